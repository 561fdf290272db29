"""Pipeline parallelism's refusals, before any process group: a model without a stage split, a
stage count its layers cannot take, features the pipelined step does not run, and a micro-batch
count the schedule cannot run. Each is one line (ConfigError, exit 2)."""

from __future__ import annotations

from typing import Any

from core.config.run_config import RunConfig
from core.contract.errors import ConfigError
from core.contract.members import member
from core.preflight.plugin_checks import call_plugin


def check_pipeline(components: dict[str, Any], rc: RunConfig, path: str) -> int:
    """The parallelism's pipeline stage count, once the model and the run's options can take it."""
    pp = member("parallelism", components["parallelism"], "pipeline_parallel")
    if pp == 1:
        return 1
    model_name = rc.slots["model"].component.name
    where = f"{path}: [parallelism] pp = {pp}"
    if member("parallelism", components["parallelism"], "pipeline_step") is None:
        raise ConfigError(f"{where}: parallelism {rc.slots['parallelism'].component.name!r} has no pipeline_step to run the stages; expected pp = 1")
    check = member("model", components["model"], "check_pipeline")
    if check is None:
        raise ConfigError(f"{where}: model {model_name!r} has no pipeline stage split (pipeline_stages); expected pp = 1")
    n_stages = pp * member("parallelism", components["parallelism"], "pipeline_stages_per_rank")
    call_plugin(f"model {model_name!r}: check_pipeline", check, n_stages)
    if rc.train.micro_batch == "auto":
        raise ConfigError(f'{where}: train.micro_batch = "auto" with pipeline parallelism is not supported (its probe runs the whole model); expected a number')
    if rc.sections["validation"].every:
        raise ConfigError(
            f"{where}: validation during training with pipeline parallelism is not supported yet (it runs the whole model); expected validation.every = 0"
        )
    return pp


def check_pipeline_micro_batches(parallelism: Any, pp: int, micro_batches: int, path: str) -> None:
    """A step's micro-batches (the gradient accumulation) fill the pipeline: at least one per stage,
    and what the parallelism's schedule asks besides (its ``check_micro_batches``)."""
    if pp == 1:
        return
    if micro_batches < pp:
        raise ConfigError(
            f"{path}: [parallelism] pp = {pp}: {micro_batches} micro-batch(es) per step (global_batch_tokens / (micro_batch x seq_len x "
            f"data-parallel ranks)) is below the stage count; expected at least {pp} (a smaller train.micro_batch)"
        )
    check = member("parallelism", parallelism, "check_micro_batches")
    if check is not None:
        call_plugin("parallelism: check_micro_batches", check, micro_batches)
