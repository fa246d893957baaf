"""Tensors as a safetensors file that is written and read piece by piece, never as one blob.

A healing transfer (``heal.HealTransport``) sends a site's state as the bytes of a safetensors
file (the format: github.com/huggingface/safetensors, "Format"): 8 bytes of little-endian
header length ``N``, ``N`` bytes of UTF-8 JSON (``{name: {"dtype", "shape", "data_offsets":
[begin, end]}}``, padded with spaces to a multiple of 8), then every tensor's bytes back to back.
``safetensors.torch.load`` reads those bytes as any other safetensors file (tested), but neither
side builds them in memory: the sender sends each tensor's bytes from the tensor itself
(``Layout.piece``), the receiver receives them into one buffer and takes the tensors as views of
it (``Layout.views``), so each side holds the state once, not two or three times.

Tensors are laid out by element size, largest first, then by name (as safetensors orders them),
so that every tensor's offset is a multiple of its element size and a view of the received bytes
needs no copy. ``read_layout`` checks a received header as strictly as safetensors does: known
dtypes, shapes whose bytes match their offsets, offsets that tile the data exactly, aligned.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from torchrun_ddp.checkpoint.ranks import json_int, json_ints, json_object, json_str

DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
"""safetensors' dtype names -> torch dtypes, for the dtypes a training state holds."""
NAMES = {dtype: name for name, dtype in DTYPES.items()}
MERGE_BYTES = 256 * 2**10
"""Tensors smaller than this (biases, norms, counters) travel merged with their neighbours:
one send each would cost more than copying them (``Layout.pieces``)."""


@dataclass(frozen=True)
class Entry:
    """One tensor of a layout: its bytes are ``[begin, end)`` of the data after the header."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int


@dataclass(frozen=True)
class Layout:
    """Where each tensor's bytes sit in a safetensors file of ``size`` bytes, whose first
    ``len(header)`` bytes are ``header`` (length and JSON)."""

    header: bytes
    entries: tuple[Entry, ...]

    @property
    def size(self) -> int:
        """Bytes of the whole file: header, then data."""
        return len(self.header) + (self.entries[-1].end if self.entries else 0)

    def pieces(self, chunk_bytes: int) -> list[tuple[int, int]]:
        """File byte ranges ``[start, stop)`` to send one after the other, the header first and
        alone (the receiver needs it to know the rest), then ranges of at most ``chunk_bytes``:
        a tensor of ``MERGE_BYTES`` (or ``chunk_bytes``) or more in ranges of its own (sent from
        its memory), smaller consecutive tensors merged (copied into one piece). The same on both
        sides, from the layout alone. Raises ValueError for ``chunk_bytes`` < 1."""
        if chunk_bytes < 1:
            raise ValueError(f"a piece must hold at least 1 byte, got {chunk_bytes}")
        base = len(self.header)
        ranges, start = [(0, base)], base  # start: where the run of small tensors begins
        for entry in self.entries:
            begin, stop = base + entry.begin, base + entry.end
            small = stop - begin < min(MERGE_BYTES, chunk_bytes)
            if start < begin and (not small or stop - start > chunk_bytes):
                ranges.append((start, begin))  # the run ends before this tensor
                start = begin
            if small:
                continue
            ranges += [(a, min(a + chunk_bytes, stop)) for a in range(begin, stop, chunk_bytes)]
            start = stop
        if start < self.size:
            ranges.append((start, self.size))
        return ranges

    def piece(self, tensors: Mapping[str, torch.Tensor], start: int, stop: int) -> torch.Tensor:
        """File bytes ``[start, stop)`` as a uint8 CPU tensor: a view of the one tensor (or the
        header) they lie in, or a copy of the parts of several. ``tensors``: the layout's, by
        name (contiguous; on any device: a GPU tensor's part is copied to the CPU)."""
        parts = [part for part in self._parts(tensors, start, stop) if part.numel()]
        if len(parts) == 1:
            return parts[0].cpu()
        return torch.cat([part.cpu() for part in parts])

    def _parts(
        self, tensors: Mapping[str, torch.Tensor], start: int, stop: int
    ) -> list[torch.Tensor]:
        """The uint8 slices of the header and of each tensor that ``[start, stop)`` covers."""
        base = len(self.header)
        header = torch.frombuffer(bytearray(self.header), dtype=torch.uint8)
        parts = [header[start:stop]] if start < base else []
        for entry in self.entries:
            lo, hi = max(start, base + entry.begin), min(stop, base + entry.end)
            if lo < hi:
                raw = byte_view(tensors[entry.name])
                parts.append(raw[lo - base - entry.begin : hi - base - entry.begin])
        return parts

    def views(self, body: torch.Tensor) -> dict[str, torch.Tensor]:
        """The tensors of a received file ``body`` (uint8, ``size`` bytes) as views of it."""
        base = len(self.header)
        return {
            entry.name: body[base + entry.begin : base + entry.end]
            .view(entry.dtype)
            .view(entry.shape)
            for entry in self.entries
        }


def byte_view(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a flat uint8 view (no copy)."""
    return tensor.reshape(-1).view(torch.uint8)


def layout(tensors: Mapping[str, torch.Tensor]) -> Layout:
    """The safetensors layout of ``tensors`` (contiguous, plain tensors: a DTensor's local
    shard). Raises TypeError for a dtype outside ``DTYPES``."""
    entries, offset = [], 0
    for name in sorted(tensors, key=lambda key: (-tensors[key].element_size(), key)):
        tensor = tensors[name]
        if tensor.dtype not in NAMES:
            raise TypeError(
                f"cannot send {name!r} of dtype {tensor.dtype}: not a safetensors dtype"
            )
        size = tensor.numel() * tensor.element_size()
        entries.append(Entry(name, tensor.dtype, tuple(tensor.shape), offset, offset + size))
        offset += size
    spec = {
        entry.name: {
            "dtype": NAMES[entry.dtype],
            "shape": list(entry.shape),
            "data_offsets": [entry.begin, entry.end],
        }
        for entry in entries
    }
    text = json.dumps(spec, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return Layout(len(text).to_bytes(8, "little") + text, tuple(entries))


def read_layout(header: bytes, size: int) -> Layout:
    """The layout of a received safetensors file of ``size`` bytes from its first bytes
    ``header`` (length and JSON, as ``Layout.header``). Raises ValueError for a header that
    another length announces, is not a JSON object of tensor entries, names an unknown dtype,
    or whose offsets do not tile the data up to ``size`` exactly with each tensor aligned."""
    if len(header) < 8 or int.from_bytes(header[:8], "little") != len(header) - 8:
        raise ValueError("a healing peer's safetensors header does not match its length")
    spec = json_object(json.loads(header[8:], object_pairs_hook=_no_repeats))
    entries = sorted(
        (_entry(name, value) for name, value in spec.items() if name != "__metadata__"),
        key=lambda entry: entry.begin,
    )
    offset = 0
    for entry in entries:
        if entry.begin != offset or entry.begin % entry.dtype.itemsize:
            raise ValueError(f"a healing peer's tensor {entry.name!r} is not where it belongs")
        offset = entry.end
    if len(header) + offset != size:
        raise ValueError(f"a healing peer's tensors end at {len(header) + offset}, not {size}")
    return Layout(header, tuple(entries))


def _entry(name: str, value: object) -> Entry:
    """One checked entry of a received header."""
    fields = json_object(value)
    dtype = DTYPES.get(json_str(fields.get("dtype")))
    shape = json_ints(fields.get("shape"))
    begin, end = (json_int(bound) for bound in json_ints(fields.get("data_offsets")))
    if dtype is None or any(side < 0 for side in shape):
        raise ValueError(f"a healing peer's tensor {name!r} has dtype or shape {fields}")
    if end - begin != math.prod(shape) * dtype.itemsize:
        raise ValueError(f"a healing peer's tensor {name!r} has {end - begin} bytes for {shape}")
    return Entry(name, dtype, shape, begin, end)


def _no_repeats(pairs: list[tuple[str, object]]) -> dict[str, object]:
    """A JSON object whose keys appear once (json.loads would keep the last)."""
    found = dict(pairs)
    if len(found) != len(pairs):
        raise ValueError("a healing peer's safetensors header repeats a tensor name")
    return found
