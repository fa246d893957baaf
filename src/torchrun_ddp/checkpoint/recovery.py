"""The collective start with several checkpoint folders: every domain's ``peers.inventory``
gathered, rank 0's ``peers.plan_across`` broadcast, and the decision carried out in every folder
(``settle``): the old run deleted (--overwrite-output-dir), newer steps set aside, the files a
folder lacks copied from a peer (``transfer.exchange``) and published atomically.

Every step ends with every rank knowing whether every other rank succeeded, so that a failure on
one rank (an unreadable folder, a disk error, a refusal) stops every rank with the same line
instead of leaving the others waiting in a collective until the timeout.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import torch.distributed as dist

from torchrun_ddp.checkpoint.codec import fsync_dir
from torchrun_ddp.checkpoint.folders import MARKER, complete_steps, publish, remove_incomplete
from torchrun_ddp.checkpoint.peers import Inventory, Rebuild, inventory, plan_across
from torchrun_ddp.checkpoint.ranks import all_gather_json, broadcast_json
from torchrun_ddp.checkpoint.run_identity import StartPlan, delete_run
from torchrun_ddp.checkpoint.storage import StorageLayout, span
from torchrun_ddp.checkpoint.transfer import CHUNK_BYTES, Moved, Stream, exchange
from torchrun_ddp.errors import UserError

log = logging.getLogger("torchrun_ddp")


def agree_across(
    root: Path,
    layout: StorageLayout,
    resume: bool,
    resume_from: str,
    overwrite: bool,
    rebuild: Rebuild,
    check: Callable[[str], None] = lambda run_id: None,
) -> StartPlan:
    """Collective: gather every domain's ``inventory``, let rank 0 decide (``plan_across``),
    then ``settle`` the decision; rank 0 logs which step is resumed and why. Returns this rank's
    plan (with its own folder's path). ``check(run_id)`` runs on rank 0 after the decision (e.g.
    that metrics.jsonl holds no other run); its UserError stops every rank.

    Raises the same UserError on every rank when the decision is refused or a copy fails. Any
    other exception on a rank is re-raised there, and the other ranks raise RuntimeError naming
    it (as ``agreement.agree_on_start`` does with one folder)."""
    rank = dist.get_rank()
    mine: Inventory | None = None
    failure: Exception | None = None
    if rank == layout.leader:
        try:
            mine = inventory(root, resume_from)
        except UserError as exc:
            mine = {"error": str(exc)}
        except Exception as exc:  # re-raised below, once every rank knows
            mine, failure = {"failure": f"rank {rank}: {type(exc).__name__}: {exc}"}, exc
    listed = all_gather_json(mine)
    inventories = [listed[ranks[0]] for ranks in layout.domains]
    _raise_if_failed(inventories, failure)
    decision: dict[str, object] = {}
    if rank == 0:
        decision, failure = _decide(
            lambda: plan_across(inventories, layout, resume, resume_from, overwrite, rebuild)
        )
        if "plan" in decision:
            try:
                check(str(decision["plan"]["run_id"]))
            except UserError as exc:
                decision = {"error": str(exc)}
    decision = dict(broadcast_json(decision))
    _raise_if_failed([decision], failure)
    if decision.get("note"):
        log.info("%s", decision["note"])
    return settle(decision, root, layout, resume_from)


def _raise_if_failed(answers: Sequence[Mapping[str, object]], failure: Exception | None) -> None:
    """Raise what a rank reported: its own exception where it failed, RuntimeError naming it
    elsewhere, or the first one-line refusal as UserError."""
    if failure is not None:
        raise failure
    failed = [str(a["failure"]) for a in answers if a and "failure" in a]
    if failed:
        raise RuntimeError(f"the start agreement failed on {failed[0]}")
    errors = [str(a["error"]) for a in answers if a and "error" in a]
    if errors:
        raise UserError(errors[0])


def _decide(plan: Callable[[], dict[str, object]]) -> tuple[dict[str, object], Exception | None]:
    """Rank 0: ``plan()`` (``plan_across``), or ``{"error": line}`` for a refusal, or
    ``{"failure": ...}`` with the exception for anything else (re-raised on rank 0 once the
    others are told)."""
    try:
        return plan(), None
    except UserError as exc:
        return {"error": str(exc)}, None
    except Exception as exc:  # re-raised by the caller, once every rank knows
        return {"failure": f"rank 0: {type(exc).__name__}: {exc}"}, exc


def settle(
    decision: Mapping[str, object], root: Path, layout: StorageLayout, resume_from: str
) -> StartPlan:
    """Collective: carry out ``plan_across``'s decision in this rank's folder ``root``: delete
    the run (--overwrite-output-dir), set aside newer steps, copy the files each folder lacks
    (``transfer.exchange``) and publish them; returns this rank's ``StartPlan``. A folder error
    on a leader (OSError) stops every rank with one line naming the folder."""
    plan = dict(decision["plan"])
    step = plan.get("step")
    leader = dist.get_rank() == layout.leader
    _everywhere(leader, lambda: delete_run(root) if decision.get("delete") else None, root)
    if step is None:
        return StartPlan(str(plan["run_id"]))
    step = int(step)
    _everywhere(leader, lambda: _set_aside(root, step), root)
    streams = [Stream(int(s), int(d), tuple((str(n), int(b)) for n, b in f)) for s, d, f in
               decision["streams"]]  # fmt: skip
    keeper = layout.domain in decision.get("holders", [])
    own = Path(resume_from) if decision.get("source") == "resume_from" else root / f"step-{step}"
    source = own if keeper else root / f"step-{step}"  # a keeper of --resume-from reads there
    fetched = root / f"step-{step}.tmp"
    moved = exchange(streams, own, fetched, CHUNK_BYTES)
    if leader and fetched.is_dir():
        _everywhere(True, lambda: _place(fetched, root / f"step-{step}", step, not keeper), root)
    else:
        _everywhere(False, lambda: None, root)
    _log_moves(moved, layout, step)
    lost = tuple(int(rank) for rank in plan.get("lost", []))
    return StartPlan(str(plan["run_id"]), str(source), step, lost, int(plan.get("segment", 0)))


def _everywhere(acting: bool, action: Callable[[], object], root: Path) -> None:
    """Collective: run ``action`` where ``acting`` (a leader's folder work); every rank then
    raises the same UserError if an OSError stopped it on some rank."""
    error = ""
    if acting:
        try:
            action()
        except OSError as exc:
            error = f"cannot update --checkpoint-dir {root} ({exc.strerror or exc})"
    errors = [str(e) for e in all_gather_json(error) if e]
    if errors:
        raise UserError(f"{errors[0]}; check the folder's disk and permissions, then restart")


def _set_aside(root: Path, step: int) -> None:
    """Rename complete steps newer than ``step`` to ``step-N.stale`` (replacing an older one)
    and remove what a crash left half-written. ``folders.prune`` deletes a stale copy once the
    run has saved that step again."""
    remove_incomplete(root)
    for newer, path in complete_steps(root):
        if newer <= step:
            continue
        stale = path.with_name(f"{path.name}.stale")
        if stale.exists():
            shutil.rmtree(stale)
        (path / MARKER).unlink()
        path.rename(stale)
        log.warning("set aside %s as %s: resuming the older step %d", path, stale.name, step)


def _place(fetched: Path, final: Path, step: int, whole: bool) -> None:
    """Publish a ``whole`` fetched step (the folder lacked it, or held a stale copy, which is
    replaced), or move fetched per-rank files into the step this folder keeps (each file
    renamed into place, atomically, then the folder fsynced)."""
    if whole:
        publish(fetched, final, step)
        return
    for file in sorted(fetched.rglob("*")):
        if file.is_file():
            os.replace(file, final / file.relative_to(fetched))
    fsync_dir(final)
    shutil.rmtree(fetched)


def _log_moves(moved: Moved, layout: StorageLayout, step: int) -> None:
    """Rank 0 logs what each domain's leader received: bytes, seconds, rate."""
    every = all_gather_json([moved.received, moved.seconds])
    for ranks in layout.domains:
        received, seconds = every[ranks[0]]
        if int(received):
            rate = int(received) / max(float(seconds), 1e-9) / 2**20
            log.info(
                "step %d: the folder of %s got %.1f MiB from peers in %.2f s (%.1f MiB/s)",
                step, span(ranks), int(received) / 2**20, float(seconds), rate,
            )  # fmt: skip
