"""A site rank's own data position at its last committed sync, kept on its disk.

A site that dies loses the documents of its uncommitted window: they never reached the synced
parameters. When it comes back and heals, it goes on from its data position at its last
committed sync, not from its last checkpoint's (which may be older: those documents would be
trained twice) nor from the live site's step (they would be skipped). Each rank writes the
position after every committed sync to ``<checkpoint root>/sites/rank-<r>.json`` and
``.safetensors`` (``heal.encode``: JSON + safetensors + SHA-256, never a pickle; written to a
temporary name and renamed, so a kill mid-write leaves the previous record).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import cast

from torchrun_ddp.checkpoint.heal import decode, encode
from torchrun_ddp.checkpoint.ranks import json_int, json_object


def position_files(root: Path, rank: int) -> tuple[Path, Path]:
    """``(header, payload)`` paths of ``rank``'s record under the checkpoint ``root``."""
    folder = root / "sites"
    return folder / f"rank-{rank}.json", folder / f"rank-{rank}.safetensors"


def write_position(root: Path, rank: int, step: int, position: Mapping[str, object]) -> None:
    """Record ``position`` (a data loader's state: JSON values and tensors) as of ``step``."""
    header, payload = encode({"data": position}, step)
    for path, data in zip(position_files(root, rank), (header, payload), strict=True):
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_suffix(path.suffix + ".tmp")
        temporary.write_bytes(data)
        os.replace(temporary, path)


def read_position(root: Path, rank: int) -> tuple[int, Mapping[str, object]] | None:
    """``(step, position)`` of ``rank``'s record, or None where there is none. Raises
    ValueError for a record whose payload does not match its header (size or SHA-256)."""
    header_path, payload_path = position_files(root, rank)
    if not header_path.is_file() or not payload_path.is_file():
        return None
    header = json_object(json.loads(header_path.read_bytes()))
    step = json_int(header.get("step"))
    state = json_object(decode(header, payload_path.read_bytes(), step))
    return step, cast(Mapping[str, object], state["data"])
