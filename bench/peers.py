"""Peers: plait against a bare loop and the peer trainers, same shape, batch, precision and optimizer.

Candidates, each in its own subprocess (imports and threads never mix):

- ``plait``: plait's own Trainer (``fit()``), its token_bin loader, ddp plugin, AdamW.
- ``bare``: a hand-written loop on a small Llama-style module defined in this file
  (independent of plait's model code), random windows read from the same corpus.
- ``olmo-core``, ``litgpt``, ``torchtitan``: the peers' own model classes and, as
  far as they go on CPU, their train-step helpers (see each ``peer_*`` function).

All train the same shape (plait's llama3 ``debug`` flavor by default: 2 layers,
dim 128, 4 heads, 2 kv heads, ffn 384, vocab 512) at seq 512, micro-batch 8 per
rank, fp32, AdamW (lr 1e-4, betas 0.9/0.95, weight decay 0.1), grad clip 1.0,
one optimizer step per micro-batch. The time of a step is the wall time from the
end of the previous step to the end of this one, data loading included; a
subprocess runs ``--warmup`` steps, then ``--steps`` timed ones and reports their
median (rank 0's, after a barrier, with two processes). Rounds alternate between
candidates (A B C, A B C, ...); the table gives the median and range over rounds.
A peer that cannot run is reported with the first line of its error, never a figure.

The peers live in a separate environment (``pip install -e .[peers]`` in a venv of
its own); point ``--peers-python`` (or ``PLAIT_PEERS_PYTHON``) at its interpreter.
This process never imports a peer.

    python -m bench.peers --peers-python /work/peers-venv/bin/python --rounds 5 --steps 10 --nproc 1,2
    python -m bench.peers --candidates plait,bare --rounds 1 --steps 2 --no-record
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CORPUS = REPO / "plugins" / "data" / "corpus" / "shakespeare"
RESULT = "PEERS_RESULT "

# Candidate -> (distribution name for the version, import name to check it is installed), None: ours.
PEERS = {"olmo-core": ("ai2-olmo-core", "olmo_core"), "litgpt": ("litgpt", "litgpt"), "torchtitan": ("torchtitan", "torchtitan")}
CANDIDATES = ["plait", "bare", *PEERS]
# What each candidate's figure times (the table's "what ran" column).
WHAT_RAN = {
    "plait": "plait's Trainer.fit(): its llama3 model, token_bin loader, ddp plugin, AdamW, clip",
    "bare": "hand-written loop, this file's own Llama-style module, torch AdamW + clip_grad_norm_ (DDP on 2)",
    "olmo-core": "OLMo-core llama_like Transformer; TransformerTrainModule train_batch / optim_step / zero_grads "
    "(AdamWConfig, max_grad_norm, its DDP on 2); its Trainer loop not used",
    "litgpt": "litgpt GPT + initialize_weights under Lightning Fabric (DDP on 2; pretrain picks FSDP there); "
    "pretrain.fit's step: chunked_cross_entropy, fabric.backward, fabric.clip_gradients; eager",
    "torchtitan": "tried: its Trainer (config.build()), then its Llama3Model in the bench loop",
}

# The shapes of plait's llama3 flavors (model_specs/llama3/spec.py FLAVORS), repeated here so the
# peers' processes (another environment, no plait) need not import plait. The debug flavor at vocab 512.
SHAPES = {
    "debug": {"n_layers": 2, "dim": 128, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 384, "vocab_size": 512, "rope_theta": 10_000.0, "tie": False},
    "50m": {"n_layers": 8, "dim": 768, "n_heads": 12, "n_kv_heads": 4, "ffn_dim": 2048, "vocab_size": 50_257, "rope_theta": 10_000.0, "tie": True},
}
LR, BETAS, WD, EPS, CLIP = 1e-4, (0.9, 0.95), 0.1, 1e-8, 1.0


# --------------------------------------------------------------------------- worker side


def world() -> tuple[int, int]:
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


class Windows:
    """Random windows of seq_len + 1 tokens from the shipped corpus (uint16 memmap), per rank."""

    def __init__(self, seq_len: int, micro_batch: int, vocab: int, seed: int = 0) -> None:
        import numpy as np

        self.np = np
        self.data = np.memmap(CORPUS / "train.bin", dtype=np.uint16, mode="r")
        self.rng = np.random.default_rng(seed + world()[0])
        self.seq_len, self.micro_batch, self.vocab = seq_len, micro_batch, vocab

    def next(self):
        import torch

        np, T = self.np, self.seq_len
        starts = self.rng.integers(0, len(self.data) - T - 1, self.micro_batch)
        rows = np.stack([self.data[s : s + T + 1] for s in starts]).astype(np.int64) % self.vocab
        t = torch.from_numpy(rows)
        return t[:, :-1], t[:, 1:]


def init_dist():
    import torch.distributed as dist

    if world()[1] > 1 and not dist.is_initialized():
        dist.init_process_group("gloo")
    return dist


def barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def run_steps(step_fn, warmup: int, steps: int) -> list[float]:
    """Call ``step_fn()`` warmup + steps times; the wall time of each timed call."""
    for _ in range(warmup):
        step_fn()
    barrier()
    times, last = [], time.perf_counter()
    for _ in range(steps):
        step_fn()
        now = time.perf_counter()
        times.append(now - last)
        last = now
    return times


def adamw_groups(model, embed_names=("embed", "wte", "tok_embeddings")):
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and not any(e in n for e in embed_names)]
    other = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and not any(e in n for e in embed_names))]
    return [{"params": decay, "weight_decay": WD}, {"params": other, "weight_decay": 0.0}]


# ---- bare: a small Llama-style decoder written for this file only


def bare_model(s: dict):
    import torch
    import torch.nn.functional as F
    from torch import nn

    hd = s["dim"] // s["n_heads"]

    class Norm(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.w = nn.Parameter(torch.ones(d))

        def forward(self, x):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * self.w

    def rope(x, cos, sin):  # x [B, H, T, hd], interleaved-free "rotate half"
        x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
        return x * cos + torch.cat([-x2, x1], -1) * sin

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            d, h, kv = s["dim"], s["n_heads"], s["n_kv_heads"]
            self.n1, self.n2 = Norm(d), Norm(d)
            self.qkv = nn.Linear(d, (h + 2 * kv) * hd, bias=False)
            self.o = nn.Linear(h * hd, d, bias=False)
            self.up = nn.Linear(d, 2 * s["ffn_dim"], bias=False)
            self.down = nn.Linear(s["ffn_dim"], d, bias=False)

        def forward(self, x, cos, sin):
            B, T, _ = x.shape
            h, kv = s["n_heads"], s["n_kv_heads"]
            q, k, v = self.qkv(self.n1(x)).view(B, T, h + 2 * kv, hd).transpose(1, 2).split([h, kv, kv], dim=1)
            q, k = rope(q, cos, sin), rope(k, cos, sin)
            y = F.scaled_dot_product_attention(q, k.repeat_interleave(h // kv, 1), v.repeat_interleave(h // kv, 1), is_causal=True)
            x = x + self.o(y.transpose(1, 2).reshape(B, T, h * hd))
            gate, up = self.up(self.n2(x)).chunk(2, -1)
            return x + self.down(F.silu(gate) * up)

    class Decoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(s["vocab_size"], s["dim"])
            self.layers = nn.ModuleList(Layer() for _ in range(s["n_layers"]))
            self.norm = Norm(s["dim"])
            self.head = nn.Linear(s["dim"], s["vocab_size"], bias=False)
            if s["tie"]:
                self.head.weight = self.embed.weight
            inv = 1.0 / s["rope_theta"] ** (torch.arange(0, hd, 2).float() / hd)
            ang = torch.outer(torch.arange(4096).float(), inv).repeat(1, 2)
            self.register_buffer("cos", ang.cos(), persistent=False)
            self.register_buffer("sin", ang.sin(), persistent=False)
            for m in self.modules():
                if isinstance(m, (nn.Linear, nn.Embedding)):
                    nn.init.normal_(m.weight, std=0.02)

        def forward(self, idx, targets):
            T = idx.shape[1]
            x = self.embed(idx)
            for layer in self.layers:
                x = layer(x, self.cos[:T], self.sin[:T])
            logits = self.head(self.norm(x))
            return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    return Decoder()


def ddp_wrap(model):
    if world()[1] > 1:
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model)
    return model


def worker_bare(a, s):
    import torch

    init_dist()
    torch.manual_seed(0)
    model = ddp_wrap(bare_model(s))
    opt = torch.optim.AdamW(adamw_groups(model), lr=LR, betas=BETAS, eps=EPS)
    data = Windows(a.seq_len, a.micro_batch, s["vocab_size"])

    def step():
        x, y = data.next()
        model(x, y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return run_steps(step, a.warmup, a.steps), {"version": "this file"}


# ---- plait: its own Trainer


def plait_trainer(a, total_steps: int):
    """plait's Trainer, built for this file's shape, batch, precision and optimizer (see the module docstring)."""
    from core.loop.trainer import Trainer
    from core.preflight.prepare import prepare
    from core.runtime import distributed

    ws = world()[1]
    overrides = [
        f"--model.flavor={a.flavor}",
        *(["--model.vocab_size=512"] if a.flavor == "debug" else []),
        f"--data.seq_len={a.seq_len}",
        f"--train.micro_batch={a.micro_batch}",
        f"--train.global_batch_tokens={a.micro_batch * a.seq_len * ws}",
        f"--train.steps={total_steps}",
        "--train.log_every=1000000",
        f"--train.device={a.device}",
        "--precision.name=fp32",
        f"--train.grad_clip={CLIP}",
        "--monitors.enabled=[]",
        "--checkpoint.at_end=false",
        "--checkpoint.resume=none",
        f"--train.output_dir=/tmp/plait-bench-peers-{os.getpid()}",
        "--lr_schedule.name=constant",
        "--lr_schedule.warmup_steps=0",
        "--optimizer.name=adamw",
        f"--optimizer.lr={LR}",
        f"--optimizer.betas=[{BETAS[0]}, {BETAS[1]}]",
        f"--optimizer.weight_decay={WD}",
        "--parallelism.name=ddp",
    ]
    prep = prepare(str(REPO / "train_configs" / "debug_cpu.toml"), overrides)
    info = distributed.init(a.device)
    trainer = Trainer(prep, info)
    trainer.build()
    return trainer


def worker_plait(a, s):
    from core.contract.hookspecs import hookimpl, register_monitor

    trainer = plait_trainer(a, a.warmup + a.steps)
    ends: list[float] = []

    class StepClock:
        @hookimpl
        def plait_train_start(self):
            ends.append(time.perf_counter())

        @hookimpl
        def plait_step_end(self, step):
            if step == a.warmup:
                barrier()  # the timed steps start together on every rank, as in run_steps
                ends.append(time.perf_counter())
            elif step > a.warmup:
                ends.append(time.perf_counter())

    register_monitor(trainer.monitors.pm, "bench_step_clock", StepClock())
    trainer.monitors.names.append("bench_step_clock")
    code = trainer.fit()
    if code:
        raise RuntimeError(f"plait's fit() returned exit code {code}")
    ends = ends[1:] if a.warmup else ends
    import importlib.metadata as md

    return [b - e for e, b in itertools.pairwise(ends)], {"version": md.version("plait")}


# ---- the peers


def peer_version(dist_name: str) -> str:
    import importlib.metadata as md

    return md.version(dist_name)


def worker_olmo_core(a, s):
    """OLMo-core's TransformerTrainModule: its llama_like model, parallelize_model (DDP on 2 ranks), AdamWConfig
    optimizer, and its own train_batch / optim_step / zero_grads, called as its Trainer calls them. Its Trainer
    (callbacks, metric reduction, data loader) is left out: a stand-in takes the metrics the module records."""
    import torch
    from olmo_core.distributed.parallel import DataParallelType
    from olmo_core.nn.transformer import TransformerConfig
    from olmo_core.optim import AdamWConfig
    from olmo_core.train.train_module import (
        TransformerDataParallelConfig,
        TransformerTrainModule,
    )

    init_dist()
    torch.manual_seed(0)
    cfg = TransformerConfig.llama_like(
        d_model=s["dim"],
        vocab_size=s["vocab_size"],
        n_layers=s["n_layers"],
        n_heads=s["n_heads"],
        n_kv_heads=s["n_kv_heads"],
        rope_theta=int(s["rope_theta"]),
        hidden_size_multiple_of=s["ffn_dim"],
        layer_norm_eps=1e-5,
    )
    model = cfg.build(init_device="cpu")
    ffn = model.blocks["0"].feed_forward.w1.out_features
    if ffn != s["ffn_dim"]:
        raise RuntimeError(f"OLMo-core's llama_like gave ffn {ffn}, not {s['ffn_dim']}")
    optim = AdamWConfig(lr=LR, betas=BETAS, weight_decay=WD, eps=EPS)
    dp = TransformerDataParallelConfig(name=DataParallelType.ddp) if world()[1] > 1 else None
    module = TransformerTrainModule(
        model,
        optim,
        rank_microbatch_size=a.micro_batch * a.seq_len,
        max_sequence_length=a.seq_len,
        max_grad_norm=CLIP,
        dp_config=dp,
        device=torch.device("cpu"),
    )

    class MetricsSink:  # what the module asks of its Trainer during a step
        dp_process_group = None

        def record_metric(self, *args, **kwargs):
            pass

        def record_ce_loss(self, *args, **kwargs):
            pass

    module._trainer = MetricsSink()
    data = Windows(a.seq_len, a.micro_batch, s["vocab_size"])

    def step():
        x, y = data.next()
        module.zero_grads()
        module.train_batch({"input_ids": x, "labels": y})
        module.optim_step()
        module.zero_grads()

    return run_steps(step, a.warmup, a.steps), {"version": peer_version("ai2-olmo-core")}


def worker_litgpt(a, s):
    """litgpt's pretrain step: its GPT model and initialize_weights under Lightning Fabric (DDP on 2 ranks, where
    litgpt's pretrain would pick FSDP), instantiate_torch_optimizer, chunked_cross_entropy, fabric.backward,
    fabric.clip_gradients, as litgpt.pretrain.fit runs them; eager (pretrain compiles by default; all run eager here)."""
    import lightning as L
    from litgpt.config import Config
    from litgpt.model import GPT
    from litgpt.pretrain import initialize_weights
    from litgpt.utils import chunked_cross_entropy, instantiate_torch_optimizer

    ws = world()[1]
    fabric = L.Fabric(accelerator="cpu", devices=ws, strategy="ddp" if ws > 1 else "auto", precision="32-true")
    fabric.launch()
    fabric.seed_everything(0)
    config = Config(
        name="plait-" + a.flavor,
        block_size=a.seq_len,
        vocab_size=s["vocab_size"],
        padded_vocab_size=s["vocab_size"],
        n_layer=s["n_layers"],
        n_embd=s["dim"],
        n_head=s["n_heads"],
        n_query_groups=s["n_kv_heads"],
        intermediate_size=s["ffn_dim"],
        rotary_percentage=1.0,
        parallel_residual=False,
        bias=False,
        norm_class_name="RMSNorm",
        norm_eps=1e-5,
        mlp_class_name="LLaMAMLP",
        rope_base=int(s["rope_theta"]),
    )
    with fabric.init_module(empty_init=True):
        model = GPT(config)
    initialize_weights(fabric, model, n_layer=config.n_layer, n_embd=config.n_embd)
    if s["tie"]:
        model.transformer.wte.weight = model.lm_head.weight
    model = fabric.setup(model)
    optimizer = instantiate_torch_optimizer(
        {"class_path": "torch.optim.AdamW", "init_args": {"lr": LR, "weight_decay": WD, "betas": BETAS, "eps": EPS}}, model.parameters(), fused=False
    )
    optimizer = fabric.setup_optimizers(optimizer)
    data = Windows(a.seq_len, a.micro_batch, s["vocab_size"])

    def step():
        x, y = data.next()
        logits = model(x)
        loss = chunked_cross_entropy(logits, y)
        fabric.backward(loss)
        fabric.clip_gradients(model, optimizer, max_norm=CLIP)
        optimizer.step()
        optimizer.zero_grad()

    return run_steps(step, a.warmup, a.steps), {"version": peer_version("litgpt")}


def torchtitan_model_config(s, seq_len):
    """torchtitan's Llama3Model.Config at the bench's shape, built as its own ``debugmodel`` flavor is
    (torchtitan.models.llama3._debugmodel), with plain RoPE (no Llama-3.1 scaling, as plait) and its flex attention."""
    import torchtitan.models.llama3 as tl
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm

    dim, v, hd = s["dim"], s["vocab_size"], s["dim"] // s["n_heads"]
    return tl.Llama3Model.Config(
        dim=dim,
        vocab_size=v,
        tok_embeddings=Embedding.Config(num_embeddings=v, embedding_dim=dim, param_init=tl._EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=tl._NORM_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=v, param_init=tl._output_linear_init(dim)),
        layers=tl._build_llama3_layers(
            fuse_qkv=True,
            n_layers=s["n_layers"],
            dim=dim,
            n_heads=s["n_heads"],
            n_kv_heads=s["n_kv_heads"],
            hidden_dim=s["ffn_dim"],
            rope=ComplexRoPE.Config(dim=hd, max_seq_len=max(seq_len, 1024), theta=s["rope_theta"]),
            attn_backend="flex",
        ),
    )


def worker_torchtitan(a, s):
    """torchtitan: first its Trainer (config.build(), as torchtitan.train does); if that cannot run here, its
    Llama3Model (flex attention, its own weight init and attention masks) in the bench's loop (torch AdamW,
    clip_grad_norm_, DDP on 2 ranks). The Trainer's error is reported beside the figure."""
    import dataclasses
    import os

    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    for k, v in (("LOCAL_RANK", "0"), ("RANK", "0"), ("WORLD_SIZE", "1")):  # as torchrun would set them
        os.environ.setdefault(k, v)
    trainer_error = None
    try:
        config = llama3_debugmodel()
        config.model_spec = dataclasses.replace(config.model_spec, model=torchtitan_model_config(s, a.seq_len))
        config.training.seq_len, config.training.local_batch_size, config.training.steps = a.seq_len, a.micro_batch, a.warmup + a.steps
        config.build()
        raise RuntimeError("torchtitan's Trainer built on CPU: time it through Trainer.train_step (not wired in this bench)")
    except Exception as e:  # noqa: BLE001 - reported beside the figure
        lines = (str(e).strip() or type(e).__name__).splitlines()
        trainer_error = f"{type(e).__name__}: {lines[0] if lines else ''}"

    try:
        return torchtitan_model_in_bench_loop(a, s, trainer_error)
    except Exception as e:
        lines = (str(e).strip() or type(e).__name__).splitlines()
        raise PeerCannot(
            f"its Trainer: {trainer_error}; its Llama3Model (flex attention) in the bench loop: {type(e).__name__}: {lines[0] if lines else ''}"
        ) from e


def torchtitan_model_in_bench_loop(a, s, trainer_error):
    import torch
    import torch.nn.functional as F

    init_dist()
    torch.manual_seed(0)
    with torch.device("meta"):
        model = torchtitan_model_config(s, a.seq_len).build()
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_states(buffer_device=None) if hasattr(model, "init_states") else model.init_weights()
    if s["tie"]:
        model.lm_head.weight = model.tok_embeddings.weight
    masks_of = model.get_attention_masks
    model = ddp_wrap(model)
    opt = torch.optim.AdamW(adamw_groups(model), lr=LR, betas=BETAS, eps=EPS)
    data = Windows(a.seq_len, a.micro_batch, s["vocab_size"])

    def step():
        x, y = data.next()
        positions = torch.arange(a.seq_len).expand(x.shape[0], -1)
        pred = model(x, positions=positions, attention_masks=masks_of(positions))
        F.cross_entropy(pred.flatten(0, 1).float(), y.flatten()).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return run_steps(step, a.warmup, a.steps), {"version": peer_version("torchtitan"), "trainer_error": trainer_error}


WORKERS = {"plait": worker_plait, "bare": worker_bare, "olmo-core": worker_olmo_core, "litgpt": worker_litgpt, "torchtitan": worker_torchtitan}


class PeerCannot(RuntimeError):
    """What a peer could not do, already said in full (no exception type in front)."""


def worker_main(a) -> int:
    s = dict(SHAPES[a.flavor])
    if a.flavor == "debug":
        s["vocab_size"] = 512
    rank, _ = world()
    out: dict = {"candidate": a.worker}
    try:
        import torch

        out["torch"] = torch.__version__
        times, extra = WORKERS[a.worker](a, s)
        out.update(extra, times=times)
    except BaseException as e:  # noqa: BLE001 - reported, never a figure
        lines = (str(e).strip() or type(e).__name__).splitlines()
        out["error"] = lines[0] if isinstance(e, PeerCannot) else f"{type(e).__name__}: {lines[0] if lines else ''}"
        if a.worker in PEERS:
            import importlib.metadata as md

            with contextlib.suppress(md.PackageNotFoundError):
                out["version"] = peer_version(PEERS[a.worker][0])
        if os.environ.get("PLAIT_BENCH_TRACEBACK"):
            import traceback

            traceback.print_exc()
    if rank == 0:
        print(RESULT + json.dumps(out), flush=True)
    with contextlib.suppress(Exception):  # leaving anyway: a failed teardown changes no figure
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    return 0 if "times" in out else 3


# --------------------------------------------------------------------------- driver side


def python_for(cand: str, a) -> str:
    return a.peers_python if cand in PEERS else sys.executable


def installed(python: str, module: str) -> bool:
    code = f"import importlib.util, sys; sys.exit(0 if importlib.util.find_spec({module!r}) else 1)"
    return subprocess.run([python, "-c", code], cwd=REPO, capture_output=True, check=False).returncode == 0


def launch(cand: str, nproc: int, a) -> dict:
    py = python_for(cand, a)
    worker = [
        "-m",
        "bench.peers",
        "--worker",
        cand,
        "--flavor",
        a.flavor,
        "--seq-len",
        str(a.seq_len),
        "--micro-batch",
        str(a.micro_batch),
        "--warmup",
        str(a.warmup),
        "--steps",
        str(a.steps),
        "--device",
        a.device,
    ]
    if nproc == 1:
        cmd = [py, *worker]
    else:
        cmd = [py, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *worker]
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    try:
        p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=env, timeout=a.timeout, check=False)
    except subprocess.TimeoutExpired:
        return {"candidate": cand, "error": f"subprocess ran past --timeout {a.timeout:g} s"}
    for line in p.stdout.splitlines():
        if line.startswith(RESULT):
            return json.loads(line[len(RESULT) :])
    tail = [ln for ln in (p.stderr + p.stdout).splitlines() if ln.strip()]
    err = next((ln for ln in reversed(tail) if "Error" in ln or "error" in ln), tail[-1] if tail else f"exit {p.returncode}")
    return {"candidate": cand, "error": f"subprocess exited {p.returncode}: {err.strip()}"}


def load_average() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:
        return float("nan")


def fmt_ms(x: float) -> str:
    return f"{x * 1000:.1f}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worker", choices=CANDIDATES, help=argparse.SUPPRESS)
    p.add_argument("--candidates", default=",".join(CANDIDATES), help=f"comma-separated, of {', '.join(CANDIDATES)}")
    p.add_argument("--flavor", default="debug", choices=list(SHAPES))
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10, help="timed steps per subprocess")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--nproc", default="1", help="comma-separated process counts, e.g. 1,2 (gloo, torchrun)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument(
        "--peers-python",
        default=os.environ.get("PLAIT_PEERS_PYTHON", sys.executable),
        help="interpreter of the environment the peers are installed in (default: $PLAIT_PEERS_PYTHON, else this one)",
    )
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per subprocess")
    p.add_argument(
        "--max-minutes", type=float, default=0.0, help="start no new round after this many minutes (0: no limit); the table says how many rounds ran"
    )
    p.add_argument("--no-record", action="store_true", help="print only; do not append to bench/results.jsonl")
    a = p.parse_args(argv)
    if a.worker:
        return worker_main(a)

    cands = [c.strip() for c in a.candidates.split(",") if c.strip()]
    unknown = [c for c in cands if c not in CANDIDATES]
    if unknown:
        print(f"bench.peers: unknown candidate {unknown[0]!r}; candidates: {', '.join(CANDIDATES)}", file=sys.stderr)
        return 2
    try:
        nprocs = [int(n) for n in a.nproc.split(",")]
        assert all(n >= 1 for n in nprocs) and min(a.steps, a.rounds) >= 1 and a.warmup >= 0
    except (ValueError, AssertionError):
        print("bench.peers: --nproc takes positive integers (1,2); --steps and --rounds >= 1, --warmup >= 0", file=sys.stderr)
        return 2
    if a.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("bench.peers: --device cuda asked, but torch sees no CUDA device", file=sys.stderr)
            return 2
    for c in cands:
        if c in PEERS and not installed(a.peers_python, PEERS[c][1]):
            print(
                f"bench.peers: peer {c!r} is not installed for {a.peers_python} (pip install {PEERS[c][0]}, "
                "or point --peers-python at the environment that has it)",
                file=sys.stderr,
            )
            return 2

    load_start = load_average()
    runs: dict[tuple[str, int], list[dict]] = {(c, n): [] for n in nprocs for c in cands}
    t_start, rounds_done = time.monotonic(), 0
    for r in range(a.rounds):
        if r and a.max_minutes and time.monotonic() - t_start > a.max_minutes * 60:
            print(f"bench.peers: --max-minutes {a.max_minutes:g} reached: {r} of {a.rounds} rounds ran", file=sys.stderr, flush=True)
            break
        rounds_done = r + 1
        for n in nprocs:
            for c in cands:
                if runs[(c, n)] and "error" in runs[(c, n)][-1]:
                    continue  # it failed once: the same error again says nothing new
                res = launch(c, n, a)
                runs[(c, n)].append(res)
                med = fmt_ms(statistics.median(res["times"])) + " ms" if "times" in res else res["error"]
                print(f"round {r + 1}/{a.rounds} nproc {n} {c}: {med}", file=sys.stderr, flush=True)

    tokens = a.micro_batch * a.seq_len
    rows, versions = [], {}
    for (c, n), results in runs.items():
        ok = [r for r in results if "times" in r]
        v = next((r.get("version") for r in results if r.get("version")), None)
        if c in PEERS and v:
            versions[PEERS[c][0]] = v
        if ok and len(ok) == len(results):
            meds = [statistics.median(r["times"]) for r in ok]
            m = statistics.median(meds)
            rows.append([c, n, fmt_ms(m), f"{fmt_ms(min(meds))}-{fmt_ms(max(meds))}", f"{tokens * n / m:,.0f}", WHAT_RAN[c]])
        else:
            err = next(r["error"] for r in results if "error" in r)
            rows.append([c, n, "-", "-", "-", f"{WHAT_RAN[c]}. Could not run: {err}"])
    from bench.common import table

    body = table(["candidate", "processes", "median step ms", "range over rounds (ms)", "tokens/s (all ranks)", "what ran"], rows)
    body += (
        f"\n\nflavor `{a.flavor}`, fp32, micro-batch {a.micro_batch} x seq {a.seq_len} per process, one optimizer step per "
        f"micro-batch; AdamW lr {LR} betas {BETAS} wd {WD}, grad clip {CLIP}; {a.warmup} warm-up + {a.steps} timed steps "
        f"per subprocess, {rounds_done} alternating rounds{'' if rounds_done == a.rounds else f' (of {a.rounds} asked; --max-minutes)'}; step time = wall time per optimizer step, data loading included, "
        "startup excluded (rank 0's with two processes, gloo under torchrun, which sets OMP_NUM_THREADS=1 per rank; one process "
        "runs with torch's default threads). plait reads batches through its own token_bin loader, the others through "
        "this bench's random windows of the same corpus."
    )
    print(body)
    if not a.no_record:
        from bench.common import report

        vers = ", ".join(f"{k} {v}" for k, v in sorted(versions.items())) or "no peer ran"
        note = f"peers: {vers} (in {a.peers_python}, with the same torch); 1-minute load average at the start {load_start:.2f}, at the end {load_average():.2f}"
        report(f"Peers: plait vs a bare loop and peer trainers, {a.flavor} on {a.device}", body, device=a.device, note=note)
    return 0


if __name__ == "__main__":
    sys.exit(main())
