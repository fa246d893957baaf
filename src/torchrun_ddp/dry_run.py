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
import functools
import logging
import math
from dataclasses import dataclass

import torch
from transformers import PretrainedConfig

from torchrun_ddp.compression import compression_settings
from torchrun_ddp.config import TrainConfig
from torchrun_ddp.distributed import DistEnv
from torchrun_ddp.errors import UserError
from torchrun_ddp.methods import MemoryRow, Method, method_for
from torchrun_ddp.metrics.peaks import gpu_peak_flops, measure_cpu_peak_flops
from torchrun_ddp.model import PRECISION_DTYPES, load_model_config
from torchrun_ddp.plan.architecture import llama2_7b_config, missing_sizes
from torchrun_ddp.plan.checkpoint import (
    checkpoint_sizes,
    checkpoint_table,
    shared_checkpoint_table,
)
from torchrun_ddp.plan.communication import (
    CommEstimate,
    Topology,
    communication_table,
    run_line,
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
    data: DataCount | None = None,
    model_config: PretrainedConfig | None = None,
    method: Method | None = None,
) -> str:
    """The memory and FLOP plan of this run, as text; nothing is allocated or downloaded.

    ``model_config``: the model's, else ``plan_model_config``'s. Device memory is
    --device-memory-gib, else the visible GPU's, else 80 GiB. ``data``: what was counted of the
    training data (``inputs.planned_data``; nothing when None), for the run length.
    ``method``: the run's (``method_for(config)`` when None). Raises UserError for a setting
    the planned mesh refuses (``DataParallel.check_mesh``).
    """
    model_config = model_config or plan_model_config(config)
    config = launched_cluster(config, env)
    memory = config.device_memory_gib or visible_device_gib() or 80.0
    method = method or method_for(config)
    world = config.plan_world_size or env.world_size
    run_mode(config, world).check_mesh(config)  # on the planned mesh, as a start on its ranks
    plan, hints = plan_run(config, model_config, world, memory, method=method)
    peak = plan_peak(config)
    adapters = sum(plan.settings.adapter_sizes)
    trained = f" (+ {adapters:,} LoRA adapter parameters, trained)" if adapters else ""
    lines = [
        f"model {config.model}: {plan.parameters:,} parameters{trained}, "
        f"{plan.flops_per_token:.4g} training FLOPs per token at seq length {config.seq_length}",
        run_length(config, world, data or DataCount(), plan.flops_per_token, peak),
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
    lines.append(communication_plan(config, env, shapes, plan.flops_per_token, method, peak))
    matrices = trained_matrix_shapes(config, model_config)
    lines.append(checkpoint_plan(config, plan, (shapes, matrices), method))
    return "\n".join(lines)


def launched_cluster(config: TrainConfig, env: DistEnv) -> TrainConfig:
    """``config`` planned on the cluster it was launched on: under torchrun (WORLD_SIZE above
    1) without --plan-world-size, a node is LOCAL_WORLD_SIZE ranks, as a real start's mesh
    has it, not --plan-gpus-per-node."""
    if config.plan_world_size or env.world_size == 1:
        return config
    return dataclasses.replace(config, plan_gpus_per_node=env.local_world_size)


@dataclass(frozen=True)
class DataCount:
    """What a dry run counted of the local training data (``inputs.planned_data``): ``tokens``
    of one pass, and the ``windows`` each planned rank packs over --epochs (in rank order, up to
    --max-steps' windows); None where not counted (hub streaming, large files, a hub
    tokenizer)."""

    tokens: int | None = None
    windows: tuple[int, ...] | None = None


def planned_steps(config: TrainConfig, world_size: int, data: DataCount) -> int | None:
    """Optimizer steps the run takes: --max-steps, or fewer where the data ends first, as the
    loop ends it (``data_steps``); None where neither is known (hub streaming without
    --max-steps)."""
    limit = config.max_steps if config.max_steps > 0 else None
    ends = data_steps(config, world_size, data)
    if ends is None or (limit is not None and limit <= ends):
        return limit
    return ends


def data_steps(config: TrainConfig, world_size: int, data: DataCount) -> int | None:
    """The steps after which the loop finds the data ended, before --max-steps: each rank's
    full steps (``batch_size x accumulation_steps`` windows; a partial micro-batch or step is
    dropped), the fewest of any rank, cut to a multiple of --log-every (ranks agree on the end
    of data at log steps, and the steps read beyond the last one are not trained). Without
    counted windows: --epochs passes of the counted tokens over the step's tokens, an upper
    bound; None where nothing is counted."""
    per_step = config.batch_size * config.accumulation_steps
    if data.windows is not None:
        fewest = min(data.windows) // per_step
        return fewest - fewest % config.log_every
    if data.tokens is None:
        return None
    return data.tokens * config.epochs // (world_size * per_step * config.seq_length)


def run_length(
    config: TrainConfig,
    world_size: int,
    data: DataCount,
    flops_per_token: float,
    peak: tuple[float, str] = (400e12, "--plan-tflops"),
) -> str:
    """One line: the run's optimizer steps (``planned_steps``), tokens, passes over the
    training data, and its compute time at ``peak`` (FLOP/s per rank and where the figure
    comes from: ``plan_peak``; communication not included: see the communication plan's step
    times)."""
    steps = planned_steps(config, world_size, data)
    if steps is None:
        return (
            "run length: unknown (--max-steps -1 streams the hub dataset to its end); set "
            "--max-steps for a planned length"
        )
    per_rank = config.batch_size * config.seq_length * config.accumulation_steps
    tokens = steps * per_rank * world_size
    seconds = steps * per_rank * flops_per_token / peak[0]
    epochs = (
        f", {tokens / data.tokens:.3g} epochs of the training data's {data.tokens:,} tokens"
        if data.tokens
        else ""
    )
    return (
        f"run length: {steps:,} optimizer steps ({steps_reason(config, steps, data)}) x "
        f"{per_rank * world_size:,} tokens = {tokens:,} tokens{epochs}; compute "
        f"{duration(seconds)} at {peak[0] / 1e12:.3g} TFLOP/s per rank ({peak[1]}; "
        "communication not included)"
    )


def steps_reason(config: TrainConfig, steps: int, data: DataCount) -> str:
    """Why the run ends after ``steps``: --max-steps, or where the data ends (``data_steps``:
    the windows counted per rank, or the token count's upper bound), or that it trains none."""
    if steps == config.max_steps:
        return "--max-steps"
    if data.windows is None:
        return f"--epochs {config.epochs} of the tokens, at most"
    if not steps:
        return (
            f"the data ends before step {config.log_every}, the first log step: a real start "
            "refuses it; add documents, raise --epochs, or lower --log-every or --batch-size"
        )
    return (
        f"the data ends: --epochs {config.epochs} give the rank with the fewest "
        f"{min(data.windows):,} windows, cut to whole steps and to a multiple of --log-every "
        f"{config.log_every}"
    )


GPU_FALLBACK_FLOPS = 400e12
"""The compute rate a plan assumes on a GPU with no data-sheet peak (``metrics.GPU_PEAK_FLOPS``)
and no --peak-tflops or --plan-tflops; the plan says it is assumed."""


def plan_peak(config: TrainConfig) -> tuple[float, str]:
    """FLOP/s per rank the plan's compute time uses, and where it comes from: --plan-tflops,
    else --peak-tflops, else the peak MFU divides by on the device the run would train on
    (``metrics.device_peak_flops``: the visible GPU's data-sheet dense bf16 peak, or this CPU's
    measured matmul rate in the compute dtype, measured once per process)."""
    if config.plan_tflops:
        return config.plan_tflops * 1e12, "--plan-tflops"
    if config.peak_tflops:
        return config.peak_tflops * 1e12, "--peak-tflops"
    if run_device_type(config) == "cuda":
        peak, source = gpu_peak_flops(torch.cuda.get_device_name(0))
        if peak:
            return peak, source
        return GPU_FALLBACK_FLOPS, f"{source}; assumed: --peak-tflops sets it"
    dtype = torch.float32 if config.precision == "fp32" else torch.bfloat16
    name = str(dtype).removeprefix("torch.")
    return _cpu_peak(dtype), f"measured {name} matmul on this CPU; --peak-tflops for another"


@functools.cache
def _cpu_peak(dtype: torch.dtype) -> float:
    """``metrics.measure_cpu_peak_flops`` once per process and dtype."""
    return measure_cpu_peak_flops(dtype=dtype)


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
    those among them that are hidden-layer matrices (``planning.trained_matrix_shapes``). A
    mode that refuses a folder per node (fsdp) gets the shared folder's rows instead."""
    shapes, matrices = layout
    world = plan.settings.world_size
    per_node = min(config.plan_gpus_per_node, world)
    trained = sum(math.prod(shape) for shape in shapes)
    hook, _ = state_bytes(compression_settings(config), [trained], world, 0)  # 0: no hook
    weight = PRECISION_DTYPES[config.precision].itemsize  # saved moments: the weights' dtype
    sizes = dataclasses.replace(
        plan_sizes(config, shapes, plan.parameters, world, matrices), weight_bytes=weight
    )
    optimizer, mode = method.checkpoint_bytes(sizes), run_mode(config, world)
    heal = 0
    if config.fault_tolerance == "sites":  # a live site sends each rank its shards
        shards = dataclasses.replace(sizes, shapes=tuple(mode.shard_shapes(sizes.shapes)))
        heal = method.heal_bytes(shards, mode.shape.shard)
    replicated, per_rank = optimizer.replicated, optimizer.per_rank + hook
    sizes = checkpoint_sizes(config, plan.parameters, trained, replicated, per_rank)
    if not mode.accepts_node_folders(config):
        return shared_checkpoint_table(sizes, world, mode.name)
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
    peak: tuple[float, str] | None = None,
) -> str:
    """Wire bytes and predicted times per step of this run's method (its --compression, or
    DeMo's all-gather under --optimizer demo) and the reference methods (``plan.communication``)
    for the trained parameters of ``shapes``, for --plan-world-size ranks (else WORLD_SIZE),
    --plan-gpus-per-node and the --plan-*-gbit links; compute at ``peak`` per rank
    (``plan_peak`` when None); the rows the run's mode runs (``DataParallel.communication``).
    ``method``: the run's (``method_for(config)`` when None)."""
    world = config.plan_world_size or env.world_size
    per_node = min(config.plan_gpus_per_node, world)
    topo = Topology(
        world, per_node, config.plan_intra_node_gbit * 1e9, config.plan_inter_node_gbit * 1e9
    )
    tokens = config.batch_size * config.seq_length * config.accumulation_steps
    flops, source = peak or plan_peak(config)
    compute_s = tokens * flops_per_token / flops
    method = method or method_for(config)
    section = run_mode(config, world).communication(config, shapes, topo, method)
    header = (
        f"communication plan: {world} ranks = {topo.nodes} node(s) x {per_node}, links "
        f"{config.plan_intra_node_gbit:g} Gbit/s in a node, {config.plan_inter_node_gbit:g} "
        f"Gbit/s between nodes; compute {compute_s:.4g} s per step ({tokens} tokens per rank at "
        f"{flops / 1e12:.3g} TFLOP/s, {source}); first rows: this run's (diloco and "
        "sparseloco: one sync, then its share of a step), then the others for comparison"
    )
    table = communication_table(section.rows, section.dense, compute_s)
    return "\n".join([header, *section.lines, run_line(section, topo), table])


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
