"""``python -m core.generate --checkpoint DIR --prompt TEXT [--max-new-tokens N --temperature T --top-k K --seed S --device cpu|cuda]``

Samples text from a plait checkpoint folder, a plait safetensors export or a
Hugging Face export made by ``core.export``, with the tokenizer the training
data was prepared with (the one the data source declared, recorded in the
checkpoint's ``state.json``; else found through its resolved config: the
data section's ``path`` -> its ``meta.json``; in an export, its
``plait.json``); ``--tokenizer SPEC`` overrides it. Greedy at temperature 0,
else top-k sampling from a seeded generator. Generation stops after
``--max-new-tokens`` or at the tokenizer's EOS. No KV cache: every step runs
the model over the whole context, cropped to the model's ``max_seq_len``.
Checkpoints are read through the safe reader; nothing in them runs.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from core.cli.export import PLAIT_FILE  # next to exported weights: the model section and the tokenizer
from core.cli.text_codec import Codec, TokenizerRecord, check_against_recorded, recorded_tokenizer, resolve
from core.contract.errors import ArgumentParser, CheckpointError, ConfigError, DataError, PlaitError, exit_bad_input
from core.contract.members import member


@dataclass
class Loaded:
    spec: Any
    model: torch.nn.Module
    tokenizer: TokenizerRecord | None
    where: str


def export_record(path: Path) -> dict[str, Any]:
    """The ``plait.json`` of an export folder (or next to an export file), or {}."""
    from core.cli.text_codec import read_json

    folder = path if path.is_dir() else path.parent
    file = folder / PLAIT_FILE
    return read_json(file) if file.is_file() else {}


def _export_tokenizer(record: dict[str, Any], folder: Path) -> TokenizerRecord | None:
    spec = record.get("tokenizer")
    if not isinstance(spec, str) or not spec:
        return None
    where = str(folder / PLAIT_FILE)
    eos = record.get("eos_id")
    return TokenizerRecord(resolve(spec, [folder], where), eos if isinstance(eos, int) and not isinstance(eos, bool) else None, where)


def load(path: Path) -> Loaded:
    """The model (eval mode, on CPU) and the recorded tokenizer of whatever ``core.weights`` can read at ``path``."""
    from core.weights import SAFETENSORS_FILE, checkpoint_model, copy_into, empty_model, load_weights, spec_from_config, weights_kind

    if not path.exists():
        raise CheckpointError(f"checkpoint {path} does not exist")
    kind = weights_kind(path)
    if kind == "dcp":
        spec, config, model = checkpoint_model(path)
        tokenizer = recorded_tokenizer(path, config, f"checkpoint {path}")
    else:
        record = export_record(path)
        folder = path if path.is_dir() else path.parent
        section = record.get("model")
        if section is None and kind == "safetensors":
            from safetensors import SafetensorError
            from safetensors.torch import safe_open

            file = path if path.is_file() else path / SAFETENSORS_FILE
            try:
                with safe_open(str(file), framework="pt") as f:
                    section = json.loads((f.metadata() or {}).get("plait", "{}")).get("model")
            except (SafetensorError, OSError, json.JSONDecodeError) as e:
                raise CheckpointError(f"{file}: not a readable plait safetensors export ({e})") from None
        if not isinstance(section, dict):
            raise CheckpointError(f"{path}: no plait model section (a {PLAIT_FILE} written by core.export); cannot tell which model these weights belong to")
        spec = spec_from_config({"model": section}, f"export {path}")
        model = empty_model(spec)
        copy_into(model, load_weights(path, spec, model))
        tokenizer = _export_tokenizer(record, folder)
    model.eval()
    return Loaded(spec, model, tokenizer, str(path))


@torch.no_grad()
def generate(
    model: torch.nn.Module,
    ids: list[int],
    max_new_tokens: int,
    *,
    max_seq_len: int | None,
    temperature: float = 0.0,
    top_k: int = 0,
    seed: int = 0,
    eos_id: int | None = None,
    vocab_limit: int | None = None,
    device: torch.device | str = "cpu",
) -> list[int]:
    """The new token ids after ``ids``: greedy when ``temperature`` is 0, else sampled from the
    ``top_k`` most likely (0: all) at ``temperature`` with a generator seeded by ``seed``.
    Stops at ``eos_id`` (included) or after ``max_new_tokens``. Ids at or above ``vocab_limit``
    (the tokenizer's size, when the model's vocabulary is padded) are never produced. The model is
    called on the last ``max_seq_len`` tokens (None: a spec without ``max_seq_len``, all of them) at
    every step (full recompute, no cache)."""
    if not ids:
        raise ValueError("generate needs at least one token of context")
    device = torch.device(device)
    context = torch.tensor([ids], dtype=torch.long, device=device)
    generator = torch.Generator(device=device).manual_seed(seed) if temperature > 0 else None
    out: list[int] = []
    for _ in range(max_new_tokens):
        logits = model(context if max_seq_len is None else context[:, -max_seq_len:])[0, -1].float()
        if vocab_limit is not None and vocab_limit < logits.numel():
            logits[vocab_limit:] = -math.inf
        if temperature == 0:
            nxt = int(torch.argmax(logits))
        else:
            logits = logits / temperature
            if 0 < top_k < logits.numel():
                kth = torch.topk(logits, top_k).values[-1]
                logits = logits.masked_fill(logits < kth, -math.inf)
            probs = torch.softmax(logits, dim=-1)
            nxt = int(torch.multinomial(probs, 1, generator=generator))
        out.append(nxt)
        if nxt == eos_id:
            break
        context = torch.cat([context, torch.tensor([[nxt]], dtype=torch.long, device=device)], dim=1)
    return out


def pick_device(name: str | None) -> torch.device:
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: no CUDA device is available (use --device cpu)")
    return torch.device(name)


def check_numbers(args: Any) -> None:
    if args.max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if not math.isfinite(args.temperature) or args.temperature < 0:
        raise ConfigError(f"--temperature must be a finite number >= 0 (0: greedy), got {args.temperature}")
    if args.top_k < 0:
        raise ConfigError(f"--top-k must be >= 0 (0: the whole vocabulary), got {args.top_k}")
    if not -(2**63) <= args.seed < 2**64:  # torch.Generator.manual_seed's range: beyond it, a traceback
        raise ConfigError(f"--seed must be an integer from -2**63 to 2**64 - 1, got {args.seed}")
    if args.eos_id is not None and args.tokenizer is None:  # an --eos-id nothing would use: refused, not ignored
        raise ConfigError(f"--eos-id {args.eos_id} is the EOS of --tokenizer, and no --tokenizer is given (the recorded tokenizer keeps its EOS)")


def prompt_ids(codec: Codec, prompt: str, model_vocab: int) -> list[int]:
    """The prompt's ids; an empty prompt is the EOS token (a document starts after one)."""
    if codec.vocab_size > model_vocab:
        raise DataError(f"tokenizer {codec.record.spec} has {codec.vocab_size} ids, more than the model's vocabulary {model_vocab}")
    return codec.encode(prompt) if prompt else [codec.eos_id]


def parser() -> ArgumentParser:
    """The command's flags (docs' flag tables are generated from it: core.cli.doc_tables)."""
    p = ArgumentParser(prog="python -m core.generate", description=__doc__.split("\n\n")[1].replace("\n", " "))
    p.add_argument(
        "--checkpoint",
        required=True,
        type=Path,
        help="a committed checkpoint folder, a plait safetensors export (folder or file) or a Hugging Face export folder",
    )
    p.add_argument("--prompt", default="", help="text to continue (empty: start a new document)")
    p.add_argument("--max-new-tokens", type=int, default=200, help="tokens to write at most, fewer at EOS (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.8, help="0: greedy (default: %(default)s)")
    p.add_argument("--top-k", type=int, default=50, help="sample from the K most likely tokens, 0: all (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampling generator: the same seed, the same text (default: %(default)s)")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda when available")
    p.add_argument("--tokenizer", default=None, help="bytes | hf:PATH/tokenizer.json | tiktoken:PATH (default: the one the data was prepared with)")
    p.add_argument("--eos-id", type=int, default=None, help="EOS id for --tokenizer (default: the tokenizer's)")
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    try:
        check_numbers(args)
        device = pick_device(args.device)
        if args.tokenizer is not None:
            record: TokenizerRecord | None = TokenizerRecord(resolve(args.tokenizer, [Path.cwd()], "--tokenizer"), args.eos_id, "--tokenizer")
        loaded = load(args.checkpoint)
        if args.tokenizer is None:
            record = loaded.tokenizer
        elif record is not None and args.checkpoint.is_dir():
            check_against_recorded(record, args.checkpoint)
        if record is None:
            raise DataError(f"{args.checkpoint}: no tokenizer recorded (not in state.json, nor in the data section or a meta.json); pass --tokenizer SPEC")
        codec = Codec(record)
        spec, model = loaded.spec, loaded.model.to(device)
        ids = prompt_ids(codec, args.prompt, spec.vocab_size)
        new = generate(
            model,
            ids,
            args.max_new_tokens,
            max_seq_len=member("model", spec, "max_seq_len"),
            temperature=args.temperature,
            top_k=args.top_k,
            seed=args.seed,
            eos_id=codec.eos_id,
            vocab_limit=codec.vocab_size,
            device=device,
        )
    except PlaitError as e:
        exit_bad_input(e)
    sys.stdout.write(args.prompt + codec.decode(new) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
