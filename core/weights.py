"""Model weights in and out of plait: DCP checkpoints, safetensors, Hugging Face layout.

Everything here runs on one process without a process group. Tensors are
keyed by plait's names (the model's ``state_dict`` names); the Hugging Face
layout goes through the model spec's ``to_hf_state_dict`` /
``from_hf_state_dict``, so this module knows no concrete model.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from core.checkpoint import COMMIT_MARKER, check_shapes, folder_of_checkpoints, read_model, verify
from core.contract.errors import CheckpointError
from core.contract.members import member
from core.runtime.materialize import materialize

SAFETENSORS_FILE = "model.safetensors"
HF_INDEX = "model.safetensors.index.json"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def spec_from_config(config: dict[str, Any], where: str) -> Any:
    """The model spec that a resolved config's ``[model]`` section describes."""
    from core.config import registry as registry_mod
    from core.contract.option_values import build_options

    section = dict(config.get("model", {}))
    name = section.pop("name", None)
    if not name:
        raise CheckpointError(f"{where}: no [model] section with a name")
    component = registry_mod.load().get("model", name, where)
    return component.factory(build_options(component.options, section, f"{where} [model]"))


def empty_model(spec: Any) -> torch.nn.Module:
    with torch.device("meta"):
        model = spec.build()
    materialize(model, torch.device("cpu"))
    with torch.no_grad():
        spec.init_weights(model)
    return model


def checkpoint_model(path: Path) -> tuple[Any, dict[str, Any], torch.nn.Module]:
    """(spec, resolved config, model with the checkpoint's weights) for a plait checkpoint folder."""
    meta = verify(path, shards=False)  # read_model checks the shards
    config = meta["config"]
    spec = spec_from_config(config, f"checkpoint {path}")
    check_buildable(path, spec)
    model = empty_model(spec)
    read_model(path, model)
    return spec, config, model


def check_buildable(path: Path, spec: Any) -> None:
    """Before a byte of the model is allocated: the model that ``state.json``'s config describes, built
    on the meta device, must have the shapes of the tensors the checkpoint's DCP metadata lists (a
    ``state.json`` edited to name a larger model is refused here), and its weights must fit in the
    memory this machine has available. Raises CheckpointError (one line, exit code 2)."""
    with torch.device("meta"):
        shell = spec.build()
    check_shapes(path, shell)
    need = sum(t.numel() * t.element_size() for t in shell.state_dict().values())
    have = available_memory()
    if have is not None and need > have:
        raise CheckpointError(
            f"checkpoint {path}: its model needs {need / 2**30:.1f} GiB to build, more than the {have / 2**30:.1f} GiB this machine has available"
        )


def available_memory() -> int | None:
    """Bytes of memory available to a new allocation (``MemAvailable`` in /proc/meminfo); None if unknown."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def unique_tensors(sd: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Drop tensors that share storage with an earlier one (tied weights); return (tensors, aliases)."""
    seen: dict[tuple[int, int], str] = {}
    out: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    for name, t in sd.items():
        key = (t.untyped_storage().data_ptr(), int(t.storage_offset()))
        if key in seen and t.numel():
            aliases[name] = seen[key]
            continue
        seen[key] = name
        out[name] = t
    return out, aliases


def cast(sd: dict[str, torch.Tensor], dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    return {k: (v.to(dtype) if dtype is not None and v.is_floating_point() else v).contiguous() for k, v in sd.items()}


def save_safetensors(sd: dict[str, torch.Tensor], out: Path, model_section: dict[str, Any], dtype: torch.dtype | None) -> Path:
    """plait's own safetensors export: one file, plait names, tied weights stored once."""
    from safetensors.torch import save_file

    tensors, aliases = unique_tensors(sd)
    out.mkdir(parents=True, exist_ok=True)
    path = out / SAFETENSORS_FILE
    # One metadata key: safetensors writes metadata in hash-map order, and one key keeps files byte-identical.
    meta = json.dumps({"model": model_section, "aliases": aliases}, sort_keys=True)
    save_file(cast(tensors, dtype), str(path), metadata={"plait": meta})
    (out / "config.json").write_text(json.dumps({"plait_model": model_section}, indent=1, sort_keys=True) + "\n")
    return path


def save_hf(
    spec: Any, sd: dict[str, torch.Tensor], out: Path, dtype: torch.dtype | None, shard_bytes: int, extra_config: dict[str, Any] | None = None
) -> list[Path]:
    """transformers' layout: config.json (the spec's fields, then ``extra_config``, e.g. token ids)
    and safetensors shards with HF names."""
    from safetensors.torch import save_file

    hf = cast(spec.to_hf_state_dict(sd), dtype)
    hf_dtype = next(v.dtype for v in hf.values() if v.is_floating_point())
    config = dict(spec.hf_config(), torch_dtype=str(hf_dtype).replace("torch.", ""), **(extra_config or {}))
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=1, sort_keys=True) + "\n")
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(hf):
        t = hf[name]
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], str(out / SAFETENSORS_FILE), metadata={"format": "pt"})
        return [out / SAFETENSORS_FILE]
    paths, weight_map = [], {}
    for i, shard in enumerate(shards, 1):
        p = out / f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(p), metadata={"format": "pt"})
        paths.append(p)
        weight_map.update({k: p.name for k in shard})
    total = sum(t.numel() * t.element_size() for t in hf.values())
    (out / HF_INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1, sort_keys=True) + "\n")
    return paths


def weights_kind(path: Path) -> str:
    """``dcp``, ``safetensors`` (plait's export) or ``hf``, or a CheckpointError."""
    if path.is_file() and path.suffix == ".safetensors":
        return "safetensors"
    if not path.is_dir():
        raise CheckpointError(f"weights {path} not found (expected a checkpoint folder, an export folder or a .safetensors file)")
    if (path / COMMIT_MARKER).is_file():
        return "dcp"
    config = path / "config.json"
    if config.is_file():
        try:
            data = json.loads(config.read_text())
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{config}: not valid JSON ({e})") from None
        if "plait_model" in data:
            return "safetensors"
        if (path / SAFETENSORS_FILE).is_file() or (path / HF_INDEX).is_file():
            return "hf"
    raise CheckpointError(
        folder_of_checkpoints(path) or f"weights {path}: not a committed plait checkpoint, a plait safetensors export or a Hugging Face folder"
    )


def _meta_tensors(file: str) -> dict[str, torch.Tensor]:
    """A safetensors file's tensors as meta tensors of their shapes: its header alone is read."""
    from safetensors import safe_open

    with safe_open(file, framework="pt") as f:
        return {k: torch.empty(f.get_slice(k).get_shape(), device="meta") for k in f.keys()}


def load_weights(path: Path, spec: Any, model: torch.nn.Module, shapes_only: bool = False) -> dict[str, torch.Tensor]:
    """Weights at ``path`` in plait names, checked against ``model``'s keys and shapes. ``shapes_only``:
    a safetensors export or a Hugging Face folder is read from its headers alone, as meta tensors (the
    pre-flight check of ``checkpoint.initial_load``)."""
    from safetensors.torch import load_file, safe_open

    kind = weights_kind(path)
    read = _meta_tensors if shapes_only else load_file
    if kind == "dcp":
        target = {k: v.detach().clone() for k, v in model.state_dict().items()}
        return read_model(path, _StateHolder(target))
    if kind == "safetensors":
        file = path if path.is_file() else path / SAFETENSORS_FILE
        sd = read(str(file))
        with safe_open(str(file), framework="pt") as f:
            aliases = json.loads((f.metadata() or {}).get("plait", "{}")).get("aliases", {})
        for alias, source in aliases.items():
            sd[alias] = sd[source]
    else:
        index = path / HF_INDEX
        files = hf_index_files(index) if index.is_file() else [SAFETENSORS_FILE]
        hf: dict[str, torch.Tensor] = {}
        for name in files:
            hf.update(read(str(path / name)))
        to_plait = member("model", spec, "from_hf_state_dict")
        if to_plait is None:
            raise CheckpointError(f"{path}: the model spec cannot read Hugging Face weights")
        try:
            sd = to_plait(hf)
        except KeyError as e:
            raise CheckpointError(f"{path}: {e.args[0]}") from None
        except (NotImplementedError, RuntimeError):  # a converter that needs the values: checked when they are loaded
            if not shapes_only:
                raise
            return {}
    check_against(sd, model, path)
    return sd


def hf_index_files(index: Path) -> list[str]:
    """The shard files that ``model.safetensors.index.json`` names, each a plain file of its folder."""
    from core.contract.option_values import escapes

    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        names = sorted(set(weight_map.values()))
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"{index}: expected a JSON object with a weight_map of tensor -> file name ({type(e).__name__}: {e})") from None
    for name in names:
        why = escapes(name) if isinstance(name, str) else "not a string"
        if why:
            raise CheckpointError(f"{index}: weight_map names {name!r}, expected a file inside {index.parent} ({why})")
    return names


class _StateHolder(torch.nn.Module):
    """A module whose state_dict is a given dict (lets read_model fill a copy)."""

    def __init__(self, sd: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self._sd = sd

    def state_dict(self, *args, **kwargs):  # type: ignore[override]
        return self._sd


def check_against(sd: dict[str, torch.Tensor], model: torch.nn.Module, path: Path) -> None:
    want = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    missing = sorted(set(want) - set(sd))
    extra = sorted(set(sd) - set(want))
    bad = sorted(k for k in set(want) & set(sd) if tuple(sd[k].shape) != want[k])
    if bad:
        raise CheckpointError(f"weights {path} do not fit the model: " + ", ".join(f"{k} {tuple(sd[k].shape)} vs model {want[k]}" for k in bad[:4]))
    if missing or extra:
        raise CheckpointError(f"weights {path}: missing {missing[:4]} unexpected {extra[:4]}")


def copy_into(model: torch.nn.Module, sd: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for name, t in model.state_dict().items():
            t.copy_(sd[name].to(t.dtype))
