"""Which memory plan a run gets: its data-parallel mode's rows (``parallel``) with its training
method's optimizer footprint (``methods``), from the ``plan`` package's calculators; the setting
changes that make a plan fit; several plans side by side; a run's plan from its config.

Nothing is allocated: parameters are counted on a meta-device model. ``dry_run`` prints the plan
and ``check_fits`` refuses a run that does not fit; benchmarks compare the plan with measured
peaks.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import replace

import torch
from transformers import PretrainedConfig

from torchrun_ddp.compression import compression_settings
from torchrun_ddp.config import TrainConfig
from torchrun_ddp.methods import MemoryRow, Method, PlanSizes, method_class, method_for
from torchrun_ddp.model import (
    PRECISION_DTYPES,
    LoraSettings,
    apply_lora,
    hidden_matrices,
    lora_settings,
    uses_fused_loss,
)
from torchrun_ddp.parallel.base import DataParallel
from torchrun_ddp.parallel.modes import mode_class
from torchrun_ddp.plan.architecture import (
    architecture,
    matmul_parameter_count,
    meta_model,
    parameter_sizes,
)
from torchrun_ddp.plan.communication import state_bytes
from torchrun_ddp.plan.memory import GIB, MemoryPlan, PlanRequest
from torchrun_ddp.plan.settings import PlanSettings


def plan_memory(
    config: PretrainedConfig,
    parameters: int,
    settings: PlanSettings,
    parameter_sizes: Sequence[int] | None = None,
    active_parameters: int | None = None,
) -> MemoryPlan:
    """The per-rank memory plan of ``settings`` for the model of ``config`` (``parameters``
    elements; ``parameter_sizes``: its tensors' element counts, for ZeRO-1's partition and the
    optimizer's step; ``active_parameters``: those a token passes through, for FLOPs): the
    rows of ``settings.data_parallel``'s mode (``DataParallel.plan_memory``) with the optimizer
    state of ``settings.optimizer``'s method (``Method.footprint``). Raises UserError when the
    config is not a decoder config or ``seq_length`` exceeds its positions."""
    footprint = method_class(settings.optimizer).footprint()
    request = PlanRequest(
        architecture(config), parameters, settings, footprint, parameter_sizes, active_parameters
    )
    return planned_mode(settings).plan_memory(request)


def planned_mode(settings: PlanSettings) -> DataParallel:
    """The mode of ``settings`` on its ranks: ``shard_degree`` ranks a shard group (0: all)."""
    world = settings.world_size
    return mode_class(settings.data_parallel)(world, world, settings.shard_degree)


# -- which settings fit ----------------------------------------------------------------------------

_FLAGS: dict[str, Callable[[PlanSettings], PlanSettings | None]] = {
    "--precision bf16-mixed": lambda s: (
        replace(s, precision="bf16-mixed") if s.precision == "fp32" else None
    ),
    "--precision bf16": lambda s: replace(s, precision="bf16") if s.precision != "bf16" else None,
    "--zero1": lambda s: None if s.zero1 else replace(s, zero1=True),
    "--activation-checkpointing": lambda s: (
        None if s.activation_checkpointing else replace(s, activation_checkpointing=True)
    ),
    "--gradient-as-bucket-view": lambda s: (
        None if s.gradient_as_bucket_view else replace(s, gradient_as_bucket_view=True)
    ),
}
"""Setting changes ``suggestions`` tries: each returns the changed settings, or None when the
change does not apply (already on)."""

_SHARED_CHANGES = frozenset({"--precision bf16-mixed", "--precision bf16"})
_SHARED_CHANGES |= {"--activation-checkpointing"}
"""The changes every mode and method can make; the others are the mode's
(``DataParallel.fit_changes``), ZeRO-1 only where the method's optimizer state can be sharded."""

MAX_WORLD_SIZE = 1024
"""The largest number of ranks ``suggestions`` proposes."""


def _changes(settings: PlanSettings) -> frozenset[str]:
    """The setting changes that apply to ``settings``'s mode and method."""
    changes = _SHARED_CHANGES | planned_mode(settings).fit_changes()
    if not method_class(settings.optimizer).footprint().zero1:
        changes -= {"--zero1"}
    return changes


def _variants(base: PlanSettings, names: Sequence[str]) -> list[PlanSettings]:
    """Settings with the flags in ``names`` applied, times the micro-batches (halving to 1,
    largest first) and world sizes (doubling up to MAX_WORLD_SIZE, smallest first) named."""
    settings: PlanSettings | None = base
    allowed = _changes(base)
    for name in names:
        if name in _FLAGS and settings is not None:
            settings = _FLAGS[name](settings) if name in allowed else None
    if settings is None:
        return []
    micro = [base.micro_batch]
    if "smaller micro-batch" in names:
        micro = [base.micro_batch >> k for k in range(1, base.micro_batch.bit_length())]
    worlds = [base.world_size]
    if "more GPUs" in names:
        worlds = [base.world_size << k for k in range(1, 11)]
        worlds = [w for w in worlds if w <= MAX_WORLD_SIZE]
    return [replace(settings, world_size=w, micro_batch=m) for w in worlds for m in micro]


def _label(base: PlanSettings, names: Sequence[str], settings: PlanSettings) -> str:
    """``--precision bf16-mixed + --zero1 + --batch-size 2 (accumulate 2x to keep tokens per
    step)``: the trainer's flags."""
    parts = [name for name in names if name in _FLAGS]
    if settings.micro_batch != base.micro_batch:
        factor = base.micro_batch // settings.micro_batch
        parts.append(
            f"--batch-size {settings.micro_batch} (--accumulation-steps x{factor} keeps the "
            "tokens per step)"
        )
    if settings.world_size != base.world_size:
        parts.append(f"{settings.world_size} GPUs")
    return " + ".join(parts)


def suggestions(
    config: PretrainedConfig,
    parameters: int,
    settings: PlanSettings,
    parameter_sizes: Sequence[int] | None = None,
) -> list[str]:
    """Changes of settings that make a plan which does not fit, fit; [] when it already fits.

    Tries every combination of bf16-mixed or bf16, zero1, activation checkpointing,
    ``gradient_as_bucket_view``, a smaller micro-batch and more GPUs (those that apply to the
    mode and the method), re-planning each, and keeps the minimal ones (no fitting combination
    is a subset of another), fewest changes first, each as ``<changes>: <total> GiB of <device>
    GiB per rank (<headroom>)``. When nothing fits, says so, and why (the mode's reason).
    """
    if plan_memory(config, parameters, settings, parameter_sizes).fits:
        return []
    options = [*_FLAGS, "smaller micro-batch", "more GPUs"]
    found: list[tuple[frozenset[str], str]] = []
    for count in range(1, len(options) + 1):
        for names in itertools.combinations(options, count):
            if any(chosen <= set(names) for chosen, _ in found):
                continue
            line = _first_fit(config, parameters, settings, names, parameter_sizes)
            if line:
                found.append((frozenset(names), line))
    if found:
        return [line for _, line in found]
    return [_nothing_fits(config, parameters, settings, parameter_sizes)]


def _first_fit(
    config: PretrainedConfig,
    parameters: int,
    base: PlanSettings,
    names: Sequence[str],
    sizes: Sequence[int] | None,
) -> str:
    """The first variant of ``names`` that fits, described; "" when none does."""
    if "--precision bf16-mixed" in names and "--precision bf16" in names:
        return ""
    for settings in _variants(base, names):
        plan = plan_memory(config, parameters, settings, sizes)
        if plan.fits:
            total = f"{plan.total / GIB:.1f} GiB of {settings.device_memory_gib:g} GiB per rank"
            return f"{_label(base, names, settings)}: {total} ({plan.verdict()})"
    return ""


def _nothing_fits(
    config: PretrainedConfig, parameters: int, base: PlanSettings, sizes: Sequence[int] | None
) -> str:
    """Why no combination fits: the smallest plan, and the mode's reason
    (``DataParallel.nothing_fits``)."""
    changes = _changes(base)
    zero1 = "--zero1" in changes
    smallest = replace(
        base,
        precision="bf16",
        zero1=zero1,
        activation_checkpointing=True,
        gradient_as_bucket_view=True,
        micro_batch=1,
        world_size=MAX_WORLD_SIZE,
    )
    plan = plan_memory(config, parameters, smallest, sizes)
    applied = ["bf16", *(["zero1"] if zero1 else []), "activation checkpointing"]
    applied += ["gradient_as_bucket_view"] if "--gradient-as-bucket-view" in changes else []
    reason = planned_mode(base).nothing_fits(
        base.device_memory_gib, plan.total / GIB, (plan.weights + plan.gradients) / GIB
    )
    return (
        f"no combination fits in {base.device_memory_gib:g} GiB: even {' + '.join(applied)} at "
        f"micro-batch 1 on {MAX_WORLD_SIZE} GPUs {reason}"
    )


def comparison_table(plans: Sequence[MemoryPlan]) -> str:
    """Several plans side by side as a Markdown table, GiB per rank (for a README)."""
    lines = [
        "| setting | GPUs | micro-batch x seq | weights + grads + buckets | optimizer state "
        "| activations | peak total | verdict |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for plan in plans:
        s = plan.settings
        name = plan.describe().split(",")[0]
        replicated = (plan.weights + plan.gradients + plan.ddp_buckets) / GIB
        lines.append(
            f"| {name} | {s.world_size} x {s.device_memory_gib:g} GiB "
            f"| {s.micro_batch} x {s.seq_length} | {replicated:.1f} "
            f"| {plan.optimizer_state / GIB:.1f} | {plan.activations / GIB:.1f} "
            f"| {plan.total / GIB:.1f} | {plan.verdict()} |"
        )
    return "\n".join(lines)


# -- a run's plan ----------------------------------------------------------------------------------


def run_mode(config: TrainConfig, world_size: int) -> DataParallel:
    """The run's mode on the planned cluster: ``world_size`` ranks, --plan-gpus-per-node of
    them a node (hsdp's default shard group)."""
    return mode_class(config.data_parallel)(
        world_size, min(config.plan_gpus_per_node, world_size), config.shard_degree
    )


def plan_settings(
    config: TrainConfig, world_size: int, memory_gib: float, adapter_sizes: tuple[int, ...] = ()
) -> PlanSettings:
    """The memory plan's view of this run's settings, on devices of ``memory_gib`` GiB
    (``adapter_sizes``: the LoRA adapters' element counts under --peft lora)."""
    mode = run_mode(config, world_size)
    return PlanSettings(
        world_size=world_size,
        micro_batch=config.batch_size,
        seq_length=config.seq_length,
        precision=config.precision,
        zero1=config.zero1,
        activation_checkpointing=config.activation_checkpointing,
        device_memory_gib=memory_gib,
        ddp_bucket_cap_mb=config.ddp_bucket_cap_mb,
        gradient_as_bucket_view=mode.plan_bucket_view(config),
        accumulation_steps=config.accumulation_steps,
        fused_adamw=config.adamw_implementation == "fused",
        adapter_sizes=adapter_sizes,
        optimizer=config.optimizer,
        data_parallel=config.data_parallel,
        shard_degree=mode.shape.shard,
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
    method: Method | None = None,
) -> tuple[MemoryPlan, list[str]]:
    """This run's per-rank memory plan (parameters counted on the meta device) and, when it does
    not fit, the setting changes that would make it fit. ``device_type`` ("cuda", "cpu"; empty:
    ``planned_device_type``) decides whether ``--fused-loss auto`` is planned as Liger's fused
    loss (``model.uses_fused_loss``). ``method``: the run's (``methods.method_for`` when None)."""
    model_type = str(getattr(model_config, "model_type", "") or "")
    device_type = device_type or planned_device_type(config)
    fused = uses_fused_loss(config.fused_loss, device_type, model_type)
    model = meta_model(model_config)
    sizes = parameter_sizes(model)
    active = matmul_parameter_count(model, model_config)
    adapters: tuple[int, ...] = ()
    if config.peft == "lora":
        adapters = tuple(math.prod(shape) for shape in trained_shapes(config, model_config))
    mode = run_mode(config, world_size)
    shards = mode.shard_shapes([tuple(p.shape) for p in model.parameters()])
    state, buffers = state_bytes(  # DDP buckets only what is trained: the adapters under LoRA;
        compression_settings(config),  # a hook on hsdp's replicas: the shards
        list(adapters) or [math.prod(shape) for shape in shards],
        world_size,
        config.ddp_bucket_cap_mb * 2**20,
    )
    method = method or method_for(config)
    for row in local_update_memory(config, model_config, world_size, method):  # persistent:
        if row.persistent:  # all phases; a sync's temporaries as end-of-backward buffers, an
            state += row.nbytes  # upper bound
        else:
            buffers = max(buffers, row.nbytes)
    settings = replace(
        plan_settings(config, world_size, memory_gib, adapters),
        compression_state_bytes=state,
        compression_buffer_bytes=buffers,
        fused_loss=fused,
    )
    plan = plan_memory(model_config, sum(sizes), settings, sizes, active_parameters=active)
    if plan.fits:
        return plan, []
    return plan, suggestions(model_config, sum(sizes), settings, parameter_sizes=sizes)


def plan_sizes(
    config: TrainConfig,
    shapes: list[tuple[int, ...]],
    parameters: int,
    world_size: int,
    matrices: Sequence[tuple[int, ...]] = (),
) -> PlanSizes:
    """The sizes a method's plan rows come from: the trained parameters of ``shapes`` (LoRA
    adapters stay fp32), of which ``matrices`` are the hidden layers' matrices
    (``trained_matrix_shapes``), ``parameters`` in the model, ``world_size`` ranks."""
    lora = config.peft != "none"
    dtype = PRECISION_DTYPES["fp32" if lora else config.precision]
    trained = sum(math.prod(shape) for shape in shapes)
    hidden = sum(math.prod(shape) for shape in matrices)
    return PlanSizes(trained, parameters, dtype.itemsize, world_size, tuple(shapes), hidden)


def local_update_memory(
    config: TrainConfig, model_config: PretrainedConfig, world_size: int, method: Method
) -> list[MemoryRow]:
    """What the method adds per rank beyond weights, gradients and optimizer state
    (``Method.memory_rows``: DiLoCo's and SparseLoCo's). ``plan_run`` counts the persistent rows
    as compression state and the sync's temporaries as compression buffers: those peak at the
    end of backward, with the gradients and one layer's activations alive, which bounds the
    sync (in the optimizer step, with the gradients alive) from above."""
    mode = run_mode(config, world_size)
    shapes = mode.shard_shapes(trained_shapes(config, model_config))
    matrices = mode.shard_shapes(trained_matrix_shapes(config, model_config))
    return method.memory_rows(plan_sizes(config, shapes, 0, world_size, matrices))


def trained_shapes(config: TrainConfig, model_config: PretrainedConfig) -> list[tuple[int, ...]]:
    """Shapes of the parameters that train, on the meta device: what DDP buckets and DeMo tiles
    (only the adapters under --peft lora)."""
    return list(_meta_shapes(config, model_config)[0])


def trained_matrix_shapes(
    config: TrainConfig, model_config: PretrainedConfig
) -> list[tuple[int, ...]]:
    """Shapes of the trained hidden-layer matrices (``model.hidden_matrices``), on the meta
    device: what an optimizer that treats them apart (Muon) steps."""
    return list(_meta_shapes(config, model_config)[1])


Shapes = tuple[tuple[int, ...], ...]
_META_SHAPES: dict[tuple[str, LoraSettings | None], tuple[Shapes, Shapes]] = {}
"""(the model's config as JSON, the LoRA settings) -> its trained shapes and trained matrices'
shapes: one dry run asks for them about 7 times, and 7B's LoRA model takes seconds to build."""


def _meta_shapes(config: TrainConfig, model_config: PretrainedConfig) -> tuple[Shapes, Shapes]:
    """The trained shapes and the trained hidden matrices' shapes, built once per model."""
    lora = lora_settings(config) if config.peft == "lora" else None
    key = (model_config.to_json_string(), lora)
    if key not in _META_SHAPES:
        model = _trained_meta_model(config, model_config)
        trained = tuple(tuple(p.shape) for p in model.parameters() if p.requires_grad)
        _META_SHAPES[key] = trained, tuple(tuple(p.shape) for p in hidden_matrices(model))
    return _META_SHAPES[key]


def _trained_meta_model(config: TrainConfig, model_config: PretrainedConfig) -> torch.nn.Module:
    """The model on the meta device, with its adapters under --peft lora (built on the meta
    device too: peft would draw 7B's 1,568 adapters on the host, about 10 s a build)."""
    model = meta_model(model_config)
    if config.peft != "lora":
        return model
    with torch.device("meta"):
        return apply_lora(model, lora_settings(config))
