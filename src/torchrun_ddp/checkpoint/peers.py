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

Typed values: a folder's listing is a ``listing.Inventory`` (of ``StepListing``), the
decision a ``StartDecision``; both cross the process group as JSON (``to_json`` /
``from_json``). ``decide`` answers with one; ``plan_across`` gives the same answer in JSON.
A step's meta.json values are read (``StepListing.step``...) where the decision uses them, so a
listing carries a damaged value and the decision fails naming it.

Source of the idea: torchft's ``checkpointing/`` (a replica that comes back gets its state from
a healthy peer, not from shared storage), https://github.com/meta-pytorch/torchft.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from torchrun_ddp.checkpoint.listing import (
    CHOSEN,
    RANK_FILE,
    Inventory,
    StepListing,
)
from torchrun_ddp.checkpoint.ranks import (
    JsonObject,
    int_rows,
    json_int,
    json_ints,
    json_list,
    json_object,
    json_rows,
    json_str,
)
from torchrun_ddp.checkpoint.run_identity import OTHER_RUN, new_run_id
from torchrun_ddp.checkpoint.storage import StorageLayout
from torchrun_ddp.checkpoint.transfer import Stream
from torchrun_ddp.errors import UserError

log = logging.getLogger("torchrun_ddp")

Rebuild = Callable[[Mapping[str, object]], str]
"""``meta of the step -> ""`` when the caller can rebuild a rank's lost own state of that
checkpoint, else why not (one clause). It gets the step's ``META_KEYS`` as saved
(``StepListing.saved``), as ``resume.rebuild_problem`` reads them."""


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
            "source": CHOSEN if self.chosen else "steps",
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
            chosen=fields["source"] == CHOSEN,
            note=json_str(fields["note"]),
            damaged=json_rows(fields["damaged"]),
        )


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
        by_source[first] = [f for f in holders[first].files if not RANK_FILE.fullmatch(f[0])]
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
