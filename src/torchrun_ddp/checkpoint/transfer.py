"""Checkpoint files sent from one rank to another over the process group, in bounded chunks,
checked with SHA-256: how a folder that lacks the checkpoint to resume gets it from a peer, and
how buddy copies of per-rank files reach other folders when a checkpoint is saved.

A :class:`Stream` is a list of files that one rank reads from its folder and another writes into
its own. Every rank runs the same list of streams (``exchange``): chunk ``c`` of every stream
moves in round ``c``, one batch of point-to-point sends and receives (``batch_isend_irecv``), so
memory stays at one chunk per stream a rank takes part in, whatever the files' size. At the end
each sender sends the SHA-256 of what it read and each receiver compares it with what it
received. Nothing is unpickled: the bytes are written as they came.
"""

from __future__ import annotations

import hashlib
import math
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import torch
import torch.distributed as dist

from torchrun_ddp.checkpoint.manifest import Entry
from torchrun_ddp.checkpoint.ranks import (
    all_gather_json,
    collective_device,
    json_int,
    json_list,
    json_str,
)
from torchrun_ddp.errors import UserError

CHUNK_BYTES = 64 * 2**20
"""Bytes per round of a stream (64 MiB): the memory a transfer adds on each rank it involves."""

Files = tuple[tuple[str, int], ...]
"""Files of a step folder: (path relative to the folder, size in bytes), in order."""


def files_to_json(files: Files) -> list[list[object]]:
    """``[[path, bytes], ...]``: ``files`` as they cross the process group."""
    return [[name, size] for name, size in files]


def files_from_json(value: object) -> Files:
    """``files_to_json``'s inverse. Raises ValueError for another shape."""
    pairs = (json_list(item, 2) for item in json_list(value))
    return tuple((json_str(name), json_int(size)) for name, size in pairs)


@dataclass(frozen=True)
class Stream:
    """``files`` (path relative to both folders, size in bytes), sent by rank ``src`` and
    written by rank ``dst``, in order."""

    src: int
    dst: int
    files: Files

    @property
    def size(self) -> int:
        """Bytes the stream moves."""
        return sum(size for _, size in self.files)

    def to_json(self) -> list[object]:
        """``[src, dst, [[path, bytes], ...]]``, as it crosses the process group."""
        return [self.src, self.dst, files_to_json(self.files)]

    @classmethod
    def from_json(cls, value: object) -> Stream:
        """``to_json``'s inverse. Raises ValueError for another shape."""
        src, dst, files = json_list(value, 3)
        return cls(json_int(src), json_int(dst), files_from_json(files))


@dataclass(frozen=True)
class Moved:
    """What ``exchange`` moved into this rank's folder: bytes received, and wall-clock seconds
    of the whole exchange (every round and the checks)."""

    received: int
    seconds: float
    entries: dict[str, Entry] = field(default_factory=dict)
    """The manifest ``Entry`` (bytes, SHA-256) of every file written here, by path, hashed while
    writing (the folder's manifest takes them)."""


class _Reader:
    """The concatenated bytes of a stream's files under ``folder``, read chunk by chunk; a file
    that cannot be read (or is shorter than announced) reads as zeros and is reported."""

    def __init__(self, folder: Path, files: Sequence[tuple[str, int]]) -> None:
        self.folder, self.files, self.index, self.offset = folder, list(files), 0, 0
        self.handle: BinaryIO | None = None
        self.digest = hashlib.sha256()
        self.error = ""

    def read(self, count: int) -> bytes:
        out = bytearray()
        while len(out) < count:
            name, size = self.files[self.index]
            part = self._read_file(name, min(size - self.offset, count - len(out)))
            out += part
            self.offset += len(part)
            if self.offset == size:
                self._next()
        self.digest.update(out)
        return bytes(out)

    def _read_file(self, name: str, count: int) -> bytes:
        try:
            if self.handle is None:
                self.handle = (self.folder / name).open("rb")
            data = self.handle.read(count)
        except OSError as exc:
            self.error = self.error or f"cannot read {self.folder / name} ({exc.strerror})"
            data = b""
        if len(data) < count:
            self.error = self.error or f"{self.folder / name} is shorter than announced"
        return data + bytes(count - len(data))

    def _next(self) -> None:
        if self.handle is not None:
            self.handle.close()
        self.handle, self.index, self.offset = None, self.index + 1, 0
        while self.index < len(self.files) and self.files[self.index][1] == 0:
            self.index += 1  # empty files: nothing to read


class _Writer:
    """Writes a stream's bytes into its files under ``folder`` (folders created, each file
    fsynced when full); a write that fails is reported and the rest of the bytes dropped."""

    def __init__(self, folder: Path, files: Sequence[tuple[str, int]]) -> None:
        self.folder, self.files, self.index, self.offset = folder, list(files), 0, 0
        self.handle: BinaryIO | None = None
        self.digest = hashlib.sha256()
        self.file_digest = hashlib.sha256()
        self.entries: dict[str, Entry] = {}
        self.error = ""
        try:
            for name, size in self.files:
                if size == 0:
                    self._open(name).close()
                    self.entries[name] = Entry(0, hashlib.sha256().hexdigest())
        except OSError as exc:
            self.error = f"cannot write in {self.folder} ({exc.strerror})"

    def write(self, data: bytes) -> None:
        self.digest.update(data)
        view = memoryview(data)
        while view:
            name, size = self.files[self.index]
            count = min(size - self.offset, len(view))
            self._write_file(name, view[:count])
            self.file_digest.update(view[:count])
            view, self.offset = view[count:], self.offset + count
            if self.offset == size:
                self._close()

    def _open(self, name: str) -> BinaryIO:
        path = self.folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        return path.open("wb")

    def _write_file(self, name: str, data: memoryview) -> None:
        if self.error:
            return
        try:
            if self.handle is None:
                self.handle = self._open(name)
            self.handle.write(data)
        except OSError as exc:
            self.error = f"cannot write {self.folder / name} ({exc.strerror})"

    def _close(self) -> None:
        if self.handle is not None and not self.error:
            try:
                self.handle.flush()
                os.fsync(self.handle.fileno())
            except OSError as exc:
                self.error = f"cannot write {self.handle.name} ({exc.strerror})"
        if self.handle is not None:
            self.handle.close()
        name, size = self.files[self.index]
        self.entries[name] = Entry(size, self.file_digest.hexdigest())
        self.file_digest = hashlib.sha256()
        self.handle, self.index, self.offset = None, self.index + 1, 0
        while self.index < len(self.files) and self.files[self.index][1] == 0:
            self.index += 1


def exchange(
    streams: Sequence[Stream],
    source: Path | None,
    target: Path | None,
    chunk_bytes: int = CHUNK_BYTES,
) -> Moved:
    """Collective over every rank: move ``streams`` (the same list, in the same order, on every
    rank). This rank reads what it sends from ``source`` and writes what it receives into
    ``target``. At most one stream per (src, dst) pair.

    Raises ValueError for two streams of one pair, and UserError on every rank when a file
    could not be read or written or a stream's SHA-256 differs at its receiver.
    """
    pairs = [(stream.src, stream.dst) for stream in streams]
    if len(set(pairs)) != len(pairs):
        raise ValueError("exchange takes one stream per (src, dst) pair")
    started = time.perf_counter()
    rank, device = dist.get_rank(), collective_device()
    sending = [i for i, stream in enumerate(streams) if stream.src == rank]
    taking = [i for i, stream in enumerate(streams) if stream.dst == rank]
    readers = {i: _Reader(source or Path(), streams[i].files) for i in sending}
    writers = {i: _Writer(target or Path(), streams[i].files) for i in taking}
    rounds = max((math.ceil(stream.size / chunk_bytes) for stream in streams), default=0)
    for index in range(rounds):
        _round(streams, readers, writers, index, chunk_bytes, device)
    errors = _check(streams, readers, writers, device)
    failures = [
        json_str(error) for listed in all_gather_json(errors) for error in json_list(listed)
    ]
    if failures:
        raise UserError(f"copying checkpoint files between ranks failed: {failures[0]}")
    received = sum(streams[i].size for i in taking)
    entries = {name: entry for writer in writers.values() for name, entry in writer.entries.items()}
    return Moved(received, time.perf_counter() - started, entries)


def _round(
    streams: Sequence[Stream],
    readers: dict[int, _Reader],
    writers: dict[int, _Writer],
    index: int,
    chunk_bytes: int,
    device: torch.device,
) -> None:
    """Round ``index``: this rank sends chunk ``index`` of each stream it reads and receives
    that chunk of each stream it writes, all in one batch."""
    ops, received = [], []
    for i, reader in readers.items():
        if count := _chunk(streams[i].size, index, chunk_bytes):
            data = torch.frombuffer(bytearray(reader.read(count)), dtype=torch.uint8)
            ops.append(dist.P2POp(dist.isend, data.to(device), streams[i].dst))
    for i in writers:
        if count := _chunk(streams[i].size, index, chunk_bytes):
            buffer = torch.empty(count, dtype=torch.uint8, device=device)
            ops.append(dist.P2POp(dist.irecv, buffer, streams[i].src))
            received.append((i, buffer))
    _run(ops)
    for i, buffer in received:
        writers[i].write(buffer.cpu().numpy().tobytes())


def _chunk(size: int, index: int, chunk_bytes: int) -> int:
    """Bytes of round ``index`` of a stream of ``size`` bytes (0 past its end)."""
    return max(0, min(chunk_bytes, size - index * chunk_bytes))


def _run(ops: list[dist.P2POp]) -> None:
    """Post this rank's sends and receives of one round together and wait for all of them."""
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()


def _check(
    streams: Sequence[Stream],
    readers: dict[int, _Reader],
    writers: dict[int, _Writer],
    device: torch.device,
) -> list[str]:
    """Each sender sends its stream's SHA-256; each receiver compares. This rank's errors."""
    ops, received = [], []
    for i, reader in readers.items():
        digest = torch.frombuffer(bytearray(reader.digest.digest()), dtype=torch.uint8)
        ops.append(dist.P2POp(dist.isend, digest.to(device), streams[i].dst))
    for i in writers:
        buffer = torch.empty(32, dtype=torch.uint8, device=device)
        ops.append(dist.P2POp(dist.irecv, buffer, streams[i].src))
        received.append((i, buffer))
    _run(ops)
    errors = [reader.error for reader in readers.values() if reader.error]
    errors += [writer.error for writer in writers.values() if writer.error]
    for i, buffer in received:
        if buffer.cpu().numpy().tobytes() != writers[i].digest.digest():
            errors.append(f"SHA-256 of the files from rank {streams[i].src} differs on arrival")
    return errors
