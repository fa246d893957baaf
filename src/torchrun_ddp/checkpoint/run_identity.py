"""Run identity and the start plan: which run a checkpoint folder belongs to, and what a
starting run resumes.

``<root>/run.json`` holds the ``run_id`` (a random hex string) of the one run whose checkpoints
the folder holds, and every ``meta.json`` repeats it. ``plan_start`` (rank 0) decides what a
starting run resumes and refuses to start a different run in a folder that holds another run's
checkpoints, unless told to overwrite them; ``verify_start`` checks on every rank that it sees the
checkpoint rank 0 chose (``--checkpoint-dir`` must be one shared file system at one path).
"""

from __future__ import annotations

import contextlib
import json
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from torchrun_ddp.checkpoint.codec import fsync_dir, write_json
from torchrun_ddp.checkpoint.folders import (
    MARKER,
    META_JSON,
    complete_steps,
    find_latest,
    read_meta,
    remove_incomplete,
    remove_stale,
    step_dirs,
)
from torchrun_ddp.checkpoint.ranks import distributed, rank_and_world
from torchrun_ddp.errors import UserError

RUN_FILE = "run.json"
OTHER_RUN = (
    "pass a new --checkpoint-dir (and --output-dir), or add --no-resume --overwrite-output-dir "
    "to delete the old run's checkpoints and metrics"
)


@dataclass(frozen=True)
class StartPlan:
    """What a starting run does: resume ``path`` (``step`` steps done) or start fresh (``path``
    None, ``step`` 0); ``run_id`` names the run either way."""

    run_id: str
    path: str | None = None
    step: int = 0
    lost: tuple[int, ...] = ()
    """Ranks of the checkpoint whose own state no folder holds (several storage domains, more
    lost than buddy copies): the caller rebuilds it (``peers.plan_across``)."""
    segment: int = 0
    """The timeline the run trains on from here: 0 for a fresh run, else one above every
    checkpoint's ``segment`` in the folder(s), so that a step saved again outranks a stale copy
    (``peers``)."""


def read_run_id(root: Path) -> str | None:
    """The run id in ``<root>/run.json``, or None when there is none (a new folder).

    Raises UserError if the file exists but is not a JSON object with a string ``run_id``.
    """
    file = root / RUN_FILE
    if not file.is_file():
        return None
    try:
        value = json.loads(file.read_text()).get("run_id")
    except (OSError, json.JSONDecodeError, AttributeError) as exc:
        raise UserError(f"cannot read the run id in {file} ({exc}); {OTHER_RUN}") from exc
    if not isinstance(value, str):
        raise UserError(f"{file} has no run_id string; {OTHER_RUN}")
    return value


def write_run_id(root: Path, run_id: str) -> None:
    """Write ``<root>/run.json`` atomically (temporary file, fsync, rename)."""
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f"{RUN_FILE}.tmp"
    write_json(tmp, {"run_id": run_id})
    tmp.replace(root / RUN_FILE)
    fsync_dir(root)


def new_run_id() -> str:
    """A fresh random run id (32 hex digits, uuid4)."""
    return uuid.uuid4().hex


def plan_start(root: Path, resume: bool, resume_from: str, overwrite: bool) -> StartPlan:
    """Rank 0's decision what to resume from ``root`` (file system only, no collective).

    - ``resume_from``: that complete checkpoint, continuing its run id.
    - ``resume``: the newest complete checkpoint of ``root``; without one, the run of
      ``run.json`` starts over (a crash before the first checkpoint) or a new run starts.
    - neither (``--no-resume``): a new run; if ``root`` holds a run, its checkpoints and
      ``run.json`` are deleted when ``overwrite`` is set, otherwise UserError.

    Raises UserError if ``root`` holds another run than the one resumed, or if the checkpoint to
    resume is incomplete or unreadable. The caller records the run id (``record_run_id``) once
    its own checks pass.
    """
    existing = read_run_id(root)
    if not resume and not resume_from:
        if existing is not None or step_dirs(root):
            if not overwrite:
                raise UserError(
                    f"--no-resume: --checkpoint-dir {root} holds the checkpoints of run "
                    f"{existing or '(unnamed)'}, which a new run must not mix with; {OTHER_RUN}"
                )
            delete_run(root)
        return StartPlan(new_run_id())
    path = Path(resume_from) if resume_from else find_latest(root)
    if path is None:
        return StartPlan(existing or new_run_id())
    meta = read_meta(path)
    run_id = str(meta.get("run_id") or existing or new_run_id())
    if existing is not None and existing != run_id:
        raise UserError(
            f"--checkpoint-dir {root} holds run {existing} but {path} belongs to run {run_id}; "
            "resume into the checkpoint's own folder, or pass a new --checkpoint-dir"
        )
    return StartPlan(run_id, str(path), int(meta["step"]), segment=_next_segment(root, meta))


def _next_segment(root: Path, resumed: dict[str, object]) -> int:
    """One above the ``segment`` of the resumed checkpoint and of every complete one in
    ``root`` (a meta.json that cannot be read counts as 0)."""
    segments = [int(resumed.get("segment") or 0)]
    for _, folder in complete_steps(root):
        with contextlib.suppress(UserError):  # unreadable: counts as 0
            segments.append(int(read_meta(folder).get("segment") or 0))
    return 1 + max(segments)


def record_run_id(root: Path, run_id: str) -> None:
    """Write ``run_id`` to ``<root>/run.json`` unless it is there already."""
    if read_run_id(root) != run_id:
        write_run_id(root, run_id)


def delete_run(root: Path) -> None:
    """Delete every ``step-<N>``, ``*.tmp`` and ``*.stale`` folder and ``run.json`` under
    ``root`` (markers first, so a crash halfway never leaves a loadable partial checkpoint)."""
    for _, path in step_dirs(root):
        (path / MARKER).unlink(missing_ok=True)
    remove_incomplete(root)
    remove_stale(root)
    (root / RUN_FILE).unlink(missing_ok=True)


def check_start(plan: StartPlan) -> str:
    """Why this rank cannot resume ``plan`` ("" when it can): the checkpoint must be complete
    here, at the same step and of the same run. Reads files only; see ``verify_start``."""
    if plan.path is None:
        return ""
    path = Path(plan.path)
    if not (path / MARKER).is_file():
        return f"{path} is not complete here"
    try:
        meta = json.loads((path / META_JSON).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        return f"cannot read {path / META_JSON} ({exc})"
    if meta.get("step") != plan.step or meta.get("run_id", plan.run_id) != plan.run_id:
        return f"{path} holds step {meta.get('step')} of run {meta.get('run_id')}"
    return ""


def verify_start(plan: StartPlan, device: torch.device, folder_per_node: bool = False) -> None:
    """Collective: every rank checks ``check_start(plan)``; one all-reduce (MIN) of the verdicts.

    Raises UserError on every rank (so none waits in a later collective) when any rank does not
    see the checkpoint rank 0 chose, e.g. a stale view of a shared --checkpoint-dir
    (``folder_per_node``: each rank checks its own folder after the copies; the hint differs).
    """
    problem = check_start(plan)
    verdict = torch.tensor([0 if problem else 1], device=device)
    if distributed():
        dist.all_reduce(verdict, op=dist.ReduceOp.MIN)
    if int(verdict.item()) == 1:
        return
    rank, _ = rank_and_world()
    fix = (
        "check that no other job writes into the nodes' --checkpoint-dir folders"
        if folder_per_node
        else "put --checkpoint-dir on a file system shared by all nodes, at the same path"
    )
    raise UserError(
        f"not every rank sees the checkpoint {plan.path} (step {plan.step}) that rank 0 chose "
        f"(rank {rank}: {problem or 'sees it'}); {fix}"
    )
