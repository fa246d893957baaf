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
from torchrun_ddp.model import autocast_context, causal_lm_inputs, trained_tokens

log = logging.getLogger("torchrun_ddp")


@torch.no_grad()
def evaluate(trainer: Trainer) -> Record:
    """Mean loss and perplexity over every rank's fixed held-out windows (per trained token
    where windows carry labels, so a window of padding weighs nothing)."""
    model = trainer.model
    model.eval()
    totals = torch.zeros(2, device=trainer.device, dtype=torch.float64)
    for batch in trainer.eval_set:
        with autocast_context(trainer.config.precision, trainer.device):
            loss, weight = batch_loss(model, batch.to(trainer.device))
        totals[0] += loss.double()
        totals[1] += weight
    dist.all_reduce(totals)
    model.train()
    if totals[1] == 0:
        log.warning("no held-out windows to evaluate on; check --eval-files")
        return {}
    eval_loss = float(totals[0] / totals[1])
    return {"eval_loss": eval_loss, "eval_ppl": math.exp(min(eval_loss, 50.0))}


def batch_loss(model: torch.nn.Module, batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, weight) of one held-out micro-batch: its mean loss and 1 for text packed back to
    back (every window trains L - 1 tokens, as before), else its summed token loss and trained
    token count, so the mean is per trained token and padding weighs nothing."""
    one = torch.ones((), device=batch.device)
    if batch.dim() == 2:
        return model(**causal_lm_inputs(batch)).loss, one
    return model(**causal_lm_inputs(batch), num_items_in_batch=one).loss, trained_tokens(batch)
