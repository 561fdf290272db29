"""Validation every N steps on the data source's validation split.

Each evaluation reads the same ``batches`` micro-batches (the first global
samples of the split), so values are comparable across evaluations and
across world sizes. The loss is averaged over every rank's tokens. The best
value is kept in the train state (``best_val_loss``), which checkpoints save.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from core.distributed import mean_across_ranks
from core.options import option
from core.protocols import LoaderSpec


@dataclass
class ValidationOptions:
    every: int = option(0, "steps between validation passes; 0 disables validation")
    batches: int = option(10, "micro-batches per rank in each validation pass")
    split: str = option("val", "the data source's split to evaluate")

    def check(self) -> None:
        if self.every < 0 or self.batches <= 0:
            raise ValueError("every must be >= 0 and batches > 0")


@torch.no_grad()
def evaluate(trainer, opts: ValidationOptions) -> float:
    spec = trainer.loader_spec
    val_spec = LoaderSpec(seq_len=spec.seq_len, micro_batch=spec.micro_batch, grad_accum=1,
                          dp_rank=spec.dp_rank, dp_size=spec.dp_size, seed=spec.seed, split=opts.split)
    loader = iter(trainer.c["data"].loader(val_spec))
    model, device = trainer.train_model, trainer.dist.device
    was_training = model.training
    model.eval()
    total = torch.zeros((), device=device)
    for _ in range(opts.batches):
        inputs, labels = next(loader)
        with trainer.c["precision"].autocast(device):
            total += model(inputs.to(device), labels.to(device)).float()
    model.train(was_training)
    return mean_across_ranks(total / opts.batches, trainer.dist).item()
