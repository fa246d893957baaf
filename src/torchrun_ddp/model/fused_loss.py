"""Liger Kernel's fused linear cross-entropy for training (``--fused-loss``): when a run uses it,
and putting it on a model instance. Liger imports Triton, so it is found, not imported, until a
run uses it.
"""

from __future__ import annotations

import importlib.util

from transformers import PreTrainedModel

from torchrun_ddp.errors import UserError

FUSED_LOSS_KERNELS_OFF = (
    "rope", "rms_norm", "swiglu", "geglu", "layer_norm", "cross_entropy", "fused_add_rms_norm",
)  # fmt: skip
"""Liger Kernel's other per-model replacements, turned off: ``--fused-loss liger`` swaps the
loss only, so the layers stay transformers' own (and inductor's under --compile)."""

FUSED_LOSS_AUTO_TYPES = ("llama",)
"""Model types for which ``--fused-loss auto`` picks liger on CUDA: those whose fused loss
tests/test_gpu.py checks against the plain loss on a GPU. ``--fused-loss liger`` takes any type
Liger Kernel has a forward for."""


def liger_installed() -> bool:
    """Whether the liger-kernel package is installed (found, not imported: it imports Triton)."""
    return importlib.util.find_spec("liger_kernel") is not None


def liger_model_types() -> frozenset[str]:
    """The ``model_type`` values Liger Kernel has a fused-loss forward for (empty where
    ``liger_kernel`` does not import). Imports Liger and Triton: seconds."""
    try:
        from liger_kernel.transformers.monkey_patch import (  # noqa: PLC0415 (imports Triton)
            MODEL_TYPE_TO_APPLY_LIGER_FN,
        )
    except ImportError:
        return frozenset()
    return frozenset(MODEL_TYPE_TO_APPLY_LIGER_FN)


def uses_fused_loss(choice: str, device_type: str, model_type: str) -> bool:
    """Whether ``--fused-loss`` ``choice`` trains with Liger's fused linear cross-entropy on a
    ``device_type`` ("cuda", "cpu") device for a ``model_type`` model: liger always (its
    Triton kernels then need CUDA, ``check_fused_loss``), none never, auto on CUDA for
    ``FUSED_LOSS_AUTO_TYPES`` where liger-kernel is installed."""
    if choice != "auto":
        return choice == "liger"
    return device_type == "cuda" and model_type in FUSED_LOSS_AUTO_TYPES and liger_installed()


def check_fused_loss(device_type: str, model_type: str) -> None:
    """Raise UserError where ``--fused-loss liger`` cannot run: a device other than CUDA (Liger's
    kernels are Triton GPU kernels), Liger Kernel not installed, or a model type it has no
    forward for."""
    if device_type != "cuda":
        raise UserError(
            f"--fused-loss liger runs Triton kernels on CUDA, and this run's device is "
            f"{device_type}; use --fused-loss none (or auto) on this device"
        )
    if not liger_installed():
        raise UserError(
            "--fused-loss liger needs the liger-kernel package (uv sync on Linux installs it); "
            "install it or use --fused-loss none"
        )
    if model_type not in liger_model_types():
        raise UserError(
            f"--fused-loss liger has no fused forward for {model_type or 'this'} models; use "
            "--fused-loss none (or auto, which falls back to it)"
        )


def apply_fused_loss(model: PreTrainedModel) -> None:
    """Give ``model`` (this instance only) Liger Kernel's forward for its model type: in
    training with labels, the hidden states [B, T, H] go to lm_head and cross-entropy in chunks
    of tokens (``LigerFusedLinearCrossEntropyFunction``), computing the loss (fp32, mean over
    trained tokens, or the sum over ``num_items_in_batch``) and the gradients of the hidden
    states and of lm_head's weight in the forward itself, so the [B, T, V] logits never exist
    (Hsu et al. 2024, "Liger Kernel: Efficient Triton Kernels for LLM Training",
    arXiv:2410.10989). In eval mode, or without labels, it computes the logits and
    transformers' loss as before. The same call HF Trainer makes for ``use_liger_kernel``
    (``_apply_liger_kernel_to_instance``), with Liger's other kernels off
    (``FUSED_LOSS_KERNELS_OFF``). Two host reads per training forward come with it (the count of
    trained tokens, and whether the loss's gradient is 1)."""
    from liger_kernel.transformers import _apply_liger_kernel_to_instance  # noqa: PLC0415

    off = dict.fromkeys(FUSED_LOSS_KERNELS_OFF, False)
    _apply_liger_kernel_to_instance(model=model, fused_linear_cross_entropy=True, **off)
