"""DiLoCo's and SparseLoCo's settings: the flags of ``--optimizer diloco|sparseloco``, their
checks and their one-line description.

Defaults (see ``config.py``): DiLoCo H 500, outer lr 0.7, Nesterov momentum 0.9 (DiLoCo paper,
section 3); SparseLoCo H 15, k 64 of 4096-value chunks (1.56% density: the paper reports 1-3%),
error-feedback decay 0.95, 2-bit values, outer lr 1 (SparseLoCo paper's main setting). The
methods themselves are :class:`.diloco.DiLoCo` and :class:`.sparseloco.SparseLoCo`, on the base
:class:`.local_updates.LocalUpdates`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from torchrun_ddp.errors import UserError
from torchrun_ddp.optim.sparseloco_codec import MessageFormat

if TYPE_CHECKING:
    from torchrun_ddp.config import TrainConfig

LOCAL_UPDATE_METHODS = ("diloco", "sparseloco")
PSEUDO_GRADIENT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
PAPER_LOCAL_STEPS = {"diloco": 500, "sparseloco": 15}
"""H of each paper's main runs (DiLoCo sec. 3; SparseLoCo's main comparison)."""
PAPER_OUTER_LR = {"diloco": 0.7, "sparseloco": 1.0}
"""Outer learning rate of each paper (DiLoCo: Nesterov SGD 0.7; SparseLoCo: plain SGD 1)."""
MAX_QUANT_BITS = 8
QUANTIZERS = ("chunk", "statistical")
AGGREGATES = ("all", "senders")
CLIPS = ("none", "median")


@dataclass(frozen=True)
class LocalUpdateSettings:
    """How the outer loop runs; checked by :func:`validate_local_updates`."""

    method: str = "diloco"
    """``diloco`` or ``sparseloco``."""
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
    if settings.method not in LOCAL_UPDATE_METHODS:
        raise ValueError(
            f"unknown local-update method {settings.method!r}; use diloco or sparseloco"
        )
    if settings.local_steps < 1 or settings.outer_lr <= 0:
        raise ValueError(
            f"local steps must be >= 1 and the outer lr > 0, got {settings.local_steps} and "
            f"{settings.outer_lr}"
        )
    if not 0.0 <= settings.outer_momentum < 1.0:
        raise ValueError(f"outer momentum must be in [0, 1), got {settings.outer_momentum}")
    if settings.method == "sparseloco" and settings.outer_momentum:
        raise ValueError("SparseLoCo has no outer momentum (error feedback replaces it); use 0")
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


def local_update_settings(config: TrainConfig, method: str = "") -> LocalUpdateSettings:
    """The settings of ``--optimizer diloco|sparseloco`` (or ``method``) from the run's config:
    ``0`` for ``--local-steps`` and ``--outer-lr`` means the method's paper value; SparseLoCo
    ignores ``--outer-momentum`` (it has none). Raises UserError for values out of range."""
    settings = settings_from_config(config, method or config.optimizer)
    try:
        validate_local_updates(settings)
    except ValueError as exc:  # validate_local_updates raises ValueError for bad settings only
        raise UserError(f"--optimizer {settings.method}: {exc}") from exc
    return settings


def settings_from_config(config: TrainConfig, method: str) -> LocalUpdateSettings:
    """``method``'s settings from the run's config, unchecked (``local_update_settings`` checks
    them)."""
    local_steps = config.local_steps or PAPER_LOCAL_STEPS.get(method, 1)
    return LocalUpdateSettings(
        method=method,
        local_steps=local_steps,
        outer_lr=config.outer_lr or PAPER_OUTER_LR.get(method, 1.0),
        outer_momentum=config.outer_momentum if method == "diloco" else 0.0,
        pseudo_gradient_dtype=config.pseudo_gradient_dtype,
        topk=config.sparseloco_topk,
        chunk=config.sparseloco_chunk,
        beta=config.sparseloco_beta,
        quant_bits=config.quant_bits,
        sync_delay=(config.sync_delay or local_steps) if config.overlap_exchange else 0,
        quantizer=config.sparseloco_quantizer,
        aggregate=config.sparseloco_aggregate,
        clip=config.sparseloco_clip,
        eager=config.eager_updates,
    )


def describe(settings: LocalUpdateSettings) -> str:
    """One line for logs and tables, e.g. ``sparseloco H=15 k=64/4096 2-bit beta 0.95 lr 1``
    (``overlapped tau=15`` follows with a sync delay)."""
    tail = f" overlapped tau={settings.sync_delay}" if settings.sync_delay else ""
    tail += " eager" if settings.eager else ""
    return _describe(settings) + tail


def _describe(settings: LocalUpdateSettings) -> str:
    head = f"{settings.method} H={settings.local_steps}"
    if settings.method == "diloco":
        momentum = f"Nesterov {settings.outer_momentum:g}" if settings.outer_momentum else "SGD"
        dtype = "bf16" if settings.pseudo_gradient_dtype == "bfloat16" else "fp32"
        return f"{head} {dtype} outer {momentum} lr {settings.outer_lr:g}"
    values = f"{settings.quant_bits}-bit" if settings.quant_bits else "fp32"
    if settings.quant_bits and settings.quantizer != "chunk":
        values += f" {settings.quantizer}"
    size = settings.chunk * settings.chunk
    extra = "".join(
        f" {name}"
        for name, default in ((settings.aggregate, "all"), (settings.clip, "none"))
        if name != default
    )
    return (
        f"{head} k={settings.topk}/{size} {values} beta {settings.beta:g} lr "
        f"{settings.outer_lr:g}{extra}"
    )
