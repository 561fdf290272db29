"""A µP run's checkpoints downstream, through the real trainer: a 2-rank fsdp2 µP run (gloo) saves,
and one process resumes it resharded with the losses the uninterrupted run had; its Hugging Face
export gives transformers the logits of plait's forward, and core.generate and core.eval the same
text and scores as the checkpoint."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import run_module, torchrun, write_tiny_config
from shared import error_lines, losses, shakespeare_text, write_task
from test_plugin_author import install

pytestmark = pytest.mark.slow

# dim 128 against base width 64: r = 0.5, so the logits, attention scores, head init and the
# hidden matrices' LR all differ from standard parametrization; the debug head is untied (µP's own
# "output" group).
MUP = ("--model.dim=128", "--model.parametrization=mup", "--model.mup_base_width=64")


# Two third-party models that declare no widths: one without a parametrization option, one with
# llama3's options (parametrization included) but no mup_widths().
WIDTHLESS = """
from core.api import hookimpl
from model_specs.llama3.spec import Llama3Options, Llama3Spec

class Spec:
    def __init__(self, options):
        self.llama = Llama3Spec.from_flavor("debug", dim=64, n_layers=2)
        self.vocab_size = self.llama.vocab_size

    def build(self):
        return self.llama.build()

    def init_weights(self, model):
        self.llama.init_weights(model)

    def blocks(self, model):
        return self.llama.blocks(model)

    def flops_per_token(self, seq_len):
        return self.llama.flops_per_token(seq_len)

    def activation_bytes(self, micro_batch, seq_len, bytes_per_element):
        return self.llama.activation_bytes(micro_batch, seq_len, bytes_per_element)

class NoWidths(Spec):
    def __init__(self, options):
        self.llama = Llama3Spec.from_options(options)
        self.vocab_size = self.llama.vocab_size

@hookimpl
def plait_register(registry):
    registry.add("model", "no_option", Spec, doc="llama3 debug without µP's options")
    registry.add("model", "no_widths", NoWidths, options=Llama3Options, doc="llama3's options, no mup_widths()")
"""


@pytest.mark.parametrize(
    "model, expected",
    [
        ("no_option", "[model].parametrization: model 'no_option' has no parametrization option and declares no widths"),
        ("no_widths", "[model].parametrization = \"mup\" but model 'no_widths' declares no widths"),
    ],
)
def test_mup_asked_of_a_third_party_model_without_widths_is_one_line_before_anything_is_made(tmp_path: Path, model: str, expected: str):
    """A plugin model (a real distribution found through its entry point) that declares no widths,
    asked for µP: exit 2, one line naming [model].parametrization, and no run folder made (the
    refusal comes before the folders, so before any process group)."""
    env = install(tmp_path / "site", WIDTHLESS)
    cfg = (
        write_tiny_config(tmp_path, steps=2)
        .read_text()
        .replace('name = "llama3"\nflavor = "debug"\ndim = 64\nn_layers = 2\n', f'name = "{model}"\nparametrization = "mup"\n')
    )
    (tmp_path / "run.toml").write_text(cfg)
    proc = run_module("core.train", "--config", str(tmp_path / "run.toml"), extra_env=env)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = error_lines(proc)
    assert len(lines) == 1 and expected in lines[0], proc.stderr[-3000:]
    assert not (tmp_path / "out").exists()


def test_mup_fsdp2_checkpoint_resumes_on_one_process_with_the_uninterrupted_losses(tmp_path: Path):
    """Tolerance: rel 2e-5 / abs 2e-5 (fp32 summation order differs between 2 fsdp2 ranks and one
    process; the same global samples every step), as for the standard resharded resume
    (tests/e2e/test_checkpoint.py). A resume that dropped µP's LR multipliers or its logit
    multiplier would change the loss of step 5 by far more."""
    cfg = write_tiny_config(tmp_path, steps=8, global_batch_tokens=1024)
    out = tmp_path / "run"
    common = ("--config", str(cfg), f"--train.output_dir={out}", *MUP)
    first = torchrun(2, *common, "--parallelism.name=fsdp2", "--checkpoint.every=4")
    assert first.returncode == 0, first.stderr[-3000:]
    straight = losses(out)  # the uninterrupted 8 steps (saving changes no arithmetic)
    assert sorted(straight) == list(range(1, 9))
    shutil.rmtree(out / "checkpoints" / "step_000000008")

    resumed = run_module("core.train", *common, "--parallelism.name=ddp")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout and "step_000000004 at step 4" in resumed.stdout
    got = losses(out)
    for s in range(5, 9):
        assert got[s] == pytest.approx(straight[s], rel=2e-5, abs=2e-5), (s, got, straight)
    assert json.loads((out / "run_info.json").read_text())["world_size"] == 1
    saved = json.loads((out / "checkpoints" / "step_000000008" / "state.json").read_text())
    assert saved["config"]["model"]["parametrization"] == "mup" and saved["config"]["model"]["mup_base_width"] == 64


def test_a_mup_checkpoint_and_its_hf_export_give_the_same_logits_generations_and_scores(tmp_path: Path, capsys):
    """A µP run (r = 0.5, untied head) exported with ``core.export --format hf``: transformers' logits on
    the export equal plait's forward on the checkpoint (atol 1e-4, fp32; the multipliers are folded into
    the head, so the Hugging Face model needs none); ``core.generate`` greedy text and ``core.eval``
    scores (abs 1e-5) on the export equal those on the checkpoint."""
    transformers = pytest.importorskip("transformers", reason="transformers is a test-only dependency (extra 'dev')")
    from core.cli.eval import evaluate_checkpoint
    from core.cli.export import main as export
    from core.cli.generate import load
    from core.cli.generate import main as generate

    cfg = write_tiny_config(tmp_path, steps=3, global_batch_tokens=512)
    trained = run_module("core.train", "--config", str(cfg), *MUP)
    assert trained.returncode == 0, trained.stderr[-3000:]
    ckpt = tmp_path / "out" / "checkpoints" / "step_000000003"
    out = tmp_path / "hf"
    assert export(["--checkpoint", str(ckpt), "--format", "hf", "--out", str(out)]) == 0

    ours = load(ckpt).model
    assert ours.args.width_ratio == 0.5
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    torch.testing.assert_close(hf.lm_head.weight, 0.5 * ours.output.weight)  # the logit multiplier, folded
    ids = torch.randint(0, 257, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, ours(ids), rtol=0, atol=1e-4)

    def greedy(path: Path) -> str:
        capsys.readouterr()
        assert generate(["--checkpoint", str(path), "--prompt", "ROMEO: What", "--max-new-tokens", "16", "--temperature", "0"]) == 0
        return capsys.readouterr().out

    text = greedy(ckpt)
    assert text.startswith("ROMEO: What") and greedy(out) == text

    task = write_task(tmp_path / "toy.jsonl", 40, False)
    held = tmp_path / "held.txt"
    held.write_text(shakespeare_text(4000)[1000:3000])
    on_ckpt = evaluate_checkpoint(ckpt, [str(task)], {"shakes": held}, max_len=128)
    on_export = evaluate_checkpoint(out, [str(task)], {"shakes": held}, max_len=128)
    assert {"eval/toy/acc", "eval/toy/gold_ll", "eval/shakes/bpb"} <= set(on_ckpt) and set(on_export) == set(on_ckpt)
    for key, value in on_ckpt.items():
        assert on_export[key] == pytest.approx(value, abs=1e-5), key
