"""Multiple-choice scoring by log-likelihood, as lm-evaluation-harness and OLMES score their
"rc" (ranked classification) tasks: each choice is scored by the summed log-probability the
model gives its tokens after the question's context, and the model's answer is the best-scored
choice, either by that sum (``acc``) or by the sum per character of the choice (``acc_norm`` in
lm-evaluation-harness, ``acc_per_char`` in OLMES; Gu et al. 2024, "OLMES: A Standard for
Language Model Evaluations").

Pure torch: the caller hands token ids and a causal LM; nothing here communicates.
"""

from __future__ import annotations

import math

import torch


def choice_loglikelihoods(
    model: torch.nn.Module,
    context: list[int],
    choices: list[list[int]],
    max_length: int,
    device: torch.device,
) -> torch.Tensor:
    """float64 [len(choices)]: the summed log-probability (nats) of each choice's token ids
    after ``context``, in one forward pass over the choices as a batch.

    Each sequence ``context + choice`` keeps its last ``max_length + 1`` tokens (the context is
    cut from the left, as lm-evaluation-harness cuts it) and is fed without its last token;
    shorter rows are padded on the right, which a causal model's earlier positions never see.
    Only the positions that predict a choice's token get logits (``logits_to_keep``: the output
    head is most of a small model's cost). Every choice needs at least one token."""
    rows = [(context + choice)[-(max_length + 1) :] for choice in choices]
    counts = [min(len(choice), len(row) - 1) for row, choice in zip(rows, choices, strict=True)]
    width = max(len(row) for row in rows) - 1
    first = min(len(row) - 1 - count for row, count in zip(rows, counts, strict=True))
    inputs = torch.zeros(len(rows), width, dtype=torch.long)
    for index, row in enumerate(rows):
        inputs[index, : len(row) - 1] = torch.tensor(row[:-1])
    output = model(input_ids=inputs.to(device), use_cache=False, logits_to_keep=width - first)
    log_probs = torch.log_softmax(output.logits.float(), dim=-1)
    scores = torch.zeros(len(rows), dtype=torch.float64)
    for index, (row, count) in enumerate(zip(rows, counts, strict=True)):
        targets = torch.tensor(row[-count:], device=device)
        start = len(row) - 1 - count - first  # the kept logits begin at position ``first``
        positions = torch.arange(start, start + count, device=device)
        scores[index] = log_probs[index, positions, targets].double().sum().cpu()
    return scores


def picks(scores: torch.Tensor, chars: list[int]) -> tuple[int, int]:
    """(the choice with the highest summed log-likelihood, the choice with the highest
    log-likelihood per character) for float64 [n] ``scores``; ties go to the first choice."""
    per_char = scores / torch.tensor(chars, dtype=torch.float64).clamp(min=1)
    return int(torch.argmax(scores)), int(torch.argmax(per_char))


def accuracy_stderr(accuracy: float, count: int) -> float:
    """The standard error of an accuracy over ``count`` questions, ``sqrt(p (1 - p) / n)``
    (binomial; 0 without questions)."""
    if count <= 0:
        return 0.0
    return math.sqrt(accuracy * (1.0 - accuracy) / count)
