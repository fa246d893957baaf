"""Evaluation: the held-out loss over every rank's fixed held-out windows, and multiple-choice
accuracy over every rank's share of the --eval-multiple-choice questions, summed over all ranks
in one all-reduce. Like main.py it composes (the trainer's model, held-out set and questions,
``model``'s autocast, ``choice_scoring``)."""

from __future__ import annotations

import logging
import math

import torch
import torch.distributed as dist

from torchrun_ddp.build import Trainer
from torchrun_ddp.choice_scoring import accuracy_stderr, choice_loglikelihoods, picks
from torchrun_ddp.metrics import Record
from torchrun_ddp.model import autocast_context, causal_lm_inputs, trained_tokens
from torchrun_ddp.parallel.ddp import unwrap

log = logging.getLogger("torchrun_ddp")


@torch.no_grad()
def evaluate(trainer: Trainer) -> Record:
    """Mean loss and perplexity over every rank's fixed held-out windows (per trained token
    where windows carry labels, so a window of padding weighs nothing), and the multiple-choice
    record (``multiple_choice_record``) where --eval-multiple-choice is given. Collective: one
    all-reduce of float64 [5] (loss sum, weight, questions, right by sum, right per character)."""
    model = trainer.model
    model.eval()
    totals = torch.zeros(5, device=trainer.device, dtype=torch.float64)
    for batch in trainer.eval_set:
        with autocast_context(trainer.config.precision, trainer.device):
            loss, weight = batch_loss(model, batch.to(trainer.device))
        totals[0] += loss.double()
        totals[1] += weight
    totals[2:] = multiple_choice_counts(trainer).to(trainer.device)
    dist.all_reduce(totals)
    model.train()
    record = multiple_choice_record(totals[2:].tolist())
    if totals[1] == 0:
        if not record:
            log.warning("no held-out windows to evaluate on; check --eval-files")
        return record
    eval_loss = float(totals[0] / totals[1])
    return {"eval_loss": eval_loss, "eval_ppl": math.exp(min(eval_loss, 50.0)), **record}


def multiple_choice_counts(trainer: Trainer) -> torch.Tensor:
    """float64 [3]: this rank's questions, and how many of them the model answers right by the
    summed log-likelihood and by the log-likelihood per character (``choice_scoring``). Runs the
    model without its DDP wrapper, so ranks with more questions than others call no collective."""
    counts = torch.zeros(3, dtype=torch.float64)
    if not trainer.questions:
        return counts
    module = unwrap(trainer.model)  # DDP's module (--eval-multiple-choice is refused under FSDP)
    for question in trainer.questions:
        with autocast_context(trainer.config.precision, trainer.device):
            scores = choice_loglikelihoods(
                module, question.context, question.choices, trainer.config.seq_length,
                trainer.device,
            )  # fmt: skip
        by_sum, by_char = picks(scores, question.chars)
        counts += torch.tensor([1.0, by_sum == question.gold, by_char == question.gold])
    return counts


def multiple_choice_record(counts: list[float]) -> Record:
    """The metrics of [questions, right by sum, right per character] over all ranks:
    ``mc_accuracy`` and ``mc_accuracy_per_char`` (fractions, 0 to 1), each with its standard
    error (``_stderr``), and ``mc_questions``; empty without questions."""
    questions = int(counts[0])
    if questions == 0:
        return {}
    accuracy, per_char = counts[1] / questions, counts[2] / questions
    return {
        "mc_accuracy": accuracy,
        "mc_accuracy_stderr": accuracy_stderr(accuracy, questions),
        "mc_accuracy_per_char": per_char,
        "mc_accuracy_per_char_stderr": accuracy_stderr(per_char, questions),
        "mc_questions": questions,
    }


def batch_loss(model: torch.nn.Module, batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, weight) of one held-out micro-batch: its mean loss and 1 for text packed back to
    back (every window trains L - 1 tokens, as before), else its summed token loss and trained
    token count, so the mean is per trained token and padding weighs nothing."""
    one = torch.ones((), device=batch.device)
    if batch.dim() == 2:
        return model(**causal_lm_inputs(batch)).loss, one
    return model(**causal_lm_inputs(batch), num_items_in_batch=one).loss, trained_tokens(batch)
