"""ZeRO-1 optimizer state saved at one world size loads at another through DCP (real gloo
groups): saved by 2 ranks, loaded by 3, whose partition of the parameters differs; every
AdamW moment arrives bit-identical on the rank that owns it now, and the next step at 3 ranks
equals the next step at 2 ranks on the same global batch. The same spawns check that a rotating
``dct`` comm hook's state keeps its step and drops its error-feedback residuals."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from distributed_harness import run_distributed
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel
from torch.optim import AdamW

from torchrun_ddp.checkpoint import (
    ModelAndOptimizer,
    ShardedOptimizer,
    load_checkpoint,
    load_rank_states,
    save_checkpoint,
)
from torchrun_ddp.compression import CompressionSettings, CompressionState, register_compression

WIDTH = 16
GLOBAL_BATCH = 6  # samples per step over all ranks: divides by 2 and by 3
STEPS = 2


def _build() -> tuple[DistributedDataParallel, ZeroRedundancyOptimizer]:
    """A small MLP (plain torch: a spawn then imports no transformers) with ZeRO-1 AdamW."""
    torch.manual_seed(0)
    layers = [torch.nn.Linear(WIDTH, WIDTH) for _ in range(5)]
    model = DistributedDataParallel(torch.nn.Sequential(*layers))
    params = list(model.parameters())
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    return model, ZeroRedundancyOptimizer(groups, optimizer_class=AdamW, lr=1e-2)


def _step(model: DistributedDataParallel, zero: ZeroRedundancyOptimizer, step: int) -> None:
    """One step on this rank's share of a global batch drawn from a fixed generator."""
    rank, world = dist.get_rank(), dist.get_world_size()
    batch = torch.randn(GLOBAL_BATCH, WIDTH, generator=torch.Generator().manual_seed(step))
    mine = batch.chunk(world)[rank]
    model(mine).square().mean().backward()
    zero.step()
    zero.zero_grad(set_to_none=True)


def _compressed() -> tuple[DistributedDataParallel, CompressionState]:
    """A second small DDP model whose gradients go through rotating dct with error feedback."""
    torch.manual_seed(1)
    model = DistributedDataParallel(torch.nn.Linear(WIDTH, WIDTH))
    settings = CompressionSettings(method="dct", ratio=0.25, block_size=8, selection="rotating")
    return model, register_compression(model, settings)


def _owned(sharded: ShardedOptimizer) -> dict[str, dict[str, torch.Tensor]]:
    """A copy of this rank's optimizer state (the live tensors change at the next step)."""
    return {
        name: {key: value.clone() for key, value in values.items()}
        for name, values in sharded.owned_state().items()
    }


def _save_worker(rank: int, world_size: int, root: str) -> dict[str, object]:
    model, zero = _build()
    for step in range(STEPS):
        _step(model, zero, step)
    sharded = ShardedOptimizer(zero, model)
    compressed, compression = _compressed()
    for _ in range(STEPS):
        compressed(torch.randn(3, WIDTH)).sum().backward()
    per_rank = {
        "optimizer": sharded.state_dict(),
        "data": {"rank": rank},
        "compression": compression.state_dict(),
    }
    shared = {"train": ModelAndOptimizer(model, None)}
    save_checkpoint(Path(root), STEPS, shared, per_rank, {}, 1, sharded={"optimizer": sharded})
    owned = _owned(sharded)
    _step(model, zero, STEPS)
    after = {name: p.detach().clone() for name, p in model.module.named_parameters()}
    return {"owned": owned, "after": after}


def _load_worker(rank: int, world_size: int, root: str) -> dict[str, object]:
    model, zero = _build()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(1.0)  # not the saved weights: the load must replace them
    sharded = ShardedOptimizer(zero, model)
    path = Path(root) / f"step-{STEPS}"
    shared = {"train": ModelAndOptimizer(model, None)}
    per_rank = load_checkpoint(path, shared, {"optimizer": sharded}, reshard=True)
    sharded.load_state_dict(load_rank_states(path, "optimizer", [0])[0])
    owned = _owned(sharded)
    _step(model, zero, STEPS)
    after = {name: p.detach().clone() for name, p in model.module.named_parameters()}
    data = load_rank_states(path, "data")
    _, compression = _compressed()
    dropped = compression.load_resharded(load_rank_states(path, "compression", [0])[0])
    residuals = [k for k in compression.state_dict() if k.startswith("residual.")]
    return {
        "per_rank": per_rank, "owned": owned, "after": after, "data": data,
        "compression": (compression.step, dropped, residuals),
    }  # fmt: skip


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[object], list[object]]:
    root = str(tmp_path_factory.mktemp("zero1"))
    return run_distributed(_save_worker, 2, root), run_distributed(_load_worker, 3, root)


def test_zero1_state_is_resharded_bit_identical(runs: tuple[list[object], list[object]]) -> None:
    saved, loaded = runs
    before = {name: v for r in saved for name, v in r["owned"].items()}
    after = {name: v for r in loaded for name, v in r["owned"].items()}
    owners_before = [set(r["owned"]) for r in saved]
    owners_after = [set(r["owned"]) for r in loaded]
    assert owners_before != owners_after[:2], "the 3-rank partition should differ"
    assert sum(map(len, owners_after)) == len(after) == len(before) > 0
    assert after.keys() == before.keys()
    for name, values in before.items():
        assert values.keys() == after[name].keys() == {"step", "exp_avg", "exp_avg_sq"}
        for key, tensor in values.items():
            assert torch.equal(after[name][key], tensor), (name, key)


def test_the_next_step_at_three_ranks_matches_two(runs: tuple[list[object], list[object]]) -> None:
    saved, loaded = runs
    for result in loaded:
        assert result["per_rank"] is None  # another world size: per-rank state is not this rank's
        assert result["data"] == [{"rank": 0}, {"rank": 1}]
        assert result["compression"] == (STEPS, 2, [])  # weight and bias residuals dropped
        for name, tensor in saved[0]["after"].items():
            torch.testing.assert_close(result["after"][name], tensor, rtol=1e-5, atol=1e-6)
