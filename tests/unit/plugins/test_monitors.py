"""Monitors driven through a real pluggy PluginManager with a real Run: console, jsonl, tensorboard."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from core.api import restore_not_finite
from core.config.registry import Registry, plugin_manager
from core.contract.protocols import DistInfo
from core.contract.run import Run
from plugins.monitors.console import Console, ConsoleOptions
from plugins.monitors.jsonl import Jsonl, JsonlOptions


def make_run(out: Path, step: int = 0, rank: int = 0, world_size: int = 1, total: int = 1000) -> Run:
    return Run(
        config={}, output_dir=out, dist=DistInfo(rank=rank, world_size=world_size), total_steps=total, tokens_per_step=4096, step=step, tokens_seen=step * 4096
    )


def metrics(step: int, loss: float = 2.5, **extra) -> dict:
    m = {
        "step": step,
        "loss": loss,
        "grad_norm": 0.5 + step / 1000,
        "lr": 3e-4 * step / 100,
        "tokens_seen": step * 4096,
        "tokens_per_s": 10_000.0 + step,
        "step_time_s": 0.4,
        "elapsed_s": 0.4 * step,
        "eta_s": 0.4 * (1000 - step),
    }
    m.update(extra)
    return m


def manager(*monitors):
    pm = plugin_manager()
    for i, m in enumerate(monitors):
        pm.register(m, name=f"monitor{i}")
    return pm


def drive(pm, run: Run, steps, log_every: int = 10, val_at=(), ckpt_at=(), end: str | None = "completed", loss=lambda s: 3.0 - s / 100):
    pm.hook.plait_train_start(run=run)
    for s in steps:
        run.step = s
        run.tokens_seen = s * run.tokens_per_step
        pm.hook.plait_step_end(run=run, step=s, metrics=metrics(s, loss(s)) if s % log_every == 0 else {})
        if s in val_at:
            pm.hook.plait_validation_end(run=run, step=s, metrics={"val_loss": loss(s) + 0.1, "best_val_loss": loss(s) + 0.1})
        if s in ckpt_at:
            pm.hook.plait_checkpoint_saved(run=run, step=s, path=str(run.output_dir / f"checkpoints/step_{s:09d}"))
    if end is not None:
        pm.hook.plait_train_end(run=run, reason=end)


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


# -- registration -----------------------------------------------------------------


def test_registered_with_documented_options():
    import plugins.monitors as mod

    registry = Registry()
    mod.plait_register(registry=registry)
    assert {"console", "jsonl", "tensorboard"} <= set(registry.names("monitor"))
    comp = registry.get("monitor", "jsonl", "[monitors]")
    assert isinstance(comp.factory(comp.options()), Jsonl)


# -- jsonl ------------------------------------------------------------------------


def test_jsonl_rows_and_resume_appends(tmp_path):
    out = tmp_path / "out"
    run = make_run(out, total=40)
    drive(manager(Jsonl(JsonlOptions())), run, range(1, 31), val_at=(20,), ckpt_at=(20,))
    got = rows(out / "metrics.jsonl")
    train = [r for r in got if r["kind"] == "train"]
    assert [r["step"] for r in train] == [10, 20, 30]
    for r in train:
        expected = metrics(r["step"], 3.0 - r["step"] / 100)
        assert {k: r[k] for k in expected} == pytest.approx(expected)
    assert [r["kind"] for r in got] == ["train", "train", "val", "checkpoint", "train", "end"]
    val = got[2]
    assert val["step"] == 20 and val["val_loss"] == pytest.approx(2.9)
    assert got[3] == {"kind": "checkpoint", "step": 20, "path": str(out / "checkpoints/step_000000020")}
    assert got[-1]["reason"] == "completed" and got[-1]["step"] == 30

    # resumed from the checkpoint at step 20: the earlier lines stay, a resume line and the new ones are appended
    resumed = make_run(out, step=20, total=40)
    drive(manager(Jsonl(JsonlOptions())), resumed, range(21, 41))
    again = rows(out / "metrics.jsonl")
    assert again[: len(got)] == got
    assert [(r["kind"], r["step"]) for r in again[len(got) :]] == [("resume", 20), ("train", 30), ("train", 40), ("end", 40)]
    last = {r["step"]: r["loss"] for r in again if r["kind"] == "train"}
    assert sorted(last) == [10, 20, 30, 40] and last[40] == pytest.approx(2.6)

    # a fresh run in the same folder starts the file over
    drive(manager(Jsonl(JsonlOptions())), make_run(out, total=10), range(1, 11))
    assert [(r["kind"], r["step"]) for r in rows(out / "metrics.jsonl")] == [("train", 10), ("end", 10)]


def test_jsonl_resume_after_a_cut_line_keeps_the_resume_line_whole(tmp_path):
    """A machine crash or a full disk can leave the last line cut short; the resumed run's
    ``"resume"`` line must not be glued to it (the report would lose it and splice histories)."""
    from core.cli.report import read_rows

    out = tmp_path / "out"
    drive(manager(Jsonl(JsonlOptions())), make_run(out, total=40), range(1, 31))
    path = out / "metrics.jsonl"
    text = path.read_text()
    path.write_text(text + '{"kind": "train", "step": 40, "lo')  # cut inside a row past the checkpoint
    # resumed from an older checkpoint (step 10), this run ends at 20: the old branch's 30 must go
    drive(manager(Jsonl(JsonlOptions())), make_run(out, step=10, total=20), range(11, 21), loss=lambda s: 1.0)
    lines = path.read_text().splitlines()
    assert lines[len(text.splitlines())] == '{"kind": "train", "step": 40, "lo'
    assert json.loads(lines[len(text.splitlines()) + 1])["kind"] == "resume"
    train = [(r["step"], r["loss"]) for r in read_rows(out) if r["kind"] == "train"]
    assert train == [(10, pytest.approx(2.9)), (20, 1.0)]


def test_jsonl_converts_values_and_keeps_lines_of_a_killed_run(tmp_path):
    out = tmp_path / "out"
    run = make_run(out)
    pm = manager(Jsonl(JsonlOptions(filename="m.jsonl")))
    pm.hook.plait_train_start(run=run)
    pm.hook.plait_step_end(
        run=run, step=1, metrics=metrics(1, loss=torch.tensor(2.25), grad_norm=np.float32(0.5), mem_peak_gib=np.float64(1.5), nonfinite=float("nan"))
    )
    pm.hook.plait_step_end(run=run, step=2, metrics={})  # not a log step: nothing
    pm.hook.plait_step_end(run=run, step=3, metrics=metrics(3, loss=float("inf")))
    # no train_end: the file already holds every line (a killed run keeps them)
    got = rows(out / "m.jsonl")
    assert [r["step"] for r in got] == [1, 3]
    assert got[0]["loss"] == 2.25 and type(got[0]["loss"]) is float
    assert got[0]["grad_norm"] == 0.5 and got[0]["mem_peak_gib"] == 1.5
    assert math.isnan(restore_not_finite(dict(got[0]))["nonfinite"]) and restore_not_finite(dict(got[1]))["loss"] == math.inf


def test_jsonl_lines_are_strict_json_and_say_which_values_were_not_finite(tmp_path):
    """NaN and infinity are written as null (JSON's NaN / Infinity are not JSON: jq and most parsers
    reject the line), named with what they were in the line's not_finite object; restore_not_finite (and so core.report) puts them back."""
    out = tmp_path / "out"
    run = make_run(out)
    pm = manager(Jsonl(JsonlOptions()))
    pm.hook.plait_train_start(run=run)
    nested = {"a": float("-inf"), "b": [1.0, float("nan")]}
    pm.hook.plait_step_end(run=run, step=1, metrics=metrics(1, loss=torch.tensor(float("nan")), grad_norm=np.float32("inf"), parts=nested))
    pm.hook.plait_validation_end(run=run, step=1, metrics={"val_loss": float("nan")})

    def strict(text: str) -> dict:  # what RFC 8259 allows: NaN, Infinity and -Infinity are not JSON
        return json.loads(text, parse_constant=lambda name: pytest.fail(f"{name} in {text}"))

    train, val = [strict(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert train["loss"] is None and train["grad_norm"] is None and train["parts"] == {"a": None, "b": [1.0, None]}
    assert train["not_finite"] == {"loss": "NaN", "grad_norm": "Infinity", "parts.a": "-Infinity", "parts.b[1]": "NaN"}
    assert train["lr"] == metrics(1)["lr"] and val["val_loss"] is None and val["not_finite"] == {"val_loss": "NaN"}
    back = restore_not_finite(train)
    assert math.isnan(back["loss"]) and back["grad_norm"] == math.inf and "not_finite" not in back


# -- console ----------------------------------------------------------------------


def test_console_lines(tmp_path, capsys):
    run = make_run(tmp_path, step=119)
    pm = manager(Console(ConsoleOptions(extra=["lm", "aux"])))
    pm.hook.plait_train_start(run=run)
    capsys.readouterr()
    pm.hook.plait_step_end(run=run, step=119, metrics={})
    assert capsys.readouterr().out == ""
    m = {
        "step": 120,
        "loss": torch.tensor(2.34564),
        "grad_norm": 0.8123,
        "lr": 3e-4,
        "tokens_per_s": 12345.2,
        "tokens_seen": 1_234_567,
        "step_time_s": 0.5,
        "elapsed_s": 62.4,
        "eta_s": 550.0,
        "lm": 2.1,
        "other": 5.0,
    }
    pm.hook.plait_step_end(run=run, step=120, metrics=m)
    line = capsys.readouterr().out
    assert line == ("step 120/1000 | loss 2.3456 | gnorm 0.812 | lr 3.00e-04 | 12,345 tok/s | tokens 1.23M | elapsed 0:01:02 | eta 0:09:10 | lm 2.1000\n")
    pm.hook.plait_validation_end(run=run, step=120, metrics={"val_loss": 2.5, "best_val_loss": 2.4})
    pm.hook.plait_checkpoint_saved(run=run, step=120, path="/ckpt/step_000000120")
    run.step = 120
    pm.hook.plait_train_end(run=run, reason="signal")
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "step 120/1000 | val_loss 2.5000 | best_val_loss 2.4000"
    assert "120" in out[1] and "/ckpt/step_000000120" in out[1]
    assert out[2].endswith("(signal)") and "step 120" in out[2]


# -- tensorboard ------------------------------------------------------------------


def scalars(logdir: Path) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def test_tensorboard_scalars(tmp_path):
    from plugins.monitors.tensorboard import TensorBoard, TensorBoardOptions

    out = tmp_path / "out"
    drive(manager(TensorBoard(TensorBoardOptions())), make_run(out, total=30), range(1, 31), val_at=(20,), ckpt_at=(20,))
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))
    got = scalars(out / "tensorboard")
    for tag in ("train/loss", "train/lr", "train/grad_norm", "train/tokens_per_s", "train/perplexity", "val/loss"):
        assert tag in got, (tag, sorted(got))
    assert "train/step" not in got
    assert got["train/loss"] == pytest.approx({10: 2.9, 20: 2.8, 30: 2.7})
    assert got["train/lr"] == pytest.approx({10: 3e-5, 20: 6e-5, 30: 9e-5})
    assert got["train/perplexity"] == pytest.approx({s: math.exp(3.0 - s / 100) for s in (10, 20, 30)}, rel=1e-6)
    assert got["val/loss"] == pytest.approx({20: 2.9})


def test_tensorboard_puts_evaluation_metrics_in_their_own_eval_section(tmp_path):
    """The downstream monitor's step metrics (``eval/<task>/acc``, ``eval/time_s``) are tagged ``eval/...``
    (TensorBoard's section is a tag's first part), not ``train/eval/...``; training metrics stay in ``train/``."""
    from plugins.monitors.tensorboard import TensorBoard, TensorBoardOptions

    out = tmp_path / "out"
    pm, run = manager(TensorBoard(TensorBoardOptions())), make_run(out, total=20)
    pm.hook.plait_train_start(run=run)
    for s in (10, 20):
        run.step = s
        pm.hook.plait_step_end(run=run, step=s, metrics={**metrics(s, 2.5), "eval/toy/acc": s / 40, "eval/toy/acc_stderr": 0.01, "eval/time_s": 1.5})
    pm.hook.plait_train_end(run=run, reason="completed")
    got = scalars(out / "tensorboard")
    assert got["eval/toy/acc"] == pytest.approx({10: 0.25, 20: 0.5})
    assert got["eval/toy/acc_stderr"] == pytest.approx({10: 0.01, 20: 0.01}) and got["eval/time_s"] == pytest.approx({10: 1.5, 20: 1.5})
    assert "train/loss" in got and not [t for t in got if "eval" in t and not t.startswith("eval/")], sorted(got)
    assert {t.split("/")[0] for t in got} == {"train", "eval"}


def test_tensorboard_resume_hides_the_steps_after_the_checkpoint(tmp_path):
    """A run logged to step 30, then resumed from its step-20 checkpoint: TensorBoard shows steps 21-30
    of the resumed run, not of the first (the resumed file's START event at step 21 purges them)."""
    import time

    from plugins.monitors.tensorboard import TensorBoard, TensorBoardOptions

    out = tmp_path / "out"
    drive(manager(TensorBoard(TensorBoardOptions())), make_run(out, total=30), range(1, 31))
    time.sleep(1.1)  # events files sort by the second they were opened in
    drive(manager(TensorBoard(TensorBoardOptions())), make_run(out, step=20, total=40), range(21, 41), loss=lambda s: 1.0)
    assert len(list((out / "tensorboard").glob("events.out.tfevents.*"))) == 2
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    got = acc.Scalars("train/loss")
    assert [e.step for e in got] == [10, 20, 30, 40] and [e.value for e in got] == pytest.approx([2.9, 2.8, 1.0, 1.0])


# -- ranks other than 0 -----------------------------------------------------------


def test_non_main_rank_writes_nothing(tmp_path, capsys):
    from plugins.monitors.tensorboard import TensorBoard, TensorBoardOptions

    out = tmp_path / "out"
    run = make_run(out, rank=1, world_size=2, total=20)
    pm = manager(Console(ConsoleOptions()), Jsonl(JsonlOptions()), TensorBoard(TensorBoardOptions()))
    drive(pm, run, range(1, 21), val_at=(10,), ckpt_at=(10,))
    assert capsys.readouterr().out == ""
    assert not out.exists() or not any(out.rglob("*"))


# -- console formats ----------------------------------------------------------------

GUIDE = {
    "step": 10,
    "loss": 3.214,
    "lm": 3.102,
    "aux": 0.0312,
    "z": 0.0012,
    "grad_norm": 1.2312,
    "lr": 3e-4,
    "tokens_per_s": 421_000.0,
    "tokens_seen": 70_123_456,
    "step_time_s": 0.2,
    "elapsed_s": 2.0,
    "eta_s": 9.0,
    "epoch": 0.42,
}


def test_console_moe_line_is_the_guides(tmp_path, capsys):
    run = make_run(tmp_path, step=10, total=152000)
    pm = manager(Console(ConsoleOptions(format="moe")))
    pm.hook.plait_step_end(run=run, step=10, metrics=dict(GUIDE))
    assert capsys.readouterr().out == (
        "Epoch 1 | step    10/152000 | loss 3.2140 | lm 3.1020 | aux 0.0312 | z 0.0012 | gnorm 1.23 | lr 3.00e-04 | 0.42M tok/s | 0.07B tokens\n"
    )
    # second epoch; a source that does not know its size and a model without loss parts: those segments go
    pm.hook.plait_step_end(run=run, step=11, metrics={**GUIDE, "epoch": 1.5})
    assert capsys.readouterr().out.startswith("Epoch 2 | step    11/152000 |")
    plain = {k: v for k, v in GUIDE.items() if k not in ("epoch", "lm", "aux", "z")}
    pm.hook.plait_step_end(run=run, step=12, metrics=plain)
    assert capsys.readouterr().out == "step    12/152000 | loss 3.2140 | gnorm 1.23 | lr 3.00e-04 | 0.42M tok/s | 0.07B tokens\n"


def test_console_user_template(tmp_path, capsys):
    run = make_run(tmp_path, step=10, total=500)
    opts = ConsoleOptions(format="[{step:>{steps_width}}/{total_steps}] {loss:.2f} ({epochs:.3f} ep) {mtokens:.1f}Mt {eta}", extra=["aux"])
    manager(Console(opts)).hook.plait_step_end(run=run, step=10, metrics=dict(GUIDE))
    assert capsys.readouterr().out == "[ 10/500] 3.21 (0.420 ep) 70.1Mt 0:00:09 | aux 0.0312\n"


@pytest.mark.parametrize(
    "template, expected",
    [
        ("step {stepp}", "unknown field 'stepp' (did you mean 'step'?)"),
        ("loss {loss:.3q}", "bad format spec (Unknown format code 'q'"),
        ("eta {eta:.1f}", "bad format spec (Unknown format code 'f' for object of type 'str')"),
        ("{step:>{width}}", "unknown field 'width'"),
        ("loss {}", "positional {} placeholders are not allowed"),
        ("loss {loss", "expected '}' before end of string"),
    ],
)
def test_console_bad_template_is_one_line(template, expected):
    from core.contract.errors import ConfigError
    from core.contract.option_values import build_options

    with pytest.raises(ConfigError) as err:
        build_options(ConsoleOptions, {"format": template}, "[monitors.console]")
    msg = str(err.value)
    assert msg.startswith(f"[monitors.console]: format {template!r}") and expected in msg and "\n" not in msg


def test_console_bad_template_exits_2_before_training(tmp_path):
    from conftest import run_here, write_tiny_config

    proc = run_here("core.train", "--config", str(write_tiny_config(tmp_path)), "--monitors.console.format=step {step} {lr:%}x {nope}")
    assert proc.returncode == 2 and proc.stdout == ""
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "[monitors.console]: format" in lines[0] and "unknown field 'nope'" in lines[0], proc.stderr
    assert not (tmp_path / "out" / "metrics.jsonl").exists()
