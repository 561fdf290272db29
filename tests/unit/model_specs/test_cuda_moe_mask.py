"""The CUDA fast paths against the CPU-tested paths on the same device: the sparse MoE's
``torch._grouped_mm`` (bf16, compute capability 9.0+) against the dense experts, and the document
mask's FlexAttention block mask against SDPA with the boolean mask. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none visible to torch)")
HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)


@pytest.mark.skipif(not HOPPER, reason="torch._grouped_mm needs compute capability 9.0 or newer (none visible)")
def test_grouped_mm_experts_match_the_dense_experts_on_cuda():
    from model_specs.recurrent_moe.experts import grouped_mm_usable
    from model_specs.recurrent_moe.model import MoE

    torch.manual_seed(0)
    dense = MoE(128, 256, 8, 2, dispatch="dense").cuda().bfloat16()
    sparse = MoE(128, 256, 8, 2).cuda().bfloat16()
    sparse.load_state_dict(dense.state_dict())
    x = torch.randn(512, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    assert grouped_mm_usable(x, torch.empty(8, 256, 128, device="cuda", dtype=torch.bfloat16))
    yd, ys = dense(x)[0], sparse(x)[0]
    assert torch.allclose(ys.float(), yd.float(), atol=2e-2, rtol=2e-2)
    ys.float().sum().backward()
    gs = {n: p.grad.clone() for n, p in sparse.named_parameters()}
    x.grad = None
    yd.float().sum().backward()
    for n, p in dense.named_parameters():
        assert torch.allclose(gs[n].float(), p.grad.float(), atol=5e-2, rtol=5e-2), n


def test_flex_attention_document_mask_matches_sdpa_on_cuda():
    from model_specs.llama3.spec import Llama3Spec

    spec = Llama3Spec.from_flavor("debug", attention_mask="document", rope_positions="document")
    spec.use_end_of_document_id(7)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = spec.build()
    spec.init_weights(model)
    ids = torch.randint(10, 500, (2, 256), device="cuda")
    ids[:, 60::70] = 7
    with torch.no_grad():
        flex = model(ids)  # CUDA: a FlexAttention BlockMask
        cpu_model = spec.build()
        cpu_model.load_state_dict({k: v.cpu() for k, v in model.state_dict().items()})
        cpu_model.init_buffers()
        sdpa = cpu_model(ids.cpu())  # CPU: SDPA with the boolean mask
    assert torch.allclose(flex.cpu(), sdpa, atol=1e-3, rtol=1e-3)
