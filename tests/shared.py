"""Helpers that test modules in different folders share (``tests/`` is on ``sys.path`` beside
``conftest``): a tokenizer trained here, a command's error lines, a crafted checkpoint, the
Shakespeare corpus and tasks made from it, a text_stream run's config, launchers/remote.sh's environment
and a small run's flags, the watchdog's test double, checkpoint folder listings, an optimizer plugin
built as a run builds it."""

from __future__ import annotations

import datetime
import json
import os
import pickle
import random
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import REPO, env, flat_checkpoint, read_metrics, write_tiny_config

from core.checkpoint.folders import manifest_files
from core.runtime.marks import Marks
from core.runtime.peers import PeerView
from core.runtime.watchdog import Watchdog

SHAKESPEARE = REPO / "plugins" / "data" / "corpus" / "shakespeare"


def bpe(folder: Path) -> Path:
    """A 300-token byte-level BPE trained here (no download), saved as ``folder/tokenizer.json``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    docs = ["to be or not to be, that is the question. " * 4, "whether tis nobler in the mind to suffer"] * 20
    tok.train_from_iterator(docs, trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    folder.mkdir(parents=True)
    tok.save(str(folder / "tokenizer.json"))
    return folder / "tokenizer.json"


def error_lines(proc) -> list[str]:
    return [line for line in proc.stderr.splitlines() if line.startswith("plait: error: ")]


class RunsAShellCommand:
    """Pickles to a call of os.system: what a crafted checkpoint would carry."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def recommit(folder: Path) -> None:
    """Rewrite COMMITTED to match the files as they are now (a buggy writer, or an attacker)."""
    manifest = json.loads((folder / "COMMITTED").read_text())
    manifest.update(manifest_files(folder, exclude="COMMITTED", known={}))
    (folder / "COMMITTED").write_text(json.dumps(manifest))


def craft_metadata(folder: Path, marker: Path) -> None:
    (folder / ".metadata").write_bytes(pickle.dumps(RunsAShellCommand(marker)))
    recommit(folder)


# -- commands in this process (tests/unit/cli, tests/e2e) ------------------------------------


def one_line_error(proc, *names: str) -> str:
    """The single stderr line of a refused command; it names every one of ``names``."""
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith("plait: error: "), proc.stderr[-2000:]
    for name in names:
        assert name in lines[0], lines[0]
    return lines[0]


def generate_error_line(capsys, *args):
    """``core.generate``'s ``main(args)`` in this process: exit 2 and one ``plait: error:`` line, which it returns."""
    from core.cli.generate import main

    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(list(map(str, args)))
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("plait: error: ") and err.count("\n") == 1, err
    return err


def plan_json(capsys, *args: str) -> dict:
    """``core.plan``'s ``main(args + --json)`` in this process: it succeeds; its JSON."""
    from core.cli.plan import main

    assert main([*args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def plan_text(capsys, *args: str) -> str:
    """``core.plan``'s ``main(args)`` in this process: it succeeds; what it printed."""
    from core.cli.plan import main

    assert main(list(args)) == 0
    return capsys.readouterr().out


# -- launchers/remote.sh -----------------------------------------------------------------------


def remote_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """The environment of ``launchers/remote.sh`` for a 2-rank job with its output in ``tmp_path/out`` (1 s backoff), and ``extra``."""
    e = env(**{"PYTHON": sys.executable, "OUTPUT_DIR": str(tmp_path / "out"), "NPROC": "2", "BACKOFF_S": "1", **extra})
    e["PATH"] = str(Path(sys.executable).parent) + os.pathsep + e["PATH"]
    return e


def small_args(steps: int) -> list[str]:
    """Flags that make base.toml's run small: ``steps`` steps of a dim-64 model, logged each step (console, jsonl)."""
    return [
        "--train.steps=%d" % steps,
        "--model.dim=64",
        "--data.seq_len=128",
        "--train.global_batch_tokens=1024",
        "--train.micro_batch=2",
        "--train.log_every=1",
        '--monitors.enabled=["console", "jsonl"]',
    ]


# -- data --------------------------------------------------------------------------------------


def write(path, ids, dtype="uint16"):
    path.parent.mkdir(parents=True, exist_ok=True)
    np.asarray(ids, dtype=dtype).tofile(path)


def one_document(folder: Path) -> Path:
    """``folder/docs.jsonl`` holding one short document."""
    path = folder / "docs.jsonl"
    path.write_text(json.dumps({"text": "hello world"}) + "\n")
    return path


def varied_documents(folder: Path, count: int = 200) -> Path:
    """``folder/docs.jsonl``: ``count`` documents of 1 to 7 repeats of a phrase, so their lengths differ."""
    path = folder / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": f"document {i}: " + "lorem ipsum " * (i % 7 + 1)}) + "\n" for i in range(count)))
    return path


def stream_docs(folder: Path) -> Path:
    """``folder/docs.jsonl``: 200 documents of the same length."""
    path = folder / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": f"document {i}: " + "lorem ipsum " * 9}) + "\n" for i in range(200)))
    return path


def text_stream_config(path: Path, files: Path, *, train: dict, data: dict, monitors: list[str], **tables: dict) -> Path:
    """``path``: a run over ``train_configs/base.toml`` of the debug llama3 (dim 64) on CPU, micro_batch 2,
    reading ``files`` through text_stream. ``train`` and ``data`` add their tables' other keys, ``monitors``
    is ``[monitors] enabled``, ``tables`` whole further tables (``parallelism={"name": "fsdp2", "tp": 2}``)."""

    def table(name: str, keys: dict) -> str:
        return f"[{name}]\n" + "".join(f"{k} = {json.dumps(str(v) if isinstance(v, Path) else v)}\n" for k, v in keys.items())

    sections = {
        "train": {"micro_batch": 2, "device": "cpu", **train},
        "model": {"name": "llama3", "flavor": "debug", "dim": 64},
        "data": {"name": "text_stream", "files": [str(files)], **data},
        **tables,
        "monitors": {"enabled": monitors},
    }
    path.write_text(f"extends = {json.dumps(str(REPO / 'train_configs' / 'base.toml'))}\n" + "".join(table(n, keys) for n, keys in sections.items()))
    return path


def token_bin_source(folder, **opts):
    """The token_bin data source over ``folder``, built from its options as a run builds it."""
    from plugins.data.token_bin import TokenBin, TokenBinOptions

    return TokenBin(TokenBinOptions(path=str(folder), **opts))


def shakespeare_text(chars: int = 200_000) -> str:
    val = np.fromfile(SHAKESPEARE / "val.bin", dtype=np.uint16)[:chars]
    return bytes(int(t) for t in val if t < 256).decode("utf-8", "replace")


def shuffles(gold: str, rng: random.Random) -> list[str]:
    """Three distinct orderings of ``gold``'s characters other than ``gold`` (same characters: only order tells), or []."""
    found: set[str] = set()
    for _ in range(50):
        chars = list(gold)
        rng.shuffle(chars)
        if "".join(chars) != gold:
            found.add("".join(chars))
        if len(found) == 3:
            return sorted(found)
    return []


def write_task(path: Path, n: int, real_distractors: bool, seed: int = 0) -> Path:
    """Contexts of Shakespeare's text; the gold continuation is the 8 characters that follow. Distractors
    are the gold's characters shuffled (learnable: a model of English orders them; an untrained model
    has nothing to tell them apart by) or text from elsewhere (harder)."""
    text, rng = shakespeare_text(), random.Random(seed)
    written = 0
    with path.open("w") as f:
        while written < n:
            s = rng.randrange(0, len(text) - 100)
            gold = text[s + 48 : s + 56]
            others = [text[(o := rng.randrange(0, len(text) - 10)) : o + 8] for _ in range(3)] if real_distractors else shuffles(gold, rng)
            if not others:
                continue
            g = rng.randrange(4)
            others.insert(g, gold)
            f.write(json.dumps({"context": text[s : s + 48], "continuations": others, "gold": g}) + "\n")
            written += 1
    return path


def prepared_project(proj: Path, monkeypatch) -> Path:
    """``proj/tok/tokenizer.json`` (a BPE), ``proj/data`` prepared with it as ``hf:tok/tokenizer.json`` (relative:
    meta.json records it so), ``proj/run.toml`` training on it with its output in ``proj/out``."""
    from plugins.data.prepare import main as prepare

    tok = bpe(proj / "tok")
    text = bytes(np.fromfile(SHAKESPEARE / "val.bin", dtype=np.uint16)[:60_000].astype(np.uint8)).decode("utf-8", "replace")
    (proj / "corpus.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in text.split("\n\n") if d.strip()))
    monkeypatch.chdir(proj)
    assert prepare(["--input", "corpus.jsonl", "--out", "data", "--tokenizer", "hf:tok/tokenizer.json", "--workers", "1", "--val-fraction", "0.1"]) == 0
    cfg = write_tiny_config(proj, steps=3, global_batch_tokens=512)
    cfg.write_text(cfg.read_text().replace(str(SHAKESPEARE), str(proj / "data")))
    return tok


# -- checkpoints and run folders ---------------------------------------------------------------


def committed(root: Path) -> list[str]:
    """The names of the committed checkpoint folders directly under ``root``."""
    return sorted(p.name for p in root.glob("step_*") if (p / "COMMITTED").is_file())


def losses(out: Path) -> dict[int, float]:
    """The training loss of each logged step of the run in ``out``."""
    return {r["step"]: r["loss"] for r in read_metrics(out)}


def nbytes(x) -> int:
    """The bytes of the tensors in ``x``, a tensor or nested dicts of them."""
    if isinstance(x, dict):
        return sum(nbytes(v) for v in x.values())
    return x.numel() * x.element_size() if isinstance(x, torch.Tensor) else 0


def trainer_for(cfg: Path, *overrides: str):
    """plait's Trainer for ``cfg`` on one CPU process, built (model, optimizer, data, checkpointer), not run."""
    from core.contract.protocols import DistInfo
    from core.loop.trainer import Trainer
    from core.preflight.prepare import prepare

    t = Trainer(prepare(str(cfg), list(overrides)), DistInfo(device=torch.device("cpu")))
    t.build()
    return t


def ckpt_dirs(out: Path) -> list[str]:
    return sorted(p.name for p in (out / "checkpoints").glob("step_*"))


def committed_steps(out: Path) -> list[str]:
    return sorted(p.name for p in (out / "checkpoints").glob("step_*") if (p / "COMMITTED").exists())


def nonfinite_tensors(path: Path) -> int:
    """NaN/inf tensors in a DCP checkpoint, read with DCP's own single-process loader."""
    flat = flat_checkpoint(path)

    def walk(x):
        if isinstance(x, torch.Tensor):
            yield x
        elif isinstance(x, dict):
            for v in x.values():
                yield from walk(v)

    return sum(int(not torch.isfinite(t).all()) for t in walk(flat) if t.is_floating_point())


# What another host's job writes in plait.lock when it takes a folder whose holder stopped renewing.
THEIRS = {"pid": 4242, "host": "node-b", "since": "2026-11-26T00:00:00Z", "command": "core.train", "lease_s": 10.0, "renewals": 0}


# -- the budget guard --------------------------------------------------------------------------


def budget_file(path, spent, projected, age_s=0.0, clock=1_800_000_000.0):
    stamp = datetime.datetime.fromtimestamp(clock - age_s, datetime.timezone.utc).isoformat()
    path.write_text(json.dumps({"spent_usd": spent, "rate_usd_per_hr": 1.5, "hours_elapsed": 3.0, "projected_total_usd": projected, "last_update_utc": stamp}))
    return path


# -- the stall watchdog ------------------------------------------------------------------------

TIMEOUT_S = 1.0  # what a test asserts does not happen waits a few of these: room for a loaded machine's scheduling
ENDS_WITHIN_S = 60.0  # the wait for an end that must come: it returns once the end comes, long only on a loaded machine


class Ending:
    """What a watchdog did at its end: the exit code, and the exit_status.json it asked for."""

    def __init__(self) -> None:
        self.codes: list[int] = []
        self.statuses: list[tuple] = []
        self.done = threading.Event()

    def write_status(self, code: int, reason: str, step: int, detail: str) -> None:
        self.statuses.append((code, reason, step, detail))

    def exit(self, code: int) -> None:
        self.codes.append(code)
        self.done.set()


def steady_marks() -> Marks:
    """Marks of a rank that has completed a step: the plain timeout applies."""
    marks = Marks()
    marks.progress("reading the data of step 1", 0)
    marks.progress("after step 1", 1)
    return marks


def watch(marks: Marks, rank: int = 0, view: PeerView | None = None, timeout_s: float = TIMEOUT_S) -> tuple[Watchdog, Ending]:
    ending = Ending()
    dog = Watchdog(marks, timeout_s, ending.write_status, rank, view, end=ending.exit, grace_s=0.1)
    dog.start()
    return dog, ending


def build_optimizer(name: str, values: dict, model: torch.nn.Module) -> torch.optim.Optimizer:
    """Optimizer plugin ``name`` as a run builds it: through the registry, its options from ``values``
    (a TOML table), over the core's parameter groups of ``model``."""
    from core.config import registry
    from core.contract.option_values import build_options
    from core.contract.param_groups import param_groups

    component = registry.load().get("optimizer", name, "test")
    opts = build_options(component.options, values, f"[optimizer] {name}")
    return component.factory(opts).build(param_groups(model, opts))


def plan_error(capsys, *args: str) -> str:
    """``python -m core.plan`` in this process: exit code 2 and one ``plait: error:`` line. Input that
    makes a plan impossible prints nothing else; a missing or unusable data file or checkpoint is
    listed under the whole plan, which is printed."""
    from core.cli import plan

    capsys.readouterr()
    try:
        code = plan.main(list(args))
    except SystemExit as exc:
        code = exc.code
    out = capsys.readouterr()
    assert code == 2, out
    lines = [l for l in out.err.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("plait: error: "), out.err
    if out.out:  # the plan, and the problem under it
        assert out.out.startswith("plan for ") and "  parameters  " in out.out, out.out
        assert "  problems    " + lines[0].removeprefix("plait: error: ") in out.out, out.out
    return lines[0]
