"""bench.gpu_1b without a GPU: its variant of the 1b train config takes that config's speed settings,
and every variant is a config plait accepts."""

from __future__ import annotations

import pytest
import tomllib

from bench.common import REPO, synthetic_config
from bench.gpu_1b import BASE, OPT_IN, VARIANTS, micro_batch_of
from core.preflight.prepare import prepare


def test_config_variant_takes_the_1b_configs_speed_settings(tmp_path):
    cfg = tomllib.loads((REPO / "train_configs" / "1b_h100.toml").read_text())
    extra = VARIANTS["config-1b_h100"]
    assert "--train.compile=true" in extra and cfg["train"]["compile"] is True
    assert f"--train.activation_checkpointing={cfg['train']['activation_checkpointing']}" in extra
    assert f"--optimizer.impl={cfg['optimizer']['impl']}" in extra and f"--precision.name={cfg['precision']['name']}" in extra
    micro = micro_batch_of(extra)
    assert micro == cfg["train"]["micro_batch_max"]
    # the variant's run prepares (on CPU here): "auto" tries every micro-batch dividing the bench's batch
    path = synthetic_config("1b", 2048, micro, "cpu", str(tmp_path / "out"), loss_chunk_tokens=8192)
    prep = prepare(str(path), BASE + extra + [f"--train.global_batch_tokens={micro * 2048}", "--train.steps=3", "--train.device=cpu"], world_size=1)
    assert prep.rc.train.compile and prep.micro_batch_candidates == [m for m in (16, 8, 4, 2, 1) if m <= micro]


@pytest.mark.parametrize("name", list(VARIANTS) + list(OPT_IN))
def test_every_variant_is_a_config_plait_accepts(tmp_path, name):
    """A GPU session is rare: a variant with a wrong key or value must fail here, not there."""
    extra = {**VARIANTS, **OPT_IN}[name]
    micro = micro_batch_of(extra)
    path = synthetic_config("1b", 2048, micro, "cpu", str(tmp_path / "out"), loss_chunk_tokens=8192)
    on_cpu = ["--precision.allow_cpu=true"] if "--precision.name=fp8" in extra else []  # fp8 checks for CUDA first
    overrides = BASE + extra + on_cpu + [f"--train.global_batch_tokens={micro * 2048}", "--train.steps=3", "--train.device=cpu"]
    prep = prepare(str(path), overrides, world_size=1, dry_run=True)  # as core.plan: the 8b variant does not fit this machine's memory
    assert prep.rc.slots["precision"].component.name == ("fp8" if "--precision.name=fp8" in extra else "bf16")
    if "--precision.skip_head=false" in extra:
        assert prep.rc.slots["precision"].options.skip_head is False
