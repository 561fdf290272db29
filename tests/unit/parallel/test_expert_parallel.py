"""Expert parallelism's layout checks (``[parallelism] fsdp2`` with ``ep``): a degree or model that cannot
work is one line, exit 2, before any process group (``core.plan``, in process); and the stacked experts
load a state dict of the per-expert layout they replaced. Equality with one process on gloo ranks:
tests/e2e/test_expert_parallel_e2e.py."""

from __future__ import annotations

import pytest
import torch
from shared import plan_error

from model_specs.recurrent_moe.model import MoE

MOE = ["--model.name=recurrent_moe", "--model.flavor=debug"]  # 4 experts


@pytest.mark.parametrize(
    "nproc, overrides, expected",
    [
        (2, [*MOE, "--parallelism.ep=4"], "[parallelism] fsdp2: ep = 4 does not divide the world size 2; expected a divisor of the world size"),
        (3, [*MOE, "--parallelism.ep=3"], "[parallelism] ep = 3 does not divide [model] n_experts = 4; expected a divisor of n_experts"),
        (4, [*MOE, "--parallelism.ep=4", "--model.n_experts=6"], "[parallelism] ep = 4 does not divide [model] n_experts = 6"),
        (2, [*MOE, "--parallelism.ep=2", "--model.dispatch=dense"], "[parallelism] ep = 2 needs [model] dispatch = \"sparse\", not 'dense'"),
        (2, ["--parallelism.ep=2"], "[parallelism] ep = 2: model 'llama3' declares no experts (parallelize_experts); expected ep = 1"),
        (
            8,
            [*MOE, "--parallelism.ep=2", "--parallelism.tp=2", "--parallelism.pp=2"],
            "[parallelism] fsdp2: ep = 2 with tp = 2 and pp or replicate is not supported yet; expected pp = 1 and replicate = 1 with ep and tp",
        ),
        (
            4,
            [*MOE, "--parallelism.ep=4", "--parallelism.tp=2"],
            "[parallelism] fsdp2: ep = 4 does not divide the 2 data-parallel ranks (world size 4 / tp 2); expected a divisor of 2",
        ),
        (2, [*MOE, "--parallelism.ep=2", "--parallelism.cpu_offload=true"], "[parallelism] fsdp2: ep = 2 with cpu_offload is not supported yet; expected"),
        (
            4,
            [*MOE, "--parallelism.ep=4", "--parallelism.replicate=2"],
            "[parallelism] fsdp2: ep = 4 does not divide the 2 ranks of a replica group (world size 4 / replicate 2); expected a divisor of 2",
        ),
        (
            4,
            [*MOE, "--parallelism.ep=4", "--parallelism.pp=2"],
            "[parallelism] fsdp2: ep = 4 does not divide the 2 data-parallel ranks of a pipeline stage (world size 4 / pp 2); expected a divisor of 2",
        ),
        (2, [*MOE, "--parallelism.ep=2", "--train.micro_batch=auto"], 'train.micro_batch = "auto" with expert parallelism is not supported yet'),
    ],
)
def test_an_expert_parallel_layout_that_cannot_work_is_one_line(tiny_config, capsys, nproc, overrides, expected):
    line = plan_error(capsys, "--config", str(tiny_config()), "--config-only", "--nproc", str(nproc), "--parallelism.name=fsdp2", *overrides)
    assert expected in line, line


def test_the_stacked_experts_load_the_per_expert_layout():
    """``experts.{e}.w1.weight`` ... (the layout before the experts were stacked) load into ``experts.w1`` [E, h, d]."""
    torch.manual_seed(0)
    moe = MoE(16, 32, 4, 2)
    torch.nn.init.normal_(moe.experts.w1)
    torch.nn.init.normal_(moe.experts.w3)
    torch.nn.init.normal_(moe.experts.w2)
    old = {"router.weight": moe.router.weight.detach().clone()}
    for name in ("w1", "w3", "w2"):
        for e in range(4):
            old[f"experts.{e}.{name}.weight"] = getattr(moe.experts, name)[e].detach().clone()
    fresh = MoE(16, 32, 4, 2)
    fresh.load_state_dict(old)  # strict: every key used, none missing
    x = torch.randn(8, 16)
    torch.testing.assert_close(fresh(x)[0], moe(x)[0])
    assert sorted(fresh.state_dict()) == ["experts.w1", "experts.w2", "experts.w3", "router.weight"]
