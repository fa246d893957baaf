"""What the model reads from a micro-batch: the keyword inputs of token ids, labels and
restarting positions, and the count of trained tokens.
"""

from __future__ import annotations

import torch

IGNORED_LABEL = -100
"""Label of a token that is not trained on (transformers' loss ignores it)."""


def causal_lm_inputs(batch: torch.Tensor) -> dict[str, torch.Tensor | bool]:
    """The model's keyword inputs for a micro-batch: int64 [B, L] token ids (every token is
    its own label), or int64 [B, 3, L] with rows token ids, labels (-100: not trained) and
    position ids that restart per example. With no attention mask and no cache, transformers
    reads restarting positions as packed examples (``masking_utils.find_packed_sequence_indices``:
    a block-diagonal causal mask for sdpa/eager, varlen flash attention); ``use_cache`` is off
    because a cache turns that detection off."""
    if batch.dim() == 2:
        return {"input_ids": batch, "labels": batch}
    return {
        "input_ids": batch[:, 0],
        "labels": batch[:, 1],
        "position_ids": batch[:, 2],
        "use_cache": False,
    }


def trained_tokens(batch: torch.Tensor) -> torch.Tensor:
    """Tokens whose prediction is trained in a micro-batch (labels after the shift that the
    loss makes: position t's label is predicted from position t - 1), a 0-d int64 tensor on
    the batch's device (no host read)."""
    labels = batch if batch.dim() == 2 else batch[:, 1]
    return (labels[:, 1:] != IGNORED_LABEL).sum()
