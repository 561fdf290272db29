"""``fsdp2``: parameters, gradients and optimizer state sharded over ranks with ``fully_shard``.

Each transformer block is one FSDP unit, and the root module (embeddings,
final norm, head) is another. With bf16 precision the unit computes in bf16
and reduces gradients in fp32 (MixedPrecisionPolicy); the sharded fp32
parameters stay the optimizer's master weights. ``replicate > 1`` gives HSDP:
a 2-D mesh (replicate x shard) that shards within groups of
``world_size / replicate`` ranks and all-reduces across groups.

``cpu_offload = true`` keeps the sharded fp32 parameters, their gradients
and the optimizer state in host memory (FSDP2's ``CPUOffloadPolicy``; pinned
on CUDA), so a model too big for one GPU's memory can still train, slowly.
It works on one process too: the plugin then shards over a one-rank group of
its own, which is how an 8B model is meant to fit on one 80 GB GPU.

``tp > 1`` adds tensor + sequence parallelism on one device mesh (``dp`` x ``tp``, dp = world
size / tp): consecutive ranks form a tensor-parallel group, which reads the same batches, and the
model spec's ``parallelize_tensor`` shards its modules over it (before checkpointing and compile);
FSDP then shards over ``dp`` (over nothing when dp = 1). With ``replicate > 1`` too, the mesh is 3-D
(``replicate`` x ``shard`` x ``tp``): HSDP over the data-parallel ranks, TP within each group. Degrees
are checked against the world size before any process group.

``pp > 1`` adds pipeline parallelism (:mod:`plugins.parallelism.pipeline`): the mesh is
``pp`` x ``dp`` x ``tp`` (pp outermost), the model spec's ``pipeline_stages`` gives each rank its
stages, FSDP shards each stage over ``dp`` (parameters kept gathered between micro-batches, as
torchtitan does), and ``pipeline_schedule`` runs a step's micro-batches (at least one per stage;
``Interleaved1F1B`` holds two stages per rank and needs a multiple of ``pp``). Not with
``replicate`` or ``cpu_offload``.

``ep > 1`` adds expert parallelism, as torchtitan does it: the expert-parallel ranks are taken from
the data-parallel ones (they still read different batches; a mesh ``replica`` x ``ep``, replica =
world size / ep, consecutive ranks one ``ep`` group), because a MoE layer's experts hold most of its
weights but each token needs only top-k of them, so splitting them costs no data parallelism. The
model spec's ``parallelize_experts`` keeps each rank's ``n_experts / ep`` experts and exchanges the
routed rows with ``all_to_all_single``. FSDP shards every other parameter over all ranks as before;
each expert module is an FSDP unit of its own, sharded over ``replica`` (the ranks holding the same
experts; on dim 0, or dim 1 where replica x ep exceeds the experts, as torchtitan), so a rank holds
1 / world size of the experts' parameters, gradients and optimizer state. Their gradients are
summed over ``replica`` and divided by the world size (the mean FSDP takes of the others: each
expert's gradient already sums its ``ep`` group's tokens through the exchange). With ``pp > 1`` the
expert-parallel ranks are each stage's data-parallel ones (a mesh ``pp`` x ``replica`` x ``ep``,
replica x ep = dp) and a rank shards its stages' experts only. With ``replicate > 1`` they are a replica
group's shard ranks (a mesh ``replicate`` x ``replica`` x ``ep``) and the experts are HSDP-sharded as
the rest: over ``replica``, all-reduced over ``replicate``. With ``tp > 1`` they are the data-parallel
ranks of each tp index (a mesh ``replica`` x ``ep`` x ``tp``): every tp rank runs a MoE layer whole (the
model spec's TP plan), so the experts repeat over ``tp`` (DTensors replicated on it). Not with ``tp``
and ``pp`` or ``replicate`` together, nor ``cpu_offload``, yet.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as tdist
from torch import nn

from core.api import ConfigError, log, option
from plugins.parallelism import pipeline
from plugins.parallelism.common import clip_grad_norm


@dataclass
class FSDP2Options:
    reshard_after_forward: bool = option(True, "free gathered parameters after each block's forward (less memory, one more all-gather)")
    replicate: int = option(1, "HSDP: number of replica groups; (world size / tp) / replicate ranks shard each replica", ge=1)
    cpu_offload: bool = option(False, "keep sharded parameters, gradients and optimizer state in CPU memory")
    tp: int = option(1, "tensor-parallel degree: ranks of one group that split each layer (world size = dp x tp)", ge=1)
    pp: int = option(1, "pipeline-parallel degree: stages the model's blocks are split into (world size = pp x dp x tp)", ge=1)
    pipeline_schedule: Literal["1F1B", "Interleaved1F1B", "GPipe"] = option(
        "1F1B", "pipeline schedule under pp > 1 (Interleaved1F1B: two stages per rank, micro-batches a multiple of pp)"
    )
    ep: int = option(1, "expert-parallel degree: ranks that split each MoE layer's experts, taken from the data-parallel ranks", ge=1)


class FSDP2:
    shards_parameters = True

    def __init__(self, options: FSDP2Options) -> None:
        self.options = options

        self.tensor_parallel = options.tp
        self.pipeline_parallel = options.pp
        self.pipeline_stages_per_rank = pipeline.stages_per_rank(options.pipeline_schedule)
        self.mesh: Any = None  # the [pp x] dp x tp mesh, made by shard_tensors when tp > 1 or pp > 1
        self.pipeline: pipeline.Pipeline | None = None  # this rank's stages and schedule, made by wrap when pp > 1
        self.expert_parallel = options.ep
        self.expert_mesh: Any = None  # the replica x ep mesh, made by shard_tensors when ep > 1
        self.expert_modules: list[nn.Module] = []  # the model's experts split over ep, FSDP units over replica

    def check_world(self, world_size: int) -> None:
        o = self.options
        if o.pp > 1 and world_size % (o.pp * o.tp):
            raise ConfigError(f"[parallelism] fsdp2: pp = {o.pp} x tp = {o.tp} does not divide the world size {world_size}; expected world size = pp x dp x tp")
        if o.pp > 1 and (o.replicate > 1 or o.cpu_offload):
            raise ConfigError(
                f"[parallelism] fsdp2: pp = {o.pp} with replicate > 1 or cpu_offload is not supported yet; expected replicate = 1, cpu_offload = false"
            )
        if world_size % o.tp:
            raise ConfigError(f"[parallelism] fsdp2: tp = {o.tp} does not divide the world size {world_size}; expected world size = dp x tp")
        if (world_size // o.tp) % o.replicate:
            ranks = f"the world size {world_size}" if o.tp == 1 else f"the {world_size // o.tp} data-parallel ranks (world size {world_size} / tp {o.tp})"
            raise ConfigError(f"[parallelism] fsdp2: replicate = {o.replicate} does not divide {ranks}; expected world size = replicate x shard x tp")
        if o.pp == 1 and o.replicate == 1 and o.tp == 1 and world_size % o.ep:
            raise ConfigError(f"[parallelism] fsdp2: ep = {o.ep} does not divide the world size {world_size}; expected a divisor of the world size")
        if o.replicate > 1 and (world_size // o.tp // o.replicate) % o.ep:
            shard = world_size // o.tp // o.replicate
            raise ConfigError(
                f"[parallelism] fsdp2: ep = {o.ep} does not divide the {shard} ranks of a replica group (world size {world_size} / replicate {o.replicate}); "
                f"expected a divisor of {shard}"
            )
        dp = world_size // (o.pp * o.tp)
        if o.pp > 1 and dp % o.ep:
            raise ConfigError(
                f"[parallelism] fsdp2: ep = {o.ep} does not divide the {dp} data-parallel ranks of a pipeline stage (world size {world_size} / pp {o.pp}); "
                f"expected a divisor of {dp}"
            )
        if o.ep > 1 and o.tp > 1 and (o.pp > 1 or o.replicate > 1):
            raise ConfigError(
                f"[parallelism] fsdp2: ep = {o.ep} with tp = {o.tp} and pp or replicate is not supported yet; expected pp = 1 and replicate = 1 with ep and tp"
            )
        if o.ep > 1 and o.tp > 1 and (world_size // o.tp) % o.ep:
            raise ConfigError(
                f"[parallelism] fsdp2: ep = {o.ep} does not divide the {world_size // o.tp} data-parallel ranks (world size {world_size} / tp {o.tp}); "
                f"expected a divisor of {world_size // o.tp}"
            )
        if o.ep > 1 and o.cpu_offload:
            raise ConfigError(f"[parallelism] fsdp2: ep = {o.ep} with cpu_offload is not supported yet; expected ep = 1 or cpu_offload = false")
        if o.tp > 1 and o.cpu_offload:
            raise ConfigError(f"[parallelism] fsdp2: cpu_offload with tp = {o.tp} is not supported; expected tp = 1 or cpu_offload = false")

    def check_micro_batches(self, micro_batches: int) -> None:
        pipeline.check_micro_batches(self.options.pipeline_schedule, self.options.pp, micro_batches)

    def shard_tensors(self, model: nn.Module, spec, dist) -> None:
        """tp > 1 or pp > 1: the [pp x] dp x tp mesh (replicate x shard x tp with ``replicate > 1``), and
        with tp > 1 the model's modules sharded over its ``tp`` dimension; ep > 1: the [pp x] replica x ep
        mesh, and the model's experts split over its ``ep`` dimension."""
        o = self.options
        from torch.distributed.device_mesh import init_device_mesh

        if o.ep > 1:  # the [pp x] [replicate x] replica x ep [x tp] ranks, in order: ep groups inside a stage's, a replica group's, ranks
            shard = dist.world_size // o.pp // o.replicate // o.tp
            outer = (("pp", o.pp),) if o.pp > 1 else (("replicate", o.replicate),) if o.replicate > 1 else ()
            inner = (("tp", o.tp),) if o.tp > 1 else ()
            dims = (*outer, ("replica", shard // o.ep), ("ep", o.ep), *inner)
            self.expert_mesh = init_device_mesh(dist.device.type, tuple(n for _, n in dims), mesh_dim_names=tuple(name for name, _ in dims))
            # under tp every tensor-parallel rank runs the MoE layers whole: the experts repeat over tp
            self.expert_modules = spec.parallelize_experts(model, self.expert_mesh["ep", "tp"] if o.tp > 1 else self.expert_mesh["ep"])
        if o.tp == 1 and o.pp == 1:
            return
        if o.pp > 1:
            self.mesh = init_device_mesh(dist.device.type, (o.pp, dist.world_size // (o.pp * o.tp), o.tp), mesh_dim_names=("pp", "dp", "tp"))
        elif o.replicate > 1:
            dp = dist.world_size // o.tp
            self.mesh = init_device_mesh(dist.device.type, (o.replicate, dp // o.replicate, o.tp), mesh_dim_names=("replicate", "shard", "tp"))
        else:
            self.mesh = init_device_mesh(dist.device.type, (dist.world_size // o.tp, o.tp), mesh_dim_names=("dp", "tp"))
        if o.tp > 1:
            spec.parallelize_tensor(model, self.mesh["tp"])

    def wrap(self, model: nn.Module, spec, dist, precision) -> nn.Module:
        o = self.options
        if o.pp > 1:
            return self.wrap_pipeline(model, spec, dist, precision)
        dp = dist.world_size // o.tp
        if dp == 1 and not o.cpu_offload:
            return model  # nothing to shard over: behave like a single process (tensor-parallel only)
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        if dist.world_size == 1:
            one_rank_group(dist.device)
        device_type = dist.device.type
        if o.tp > 1:
            mesh = self.mesh["replicate", "shard"] if o.replicate > 1 else self.mesh["dp"]
        elif o.replicate > 1:
            mesh = init_device_mesh(device_type, (o.replicate, dist.world_size // o.replicate), mesh_dim_names=("replicate", "shard"))
        else:
            mesh = init_device_mesh(device_type, (dist.world_size,), mesh_dim_names=("shard",))
        kwargs: dict[str, Any] = {"mesh": mesh}
        if precision.param_dtype is not None:
            kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=precision.param_dtype, reduce_dtype=torch.float32)
        if o.cpu_offload:
            kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=dist.device.type == "cuda")
        self.shard_experts(model, kwargs | {"reshard_after_forward": o.reshard_after_forward}, dist)
        blocks = spec.blocks(model)
        for i, block in enumerate(blocks):
            # The last block's parameters are needed again at once by the backward pass.
            fully_shard(block, reshard_after_forward=o.reshard_after_forward and i < len(blocks) - 1, **kwargs)
        fully_shard(model, reshard_after_forward=o.reshard_after_forward, **kwargs)
        if o.cpu_offload:
            log.info(f"fsdp2: parameters, gradients and optimizer state offloaded to host memory ({dist.world_size} rank(s))")
        return model

    def shard_experts(self, model: nn.Module, kwargs: dict[str, Any], dist) -> None:
        """ep > 1: each expert module ``model`` still holds an FSDP unit over ``replica`` (``kwargs``: the
        other units' options), sharded on dim 0 unless replica x ep exceeds the experts (then dim 1 where
        it splits evenly; HSDP: repeated over ``replicate``), its gradients divided by the data-parallel
        ranks (replicate x replica x ep, the mean FSDP takes of the others); the blocks' units, made
        after, leave its parameters out."""
        kept = {id(m) for m in model.modules()}
        modules = [m for m in self.expert_modules if id(m) in kept]  # under pp, this rank's stages' experts
        if not modules:
            return
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor import Shard

        replicas = self.expert_mesh["replica"]
        ranks = replicas.size() * self.expert_parallel  # a shard group's (or stage's) data-parallel ranks
        hsdp = self.options.replicate > 1  # HSDP as the other units: sharded over replica, all-reduced over replicate
        mesh = self.expert_mesh["replicate", "replica"] if hsdp else replicas

        def placement(p: nn.Parameter) -> Shard | None:  # dim 1 must split evenly (FSDP); dim 0 may be padded
            return Shard(1) if ranks > p.shape[0] and p.shape[1] % replicas.size() == 0 else None

        for module in modules:
            fully_shard(module, **(kwargs | {"mesh": mesh, "shard_placement_fn": placement}))
            module.set_gradient_divide_factor(ranks * self.options.replicate)  # type: ignore[operator]  # an FSDPModule now
            # off CUDA a sum then a division (gloo has no pre-multiplied sum); not over one replica,
            # where FSDP (torch 2.13) would divide twice
            module.set_force_sum_reduction_for_comms(dist.device.type != "cuda" and replicas.size() > 1)  # type: ignore[operator]
        params = [p for m in modules for p in m.parameters()]
        held, total = sum(p.to_local().numel() for p in params), sum(p.numel() for p in params)  # type: ignore[attr-defined]  # DTensors
        log.info(
            f"fsdp2: experts split over ep {self.expert_parallel}, sharded over replica {replicas.size()}"
            + (f", replicated over replicate {self.options.replicate}" if hsdp else "")
            + f": {held:,} of their {total:,} parameters on this rank"
        )

    def wrap_pipeline(self, model: nn.Module, spec, dist, precision) -> nn.Module:
        """This rank's stages (``model`` pruned to them), each FSDP-sharded over ``dp`` when dp > 1,
        and the schedule that runs them; the stages, in a ModuleList, are the module to call."""
        o = self.options
        n_stages = o.pp * self.pipeline_stages_per_rank
        pp_rank = self.mesh["pp"].get_local_rank()
        stage_ids = pipeline.pipeline_stage_ids(pp_rank, o.pp, o.pipeline_schedule)
        stages = spec.pipeline_stages(model, stage_ids, n_stages)
        if self.mesh["dp"].size() > 1:
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            kwargs: dict[str, Any] = {"mesh": self.mesh["dp"], "reshard_after_forward": False}  # gathered across the micro-batches
            if precision.param_dtype is not None:
                kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=precision.param_dtype, reduce_dtype=torch.float32)
            self.shard_experts(model, kwargs, dist)
            for block in spec.blocks(model):
                fully_shard(block, **kwargs)
            for stage in stages:
                fully_shard(stage, **kwargs)
        self.pipeline = pipeline.Pipeline(stages, stage_ids, n_stages, o.pipeline_schedule, self.mesh["pp"], dist.device)
        return nn.ModuleList(stages)

    def pipeline_step(self, model: nn.Module, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """The step's micro-batches through the schedule: forward, backward, the mean loss on every rank."""
        assert self.pipeline is not None, "wrap() made the pipeline (pp > 1)"
        return self.pipeline.step(micro_batches, tensor_parallel=self.options.tp > 1)

    def sync_context(self, model: nn.Module, sync: bool):
        """Gradient sync on the last micro-step only; with tp > 1, the loss computed on the
        vocabulary-sharded logits (``loss_parallel``, forward and backward)."""
        set_sync = getattr(model, "set_requires_gradient_sync", None)  # an FSDPModule's
        if set_sync is not None:
            set_sync(sync)
        if self.options.tp > 1:
            from torch.distributed.tensor.parallel import loss_parallel

            return loss_parallel()
        return contextlib.nullcontext()

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        """The global gradient norm (over the stages under pp > 1; the experts' mesh and the others' under ep > 1)."""
        if self.pipeline is not None:
            return self.pipeline.clip_grad_norm(model, max_norm)
        return clip_grad_norm(model, max_norm)


def one_rank_group(device: torch.device) -> None:
    """A process group of this process alone (an in-memory store, no rendezvous), for
    ``fully_shard`` with CPU offload in a single-process run."""
    if not tdist.is_initialized():
        tdist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=tdist.HashStore(), rank=0, world_size=1)
