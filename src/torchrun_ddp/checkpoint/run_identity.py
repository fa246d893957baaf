"""Run identity: which run a checkpoint folder belongs to.

``<root>/run.json`` holds the ``run_id`` (a random hex string) of the one run whose checkpoints
the folder holds, and every ``meta.json`` repeats it. The start (``start.agree_on_start``, deciding
in ``peers.decide``) refuses to start a different run in a folder that holds another run's
checkpoints, unless told to overwrite them (``delete_run``); the leader of each folder records the
run id once every start check has passed (``record_run_id``).
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

from torchrun_ddp.checkpoint.codec import fsync_dir, write_json
from torchrun_ddp.checkpoint.folders import (
    MARKER,
    remove_incomplete,
    remove_stale,
    step_dirs,
)
from torchrun_ddp.errors import UserError

RUN_FILE = "run.json"
OTHER_RUN = (
    "pass a new --checkpoint-dir (and --output-dir), or add --no-resume --overwrite-output-dir "
    "to delete the old run's checkpoints and metrics"
)


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
