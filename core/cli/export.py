"""``python -m core.export --checkpoint DIR --format safetensors|hf --out DIR [--dtype bf16]``

Writes a committed plait checkpoint's model weights as plait's own
safetensors file (plait names, tied weights once, the model section in the
metadata) or in Hugging Face's Llama layout (``config.json`` plus safetensors
shards) that ``transformers.AutoModelForCausalLM.from_pretrained`` loads.
Both carry ``plait.json`` (the model section and the tokenizer the data was
prepared with, its file copied next to the weights) for ``core.generate``;
the Hugging Face layout also carries ``generation_config.json`` (EOS, and the
padded vocabulary's ids suppressed) and, for an ``hf:`` or the ``bytes``
tokenizer, ``tokenizer.json`` (for bytes a byte-level one: id = UTF-8 byte,
EOS 256) with a minimal ``tokenizer_config.json``, so ``transformers`` and
lm-evaluation-harness's ``hf`` model can use it. Needs no process group and no GPU.
"""

from __future__ import annotations

import importlib.util
import json
import math
import shutil
import sys
from pathlib import Path
from typing import Any

from core.contract import log
from core.contract.errors import ArgumentParser, CheckpointError, ConfigError, PlaitError, exit_bad_input
from core.contract.members import member

PLAIT_FILE = "plait.json"
GENERATION_CONFIG = "generation_config.json"


def refuse_inside_checkpoint(out: Path, flag: str) -> None:
    """An export or report written into a checkpoint folder is deleted with it when the run prunes it
    (or sets it aside with its branch): refused, before anything is read or written."""
    from core.checkpoint import checkpoint_holding

    if (ckpt := checkpoint_holding(out)) is not None:
        raise ConfigError(f"{flag} {out} lies in the checkpoint folder {ckpt}, which pruning deletes whole, with whatever else it holds; write it elsewhere")


def find_tokenizer(spec_arg: str | None, eos_arg: int | None, checkpoint: Path, config: dict[str, Any]):
    """The Codec of ``--tokenizer`` or of the one checkpoint ``checkpoint`` records (its data source's
    declared ``tokenizer()``, or what its ``[data]`` section names); None (said in one line) when none
    is recorded or the recorded one cannot be read: the weights export anyway."""
    from core.cli.text_codec import Codec, TokenizerRecord, check_against_recorded, recorded_tokenizer, resolve

    if spec_arg is not None:  # asked for explicitly: a bad one is an error
        given = TokenizerRecord(resolve(spec_arg, [Path.cwd()], "--tokenizer"), eos_arg, "--tokenizer")
        check_against_recorded(given, checkpoint)
        return Codec(given)
    try:
        record = recorded_tokenizer(checkpoint, config, f"checkpoint {checkpoint}")
        codec = Codec(record) if record is not None else None
    except PlaitError as e:
        log.warn(f"no tokenizer exported: {e}")
        return None
    if codec is None:
        log.warn("no tokenizer exported: the checkpoint records none, nor does its data section (pass --tokenizer SPEC)")
    return codec


BYTES_EOS_TEXT = "<|endoftext|>"  # the bytes tokenizer's EOS (id 256) in its Hugging Face form


def byte_to_unicode() -> dict[int, str]:
    """The printable character standing for each byte in a byte-level BPE vocabulary (GPT-2's table,
    the one ``tokenizers.pre_tokenizers.ByteLevel`` maps bytes to)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1), *range(ord("\u00ae"), ord("\u00ff") + 1)]
    rest = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + n) for n, b in enumerate(rest)}}


def write_bytes_tokenizer(path: Path) -> Path:
    """The bytes tokenizer as a Hugging Face ``tokenizer.json``: id = UTF-8 byte (a BPE of no merges over
    the 256 byte characters), EOS ``<|endoftext|>`` = 256, decoding back to the text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.BPE(vocab={c: b for b, c in byte_to_unicode().items()}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([BYTES_EOS_TEXT])
    tok.save(str(path))
    return path


def write_tokenizer_config(out: Path, eos: str | None, max_seq_len: int | None) -> Path:
    """A minimal ``tokenizer_config.json`` for ``transformers.AutoTokenizer``: no BOS, EOS and pad ``eos``."""
    tok_config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": eos,
        "pad_token": eos,
        "clean_up_tokenization_spaces": False,
    }
    if max_seq_len is not None:  # optional for a model spec (core/contract/members.py)
        tok_config["model_max_length"] = max_seq_len
    return write_json(out / "tokenizer_config.json", tok_config)


def write_tokenizer_files(codec: Any, out: Path, fmt: str, max_seq_len: int | None) -> tuple[list[Path], str | None]:
    """Copy the tokenizer's file into ``out`` (plus tokenizer_config.json for hf); return (paths, spec relative to out).
    The bytes tokenizer is written for hf only, as a byte-level ``tokenizer.json`` (its spec stays ``bytes``)."""
    if codec is None:
        return [], None
    kind = codec.record.kind
    if kind == "bytes":
        if fmt != "hf":
            return [], "bytes"
        if importlib.util.find_spec("tokenizers") is None:
            log.info("tokenizer 'bytes': no tokenizer.json written (it needs the package tokenizers, extra 'hf'); core.generate reads it from plait.json")
            return [], "bytes"
        return [write_bytes_tokenizer(out / "tokenizer.json"), write_tokenizer_config(out, BYTES_EOS_TEXT, max_seq_len)], "bytes"
    name = "tokenizer.json" if kind == "hf" else "tokenizer.tiktoken"
    shutil.copyfile(codec.record.file, out / name)
    paths = [out / name]
    if fmt == "hf" and kind == "hf":
        paths.append(write_tokenizer_config(out, codec.token_text(codec.eos_id), max_seq_len))
    elif fmt == "hf":
        log.info(f"tokenizer {codec.record.spec} has no Hugging Face form: copied as {name} for core.generate only")
    return paths, f"{kind}:{name}"


def generation_config(codec: Any, model_vocab: int) -> dict[str, Any]:
    """transformers' generation defaults: stop at EOS, pad with it, never produce the ids
    past the tokenizer's vocabulary (a padded embedding), as core.generate does."""
    config: dict[str, Any] = {"eos_token_id": codec.eos_id, "pad_token_id": codec.eos_id}
    if codec.vocab_size < model_vocab:
        config["suppress_tokens"] = list(range(codec.vocab_size, model_vocab))
    return config


def write_json(path: Path, data: dict[str, Any]) -> Path:
    path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    return path


def parser() -> ArgumentParser:
    """The command's flags (docs' flag tables are generated from it: core.cli.doc_tables)."""
    from core.weights import DTYPES

    p = ArgumentParser(prog="python -m core.export", description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", required=True, type=Path, help="a committed checkpoint folder (step_XXXXXXXXX)")
    p.add_argument("--format", required=True, choices=["safetensors", "hf"], help="plait's tensor names, or Hugging Face's Llama layout")
    p.add_argument("--out", required=True, type=Path, help="folder to write (not inside a checkpoint folder)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="cast floating tensors (default: as saved, fp32)")
    p.add_argument("--shard-gb", type=float, default=5.0, help="hf: largest shard in GB (default: %(default)s)")
    p.add_argument("--tokenizer", default=None, help="bytes | hf:PATH/tokenizer.json | tiktoken:PATH (default: the one the data was prepared with)")
    p.add_argument("--eos-id", type=int, default=None, help="EOS id for --tokenizer (default: the tokenizer's)")
    return p


def main(argv: list[str] | None = None) -> int:
    from core.weights import DTYPES

    p = parser()
    args = p.parse_args(argv)
    if not (math.isfinite(args.shard_gb) and args.shard_gb > 0):
        p.error(f"argument --shard-gb: expected a finite number > 0, got {args.shard_gb}")
    if args.eos_id is not None and args.tokenizer is None:  # an --eos-id nothing would use: refused, not ignored
        p.error(f"argument --eos-id: {args.eos_id} is the EOS of --tokenizer, and no --tokenizer is given (the recorded tokenizer keeps its EOS)")
    try:
        from core.cli.staged_output import staged
        from core.runtime.made_folders import probe_folder
        from core.weights import checkpoint_model, save_hf, save_safetensors

        refuse_inside_checkpoint(args.out, "--out")
        probe_folder(args.out, "--out", keep=False)  # a file there, or no permission: refused before loading
        spec, config, model = checkpoint_model(args.checkpoint)
        codec = find_tokenizer(args.tokenizer, args.eos_id, args.checkpoint, config)
        sd = model.state_dict()
        dtype = DTYPES[args.dtype] if args.dtype else None
        if args.format == "hf":
            lacking = [m for m in ("to_hf_state_dict", "hf_config") if member("model", spec, m) is None]
            if lacking:  # optional members of the model spec (core/contract/members.py); hf export needs both
                raise CheckpointError(
                    f"model {config['model']['name']!r} does not support hf export: its spec lacks {' and '.join(lacking)} (core/contract/members.py); use --format safetensors"
                )
        with staged(args.out, "export") as out:  # every file whole, or none (a full disk: one line, exit 74)
            if args.format == "safetensors":
                paths = [save_safetensors(sd, out, config["model"], dtype)]
            else:
                ids = {"bos_token_id": None, "eos_token_id": codec.eos_id} if codec is not None else None
                paths = save_hf(spec, sd, out, dtype, int(args.shard_gb * 1e9), extra_config=ids)
                if codec is not None:
                    paths.append(write_json(out / GENERATION_CONFIG, generation_config(codec, spec.vocab_size)))
            tok_paths, tok_spec = write_tokenizer_files(codec, out, args.format, member("model", spec, "max_seq_len"))
            paths += tok_paths
            record = {"model": config["model"], "tokenizer": tok_spec, "eos_id": codec.eos_id if codec is not None else None}
            paths.append(write_json(out / PLAIT_FILE, record))
            names = sorted(p.name for p in out.iterdir())  # every file: config.json too, which the writers above add
        paths = [args.out / name for name in names]
    except PlaitError as e:
        exit_bad_input(e)
    for path in paths:
        log.info(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
