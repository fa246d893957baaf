"""What FSDP sends per rank and optimizer step under --data-parallel fsdp|hsdp, for the
communication plan: within each shard group (its all-gathers and reduce-scatter) and across the
groups (native hsdp's all-reduce of the shards, or the training method's own exchange on the
replicas)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from torchrun_ddp.compression import ShardedExchange, sharded_step_bytes
from torchrun_ddp.model import PRECISION_DTYPES

if TYPE_CHECKING:
    from torchrun_ddp.config import TrainConfig
    from torchrun_ddp.parallel.base import PlannedMethod
    from torchrun_ddp.parallel.fsdp import FSDP
    from torchrun_ddp.plan.communication import Topology


@dataclass(frozen=True)
class ShardedTraffic:
    """Wire bytes one rank sends per optimizer step under --data-parallel fsdp/hsdp: ``within``
    its shard group (FSDP's all-gathers and reduce-scatter) and ``across`` the groups (native
    hsdp: FSDP's all-reduce of the shards; ``hooked``: the method's own exchange on the
    replicas); ``shard`` ranks per group, ``replicas`` groups. ``fsdp``: FSDP's own bytes."""

    within: float
    across: float
    hooked: bool
    shard: int
    replicas: int

    @property
    def fsdp(self) -> float:
        """FSDP's collectives (native hsdp: its all-reduce across the groups included)."""
        return self.within if self.hooked else self.within + self.across


def sharded_traffic_bytes(
    mode: FSDP,
    config: TrainConfig,
    shapes: Sequence[tuple[int, ...]],
    topo: Topology,
    method: PlannedMethod,
) -> ShardedTraffic:
    """FSDP's wire bytes per rank and step (``compression.sharded_step_bytes``: every
    micro-batch all-gathers the units, layers twice and the root once, then the gradients are
    reduce-scattered, under native hsdp also all-reduced over the replicas). Under hsdp with a
    method on the replicas (``exchanges_replicas``) FSDP stays within each group, and ``across``
    is the method's estimate for the shard's shapes on a ring of the R replicas."""
    world, sizes = topo.world_size, [math.prod(shape) for shape in shapes]
    parameters = sum(sizes)
    shard = mode.shape.shard
    hooked = method.exchanges_replicas(mode.replicate_dim)
    exchange = ShardedExchange(
        parameters=parameters,
        gathered=2 * parameters - max(sizes),  # the root's bulk: the embedding (and the head)
        shard=shard,
        replicate=1 if hooked else world // shard,
        micro_batches=config.accumulation_steps,
        gather_bytes=4 if config.precision == "fp32" else 2,
        reduce_bytes=PRECISION_DTYPES[config.precision].itemsize,
    )
    within, _ = sharded_step_bytes(replace(exchange, replicate=1))
    across = sharded_step_bytes(exchange)[0] - within
    if hooked:
        replicas = replace(topo, world_size=world // shard, per_node=1)
        bucket = config.ddp_bucket_cap_mb * 2**20
        estimate = method.step_estimate(mode.shard_shapes(shapes), replicas, bucket)
        across = estimate.wire_bytes
    return ShardedTraffic(within, across, hooked, shard, world // shard)


def sharded_traffic(
    mode: FSDP,
    config: TrainConfig,
    shapes: Sequence[tuple[int, ...]],
    topo: Topology,
    method: PlannedMethod,
) -> list[str]:
    """FSDP's line of :func:`sharded_traffic_bytes` (the table's rows are then DDP's comm hooks,
    for comparison), where its collectives cross nodes, and with a method on hsdp's replicas its
    line across them."""
    bytes_ = sharded_traffic_bytes(mode, config, shapes, topo, method)
    lines = [
        f"--data-parallel {mode.name} ({bytes_.replicas} x {bytes_.shard} ranks): "
        f"FSDP sends {bytes_.fsdp / 1e6:.4g} MB per rank per step (all-gathers of every "
        "micro-batch, one reduce-scatter"
        + ("" if bytes_.hooked else ", and under hsdp the shards' all-reduce across replicas")
        + "); the rows below are DDP's comm hooks, for comparison"
    ]
    if bytes_.hooked:
        lines.append(
            f"{method.describe()} across the {bytes_.replicas} replicas: "
            f"{bytes_.across / 1e6:.4g} MB per rank per step, each rank its 1/{bytes_.shard} "
            "shard (the method's estimate for the shard's shapes; only this crosses between "
            "groups)"
        )
    return lines
