"""This process's rank and world size, and the barriers and agreement the checkpoint code needs.

Every helper also works without a process group (a single process is rank 0 of 1), so the
checkpoint functions run unchanged in one process, e.g. in tests or tools.
"""

from __future__ import annotations

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


def every_rank_ok(ok: bool) -> bool:
    """Whether ``ok`` holds on every rank (one all-reduce MIN; just ``ok`` without a group)."""
    if not distributed():
        return ok
    device = torch.device("cpu")
    if dist.get_backend() == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    flag = torch.tensor([int(ok)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def barrier() -> None:
    """``dist.barrier()`` when a process group exists; nothing otherwise."""
    if distributed():
        dist.barrier()
