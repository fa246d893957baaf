"""The held-out loss: every rank's fixed held-out windows through the DDP model, averaged over
all ranks in one all-reduce. Like main.py it composes (the trainer's model and held-out set,
``model``'s autocast)."""

from __future__ import annotations

import logging
import math

import torch
import torch.distributed as dist

from torchrun_ddp.build import Trainer
from torchrun_ddp.metrics import Record
from torchrun_ddp.model import autocast_context

log = logging.getLogger("torchrun_ddp")


@torch.no_grad()
def evaluate(trainer: Trainer) -> Record:
    """Mean loss and perplexity over every rank's fixed held-out windows."""
    model = trainer.model
    model.eval()
    totals = torch.zeros(2, device=trainer.device, dtype=torch.float64)
    for batch in trainer.eval_set:
        input_ids = batch.to(trainer.device)
        with autocast_context(trainer.config.precision, trainer.device):
            totals[0] += model(input_ids=input_ids, labels=input_ids).loss.double()
        totals[1] += 1
    dist.all_reduce(totals)
    model.train()
    if totals[1] == 0:
        log.warning("no held-out windows to evaluate on; check --eval-files")
        return {}
    eval_loss = float(totals[0] / totals[1])
    return {"eval_loss": eval_loss, "eval_ppl": math.exp(min(eval_loss, 50.0))}
