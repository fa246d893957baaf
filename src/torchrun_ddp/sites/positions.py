"""A site rank's own data position at its last committed sync, kept on its disk.

A site that dies loses the documents of its uncommitted window: they never reached the synced
parameters. When it comes back and heals, it goes on from its data position at its last
committed sync, not from its last checkpoint's (which may be older: those documents would be
trained twice) nor from the live site's step (they would be skipped). Each rank writes the
position after every committed sync under ``<checkpoint root>/sites/``: the blob it shared in
that sync (``pack``: JSON + safetensors + SHA-256, never a pickle; encoded once for both), into
one of two slots in turn (``record_files``), so a kill mid-write leaves the previous record.

A copy on the peers, for a site whose disk is gone: at every sync each rank shares its packed
position (``pack``) with the same rank of the live sites (``gather_blobs`` on the Managers'
group); a committed sync updates each rank's book of every site's last committed position, and a
healing site receives the live site's book with its state and takes its own entry.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import cast

import torch
from torch.distributed import ProcessGroup
from torch.distributed.distributed_c10d import AllgatherOptions

from torchrun_ddp.checkpoint.heal import decode, encode
from torchrun_ddp.checkpoint.ranks import JsonObject, json_int, json_object

GATHER_BYTES = 64 * 2**10
"""Bytes per member of the one all-gather that shares the sites' data positions at a sync (a
position of a few KiB; a longer one takes a second all-gather)."""


def position_files(root: Path, rank: int) -> tuple[Path, Path]:
    """``(header, payload)`` paths of ``rank``'s record under the checkpoint ``root`` as
    versions before the packed record wrote it (still read, ``read_position``)."""
    folder = root / "sites"
    return folder / f"rank-{rank}.json", folder / f"rank-{rank}.safetensors"


def record_files(root: Path, rank: int) -> tuple[Path, Path]:
    """The two slots of ``rank``'s record under the checkpoint ``root``, written in turn (by
    the step's parity), each ``pack``'s bytes: a kill mid-write spoils one, the other holds the
    record before."""
    folder = root / "sites"
    return folder / f"rank-{rank}.position.0", folder / f"rank-{rank}.position.1"


def write_position(root: Path, rank: int, blob: torch.Tensor) -> None:
    """Record ``blob`` (``pack``'s: the data position this rank shared at the sync just
    committed) as its last committed sync's, in the slot of its step's parity, over the old
    bytes in place (no truncation, no rename: on ext4 either costs 20 times the write; the
    blob says its own length). An empty blob (none shared) writes nothing."""
    if not blob.numel():
        return
    path = record_files(root, rank)[peek(blob).step % 2]
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch()
    with path.open("r+b") as handle:
        handle.write(blob.numpy().tobytes())


def read_position(root: Path, rank: int) -> tuple[int, Mapping[str, object]] | None:
    """``(step, position)`` of ``rank``'s newest intact record, or None where there is none.
    Raises ValueError where every slot is damaged (its payload does not match its header:
    size or SHA-256)."""
    found, damaged = [], None
    for path in filter(Path.is_file, record_files(root, rank)):
        try:
            found.append(unpack(torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.uint8)))
        except ValueError as exc:  # a write that a kill cut short
            damaged = exc
    if found:
        newest = max(found, key=lambda shared: shared.step)
        return newest.step, newest.position
    if damaged is not None:
        raise damaged
    return _read_two_files(root, rank)


def _read_two_files(root: Path, rank: int) -> tuple[int, Mapping[str, object]] | None:
    """A record as versions before the packed record wrote it (JSON header, payload)."""
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


def _header(data: bytes) -> tuple[JsonObject, int]:
    """A packed blob's header and where its payload starts."""
    size = int.from_bytes(data[:8], "little")
    if not 0 < size <= len(data) - 8:
        raise ValueError(f"a data position's copy announces a {size}-byte header")
    return json_object(json.loads(data[8 : 8 + size])), 8 + size


def unpack(blob: torch.Tensor) -> Shared:
    """``pack``'s inverse (bytes past the payload's announced size are ignored: an older,
    longer record's tail). Raises ValueError for a blob whose parts do not match its header
    (sizes, SHA-256)."""
    data = blob.numpy().tobytes()
    header, start = _header(data)
    step = json_int(header.get("step"))
    payload = data[start : start + json_int(header.get("bytes"))]
    state = json_object(decode(header, payload, step))
    position = cast(Mapping[str, object], state["data"])
    return Shared(json_int(state["site"]), step, position, str(state.get("digest", "")))


def peek(blob: torch.Tensor) -> Shared:
    """A packed blob's site, step and digest from its JSON header alone, without the position
    (not decoded, nor checked against its SHA-256: ``unpack`` does both where it is used).
    Raises ValueError for a header that is not such a blob's."""
    header, _ = _header(blob.numpy().tobytes())
    tree = json_object(header.get("tree"))
    digest = tree.get("digest", "")
    return Shared(json_int(tree.get("site")), json_int(header.get("step")), {}, str(digest))


def differing_sites(mine: Shared, shared: list[Shared]) -> list[int]:
    """The sites among ``shared`` whose non-empty ``digest`` differs from ``mine``'s (none
    where ``mine`` has none): the replicas that are not equal after a heal."""
    if not mine.digest:
        return []
    return sorted(s.site for s in shared if s.digest and s.digest != mine.digest)


class PendingBlobs:
    """An all-gather of blobs in flight over ``group`` (the live sites' rank ``r``), started at
    construction so that it overlaps the sync's exchange; ``wait`` gives every member's
    ``blob`` (uint8, any length; empty: nothing to share) in the group's rank order. One
    all-gather of ``GATHER_BYTES`` per member (the length, then the blob) where every blob
    fits, a second of the longest, in ``wait``, where one does not. Raises RuntimeError (gloo's,
    for a member lost during it) at the start or in ``wait``."""

    def __init__(self, group: ProcessGroup, blob: torch.Tensor, timeout: timedelta) -> None:
        self.group, self.blob, self.timeout = group, blob, timeout
        slot = torch.zeros(GATHER_BYTES, dtype=torch.uint8)
        slot[:8] = torch.tensor([blob.numel()], dtype=torch.int64).view(torch.uint8)
        if blob.numel() <= GATHER_BYTES - 8:
            slot[8 : 8 + blob.numel()] = blob
        self.gathered = [torch.zeros(GATHER_BYTES, dtype=torch.uint8) for _ in range(group.size())]
        self.work = group.allgather([self.gathered], [slot], AllgatherOptions())

    def wait(self) -> list[torch.Tensor]:
        """The members' blobs, once the all-gather is done (collective: a second all-gather
        where a blob did not fit in its slot)."""
        self.work.wait(self.timeout)
        lengths = [int(data[:8].view(torch.int64).item()) for data in self.gathered]
        if max(lengths) <= GATHER_BYTES - 8:
            pairs = zip(self.gathered, lengths, strict=True)
            return [data[8 : 8 + size].clone() for data, size in pairs]
        padded = torch.zeros(max(lengths), dtype=torch.uint8)
        padded[: self.blob.numel()] = self.blob
        whole = [torch.zeros(max(lengths), dtype=torch.uint8) for _ in lengths]
        self.group.allgather([whole], [padded], AllgatherOptions()).wait(self.timeout)
        return [data[:size].clone() for data, size in zip(whole, lengths, strict=True)]


def gather_blobs(group: ProcessGroup, blob: torch.Tensor, timeout: timedelta) -> list[torch.Tensor]:
    """Collective over ``group``: every member's ``blob`` (``PendingBlobs``), waited for."""
    return PendingBlobs(group, blob, timeout).wait()
