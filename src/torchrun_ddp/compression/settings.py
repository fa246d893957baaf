"""Compression settings: the method names, their parameters and their validation."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from torchrun_ddp.errors import UserError

if TYPE_CHECKING:
    from torchrun_ddp.config import TrainConfig

METHODS = ("none", "dct", "dct-topk", "fp16", "bf16", "powersgd")
TOPK_VALUE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
POWERSGD_MIN_START = 2
POWERSGD_EPSILON = 1e-8
POWERSGD_MIN_RATE = 2.0
FP32_BYTES = 4
SELECTIONS = ("low-pass", "rotating")
SCOPES = ("global", "inter-node")
SCOPED_METHODS = ("none", "fp16", "bf16", "dct")
"""Methods whose exchange is an all-reduce, so ``scope = "inter-node"`` can split it in three."""


@dataclass
class CompressionSettings:
    """How DDP gradients are compressed. Plain values; checked by :func:`validate_settings`."""

    method: str = "none"
    """One of :data:`METHODS`."""
    ratio: float = 0.5
    """dct: fraction of the DCT coefficients of every block that is sent, 0 < ratio <= 1."""
    block_size: int = 64
    """dct, dct-topk: DCT block length in values (at least 2)."""
    topk: int = 8
    """dct-topk: coefficients sent per block, 1 <= topk <= block_size."""
    error_feedback: bool = True
    """dct (rotating selection), dct-topk: carry what was not sent into the next step's gradient.

    Low-pass ``dct`` keeps no residual whatever this says: what it does not send lies in the
    orthogonal complement of a kept set that never changes, so a residual would never be sent and
    would only grow (a full fp32 copy of the gradients)."""
    start_step: int = 0
    """Steps before this one use the plain dense all-reduce (powersgd: at least 2)."""
    powersgd_rank: int = 4
    """powersgd: rank of the low-rank approximation of every weight matrix."""
    topk_value_dtype: str = "float32"
    """dct, dct-topk: dtype of the coefficients on the wire: float32, bfloat16 or float16."""
    selection: str = "low-pass"
    """dct: which coefficients a step sends, the same on every rank: ``low-pass`` (always the
    ``k`` lowest frequencies) or ``rotating`` (frequencies ``(step * k + j) mod block_size``,
    so every coefficient is sent once every ``ceil(block_size / k)`` steps; needs error
    feedback to mean anything)."""
    scope: str = "global"
    """``global``: one collective over all ranks. ``inter-node``: reduce-scatter inside each
    node in fp32, compressed all-reduce of each shard between nodes (ranks with the same local
    rank), all-gather inside the node. Methods in :data:`SCOPED_METHODS` only."""


def validate_settings(settings: CompressionSettings) -> None:
    """Check every field; raise ``ValueError`` with a one-line message naming the fix."""
    if settings.method not in METHODS:
        raise ValueError(
            f"unknown compression method {settings.method!r}; use one of {', '.join(METHODS)}"
        )
    if not 0.0 < settings.ratio <= 1.0:
        raise ValueError(
            f"--compression-ratio must be in (0, 1], got {settings.ratio}; "
            "e.g. 0.25 sends a quarter of the DCT coefficients"
        )
    if settings.block_size < 2:
        raise ValueError(
            f"--compression-block-size (block_size) must be >= 2, got {settings.block_size}; try 64"
        )
    if not 1 <= settings.topk <= settings.block_size:
        raise ValueError(
            f"topk must be between 1 and block_size ({settings.block_size}), got "
            f"{settings.topk}; lower topk or raise block_size"
        )
    if settings.start_step < 0:
        raise ValueError(
            f"start_step must be >= 0, got {settings.start_step}; use 0 to compress from step 0"
        )
    if settings.powersgd_rank < 1:
        raise ValueError(f"powersgd_rank must be >= 1, got {settings.powersgd_rank}; try 4")
    _validate_choices(settings)
    if settings.topk_value_dtype not in TOPK_VALUE_DTYPES:
        raise ValueError(
            f"unknown topk_value_dtype {settings.topk_value_dtype!r}; "
            f"use one of {', '.join(TOPK_VALUE_DTYPES)}"
        )


def kept_coefficients(settings: CompressionSettings) -> int:
    """Coefficients sent per block by ``dct``: ``max(1, round(ratio * block_size))``."""
    return max(1, round(settings.ratio * settings.block_size))


def _validate_choices(settings: CompressionSettings) -> None:
    if settings.selection not in SELECTIONS:
        raise ValueError(
            f"unknown dct selection {settings.selection!r}; use one of {', '.join(SELECTIONS)}"
        )
    if settings.scope not in SCOPES:
        raise ValueError(
            f"unknown compression scope {settings.scope!r}; use one of {', '.join(SCOPES)}"
        )
    if settings.scope != "global" and settings.method not in SCOPED_METHODS:
        raise ValueError(
            f"compression scope {settings.scope!r} supports {', '.join(SCOPED_METHODS)}, not "
            f"{settings.method!r}; use scope global for it"
        )


def keeps_residual(settings: CompressionSettings) -> bool:
    """Whether the method keeps an error-feedback residual (a fp32 copy of the gradients)."""
    if not settings.error_feedback:
        return False
    return settings.method == "dct-topk" or (
        settings.method == "dct" and settings.selection == "rotating"
    )


def compression_settings(config: TrainConfig) -> CompressionSettings:
    """The comm hook's settings from the run's config; raises UserError if they do not fit
    together (the message of :func:`validate_settings`)."""
    settings = CompressionSettings(
        method=config.compression,
        ratio=config.compression_ratio,
        block_size=config.compression_block_size,
        topk=config.compression_topk,
        error_feedback=config.compression_error_feedback,
        start_step=config.compression_start_step,
        powersgd_rank=config.powersgd_rank,
        topk_value_dtype=config.compression_value_dtype,
        selection=config.compression_selection,
        scope=config.compression_scope,
    )
    try:
        validate_settings(settings)
    except ValueError as exc:  # validate_settings raises ValueError for bad settings only
        raise UserError(str(exc)) from exc
    return settings
