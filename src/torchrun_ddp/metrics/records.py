"""The records file across restarts: ``metrics.jsonl`` read (a torn last line left out), another
run's records refused at the start, and the file trimmed atomically to the step a run resumes
from. Imports ``errors``.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from torchrun_ddp.errors import UserError

log = logging.getLogger("torchrun_ddp")


def read_records(path: Path) -> list[dict[str, object]]:
    """The records of a metrics.jsonl; a torn last line (a crash mid-write) is left out.

    Raises UserError naming the file and line for any other line that is not a JSON object.
    """
    if not path.is_file():
        return []
    lines = path.read_text(encoding="utf-8").splitlines()
    records = []
    for number, line in enumerate(lines, start=1):
        try:
            record = json.loads(line) if line.strip() else None
        except json.JSONDecodeError as exc:
            if number == len(lines):
                log.warning("%s: dropping the torn last line %d (%s)", path, number, exc)
                continue
            raise UserError(
                f"{path} line {number} is not JSON ({exc}); move the file away or fix the line"
            ) from exc
        if isinstance(record, dict):
            records.append(record)
    return records


def check_records(path: Path, run_id: str, overwrite: bool = False) -> None:
    """Raise UserError if a metrics.jsonl holds another run's records (no ``run_id`` or a
    different one) and ``overwrite`` is not set, or a line before the last is not JSON."""
    others = {str(r.get("run_id")) for r in read_records(path) if r.get("run_id") != run_id}
    if others and not overwrite:
        raise UserError(
            f"{path} holds the metrics of another run ({sorted(others)[0]}); pass a new "
            "--output-dir, or add --no-resume --overwrite-output-dir to replace them"
        )


def restart_records(path: Path, run_id: str, step: int) -> None:
    """Keep only the records of run ``run_id`` up to ``step`` in a metrics.jsonl (a resumed run
    logs the later steps again; a fresh run passes ``step=-1``), rewritten atomically (temporary
    file, fsync, rename), so a crash leaves either the old or the new file. A torn last line is
    dropped; other runs' records too (``check_records`` first refuses them unless asked)."""
    if not path.is_file():
        return
    kept = [r for r in read_records(path) if r.get("run_id") == run_id and int(r["step"]) <= step]
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", encoding="utf-8") as handle:
        handle.writelines(json.dumps(record) + "\n" for record in kept)
        handle.flush()
        os.fsync(handle.fileno())
    tmp.replace(path)
