"""The settings of the optimizers that take local updates (:class:`LocalUpdateSettings`) and the
checks of their values. Which values a run uses (each paper's defaults, presets) and how they are
described is each training method's own (``methods.diloco``, ``methods.sparseloco``); the
optimizers are :class:`.diloco.DiLoCo` and :class:`.sparseloco.SparseLoCo`, on the base
:class:`.local_updates.LocalUpdates`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from torchrun_ddp.optim.sparseloco_codec import MessageFormat

PSEUDO_GRADIENT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
MAX_QUANT_BITS = 8
QUANTIZERS = ("chunk", "statistical")
AGGREGATES = ("all", "senders")
CLIPS = ("none", "median")


@dataclass(frozen=True)
class LocalUpdateSettings:
    """How the outer loop runs; checked by :func:`validate_local_updates`."""

    method: str = "diloco"
    """The training method's name (``--optimizer``), for messages; the method object chose
    the optimizer class and these values (``methods.local_updates``)."""
    local_steps: int = 500
    """H: inner optimizer steps between syncs (>= 1)."""
    outer_lr: float = 0.7
    """Outer SGD learning rate (> 0)."""
    outer_momentum: float = 0.9
    """DiLoCo: outer Nesterov momentum in [0, 1); 0 is plain SGD. SparseLoCo: must be 0."""
    pseudo_gradient_dtype: str = "float32"
    """DiLoCo: dtype of the all-reduced pseudo-gradient (float32 or bfloat16)."""
    topk: int = 64
    """SparseLoCo: values sent per chunk (capped at the chunk's size)."""
    chunk: int = 64
    """SparseLoCo: largest chunk side (chunks of up to chunk x chunk values)."""
    beta: float = 0.95
    """SparseLoCo: error-feedback decay in [0, 1)."""
    quant_bits: int = 2
    """SparseLoCo: bits per value sent, 1 to 8; 0 sends fp32 values (no quantization)."""
    sync_delay: int = 0
    """Inner steps between a sync's start and its outer update (0 to H); 0 waits for the sync
    in the step that starts it, >= 1 overlaps it with that many inner steps."""
    quantizer: str = "chunk"
    """SparseLoCo: ``chunk`` (an fp32 scale per chunk) or ``statistical`` (Templar's per-tensor
    codebook); ``sparseloco_codec``."""
    aggregate: str = "all"
    """SparseLoCo: mean over ``all`` ranks, or per value over its ``senders`` (Templar)."""
    clip: str = "none"
    """SparseLoCo: ``median``: each rank's message scaled down to the median norm (Templar)."""
    eager: bool = False
    """With a sync delay: eager updates (Kale et al. 2025): the delay's inner steps start from
    an estimate of the outer update instead of the rank's own parameters (module docstring)."""

    @property
    def message_format(self) -> MessageFormat:
        """SparseLoCo's message format (``sparseloco_codec``)."""
        return MessageFormat(self.quant_bits, self.quantizer, self.aggregate, self.clip)


def validate_local_updates(settings: LocalUpdateSettings) -> None:
    """Raise ``ValueError`` with a one-line message naming the bad field and the fix."""
    if settings.local_steps < 1 or settings.outer_lr <= 0:
        raise ValueError(
            f"local steps must be >= 1 and the outer lr > 0, got {settings.local_steps} and "
            f"{settings.outer_lr}"
        )
    if not 0.0 <= settings.outer_momentum < 1.0:
        raise ValueError(f"outer momentum must be in [0, 1), got {settings.outer_momentum}")
    if settings.pseudo_gradient_dtype not in PSEUDO_GRADIENT_DTYPES:
        raise ValueError(
            f"unknown pseudo-gradient dtype {settings.pseudo_gradient_dtype!r}; use float32 or "
            "bfloat16"
        )
    validate_sparseloco_fields(settings)
    if settings.eager and not settings.sync_delay:
        raise ValueError("eager updates need an overlapped sync (a sync delay of 1 or more)")
    if not 0 <= settings.sync_delay <= settings.local_steps:
        raise ValueError(
            f"the sync delay (--sync-delay) must be 0 to the local steps ({settings.local_steps}), "
            f"got {settings.sync_delay}; lower it or raise --local-steps"
        )


def validate_sparseloco_fields(settings: LocalUpdateSettings) -> None:
    """Raise ``ValueError`` naming the flag for SparseLoCo's fields out of range (checked
    whatever the method, as the flags are)."""
    if settings.topk < 1 or settings.chunk < 2 or not 0.0 <= settings.beta < 1.0:
        raise ValueError(
            f"--sparseloco-topk must be >= 1, --sparseloco-chunk >= 2 and --sparseloco-beta in "
            f"[0, 1), got {settings.topk}, {settings.chunk} and {settings.beta}"
        )
    if not 0 <= settings.quant_bits <= MAX_QUANT_BITS:
        raise ValueError(f"--quant-bits must be 0 (none) to 8, got {settings.quant_bits}")
    options = (settings.quantizer, settings.aggregate, settings.clip)
    if options not in {(q, a, c) for q in QUANTIZERS for a in AGGREGATES for c in CLIPS}:
        raise ValueError(
            f"unknown SparseLoCo quantizer, aggregate or clip {options}; use {QUANTIZERS}, "
            f"{AGGREGATES} and {CLIPS}"
        )
