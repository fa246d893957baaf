"""The comm-hook family's cost model before a run: what each hook hands its collective per step,
the state it keeps, whether it overlaps backward, and its label in plan tables.

Closed forms over the parameter sizes, shared by ``plan.communication`` (wire bytes and link time
of every hook, the reference rows of ``--dry-run``) and the memory plan. Vogels et al. 2019
(PowerSGD, arXiv:1905.13727) for the low-rank factors.
"""

import math
from collections.abc import Sequence

from torchrun_ddp.compression.settings import (
    POWERSGD_MIN_RATE,
    TOPK_VALUE_DTYPES,
    CompressionSettings,
    keeps_residual,
    kept_coefficients,
)
from torchrun_ddp.compression.wire import topk_payload_bytes

FP32 = 4


def hook_overlaps(settings: CompressionSettings) -> bool:
    """Whether the hook returns before its collectives finish, so communication runs during
    backward (PowerSGD waits for its P all-reduce inside the hook)."""
    return settings.method != "powersgd"


def _value_bytes(settings: CompressionSettings) -> int:
    return 2 if settings.method in ("fp16", "bf16") else 4


def hook_payload(
    settings: CompressionSettings, sizes: Sequence[int], shapes: Sequence[tuple[int, ...]] = ()
) -> tuple[str, float, int]:
    """(collective, bytes handed to it per step, bytes per value) for the global scope."""
    method = settings.method
    numel = sum(sizes)
    blocks = sum(math.ceil(size / settings.block_size) for size in sizes)
    value = TOPK_VALUE_DTYPES[settings.topk_value_dtype].itemsize
    if method == "dct":
        return "all_reduce", blocks * kept_coefficients(settings) * value, value
    if method == "dct-topk":
        dtype = TOPK_VALUE_DTYPES[settings.topk_value_dtype]
        return (
            "all_gather",
            topk_payload_bytes(blocks, settings.topk, settings.block_size, dtype),
            0,
        )
    if method == "powersgd":
        rank = settings.powersgd_rank
        values = powersgd_numel(shapes, rank) if shapes else _powersgd_numel(sizes, rank)
        return "all_reduce", values * FP32, FP32
    width = _value_bytes(settings)
    return "all_reduce", numel * width, width


def _powersgd_numel(sizes: Sequence[int], rank: int) -> int:
    """Values PowerSGD all-reduces, approximating every tensor as square-ish (n = sqrt(numel)):
    P and Q of ``rank`` columns for matrices it compresses, the rest dense. Only an estimate,
    for callers without the shapes (:func:`powersgd_numel` counts them exactly)."""
    total = 0
    for size in sizes:
        side = math.isqrt(size)
        r = min(side, rank)
        total += 2 * side * r if 2 * side * r * 2 < size else size
    return total


def powersgd_numel(shapes: Sequence[tuple[int, ...]], rank: int) -> int:
    """Values torch's ``powerSGD_hook`` all-reduces per step for parameters of ``shapes``: a
    tensor viewed as ``[n, m]`` (``n = shape[0]``) with ``r = min(n, m, rank)`` sends P
    ``[n, r]`` and Q ``[m, r]`` when ``(n + m) r * min_compression_rate < n m``
    (``POWERSGD_MIN_RATE``), else all of it, as does every 1-D tensor. Vogels et al. 2019,
    arXiv:1905.13727; the rule is the hook's own."""
    return sum(_factors(shape, rank) or math.prod(shape) for shape in shapes)


def powersgd_factor_numel(shapes: Sequence[tuple[int, ...]], rank: int) -> int:
    """Values of PowerSGD's P and Q memories for parameters of ``shapes`` (fp32, the same on
    every rank: what a site that heals receives across fault-tolerant sites); the tensors the
    hook sends whole have none (the rule of :func:`powersgd_numel`)."""
    return sum(_factors(shape, rank) for shape in shapes)


def _factors(shape: tuple[int, ...], rank: int) -> int:
    """P and Q's values for one tensor, 0 where the hook sends it whole."""
    numel = math.prod(shape)
    if len(shape) < 2 or not numel:
        return 0
    n, m = shape[0], numel // shape[0]
    r = min(n, m, rank)
    return (n + m) * r if (n + m) * r * POWERSGD_MIN_RATE < n * m else 0


def state_bytes(
    settings: CompressionSettings, sizes: Sequence[int], world_size: int, bucket_bytes: float
) -> tuple[int, int]:
    """(persistent, transient) bytes per rank the comm hook holds beyond DDP's buckets.

    Persistent: the error-feedback residual, an fp32 copy of the gradients (rotating ``dct``,
    ``dct-topk`` with error feedback) and PowerSGD's error and P/Q memories. Transient, at the
    end of backward when every bucket's message can be in flight at once: the payloads
    (``dct-topk``: its own pairs and the ``world_size`` gathered ones), plus one bucket's encode
    and decode work space (two fp32 bucket-sized blocks). The node-aware scope waits for each
    bucket, so only one bucket's payload and its padded copy and gathered result are alive.
    """
    numel = sum(sizes)
    persistent = numel * FP32 if keeps_residual(settings) else 0
    if settings.method == "powersgd":
        persistent = numel * FP32 + _powersgd_numel(sizes, settings.powersgd_rank) * FP32
    if settings.method == "none":
        return persistent, 0
    collective, payload, _ = hook_payload(settings, sizes)
    if collective == "all_gather":
        payload *= world_size + 1
    workspace = 2 * bucket_bytes
    if settings.scope == "inter-node":
        share = bucket_bytes / max(1.0, numel * FP32)
        return persistent, int(payload * share + 2 * bucket_bytes + workspace)
    return persistent, int(payload + workspace)


def label(settings: CompressionSettings) -> str:
    """Short name of a setting for tables, e.g. ``dct 0.25 bf16 rotating inter-node``."""
    parts = [settings.method]
    if settings.method == "dct":
        parts.append(f"{settings.ratio:g}")
    if settings.method == "dct-topk":
        parts.append(f"k={settings.topk}")
    if settings.method in ("dct", "dct-topk") and settings.topk_value_dtype != "float32":
        parts.append({"bfloat16": "bf16", "float16": "fp16"}[settings.topk_value_dtype])
    if settings.method == "dct" and settings.selection != "low-pass":
        parts.append(settings.selection)
    if settings.method == "powersgd":
        parts.append(f"rank {settings.powersgd_rank}")
    if settings.scope != "global":
        parts.append(settings.scope)
    return " ".join(parts)
