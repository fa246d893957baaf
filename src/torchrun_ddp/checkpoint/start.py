"""The start of a run: which checkpoint every rank resumes, agreed over the process group.

One path for every storage layout (``storage``): a shared file system is one storage domain, a
folder per node or per site one domain each. Each domain's leader lists its folder
(``peers.list_folder``); rank 0 decides from every list (``peers.decide``: the newest step that
every rank can resume, the copies a folder lacks; none with one domain) and checks the run's
other records (``check``: metrics.jsonl); the decision is broadcast and carried out in every
folder (``settle``): the old run deleted (--overwrite-output-dir), newer steps set aside, the
files a folder lacks copied from a peer (``transfer.exchange``) and published atomically; then
every rank checks that its folder holds the chosen checkpoint (``verify_start``).

Every step ends with every rank knowing whether every other rank succeeded, so that a failure on
one rank (an unreadable folder, a disk error, a refusal) stops every rank with the same line
instead of leaving the others waiting in a collective until the timeout.

What crosses the process group is typed on both sides: a leader's ``peers.Inventory`` or its
``Failure``, rank 0's ``peers.StartDecision`` or its ``Failure``, each as JSON only inside the
gather and the broadcast (``_send``, ``_received``).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from torchrun_ddp.checkpoint.codec import fsync_dir
from torchrun_ddp.checkpoint.folders import (
    MARKER,
    META_JSON,
    complete_steps,
    publish,
    remove_incomplete,
)
from torchrun_ddp.checkpoint.listing import Inventory, list_folder
from torchrun_ddp.checkpoint.manifest import Entry, add_entries, check_received
from torchrun_ddp.checkpoint.peers import Rebuild, StartDecision, decide
from torchrun_ddp.checkpoint.ranks import (
    JsonObject,
    all_gather_json,
    broadcast_json,
    collective_device,
    distributed,
    json_float,
    json_int,
    json_list,
    json_object,
    json_str,
    rank_and_world,
)
from torchrun_ddp.checkpoint.run_identity import delete_run
from torchrun_ddp.checkpoint.storage import StorageLayout, span
from torchrun_ddp.checkpoint.transfer import CHUNK_BYTES, Moved, exchange
from torchrun_ddp.errors import UserError

log = logging.getLogger("torchrun_ddp")

Check = Callable[[str, bool], None]
"""``check(run_id, overwrite)``: the caller's check of the run's other records (metrics.jsonl
holds no other run unless ``overwrite``); raises UserError to refuse the start."""


@dataclass(frozen=True)
class StartFlags:
    """What the user asked for: ``resume`` (--resume / --no-resume), ``resume_from``
    (--resume-from), ``overwrite_output_dir`` (--overwrite-output-dir), and whether this attempt
    is a ``restarted`` one (a torchrun restart or re-rendezvous of the job); ``verify``
    (--verify-checkpoints: full, size or off) how each folder's steps are checked against their
    manifests before anything is chosen."""

    resume: bool = True
    resume_from: str = ""
    overwrite_output_dir: bool = False
    restarted: bool = False
    verify: str = "full"

    @property
    def resume_newest(self) -> bool:
        """Resume the newest checkpoint: --resume, or any restart (--no-resume applies to a
        job's first attempt only: a restart resumes the run's own checkpoints)."""
        return self.resume or self.restarted

    @property
    def overwrite(self) -> bool:
        """Delete another run's checkpoints and metrics first: only for a fresh start."""
        return self.overwrite_output_dir and not self.resume_newest and not self.resume_from


@dataclass(frozen=True)
class StartPlan:
    """What a starting run does: resume ``path`` (``step`` steps done) or start fresh (``path``
    None, ``step`` 0); ``run_id`` names the run either way."""

    run_id: str
    path: str | None = None
    step: int = 0
    lost: tuple[int, ...] = ()
    """Ranks of the checkpoint whose own state no folder holds (several storage domains, more
    lost than buddy copies): the caller rebuilds it (``peers.decide``)."""
    segment: int = 0
    """The timeline the run trains on from here: 0 for a fresh run, else one above every
    checkpoint's ``segment`` in the folder(s), so that a step saved again outranks a stale copy
    (``peers``)."""


def agree_on_start(
    root: Path,
    layout: StorageLayout,
    flags: StartFlags,
    rebuild: Rebuild,
    check: Check = lambda run_id, overwrite: None,
) -> StartPlan:
    """Collective: the checkpoint every rank resumes (a fresh run: ``path`` None), from this
    rank's folder ``root`` (its domain's --checkpoint-dir).

    Each domain's leader lists its folder; rank 0 decides (``peers.decide``) and runs
    ``check(run_id, overwrite)``; the decision is broadcast and ``settle``d; every rank then
    checks that its folder holds the chosen checkpoint (``verify_start``). Rank 0 logs which
    step is resumed and why. ``rebuild``: see ``peers.Rebuild``.

    Raises the same UserError on every rank for a refusal (another run's folder or metrics, a
    checkpoint that cannot be resumed, a folder that cannot be updated). Any other exception on
    a rank is re-raised there, and the other ranks raise RuntimeError naming it, so every rank
    says why the start failed and none waits in a collective.
    """
    if not layout.shared:
        log.info("%s", layout.describe())
    rank = dist.get_rank()
    listed, error = _listings(root, layout, flags, rank)
    decided: StartDecision | Failure | None = None
    if rank == 0:
        decided, error = _decide(listed, layout, flags, rebuild, check, error)
    decision = _received(broadcast_json(_send(decided)), StartDecision.from_json)
    if error is not None:
        raise error
    if not isinstance(decision, StartDecision):
        raise (decision or Failure("rank 0 sent no decision")).exception()
    if decision.note:
        log.info("%s", decision.note)
    plan = settle(decision, root, layout, flags.resume_from)
    verify_start(plan, folder_per_node=not layout.shared)
    return plan


@dataclass(frozen=True)
class Failure:
    """A rank's failed part of the start, told to every rank: ``line`` says what; ``refusal``
    for bad input (a UserError, raised alike on every rank), else anything else (re-raised where
    it happened, a RuntimeError naming it on the other ranks)."""

    line: str
    refusal: bool = False

    def exception(self) -> Exception:
        """The exception a rank that did not fail raises: UserError or RuntimeError."""
        return UserError(self.line) if self.refusal else RuntimeError(self.line)

    def to_json(self) -> JsonObject:
        """``{"line": str, "refusal": bool}``."""
        return {"line": self.line, "refusal": self.refusal}

    @classmethod
    def from_json(cls, value: object) -> Failure:
        """``to_json``'s inverse. Raises ValueError for another shape."""
        fields = json_object(value)
        return cls(json_str(fields["line"]), bool(fields["refusal"]))


def _send(value: Inventory | StartDecision | Failure | None) -> object:
    """The JSON that carries ``value`` across the process group: null, ``{"failure": ...}``
    or ``{"value": ...}`` (``_received`` reads it)."""
    if value is None:
        return None
    return {"failure" if isinstance(value, Failure) else "value": value.to_json()}


def _received[T](value: object, kind: Callable[[object], T]) -> T | Failure | None:
    """``_send``'s value back, its ``value`` read by ``kind`` (a ``from_json``). Raises
    ValueError for another shape."""
    if value is None:
        return None
    fields = json_object(value)
    if "failure" in fields:
        return Failure.from_json(fields["failure"])
    return kind(fields["value"])


def _listings(
    root: Path, layout: StorageLayout, flags: StartFlags, rank: int
) -> tuple[list[Inventory | Failure | None], Exception | None]:
    """Collective: every domain's listing, in domain order (each leader lists its folder; with
    one domain only rank 0's, nothing gathered), and this rank's own exception if its listing
    failed (kept to be re-raised once every rank is told)."""
    mine: Inventory | Failure | None = None
    error: Exception | None = None
    if rank == layout.leader:
        failed = f"rank {rank} failed listing --checkpoint-dir {root}"
        mine, error = _attempt(lambda: list_folder(root, flags.resume_from, flags.verify), failed)
    if layout.shared:
        return [mine], error
    every = all_gather_json(_send(mine))
    return [_received(every[ranks[0]], Inventory.from_json) for ranks in layout.domains], error


def _decide(
    listed: Sequence[Inventory | Failure | None],
    layout: StorageLayout,
    flags: StartFlags,
    rebuild: Rebuild,
    check: Check,
    error: Exception | None,
) -> tuple[StartDecision | Failure, Exception | None]:
    """Rank 0: a leader's failed listing (the first failure, else the first refusal), else
    ``decide``'s decision once ``check`` passes, or the ``Failure`` of either and the exception
    for anything but a refusal (re-raised on rank 0 once every rank is told). ``error``: rank
    0's own failed listing, kept."""
    failures = [item for item in listed if isinstance(item, Failure)]
    if problems := [item for item in failures if not item.refusal] or failures:
        return problems[0], error
    inventories = [item for item in listed if isinstance(item, Inventory)]
    resume, overwrite = flags.resume_newest, flags.overwrite

    def plan() -> StartDecision:
        decided = decide(inventories, layout, resume, flags.resume_from, overwrite, rebuild)
        check(decided.run_id, overwrite)
        return decided

    return _attempt(plan, "rank 0 failed deciding what to resume")


def _attempt[T](action: Callable[[], T], failed: str) -> tuple[T | Failure, Exception | None]:
    """``action()``, or the ``Failure`` of a UserError (a refusal: every rank stops with the
    same line), or ``Failure("<failed>: <type>: <message>")`` with the exception for anything
    else (re-raised where it happened, once every rank is told)."""
    try:
        return action(), None
    except UserError as exc:
        return Failure(str(exc), refusal=True), None
    except Exception as exc:  # re-raised by the caller, once every rank knows
        return Failure(f"{failed}: {type(exc).__name__}: {exc}"), exc


def settle(
    decision: StartDecision, root: Path, layout: StorageLayout, resume_from: str
) -> StartPlan:
    """Collective: carry out ``decide``'s decision in this rank's folder ``root``: delete the
    run (--overwrite-output-dir), set aside newer steps, copy the files each folder lacks
    (``transfer.exchange``) and publish them; returns this rank's ``StartPlan``. A folder error
    on a leader (OSError) stops every rank with one line naming the folder."""
    leader = dist.get_rank() == layout.leader
    _everywhere(leader, lambda: delete_run(root) if decision.delete else None, root)
    step = decision.step
    if step is None:
        return StartPlan(decision.run_id)
    damaged = decision.damaged[layout.domain] if decision.damaged else ()
    _everywhere(leader, lambda: _set_aside(root, step, damaged), root)
    keeper = layout.domain in decision.holders
    own = Path(resume_from) if decision.chosen else root / f"step-{step}"
    source = own if keeper else root / f"step-{step}"  # a keeper of --resume-from reads there
    fetched = root / f"step-{step}.tmp"
    moved = exchange(decision.streams, own, fetched, CHUNK_BYTES)
    if leader and fetched.is_dir():
        final, whole = root / f"step-{step}", not keeper
        _everywhere(True, lambda: _place(fetched, final, step, whole, moved.entries), root)
    else:
        _everywhere(False, lambda: None, root)
    _log_moves(moved, layout, step)
    return StartPlan(decision.run_id, str(source), step, decision.lost, decision.segment)


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


def _set_aside(root: Path, step: int, damaged: Sequence[int]) -> None:
    """Rename the ``damaged`` steps (files that do not match their manifest) to
    ``step-N.damaged`` (``step-N.damaged-2``... when taken: never deleted), complete steps newer
    than ``step`` to ``step-N.stale`` (replacing an older one), and remove what a crash left
    half-written. ``folders.prune`` deletes a stale copy once the run has saved that step
    again."""
    for number in damaged:
        path = root / f"step-{number}"
        if (path / MARKER).is_file():
            (path / MARKER).unlink()
            aside = _free_name(root, f"step-{number}.damaged")
            path.rename(aside)
            log.warning("set aside the damaged %s as %s", path, aside.name)
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


def _free_name(root: Path, name: str) -> Path:
    """``root/name``, or ``root/name-2``, ``-3``... where that is taken."""
    path, count = root / name, 1
    while path.exists():
        count += 1
        path = root / f"{name}-{count}"
    return path


def _place(
    fetched: Path, final: Path, step: int, whole: bool, entries: Mapping[str, Entry]
) -> None:
    """Publish a ``whole`` fetched step (the folder lacked it, or held a stale or damaged copy,
    which is replaced) once every received file matches the sender's manifest (``entries``:
    size and SHA-256 hashed while receiving); or move fetched per-rank files into the step this
    folder keeps (each file renamed into place, atomically, then the folder fsynced) and add
    them to its manifest. Raises OSError (EIO) naming a received file that does not match the
    manifest it came with."""
    if whole:
        if problem := check_received(fetched, entries):
            raise OSError(errno.EIO, f"a copy from a peer is damaged: {problem}")
        publish(fetched, final, step)
        return
    for file in sorted(fetched.rglob("*")):
        if file.is_file():
            os.replace(file, final / file.relative_to(fetched))
    fsync_dir(final)
    shutil.rmtree(fetched)
    add_entries(final, entries)


def _log_moves(moved: Moved, layout: StorageLayout, step: int) -> None:
    """Rank 0 logs what each domain's leader received: bytes, seconds, rate."""
    every = [json_list(pair, 2) for pair in all_gather_json([moved.received, moved.seconds])]
    for ranks in layout.domains:
        received, seconds = json_int(every[ranks[0]][0]), json_float(every[ranks[0]][1])
        if received:
            rate = received / max(seconds, 1e-9) / 2**20
            log.info(
                "step %d: the folder of %s got %.1f MiB from peers in %.2f s (%.1f MiB/s)",
                step, span(ranks), received / 2**20, seconds, rate,
            )  # fmt: skip


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


def verify_start(
    plan: StartPlan, device: torch.device | None = None, folder_per_node: bool = False
) -> None:
    """Collective: every rank checks ``check_start(plan)``; one all-reduce (MIN) of the verdicts
    on ``device`` (default: the group's, ``ranks.collective_device``).

    Raises UserError on every rank (so none waits in a later collective) when any rank does not
    see the checkpoint rank 0 chose, e.g. a stale view of a shared --checkpoint-dir
    (``folder_per_node``: each rank checks its own folder after the copies; the hint differs).
    """
    problem = check_start(plan)
    verdict = torch.tensor([0 if problem else 1], device=device or collective_device())
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
