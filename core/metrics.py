"""Throughput and health metrics: MFU, memory, update/parameter ratio.

MFU = tokens/s per device x FLOPs per token (docs/metrics.md) / the device's
dense bf16 peak from :data:`PEAK_BF16_TFLOPS` (no sparsity). CPUs and unknown
devices report no MFU rather than a guess.
"""

from __future__ import annotations

import torch

# Dense bf16 tensor-core peak, TFLOP/s, from the vendors' data sheets.
PEAK_BF16_TFLOPS: list[tuple[str, float]] = [
    ("H200", 989.0),
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.0),          # SXM
    ("B200", 2250.0),
    ("A100", 312.0),
    ("L40S", 362.0),
    ("RTX PRO 6000 Blackwell", 503.8),
    ("RTX 6000 Ada", 364.0),
]


def peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(device)
    for key, tflops in PEAK_BF16_TFLOPS:
        if key in name:
            return tflops * 1e12
    return None


def mfu(tokens_per_s_per_device: float, flops_per_token: float, device: torch.device) -> float | None:
    peak = peak_flops(device)
    return None if peak is None else tokens_per_s_per_device * flops_per_token / peak


def memory(device: torch.device) -> dict[str, float]:
    if device.type != "cuda":
        return {}
    gib = 2**30
    return {
        "mem_allocated_gib": torch.cuda.memory_allocated(device) / gib,
        "mem_reserved_gib": torch.cuda.memory_reserved(device) / gib,
        "mem_peak_gib": torch.cuda.max_memory_allocated(device) / gib,
    }


class UpdateRatio:
    """||update|| / ||param|| per parameter kind (matrix, embedding, norm, bias), measured on log steps.

    ``before()`` copies the parameters of one log step; ``after()`` compares.
    Sharded (DTensor) parameters give the local shard's ratio, which tracks
    the global one closely for evenly sharded weights.
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.saved: list[tuple[str, list[torch.Tensor]]] | None = None

    @staticmethod
    def _local(p: torch.Tensor) -> torch.Tensor:
        return p.to_local() if hasattr(p, "to_local") else p

    @torch.no_grad()
    def before(self) -> None:
        self.saved = [(g.get("name", str(i)), [self._local(p).detach().clone() for p in g["params"]])
                      for i, g in enumerate(self.optimizer.param_groups)]

    @torch.no_grad()
    def after(self) -> dict[str, float]:
        if self.saved is None:
            return {}
        out = {}
        for (name, old), group in zip(self.saved, self.optimizer.param_groups):
            new = [self._local(p).detach() for p in group["params"]]
            upd = torch.sqrt(sum(((n.float() - o.float()) ** 2).sum() for n, o in zip(new, old)))
            par = torch.sqrt(sum((o.float() ** 2).sum() for o in old))
            out[f"update_ratio/{name}"] = float(upd / par.clamp(min=1e-12))
        self.saved = None
        return out
