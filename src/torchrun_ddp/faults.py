"""Fault injection for the fault tests: off unless ``TORCHRUN_DDP_FAULT`` is set.

``TORCHRUN_DDP_FAULT=POINT:RANK:STEP[,POINT:RANK:STEP...]``: the ``i``-th entry makes global
rank ``RANK`` SIGKILL itself when it reaches ``POINT`` for optimizer step ``STEP`` in torchrun
attempt ``i`` (``TORCHELASTIC_RESTART_COUNT == i``), so one run with ``--max-restarts`` goes
through every entry, one per restart. Points: ``step`` (after forward and backward, before the
optimizer step), ``checkpoint-write`` (this rank's checkpoint files written, before the
barrier), ``publish`` (rank 0: checkpoint folder renamed, COMPLETE marker not yet written; other
ranks: waiting meanwhile), ``metrics`` (rank 0: half of a metrics.jsonl line written; other
ranks: at the same record).
"""

from __future__ import annotations

import os
import signal
import sys

ENV = "TORCHRUN_DDP_FAULT"
POINTS = ("step", "checkpoint-write", "publish", "metrics")


def fault_armed() -> bool:
    """Whether ``TORCHRUN_DDP_FAULT`` is set (production code then takes its normal path)."""
    return bool(os.environ.get(ENV))


def fault_point(point: str, step: int) -> None:
    """SIGKILL this process if ``TORCHRUN_DDP_FAULT`` names ``point`` and ``step`` for this rank
    in this torchrun attempt; otherwise (the default, variable unset) do nothing."""
    spec = os.environ.get(ENV)
    if not spec:
        return
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    entries = spec.split(",")
    if attempt >= len(entries):
        return
    want_point, rank, want_step = entries[attempt].split(":")
    if (want_point, int(rank), int(want_step)) != (point, _rank(), step):
        return
    print(f"fault injection: SIGKILL rank {rank} at {point} of step {step}", file=sys.stderr)
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))
