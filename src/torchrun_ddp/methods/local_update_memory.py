"""Per-rank memory that DiLoCo and SparseLoCo add beyond the inner AdamW, for --dry-run plans.

Rows in bytes, from the parameter shapes and ``optim.LocalUpdateSettings``; the DiLoCo and
SparseLoCo methods answer ``Method.memory_rows`` with them, and ``dry_run`` prints them next to
the model's memory plan.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from torchrun_ddp.compression.wire import sparseloco_payload_bytes
from torchrun_ddp.methods.base import MemoryRow

if TYPE_CHECKING:
    from torchrun_ddp.optim.local_updates import LocalUpdateSettings

SPARSELOCO_WORK_COPIES = 5
"""fp32 copies of one parameter alive at once in SparseLoCo's compression: the pseudo-gradient,
its chunks, their magnitudes for top-k, the sent values scattered back and their join."""


def memory_rows(
    settings: LocalUpdateSettings,
    shapes: list[tuple[int, ...]],
    world_size: int,
    param_bytes: int = 4,
) -> list[MemoryRow]:
    """What DiLoCo or SparseLoCo holds beyond the inner AdamW, per rank, for trained parameters
    of ``shapes`` (``N`` values): the synced fp32 copy (4 N); DiLoCo's outer momentum (4 N, when
    > 0) or SparseLoCo's error feedback (4 N); and at a sync, the fp32 pseudo-gradient handed
    to the outer SGD (4 N) plus DiLoCo's bf16 wire copy (2 N) or SparseLoCo's own and gathered
    messages ((1 + W) x payload) and ``SPARSELOCO_WORK_COPIES`` fp32 copies of the largest
    parameter (it compresses one parameter at a time).

    With a sync delay (``--overlap-exchange``) the rank also keeps its parameters at the sync's
    start (``param_bytes`` N, the parameter dtype), and DiLoCo's pseudo-gradient and wire copy or
    SparseLoCo's own and gathered messages stay alive while the exchange runs, so they count as
    kept; eager updates keep the last mean and the rank's last part (8 N)."""
    sizes = [math.prod(shape) for shape in shapes]
    numel = sum(sizes)
    delayed = settings.sync_delay > 0
    rows = [MemoryRow("synced parameters (fp32 copy, the same on every rank)", 4 * numel, True)]
    if delayed:
        start = MemoryRow("parameters at the sync's start (overlap)", param_bytes * numel, True)
        rows.append(start)
    if settings.eager:
        name = "eager updates: the last mean and this rank's last part (fp32)"
        rows.append(MemoryRow(name, 8 * numel, True))
    if settings.method == "diloco":
        if settings.outer_momentum:
            rows.append(MemoryRow("outer Nesterov momentum (fp32)", 4 * numel, True))
        bf16 = settings.pseudo_gradient_dtype == "bfloat16"
        name = "sync: pseudo-gradient (fp32" + (", and its bf16 wire copy)" if bf16 else ")")
        rows.append(MemoryRow(name, 4 * numel + (2 * numel if bf16 else 0), delayed))
        return rows
    rows.append(MemoryRow("error feedback (fp32, per rank)", 4 * numel, True))
    payload = sparseloco_payload_bytes(
        shapes, settings.topk, settings.chunk, settings.quant_bits, settings.quantizer
    )
    work = SPARSELOCO_WORK_COPIES * 4 * max(sizes, default=0)
    temporary = 4 * numel + (1 + world_size) * payload + work
    rows.append(MemoryRow("sync: mean pseudo-gradient, messages, chunk work", temporary, False))
    if delayed:
        in_flight = (1 + world_size) * payload
        rows.append(MemoryRow("own and gathered messages in flight (overlap)", in_flight, True))
    return rows
