"""The --dry-run plan of LLaMA-2-7B full fine-tuning under --data-parallel ddp, fsdp and hsdp, for
each method on hsdp's replicate dimension, at the cluster shapes of issue 44: per-rank memory
and the wire bytes a rank sends per step, within its node and across the nodes.

Nothing trains: every row is ``planning.plan_run`` (memory) and
``parallel.fsdp.sharded_traffic_bytes`` / ``Method.step_estimate`` (traffic) of
``configs/llama2_7b.toml`` with the row's flags, as ``train.py --dry-run`` prints them. ``ddp``
rows: the whole exchange crosses the nodes (the all-reduce's ring, or the method's own
exchange), so "within a node" is blank there.

Usage (from the repository root)::

    uv run python benchmarks/sharded_plan.py
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from transformers import PretrainedConfig  # noqa: E402

from torchrun_ddp.config import TrainConfig  # noqa: E402
from torchrun_ddp.config_io import parse_config  # noqa: E402
from torchrun_ddp.methods import method_for  # noqa: E402
from torchrun_ddp.parallel.fsdp import FSDP  # noqa: E402
from torchrun_ddp.parallel.traffic import sharded_traffic_bytes  # noqa: E402
from torchrun_ddp.plan.architecture import llama2_7b_config  # noqa: E402
from torchrun_ddp.plan.communication import Topology  # noqa: E402
from torchrun_ddp.planning import plan_run, run_mode, trained_shapes  # noqa: E402

CLUSTERS = ((1, 8, 24.0), (1, 8, 40.0), (2, 8, 40.0), (8, 8, 40.0))
"""(nodes, GPUs per node, GiB per GPU)."""

DCT = (
    "--compression", "dct", "--compression-ratio", "0.25", "--compression-value-dtype",
    "bfloat16", "--compression-selection", "rotating",
)  # fmt: skip
"""The comm hook of the dct rows: 0.25 of the coefficients in bf16, rotating."""

METHODS = {
    "ddp, AdamW + dct 0.25 bf16 (ZeRO-1)": ("--zero1", "true", *DCT),
    "fsdp, AdamW": ("--data-parallel", "fsdp", "--compression", "none"),
    "hsdp, AdamW (FSDP's all-reduce)": ("--data-parallel", "hsdp", "--compression", "none"),
    "hsdp, AdamW + dct 0.25 bf16": ("--data-parallel", "hsdp", *DCT),
    "hsdp, DeMo": ("--data-parallel", "hsdp", "--optimizer", "demo", "--compression", "none"),
    "hsdp, DiLoCo H 500": ("--data-parallel", "hsdp", "--optimizer", "diloco",
                           "--compression", "none"),
    "hsdp, SparseLoCo H 15": ("--data-parallel", "hsdp", "--optimizer", "sparseloco",
                              "--compression", "none", "--local-steps", "15"),
}  # fmt: skip
"""Row label -> flags on top of the config."""

BASE = ("--config", str(REPO / "configs" / "llama2_7b.toml"), "--zero1", "false")


def _traffic_mb(
    config: TrainConfig, model: PretrainedConfig, nodes: int, per_node: int
) -> tuple[str, str]:
    """(MB a rank sends per step within its node, across the nodes). A ring that spans nodes
    (DDP's all-reduce, fsdp's collectives on several nodes) counts as across."""
    shapes = trained_shapes(config, model)
    world = nodes * per_node
    topo = Topology(world, per_node, config.plan_intra_node_gbit * 1e9, 1e11)
    method = method_for(config)
    mode = run_mode(config, world)
    if not isinstance(mode, FSDP):  # ddp: the method's all-reduce is the traffic
        estimate = method.step_estimate(shapes, topo, config.ddp_bucket_cap_mb * 2**20)
        return ("-", f"{estimate.wire_bytes / 1e6:,.0f}") if nodes > 1 else (
            f"{estimate.wire_bytes / 1e6:,.0f}", "0")  # fmt: skip
    traffic = sharded_traffic_bytes(mode, config, shapes, topo, method)
    if traffic.shard > per_node:  # fsdp over several nodes: its rings cross them
        return "-", f"{traffic.within / 1e6:,.0f}"
    return f"{traffic.within / 1e6:,.0f}", f"{traffic.across / 1e6:,.1f}"


def rows() -> list[str]:
    """One Markdown row per cluster shape and method."""
    out, model = [], llama2_7b_config()
    for nodes, per_node, gib in CLUSTERS:
        world = nodes * per_node
        for label, flags in METHODS.items():
            argv = [*BASE, *flags, "--device-memory-gib", str(gib)]
            argv += ["--plan-gpus-per-node", str(per_node)]
            config = parse_config(argv)
            if config.data_parallel == "hsdp" and nodes == 1 and "FSDP" not in label:
                continue  # one node is one replica: nothing to exchange across
            plan, _ = plan_run(config, model, world, gib)
            within, across = _traffic_mb(config, model, nodes, per_node)
            verdict = "fits" if plan.fits else f"short {-plan.headroom / 2**30:.1f} GiB"
            shape = f"{nodes} x {per_node} x {gib:g} GiB"
            total = plan.total / 2**30
            out.append(f"| {shape} | {label} | {total:.1f} | {verdict} | {within} | {across} |")
    return out


def main() -> None:
    """Print the table."""
    print("| nodes x GPUs x memory | mode, method | GiB per rank | verdict | MB/rank/step "
          "within a node | MB/rank/step across nodes |")  # fmt: skip
    print("|---|---|---:|---|---:|---:|")
    for row in rows():
        print(row)


if __name__ == "__main__":
    main()
