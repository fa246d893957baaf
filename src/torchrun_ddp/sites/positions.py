"""A site rank's own data position at its last committed sync, kept on its disk.

A site that dies loses the documents of its uncommitted window: they never reached the synced
parameters. When it comes back and heals, it goes on from its data position at its last
committed sync, not from its last checkpoint's (which may be older: those documents would be
trained twice) nor from the live site's step (they would be skipped). Each rank writes the
position after every committed sync to ``<checkpoint root>/sites/rank-<r>.position``: the blob
it shared in that sync (``pack``: JSON + safetensors + SHA-256, never a pickle; encoded once for
both), written to a temporary name and renamed, so a kill mid-write leaves the previous record.

A copy on the peers, for a site whose disk is gone: at every sync each rank shares its packed
position (``pack``) with the same rank of the live sites (``gather_blobs`` on the Managers'
group); a committed sync updates each rank's book of every site's last committed position, and a
healing site receives the live site's book with its state and takes its own entry.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import cast

import torch
from torch.distributed import ProcessGroup
from torch.distributed.distributed_c10d import AllgatherOptions

from torchrun_ddp.checkpoint.heal import decode, encode
from torchrun_ddp.checkpoint.ranks import json_int, json_object


def position_files(root: Path, rank: int) -> tuple[Path, Path]:
    """``(header, payload)`` paths of ``rank``'s record under the checkpoint ``root`` as
    versions before the packed record wrote it (still read, ``read_position``)."""
    folder = root / "sites"
    return folder / f"rank-{rank}.json", folder / f"rank-{rank}.safetensors"


def record_file(root: Path, rank: int) -> Path:
    """The path of ``rank``'s record under the checkpoint ``root``: ``pack``'s bytes."""
    return root / "sites" / f"rank-{rank}.position"


def write_position(root: Path, rank: int, blob: torch.Tensor) -> None:
    """Record ``blob`` (``pack``'s: the data position this rank shared at the sync just
    committed) as its last committed sync's, replacing the previous record only once it is
    written whole (a temporary name, then a rename). An empty blob (none shared) writes
    nothing."""
    if not blob.numel():
        return
    path = record_file(root, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_suffix(".tmp")
    temporary.write_bytes(blob.numpy().tobytes())
    os.replace(temporary, path)


def read_position(root: Path, rank: int) -> tuple[int, Mapping[str, object]] | None:
    """``(step, position)`` of ``rank``'s record, or None where there is none. Raises
    ValueError for a record whose payload does not match its header (size or SHA-256)."""
    path = record_file(root, rank)
    if path.is_file():
        shared = unpack(torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.uint8))
        return shared.step, shared.position
    header_path, payload_path = position_files(root, rank)
    if not header_path.is_file() or not payload_path.is_file():
        return None
    header = json_object(json.loads(header_path.read_bytes()))
    step = json_int(header.get("step"))
    state = json_object(decode(header, payload_path.read_bytes(), step))
    return step, cast(Mapping[str, object], state["data"])


@dataclass(frozen=True)
class Shared:
    """What a site's rank shares with the live sites at a sync (``pack``/``unpack``)."""

    site: int
    step: int
    """The optimizer step the position is at (after the sync's step)."""
    position: Mapping[str, object]
    """The rank's data loader state (JSON values and tensors)."""
    digest: str = ""
    """SHA-256 (hex) of the rank's synced state before this sync's outer step, shared at the
    first sync after a heal (``SiteLink``); "" otherwise."""


def pack(site: int, step: int, position: Mapping[str, object], digest: str = "") -> torch.Tensor:
    """Site ``site``'s ``position`` as of ``step`` (and ``digest``, see ``Shared``) in one
    uint8 tensor: the header's length (8 bytes, little endian), the header (``heal.encode``'s
    JSON) and the safetensors payload."""
    header, payload = encode({"site": site, "data": position, "digest": digest}, step)
    data = len(header).to_bytes(8, "little") + header + payload
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def unpack(blob: torch.Tensor) -> Shared:
    """``pack``'s inverse. Raises ValueError for a blob whose parts do not match its header
    (sizes, SHA-256)."""
    data = blob.numpy().tobytes()
    size = int.from_bytes(data[:8], "little")
    if not 0 < size <= len(data) - 8:
        raise ValueError(f"a data position's copy announces a {size}-byte header")
    header = json_object(json.loads(data[8 : 8 + size]))
    step = json_int(header.get("step"))
    state = json_object(decode(header, data[8 + size :], step))
    position = cast(Mapping[str, object], state["data"])
    return Shared(json_int(state["site"]), step, position, str(state.get("digest", "")))


def differing_sites(mine: Shared, shared: list[Shared]) -> list[int]:
    """The sites among ``shared`` whose non-empty ``digest`` differs from ``mine``'s (none
    where ``mine`` has none): the replicas that are not equal after a heal."""
    if not mine.digest:
        return []
    return sorted(s.site for s in shared if s.digest and s.digest != mine.digest)


def gather_blobs(group: ProcessGroup, blob: torch.Tensor, timeout: timedelta) -> list[torch.Tensor]:
    """Collective over ``group`` (the live sites' rank ``r``): every member's ``blob`` (uint8,
    any length; empty: nothing to share), in the group's rank order."""
    options = AllgatherOptions()
    length = torch.tensor([blob.numel()], dtype=torch.int64)
    lengths = [torch.zeros(1, dtype=torch.int64) for _ in range(group.size())]
    group.allgather([lengths], [length], options).wait(timeout)
    longest = max(int(size.item()) for size in lengths)
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[: blob.numel()] = blob
    gathered = [torch.zeros(longest, dtype=torch.uint8) for _ in lengths]
    group.allgather([gathered], [padded], options).wait(timeout)
    return [data[: int(size.item())].clone() for data, size in zip(gathered, lengths, strict=True)]
