"""Before a run: the per-rank memory and FLOP plan, the communication plan (--dry-run), and the
fit check that refuses a run that would not fit the device.

Composes the ``plan`` package's calculators: ``architecture`` (meta-device model, sizes, FLOPs),
``memory`` (memory rows), ``fit`` (setting changes that fit), ``communication`` (wire bytes and
link time), with ``model``'s LoRA on the meta device and the training method's own rows
(``methods``: its memory, communication and checkpoint bytes). Nothing is allocated or
downloaded.
"""

from __future__ import annotations

import dataclasses
import logging
import math

import torch
from transformers import PretrainedConfig

from torchrun_ddp.compression import ShardedExchange, compression_settings, sharded_step_bytes
from torchrun_ddp.config import TrainConfig
from torchrun_ddp.distributed import DistEnv
from torchrun_ddp.errors import UserError
from torchrun_ddp.methods import MemoryRow, Method, PlanSizes, method_for
from torchrun_ddp.model import (
    PRECISION_DTYPES,
    apply_lora,
    load_model_config,
    lora_settings,
    uses_fused_loss,
)
from torchrun_ddp.plan.architecture import (
    llama2_7b_config,
    matmul_parameter_count,
    meta_model,
    missing_sizes,
    parameter_sizes,
)
from torchrun_ddp.plan.checkpoint import checkpoint_sizes, checkpoint_table
from torchrun_ddp.plan.communication import (
    CommEstimate,
    Topology,
    communication_table,
    reference_methods,
    state_bytes,
)
from torchrun_ddp.plan.fit import suggestions
from torchrun_ddp.plan.memory import MemoryPlan, PlanSettings, plan_memory

log = logging.getLogger("torchrun_ddp")


def plan_settings(
    config: TrainConfig, world_size: int, memory_gib: float, adapter_sizes: tuple[int, ...] = ()
) -> PlanSettings:
    """The memory plan's view of this run's settings, on devices of ``memory_gib`` GiB
    (``adapter_sizes``: the LoRA adapters' element counts under --peft lora)."""
    return PlanSettings(
        world_size=world_size,
        micro_batch=config.batch_size,
        seq_length=config.seq_length,
        precision=config.precision,
        zero1=config.zero1,
        activation_checkpointing=config.activation_checkpointing,
        device_memory_gib=memory_gib,
        ddp_bucket_cap_mb=config.ddp_bucket_cap_mb,
        gradient_as_bucket_view=config.gradient_as_bucket_view and config.data_parallel == "ddp",
        accumulation_steps=config.accumulation_steps,
        fused_adamw=config.adamw_implementation == "fused",
        adapter_sizes=adapter_sizes,
        optimizer=config.optimizer,
        data_parallel=config.data_parallel,
        shard_degree=planned_shard_degree(config, world_size),
    )


def planned_device_type(config: TrainConfig) -> str:
    """The device type a plan is for: a plan is for a GPU unless --device cpu (--dry-run needs
    none to plan for one)."""
    return "cpu" if config.device == "cpu" else "cuda"


def plan_run(
    config: TrainConfig,
    model_config: PretrainedConfig,
    world_size: int,
    memory_gib: float,
    device_type: str = "",
) -> tuple[MemoryPlan, list[str]]:
    """This run's per-rank memory plan (parameters counted on the meta device) and, when it does
    not fit, the setting changes that would make it fit. ``device_type`` ("cuda", "cpu"; empty:
    ``planned_device_type``) decides whether ``--fused-loss auto`` is planned as Liger's fused
    loss (``model.uses_fused_loss``)."""
    model_type = str(getattr(model_config, "model_type", "") or "")
    device_type = device_type or planned_device_type(config)
    fused = uses_fused_loss(config.fused_loss, device_type, model_type)
    model = meta_model(model_config)
    sizes = parameter_sizes(model)
    active = matmul_parameter_count(model, model_config)
    adapters: tuple[int, ...] = ()
    if config.peft == "lora":
        adapters = tuple(math.prod(shape) for shape in trained_shapes(config, model_config))
    shards = shard_shapes(config, [tuple(p.shape) for p in model.parameters()], world_size)
    state, buffers = state_bytes(  # DDP buckets only what is trained: the adapters under LoRA;
        compression_settings(config),  # a hook on hsdp's replicas: the shards
        list(adapters) or [math.prod(shape) for shape in shards],
        world_size,
        config.ddp_bucket_cap_mb * 2**20,
    )
    for row in local_update_memory(config, model_config, world_size):  # persistent: all phases;
        if row.persistent:  # a sync's temporaries as end-of-backward buffers, an upper bound
            state += row.nbytes
        else:
            buffers = max(buffers, row.nbytes)
    settings = dataclasses.replace(
        plan_settings(config, world_size, memory_gib, adapters),
        compression_state_bytes=state,
        compression_buffer_bytes=buffers,
        fused_loss=fused,
    )
    plan = plan_memory(model_config, sum(sizes), settings, sizes, active_parameters=active)
    if plan.fits:
        return plan, []
    return plan, suggestions(model_config, sum(sizes), settings, parameter_sizes=sizes)


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
) -> str:
    """The memory and FLOP plan of this run, as text; nothing is allocated or downloaded.

    ``model_config``: the model's, else ``plan_model_config``'s. Device memory is
    --device-memory-gib, else the visible GPU's, else 80 GiB. ``data_tokens``: the tokens of one
    pass over the training data where known (``inputs.check_dry_run_inputs``), for the run length.
    """
    model_config = model_config or plan_model_config(config)
    memory = config.device_memory_gib or visible_device_gib() or 80.0
    plan, hints = plan_run(config, model_config, config.plan_world_size or env.world_size, memory)
    adapters = sum(plan.settings.adapter_sizes)
    trained = f" (+ {adapters:,} LoRA adapter parameters, trained)" if adapters else ""
    lines = [
        f"model {config.model}: {plan.parameters:,} parameters{trained}, "
        f"{plan.flops_per_token:.4g} training FLOPs per token at seq length {config.seq_length}",
        run_length(config, plan.settings.world_size, data_tokens, plan.flops_per_token),
        f"plan per rank: {plan.settings.describe()}",
        plan.table(),
    ]
    if hints:
        lines.append("would fit with:")
        lines.extend(f"  {hint}" for hint in hints)
    extra = local_update_memory(config, model_config, plan.settings.world_size)
    if extra:
        lines.append(local_update_memory_table(extra, config))
    shapes = trained_shapes(config, model_config)
    lines.append(communication_plan(config, env, shapes, plan.flops_per_token))
    lines.append(checkpoint_plan(config, plan, shapes))
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


def checkpoint_plan(config: TrainConfig, plan: MemoryPlan, shapes: list[tuple[int, ...]]) -> str:
    """``plan.checkpoint``'s table for this run's world size and --plan-gpus-per-node."""
    world = plan.settings.world_size
    per_node = min(config.plan_gpus_per_node, world)
    trained = sum(math.prod(shape) for shape in shapes)
    hook, _ = state_bytes(compression_settings(config), [trained], world, 0)  # 0: no hook
    weight = PRECISION_DTYPES[config.precision].itemsize  # saved moments: the weights' dtype
    sizes = dataclasses.replace(
        plan_sizes(config, shapes, plan.parameters, world), weight_bytes=weight
    )
    optimizer = method_for(config).checkpoint_bytes(sizes)
    replicated, per_rank = optimizer.replicated, optimizer.per_rank + hook
    sizes = checkpoint_sizes(config, plan.parameters, trained, replicated, per_rank)
    return checkpoint_table(sizes, config, world, per_node)


def plan_sizes(
    config: TrainConfig, shapes: list[tuple[int, ...]], parameters: int, world_size: int
) -> PlanSizes:
    """The sizes a method's plan rows come from: the trained parameters of ``shapes`` (LoRA
    adapters stay fp32), ``parameters`` in the model, ``world_size`` ranks."""
    lora = config.peft != "none"
    dtype = torch.float32 if lora else PRECISION_DTYPES[config.precision]
    trained = sum(math.prod(shape) for shape in shapes)
    return PlanSizes(trained, parameters, dtype.itemsize, world_size, tuple(shapes))


def local_update_memory(
    config: TrainConfig, model_config: PretrainedConfig, world_size: int
) -> list[MemoryRow]:
    """What the method adds per rank beyond weights, gradients and optimizer state
    (``Method.memory_rows``: DiLoCo's and SparseLoCo's). ``plan_run`` counts the persistent rows
    as compression state and the sync's temporaries as compression buffers: those peak at the
    end of backward, with the gradients and one layer's activations alive, which bounds the
    sync (in the optimizer step, with the gradients alive) from above."""
    shapes = shard_shapes(config, trained_shapes(config, model_config), world_size)
    return method_for(config).memory_rows(plan_sizes(config, shapes, 0, world_size))


def planned_shard_degree(config: TrainConfig, world: int) -> int:
    """Ranks one replica is sharded over: 1 under ddp, ``world`` under fsdp, under hsdp
    --shard-degree or a node's GPUs (--plan-gpus-per-node)."""
    if config.data_parallel == "ddp":
        return 1
    if config.data_parallel == "fsdp":
        return world
    return config.shard_degree or min(config.plan_gpus_per_node, world)


def shard_shapes(
    config: TrainConfig, shapes: list[tuple[int, ...]], world: int
) -> list[tuple[int, ...]]:
    """One rank's shard of each of ``shapes`` (FSDP2 splits dim 0: ``ceil(rows / S)`` rows);
    the shapes themselves under ddp."""
    degree = planned_shard_degree(config, world)
    return [(math.ceil(s[0] / degree), *s[1:]) if s else s for s in shapes]


def local_update_memory_table(rows: list[MemoryRow], config: TrainConfig) -> str:
    """The rows of :func:`local_update_memory` as a Markdown table in GiB per rank."""
    title = method_for(config).describe()
    lines = [f"| {title}: extra memory (in the plan above) | GiB per rank |", "|---|---:|"]
    for row in rows:
        kind = "kept" if row.persistent else "during a sync"
        lines.append(f"| {row.name} ({kind}) | {row.nbytes / 2**30:.2f} |")
    return "\n".join(lines)


def trained_shapes(config: TrainConfig, model_config: PretrainedConfig) -> list[tuple[int, ...]]:
    """Shapes of the parameters that train, on the meta device: what DDP buckets and DeMo tiles
    (only the adapters under --peft lora)."""
    model = meta_model(model_config)
    if config.peft == "lora":
        model = apply_lora(model, lora_settings(config))
    return [tuple(p.shape) for p in model.parameters() if p.requires_grad]


def communication_plan(
    config: TrainConfig, env: DistEnv, shapes: list[tuple[int, ...]], flops_per_token: float
) -> str:
    """Wire bytes and predicted times per step of this run's method (its --compression, or
    DeMo's all-gather under --optimizer demo) and the reference methods (``plan.communication``)
    for the trained parameters of ``shapes``, for --plan-world-size ranks (else WORLD_SIZE),
    --plan-gpus-per-node and the --plan-*-gbit links; compute at --plan-tflops per rank."""
    world = config.plan_world_size or env.world_size
    per_node = min(config.plan_gpus_per_node, world)
    topo = Topology(
        world, per_node, config.plan_intra_node_gbit * 1e9, config.plan_inter_node_gbit * 1e9
    )
    tokens = config.batch_size * config.seq_length * config.accumulation_steps
    compute_s = tokens * flops_per_token / (config.plan_tflops * 1e12)
    sizes = [math.prod(shape) for shape in shapes]
    method = method_for(config)
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
    return "\n".join([header, *sharded_traffic(config, shapes, topo, method), table])


@dataclasses.dataclass(frozen=True)
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
    config: TrainConfig, shapes: list[tuple[int, ...]], topo: Topology, method: Method
) -> ShardedTraffic:
    """FSDP's wire bytes per rank and step (``compression.sharded_step_bytes``: every
    micro-batch all-gathers the units, layers twice and the root once, then the gradients are
    reduce-scattered, under native hsdp also all-reduced over the replicas). Under hsdp with a
    method on the replicas (``Method.exchanges_replicas``) FSDP stays within each group, and
    ``across`` is the method's estimate for the shard's shapes (FSDP2 splits dim 0: ``ceil(rows
    / S)`` rows) on a ring of the R replicas."""
    world, sizes = topo.world_size, [math.prod(shape) for shape in shapes]
    parameters = sum(sizes)
    shard = planned_shard_degree(config, world)
    hooked = config.data_parallel == "hsdp" and method.exchanges_replicas(2)
    exchange = ShardedExchange(
        parameters=parameters,
        gathered=2 * parameters - max(sizes),  # the root's bulk: the embedding (and the head)
        shard=shard,
        replicate=1 if hooked else world // shard,
        micro_batches=config.accumulation_steps,
        gather_bytes=4 if config.precision == "fp32" else 2,
        reduce_bytes=PRECISION_DTYPES[config.precision].itemsize,
    )
    within, _ = sharded_step_bytes(dataclasses.replace(exchange, replicate=1))
    across = sharded_step_bytes(exchange)[0] - within
    if hooked:
        replicas = dataclasses.replace(topo, world_size=world // shard, per_node=1)
        bucket = config.ddp_bucket_cap_mb * 2**20
        estimate = method.step_estimate(shard_shapes(config, shapes, world), replicas, bucket)
        across = estimate.wire_bytes
    return ShardedTraffic(within, across, hooked, shard, world // shard)


def sharded_traffic(
    config: TrainConfig, shapes: list[tuple[int, ...]], topo: Topology, method: Method
) -> list[str]:
    """Under --data-parallel fsdp/hsdp, FSDP's line of :func:`sharded_traffic_bytes` (the
    table's rows are then DDP's comm hooks, for comparison) and, with a method on hsdp's
    replicas, its line across them. [] under ddp."""
    if config.data_parallel == "ddp":
        return []
    bytes_ = sharded_traffic_bytes(config, shapes, topo, method)
    lines = [
        f"--data-parallel {config.data_parallel} ({bytes_.replicas} x {bytes_.shard} ranks): "
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


def run_estimate(
    config: TrainConfig, shapes: list[tuple[int, ...]], topo: Topology, method: Method | None = None
) -> CommEstimate:
    """This run's communication per optimizer step (``Method.step_estimate``: its
    --compression's, DeMo's exchange, or DiLoCo's / SparseLoCo's sync shared over its
    --local-steps; benchmarks compare it with measured step times)."""
    method = method or method_for(config)
    return method.step_estimate(shapes, topo, config.ddp_bucket_cap_mb * 2**20)


def check_fits(config: TrainConfig, model_config: PretrainedConfig, env: DistEnv) -> None:
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
    plan, hints = plan_run(config, model_config, env.world_size, memory, device_type)
    if plan.fits:
        return
    fix = hints[0] if hints[0].startswith("no combination") else f"it would fit with {hints[0]}"
    raise UserError(
        f"the memory plan needs {plan.total / 2**30:.1f} GiB per rank but the device has "
        f"{memory:g} GiB ({plan.settings.describe()}); {fix} (see --dry-run)"
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
