"""Compression settings: the method names, their parameters and their validation."""

from dataclasses import dataclass

import torch

METHODS = ("none", "dct", "dct-topk", "fp16", "bf16", "powersgd")
TOPK_VALUE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
POWERSGD_MIN_START = 2
POWERSGD_EPSILON = 1e-8
POWERSGD_MIN_RATE = 2.0
FP32_BYTES = 4


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
    """dct, dct-topk: carry what was not sent into the next step's gradient."""
    start_step: int = 0
    """Steps before this one use the plain dense all-reduce (powersgd: at least 2)."""
    powersgd_rank: int = 4
    """powersgd: rank of the low-rank approximation of every weight matrix."""
    topk_value_dtype: str = "float32"
    """dct, dct-topk: dtype of the coefficients on the wire: float32, bfloat16 or float16."""


def validate_settings(settings: CompressionSettings) -> None:
    """Check every field; raise ``ValueError`` with a one-line message naming the fix."""
    if settings.method not in METHODS:
        raise ValueError(
            f"unknown compression method {settings.method!r}; use one of {', '.join(METHODS)}"
        )
    if not 0.0 < settings.ratio <= 1.0:
        raise ValueError(
            f"compression ratio must be in (0, 1], got {settings.ratio}; "
            "e.g. 0.25 sends a quarter of the DCT coefficients"
        )
    if settings.block_size < 2:
        raise ValueError(f"block_size must be at least 2, got {settings.block_size}; try 64")
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
    if settings.topk_value_dtype not in TOPK_VALUE_DTYPES:
        raise ValueError(
            f"unknown topk_value_dtype {settings.topk_value_dtype!r}; "
            f"use one of {', '.join(TOPK_VALUE_DTYPES)}"
        )


def kept_coefficients(settings: CompressionSettings) -> int:
    """Coefficients sent per block by ``dct``: ``max(1, round(ratio * block_size))``."""
    return max(1, round(settings.ratio * settings.block_size))
