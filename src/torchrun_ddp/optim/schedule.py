"""The learning-rate schedule: linear warmup, then cosine annealing with warm restarts.

Cosine annealing with warm restarts: Loshchilov & Hutter 2017, "SGDR", from ``torch.optim``.
"""

from __future__ import annotations

from torch.optim import Optimizer
from torch.optim.lr_scheduler import (
    CosineAnnealingWarmRestarts,
    LinearLR,
    LRScheduler,
    SequentialLR,
)


def build_scheduler(
    optimizer: Optimizer, warmup_steps: int, cycle_steps: int, cycle_mult: int, min_lr: float
) -> LRScheduler:
    """Linear warmup, then cosine annealing with warm restarts; stepped once per optimizer step.

    With peak learning rate ``lr`` and ``W = warmup_steps``, the rate at step ``s`` is
    ``lr * (s + 1) / W`` for ``s < W``; afterwards it follows SGDR from ``lr`` down to ``min_lr``
    over ``cycle_steps`` steps, restarting at ``lr`` with each cycle ``cycle_mult`` times longer.
    """
    cosine = CosineAnnealingWarmRestarts(
        optimizer, T_0=cycle_steps, T_mult=cycle_mult, eta_min=min_lr
    )
    if warmup_steps == 0:
        return cosine
    warmup = LinearLR(
        optimizer, start_factor=1.0 / warmup_steps, end_factor=1.0, total_iters=warmup_steps - 1
    )
    return SequentialLR(optimizer, [warmup, cosine], milestones=[warmup_steps])
