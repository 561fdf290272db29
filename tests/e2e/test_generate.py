"""core.generate on tiny trained checkpoints: the same greedy tokens as transformers on the Hugging Face
export (bytes and BPE), generate.md's transformers blocks run offline on the exports, seeded sampling,
one-line errors (a run folder names its newest checkpoint), and a crafted checkpoint or tokenizer record
runs or reads nothing."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import REPO, env, run_here, run_module, write_tiny_config
from shared import SHAKESPEARE
from shared import generate_error_line as one_line_error

pytestmark = pytest.mark.usefixtures("one_thread")  # torch on one intra-op thread (conftest.one_thread)

PROMPT = "ROMEO: What"


def train(tmp, data_path=SHAKESPEARE):
    cfg = write_tiny_config(tmp, steps=3, global_batch_tokens=512)
    cfg.write_text(cfg.read_text().replace(str(SHAKESPEARE), str(data_path)))
    proc = run_module("core.train", "--config", str(cfg))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return tmp / "out" / "checkpoints" / "step_000000003"


@pytest.fixture(scope="module")
def bytes_ckpt(tmp_path_factory):
    """3 steps on the shipped Shakespeare corpus (its meta.json: the bytes tokenizer)."""
    return train(tmp_path_factory.mktemp("gen_bytes"))


@pytest.fixture(scope="module")
def bpe_ckpt(tmp_path_factory):
    """A 300-token byte-level BPE trained here (no download), a corpus prepared with it, 3 steps on that."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from plugins.data.prepare import main as prepare

    tmp = tmp_path_factory.mktemp("gen_bpe")
    text = bytes(np.fromfile(SHAKESPEARE / "val.bin", dtype=np.uint16)[:120_000].astype(np.uint8)).decode("utf-8", "replace")
    docs = [d for d in text.split("\n\n") if d.strip()]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(docs, trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    (tmp / "tok").mkdir()
    tok.save(str(tmp / "tok" / "tokenizer.json"))
    corpus = tmp / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    assert (
        prepare(
            [
                "--input",
                str(corpus),
                "--out",
                str(tmp / "data"),
                "--tokenizer",
                f"hf:{tmp / 'tok' / 'tokenizer.json'}",
                "--workers",
                "1",
                "--val-fraction",
                "0.1",
            ]
        )
        == 0
    )
    return train(tmp, tmp / "data")


def export(ckpt, out, fmt="hf"):
    from core.cli.export import main

    assert main(["--checkpoint", str(ckpt), "--format", fmt, "--out", str(out)]) == 0
    return out


def cli(capsys, *args):
    """``python -m core.generate`` in this process (the real command line is run in test_errors_one_line_exit_2)."""
    from core.cli.generate import main

    capsys.readouterr()  # drop what came before (export's lines)
    assert main(list(map(str, args))) == 0
    return capsys.readouterr().out


def ours_greedy(path, prompt, n):
    from core.cli.generate import generate, load
    from core.cli.text_codec import Codec

    loaded = load(path)
    codec = Codec(loaded.tokenizer)
    ids = codec.encode(prompt)
    return codec, ids, generate(loaded.model, ids, n, max_seq_len=loaded.spec.max_seq_len, eos_id=codec.eos_id, vocab_limit=codec.vocab_size)


def hf_greedy(folder, ids, n):
    transformers = pytest.importorskip("transformers", reason="transformers is a test-only dependency (extra 'dev')")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long), max_new_tokens=n, do_sample=False)
    return out[0, len(ids) :].tolist()


def test_greedy_bytes_checkpoint_matches_transformers(bytes_ckpt, tmp_path, capsys):
    text = cli(capsys, "--checkpoint", bytes_ckpt, "--prompt", PROMPT, "--max-new-tokens", 24, "--temperature", 0)
    assert text.startswith(PROMPT) and text == cli(capsys, "--checkpoint", bytes_ckpt, "--prompt", PROMPT, "--max-new-tokens", 24, "--temperature", 0)
    codec, ids, new = ours_greedy(bytes_ckpt, PROMPT, 24)
    assert codec.record.spec == "bytes" and ids == list(PROMPT.encode())
    assert text == PROMPT + codec.decode(new) + "\n"
    out = export(bytes_ckpt, tmp_path / "hf")
    printed = capsys.readouterr().out
    assert re.findall(r"wrote (\S+)", printed) == [str(p) for p in sorted(out.iterdir())]  # config.json was left out
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 256
    assert hf_greedy(out, ids, 24) == new
    # the bytes tokenizer's Hugging Face form: id = UTF-8 byte, EOS 256, no BOS
    hf_tok = pytest.importorskip("transformers").AutoTokenizer.from_pretrained(str(out))
    odd = "caf\u00e9 \u2014 \u65e5\u672c\t\n  x"
    assert hf_tok.encode(PROMPT + odd) == ids + list(odd.encode()) and hf_tok.eos_token_id == 256 and hf_tok.bos_token_id is None
    assert hf_tok.decode(new) == codec.decode(new) and hf_tok.decode(list(odd.encode())) == odd
    # the export itself generates the same text (its plait.json names the tokenizer)
    assert cli(capsys, "--checkpoint", out, "--prompt", PROMPT, "--max-new-tokens", 24, "--temperature", 0) == text


def test_the_transformers_blocks_of_generate_md_run_offline_on_the_exports(bytes_ckpt, bpe_ckpt, tmp_path, capsys):
    """docs/generate.md's Python, verbatim, in a folder holding export/hf, offline. Its one block used
    AutoTokenizer, which fails on the export of the quick start's model (the bytes tokenizer has no
    Hugging Face form): the bytes block must print what core.generate --temperature 0 prints."""
    pytest.importorskip("transformers", reason="transformers is a test-only dependency (extra 'dev')")
    blocks = re.findall(r"```python\n(.*?)```", (REPO / "docs" / "generate.md").read_text(), re.S)
    assert len(blocks) == 2 and "AutoTokenizer" in blocks[0] and ".encode()" in blocks[1]
    runs = [(tmp_path / "bpe", blocks[0]), (tmp_path / "bytes", blocks[1])]  # each in a folder holding export/hf
    for (here, _), ckpt in zip(runs, (bpe_ckpt, bytes_ckpt)):
        export(ckpt, here / "export" / "hf")
    driver = "import os, sys\nfor here, block in %r:\n    os.chdir(here)\n    exec(block, {})\n    print('<end>')\n" % [(str(h), b) for h, b in runs]
    proc = subprocess.run([sys.executable, "-c", driver], env=env(HF_HUB_OFFLINE="1"), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    bpe_text, bytes_text, _ = proc.stdout.split("<end>\n")
    assert bpe_text.startswith("ROMEO:") and bytes_text.startswith("ROMEO:")
    assert bytes_text == cli(capsys, "--checkpoint", bytes_ckpt, "--prompt", "ROMEO:", "--max-new-tokens", 50, "--temperature", 0)


def test_greedy_bpe_checkpoint_matches_transformers_with_its_tokenizer(bpe_ckpt, tmp_path, capsys):
    transformers = pytest.importorskip("transformers", reason="transformers is a test-only dependency (extra 'dev')")
    codec, ids, new = ours_greedy(bpe_ckpt, PROMPT, 16)
    assert codec.record.kind == "hf" and codec.vocab_size == 300 and len(ids) < len(PROMPT)
    out = export(bpe_ckpt, tmp_path / "hf")
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(out))
    assert hf_tok.encode(PROMPT, add_special_tokens=False) == ids
    assert hf_tok.eos_token_id == codec.eos_id
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["suppress_tokens"] == list(range(300, 512))  # the padded ids of the 512-entry embedding
    theirs = hf_greedy(out, ids, 16)
    assert theirs == new
    assert hf_tok.decode(theirs) == codec.decode(new)
    text = cli(capsys, "--checkpoint", bpe_ckpt, "--prompt", PROMPT, "--max-new-tokens", 16, "--temperature", 0)
    assert text == PROMPT + codec.decode(new) + "\n"
    # the export folder alone is enough: its copied tokenizer.json, found through plait.json
    moved = shutil.copytree(out, tmp_path / "moved")
    assert cli(capsys, "--checkpoint", moved, "--prompt", PROMPT, "--max-new-tokens", 16, "--temperature", 0) == text


def test_sampling_is_seeded(bytes_ckpt, tmp_path, capsys):
    from core.cli.generate import generate, load

    def sample(seed, path=bytes_ckpt):
        return cli(capsys, "--checkpoint", path, "--prompt", PROMPT, "--max-new-tokens", 40, "--temperature", 1.0, "--top-k", 20, "--seed", seed)

    assert sample(1) == sample(1)
    assert sample(1) != sample(2)
    st = export(bytes_ckpt, tmp_path / "st", "safetensors")
    assert sample(1, st / "model.safetensors") == sample(1)  # the same weights from plait's safetensors export
    loaded = load(bytes_ckpt)
    ids = list(PROMPT.encode())
    kw = dict(max_seq_len=loaded.spec.max_seq_len, vocab_limit=257)
    greedy = generate(loaded.model, ids, 12, **kw)
    assert generate(loaded.model, ids, 12, temperature=1.5, top_k=1, seed=5, **kw) == greedy  # top-1 is greedy


def test_errors_one_line_exit_2(bytes_ckpt, tmp_path, capsys):
    proc = run_module("core.generate", "--checkpoint", str(tmp_path / "missing"), "--prompt", "x")
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [f"plait: error: checkpoint {tmp_path / 'missing'} does not exist"]
    assert "--max-new-tokens must be >= 1" in one_line_error(capsys, "--checkpoint", bytes_ckpt, "--max-new-tokens", 0)
    assert "--temperature must be a finite" in one_line_error(capsys, "--checkpoint", bytes_ckpt, "--temperature", "nan")
    assert "--top-k must be >= 0" in one_line_error(capsys, "--checkpoint", bytes_ckpt, "--top-k", -3)
    assert "invalid int value" in one_line_error(capsys, "--checkpoint", bytes_ckpt, "--seed", "x")
    assert "not found" in one_line_error(capsys, "--checkpoint", bytes_ckpt, "--tokenizer", f"hf:{tmp_path / 'none.json'}")
    assert "expected bytes, hf:PATH" in one_line_error(capsys, "--checkpoint", bytes_ckpt, "--tokenizer", "gpt2")
    if not torch.cuda.is_available():
        assert "no CUDA device" in one_line_error(capsys, "--checkpoint", bytes_ckpt, "--device", "cuda")
    # an export whose plait.json records no tokenizer
    st = export(bytes_ckpt, tmp_path / "st", "safetensors")
    record = json.loads((st / "plait.json").read_text())
    (st / "plait.json").write_text(json.dumps(dict(record, tokenizer=None)))
    assert "no tokenizer recorded" in one_line_error(capsys, "--checkpoint", st, "--prompt", "x")
    # not weights at all
    (tmp_path / "empty").mkdir()
    assert "not a committed plait checkpoint" in one_line_error(capsys, "--checkpoint", tmp_path / "empty")


def test_a_run_folder_or_its_checkpoints_folder_is_refused_naming_its_newest_checkpoint(bytes_ckpt, tmp_path, capsys):
    """After a run the folder at hand is runs/x (or runs/x/checkpoints), not its step folder. Given
    there, generate said "not a committed plait checkpoint ...", and export, a resume or an initial
    load "checkpoint ... is incomplete: no COMMITTED marker (interrupted save?)": a damaged
    checkpoint, it seemed. The one line now says what the folder is and names its newest checkpoint."""
    from core.cli import plan

    ckpts = bytes_ckpt.parent
    config = write_tiny_config(tmp_path, steps=3, global_batch_tokens=512)
    for folder, what in ((ckpts.parent, "a run's output folder"), (ckpts, "a folder of checkpoints")):
        expected = f"{folder} is {what}, not a checkpoint: give one checkpoint folder, e.g. its newest, {bytes_ckpt}\n"
        assert one_line_error(capsys, "--checkpoint", folder).endswith(expected)
        proc = run_here("core.export", "--checkpoint", str(folder), "--format", "hf", "--out", str(tmp_path / "hf"))
        assert proc.returncode == 2 and proc.stderr == f"plait: error: {expected}" and not (tmp_path / "hf").exists()
        for key in ("resume", "initial_load"):  # the plan is printed, the problem listed under it, exit 2
            code = plan.main(["--config", str(config), f"--checkpoint.{key}={folder}"])
            said = capsys.readouterr()
            assert code == 2 and said.err == f"plait: error: [checkpoint].{key}: {expected}", said.err
            assert f"[checkpoint].{key}: {expected}".strip() in said.out


def test_crafted_checkpoint_runs_nothing(bytes_ckpt, tmp_path, capsys):
    from shared import craft_metadata

    ckpt = shutil.copytree(bytes_ckpt, tmp_path / "step_000000003")
    marker = tmp_path / "pwned"
    craft_metadata(ckpt, marker)
    assert f"{ckpt / '.metadata'} refers to posix.system" in one_line_error(capsys, "--checkpoint", ckpt, "--prompt", "x")
    assert not marker.exists()


def with_tokenizer_record(ckpt, dest, record):
    """A copy of ``ckpt`` whose state.json records ``record`` as its tokenizer, the manifest rewritten to
    match (a crafted checkpoint: CRC-32 guards against damage, not an attacker)."""
    import zlib

    ckpt = shutil.copytree(ckpt, dest)
    state = json.loads((ckpt / "state.json").read_text())
    (ckpt / "state.json").write_text(json.dumps({**state, "tokenizer": record}))
    manifest = json.loads((ckpt / "COMMITTED").read_text())
    data = (ckpt / "state.json").read_bytes()
    manifest["files"]["state.json"], manifest["checksums"]["state.json"] = len(data), f"{zlib.crc32(data):08x}"
    (ckpt / "COMMITTED").write_text(json.dumps(manifest))
    return ckpt


def test_a_tokenizer_record_naming_a_huge_file_a_pipe_or_a_device_is_one_line_never_read(bytes_ckpt, tmp_path):
    """A checkpoint's state.json records the tokenizer its data source declared (a path and its sha256).
    A record naming a file of 20 GB (a sparse file, a disk image) is not read whole into memory to take
    its sha256: a tokenizer file larger than 1 GiB is refused before it is read:
    generate is one line, exit 2, and export writes the weights without a tokenizer, said in one line.
    A pipe, /dev/zero and a link to it are refused too (not files)."""
    import os

    huge = tmp_path / "huge.tiktoken"
    with huge.open("wb") as f:
        f.truncate(20 * 2**30)  # sparse: no disk used
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    (tmp_path / "zero.json").symlink_to("/dev/zero")

    capped = 8 * 2**30  # without the fix the reads would take the machine's memory: MemoryError at 8 GB instead
    for i, spec in enumerate([f"tiktoken:{huge}", f"hf:{fifo}", "hf:/dev/zero", f"hf:{tmp_path / 'zero.json'}"]):
        ckpt = with_tokenizer_record(bytes_ckpt, tmp_path / f"c{i}" / "step_000000003", {"spec": spec, "eos_id": None, "fingerprint": "0" * 64})
        for tool, args in (
            ("core.generate", ["--prompt", "x", "--max-new-tokens", "1"]),
            ("core.export", ["--format", "safetensors", "--out", str(tmp_path / f"e{i}")]),
        ):
            proc = run_module(tool, "--checkpoint", str(ckpt), *args, timeout=120, address_space=capped)
            lines = [line for line in proc.stderr.splitlines() if line.startswith("plait:")]
            assert "Traceback" not in proc.stderr and "MemoryError" not in proc.stderr, (tool, spec, proc.stderr[-2000:])
            if tool == "core.generate":
                assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"plait: error: {ckpt / 'state.json'} tokenizer"), (spec, proc.stderr)
            else:
                assert proc.returncode == 0 and "no tokenizer exported" in proc.stderr, (spec, proc.stderr[-2000:])
