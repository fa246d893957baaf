"""What a compression method costs before a run: wire bytes, link time and memory per rank.

Closed forms over the parameter sizes, with the ring model of :mod:`.wire` (every collective is
bandwidth-bound; per-message latency is not modelled). ``--dry-run`` prints them (main.py) and
the memory plan adds :func:`state_bytes` to its rows.

Link time. A ring that spans several nodes crosses each node's uplink once per direction, so a
global collective over ``W`` ranks moves each rank's wire bytes through the slowest link: the
inter-node one when there are several nodes (NCCL's "bus bandwidth" model). The node-aware scope
moves ``S / L`` per local rank through the uplink, ``L`` rings at once, so the uplink carries
``2 (N - 1) / N * S`` for ``N`` nodes instead of ``2 (W - 1) / W * S``; its reduce-scatter and
all-gather inside the node use the intra-node links.
"""

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from torchrun_ddp.compression.cost import (
    hook_overlaps,
    hook_payload,
    label,
    powersgd_factor_numel,
    powersgd_numel,
    state_bytes,
)
from torchrun_ddp.compression.settings import CompressionSettings
from torchrun_ddp.compression.wire import demo_payload_bytes, wire_bytes

__all__ = [
    "label",
    "powersgd_factor_numel",
    "powersgd_numel",
    "state_bytes",
]  # the comm hooks' model, re-exported

FP32 = 4
DDP_BUCKET_BYTES = 25 * 2**20
"""DDP's default ``bucket_cap_mb`` (25 MiB) in bytes."""


@dataclass(frozen=True)
class Topology:
    """Ranks and links: ``world_size`` ranks, ``per_node`` on each node; bandwidths in bit/s per
    direction (intra: between two ranks of a node; inter: a node's uplink)."""

    world_size: int
    per_node: int
    intra_bits_per_s: float
    inter_bits_per_s: float

    @property
    def nodes(self) -> int:
        """Number of nodes, ``ceil(world_size / per_node)``."""
        return math.ceil(self.world_size / self.per_node)


@dataclass(frozen=True)
class CommEstimate:
    """One method's communication per optimizer step on one rank.

    ``wire_bytes``: bytes the rank sends (all links); ``uplink_bytes``: bytes its node's uplink
    carries per direction (0 on one node); ``seconds``: the time the links need (bandwidth
    model); ``overlaps``: whether the hook returns before its collectives finish, so that
    communication can run during backward; ``waits``: where it waits instead, when it does not.
    """

    wire_bytes: float
    uplink_bytes: float
    seconds: float
    overlaps: bool
    waits: str = "per bucket"
    hides_behind: float = 2 / 3
    """Share of forward plus backward the communication can run during when it ``overlaps``:
    backward's 2/3 for DDP's buckets, all of the next step's compute for a delayed update."""
    exposed_s: float = 0.0
    """Seconds of ``seconds`` that never hide, even when it ``overlaps``: a comm hook's share
    for DDP's last bucket, ready only when backward ends (:func:`last_bucket_share`), or
    node-aware DeMo's collectives inside the node (they run in the step, only the uplink's
    all-gather is delayed)."""


def last_bucket_share(sizes: Sequence[int], bucket_bytes: float = DDP_BUCKET_BYTES) -> float:
    """Share of the fp32 gradient bytes in DDP's last bucket, the one ready only when backward
    ends, so that its communication cannot hide behind backward.

    DDP fills buckets in reverse order of the parameters (``sizes``: element counts in
    ``model.parameters()`` order), closing a bucket once it holds ``bucket_bytes`` or more; the
    last bucket holds what is left of the first parameters. This package always passes
    ``bucket_cap_mb`` (``parallel.ddp.wrap_ddp``), so the first bucket has the same cap (torch
    caps it at 1 MiB only when ``bucket_cap_mb`` is left unset: ``_BucketCapacityConfig`` in
    ``torch/nn/parallel/distributed.py``). A model under one cap is one bucket: share 1."""
    total = sum(sizes) * FP32
    if not total:
        return 0.0
    filled, closed = 0.0, 0.0
    for size in reversed(sizes):
        filled += size * FP32
        if filled >= bucket_bytes:
            filled, closed = 0.0, filled
    return (filled or closed) / total


def estimate(
    settings: CompressionSettings,
    sizes: Sequence[int],
    topo: Topology,
    shapes: Sequence[tuple[int, ...]] = (),
    bucket_bytes: float = DDP_BUCKET_BYTES,
) -> CommEstimate:
    """Wire bytes and link time of one step of ``settings`` for parameters of ``sizes`` (element
    counts in ``model.parameters()`` order; ``shapes``, when given, count PowerSGD's factors
    exactly), with DDP buckets of ``bucket_bytes``."""
    collective, payload, value = hook_payload(settings, sizes, shapes)
    per_node, nodes = topo.per_node, topo.nodes
    if settings.scope == "inter-node" and nodes > 1 and per_node > 1:
        fp32_payload = payload / value * FP32
        inside = wire_bytes("reduce_scatter", fp32_payload, per_node)
        inside += wire_bytes("all_gather", fp32_payload / per_node, per_node)
        between = wire_bytes("all_reduce", payload / per_node, nodes)
        uplink = between * per_node
        seconds = inside * 8 / topo.intra_bits_per_s + uplink * 8 / topo.inter_bits_per_s
        return CommEstimate(inside + between, uplink, seconds, overlaps=False)
    comm = _global(collective, payload, topo, overlaps=hook_overlaps(settings))
    if not comm.overlaps:
        return comm
    return replace(comm, exposed_s=comm.seconds * last_bucket_share(sizes, bucket_bytes))


def _global(collective: str, payload: float, topo: Topology, overlaps: bool) -> CommEstimate:
    """One ``collective`` of ``payload`` bytes per rank over all ranks (ring model): the slowest
    link, the uplink between nodes when there are several, carries all of it."""
    wire = wire_bytes(collective, payload, topo.world_size)
    slowest = topo.inter_bits_per_s if topo.nodes > 1 else topo.intra_bits_per_s
    uplink = wire if topo.nodes > 1 else 0.0
    return CommEstimate(wire, uplink, wire * 8 / slowest, overlaps=overlaps)


def demo_estimate(
    shapes: Sequence[tuple[int, ...]],
    topk: int,
    tile: int,
    value_dtype: torch.dtype,
    topo: Topology,
    node_aware: bool = False,
    overlap: bool = False,
) -> CommEstimate:
    """DeMo's (``--optimizer demo``) step: one all-gather over all ranks of every rank's top-k
    (position, value) pairs per tile of the trained parameters of ``shapes``
    (:func:`~torchrun_ddp.compression.wire.demo_payload_bytes`), run by the optimizer after
    backward, so it never overlaps backward. Peng, Quesnelle & Kingma 2024, arXiv:2411.19870.

    ``node_aware`` (``--compression-scope inter-node``, ``optim.exchange``): an fp32
    all-reduce of the gradients and an all-gather of the ``N`` nodes' messages inside the node
    (intra-node links), and across nodes one all-gather per local rank of its ``1 / L`` share,
    so the uplink carries ``(N - 1)`` whole messages. ``overlap`` (``--overlap-exchange``): the
    exchange runs during the next step's forward and backward."""
    payload = demo_payload_bytes(shapes, topk, tile, value_dtype)
    comm = _global("all_gather", payload, topo, overlaps=False)
    if node_aware and topo.nodes > 1 and topo.per_node > 1:
        comm = _node_aware_demo(payload, sum(map(math.prod, shapes)), topo)
    if overlap:
        inside = comm.seconds - comm.uplink_bytes * 8 / topo.inter_bits_per_s if node_aware else 0
        return replace(comm, overlaps=True, hides_behind=1.0, exposed_s=max(0.0, inside))
    return replace(comm, waits="in the optimizer step")


def _node_aware_demo(payload: float, numel: int, topo: Topology) -> CommEstimate:
    """Node-aware DeMo's collectives (see :func:`demo_estimate`), bandwidth model: the fp32
    all-reduce of ``numel`` gradients and the sharing of the ``payload``-byte messages inside
    the node, one all-gather of a ``1 / L`` share among the nodes."""
    per_node, nodes = topo.per_node, topo.nodes
    inside = wire_bytes("all_reduce", numel * FP32, per_node)
    inside += wire_bytes("all_gather", nodes * payload / per_node, per_node)
    between = wire_bytes("all_gather", payload / per_node, nodes)
    uplink = between * per_node
    seconds = inside * 8 / topo.intra_bits_per_s + uplink * 8 / topo.inter_bits_per_s
    return CommEstimate(inside + between, uplink, seconds, overlaps=False)


def local_update_estimates(
    collective: str,
    payload: float,
    local_steps: int,
    topo: Topology,
    node_aware_numel: int = 0,
    sync_delay: int = 0,
) -> tuple[CommEstimate, CommEstimate]:
    """DiLoCo's or SparseLoCo's sync (``--optimizer diloco|sparseloco``): one ``collective``
    (all-reduce of the pseudo-gradient, or all-gather of each rank's top-k message) of
    ``payload`` bytes per rank, once every ``local_steps`` optimizer steps, run in the optimizer
    step (it never overlaps backward). Returns (one sync, its share of one step: every figure
    divided by ``local_steps``). Douillard et al. 2023, arXiv:2311.08105; Sarfi et al. 2025,
    arXiv:2508.15706.

    ``node_aware_numel`` (SparseLoCo with ``--compression-scope inter-node``, the trained
    parameter count): one replica per node, whose ranks all-reduce their gradients in fp32 inside
    the node every step; the sync sends one message per local-rank share over the uplinks
    (``N - 1`` whole messages) and shares the gathered ones inside the node.

    ``sync_delay`` (``tau``, ``--overlap-exchange``): the sync's exchange runs during the next
    ``tau`` steps' compute and only what outlasts them waits, in the step that applies it, so a
    step takes ``compute + max(0, sync - tau x compute) / H`` on average (``hides_behind`` =
    ``tau / H`` of a step; node-aware, the sharing inside the node and the per-step all-reduce
    never hide)."""
    sync = _global(collective, payload, topo, overlaps=False)
    every_step = CommEstimate(0.0, 0.0, 0.0, overlaps=False)
    node_aware = bool(node_aware_numel) and topo.nodes > 1 and topo.per_node > 1
    if node_aware:
        sync = _node_aware_demo(payload, 0, topo)
        every_step = _node_aware_demo(0.0, node_aware_numel, topo)
    sync = replace(sync, waits=f"in the optimizer step, every {local_steps} steps")
    per_step = replace(
        sync,
        wire_bytes=sync.wire_bytes / local_steps + every_step.wire_bytes,
        uplink_bytes=sync.uplink_bytes / local_steps,
        seconds=sync.seconds / local_steps + every_step.seconds,
    )
    if not sync_delay:
        return sync, per_step
    uplink_s = sync.uplink_bytes * 8 / topo.inter_bits_per_s
    inside = max(0.0, sync.seconds - uplink_s) if node_aware else 0.0
    sync = replace(sync, overlaps=True, hides_behind=float(sync_delay), exposed_s=inside)
    per_step = replace(
        per_step,
        overlaps=True,
        hides_behind=sync_delay / local_steps,
        exposed_s=inside / local_steps + every_step.seconds,
    )
    return sync, per_step


def predicted_step_seconds(comm: CommEstimate, compute_s: float) -> float:
    """Step time: forward plus backward (``compute_s``, backward taken as 2/3 of it, Kaplan et
    al. 2020) and the communication that does not hide behind backward. A hook that returns
    early overlaps backward: ``forward + max(backward, comm)``; a delayed update overlaps the
    whole next step (``comm.hides_behind`` = 1): ``max(compute, comm)``, plus what never hides
    (``comm.exposed_s``); one that waits adds it whole."""
    hidden = compute_s * comm.hides_behind
    if comm.overlaps:
        hideable = comm.seconds - comm.exposed_s
        return compute_s - hidden + max(hidden, hideable) + comm.exposed_s
    return compute_s + comm.seconds


def reference_methods(block_size: int) -> list[CompressionSettings]:
    """The methods ``--dry-run`` compares with the run's own: dense, 16-bit, low-pass and
    rotating ``dct`` at 8x (ratio 0.25, bf16 values; global and node-aware), ``dct`` ratio
    0.125, ``dct-topk`` k 8 with bf16 values and PowerSGD rank 4."""
    dct = CompressionSettings("dct", ratio=0.25, block_size=block_size, topk_value_dtype="bfloat16")
    return [
        CompressionSettings("none"),
        CompressionSettings("bf16"),
        CompressionSettings("bf16", scope="inter-node"),
        dct,
        CompressionSettings(**{**vars(dct), "scope": "inter-node"}),
        CompressionSettings(**{**vars(dct), "selection": "rotating"}),
        CompressionSettings("dct", ratio=0.125, block_size=block_size),
        CompressionSettings("dct-topk", topk=8, block_size=block_size, topk_value_dtype="bfloat16"),
        CompressionSettings("powersgd", powersgd_rank=4),
    ]


def _ratio(dense: float, sent: float) -> str:
    return f"{dense / sent:.3g}x" if sent else "-"


def hook_rows(
    methods: Sequence[CompressionSettings],
    sizes: Sequence[int],
    topo: Topology,
    shapes: Sequence[tuple[int, ...]] = (),
    bucket_bytes: float = DDP_BUCKET_BYTES,
    skip: Sequence[str] = (),
) -> list[tuple[str, CommEstimate]]:
    """(label, :func:`estimate`) of each comm hook of ``methods``, each label once, leaving out
    those in ``skip`` (rows the table already has). ``shapes`` and ``bucket_bytes`` as for
    :func:`estimate`."""
    rows: list[tuple[str, CommEstimate]] = []
    for settings in methods:
        name = label(settings)
        if name not in skip and name not in (row for row, _ in rows):
            rows.append((name, estimate(settings, sizes, topo, shapes, bucket_bytes)))
    return rows


@dataclass(frozen=True)
class CommSection:
    """A mode's part of the communication plan: ``lines`` above the table, its ``rows``
    (name, estimate per optimizer step), the ``dense`` fp32 all-reduce the ratio columns
    compare with, and ``run``: this run's communication per optimizer step (``run_name``: the
    rows it sums), the figure the plan's headline gives."""

    lines: list[str]
    rows: list[tuple[str, CommEstimate]]
    dense: CommEstimate
    run: CommEstimate
    run_name: str


def combined(first: CommEstimate, second: CommEstimate) -> CommEstimate:
    """Two exchanges of one step one after the other (FSDP's within its groups, then the
    replicas'): bytes and seconds added."""
    return replace(
        first,
        wire_bytes=first.wire_bytes + second.wire_bytes,
        uplink_bytes=first.uplink_bytes + second.uplink_bytes,
        seconds=first.seconds + second.seconds,
        overlaps=first.overlaps and second.overlaps,
    )


def run_line(section: CommSection, topo: Topology) -> str:
    """The plan's one cross-node figure: this run's bytes per optimizer step (a sync's share of
    a step where the method syncs every H steps, as its row says) per rank and through a
    node's uplink, the rows it sums, and their link time."""
    run = section.run
    where = (
        f"{run.uplink_bytes / 1e6:.4g} MB through each node's uplink (the table's uplink column)"
        if topo.nodes > 1
        else "nothing crosses nodes (one node)"
    )
    return (
        "this run, per optimizer step: "
        f"{run.wire_bytes / 1e6:.4g} MB sent per rank, {where}; {run.seconds:.4g} s on the "
        f"links ({section.run_name})"
    )


def communication_table(
    rows: Sequence[tuple[str, CommEstimate]], dense: CommEstimate, compute_s: float
) -> str:
    """Markdown table, one row per (name, estimate) of ``rows``: wire bytes per rank per step,
    uplink bytes, ratio against ``dense`` (a dense fp32 ring all-reduce at this world size),
    link time, whether it hides behind backward (``compute_s * 2 / 3``) and the predicted step
    time. Two ratios against ``dense``: of the wire bytes on all links, and of the bytes over a
    node's uplink (``-`` on one node), the one that matters on slow links between nodes."""
    lines = [
        "| method | wire MB/rank/step | uplink MB/step | ratio (wire) | ratio (uplink) | comm s "
        "| hides behind backward | step s |",
        "|---|---:|---:|---:|---:|---:|---|---:|",
    ]
    lines += [_table_row(name, comm, dense, compute_s) for name, comm in rows]
    return "\n".join(lines)


def _table_row(name: str, comm: CommEstimate, dense: CommEstimate, compute_s: float) -> str:
    hides = "yes" if comm.seconds <= compute_s * comm.hides_behind else "no"
    if not comm.overlaps:
        hides = f"no (waits {comm.waits})"
    return (
        f"| {name} | {comm.wire_bytes / 1e6:.4g} | {comm.uplink_bytes / 1e6:.4g} "
        f"| {dense.wire_bytes / max(comm.wire_bytes, 1.0):.3g}x "
        f"| {_ratio(dense.uplink_bytes, comm.uplink_bytes)} | {comm.seconds:.4g} "
        f"| {hides} | {predicted_step_seconds(comm, compute_s):.4g} |"
    )


__all__ = [
    "CommEstimate",
    "CommSection",
    "Topology",
    "combined",
    "communication_table",
    "demo_estimate",
    "estimate",
    "hook_rows",
    "label",
    "local_update_estimates",
    "predicted_step_seconds",
    "reference_methods",
    "run_line",
    "state_bytes",
]
