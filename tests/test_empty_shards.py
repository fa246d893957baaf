"""A shard with no rows: FSDP2 splits dim 0 of every parameter over the shard group, so a tensor
with fewer rows than ``--shard-degree`` leaves some ranks an empty shard ([0, C], or [0] for a
vector). DeMo and SparseLoCo cut their tiles from the local shard; an empty shard must send
nothing and keep empty state, and the methods must then step every replica as they step the
unsharded model. Real gloo ranks: 2 replicas of 2 shards (4 ranks) against the same replicas
unsharded, over the same replicate groups."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from distributed_harness import run_distributed
from torch.distributed.fsdp import fully_shard
from torch.optim import Optimizer

from torchrun_ddp.compression.replicas import local_shard
from torchrun_ddp.optim import SparseLoCo as LocalUpdates
from torchrun_ddp.optim.demo import DeMo, DemoSettings
from torchrun_ddp.optim.local_update_config import LocalUpdateSettings
from torchrun_ddp.parallel.base import MeshShape
from torchrun_ddp.parallel.sharding import build_mesh

STEPS = 4
SPARSELOCO = LocalUpdateSettings(
    method="sparseloco", local_steps=2, outer_lr=1.0, outer_momentum=0.0, topk=2, chunk=4
)


def _model() -> torch.nn.Sequential:
    """[8, 8] and [1, 8] weights and a [1] bias: at shard degree 2 the second shard of the last
    two is empty. Seeded, so every rank starts from the same weights."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8, bias=False), torch.nn.Linear(8, 1))


def _optimizer(method: str, model: torch.nn.Module, group: dist.ProcessGroup) -> Optimizer:
    """DeMo (tiles of 4 x 4, 2 values each) or SparseLoCo (chunks of 4, syncing every 2 steps
    around AdamW) over ``group``: tile and chunk sides divide the shards' rows, so the sharded
    tiles are the unsharded ones."""
    if method == "demo":
        return DeMo(model.parameters(), 1e-2, DemoSettings(topk=2, tile=4), process_group=group)
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return LocalUpdates(inner, SPARSELOCO, process_group=group)


def _train(model: torch.nn.Module, optimizer: Optimizer, replica: int) -> None:
    """STEPS steps on this replica's own batches (the same on both ranks of a replica)."""
    data = torch.Generator().manual_seed(100 + replica)
    for _ in range(STEPS):
        inputs = torch.randn(4, 8, generator=data)
        model(inputs).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()


def _worker(rank: int, world_size: int, method: str) -> dict[str, object]:
    """Train the 2 x 2 sharded model and the unsharded one; both exchange over the replicate
    group. Returns the local shards' shapes, the optimizer state's shapes and both models'
    full weights."""
    mesh = build_mesh(torch.device("cpu"), MeshShape(2, 2), hybrid=True)
    replicas = mesh["replicate"].get_group()
    sharded = _model()
    fully_shard(sharded, mesh=mesh["shard"])
    optimizer = _optimizer(method, sharded, replicas)
    _train(sharded, optimizer, rank // 2)
    plain = _model()
    _train(plain, _optimizer(method, plain, replicas), rank // 2)
    if isinstance(optimizer, LocalUpdates):
        state = optimizer.error
    else:
        state = [optimizer.state[p]["delta"] for p in sharded.parameters()]
    return {
        "shards": [tuple(local_shard(p).shape) for p in sharded.parameters()],
        "state": [tuple(tensor.shape) for tensor in state],
        "sharded": [p.full_tensor().detach() for p in sharded.parameters()],
        "plain": [p.detach().clone() for p in plain.parameters()],
    }


@pytest.mark.parametrize("method", ["demo", "sparseloco"])
def test_an_empty_shard_sends_nothing_and_steps_like_the_unsharded_model(method: str) -> None:
    ranks = run_distributed(_worker, 4, method)
    for rank, out in enumerate(ranks):
        rows = (4, 1, 1) if rank % 2 == 0 else (4, 0, 0)
        assert [shape[0] for shape in out["shards"]] == list(rows), out["shards"]
        assert out["state"] == out["shards"], "the method's state is not shard-shaped"
        for got, want in zip(out["sharded"], out["plain"], strict=True):
            torch.testing.assert_close(got, want)
        for got, want in zip(out["sharded"], ranks[0]["sharded"], strict=True):
            assert torch.equal(got, want), "the replicas differ"
    first = _model()
    assert not all(
        torch.equal(a, b) for a, b in zip(ranks[0]["plain"], first.parameters(), strict=True)
    ), "nothing trained"


def _one_rank(rank: int, world_size: int) -> dict[str, torch.Tensor]:
    """DeMo alone in its group (one rank, as under fsdp or a single replica) on a vector of 3:
    a message of 3 bf16 values and 3 uint8 positions, 9 bytes, an odd length."""
    param = torch.nn.Parameter(torch.tensor([0.5, -0.25, 2.0]))
    start = param.detach().clone()
    param.grad = torch.tensor([1.0, -3.0, 0.5])
    DeMo([param], 0.1, DemoSettings(topk=3, tile=4)).step()
    return {"start": start, "grad": param.grad, "end": param.detach()}


def test_one_rank_decodes_a_message_of_odd_length() -> None:
    """Every coefficient sent (k = 3 of 3) and averaged over one rank: the step is the sign of the
    gradient, times the learning rate."""
    (out,) = run_distributed(_one_rank, 1)
    torch.testing.assert_close(out["end"], out["start"] - 0.1 * out["grad"].sign())
