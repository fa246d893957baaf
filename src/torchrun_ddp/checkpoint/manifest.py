"""Checksums at rest: each published step's ``manifest.json`` lists every file of its folder
with its size and SHA-256, and a step is checked against it before anything of it is loaded.

The manifest is written into ``step-<N>.tmp/`` before the folder is published, so a step with
the ``COMPLETE`` marker always has one, and its ``meta.json`` says so (``MANIFEST_KEY``). A step
whose meta.json says so but which has no manifest lost it (a torn copy, a user's cleanup): it is
damaged, never loaded unverified. Only steps saved before manifests existed (no such key) load
unverified, with a warning. Files written by the project's own code (per-rank files,
``shared.json``, ``meta.json``, buddy copies and copies from a peer) are hashed while they are
written; DCP's shard files are hashed after DCP wrote them, each by one rank of the folder's
storage domain (``dcp_share``).

Format: ``{"version": 1, "files": {"<path relative to the step folder>": [bytes, "<sha256>"]}}``.

Verification (``verify_step``), by ``--verify-checkpoints``: ``full`` reads every file and
compares size and SHA-256 (the cost: one read of the checkpoint, measured in
docs/benchmarks.md), ``size`` compares sizes only (a truncated or zero-length file, not flipped
bytes), ``off`` checks nothing.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from torchrun_ddp.checkpoint.codec import write_json
from torchrun_ddp.checkpoint.folders import META_JSON
from torchrun_ddp.checkpoint.ranks import JsonObject, json_list, json_object

MANIFEST = "manifest.json"
VERIFY_MODES = ("full", "size", "off")
UNVERIFIED = "unverified"
"""``verify_step``'s answer for a step without a manifest saved by older code (its meta.json has
no ``MANIFEST_KEY``)."""
MANIFEST_KEY = "manifest_version"
"""The meta.json key of a step saved with a manifest (its format version, 1): ``save_checkpoint``
writes it, and a step that has it but no manifest is damaged."""
MANIFEST_VERSION = 1
_READ_BYTES = 8 * 2**20
_RANK_FILE = re.compile(r"rank-\d+\.(json|safetensors)")


@dataclass(frozen=True)
class Entry:
    """One file of a manifest: its ``size`` in bytes and the ``sha256`` hex digest of its
    bytes. On disk and across ranks it is ``[bytes, "<sha256 hex>"]`` (``to_json``)."""

    size: int
    sha256: str

    def to_json(self) -> list[object]:
        """``[size, sha256]``, as manifest.json holds it."""
        return [self.size, self.sha256]

    @classmethod
    def from_json(cls, value: object) -> Entry:
        """An entry from ``[bytes, sha256]`` (the size may be a string of digits, as older
        code's manifests are read). Raises ValueError for another shape."""
        size, sha256 = json_list(value, 2)
        return cls(int(str(size)), str(sha256))


def entries_to_json(entries: Mapping[str, Entry]) -> JsonObject:
    """``{file: [bytes, sha256]}``, by file name: manifest.json's ``files``."""
    return {name: entry.to_json() for name, entry in sorted(entries.items())}


def entries_from_json(value: object) -> dict[str, Entry]:
    """``entries_to_json``'s inverse. Raises ValueError for another shape."""
    return {name: Entry.from_json(entry) for name, entry in json_object(value).items()}


def file_entry(path: Path) -> Entry:
    """The ``Entry`` (size in bytes, SHA-256 hex) of the file ``path``, read in 8 MiB blocks.

    Raises OSError when the file cannot be read."""
    digest, size = hashlib.sha256(), 0
    with path.open("rb") as handle:
        while block := handle.read(_READ_BYTES):
            digest.update(block)
            size += len(block)
    return Entry(size, digest.hexdigest())


def bytes_entry(data: bytes) -> Entry:
    """The ``Entry`` of bytes about to be written (hashing while writing)."""
    return Entry(len(data), hashlib.sha256(data).hexdigest())


def dcp_share(folder: Path, position: int, count: int) -> dict[str, Entry]:
    """The entries of the files under ``folder`` (a step's ``dcp/``) that the rank at
    ``position`` of ``count`` ranks hashes: every ``count``-th file, by sorted name. Keys are
    relative to the step folder (``dcp/<name>``)."""
    if not folder.is_dir():
        return {}
    files = sorted(file for file in folder.rglob("*") if file.is_file())
    return {
        str(file.relative_to(folder.parent)): file_entry(file)
        for index, file in enumerate(files)
        if index % count == position
    }


def write_manifest(step_dir: Path, entries: Mapping[str, Entry]) -> None:
    """Write ``manifest.json`` into ``step_dir`` (fsynced); ``entries``: every file of the
    folder but the manifest and the marker. Raises OSError when it cannot be written."""
    write_json(step_dir / MANIFEST, {"version": 1, "files": entries_to_json(entries)})


def read_manifest(step_dir: Path) -> dict[str, Entry] | None:
    """The ``files`` of ``step_dir``'s manifest; None when it has none. Raises ValueError for a
    manifest that cannot be read or parsed (a damaged manifest is a damaged step)."""
    path = step_dir / MANIFEST
    if not path.is_file():
        return None
    try:
        files = json_object(json.loads(path.read_text()))["files"]
    except (OSError, ValueError, KeyError) as exc:
        raise ValueError(f"{path} cannot be read ({exc})") from exc
    if not isinstance(files, dict):
        raise ValueError(f"{path} holds no file list")
    try:
        return entries_from_json(files)
    except ValueError as exc:
        raise ValueError(f"{path} cannot be read ({exc})") from exc


def verify_step(step_dir: Path, mode: str = "full") -> str:
    """Check ``step_dir``'s files against its manifest: ``""`` when they match (or ``mode`` is
    ``off``), ``UNVERIFIED`` without a manifest on a step older code saved (``missing_manifest``),
    else one clause naming the first damaged file (missing, another size, or with ``full``
    another SHA-256), or the manifest a step saved with one lacks. A missing per-rank file is
    not damage: the start plans for lost per-rank files (``peers``). Reads every listed file
    with ``full``, only their sizes with ``size``. Raises ValueError for an unknown ``mode``."""
    if mode not in VERIFY_MODES:
        raise ValueError(f"unknown verification mode {mode!r}; choose one of {VERIFY_MODES}")
    if mode == "off":
        return ""
    try:
        files = read_manifest(step_dir)
    except ValueError as exc:
        return str(exc)
    if files is None:
        return missing_manifest(step_dir) or UNVERIFIED
    for name, entry in sorted(files.items()):
        if _RANK_FILE.fullmatch(name) and not (step_dir / name).exists():
            continue  # a lost rank's files: the plan serves them from a buddy copy or rebuilds
        if problem := _check_file(step_dir / name, entry, mode):
            return problem
    return ""


def saved_with_manifest(meta: Mapping[str, object]) -> bool:
    """Whether a step's meta.json (``meta``) says it was saved with a manifest."""
    return meta.get(MANIFEST_KEY) is not None


def missing_manifest(step_dir: Path) -> str:
    """Why ``step_dir``, which has no manifest, is damaged: its meta.json says this version
    saved it with one (``MANIFEST_KEY``), or cannot be read; "" for a step of older code (no
    such key), which may load unverified."""
    meta_path = step_dir / META_JSON
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, ValueError) as exc:
        return f"{step_dir / MANIFEST} is missing and {meta_path} cannot be read ({exc})"
    if isinstance(meta, dict) and not saved_with_manifest(meta):
        return ""
    return f"{step_dir / MANIFEST} is missing, though its {META_JSON} says it was saved with one"


def _check_file(path: Path, entry: Entry, mode: str) -> str:
    """Why ``path`` does not match its manifest ``entry`` ("" when it does)."""
    try:
        actual = path.stat().st_size
        if actual != entry.size:
            return f"{path} has {actual} bytes, its manifest says {entry.size}"
        if mode == "full" and file_entry(path).sha256 != entry.sha256:
            return f"{path} does not match its SHA-256 in the manifest"
    except OSError as exc:
        return f"{path} cannot be read ({exc.strerror or exc})"
    return ""


def check_received(step_dir: Path, entries: Mapping[str, Entry]) -> str:
    """Compare the files a peer sent into ``step_dir`` (``entries``: size and SHA-256, hashed
    while receiving) with the sender's manifest that came with them, then make the manifest
    this folder's own (the files it received). "" when they match (or no manifest came with a
    step of older code), else one clause naming the first file that differs, or the manifest
    that a step saved with one came without. Raises OSError when the manifest cannot be
    written."""
    try:
        files = read_manifest(step_dir)
    except ValueError as exc:
        return str(exc)
    if files is None:
        return missing_manifest(step_dir)
    received = {name: entry for name, entry in entries.items() if name != MANIFEST}
    for name, got in sorted(received.items()):
        want = files.get(name)
        if want is not None and got != want:
            return f"{step_dir / name} does not match its manifest"
    write_manifest(step_dir, received)
    return ""


def add_entries(step_dir: Path, entries: Mapping[str, Entry]) -> None:
    """Add ``entries`` (files a peer sent into a folder that keeps its own copy of the step,
    hashed while receiving) to ``step_dir``'s manifest, where it has one. Raises OSError when
    the manifest cannot be written."""
    try:
        files = read_manifest(step_dir)
    except ValueError:
        return  # a damaged manifest stays damaged: the next start sets the step aside
    if files is None:
        return
    write_manifest(step_dir, {**files, **entries})
