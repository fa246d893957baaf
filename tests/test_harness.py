"""The multi-process harness really runs a gloo group."""

import torch
import torch.distributed as dist
from distributed_harness import run_distributed


def _sum_ranks(rank: int, world_size: int) -> float:
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return float(t.item())


def test_all_reduce_over_real_processes() -> None:
    assert run_distributed(_sum_ranks, 2) == [3.0, 3.0]
