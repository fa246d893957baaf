"""Planning a start from the checkpoint folders of a run's storage domains (see ``storage``: one
for a shared file system, one per node or site otherwise): what each folder holds, the newest
step that every rank can resume, and the files that each folder must get from a peer's (none
with one domain). Files and JSON only: the collective part is ``start``.

A domain's leader lists its folder (``list_folder``: the run id, every complete step with its
files and sizes); rank 0 decides from every list (``decide``): resume the newest step
(--resume), a chosen one (--resume-from), or start a new run (--no-resume, refused in a folder
that holds another run unless told to overwrite it). A step can be resumed when some folder
holds it complete (the replicated state) and every rank's own files of it are held by some
folder (its own, or a buddy copy). The newest such step wins; where none is whole, the newest
step whose missing per-rank state the caller can rebuild (``Rebuild``) is taken, with the ranks
to rebuild named; else the decision is a one-line refusal. Of two copies of one step, the one
saved on the newer timeline (a higher ``segment``) counts; a folder with the older copy gets the
newer one whole.

Typed values: a folder's listing is an ``Inventory`` (of ``StepListing``), the decision a
``StartDecision``; both cross the process group as JSON (``to_json`` / ``from_json``).
``list_folder`` and ``decide`` answer with them; ``inventory`` and ``plan_across`` give the same
answers in their JSON forms. A step's meta.json values are read (``StepListing.step``...) where
the decision uses them, so a listing carries a damaged value and the decision fails naming it.

Source of the idea: torchft's ``checkpointing/`` (a replica that comes back gets its state from
a healthy peer, not from shared storage), https://github.com/meta-pytorch/torchft.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from torchrun_ddp.checkpoint.folders import MARKER, META_JSON, complete_steps, step_dirs
from torchrun_ddp.checkpoint.manifest import MANIFEST, UNVERIFIED, verify_step
from torchrun_ddp.checkpoint.ranks import (
    JsonObject,
    int_rows,
    json_int,
    json_ints,
    json_list,
    json_object,
    json_optional_str,
    json_rows,
    json_str,
)
from torchrun_ddp.checkpoint.run_identity import OTHER_RUN, new_run_id, read_run_id
from torchrun_ddp.checkpoint.storage import StorageLayout
from torchrun_ddp.checkpoint.transfer import Files, Stream, files_from_json, files_to_json
from torchrun_ddp.errors import UserError

log = logging.getLogger("torchrun_ddp")

Rebuild = Callable[[Mapping[str, object]], str]
"""``meta of the step -> ""`` when the caller can rebuild a rank's lost own state of that
checkpoint, else why not (one clause). It gets the step's ``META_KEYS`` as saved
(``StepListing.saved``), as ``resume.rebuild_problem`` reads them."""

META_KEYS = ("step", "run_id", "world_size", "data_since", "segment")
"""The meta.json keys an inventory carries (the rest stays on disk). ``segment`` numbers the
run's timelines: each start that resumes takes one above every segment in every folder, so a
step saved again after a resume from an older one outranks a stale copy of it."""
_RANK_FILE = re.compile(r"rank-(\d+)\.(json|safetensors)")
_CHOSEN = "resume_from"
"""The key of --resume-from's step in an inventory's ``damaged`` and a decision's ``source``
(JSON)."""


@dataclass(frozen=True)
class StepListing:
    """One complete step as a folder holds it."""

    saved: JsonObject
    """Its meta.json's ``META_KEYS`` as saved (None where absent), read by the properties
    below where the decision uses them (so a damaged value fails the decision, naming it)."""
    files: Files
    """Every file but the marker: (path relative to the step folder, bytes), sorted."""

    @property
    def step(self) -> int:
        """Optimizer steps done. Raises ValueError when the saved value is not an integer."""
        return json_int(self.saved.get("step"))

    @property
    def world_size(self) -> int:
        """Ranks that saved it. Raises ValueError when the saved value is not an integer."""
        return json_int(self.saved.get("world_size"))

    @property
    def run_id(self) -> str | None:
        """The run that saved it (None: saved without a run id)."""
        return json_optional_str(self.saved.get("run_id"))

    @property
    def segment(self) -> int:
        """Its timeline (0 when not saved). Raises ValueError for a value not an integer."""
        return json_int(self.saved.get("segment") or 0)

    @property
    def ranks(self) -> set[int]:
        """The ranks whose two own files the step holds."""
        names = {name for name, _ in self.files}
        found = (_RANK_FILE.fullmatch(name) for name in names)
        ranks = {int(match.group(1)) for match in found if match}
        return {r for r in ranks if {f"rank-{r}.json", f"rank-{r}.safetensors"} <= names}

    def to_json(self) -> JsonObject:
        """``{"meta": {META_KEYS}, "files": [[path, bytes], ...]}``."""
        return {"meta": dict(self.saved), "files": files_to_json(self.files)}

    @classmethod
    def from_json(cls, value: object) -> StepListing:
        """``to_json``'s inverse. Raises ValueError for another shape."""
        fields = json_object(value)
        return cls(dict(json_object(fields["meta"])), files_from_json(fields["files"]))


@dataclass(frozen=True)
class Inventory:
    """One folder's listing, by its domain's leader (``list_folder``)."""

    root: str
    """The folder (named in refusals)."""
    run_id: str | None = None
    """The run its run.json names (None: no run.json)."""
    leftovers: bool = False
    """Whether it holds any step folder at all (complete or not)."""
    steps: Mapping[int, StepListing] = field(default_factory=dict)
    """Every complete, intact step, by step number, ascending."""
    resume_from: StepListing | None = None
    """--resume-from's step when it is complete and intact here, else None."""
    damaged: Mapping[int, str] = field(default_factory=dict)
    """The steps whose files do not match their manifest: why, in one clause."""
    damaged_resume_from: str = ""
    """Why --resume-from's step is damaged ("" when it is not)."""

    def listings(self, chosen: bool) -> list[StepListing]:
        """--resume-from's step (``chosen``; none when absent here), else every step."""
        if not chosen:
            return list(self.steps.values())
        return [self.resume_from] if self.resume_from else []

    def damage(self) -> list[str]:
        """One clause per damaged step (``step N: <file> ...``), --resume-from's last."""
        clauses = [f"step {step}: {problem}" for step, problem in self.damaged.items()]
        return clauses + ([self.damaged_resume_from] if self.damaged_resume_from else [])

    def to_json(self) -> JsonObject:
        """``{"root", "run_id", "leftovers", "steps": {"<N>": step}, "resume_from": step or
        None, "damaged": {"<N>" or "resume_from": clause}}``."""
        damaged = {str(step): problem for step, problem in self.damaged.items()}
        if self.damaged_resume_from:
            damaged[_CHOSEN] = self.damaged_resume_from
        return {
            "root": self.root,
            "run_id": self.run_id,
            "leftovers": self.leftovers,
            "steps": {str(step): info.to_json() for step, info in self.steps.items()},
            "resume_from": self.resume_from.to_json() if self.resume_from else None,
            "damaged": damaged,
        }

    @classmethod
    def from_json(cls, value: object) -> Inventory:
        """``to_json``'s inverse. Raises ValueError for another shape."""
        fields = json_object(value)
        steps = json_object(fields["steps"])
        damaged = {key: json_str(why) for key, why in json_object(fields["damaged"]).items()}
        chosen = fields["resume_from"]
        return cls(
            root=json_str(fields["root"]),
            run_id=json_optional_str(fields["run_id"]),
            leftovers=bool(fields["leftovers"]),
            steps={int(step): StepListing.from_json(info) for step, info in steps.items()},
            resume_from=None if chosen is None else StepListing.from_json(chosen),
            damaged={int(step): why for step, why in damaged.items() if step != _CHOSEN},
            damaged_resume_from=damaged.get(_CHOSEN, ""),
        )


@dataclass(frozen=True)
class StartDecision:
    """Rank 0's decision (``decide``), carried out on every rank (``start.settle``)."""

    run_id: str
    """The run that starts or resumes."""
    step: int | None = None
    """The step every rank resumes (optimizer steps done); None: a fresh start."""
    lost: tuple[int, ...] = ()
    """The ranks of the checkpoint whose own state no folder holds: the caller rebuilds it."""
    segment: int = 0
    """The timeline the run trains on: one above every ``segment`` in any folder (0: fresh)."""
    delete: bool = False
    """Delete the old run's checkpoints first (--no-resume --overwrite-output-dir)."""
    streams: tuple[Stream, ...] = ()
    """The copies between the domains' leaders that give each folder what it lacks."""
    holders: tuple[int, ...] = ()
    """The domains that keep their own copy of the step (the others get a whole one)."""
    chosen: bool = False
    """Whether the step is --resume-from's (read from that path where a domain keeps it)."""
    note: str = ""
    """What is resumed and why, in one line for the log ("" for a fresh start)."""
    damaged: tuple[tuple[int, ...], ...] = ()
    """Per domain, the steps of its folder that do not match their manifest (set aside)."""

    def to_json(self) -> JsonObject:
        """``{"plan": {"run_id", "step", "lost", "segment"}, "delete", "streams": [[src, dst,
        [[file, bytes], ...]], ...], "holders", "source": "steps" | "resume_from", "note",
        "damaged"}``: the decision as it crosses the process group."""
        plan = {"run_id": self.run_id, "step": self.step, "lost": list(self.lost)}
        return {
            "plan": {**plan, "segment": self.segment},
            "delete": self.delete,
            "streams": [stream.to_json() for stream in self.streams],
            "holders": list(self.holders),
            "source": _CHOSEN if self.chosen else "steps",
            "note": self.note,
            "damaged": int_rows(self.damaged),
        }

    @classmethod
    def from_json(cls, value: object) -> StartDecision:
        """``to_json``'s inverse. Raises ValueError for another shape."""
        fields = json_object(value)
        plan = json_object(fields["plan"])
        step = plan["step"]
        return cls(
            run_id=json_str(plan["run_id"]),
            step=None if step is None else json_int(step),
            lost=json_ints(plan["lost"]),
            segment=json_int(plan["segment"]),
            delete=bool(fields["delete"]),
            streams=tuple(Stream.from_json(stream) for stream in json_list(fields["streams"])),
            holders=json_ints(fields["holders"]),
            chosen=fields["source"] == _CHOSEN,
            note=json_str(fields["note"]),
            damaged=json_rows(fields["damaged"]),
        )


def list_folder(root: Path, resume_from: str = "", verify: str = "full") -> Inventory:
    """What ``root`` holds (a domain leader's view); reads folders and meta files, and checks
    every complete step against its manifest (``manifest.verify_step`` with ``verify``: full,
    size or off; the seconds are logged). A step whose meta.json cannot be read is left out
    (with a warning): it cannot be resumed. A damaged step is left out too, as if the folder
    lacked it, with one warning line naming the file; ``damaged`` maps its step to that
    clause. A step without a manifest (older code) is listed, with a warning.

    Raises UserError for an unreadable run.json, OSError for a folder that cannot be listed."""
    steps: dict[int, StepListing] = {}
    damaged: dict[int, str] = {}
    started, checked = time.perf_counter(), 0
    for step, path in complete_steps(root):
        info = _step_listing(path)
        if info is None:
            continue
        checked += 1
        if problem := _verified(path, verify):
            damaged[step] = problem
            continue
        steps[step] = info
    chosen = Path(resume_from) if resume_from else None
    picked, damaged_chosen = None, ""
    if chosen and (chosen / MARKER).is_file():
        picked = _step_listing(chosen)
        checked += 1
        if picked is not None and (problem := _verified(chosen, verify)):
            damaged_chosen, picked = problem, None
    if checked and verify != "off":
        seconds = time.perf_counter() - started
        log.info("verified %d checkpoint(s) in %s (%s) in %.2f s", checked, root, verify, seconds)
    return Inventory(
        str(root), read_run_id(root), bool(step_dirs(root)), steps, picked, damaged, damaged_chosen
    )


def inventory(root: Path, resume_from: str = "", verify: str = "full") -> JsonObject:
    """``list_folder``'s listing as JSON (``Inventory.to_json``), as a leader sends it.

    Raises UserError for an unreadable run.json, OSError for a folder that cannot be listed."""
    return list_folder(root, resume_from, verify).to_json()


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


def _step_listing(path: Path) -> StepListing | None:
    """A complete step's ``StepListing``, or None when its meta.json is unreadable or not a
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
        (str(file.relative_to(path)), file.stat().st_size)
        for file in path.rglob("*")
        if file.is_file() and file.name != MARKER
    )
    return StepListing({key: meta.get(key) for key in META_KEYS}, tuple(files))


def decide(
    inventories: Sequence[Inventory],
    layout: StorageLayout,
    resume: bool,
    resume_from: str,
    overwrite: bool,
    rebuild: Rebuild,
) -> StartDecision:
    """Rank 0's decision from every domain's ``Inventory`` (with one domain nothing is copied),
    with the damaged steps each folder sets aside.

    Raises UserError when the folders hold different runs, --no-resume meets a run's
    checkpoints without --overwrite-output-dir, a checkpoint belongs to another run than its
    folder, --resume-from is complete in no folder, or no step can be resumed (every reason
    named); ValueError for a meta.json value that is not an integer."""
    damaged = tuple(tuple(sorted(inv.damaged)) for inv in inventories)
    runs = sorted({inv.run_id for inv in inventories if inv.run_id})
    if len(runs) > 1:
        raise UserError(
            f"the nodes' --checkpoint-dir folders hold different runs ({', '.join(runs)}); give "
            "every node the folder of one run, or start fresh with new folders"
        )
    existing = runs[0] if runs else None
    if not resume and not resume_from:
        return replace(_fresh(inventories, existing, overwrite), damaged=damaged)
    decision = _resume(inventories, layout, resume_from, existing, rebuild)
    return replace(decision, damaged=damaged)


def plan_across(
    inventories: Sequence[JsonObject],
    layout: StorageLayout,
    resume: bool,
    resume_from: str,
    overwrite: bool,
    rebuild: Rebuild,
) -> JsonObject:
    """``decide`` on ``inventory``'s JSON listings, answered as JSON
    (``StartDecision.to_json``). Raises what ``decide`` raises, and ValueError for a listing
    of another shape."""
    listed = [Inventory.from_json(value) for value in inventories]
    return decide(listed, layout, resume, resume_from, overwrite, rebuild).to_json()


def _resume(
    inventories: Sequence[Inventory],
    layout: StorageLayout,
    resume_from: str,
    existing: str | None,
    rebuild: Rebuild,
) -> StartDecision:
    """``decide`` for --resume or --resume-from (``existing``: the folders' run), without the
    damaged steps; raises what it raises."""
    chosen = bool(resume_from)
    candidates = _candidates(inventories, chosen, existing, resume_from)
    if not candidates:
        if damage := _damage(inventories):
            raise UserError(
                f"no intact checkpoint to resume: {damage}; restore that file from a copy, or "
                "start fresh with --no-resume --overwrite-output-dir (nothing was loaded)"
            )
        return StartDecision(existing or new_run_id())
    where = _named(inventories) if len(inventories) == 1 else "the nodes' own folders"
    decision = _choose(candidates, layout, chosen, existing, rebuild, where)
    note = decision.note
    if damage := _damage(inventories):
        note += f" (damaged, set aside: {damage})"
    return replace(decision, note=note, segment=1 + _last_segment(inventories))


def _damage(inventories: Sequence[Inventory]) -> str:
    """The damaged steps of every folder, one clause each (``step N: <file> ...``), "" for
    none."""
    return "; ".join(clause for inv in inventories for clause in inv.damage())


def _named(inventories: Sequence[Inventory]) -> str:
    """How a line names the checkpoint folders: ``--checkpoint-dir <root>`` with one domain."""
    if len(inventories) == 1:
        return f"--checkpoint-dir {inventories[0].root}"
    return "the --checkpoint-dir folders"


def _hold(inventories: Sequence[Inventory]) -> str:
    """``"--checkpoint-dir <root> holds"`` (one domain) or ``"the --checkpoint-dir folders
    hold"``."""
    return _named(inventories) + (" holds" if len(inventories) == 1 else " hold")


def _last_segment(inventories: Sequence[Inventory]) -> int:
    """The highest ``segment`` of any step in any folder (0 without one)."""
    infos = [info for inv in inventories for info in [*inv.listings(False), *inv.listings(True)]]
    return max((info.segment for info in infos), default=0)


def _fresh(
    inventories: Sequence[Inventory], existing: str | None, overwrite: bool
) -> StartDecision:
    """--no-resume: a new run id; a run already in some folder is deleted with ``overwrite``,
    else refused."""
    held = existing is not None or any(inv.leftovers for inv in inventories)
    if held and not overwrite:
        raise UserError(
            f"--no-resume: {_hold(inventories)} the checkpoints of run "
            f"{existing or '(unnamed)'}, which a new run must not mix with; {OTHER_RUN}"
        )
    return StartDecision(new_run_id(), delete=held)


def _candidates(
    inventories: Sequence[Inventory], chosen: bool, existing: str | None, resume_from: str
) -> dict[int, dict[int, StepListing]]:
    """``{step: {domain: listing}}`` of the steps that can be resumed at all, newest first
    (``chosen``: --resume-from's step only)."""
    found: dict[int, dict[int, StepListing]] = {}
    for domain, inv in enumerate(inventories):
        for info in inv.listings(chosen):
            if existing is not None and (info.run_id or existing) != existing:
                raise UserError(
                    f"checkpoint step {info.saved.get('step')} belongs to run {info.run_id}, "
                    f"but {_hold(inventories)} run {existing}; resume into the checkpoint's own "
                    "folder, or pass a new --checkpoint-dir"
                )
            found.setdefault(info.step, {})[domain] = info
    if chosen and not found:
        if damage := _damage(inventories):
            raise UserError(f"--resume-from {resume_from} is damaged: {damage}; pass an intact one")
        where = ("", "") if len(inventories) == 1 else (" on any node", " that some node holds")
        raise UserError(
            f"--resume-from {resume_from} is not a complete checkpoint{where[0]}; pass a "
            f"complete step-N folder{where[1]}"
        )
    return {step: _newest(found[step]) for step in sorted(found, reverse=True)}


def _newest(holders: dict[int, StepListing]) -> dict[int, StepListing]:
    """The holders of a step whose copy has the highest ``segment`` (the newest timeline); a
    folder with an older copy counts as lacking the step (it gets the new one)."""
    segment = {domain: info.segment for domain, info in holders.items()}
    newest = max(segment.values())
    return {domain: info for domain, info in holders.items() if segment[domain] == newest}


_MORE_COPIES = "keep more copies (--buddy-copies) or start fresh with --no-resume"


def _choose(
    candidates: Mapping[int, dict[int, StepListing]],
    layout: StorageLayout,
    chosen: bool,
    existing: str | None,
    rebuild: Rebuild,
    where: str,
) -> StartDecision:
    """The newest step every rank can resume exactly, else the newest whose lost per-rank
    state can be rebuilt; the copies it takes and a one-line note (``resuming step N from
    <where>``)."""
    reasons: list[str] = []
    fallback = None
    for step, holders in candidates.items():
        served = _serve(holders, layout, chosen)
        if not served.lost:
            return _decision(step, holders, served, chosen, existing, reasons, where)
        why = rebuild(next(iter(holders.values())).saved)
        reasons.append(f"step {step}: the own state of {_ranks(served.lost)} is in no folder")
        if why:
            reasons[-1] += f" and {why}"
        elif fallback is None:
            fallback = (step, holders, served)
    if fallback is not None:
        return _decision(*fallback, chosen, existing, reasons, where)
    raise UserError(f"no checkpoint can be resumed: {'; '.join(reasons)}; {_MORE_COPIES}")


def _ranks(ranks: Sequence[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


@dataclass
class _Served:
    """For one step: the ranks whose own files no folder can give, the domains that keep
    their own copy (``holders``), and the streams (source leader, target leader, files)."""

    lost: list[int] = field(default_factory=list)
    holders: list[int] = field(default_factory=list)
    streams: list[Stream] = field(default_factory=list)


def _decision(
    step: int,
    holders: Mapping[int, StepListing],
    served: _Served,
    chosen: bool,
    existing: str | None,
    reasons: list[str],
    where: str,
) -> StartDecision:
    note = f"resuming step {step} from {where}"
    if reasons:
        note += f" ({'; '.join(reasons)})"
    if served.lost:
        note += f"; the own state of {_ranks(served.lost)} is rebuilt"
    saved_id = next(iter(holders.values())).run_id
    return StartDecision(
        run_id=existing or saved_id or new_run_id(),
        step=step,
        lost=tuple(served.lost),
        streams=tuple(served.streams),
        holders=tuple(served.holders),
        chosen=chosen,
        note=note,
    )


def _serve(holders: Mapping[int, StepListing], layout: StorageLayout, chosen: bool) -> _Served:
    """What resuming one step takes. Every domain must hold the own files of its ranks (at
    another world size: of every old rank) and should hold its buddy copies. A domain keeps its
    own copy where it has one of the newest timeline (for --resume-from: only if that copy also
    has its ranks' files, since fetched files go to its own folder); every other domain gets a
    whole copy (the replicated files of one holder, never mixed, and the rank files)."""
    old_world = next(iter(holders.values())).world_size
    resharded = old_world != sum(len(ranks) for ranks in layout.domains)
    held = {domain: entry.ranks for domain, entry in holders.items()}
    served = _Served()
    lost: set[int] = set()
    for domain, ranks in enumerate(layout.domains):
        must = set(range(old_world)) if resharded else set(ranks) & set(range(old_world))
        wanted = (must | set(layout.keeps(domain))) & set(range(old_world))
        keeps = domain in holders and (not chosen or must <= held[domain])
        sources = {d: r for d, r in held.items() if d != domain}
        available = set().union(held[domain] if keeps else set(), *sources.values())
        lost |= must - available
        if keeps:
            served.holders.append(domain)
            wanted = set() if chosen else wanted - held[domain]
        served.streams += _streams_to(domain, wanted, holders, sources, layout, whole=not keeps)
    served.lost = sorted(lost)
    return served


def _streams_to(
    domain: int,
    ranks: set[int],
    holders: Mapping[int, StepListing],
    sources: Mapping[int, set[int]],
    layout: StorageLayout,
    whole: bool,
) -> list[Stream]:
    """The streams into ``domain``'s folder: with ``whole``, every replicated file of one other
    holder; and the own files of ``ranks``, each from the first other holder that has them."""
    by_source: dict[int, list[tuple[str, int]]] = {}
    if whole:
        if not sources:
            return []
        first = min(sources)
        by_source[first] = [f for f in holders[first].files if not _RANK_FILE.fullmatch(f[0])]
    for rank in sorted(ranks):
        source = next((d for d in sorted(sources) if rank in sources[d]), None)
        if source is None:
            continue  # no other folder has it: lost, or (a keeper's own) already there
        names = {f"rank-{rank}.json", f"rank-{rank}.safetensors"}
        files = [f for f in holders[source].files if f[0] in names]
        by_source.setdefault(source, []).extend(files)
    leader = layout.domains[domain][0]
    return [
        Stream(layout.domains[src][0], leader, tuple(files))
        for src, files in sorted(by_source.items())
    ]
