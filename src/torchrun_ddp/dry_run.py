"""Before a run: the per-rank memory and FLOP plan, the communication plan (--dry-run), and the
fit check that refuses a run that would not fit the device.

Composes ``planning`` (the run's memory plan: its mode's and method's rows, and the changes that
make it fit) with the ``plan`` package's other calculators: ``communication`` (wire bytes and
link time), ``checkpoint`` (a node's folder), and the training method's own rows (``methods``:
its memory, communication and checkpoint bytes) and the mode's traffic (``parallel``). The method
is built once per dry run. Nothing is allocated or downloaded.
"""

from __future__ import annotations

import dataclasses
import logging
import math

import torch
from transformers import PretrainedConfig

from torchrun_ddp.compression import compression_settings
from torchrun_ddp.config import TrainConfig
from torchrun_ddp.distributed import DistEnv
from torchrun_ddp.errors import UserError
from torchrun_ddp.methods import MemoryRow, Method, method_for
from torchrun_ddp.model import PRECISION_DTYPES, load_model_config
from torchrun_ddp.plan.architecture import llama2_7b_config, missing_sizes
from torchrun_ddp.plan.checkpoint import checkpoint_sizes, checkpoint_table
from torchrun_ddp.plan.communication import (
    CommEstimate,
    Topology,
    communication_table,
    reference_methods,
    state_bytes,
)
from torchrun_ddp.plan.memory import MemoryPlan
from torchrun_ddp.planning import (
    local_update_memory,
    plan_run,
    plan_sizes,
    run_mode,
    trained_matrix_shapes,
    trained_shapes,
)

log = logging.getLogger("torchrun_ddp")


def plan_model_config(config: TrainConfig) -> PretrainedConfig:
    """The model config a plan uses: LLaMA-2-7B's from the facts the package carries (no hub
    access or token needed), other models' loaded as usual (UserError where that fails)."""
    if config.model == "meta-llama/Llama-2-7b-hf":
        return llama2_7b_config()
    return load_model_config(config.model)


def dry_run(
    config: TrainConfig,
    env: DistEnv,
    data_tokens: int | None = None,
    model_config: PretrainedConfig | None = None,
    method: Method | None = None,
) -> str:
    """The memory and FLOP plan of this run, as text; nothing is allocated or downloaded.

    ``model_config``: the model's, else ``plan_model_config``'s. Device memory is
    --device-memory-gib, else the visible GPU's, else 80 GiB. ``data_tokens``: the tokens of one
    pass over the training data where known (``inputs.check_dry_run_inputs``), for the run length.
    ``method``: the run's (``method_for(config)`` when None).
    """
    model_config = model_config or plan_model_config(config)
    memory = config.device_memory_gib or visible_device_gib() or 80.0
    method = method or method_for(config)
    world = config.plan_world_size or env.world_size
    plan, hints = plan_run(config, model_config, world, memory, method=method)
    adapters = sum(plan.settings.adapter_sizes)
    trained = f" (+ {adapters:,} LoRA adapter parameters, trained)" if adapters else ""
    lines = [
        f"model {config.model}: {plan.parameters:,} parameters{trained}, "
        f"{plan.flops_per_token:.4g} training FLOPs per token at seq length {config.seq_length}",
        run_length(config, plan.settings.world_size, data_tokens, plan.flops_per_token),
        f"plan per rank: {plan.describe()}",
        plan.table(),
    ]
    if hints:
        lines.append("would fit with:")
        lines.extend(f"  {hint}" for hint in hints)
    extra = local_update_memory(config, model_config, plan.settings.world_size, method)
    if extra:
        lines.append(local_update_memory_table(extra, method))
    shapes = trained_shapes(config, model_config)
    lines.append(communication_plan(config, env, shapes, plan.flops_per_token, method))
    matrices = trained_matrix_shapes(config, model_config)
    lines.append(checkpoint_plan(config, plan, (shapes, matrices), method))
    return "\n".join(lines)


def planned_steps(config: TrainConfig, world_size: int, data_tokens: int | None) -> int | None:
    """Optimizer steps the run takes: --max-steps, or the steps --epochs passes over
    ``data_tokens`` fill (whichever ends it first), None where neither is known (hub
    streaming without --max-steps). Packing ends each pass on a whole window per rank, so the
    data's count is an upper bound by at most one step a pass."""
    per_step = world_size * config.batch_size * config.seq_length * config.accumulation_steps
    data_steps = None if data_tokens is None else data_tokens * config.epochs // per_step
    if config.max_steps < 0:
        return data_steps
    return config.max_steps if data_steps is None else min(config.max_steps, data_steps)


def run_length(
    config: TrainConfig, world_size: int, data_tokens: int | None, flops_per_token: float
) -> str:
    """One line: the run's optimizer steps (``planned_steps``), tokens, passes over the
    training data, and its compute time in hours at --plan-tflops per rank (communication not
    included: see the communication plan's step times)."""
    steps = planned_steps(config, world_size, data_tokens)
    if steps is None:
        return (
            "run length: unknown (--max-steps -1 streams the hub dataset to its end); set "
            "--max-steps for a planned length"
        )
    per_rank = config.batch_size * config.seq_length * config.accumulation_steps
    tokens = steps * per_rank * world_size
    seconds = steps * per_rank * flops_per_token / (config.plan_tflops * 1e12)
    why = "--max-steps" if steps == config.max_steps else f"--epochs {config.epochs}"
    data = (
        f", {tokens / data_tokens:.3g} epochs of the training data's {data_tokens:,} tokens"
        if data_tokens
        else ""
    )
    return (
        f"run length: {steps:,} optimizer steps ({why}) x {per_rank * world_size:,} tokens = "
        f"{tokens:,} tokens{data}; compute {duration(seconds)} at {config.plan_tflops:g} "
        "TFLOP/s per rank (communication not included)"
    )


def duration(seconds: float) -> str:
    """``seconds`` in the largest unit that keeps the number above 1: ``42 s``, ``3.5 min``,
    ``2.1 h``, ``4.2 days``."""
    for unit, size in (("days", 86400.0), ("h", 3600.0), ("min", 60.0)):
        if seconds >= size:
            return f"{seconds / size:.3g} {unit}"
    return f"{seconds:.3g} s"


def checkpoint_plan(
    config: TrainConfig,
    plan: MemoryPlan,
    layout: tuple[list[tuple[int, ...]], list[tuple[int, ...]]],
    method: Method,
) -> str:
    """``plan.checkpoint``'s table for this run's world size and --plan-gpus-per-node, with the
    ``method``'s optimizer state; ``layout``: the shapes of the trained parameters and of
    those among them that are hidden-layer matrices (``planning.trained_matrix_shapes``)."""
    shapes, matrices = layout
    world = plan.settings.world_size
    per_node = min(config.plan_gpus_per_node, world)
    trained = sum(math.prod(shape) for shape in shapes)
    hook, _ = state_bytes(compression_settings(config), [trained], world, 0)  # 0: no hook
    weight = PRECISION_DTYPES[config.precision].itemsize  # saved moments: the weights' dtype
    sizes = dataclasses.replace(
        plan_sizes(config, shapes, plan.parameters, world, matrices), weight_bytes=weight
    )
    optimizer = method.checkpoint_bytes(sizes)
    replicated, per_rank = optimizer.replicated, optimizer.per_rank + hook
    sizes = checkpoint_sizes(config, plan.parameters, trained, replicated, per_rank)
    heal = replicated if config.fault_tolerance == "sites" else 0  # what a live site sends
    return checkpoint_table(sizes, config, world, per_node, heal)


def local_update_memory_table(rows: list[MemoryRow], method: Method) -> str:
    """The ``method``'s rows of ``planning.local_update_memory`` as a Markdown table in GiB per
    rank."""
    title = method.describe()
    lines = [f"| {title}: extra memory (in the plan above) | GiB per rank |", "|---|---:|"]
    for row in rows:
        kind = "kept" if row.persistent else "during a sync"
        lines.append(f"| {row.name} ({kind}) | {row.nbytes / 2**30:.2f} |")
    return "\n".join(lines)


def communication_plan(
    config: TrainConfig,
    env: DistEnv,
    shapes: list[tuple[int, ...]],
    flops_per_token: float,
    method: Method | None = None,
) -> str:
    """Wire bytes and predicted times per step of this run's method (its --compression, or
    DeMo's all-gather under --optimizer demo) and the reference methods (``plan.communication``)
    for the trained parameters of ``shapes``, for --plan-world-size ranks (else WORLD_SIZE),
    --plan-gpus-per-node and the --plan-*-gbit links; compute at --plan-tflops per rank; under
    a sharded mode, its own collectives first (``DataParallel.traffic``). ``method``: the run's
    (``method_for(config)`` when None)."""
    world = config.plan_world_size or env.world_size
    per_node = min(config.plan_gpus_per_node, world)
    topo = Topology(
        world, per_node, config.plan_intra_node_gbit * 1e9, config.plan_inter_node_gbit * 1e9
    )
    tokens = config.batch_size * config.seq_length * config.accumulation_steps
    compute_s = tokens * flops_per_token / (config.plan_tflops * 1e12)
    sizes = [math.prod(shape) for shape in shapes]
    method = method or method_for(config)
    methods = [*method.plan_hooks(), *reference_methods(config.compression_block_size)]
    first = method.communication_rows(shapes, topo)
    header = (
        f"communication plan: {world} ranks = {topo.nodes} node(s) x {per_node}, links "
        f"{config.plan_intra_node_gbit:g} Gbit/s in a node, {config.plan_inter_node_gbit:g} "
        f"Gbit/s between nodes; compute {compute_s:.4g} s per step ({tokens} tokens per rank at "
        f"{config.plan_tflops:g} TFLOP/s); first rows: this run's --optimizer (diloco and "
        "sparseloco: one sync, then its share of a step; DeMo k 32 next to them) or --compression"
    )
    bucket = config.ddp_bucket_cap_mb * 2**20
    table = communication_table(methods, sizes, topo, compute_s, first, shapes, bucket)
    traffic = run_mode(config, world).traffic(config, shapes, topo, method)
    return "\n".join([header, *traffic, table])


def run_estimate(
    config: TrainConfig, shapes: list[tuple[int, ...]], topo: Topology, method: Method | None = None
) -> CommEstimate:
    """This run's communication per optimizer step (``Method.step_estimate``: its
    --compression's, DeMo's exchange, or DiLoCo's / SparseLoCo's sync shared over its
    --local-steps; benchmarks compare it with measured step times)."""
    method = method or method_for(config)
    return method.step_estimate(shapes, topo, config.ddp_bucket_cap_mb * 2**20)


def check_fits(
    config: TrainConfig, model_config: PretrainedConfig, env: DistEnv, method: Method | None = None
) -> None:
    """Refuse a run whose memory plan does not fit the device, naming settings that would.

    Checked when the device memory is known: --device-memory-gib, or the visible GPU when the
    run uses CUDA. Raises UserError before any weights are loaded or any process group starts.
    """
    uses_cuda = run_device_type(config) == "cuda"
    memory = config.device_memory_gib or (visible_device_gib() if uses_cuda else 0.0)
    if not memory:
        return
    if missing_sizes(model_config):
        log.warning(
            "no memory plan: the model config lacks %s", ", ".join(missing_sizes(model_config))
        )
        return
    device_type = "cuda" if uses_cuda else "cpu"
    plan, hints = plan_run(config, model_config, env.world_size, memory, device_type, method)
    if plan.fits:
        return
    fix = hints[0] if hints[0].startswith("no combination") else f"it would fit with {hints[0]}"
    raise UserError(
        f"the memory plan needs {plan.total / 2**30:.1f} GiB per rank but the device has "
        f"{memory:g} GiB ({plan.describe()}); {fix} (see --dry-run)"
    )


def run_device_type(config: TrainConfig) -> str:
    """The device type a real start of this run trains on (``distributed.pick_device``): cuda
    unless --device cpu or no GPU is visible."""
    return "cuda" if config.device != "cpu" and torch.cuda.is_available() else "cpu"


def visible_device_gib() -> float:
    """Memory of the visible GPU in GiB, or 0 without one."""
    if not torch.cuda.is_available():
        return 0.0
    return torch.cuda.get_device_properties(0).total_memory / 2**30
