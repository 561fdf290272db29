"""µP (``[model] parametrization = "mup"``, core/contract/mup.py): a µP run at its base width is the
standard run; at another width the model's multipliers (logits, attention, head init) and the
core's per-kind LRs (AdamW, Muon) follow the width; the Hugging Face export folds the multipliers;
bad input (a base width that does not divide dim, µP asked of a model without widths, a standard
resume of a µP checkpoint) is one line, exit 2. Real trainers in-process on one CPU process."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from conftest import main_here, write_tiny_config
from shared import losses, plan_json, plan_text, trainer_for

from core.contract import mup
from core.contract.errors import ConfigError
from model_specs.llama3 import Llama3Spec

pytestmark = pytest.mark.usefixtures("one_thread")

NO_CHECKPOINT = "[checkpoint]\nat_end = false\n"


def trained_losses(tmp: Path, *overrides: str) -> dict[int, float]:
    tmp.mkdir()
    cfg = write_tiny_config(tmp, steps=4, body=NO_CHECKPOINT)
    t = trainer_for(cfg, *overrides)
    assert t.fit() == 0
    return losses(tmp / "out")


def materialized(spec: Llama3Spec, seed: int = 0) -> torch.nn.Module:
    with torch.device("meta"):
        model = spec.build()
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    with torch.no_grad():
        spec.init_weights(model)
    return model


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_mup_at_its_base_width_trains_as_the_standard_run(tmp_path, optimizer):
    """Tolerance: none. At the base width every multiplier is 1, so the losses of four steps are
    bitwise those of standard parametrization (the untied head is AdamW's own group under µP, which
    changes no arithmetic)."""
    name = f"--optimizer.name={optimizer}"
    standard = trained_losses(tmp_path / "standard", name)
    at_base = trained_losses(tmp_path / "mup", name, "--model.parametrization=mup", "--model.mup_base_width=64")
    assert len(standard) == 4 and at_base == standard


MOE = """
extends = "{repo}/train_configs/recurrent_moe_debug.toml"
[train]
steps = 4
global_batch_tokens = 256
micro_batch = 4
output_dir = "{out}"
log_every = 1
[data]
path = "{repo}/plugins/data/corpus/shakespeare"
seq_len = 64
[checkpoint]
at_end = false
[monitors]
enabled = ["console", "jsonl"]
"""


def test_recurrent_moe_mup_at_its_base_width_trains_as_the_standard_run(tmp_path):
    """Tolerance: none, as for llama3; the untied head is its own AdamW group, every multiplier 1."""
    repo = Path(__file__).resolve().parents[3]
    got = {}
    for name, extra in (("standard", []), ("mup", ["--model.parametrization=mup", "--model.mup_base_width=64"])):
        cfg = tmp_path / f"{name}.toml"
        cfg.write_text(MOE.format(repo=repo, out=tmp_path / name))
        assert trainer_for(cfg, *extra).fit() == 0
        got[name] = losses(tmp_path / name)
    assert len(got["standard"]) == 4 and got["mup"] == got["standard"]


def test_mup_at_twice_the_base_width_scales_logits_attention_and_head_init():
    std = Llama3Spec.from_flavor("debug", dim=256, n_heads=4, n_kv_heads=2, ffn_dim=768)
    mu = Llama3Spec.from_flavor("debug", dim=256, n_heads=4, n_kv_heads=2, ffn_dim=768, parametrization="mup", mup_base_width=64)
    a = mu.args
    assert (a.width_ratio, a.mup_base_head_dim, a.head_dim) == (0.25, 16, 64)
    assert a.attention_scale == pytest.approx(math.sqrt(16) / 64)  # 1/d, equal to 1/sqrt(d) at the base
    assert std.args.width_ratio == 1.0 and std.args.attention_scale is None
    m_std, m_mu = materialized(std), materialized(mu)
    assert m_std.output.weight.std().item() == pytest.approx(256**-0.5, rel=0.02)
    assert m_mu.output.weight.std().item() == pytest.approx(64**-0.5, rel=0.02)  # constant in width
    for name in ("layers.0.attention.wq.weight", "layers.1.feed_forward.w2.weight", "tok_embeddings.weight"):  # hidden: 1/fan_in as standard
        assert torch.equal(dict(m_std.named_parameters())[name], dict(m_mu.named_parameters())[name])
    # The same weights: µP's logits are the standard model's (with µP's attention) times base / width.
    same_attention = Llama3Spec.from_flavor("debug", dim=256, n_heads=4, n_kv_heads=2, ffn_dim=768, parametrization="mup", mup_base_width=256)
    m_same = materialized(same_attention)
    m_same.load_state_dict(m_mu.state_dict())
    x = torch.randint(0, 257, (2, 32))
    with torch.no_grad():
        for layer in m_same.layers:
            layer.attention.scale = a.attention_scale
        torch.testing.assert_close(m_mu(x), m_same(x) * 0.25)
        m_std.load_state_dict(m_mu.state_dict())
        assert not torch.allclose(m_mu(x), m_std(x) * 0.25)  # the attention scale differs


@pytest.mark.parametrize(
    ("optimizer", "extra", "matrix_mult"),
    [("adamw", (), 0.5), ("muon", (), 1.0), ("muon", ("--optimizer.adjust_lr=match_rms_adamw",), 0.5**0.5)],
)
def test_mup_learning_rates_follow_the_parameter_kinds(tmp_path, optimizer, extra, matrix_mult):
    """AdamW's hidden matrices take lr x base / width, Muon's none (spectral rule) or sqrt(base / width)
    (match_rms_adamw); embedding, norms and the untied head (its own group under µP) keep the LR."""
    cfg = write_tiny_config(tmp_path, steps=2, body=NO_CHECKPOINT)
    t = trainer_for(cfg, f"--optimizer.name={optimizer}", *extra, "--model.dim=128", "--model.parametrization=mup", "--model.mup_base_width=64")
    mults: dict[str, float] = {}
    for g in t.built.state.optimizer.param_groups:
        mults.setdefault(g["name"], g["lr_mult"])
    assert mults["matrix"] == pytest.approx(matrix_mult)
    assert mults["embedding"] == mults["norm"] == mults["output"] == 1.0
    head = t.built.state.run.model.output.weight
    assert any(g["name"] == "output" and any(p is head for p in g["params"]) for g in t.built.state.optimizer.param_groups)


def test_user_lr_multipliers_multiply_mups_and_the_head_keeps_the_matrix_one(tmp_path):
    cfg = write_tiny_config(tmp_path, steps=2, body=NO_CHECKPOINT)
    t = trainer_for(cfg, "--optimizer.lr_multipliers={matrix = 3.0}", "--model.dim=128", "--model.parametrization=mup", "--model.mup_base_width=64")
    mults = {g["name"]: g["lr_mult"] for g in t.built.state.optimizer.param_groups}
    assert mults["matrix"] == pytest.approx(1.5) and mults["output"] == pytest.approx(3.0)


@pytest.mark.parametrize("qk_norm", [False, True])
def test_hf_export_folds_the_multipliers(qk_norm):
    transformers = pytest.importorskip("transformers", reason="transformers is a test-only dependency (extra 'dev')")
    spec = Llama3Spec.from_flavor("debug", dim=128, max_seq_len=64, qk_norm=qk_norm, parametrization="mup", mup_base_width=32)
    model = materialized(spec)
    config = spec.hf_config()
    cls = transformers.Qwen3ForCausalLM if qk_norm else transformers.LlamaForCausalLM
    hf = cls((transformers.Qwen3Config if qk_norm else transformers.LlamaConfig)(**config)).eval()
    hf.load_state_dict(spec.to_hf_state_dict(model.state_dict()), strict=True)
    x = torch.randint(0, spec.vocab_size, (2, 48))
    with torch.no_grad():
        torch.testing.assert_close(model(x), hf(x).logits, rtol=1e-4, atol=1e-4)
    back = spec.from_hf_state_dict(dict(hf.state_dict()))
    for k, v in model.state_dict().items():
        torch.testing.assert_close(back[k], v)


def test_a_tied_head_off_its_base_width_cannot_fold():
    spec = Llama3Spec.from_flavor("debug", dim=128, tie_embeddings=True, parametrization="mup", mup_base_width=64)
    with pytest.raises(ValueError, match="tied head at dim 128 .mup_base_width 64.: its logit multiplier cannot fold"):
        spec.to_hf_state_dict(materialized(spec).state_dict())
    at_base = Llama3Spec.from_flavor("debug", dim=128, tie_embeddings=True, parametrization="mup", mup_base_width=128)
    assert "lm_head.weight" not in at_base.to_hf_state_dict(materialized(at_base).state_dict())


def test_a_base_width_that_does_not_divide_dim_is_one_line_exit_2(tmp_path):
    from core.cli.train import main

    cfg = write_tiny_config(tmp_path, body=NO_CHECKPOINT)
    code, _, err = main_here(main, "--config", str(cfg), "--model.parametrization=mup", "--model.mup_base_width=48")
    assert code == 2
    assert "mup_base_width 48 is not a divisor of dim 64" in err and len(err.strip().splitlines()) == 1


@dataclass
class WidthlessOptions:
    flavor: str = "x"


def test_mup_asked_of_a_model_without_the_option_is_one_line():
    """resolve() asks this before filling the model's options (rather than "unknown key")."""
    with pytest.raises(ConfigError, match=r"run.toml: \[model\].parametrization: model 'other' has no parametrization option and declares no widths"):
        mup.unasked_option({"parametrization": "mup"}, WidthlessOptions, "other", "run.toml: [model]")
    mup.unasked_option({"flavor": "y"}, WidthlessOptions, "other", "run.toml: [model]")  # not asked: nothing to say


class NoWidths:
    """A spec with a parametrization option of its own but no mup_widths()."""

    vocab_size = 8


def test_check_asked_refuses_a_spec_without_mup_widths():
    with pytest.raises(ConfigError, match="declares no widths"):
        mup.check_asked(NoWidths(), "other", {"parametrization": "mup"}, "run.toml")
    assert mup.check_asked(NoWidths(), "other", {"parametrization": "standard"}, "run.toml") is None


def test_a_mup_checkpoint_resumed_as_standard_is_one_line_exit_2(tmp_path):
    """core.plan decides the resume as the trainer does (core.preflight), before any process group."""
    from core.cli.plan import main

    cfg = write_tiny_config(tmp_path, steps=2)
    assert trainer_for(cfg, "--model.parametrization=mup", "--model.mup_base_width=32").fit() == 0
    code, _, err = main_here(main, "--config", str(cfg), "--train.steps=4")
    assert code == 2
    assert "model.parametrization 'mup' -> 'standard'" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize(
    "override, expected",
    [("--model.parametrization=standard", "model.parametrization 'mup' -> 'standard'"), ("--model.mup_base_width=16", "model.mup_base_width 32 -> 16")],
)
def test_core_train_refuses_a_mup_checkpoint_resumed_otherwise_before_any_process_group(tmp_path, monkeypatch, capsys, override, expected):
    """core.train on a µP run's folder, resumed as standard or with another base width: one line naming
    the key, exit 2, and ``core.runtime.distributed.init`` (the process group) never called. In this
    process: core.train's rank 0 holds the run folder's lock when it decides the resume, released here
    as the process's exit would."""
    from core.cli.train import main
    from core.runtime import distributed
    from core.runtime.ownership import release_run_folders

    cfg = write_tiny_config(tmp_path, steps=2)
    mu = ("--model.parametrization=mup", "--model.mup_base_width=32")
    assert trainer_for(cfg, *mu).fit() == 0
    capsys.readouterr()
    calls: list[tuple] = []
    real_init = distributed.init
    monkeypatch.setattr(distributed, "init", lambda *a, **k: calls.append(a) or real_init(*a, **k))
    try:
        with pytest.raises(SystemExit) as exit_:
            main(["--config", str(cfg), "--train.steps=4", *mu, override])
    finally:
        release_run_folders()
    out, err = capsys.readouterr()
    assert exit_.value.code == 2 and calls == [] and "resumed from" not in out
    assert expected in err and len(err.strip().splitlines()) == 1, err


def test_plan_prints_each_groups_effective_lr_and_the_widths(tmp_path, capsys):
    cfg = write_tiny_config(tmp_path, body=NO_CHECKPOINT)
    mu = ("--model.parametrization=mup", "--model.dim=128", "--model.mup_base_width=64")
    plan = plan_json(capsys, "--config", str(cfg), "--config-only", *mu)
    groups = {g["name"]: g for g in plan["param_groups"]}
    assert plan["mup_widths"] == [128, 64]
    assert groups["matrix"]["lr"] == pytest.approx(3e-4 * 0.5) and groups["matrix"]["lr_mult"] == 0.5
    assert groups["output"]["lr"] == pytest.approx(3e-4) and groups["output"]["params"] == 128 * 512
    # init std over each group's parameters: hidden 1/sqrt(fan_in 128), the residual outputs
    # 128^-0.5 / sqrt(2 x 2 layers); the µP head base_width^-0.5 = 64^-0.5; norms constant
    assert groups["matrix"]["init_std"] == pytest.approx([128**-0.5 / 2, 128**-0.5])
    assert groups["output"]["init_std"] == pytest.approx([0.125, 0.125])
    assert groups["embedding"]["init_std"] == pytest.approx([0.02, 0.02]) and groups["norm"]["init_std"] == [0.0, 0.0]
    text = plan_text(capsys, "--config", str(cfg), "--config-only", *mu)
    assert "µP          width 128, base width 64: logits x 0.5" in text
    assert "LR groups   matrix: peak lr 0.00015 (x 0.5), init std 0.04419-0.08839, weight_decay 0.1" in text
    assert "output: peak lr 0.0003 (x 1), init std 0.125, weight_decay" in text and "norm: peak lr 0.0003 (x 1), init std 0 (constant)" in text
    muon = plan_json(capsys, "--config", str(cfg), "--config-only", "--model.dim=128", "--optimizer.name=muon")  # its own head group
    assert {g["name"]: g["init_std"] for g in muon["param_groups"]}["output"] == pytest.approx([128**-0.5] * 2)  # standard: dim^-0.5
    standard = plan_json(capsys, "--config", str(cfg), "--config-only")
    assert standard["mup_widths"] is None and [g["name"] for g in standard["param_groups"]] == ["matrix", "embedding", "norm"]
