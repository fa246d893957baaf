"""The checkpoint plan of ``--dry-run``: what one node's folder holds when every node keeps its
own (``--checkpoint-storage node-local``, or ``auto`` across sites), what buddy copies send
over the uplink at each checkpoint, and what a node whose disk was wiped gets from a peer, in
bytes and in seconds at ``--plan-inter-node-gbit``.

Sizes follow what ``training_state`` saves: the replicated state (DCP) holds the model and, for
AdamW without ZeRO-1, its two moments; DiLoCo/SparseLoCo add their synced fp32 copy (and
DiLoCo's outer momentum). Each rank's own files hold its data position and RNGs (kilobytes),
the comm hook's error feedback, and the optimizer state that differs by rank: a ZeRO-1 shard of
the moments, DeMo's fp32 momentum, or DiLoCo's/SparseLoCo's inner moments, SparseLoCo's fp32
error feedback and, inside a window, the local parameters (counted: the largest case). A frozen
LoRA base is not saved (it is rebuilt from --model).
"""

from __future__ import annotations

from dataclasses import dataclass

from torchrun_ddp.config import TrainConfig
from torchrun_ddp.model import PRECISION_DTYPES

FP32 = 4
GIB = 2**30


@dataclass(frozen=True)
class CheckpointSizes:
    """Bytes of one checkpoint: ``replicated`` (in every folder) and ``per_rank`` (one rank's
    own files)."""

    replicated: int
    per_rank: int


def checkpoint_sizes(
    config: TrainConfig, parameters: int, trained: int, optimizer: int, per_rank: int
) -> CheckpointSizes:
    """The bytes a checkpoint of this run takes: ``parameters`` in the model, ``trained`` of
    them trained (the adapters under LoRA), ``optimizer`` bytes of replicated optimizer state and
    ``per_rank`` bytes of each rank's own (``methods.Method.checkpoint_bytes``, plus the comm
    hook's persistent state: ``communication.state_bytes``)."""
    weight = PRECISION_DTYPES[config.precision].itemsize
    model = trained * FP32 if config.peft != "none" else parameters * weight
    return CheckpointSizes(model + optimizer, per_rank)


def checkpoint_table(
    sizes: CheckpointSizes, config: TrainConfig, world: int, per_node: int, heal: int = 0
) -> str:
    """The per-node rows as a Markdown table (GiB, and seconds at --plan-inter-node-gbit);
    ``heal`` > 0 (``--fault-tolerance sites``): the bytes one rank of a healing site receives
    from a live one (its synced fp32 parameters and outer momentum, or under hsdp its shard of
    them), a row for a node's ranks sharing its link."""
    nodes = max(1, world // per_node)
    copies = min(config.buddy_copies, nodes - 1)
    link = config.plan_inter_node_gbit * 1e9 / 8  # bytes per second
    folder = sizes.replicated + per_node * (1 + copies) * sizes.per_rank
    sent = per_node * copies * sizes.per_rank
    rows = [
        ("replicated state, in every folder", sizes.replicated, None),
        ("one rank's own state", sizes.per_rank, None),
        (f"a node's folder: replicated + {per_node} x {1 + copies} ranks' own", folder, None),
        ("buddy copies a node sends per checkpoint", sent, sent / link),
        ("a wiped node's recovery from a peer", folder, folder / link),
    ]
    if heal:
        name = f"a site's healing from a live one, per node ({per_node} ranks' synced state)"
        rows.append((name, per_node * heal, per_node * heal / link))
    title = (
        f"checkpoints with a folder per node: {world} ranks = {nodes} node(s) x {per_node}, "
        f"--buddy-copies {config.buddy_copies} ({copies} kept), links of "
        f"{config.plan_inter_node_gbit:g} Gbit/s between nodes"
    )
    lines = [f"| {title} | GiB | seconds |", "|---|---:|---:|"]
    for name, nbytes, seconds in rows:
        time = "" if seconds is None else f"{seconds:.1f}"
        lines.append(f"| {name} | {nbytes / GIB:.2f} | {time} |")
    return "\n".join(lines)


def shared_checkpoint_table(sizes: CheckpointSizes, world: int, mode: str) -> str:
    """The checkpoint plan where the mode keeps one shared folder only (fsdp: a folder per node
    would hold part of a shard group): the whole checkpoint, each of ``world`` ranks writing its
    1/W share of the sharded state and its own files, as a Markdown table in GiB."""
    whole = sizes.replicated + world * sizes.per_rank
    title = (
        f"checkpoints in one shared folder (--data-parallel {mode} refuses a folder per node): "
        f"{world} ranks"
    )
    rows = [
        ("a checkpoint: model and optimizer state, sharded, and the ranks' own", whole),
        ("one rank writes: its shard and its own state", sizes.replicated / world + sizes.per_rank),
    ]
    lines = [f"| {title} | GiB |", "|---|---:|"]
    lines += [f"| {name} | {nbytes / GIB:.2f} |" for name, nbytes in rows]
    return "\n".join(lines)
