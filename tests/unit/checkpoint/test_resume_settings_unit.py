"""A resumed run trains with its own config's optimizer settings, not the checkpoint's, and says which changed.

DCP's optimizer load restores every param-group setting as saved; core/checkpoint/resume.py puts
this run's back, so ``--optimizer.lr=...`` applies on a resumed run and a checkpoint saved with
``impl = "foreach"`` resumes under the fused default.
"""

from __future__ import annotations

import pytest
from conftest import REPO
from shared import stream_docs


def test_a_mixture_refuses_a_checkpoint_of_other_stages_or_without_its_streams_positions(tmp_path):
    """The mixture's own word before training (core.train and core.plan), where its load said it only
    after the model was built (and that error, too, was taken for damage)."""
    from core.contract.errors import DataError
    from plugins.data.mixture import Mixture, MixtureOptions

    corpus = str(REPO / "plugins" / "data" / "corpus" / "shakespeare")
    indexed = [{"name": "token_bin", "weight": 1.0, "path": corpus}, {"name": "synthetic", "weight": 1.0}]
    staged = Mixture(MixtureOptions(sources=indexed, stages=[(0.0, [1.0, 0.0]), (0.3, [0.5, 0.5]), (0.6, [0.0, 1.0])]))
    with pytest.raises(DataError, match=r"the checkpoint's data position has 2 stage\(s\), this config 3"):
        staged.check_resume({"world_size": 1, "data": {"consumed_samples": 48, "stage_starts": [0, 24]}}, 1)
    staged.check_resume({"world_size": 1, "data": {"consumed_samples": 48, "stage_starts": [0, 24, 30]}}, 1)
    streaming = Mixture(MixtureOptions(sources=[indexed[0], {"name": "text_stream", "weight": 1.0, "files": [str(stream_docs(tmp_path))]}]))
    with pytest.raises(DataError, match="the checkpoint holds a global data position of data source 'token_bin'"):
        streaming.check_resume({"world_size": 1, "data": {"consumed_samples": 48}, "config": {"data": {"name": "token_bin"}}}, 1)
    streaming.check_resume({"world_size": 1, "data": {}}, 1)


def test_new_betas_apply_to_a_torchao_optimizer_after_its_load_and_are_named(capsys):
    """``adamw8bit`` (torchao keeps each group's LR in a tensor): a load restores the checkpoint's betas,
    ``reapply`` puts this run's back into every group (what torchao's step reads), and the note names
    the change. No step is taken: torchao compiles its step, which the e2e resume test pays for once."""
    import torch
    from shared import build_optimizer

    from core.checkpoint import resume as hyperparams
    from model_specs.llama3.spec import Llama3Spec

    pytest.importorskip("torchao.optim", reason="adamw8bit is torchao's (a dependency of plait's)")
    spec = Llama3Spec.from_flavor("debug", dim=64, n_kv_heads=4, ffn_dim=64)

    def build(values):
        torch.manual_seed(0)
        return build_optimizer("adamw8bit", values, spec.build())

    saved = build({"lr": 3e-4}).state_dict()
    optimizer = build({"lr": 0.01, "betas": [0.9, 0.99]})
    mine = hyperparams.settings(optimizer)
    optimizer.load_state_dict(saved)
    assert {tuple(g["betas"]) for g in optimizer.param_groups} == {(0.9, 0.95)}  # the load alone: the checkpoint's
    changed = hyperparams.reapply(optimizer, mine)
    assert {tuple(g["betas"]) for g in optimizer.param_groups} == {(0.9, 0.99)}
    assert all(isinstance(g["lr"], torch.Tensor) for g in optimizer.param_groups)  # torchao refuses a float LR
    hyperparams.say_changes("ckpt", changed)
    assert "betas (0.9, 0.95) -> (0.9, 0.99)" in capsys.readouterr().err
