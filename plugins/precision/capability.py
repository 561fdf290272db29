"""What the device can do, in one place for every precision plugin."""

from __future__ import annotations

import torch


def cuda_capability(device: torch.device) -> tuple[int, int] | None:
    """(major, minor) of a CUDA device, or None off CUDA."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability(device)


def describe(device: torch.device) -> str:
    cc = cuda_capability(device)
    if cc is None:
        return f"{device.type} (no CUDA)"
    return f"{torch.cuda.get_device_name(device)} (compute capability {cc[0]}.{cc[1]})"


def eligible_linear(module: torch.nn.Module, multiple: int = 16) -> bool:
    """A linear layer whose dimensions low-precision GEMMs accept."""
    return isinstance(module, torch.nn.Linear) and module.in_features % multiple == 0 and module.out_features % multiple == 0


def linear_filter(skip: list[str], multiple: int = 16):
    """A torchao ``module_filter_fn``: eligible linears whose name is not in ``skip`` (nor a child of one)."""

    def accept(module: torch.nn.Module, fqn: str) -> bool:
        return eligible_linear(module, multiple) and not any(fqn == s or fqn.startswith(s + ".") for s in skip)

    return accept


def kept_high(spec, model: torch.nn.Module, skip_head: bool) -> list[str]:
    """What the model spec declares high precision (:func:`core.contract.protocols.high_precision_modules`),
    when the plugin's ``skip_head`` is on."""
    from core.api import high_precision_modules

    return high_precision_modules(spec, model) if skip_head and spec is not None else []


def count_eligible(model: torch.nn.Module, skip: list[str], multiple: int = 16) -> int:
    accept = linear_filter(skip, multiple)
    return sum(accept(m, name) for name, m in model.named_modules())


def quiet_torchao_import(*modules: str) -> None:
    """Import torchao with its load-time chatter (kernels for other GPUs, deprecation notes) silenced.

    torchao logs a warning for every optional CUDA extension it cannot load on
    this machine; those are expected and would bury plait's own one-line errors.
    """
    import logging

    loggers = [logging.getLogger("torchao"), logging.getLogger("torch.utils._pytree")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        import importlib

        for name in ("torchao", "torchao.float8", *modules):
            importlib.import_module(name)
    except ImportError:
        pass
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)
