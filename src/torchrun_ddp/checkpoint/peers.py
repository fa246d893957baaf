"""Planning a start from the checkpoint folders of a run's storage domains (see ``storage``: one
for a shared file system, one per node or site otherwise): what each folder holds, the newest
step that every rank can resume, and the files that each folder must get from a peer's (none
with one domain). Files and JSON only: the collective part is ``start``.

A domain's leader lists its folder (``inventory``: the run id, every complete step with its
files and sizes); rank 0 decides from every list (``plan_across``): resume the newest step
(--resume), a chosen one (--resume-from), or start a new run (--no-resume, refused in a folder
that holds another run unless told to overwrite it). A step can be resumed when some folder
holds it complete (the replicated state) and every rank's own files of it are held by some
folder (its own, or a buddy copy). The newest such step wins; where none is whole, the newest
step whose missing per-rank state the caller can rebuild (``Rebuild``) is taken, with the ranks
to rebuild named; else the decision is a one-line refusal. Of two copies of one step, the one
saved on the newer timeline (a higher ``segment``) counts; a folder with the older copy gets the
newer one whole.

Source of the idea: torchft's ``checkpointing/`` (a replica that comes back gets its state from
a healthy peer, not from shared storage), https://github.com/meta-pytorch/torchft.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from torchrun_ddp.checkpoint.folders import MARKER, META_JSON, complete_steps, step_dirs
from torchrun_ddp.checkpoint.manifest import MANIFEST, UNVERIFIED, verify_step
from torchrun_ddp.checkpoint.run_identity import OTHER_RUN, new_run_id, read_run_id
from torchrun_ddp.checkpoint.storage import StorageLayout
from torchrun_ddp.errors import UserError

log = logging.getLogger("torchrun_ddp")

Inventory = dict[str, object]
"""One folder's listing (JSON): ``root`` (the folder, named in refusals), ``run_id``,
``leftovers`` (any step folder at all), ``steps`` (``{"<N>": step info}``) and ``resume_from``
(the step info of --resume-from, or None)."""

StepInfo = dict[str, object]
"""``{"meta": {META_KEYS}, "files": [[path relative to the step folder, bytes], ...]}``."""

Rebuild = Callable[[Mapping[str, object]], str]
"""``meta of the step -> ""`` when the caller can rebuild a rank's lost own state of that
checkpoint, else why not (one clause)."""

META_KEYS = ("step", "run_id", "world_size", "data_since", "segment")
"""The meta.json keys an inventory carries (the rest stays on disk). ``segment`` numbers the
run's timelines: each start that resumes takes one above every segment in every folder, so a
step saved again after a resume from an older one outranks a stale copy of it."""
_RANK_FILE = re.compile(r"rank-(\d+)\.(json|safetensors)")


def inventory(root: Path, resume_from: str = "", verify: str = "full") -> Inventory:
    """What ``root`` holds (a domain leader's view); reads folders and meta files, and checks
    every complete step against its manifest (``manifest.verify_step`` with ``verify``: full,
    size or off; the seconds are logged). A step whose meta.json cannot be read is left out
    (with a warning): it cannot be resumed. A damaged step is left out too, as if the folder
    lacked it, with one warning line naming the file; ``damaged`` maps its step to that
    clause. A step without a manifest (older code) is listed, with a warning.

    Raises UserError for an unreadable run.json, OSError for a folder that cannot be listed."""
    steps: dict[str, StepInfo] = {}
    damaged: dict[str, str] = {}
    started, checked = time.perf_counter(), 0
    for step, path in complete_steps(root):
        info = _step_info(path)
        if info is None:
            continue
        checked += 1
        if problem := _verified(path, verify):
            damaged[str(step)] = problem
            continue
        steps[str(step)] = info
    chosen = Path(resume_from) if resume_from else None
    picked = None
    if chosen and (chosen / MARKER).is_file():
        picked = _step_info(chosen)
        checked += 1
        if picked is not None and (problem := _verified(chosen, verify)):
            damaged["resume_from"], picked = problem, None
    if checked and verify != "off":
        seconds = time.perf_counter() - started
        log.info("verified %d checkpoint(s) in %s (%s) in %.2f s", checked, root, verify, seconds)
    return {
        "root": str(root),
        "run_id": read_run_id(root),
        "leftovers": bool(step_dirs(root)),
        "steps": steps,
        "resume_from": picked,
        "damaged": damaged,
    }


def _verified(path: Path, verify: str) -> str:
    """``manifest.verify_step``'s clause for a damaged step ("" otherwise), logged in one line;
    a step without a manifest is logged as unverified and counts as intact."""
    problem = verify_step(path, verify)
    if problem == UNVERIFIED:
        log.warning("%s has no %s (saved by an older version): loaded unverified", path, MANIFEST)
        return ""
    if problem:
        log.warning("%s is damaged: %s; it counts as absent in this folder", path, problem)
    return problem


def _step_info(path: Path) -> StepInfo | None:
    """A complete step's ``StepInfo``, or None when its meta.json is unreadable or not a
    checkpoint's (no ``step`` or ``world_size``)."""
    try:
        meta = json.loads((path / META_JSON).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        log.warning("left out %s: cannot read its %s (%s)", path, META_JSON, exc)
        return None
    if not isinstance(meta, dict) or not {"step", "world_size"} <= set(meta):
        log.warning("left out %s: its %s is not a checkpoint's", path, META_JSON)
        return None
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
    """Rank 0's decision from every domain's ``inventory`` (JSON, broadcast as is; with one
    domain nothing is copied):
    ``{"plan": StartPlan fields, "delete": bool, "streams": [[src, dst, [[file, bytes]...]]],
    "holders": [domains that keep their own copy], "source": "root" | "resume_from",
    "note": str}``.

    Raises UserError when the folders hold different runs, --no-resume meets a run's
    checkpoints without --overwrite-output-dir, a checkpoint belongs to another run than its
    folder, --resume-from is complete in no folder, or no step can be resumed (every reason
    named)."""
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
        if damage := _damage(inventories):
            raise UserError(
                f"no intact checkpoint to resume: {damage}; restore that file from a copy, or "
                "start fresh with --no-resume --overwrite-output-dir (nothing was loaded)"
            )
        return {"plan": {"run_id": existing or new_run_id()}, "delete": False, "streams": []}
    where = _named(inventories) if len(inventories) == 1 else "the nodes' own folders"
    decision = _choose(candidates, layout, key, existing, rebuild, where)
    if damage := _damage(inventories):
        decision["note"] += f" (damaged, set aside: {damage})"
    decision["plan"]["segment"] = 1 + _last_segment(inventories)
    return decision


def _damage(inventories: Sequence[Inventory]) -> str:
    """The damaged steps of every folder, one clause each (``step N: <file> ...``), "" for
    none."""
    return "; ".join(
        f"step {step}: {problem}" if step != "resume_from" else problem
        for inv in inventories
        for step, problem in dict(inv.get("damaged") or {}).items()
    )


def _named(inventories: Sequence[Inventory]) -> str:
    """How a line names the checkpoint folders: ``--checkpoint-dir <root>`` with one domain."""
    if len(inventories) == 1:
        return f"--checkpoint-dir {inventories[0]['root']}"
    return "the --checkpoint-dir folders"


def _hold(inventories: Sequence[Inventory]) -> str:
    """``"--checkpoint-dir <root> holds"`` (one domain) or ``"the --checkpoint-dir folders
    hold"``."""
    return _named(inventories) + (" holds" if len(inventories) == 1 else " hold")


def _last_segment(inventories: Sequence[Inventory]) -> int:
    """The highest ``segment`` of any step in any folder (0 without one)."""
    infos = [info for inv in inventories for info in [*inv["steps"].values(), inv["resume_from"]]]
    return max((int(info["meta"].get("segment") or 0) for info in infos if info), default=0)


def _fresh(
    inventories: Sequence[Inventory], existing: str | None, overwrite: bool
) -> dict[str, object]:
    """--no-resume: a new run id; a run already in some folder is deleted with ``overwrite``,
    else refused."""
    held = existing is not None or any(inv["leftovers"] for inv in inventories)
    if held and not overwrite:
        raise UserError(
            f"--no-resume: {_hold(inventories)} the checkpoints of run "
            f"{existing or '(unnamed)'}, which a new run must not mix with; {OTHER_RUN}"
        )
    return {"plan": {"run_id": new_run_id()}, "delete": held, "streams": []}


def _candidates(
    inventories: Sequence[Inventory], key: str, existing: str | None, resume_from: str
) -> dict[int, dict[int, StepInfo]]:
    """``{step: {domain: step info}}`` of the steps that can be resumed at all, newest first."""
    found: dict[int, dict[int, StepInfo]] = {}
    for domain, inv in enumerate(inventories):
        infos = [inv["resume_from"]] if key == "resume_from" else list(inv["steps"].values())
        for info in (i for i in infos if i):
            meta = info["meta"]
            if existing is not None and (meta.get("run_id") or existing) != existing:
                raise UserError(
                    f"checkpoint step {meta['step']} belongs to run {meta['run_id']}, but "
                    f"{_hold(inventories)} run {existing}; resume into the checkpoint's own "
                    "folder, or pass a new --checkpoint-dir"
                )
            found.setdefault(int(meta["step"]), {})[domain] = info
    if key == "resume_from" and not found:
        if damage := _damage(inventories):
            raise UserError(f"--resume-from {resume_from} is damaged: {damage}; pass an intact one")
        where = ("", "") if len(inventories) == 1 else (" on any node", " that some node holds")
        raise UserError(
            f"--resume-from {resume_from} is not a complete checkpoint{where[0]}; pass a "
            f"complete step-N folder{where[1]}"
        )
    return {step: _newest(found[step]) for step in sorted(found, reverse=True)}


def _newest(holders: dict[int, StepInfo]) -> dict[int, StepInfo]:
    """The holders of a step whose copy has the highest ``segment`` (the newest timeline); a
    folder with an older copy counts as lacking the step (it gets the new one)."""
    segment = {domain: int(info["meta"].get("segment") or 0) for domain, info in holders.items()}
    newest = max(segment.values())
    return {domain: info for domain, info in holders.items() if segment[domain] == newest}


_MORE_COPIES = "keep more copies (--buddy-copies) or start fresh with --no-resume"


def _choose(
    candidates: Mapping[int, dict[int, StepInfo]],
    layout: StorageLayout,
    key: str,
    existing: str | None,
    rebuild: Rebuild,
    where: str,
) -> dict[str, object]:
    """The newest step every rank can resume exactly, else the newest whose lost per-rank
    state can be rebuilt; the copies it takes and a one-line note (``resuming step N from
    <where>``)."""
    reasons: list[str] = []
    fallback = None
    for step, holders in candidates.items():
        served = _serve(holders, layout, key)
        if not served.lost:
            return _decision(step, holders, served, key, existing, reasons, where)
        why = rebuild(next(iter(holders.values()))["meta"])
        reasons.append(f"step {step}: the own state of {_ranks(served.lost)} is in no folder")
        if why:
            reasons[-1] += f" and {why}"
        elif fallback is None:
            fallback = (step, holders, served)
    if fallback is not None:
        return _decision(*fallback, key, existing, reasons, where)
    raise UserError(f"no checkpoint can be resumed: {'; '.join(reasons)}; {_MORE_COPIES}")


def _ranks(ranks: Sequence[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


class _Served:
    """For one step: the ranks whose own files no folder can give, the domains that keep
    their own copy (``holders``), and the streams (source leader, target leader, files)."""

    def __init__(self) -> None:
        self.lost: list[int] = []
        self.holders: list[int] = []
        self.streams: list[list[object]] = []


def _decision(
    step: int,
    holders: Mapping[int, StepInfo],
    served: _Served,
    key: str,
    existing: str | None,
    reasons: list[str],
    where: str,
) -> dict[str, object]:
    note = f"resuming step {step} from {where}"
    if reasons:
        note += f" ({'; '.join(reasons)})"
    if served.lost:
        note += f"; the own state of {_ranks(served.lost)} is rebuilt"
    saved_id = next(iter(holders.values()))["meta"].get("run_id")
    run_id = existing or saved_id or new_run_id()
    plan = {"run_id": run_id, "step": step, "lost": served.lost}
    decision = {"plan": plan, "delete": False, "streams": served.streams, "source": key}
    return {**decision, "holders": served.holders, "note": note}


def _serve(holders: Mapping[int, StepInfo], layout: StorageLayout, key: str) -> _Served:
    """What resuming one step takes. Every domain must hold the own files of its ranks (at
    another world size: of every old rank) and should hold its buddy copies. A domain keeps its
    own copy where it has one of the newest timeline (for --resume-from: only if that copy also
    has its ranks' files, since fetched files go to its own folder); every other domain gets a
    whole copy (the replicated files of one holder, never mixed, and the rank files)."""
    info = next(iter(holders.values()))
    old_world = int(info["meta"]["world_size"])
    resharded = old_world != sum(len(ranks) for ranks in layout.domains)
    held = {domain: _ranks_in(entry) for domain, entry in holders.items()}
    served = _Served()
    lost: set[int] = set()
    for domain, ranks in enumerate(layout.domains):
        must = set(range(old_world)) if resharded else set(ranks) & set(range(old_world))
        wanted = (must | set(layout.keeps(domain))) & set(range(old_world))
        keeps = domain in holders and (key == "steps" or must <= held[domain])
        sources = {d: r for d, r in held.items() if d != domain}
        available = set().union(held[domain] if keeps else set(), *sources.values())
        lost |= must - available
        if keeps:
            served.holders.append(domain)
            wanted = set() if key == "resume_from" else wanted - held[domain]
        served.streams += _streams_to(domain, wanted, holders, sources, layout, whole=not keeps)
    served.lost = sorted(lost)
    return served


def _streams_to(
    domain: int,
    ranks: set[int],
    holders: Mapping[int, StepInfo],
    sources: Mapping[int, set[int]],
    layout: StorageLayout,
    whole: bool,
) -> list[list[object]]:
    """The streams into ``domain``'s folder: with ``whole``, every replicated file of one other
    holder; and the own files of ``ranks``, each from the first other holder that has them."""
    by_source: dict[int, list[list[object]]] = {}
    if whole:
        first = min(sources) if sources else None
        if first is None:
            return []
        by_source[first] = [
            [n, b] for n, b in holders[first]["files"] if not _RANK_FILE.fullmatch(str(n))
        ]
    for rank in sorted(ranks):
        source = next((d for d in sorted(sources) if rank in sources[d]), None)
        if source is None:
            continue  # no other folder has it: lost, or (a keeper's own) already there
        names = {f"rank-{rank}.json", f"rank-{rank}.safetensors"}
        files = [[n, b] for n, b in holders[source]["files"] if str(n) in names]
        by_source.setdefault(source, []).extend(files)
    leader = layout.domains[domain][0]
    return [[layout.domains[src][0], leader, files] for src, files in sorted(by_source.items())]
