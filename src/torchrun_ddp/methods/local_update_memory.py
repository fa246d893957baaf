"""Per-rank memory that every local-update method (DiLoCo, SparseLoCo) keeps beyond its inner
optimizer, for --dry-run plans: the rows the methods share; each method adds the rows of its own
outer state and sync (``LocalUpdatesMethod.exchange_rows``), and ``dry_run`` prints them next to
the model's memory plan.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from torchrun_ddp.methods.base import MemoryRow

if TYPE_CHECKING:
    from torchrun_ddp.optim import LocalUpdateSettings


def kept_rows(
    settings: LocalUpdateSettings, shapes: list[tuple[int, ...]], param_bytes: int = 4
) -> list[MemoryRow]:
    """What every local-update method keeps per rank for trained parameters of ``shapes`` (``N``
    values), in bytes: the synced fp32 copy (4 N); with a sync delay (``--overlap-exchange``)
    the rank's parameters at the sync's start (``param_bytes`` N, the parameter dtype); eager
    updates' last mean and the rank's last part (8 N)."""
    numel = sum(math.prod(shape) for shape in shapes)
    rows = [MemoryRow("synced parameters (fp32 copy, the same on every rank)", 4 * numel, True)]
    if settings.sync_delay > 0:
        start = MemoryRow("parameters at the sync's start (overlap)", param_bytes * numel, True)
        rows.append(start)
    if settings.eager:
        name = "eager updates: the last mean and this rank's last part (fp32)"
        rows.append(MemoryRow(name, 8 * numel, True))
    return rows
