"""Test hooks: fault injection and perturbations for the fault tests, off unless the test
harness arms them.

A hook fires only while ``TORCHRUN_DDP_TEST_HOOKS`` (``ARM_ENV``) holds ``ARMED``, which only
tests/distributed_harness.py sets (``hook_env``, ``test_hooks``): a stale export of a hook's
variable in a production job (sbatch passes the caller's environment) is refused at start in
one line (``check_hooks``, called by ``inputs.prepare_inputs``) instead of killing or damaging
the run. An armed hook is validated at start (a malformed value: one line, status 2), logged
and written into the run's config.toml as a comment.

``TORCHRUN_DDP_FAULT=POINT:RANK:STEP[,POINT:RANK:STEP...]``: the ``i``-th entry makes global
rank ``RANK`` SIGKILL itself when it reaches ``POINT`` for optimizer step ``STEP`` in torchrun
attempt ``i`` (``TORCHELASTIC_RESTART_COUNT == i``), so one run with ``--max-restarts`` goes
through every entry, one per restart. Points: ``step`` (after forward and backward, before the
optimizer step), ``checkpoint-write`` (this rank's checkpoint files written, before the
barrier), ``publish`` (rank 0: checkpoint folder renamed, COMPLETE marker not yet written; other
ranks: waiting meanwhile), ``metrics`` (rank 0: half of a metrics.jsonl line written; other
ranks: at the same record).

``TORCHRUN_DDP_PERTURB=KIND:N[,KIND:N...]`` (``perturbation``) changes the run instead of
killing it: ``nan-loss:STEP``, ``inf-loss:STEP`` and ``big-loss:STEP`` make every rank's loss
NaN, infinite or 1000 times larger at optimizer step ``STEP``; ``nan-grad:STEP`` makes a
gradient NaN before that step's optimizer step, ``nan-weight:STEP`` a weight NaN after it;
``replica:RANK`` changes rank ``RANK``'s replicated state after a resume has loaded it (before
the ranks compare it). A stop that a perturbation caused says so (``perturbed_note``).
For tests/test_sites.py: ``hold:STEP`` (one entry per held step) makes every rank wait before
optimizer step ``STEP`` until the file ``<TORCHRUN_DDP_HOLD_FILE>.<STEP>`` exists
(``hold_point``: a test paces a live site so that a restarted one is back before the run ends);
``hold:0`` waits before the first step, and so before the sites' join (``main.train``): two
sites released once both are ready to train join in one quorum and neither heals from the
other at the start. ``vote-no:N`` makes every rank of a site whose environment has it vote no,
once, on the sync its torchft Manager counts as step ``N`` (``N`` syncs committed, the join
included; ``sites.link``), as a site whose sync failed while the others' committed: it falls a
sync behind them and heals from a live one at its next sync, in the middle of the run.
"""

from __future__ import annotations

import math
import os
import signal
import sys
import time

import torch

from torchrun_ddp.errors import UserError

ENV = "TORCHRUN_DDP_FAULT"
PERTURB_ENV = "TORCHRUN_DDP_PERTURB"
ARM_ENV = "TORCHRUN_DDP_TEST_HOOKS"
ARMED = "armed-by-the-test-harness"
"""The value of ``ARM_ENV`` that arms the hooks (tests/distributed_harness.py sets it)."""
PERTURBATIONS = (
    "nan-loss", "inf-loss", "big-loss", "nan-grad", "nan-weight", "replica", "hold", "vote-no",
)  # fmt: skip
HOLD_ENV = "TORCHRUN_DDP_HOLD_FILE"
POINTS = ("step", "checkpoint-write", "publish", "metrics")


def _armed() -> bool:
    return os.environ.get(ARM_ENV) == ARMED


def check_hooks() -> str:
    """At start, before the process group: ``""`` when no hook variable is set, else the armed
    hooks as ``NAME=VALUE; ...`` (to log and record in the run's config).

    Raises UserError (one line) for a hook variable set without the test harness's arming, and
    for an armed hook whose value does not parse (``POINT:RANK:STEP`` or ``KIND:N`` entries)."""
    hooks = {name: os.environ[name] for name in (ENV, PERTURB_ENV) if os.environ.get(name)}
    if not hooks:
        return ""
    named = ", ".join(hooks)
    if not _armed():
        raise UserError(
            f"{named} is set in the environment but test hooks are not armed (only the test "
            f"harness arms them with {ARM_ENV}): unset {named} before training"
        )
    for name, value in hooks.items():
        if problem := (_fault_problem(value) if name == ENV else _perturb_problem(value)):
            raise UserError(f"{name}={value} is malformed: {problem}")
    return "; ".join(f"{name}={value}" for name, value in hooks.items())


def _fault_problem(spec: str) -> str:
    for entry in spec.split(","):
        parts = entry.split(":")
        if len(parts) != 3 or parts[0] not in POINTS or not all(p.isdigit() for p in parts[1:]):
            return f"{entry!r} is not POINT:RANK:STEP with POINT one of {', '.join(POINTS)}"
    return ""


def _perturb_problem(spec: str) -> str:
    for entry in spec.split(","):
        kind, _, number = entry.partition(":")
        if kind not in PERTURBATIONS or not number.isdigit():
            return f"{entry!r} is not KIND:N with KIND one of {', '.join(PERTURBATIONS)}"
    return ""


def fault_armed() -> bool:
    """Whether an armed ``TORCHRUN_DDP_FAULT`` is set (production code then takes its normal
    path)."""
    return _armed() and bool(os.environ.get(ENV))


def fault_point(point: str, step: int) -> None:
    """SIGKILL this process if an armed ``TORCHRUN_DDP_FAULT`` names ``point`` and ``step`` for
    this rank in this torchrun attempt; otherwise (the default, no armed hook) do nothing."""
    if not fault_armed():
        return
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    entries = os.environ[ENV].split(",")
    if attempt >= len(entries):
        return
    want_point, rank, want_step = entries[attempt].split(":")
    if (want_point, int(rank), int(want_step)) != (point, _rank(), step):
        return
    print(f"fault injection: SIGKILL rank {rank} at {point} of step {step}", file=sys.stderr)
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def perturbation(kind: str) -> int | None:
    """The number that an armed ``TORCHRUN_DDP_PERTURB`` gives ``kind`` (a step or a rank), or
    None (the default: no armed hook, or ``kind`` not named). The value was checked at start
    (``check_hooks``)."""
    spec = os.environ.get(PERTURB_ENV)
    if not spec or not _armed():
        return None
    for entry in spec.split(","):
        name, _, number = entry.partition(":")
        if name == kind:
            return int(number)
    return None


def hold_point(step: int) -> None:
    """Wait before optimizer step ``step`` while an armed ``TORCHRUN_DDP_PERTURB`` has the
    entry ``hold:step`` and the file ``<TORCHRUN_DDP_HOLD_FILE>.<step>`` does not exist
    (nothing by default)."""
    spec, path = os.environ.get(PERTURB_ENV, ""), os.environ.get(HOLD_ENV, "")
    if not (_armed() and path and f"hold:{step}" in spec.split(",")):
        return
    while not os.path.exists(f"{path}.{step}"):
        time.sleep(0.05)


def perturbed_note() -> str:
    """A stop message's tail when an armed ``TORCHRUN_DDP_PERTURB`` is set (the perturbation may
    have caused the stop), else ``""``."""
    spec = os.environ.get(PERTURB_ENV)
    if not spec or not _armed():
        return ""
    return f" (the test hook {PERTURB_ENV}={spec} perturbed this run)"


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


_LOSS_FACTORS = {"nan-loss": math.nan, "inf-loss": math.inf, "big-loss": 1000.0}


def before_update(step: int, model: torch.nn.Module, loss: torch.Tensor) -> torch.Tensor:
    """Tests only, between optimizer step ``step``'s backward and its update: a kill
    (``fault_point``), a hold (``hold_point``), then an armed ``TORCHRUN_DDP_PERTURB`` of its
    gradient (``nan-grad``: one NaN gradient) or its loss (NaN, infinite or 1000 times larger).
    Returns ``loss``, changed only by an armed loss perturbation."""
    fault_point("step", step)
    hold_point(step)
    if perturbation("nan-grad") == step:
        with torch.no_grad():
            next(p.grad for p in model.parameters() if p.grad is not None).fill_(math.nan)
    for kind, times in _LOSS_FACTORS.items():
        if perturbation(kind) == step:
            return loss * times
    return loss


def after_update(step: int, model: torch.nn.Module) -> None:
    """Tests only, after optimizer step ``step``'s update: an armed ``nan-weight`` makes a
    weight NaN."""
    if perturbation("nan-weight") == step:
        with torch.no_grad():
            next(model.parameters()).fill_(math.nan)
