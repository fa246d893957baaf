"""What a checkpoint folder holds, for planning a start (``peers``): every complete, intact step
with its files and sizes and its meta.json's keys, the run it belongs to, --resume-from's step,
and the steps set aside as damaged (``list_folder``, by a storage domain's leader). Typed
(``Inventory``, ``StepListing``), crossing the process group as JSON (``to_json`` /
``from_json``); ``inventory`` gives the same listing in its JSON form.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from torchrun_ddp.checkpoint.folders import MARKER, META_JSON, complete_steps, step_dirs
from torchrun_ddp.checkpoint.manifest import MANIFEST, UNVERIFIED, verify_step
from torchrun_ddp.checkpoint.ranks import (
    JsonObject,
    json_int,
    json_object,
    json_optional_str,
    json_str,
)
from torchrun_ddp.checkpoint.run_identity import read_run_id
from torchrun_ddp.checkpoint.transfer import Files, files_from_json, files_to_json

log = logging.getLogger("torchrun_ddp")

META_KEYS = ("step", "run_id", "world_size", "data_since", "segment")
"""The meta.json keys an inventory carries (the rest stays on disk). ``segment`` numbers the
run's timelines: each start that resumes takes one above every segment in every folder, so a
step saved again after a resume from an older one outranks a stale copy of it."""


RANK_FILE = re.compile(r"rank-(\d+)\.(json|safetensors)")


CHOSEN = "resume_from"
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
        found = (RANK_FILE.fullmatch(name) for name in names)
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
            damaged[CHOSEN] = self.damaged_resume_from
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
            damaged={int(step): why for step, why in damaged.items() if step != CHOSEN},
            damaged_resume_from=damaged.get(CHOSEN, ""),
        )


def list_folder(root: Path, resume_from: str = "", verify: str = "full") -> Inventory:
    """What ``root`` holds (a domain leader's view); reads folders and meta files, and checks
    every complete step against its manifest (``manifest.verify_step`` with ``verify``: full,
    size or off; the seconds are logged). A step whose meta.json cannot be read is left out
    (with a warning): it cannot be resumed. A damaged step is left out too, as if the folder
    lacked it, with one warning line naming the file; ``damaged`` maps its step to that
    clause. A step without a manifest is listed, with a warning, only where older code saved it
    (its meta.json does not say it was saved with one); otherwise it is damaged.

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
    a step of older code without a manifest is logged as unverified and counts as intact."""
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
