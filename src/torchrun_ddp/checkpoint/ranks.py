"""This process's rank and world size, and the barriers and agreement the checkpoint code needs.

Every helper also works without a process group (a single process is rank 0 of 1), so the
checkpoint functions run unchanged in one process, e.g. in tests or tools. Values cross ranks as
UTF-8 JSON in uint8 tensors, never pickled.

This is the JSON boundary of the package: the typed decisions (``peers.StartDecision``,
``peers.Inventory``, ``transfer.Stream``, ``manifest.Entry``...) are turned into plain JSON by
their ``to_json`` right before ``broadcast_json`` / ``all_gather_json`` (or a file write) and back
by their ``from_json`` right after, which read it with the ``json_*`` helpers below (each raises
ValueError for a value of another shape).
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import torch
import torch.distributed as dist

JsonObject = dict[str, object]
"""A JSON object as it crosses the process group or sits in a file: only ``to_json`` /
``from_json`` of the typed values handle one."""


def distributed() -> bool:
    """Whether a default process group exists (without one: a single process, rank 0 of 1)."""
    return dist.is_available() and dist.is_initialized()


def rank_and_world() -> tuple[int, int]:
    """``(rank, world_size)`` of the default process group, ``(0, 1)`` without one."""
    if distributed():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def collective_device() -> torch.device:
    """Where the default group's collectives take their tensors: the current GPU under NCCL,
    else the CPU."""
    if distributed() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def every_rank_ok(ok: bool) -> bool:
    """Whether ``ok`` holds on every rank (one all-reduce MIN; just ``ok`` without a group)."""
    if not distributed():
        return ok
    flag = torch.tensor([int(ok)], device=collective_device())
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def barrier() -> None:
    """``dist.barrier()`` when a process group exists; nothing otherwise."""
    if distributed():
        dist.barrier()


def broadcast_json(value: object, device: torch.device | None = None) -> object:
    """Rank 0's ``value`` on every rank, sent as UTF-8 JSON bytes (two broadcasts: the length,
    then a uint8 tensor); JSON, not pickle, so nothing received is unpickled."""
    if not distributed():
        return json.loads(json.dumps(value))
    device = device or collective_device()
    data = json.dumps(value).encode() if dist.get_rank() == 0 else b""
    length = torch.tensor([len(data)], dtype=torch.int64, device=device)
    dist.broadcast(length, src=0)
    buffer = torch.zeros(int(length.item()), dtype=torch.uint8, device=device)
    if dist.get_rank() == 0:
        buffer.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    dist.broadcast(buffer, src=0)
    return json.loads(buffer.cpu().numpy().tobytes().decode())


def all_gather_json(value: object, device: torch.device | None = None) -> list[object]:
    """Every rank's ``value``, in rank order, on every rank (two all-gathers: the lengths, then
    the UTF-8 JSON bytes padded to the longest)."""
    if not distributed():
        return [json.loads(json.dumps(value))]
    device = device or collective_device()
    data = json.dumps(value).encode()
    world = dist.get_world_size()
    lengths = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
    dist.all_gather(lengths, torch.tensor([len(data)], dtype=torch.int64, device=device))
    sizes = [int(length.item()) for length in lengths]
    mine = torch.zeros(max(sizes), dtype=torch.uint8, device=device)
    if data:
        mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    rows = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(rows, mine)
    return [
        json.loads(row[:size].cpu().numpy().tobytes().decode())
        for row, size in zip(rows, sizes, strict=True)
    ]


def json_object(value: object) -> JsonObject:
    """``value`` as a JSON object (a dict with string keys).

    Raises ValueError for anything else."""
    if isinstance(value, dict) and all(isinstance(key, str) for key in value):
        return value
    raise ValueError(f"expected a JSON object, got {type(value).__name__}")


def json_list(value: object, length: int | None = None) -> list[object]:
    """``value`` (a JSON array; a tuple is taken too) as a list, of ``length`` items if given.

    Raises ValueError for anything else."""
    if isinstance(value, list | tuple) and (length is None or len(value) == length):
        return list(value)
    raise ValueError(f"expected a JSON array of {length or 'any number of'} items, got {value!r}")


def json_int(value: object) -> int:
    """``value`` (a JSON number, or a string of digits) as ``int()`` reads it.

    Raises ValueError for anything else (``int()``'s own message for a string)."""
    if isinstance(value, int | float | str):
        return int(value)
    raise ValueError(f"expected an integer, got {value!r}")


def json_ints(value: object) -> tuple[int, ...]:
    """A JSON array of integers as a tuple. Raises ValueError for anything else."""
    return tuple(json_int(item) for item in json_list(value))


def json_float(value: object) -> float:
    """``value`` (a JSON number) as a float. Raises ValueError for anything else."""
    if isinstance(value, int | float):
        return float(value)
    raise ValueError(f"expected a number, got {value!r}")


def json_str(value: object) -> str:
    """``value`` (a JSON string) as is. Raises ValueError for anything else."""
    if isinstance(value, str):
        return value
    raise ValueError(f"expected a string, got {value!r}")


def json_optional_str(value: object) -> str | None:
    """None for JSON null, else any other value as ``str()`` writes it (a saved run id)."""
    return None if value is None else str(value)


def int_rows(rows: Sequence[Sequence[int]]) -> list[list[int]]:
    """Rows of integers as JSON arrays (``json_rows`` reads them back)."""
    return [list(row) for row in rows]


def json_rows(value: object) -> tuple[tuple[int, ...], ...]:
    """A JSON array of arrays of integers as tuples. Raises ValueError for anything else."""
    return tuple(json_ints(row) for row in json_list(value))
