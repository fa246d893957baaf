"""What FSDP sends per rank and optimizer step under --data-parallel fsdp|hsdp, for the
communication plan: within each shard group (its all-gathers and reduce-scatter) and across the
groups (native hsdp's all-reduce of the shards, or the training method's own exchange on the
replicas), and which of it crosses the link between nodes.

Link model (as ``plan.communication``'s): a ring that spans nodes carries each rank's wire
bytes through every node's uplink once per direction. A shard group that spans nodes is one
such ring. Across the replicas, each shard index has its own ring of the R replicas, and the
rings of the node's ranks (``min(shard, per_node)`` of them) share its uplink, each at that
share of the bandwidth, so the uplink carries their sum.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from torchrun_ddp.compression import ShardedExchange, sharded_step_bytes
from torchrun_ddp.compression.settings import CompressionSettings
from torchrun_ddp.model import PRECISION_DTYPES
from torchrun_ddp.plan.communication import (
    CommEstimate,
    CommSection,
    Topology,
    combined,
    estimate,
    hook_rows,
    reference_methods,
)

if TYPE_CHECKING:
    from torchrun_ddp.config import TrainConfig
    from torchrun_ddp.parallel.base import PlannedMethod
    from torchrun_ddp.parallel.fsdp import FSDP


@dataclass(frozen=True)
class ShardedTraffic:
    """Wire bytes one rank sends under --data-parallel fsdp/hsdp: ``gather`` in one
    micro-batch's all-gathers and ``reduce`` in the step's reduce-scatter, within its shard
    group, over ``micro_batches`` micro-batches a step; ``across`` the groups per step (native
    hsdp: FSDP's all-reduce of the shards; ``hooked``: the method's own exchange on the
    replicas); ``shard`` ranks per group, ``replicas`` groups; ``crosses``: whether a shard
    group spans nodes (its rings then cross the node link)."""

    gather: float
    reduce: float
    micro_batches: int
    across: float
    hooked: bool
    shard: int
    replicas: int
    crosses: bool = False

    @property
    def within(self) -> float:
        """One step's bytes within the shard group: every micro-batch's all-gathers and the
        reduce-scatter."""
        return self.micro_batches * self.gather + self.reduce

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
    """FSDP's wire bytes per rank (``compression.sharded_step_bytes``: every micro-batch
    all-gathers the units, layers twice and the root once, then the gradients are
    reduce-scattered, under native hsdp also all-reduced over the replicas). Under hsdp with a
    method on the replicas (``exchanges_replicas``) FSDP stays within each group, and ``across``
    is the method's estimate for the shard's shapes on a ring of the R replicas."""
    world, sizes = topo.world_size, [math.prod(shape) for shape in shapes]
    shard = mode.shape.shard
    hooked = method.exchanges_replicas(mode.replicate_dim)
    exchange = ShardedExchange(
        parameters=sum(sizes),
        gathered=2 * sum(sizes) - max(sizes),  # the root's bulk: the embedding (and the head)
        shard=shard,
        replicate=1,
        micro_batches=1,
        gather_bytes=4 if config.precision == "fp32" else 2,
        reduce_bytes=PRECISION_DTYPES[config.precision].itemsize,
    )
    one, _ = sharded_step_bytes(exchange)
    reduce, _ = sharded_step_bytes(replace(exchange, gathered=0))
    across = sharded_step_bytes(replace(exchange, replicate=world // shard))[0] - one
    if hooked:
        bucket = config.ddp_bucket_cap_mb * 2**20
        ring, _ = replica_ring(topo, shard)
        across = method.step_estimate(mode.shard_shapes(shapes), ring, bucket).wire_bytes
    return ShardedTraffic(
        gather=one - reduce,
        reduce=reduce,
        micro_batches=config.accumulation_steps,
        across=across,
        hooked=hooked,
        shard=shard,
        replicas=world // shard,
        crosses=shard > topo.per_node,
    )


def replica_ring(topo: Topology, shard: int) -> tuple[Topology, int]:
    """The ring of one shard index's R replicas (ranks ``i, i + shard, ...``) on ``topo``, and
    how many such rings share a node's uplink: ``min(shard, per_node)``, each at that share of
    its bandwidth (``per_node``: the replicas a node holds, ``per_node / shard`` or 1)."""
    replicas = topo.world_size // shard
    rings = min(shard, topo.per_node)
    per_node = max(1, topo.per_node // shard)
    return Topology(replicas, per_node, topo.intra_bits_per_s, topo.inter_bits_per_s / rings), rings


def on_the_uplink(comm: CommEstimate, rings: int) -> CommEstimate:
    """``comm`` of one ring of ``replica_ring`` as the node sees it: ``rings`` rings at once, so
    its uplink carries ``rings`` times one ring's bytes (the seconds already share the link)."""
    return replace(comm, uplink_bytes=comm.uplink_bytes * rings)


def within_estimate(traffic: ShardedTraffic, topo: Topology) -> CommEstimate:
    """FSDP's collectives within the shard groups in one step, as a row of the plan: on the
    node link when a group spans nodes. FSDP2 gathers the next unit while the current one
    computes and reduce-scatters during backward, so the whole step's compute can hide them."""
    bits = topo.inter_bits_per_s if traffic.crosses else topo.intra_bits_per_s
    uplink = traffic.within if traffic.crosses else 0.0
    return CommEstimate(
        traffic.within, uplink, traffic.within * 8 / bits, overlaps=True, hides_behind=1.0
    )


def sharded_lines(mode: FSDP, traffic: ShardedTraffic, topo: Topology) -> list[str]:
    """The plan's line on FSDP's own collectives: per micro-batch and per step, and what of
    them crosses the node link, with its time at --plan-inter-node-gbit."""
    head = (
        f"--data-parallel {mode.name} ({traffic.replicas} x {traffic.shard} ranks): FSDP sends "
        f"{traffic.gather / 1e6:.4g} MB per rank per micro-batch (all-gathers) and "
        f"{traffic.within / 1e6:.4g} MB per step ({traffic.micro_batches} micro-batch(es) and "
        f"one reduce-scatter of {traffic.reduce / 1e6:.4g} MB) within its shard group"
    )
    if not traffic.crosses:
        return [head + ", inside a node"]
    seconds = traffic.within * 8 / topo.inter_bits_per_s
    return [
        head,
        f"its shard group spans {math.ceil(traffic.shard / topo.per_node)} nodes, so all of it "
        f"crosses the node link: {traffic.gather / 1e6:.4g} MB per micro-batch, "
        f"{traffic.within / 1e6:.4g} MB per step through each node's uplink, "
        f"{seconds:.4g} s per step at --plan-inter-node-gbit {topo.inter_bits_per_s / 1e9:g}",
    ]


def sharded_communication(
    mode: FSDP,
    config: TrainConfig,
    shapes: Sequence[tuple[int, ...]],
    topo: Topology,
    method: PlannedMethod,
) -> CommSection:
    """The plan's rows under fsdp and hsdp: FSDP's collectives within the shard groups, and
    with replicas what crosses between them (``replica_rows``); no DDP hook row where there is
    no replica for it to run on."""
    traffic = sharded_traffic_bytes(mode, config, shapes, topo, method)
    within = (f"{mode.name}: FSDP within shard groups", within_estimate(traffic, topo))
    sizes = [math.prod(shape) for shape in shapes]
    dense = estimate(CompressionSettings("none"), sizes, topo, shapes)
    lines = sharded_lines(mode, traffic, topo)
    if traffic.replicas == 1:
        return CommSection(lines, [within], dense, within[1], f"the {within[0]} row")
    rows, run = replica_rows(mode, config, shapes, topo, method)
    lines.append(
        f"rows named replicas: the exchange across the {traffic.replicas} replicas, each rank "
        f"its 1/{traffic.shard} shard, {min(traffic.shard, topo.per_node)} rings sharing a "
        "node's uplink (DDP's comm hooks there, for comparison)"
    )
    name = f"the {within[0]} row + the {run[0]} row"
    return CommSection(lines, [within, *rows], dense, combined(within[1], run[1]), name)


def replica_rows(
    mode: FSDP,
    config: TrainConfig,
    shapes: Sequence[tuple[int, ...]],
    topo: Topology,
    method: PlannedMethod,
) -> tuple[list[tuple[str, CommEstimate]], tuple[str, CommEstimate]]:
    """hsdp's rows across the replicas, for the shard's shapes on ``replica_ring``: the
    method's own exchange or --compression hook where it runs there (not a node-aware one: hsdp
    refuses --compression-scope inter-node), FSDP's all-reduce of the shards (native hsdp),
    then the global comm hooks for comparison; and the run's row."""
    ring, rings = replica_ring(topo, mode.shape.shard)
    shard = mode.shard_shapes(shapes)
    sizes = [math.prod(shape) for shape in shard]
    bucket = config.ddp_bucket_cap_mb * 2**20
    own = [row for row in method.communication_rows(shard, ring) if "inter-node" not in row[0]]
    if method.exchanges_replicas(mode.replicate_dim):
        own += hook_rows(method.plan_hooks(), sizes, ring, shard, bucket)
    native_dtype = "none" if PRECISION_DTYPES[config.precision].itemsize == 4 else "bf16"
    native = estimate(CompressionSettings(native_dtype), sizes, ring, shard, bucket)
    rows = [*own, ("FSDP all-reduce (native hsdp)", native)]
    references = [
        settings
        for settings in reference_methods(config.compression_block_size)
        if settings.scope == "global" and settings.method != "none"
    ]
    rows += hook_rows(references, sizes, ring, shard, bucket, [name for name, _ in rows])
    rows = [(f"replicas: {name}", on_the_uplink(comm, rings)) for name, comm in rows]
    if not method.exchanges_replicas(mode.replicate_dim):
        return rows, rows[len(own)]
    run = on_the_uplink(method.step_estimate(shard, ring, bucket), rings)
    return rows, next((row for row in rows if row[1] == run), ("replicas", run))
