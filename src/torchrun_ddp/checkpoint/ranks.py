"""This process's rank and world size, and the barriers and agreement the checkpoint code needs.

Every helper also works without a process group (a single process is rank 0 of 1), so the
checkpoint functions run unchanged in one process, e.g. in tests or tools. Values cross ranks as
UTF-8 JSON in uint8 tensors, never pickled.
"""

from __future__ import annotations

import json

import torch
import torch.distributed as dist


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
