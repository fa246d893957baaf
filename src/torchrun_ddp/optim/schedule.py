"""The learning-rate schedules (``--lr-scheduler``), stepped once per optimizer step.

``cosine-restarts`` (the default): linear warmup, then cosine annealing with warm restarts
(Loshchilov & Hutter 2017, "SGDR"), from ``torch.optim``. The others are transformers'
schedulers, as Hugging Face Trainer's ``lr_scheduler_type`` picks them
(``transformers.optimization``): ``cosine`` (one half-cosine to --min-lr over the run),
``linear`` (to 0 at the last step), ``constant`` (after warmup), and ``wsd``: warmup, stable,
then a linear decay over the last --decay-steps (warmup-stable-decay, Hu et al. 2024 MiniCPM,
arXiv:2404.06395; torchtitan's default decay type). Every one is a torch ``LRScheduler``
whose ``state_dict`` is plain numbers, so a resumed run continues exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.optim import Optimizer
from torch.optim.lr_scheduler import (
    CosineAnnealingWarmRestarts,
    LinearLR,
    LRScheduler,
    SequentialLR,
)
from transformers import (
    get_constant_schedule_with_warmup,
    get_cosine_with_min_lr_schedule_with_warmup,
    get_linear_schedule_with_warmup,
    get_wsd_schedule,
)

SCHEDULERS = ("cosine-restarts", "cosine", "linear", "constant", "wsd")
"""``--lr-scheduler``'s values; all but ``cosine-restarts`` and ``constant`` need the run's
length (--max-steps)."""
WSD_DECAY_FRACTION = 0.2
"""--decay-steps 0 under wsd: the last 20% of the run (Hagele et al. 2024, arXiv:2405.18392,
find a cooldown of about 20% matches a cosine schedule's loss)."""


@dataclass(frozen=True)
class ScheduleSettings:
    """One run's schedule: ``name`` (one of :data:`SCHEDULERS`), the peak ``lr``, the steps of
    warmup, the run's ``total_steps`` (-1: unknown), SGDR's first cycle and growth, the
    ``min_lr`` that cosine, cosine-restarts and wsd end at, and wsd's ``decay_steps`` (0: 20% of
    the run)."""

    name: str = "cosine-restarts"
    lr: float = 1e-5
    warmup_steps: int = 0
    total_steps: int = -1
    cycle_steps: int = 1000
    cycle_mult: int = 1
    min_lr: float = 0.0
    decay_steps: int = 0

    @property
    def wsd_decay_steps(self) -> int:
        """wsd's decay length: --decay-steps, or :data:`WSD_DECAY_FRACTION` of the run."""
        return self.decay_steps or max(1, round(WSD_DECAY_FRACTION * self.total_steps))


def build_scheduler(optimizer: Optimizer, settings: ScheduleSettings) -> LRScheduler:
    """The schedule ``settings`` names over ``optimizer``'s parameter groups.

    With peak ``lr``, ``W`` warmup steps, ``T`` total steps and ``m = min_lr / lr``, the rate at
    step ``s`` (0-based) is: cosine-restarts ``lr (s + 1) / W`` for ``s < W``, then SGDR from
    ``lr`` to ``min_lr`` over --restart-every steps, each cycle --restart-mult times longer;
    cosine ``lr s / W``, then ``lr (m + (1 - m) (1 + cos(pi (s - W) / (T - W))) / 2)``; linear
    ``lr s / W``, then ``lr (T - s) / (T - W)``; constant ``lr s / W``, then ``lr``; wsd
    ``lr (m + (1 - m) s / W)``, then ``lr`` until the last ``D`` steps, then
    ``lr (m + (1 - m) (1 - (s - T + D) / D))``. transformers' warmups start at 0 (their step 0
    trains at lr 0, as in HF Trainer). Raises ValueError for an unknown name.
    """
    if settings.name == "cosine-restarts":
        return _cosine_restarts(optimizer, settings)
    warmup, total, ratio = (
        settings.warmup_steps,
        settings.total_steps,
        settings.min_lr / settings.lr,
    )
    if settings.name == "cosine":
        return get_cosine_with_min_lr_schedule_with_warmup(
            optimizer, warmup, total, min_lr_rate=ratio
        )
    if settings.name == "linear":
        return get_linear_schedule_with_warmup(optimizer, warmup, total)
    if settings.name == "constant":
        return get_constant_schedule_with_warmup(optimizer, warmup)
    if settings.name == "wsd":
        decay = settings.wsd_decay_steps
        return get_wsd_schedule(
            optimizer, warmup, decay, total, decay_type="linear", min_lr_ratio=ratio
        )
    raise ValueError(f"unknown learning-rate schedule {settings.name!r}; use one of {SCHEDULERS}")


def _cosine_restarts(optimizer: Optimizer, settings: ScheduleSettings) -> LRScheduler:
    """Linear warmup to ``lr`` at step ``W - 1``, then SGDR (``CosineAnnealingWarmRestarts``)."""
    cosine = CosineAnnealingWarmRestarts(
        optimizer, T_0=settings.cycle_steps, T_mult=settings.cycle_mult, eta_min=settings.min_lr
    )
    warmup_steps = settings.warmup_steps
    if warmup_steps == 0:
        return cosine
    warmup = LinearLR(
        optimizer, start_factor=1.0 / warmup_steps, end_factor=1.0, total_iters=warmup_steps - 1
    )
    return SequentialLR(optimizer, [warmup, cosine], milestones=[warmup_steps])
