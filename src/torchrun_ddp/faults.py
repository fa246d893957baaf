"""Fault injection for the fault tests: off unless ``TORCHRUN_DDP_FAULT`` is set.

``TORCHRUN_DDP_FAULT=POINT:RANK:STEP[,POINT:RANK:STEP...]``: the ``i``-th entry makes global
rank ``RANK`` SIGKILL itself when it reaches ``POINT`` for optimizer step ``STEP`` in torchrun
attempt ``i`` (``TORCHELASTIC_RESTART_COUNT == i``), so one run with ``--max-restarts`` goes
through every entry, one per restart. Points: ``step`` (after forward and backward, before the
optimizer step), ``checkpoint-write`` (this rank's checkpoint files written, before the
barrier), ``publish`` (rank 0: checkpoint folder renamed, COMPLETE marker not yet written; other
ranks: waiting meanwhile), ``metrics`` (rank 0: half of a metrics.jsonl line written; other
ranks: at the same record).

``TORCHRUN_DDP_PERTURB=KIND:N[,KIND:N...]`` (``perturbation``) changes the run instead of
killing it, for tests/test_damaged_checkpoints.py only: ``nan-loss:STEP`` makes every rank's
loss NaN at optimizer step ``STEP``; ``replica:RANK`` changes rank ``RANK``'s replicated state
after a resume has loaded it (before the ranks compare it). For tests/test_sites.py:
``hold:STEP`` makes every rank wait before optimizer step ``STEP`` until the file
``TORCHRUN_DDP_HOLD_FILE`` names exists (``hold_point``: a test paces a live site so that a
restarted one is back before the run ends).
"""

from __future__ import annotations

import os
import signal
import sys
import time

ENV = "TORCHRUN_DDP_FAULT"
PERTURB_ENV = "TORCHRUN_DDP_PERTURB"
PERTURBATIONS = ("nan-loss", "replica", "hold")
HOLD_ENV = "TORCHRUN_DDP_HOLD_FILE"
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


def perturbation(kind: str) -> int | None:
    """The number that ``TORCHRUN_DDP_PERTURB`` gives ``kind`` (a step or a rank), or None
    (the default: variable unset). Raises ValueError for an entry that is not ``KIND:N``."""
    spec = os.environ.get(PERTURB_ENV)
    if not spec:
        return None
    for entry in spec.split(","):
        name, number = entry.split(":")
        if name == kind:
            return int(number)
    return None


def hold_point(step: int) -> None:
    """Wait before optimizer step ``step`` while ``TORCHRUN_DDP_PERTURB`` names ``hold:step``
    and the file ``TORCHRUN_DDP_HOLD_FILE`` does not exist (nothing by default)."""
    if perturbation("hold") != step:
        return
    path = os.environ.get(HOLD_ENV, "")
    while path and not os.path.exists(path):
        time.sleep(0.05)


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))
