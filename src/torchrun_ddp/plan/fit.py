"""Which settings fit a device: the flag changes that make a memory plan fit (``suggestions``,
shown by --dry-run and the fit check) and several plans side by side (``comparison_table``).

Each candidate is re-planned with ``plan.memory.plan_memory``; nothing is allocated.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import replace

from transformers import PretrainedConfig

from torchrun_ddp.plan.memory import GIB, MemoryPlan, PlanSettings, plan_memory

_FLAGS: dict[str, Callable[[PlanSettings], PlanSettings | None]] = {
    "--precision bf16-mixed": lambda s: (
        replace(s, precision="bf16-mixed") if s.precision == "fp32" else None
    ),
    "--precision bf16": lambda s: replace(s, precision="bf16") if s.precision != "bf16" else None,
    "--zero1": lambda s: (
        None if s.zero1 or s.optimizer != "adamw" or s.shard_ranks > 1 else replace(s, zero1=True)
    ),
    "--activation-checkpointing": lambda s: (
        None if s.activation_checkpointing else replace(s, activation_checkpointing=True)
    ),
    "--gradient-as-bucket-view": lambda s: (
        None
        if s.gradient_as_bucket_view or s.shard_ranks > 1
        else replace(s, gradient_as_bucket_view=True)
    ),
}
"""Setting changes ``suggestions`` tries: each returns the changed settings, or None when the
change does not apply (already on)."""

MAX_WORLD_SIZE = 1024
"""The largest number of ranks ``suggestions`` proposes."""


def _variants(base: PlanSettings, names: Sequence[str]) -> list[PlanSettings]:
    """Settings with the flags in ``names`` applied, times the micro-batches (halving to 1,
    largest first) and world sizes (doubling up to MAX_WORLD_SIZE, smallest first) named."""
    settings: PlanSettings | None = base
    for name in names:
        if name in _FLAGS and settings is not None:
            settings = _FLAGS[name](settings)
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
    ``gradient_as_bucket_view``, a smaller micro-batch and more GPUs, re-planning each, and keeps
    the minimal ones (no fitting combination is a subset of another), fewest changes first, each
    as ``<changes>: <total> GiB of <device> GiB per rank (<headroom>)``. When nothing fits, says
    so: DDP replicates the weights and gradients on every rank.
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
    """Why no combination fits: the smallest plan and its replicated floor. ZeRO-1 is part of
    it only under AdamW with DDP (DeMo, DiLoCo, SparseLoCo and a sharded model refuse --zero1)."""
    zero1 = base.optimizer == "adamw" and base.shard_ranks == 1
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
    floor = (plan.weights + plan.gradients) / GIB
    if base.shard_ranks > 1:
        return (
            f"no combination fits in {base.device_memory_gib:g} GiB: even bf16 + activation "
            f"checkpointing at micro-batch 1 on {MAX_WORLD_SIZE} GPUs needs "
            f"{plan.total / GIB:.1f} GiB per rank; shard over more ranks or use GPUs with "
            "more memory"
        )
    return (
        f"no combination fits in {base.device_memory_gib:g} GiB: even bf16 + "
        f"{'zero1 + ' if zero1 else ''}activation checkpointing + gradient_as_bucket_view at "
        f"micro-batch 1 on {MAX_WORLD_SIZE} GPUs "
        f"needs {plan.total / GIB:.1f} GiB per rank, because DDP replicates the weights and "
        f"gradients ({floor:.1f} GiB) on every rank; shard them (--data-parallel fsdp) or use "
        "GPUs with more memory"
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
        name = s.describe().split(",")[0]
        replicated = (plan.weights + plan.gradients + plan.ddp_buckets) / GIB
        lines.append(
            f"| {name} | {s.world_size} x {s.device_memory_gib:g} GiB "
            f"| {s.micro_batch} x {s.seq_length} | {replicated:.1f} "
            f"| {plan.optimizer_state / GIB:.1f} | {plan.activations / GIB:.1f} "
            f"| {plan.total / GIB:.1f} | {plan.verdict()} |"
        )
    return "\n".join(lines)
