"""AdamW with decoupled weight decay on matrices only (fused, foreach or for-loop), and ZeRO-1.

AdamW: Loshchilov & Hutter 2019, "Decoupled Weight Decay Regularization", from ``torch.optim``.
ZeRO stage 1: Rajbhandari et al. 2020, through ``torch.distributed.optim.ZeroRedundancyOptimizer``.
"""

from __future__ import annotations

import torch
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.optim import AdamW, Optimizer


def parameter_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, object]]:
    """Two AdamW groups: weight decay for matrices (ndim >= 2), none for norms and biases."""
    decay, no_decay = [], []
    for param in model.parameters():
        if not param.requires_grad:
            continue
        (decay if param.ndim >= 2 else no_decay).append(param)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


ADAMW_IMPLEMENTATIONS = ("fused", "foreach", "for-loop")
"""torch's three AdamW kernels: one fused kernel over all parameters, multi-tensor (foreach)
ops, and the reference per-parameter loop. They compute the same update."""


def adamw_options(implementation: str) -> dict[str, bool]:
    """AdamW's ``fused`` / ``foreach`` keyword arguments for one implementation name.

    Raises ValueError for a name outside ``ADAMW_IMPLEMENTATIONS``.
    """
    if implementation not in ADAMW_IMPLEMENTATIONS:
        raise ValueError(f"unknown AdamW implementation {implementation!r}")
    return {"fused": implementation == "fused", "foreach": implementation == "foreach"}


def build_optimizer(
    model: torch.nn.Module,
    learning_rate: float,
    weight_decay: float,
    implementation: str = "fused",
    zero1: bool = False,
    optimizer_class: type[AdamW] = AdamW,
) -> Optimizer:
    """torch's AdamW over ``parameter_groups``; fused by default (CPU and CUDA).

    With ``zero1`` it is wrapped in ``torch.distributed.optim.ZeroRedundancyOptimizer`` (ZeRO
    stage 1, Rajbhandari et al. 2020): each rank keeps AdamW state for its partition of the
    parameters only, steps it, and broadcasts the updated parameters. Needs an initialised
    process group. ``param_groups`` (and so the learning-rate schedule) work as for AdamW.
    ``optimizer_class``: AdamW or a subclass (``sites.adamw.SiteAdamW``), without ``zero1``.
    """
    groups = parameter_groups(model, weight_decay)
    options = adamw_options(implementation)
    if not zero1:
        return optimizer_class(groups, lr=learning_rate, **options)
    return ZeroRedundancyOptimizer(groups, optimizer_class=AdamW, lr=learning_rate, **options)
