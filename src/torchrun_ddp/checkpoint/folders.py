"""The on-disk layout of checkpoints: ``step-<N>`` folders, atomic publication, the ``COMPLETE``
marker, pruning, finding the newest complete checkpoint and reading its ``meta.json``.

Atomic publication: all ranks write into ``<root>/step-<N>.tmp/``; every file is fsynced; after a
barrier rank 0 renames the folder to ``step-<N>/``, fsyncs ``<root>`` and only then writes the
marker. A folder without the marker is never loaded. Leftover ``*.tmp`` folders and marker-less
``step-*`` folders from a crash are removed at the start of the next save.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from torchrun_ddp.checkpoint.codec import fsync_dir, write_bytes
from torchrun_ddp.errors import UserError
from torchrun_ddp.faults import fault_point

MARKER = "COMPLETE"
DCP_DIR = "dcp"
SHARED_JSON = "shared.json"
META_JSON = "meta.json"
HINT = "use --no-resume or a matching --resume-from"
"""How to get past a checkpoint that cannot be resumed; ends every such UserError."""
_STEP_DIR = re.compile(r"step-(\d+)")


def find_latest(root: Path) -> Path | None:
    """The complete ``step-<N>`` folder under ``root`` with the largest ``N``, or None.

    Folders without the ``COMPLETE`` marker (a crash mid-save) and ``*.tmp`` folders are skipped.
    """
    steps = complete_steps(root)
    return steps[-1][1] if steps else None


def read_meta(path: Path) -> dict[str, object]:
    """``meta.json`` of the checkpoint folder ``path`` (``step``, ``world_size``, caller's keys).

    Raises UserError if ``path`` is not a complete checkpoint or its ``meta.json`` is unreadable.
    """
    require_complete(path)
    try:
        meta = json.loads((path / META_JSON).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise UserError(f"cannot read {path / META_JSON} ({exc}); {HINT}") from exc
    if not isinstance(meta, dict):
        raise UserError(f"{path / META_JSON} is not a JSON object; {HINT}")
    return meta


def step_dirs(root: Path) -> list[tuple[int, Path]]:
    """Every ``step-<N>`` folder under ``root`` (complete or not), sorted by ``N``."""
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        match = _STEP_DIR.fullmatch(entry.name)
        if match and entry.is_dir():
            found.append((int(match.group(1)), entry))
    return sorted(found)


def complete_steps(root: Path) -> list[tuple[int, Path]]:
    """The ``step-<N>`` folders under ``root`` that hold the marker, sorted by ``N``."""
    return [(step, path) for step, path in step_dirs(root) if (path / MARKER).is_file()]


def require_complete(path: Path) -> None:
    """Raise UserError unless ``path`` holds the ``COMPLETE`` marker."""
    if not (path / MARKER).is_file():
        raise UserError(f"{path} is not a complete checkpoint (no {MARKER} marker); {HINT}")


def remove_incomplete(root: Path) -> None:
    """Delete ``*.tmp`` folders and marker-less ``step-<N>`` folders left by a crash."""
    if not root.is_dir():
        return
    for entry in root.iterdir():
        if entry.is_dir() and entry.name.endswith(".tmp"):
            shutil.rmtree(entry)
    for _, path in step_dirs(root):
        if not (path / MARKER).is_file():
            shutil.rmtree(path)


def publish(tmp: Path, final: Path, step: int = -1) -> None:
    """Rename ``tmp`` to ``final`` (replacing an older copy), then write the marker."""
    if (tmp / DCP_DIR).is_dir():
        fsync_dir(tmp / DCP_DIR)
    fsync_dir(tmp)
    if final.exists():
        (final / MARKER).unlink(missing_ok=True)  # never loadable from here on
        shutil.rmtree(final)
    tmp.rename(final)
    fsync_dir(final.parent)
    fault_point("publish", step)
    write_bytes(final / MARKER, b"")
    fsync_dir(final)


def prune(root: Path, keep: int) -> None:
    """Delete all but the newest ``keep`` complete checkpoints, marker first, and the copies
    set aside as ``step-<N>.stale`` (a resume from an older step) that the run has passed."""
    steps = complete_steps(root)
    for _, path in steps[:-keep]:
        (path / MARKER).unlink()
        shutil.rmtree(path)
    if steps:
        remove_stale(root, steps[-1][0])


_STALE_DIR = re.compile(r"step-(\d+)\.stale")


def remove_stale(root: Path, up_to: float = float("inf")) -> None:
    """Delete the ``step-<N>.stale`` folders under ``root`` with ``N <= up_to``."""
    if not root.is_dir():
        return
    for entry in root.iterdir():
        match = _STALE_DIR.fullmatch(entry.name)
        if match and entry.is_dir() and int(match.group(1)) <= up_to:
            shutil.rmtree(entry)
