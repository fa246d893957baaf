"""Resuming with several checkpoint folders (storage domains, see ``storage``): what each folder
holds, the newest step that every rank can resume, and the files that a folder lacking it gets
from a peer's folder over the process group.

At start, the leader of every domain lists its folder (``inventory``: the run id, every complete
step with its files and sizes); rank 0 gathers the lists and decides (``plan_across``); every
rank then takes part in the copies the decision names (``settle``). A step can be resumed when
some folder holds it complete (the replicated state) and every rank's own files of it are held by
some folder (its own, or a buddy copy). The newest such step wins; where none is whole, the
newest step whose missing per-rank state the caller can rebuild (``Rebuild``) is taken, with the
ranks to rebuild named; else every rank stops with one line. Complete steps newer than the one
resumed belong to a future that will be trained again: they are set aside as ``step-N.stale``.

Source of the idea: torchft's ``checkpointing/`` (a replica that comes back gets its state from a
healthy peer, not from shared storage), https://github.com/meta-pytorch/torchft.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import torch.distributed as dist

from torchrun_ddp.checkpoint.folders import (
    MARKER,
    META_JSON,
    complete_steps,
    publish,
    remove_incomplete,
    step_dirs,
)
from torchrun_ddp.checkpoint.ranks import all_gather_json, barrier, broadcast_json
from torchrun_ddp.checkpoint.run_identity import (
    OTHER_RUN,
    StartPlan,
    delete_run,
    new_run_id,
    read_run_id,
)
from torchrun_ddp.checkpoint.storage import StorageLayout
from torchrun_ddp.checkpoint.transfer import CHUNK_BYTES, Moved, Stream, exchange
from torchrun_ddp.errors import UserError

log = logging.getLogger("torchrun_ddp")

Inventory = dict[str, object]
"""One folder's listing (JSON): ``run_id``, ``leftovers`` (any step folder at all), ``steps``
(``{"<N>": step info}``) and ``resume_from`` (the step info of --resume-from, or None)."""

Rebuild = Callable[[Mapping[str, object]], str]
"""``meta of the step -> ""`` when the caller can rebuild a rank's lost own state of that
checkpoint, else why not (one clause)."""

META_KEYS = ("step", "run_id", "world_size", "data_since", "segment")
"""The meta.json keys an inventory carries (the rest stays on disk). ``segment`` counts the
resumes of the run before the save: a step saved again after a resume from an older one (a new
timeline) has a higher segment, and a folder's copy with a lower one is stale."""
_RANK_FILE = re.compile(r"rank-(\d+)\.(json|safetensors)")


def inventory(root: Path, resume_from: str = "") -> Inventory:
    """What ``root`` holds (a domain leader's view): reads folders and meta files only."""
    steps = {str(step): _step_info(path) for step, path in complete_steps(root)}
    chosen = Path(resume_from) if resume_from else None
    return {
        "run_id": read_run_id(root),
        "leftovers": bool(step_dirs(root)),
        "steps": steps,
        "resume_from": _step_info(chosen) if chosen and (chosen / MARKER).is_file() else None,
    }


def _step_info(path: Path) -> dict[str, object]:
    """``{"meta": {META_KEYS}, "files": [[relative path, bytes], ...]}`` of a complete step."""
    meta = json.loads((path / META_JSON).read_text())
    files = sorted(
        [str(file.relative_to(path)), file.stat().st_size]
        for file in path.rglob("*")
        if file.is_file() and file.name != MARKER
    )
    return {"meta": {key: meta.get(key) for key in META_KEYS}, "files": files}


def _ranks_in(info: Mapping[str, object]) -> set[int]:
    """The ranks whose two own files a step info lists."""
    names = [str(name) for name, _ in info["files"]]
    found = [_RANK_FILE.fullmatch(name) for name in names]
    ranks = {int(match.group(1)) for match in found if match}
    return {rank for rank in ranks if {f"rank-{rank}.json", f"rank-{rank}.safetensors"} <= {*names}}


def plan_across(
    inventories: Sequence[Inventory],
    layout: StorageLayout,
    resume: bool,
    resume_from: str,
    overwrite: bool,
    rebuild: Rebuild,
) -> dict[str, object]:
    """Rank 0's decision from every domain's ``inventory`` (JSON, broadcast as is):
    ``{"plan": StartPlan fields, "delete": bool, "streams": [[src, dst, [[file, bytes]...]]],
    "source": "root" | "resume_from", "note": str}``.

    Raises UserError when the folders hold different runs, --no-resume meets a run's
    checkpoints without --overwrite-output-dir, --resume-from is complete in no folder, or no
    step can be resumed (every reason named)."""
    runs = sorted({str(inv["run_id"]) for inv in inventories if inv["run_id"]})
    if len(runs) > 1:
        raise UserError(
            f"the nodes' --checkpoint-dir folders hold different runs ({', '.join(runs)}); give "
            "every node the folder of one run, or start fresh with new folders"
        )
    existing = runs[0] if runs else None
    if not resume and not resume_from:
        return _fresh(inventories, existing, overwrite)
    key = "resume_from" if resume_from else "steps"
    candidates = _candidates(inventories, key, existing, resume_from)
    if not candidates:
        return {"plan": {"run_id": existing or new_run_id()}, "delete": False, "streams": []}
    return _choose(candidates, layout, key, existing, rebuild)


def _fresh(inventories: Sequence[Inventory], existing: str | None, overwrite: bool) -> dict:
    """--no-resume: a new run id; a run already in some folder is deleted with ``overwrite``,
    else refused."""
    held = existing is not None or any(inv["leftovers"] for inv in inventories)
    if held and not overwrite:
        raise UserError(
            f"--no-resume: the --checkpoint-dir folders hold the checkpoints of run "
            f"{existing or '(unnamed)'}, which a new run must not mix with; {OTHER_RUN}"
        )
    return {"plan": {"run_id": new_run_id()}, "delete": held, "streams": []}


def _candidates(
    inventories: Sequence[Inventory], key: str, existing: str | None, resume_from: str
) -> dict[int, dict[int, Mapping[str, object]]]:
    """``{step: {domain: step info}}`` of the steps that can be resumed at all, newest first."""
    found: dict[int, dict[int, Mapping[str, object]]] = {}
    for domain, inv in enumerate(inventories):
        infos = [inv["resume_from"]] if key == "resume_from" else list(inv["steps"].values())
        for info in (i for i in infos if i):
            meta = info["meta"]
            if existing is not None and meta.get("run_id", existing) != existing:
                raise UserError(
                    f"checkpoint step {meta['step']} belongs to run {meta['run_id']}, but the "
                    f"folders hold run {existing}; resume into the checkpoint's own folders"
                )
            found.setdefault(int(meta["step"]), {})[domain] = info
    if key == "resume_from" and not found:
        raise UserError(
            f"--resume-from {resume_from} is not a complete checkpoint on any node; pass a "
            "step-N folder that some node holds"
        )
    return {step: _newest(found[step]) for step in sorted(found, reverse=True)}


def _newest(holders: dict[int, Mapping[str, object]]) -> dict[int, Mapping[str, object]]:
    """The holders of a step whose copy has the highest ``segment`` (the newest timeline); a
    folder with an older copy counts as lacking the step (it gets the new one)."""
    segment = {domain: int(info["meta"].get("segment") or 0) for domain, info in holders.items()}
    newest = max(segment.values())
    return {domain: info for domain, info in holders.items() if segment[domain] == newest}


def _choose(
    candidates: Mapping[int, Mapping[int, Mapping[str, object]]],
    layout: StorageLayout,
    key: str,
    existing: str | None,
    rebuild: Rebuild,
) -> dict[str, object]:
    """The newest step every rank can resume exactly, else the newest whose lost per-rank
    state can be rebuilt; the copies it takes and a one-line note."""
    reasons, fallback = [], None
    for step, holders in candidates.items():
        lost, streams = _serve(holders, layout, key)
        meta = next(iter(holders.values()))["meta"]
        if not lost:
            return _decision(step, existing, [], streams, key, reasons, sorted(holders))
        why = rebuild(meta)
        reasons.append(f"step {step}: the own state of {_ranks(lost)} is in no folder")
        if not why and fallback is None:
            fallback = (step, lost, streams, sorted(holders))
        elif why:
            reasons[-1] += f" and {why}"
    if fallback is not None:
        step, lost, streams, held = fallback
        return _decision(step, existing, lost, streams, key, reasons, held)
    raise UserError(f"no checkpoint can be resumed: {'; '.join(reasons)}; {_MORE_COPIES}")


_MORE_COPIES = "keep more copies (--buddy-copies) or start fresh with --no-resume"


def _world(layout: StorageLayout) -> int:
    return sum(len(ranks) for ranks in layout.domains)


def _ranks(ranks: Sequence[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _decision(
    step: int,
    existing: str | None,
    lost: list[int],
    streams: list[list[object]],
    key: str,
    reasons: list[str],
    holders: list[int],
) -> dict[str, object]:
    note = f"resuming step {step} from the nodes' own folders"
    if reasons:
        note += f" ({'; '.join(reasons)})"
    if lost:
        note += f"; the own state of {_ranks(lost)} is rebuilt"
    plan = {"run_id": existing or new_run_id(), "step": step, "lost": lost}
    decision = {"plan": plan, "delete": False, "streams": streams, "source": key, "note": note}
    return {**decision, "holders": holders}


def _serve(
    holders: Mapping[int, Mapping[str, object]],
    layout: StorageLayout,
    key: str,
) -> tuple[list[int], list[list[object]]]:
    """For one step: the ranks whose own files no folder holds, and the streams (source
    leader, target leader, files) that give every domain what it must hold."""
    info = next(iter(holders.values()))
    old_world = int(info["meta"]["world_size"])
    resharded = old_world != _world(layout)
    held = {rank for entry in holders.values() for rank in _ranks_in(entry)}
    needed = set(range(old_world)) if resharded else set()
    wanted: dict[int, set[int]] = {}
    for domain, ranks in enumerate(layout.domains):
        own = set(range(old_world)) if resharded else set(ranks) & set(range(old_world))
        needed |= own
        extra = set() if key == "resume_from" and domain in holders else set(layout.keeps(domain))
        wanted[domain] = (own | extra) & set(range(old_world))
    lost = sorted(needed - held)
    streams = []
    for domain in range(len(layout.domains)):
        streams += _streams_to(domain, wanted[domain] & held, holders, layout)
    return lost, streams


def _streams_to(
    domain: int,
    ranks: set[int],
    holders: Mapping[int, Mapping[str, object]],
    layout: StorageLayout,
) -> list[list[object]]:
    """The streams into ``domain``'s folder: if it lacks the step, every replicated file of one
    holder (DCP shards are written per domain: never mixed); and the own files of ``ranks`` it
    lacks, each from the first holder that has them."""
    have = {str(name) for name, _ in holders[domain]["files"]} if domain in holders else set()
    by_source: dict[int, list[list[object]]] = {}
    if domain not in holders:
        first = min(holders)
        shared = [[n, b] for n, b in holders[first]["files"] if not _RANK_FILE.fullmatch(str(n))]
        by_source[first] = shared
    for rank in sorted(ranks):
        names = {f"rank-{rank}.json", f"rank-{rank}.safetensors"}
        if names <= have:
            continue
        source = min(h for h, info in holders.items() if h != domain and rank in _ranks_in(info))
        files = [[n, b] for n, b in holders[source]["files"] if str(n) in names]
        by_source.setdefault(source, []).extend(files)
    leader = layout.domains[domain][0]
    return [[layout.domains[src][0], leader, files] for src, files in sorted(by_source.items())]


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

    Raises the same UserError on every rank when the decision is refused or a copy fails."""
    mine: Inventory | None = None
    if _is_leader(layout):
        try:
            mine = inventory(root, resume_from)
        except (OSError, ValueError, KeyError, UserError) as exc:  # told to everyone below
            mine = {"error": f"cannot list --checkpoint-dir {root} on rank {_rank()}: {exc}"}
    listed = all_gather_json(mine)
    inventories = [listed[ranks[0]] for ranks in layout.domains]
    decision: dict[str, object] = {}
    if dist.get_rank() == 0:
        decision = _decide(inventories, layout, resume, resume_from, overwrite, rebuild, check)
    decision = dict(broadcast_json(decision))
    if "error" in decision:
        raise UserError(str(decision["error"]))
    if decision.get("note"):
        log.info("%s", decision["note"])
    return settle(decision, root, layout, resume_from)


def _decide(
    inventories: Sequence[Inventory],
    layout: StorageLayout,
    resume: bool,
    resume_from: str,
    overwrite: bool,
    rebuild: Rebuild,
    check: Callable[[str], None],
) -> dict[str, object]:
    """Rank 0: ``plan_across`` and ``check``, or ``{"error": line}`` for a folder that could not
    be listed or a refusal, so that every rank stops with the same line."""
    unreadable = [inv["error"] for inv in inventories if "error" in inv]
    if unreadable:
        return {"error": str(unreadable[0])}
    try:
        decision = plan_across(inventories, layout, resume, resume_from, overwrite, rebuild)
        check(str(decision["plan"]["run_id"]))
    except UserError as exc:
        return {"error": str(exc)}
    return decision


def _rank() -> int:
    return dist.get_rank()


def _is_leader(layout: StorageLayout) -> bool:
    return _rank() == layout.leader


def settle(
    decision: Mapping[str, object], root: Path, layout: StorageLayout, resume_from: str
) -> StartPlan:
    """Collective: carry out ``plan_across``'s decision in this rank's folder ``root``: delete
    the run (--overwrite-output-dir), set aside newer steps, copy the files each folder lacks
    (``transfer.exchange``) and publish them; returns this rank's ``StartPlan``."""
    plan = dict(decision["plan"])
    step = plan.get("step")
    leader = _is_leader(layout)
    if leader and decision.get("delete"):
        delete_run(root)
    if step is None:
        barrier()
        return StartPlan(str(plan["run_id"]))
    if leader:
        _set_aside(root, int(step))
    barrier()
    streams = [Stream(int(s), int(d), tuple((str(n), int(b)) for n, b in f)) for s, d, f in
               decision["streams"]]  # fmt: skip
    source = Path(resume_from) if decision.get("source") == "resume_from" else root / f"step-{step}"
    fetched = root / f"step-{step}.tmp"
    moved = exchange(streams, source, fetched, CHUNK_BYTES)
    if leader and fetched.is_dir():
        whole = layout.domain not in decision.get("holders", [])
        _place(fetched, root / f"step-{step}", int(step), whole)
    barrier()
    _log_moves(moved, layout, int(step))
    local = source if source.is_dir() and (source / MARKER).is_file() else root / f"step-{step}"
    lost = tuple(int(rank) for rank in plan.get("lost", []))
    return StartPlan(str(plan["run_id"]), str(local), int(step), lost)


def _set_aside(root: Path, step: int) -> None:
    """Rename complete steps newer than ``step`` to ``step-N.stale`` (replacing an older one)
    and remove what a crash left half-written."""
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
    replaced), or move fetched per-rank files into the step this folder holds (each file
    renamed into place, atomically)."""
    if whole or not (final / MARKER).is_file():
        publish(fetched, final, step)
        return
    for file in sorted(fetched.rglob("*")):
        if file.is_file():
            os.replace(file, final / file.relative_to(fetched))
    shutil.rmtree(fetched)


def _log_moves(moved: Moved, layout: StorageLayout, step: int) -> None:
    """Rank 0 logs what each domain's leader received: bytes, seconds, rate."""
    every = all_gather_json([moved.received, moved.seconds])
    for ranks in layout.domains:
        received, seconds = every[ranks[0]]
        if int(received):
            rate = int(received) / max(float(seconds), 1e-9) / 2**20
            log.info(
                "step %d: the folder of ranks %d-%d got %.1f MiB from peers in %.2f s "
                "(%.1f MiB/s)", step, ranks[0], ranks[-1], int(received) / 2**20,
                float(seconds), rate,
            )  # fmt: skip
