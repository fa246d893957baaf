"""Activation memory of one micro-batch: what each decoder layer saves for backward, the loss's
tensors (the logits, or Liger's fused loss), and the bf16 weight copies autocast caches.

Derived for the LLaMA decoder layer (``architecture.LLAMA_LAYOUT``: LLaMA, Mistral, Qwen2) by
reading what autograd saves in transformers' ``LlamaDecoderLayer`` with SDPA attention, in the
style of Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer
Models"); other architectures get the same formula with their own sizes, marked approximate by
the plan.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torchrun_ddp.plan.architecture import Architecture
from torchrun_ddp.plan.settings import PlanSettings


@dataclass(frozen=True)
class _Bytes:
    """Bytes per element of each kind of state under one precision."""

    weight: int
    grad: int
    moment: int
    residual: int
    """The residual stream between layers (what activation checkpointing keeps per layer)."""


PRECISION_BYTES = {
    "fp32": _Bytes(weight=4, grad=4, moment=4, residual=4),
    "bf16-mixed": _Bytes(weight=4, grad=4, moment=4, residual=4),
    "bf16": _Bytes(weight=2, grad=2, moment=2, residual=2),
}
"""bf16: torch's AdamW creates its moments with ``zeros_like(param)``, so bf16 parameters get
bf16 moments (2 + 2 bytes per parameter); there is no fp32 master copy."""


@dataclass(frozen=True)
class _Saved:
    """Bytes saved for backward per token, per unit of width, in one decoder layer.

    ``norms``: both RMSNorms per hidden unit (their fp32 input, normalised value and output) plus,
    under autocast, the bf16 copy of the normalised input that each of q, k, v, gate and up makes
    for itself. ``query``: q after RoPE and the SDPA output, per query unit. ``key_value``: k after
    RoPE and v, per kv unit. ``mlp``: gate, SiLU(gate), up and their product, per intermediate
    unit. ``head``: the final norm and lm_head's input, per hidden unit.
    """

    norms: int
    query: int
    key_value: int
    mlp: int
    head: int


SAVED = {
    "fp32": _Saved(norms=2 * 12, query=8, key_value=8, mlp=16, head=12),
    "bf16-mixed": _Saved(norms=2 * 8 + 5 * 2, query=4, key_value=4, mlp=8, head=10),
    "bf16": _Saved(norms=2 * 8, query=4, key_value=4, mlp=8, head=8),
}
"""Derived by reading what autograd saves in transformers' LlamaDecoderLayer (RMSNorm upcasts its
input to fp32; RoPE multiplies by constant cos/sin so saves nothing of size; SDPA keeps q, k, v,
its output and an fp32 log-sum-exp, never the T x T matrix; linears save their input):
fp32 4(3 + 3) H for the norms, 4 (q + out), 4 (k + v), 4 x 4 I for the MLP, i.e. 40 H + 16 I
for multi-head attention; bf16-mixed 2 x (4 + 4) H fp32 norm tensors + 5 x 2 H autocast input
copies, 2 (q + out), 2 (k + v), 4 x 2 I: 34 H + 8 I; bf16 2 x (4 + 2 + 2) H, 2 (q + out),
2 (k + v), 4 x 2 I: 24 H + 8 I. tests/test_memory_plan.py checks them against saved-tensor hooks."""


@dataclass(frozen=True)
class ActivationEstimate:
    """Activation memory of one micro-batch, bytes per rank.

    ``saved``: what is kept for backward at the end of forward, without the loss (every layer's
    saved tensors, or only each layer's input under checkpointing, plus the final norm).
    ``layer``: one layer's saved tensors (recomputed during backward under checkpointing).
    ``loss_forward`` / ``loss_backward``: the [B, T, V] logits tensors alive at the end of
    forward and at the start of backward.
    """

    saved: int
    layer: int
    loss_forward: int
    loss_backward: int


def activation_estimate(
    arch: Architecture, settings: PlanSettings, compute: str = ""
) -> ActivationEstimate:
    """Estimate the activations of one micro-batch of B x T tokens, in bytes.

    Per layer: ``B T (norms H + query Q + key_value K + mlp I + 4 A + 8)`` with the per-precision
    coefficients of ``SAVED`` (Q = heads x head_dim, K = kv_heads x head_dim, A = heads; 4 A is
    SDPA's fp32 log-sum-exp, 8 the fp32 inverse RMS of the two norms). After the layers, the final
    norm and lm_head's input, ``B T (head H + 4)``. Under activation checkpointing (transformers'
    non-reentrant ``gradient_checkpointing_enable``) a layer keeps only its input, ``B T H``
    residual-stream elements, and recomputes the rest during backward. ``compute``: the
    precision the activations are saved in (``settings.precision`` when empty; FSDP's
    bf16-mixed computes in bf16 throughout, so its layers save what pure bf16 saves).

    The loss: transformers upcasts the [B, T, V] logits to fp32 and cross-entropy saves fp32
    log-probabilities, 4 B T V bytes; the end of forward also holds the logits themselves (fp32:
    8 B T V in all; bf16 logits plus their fp32 copy: 10 B T V), and the start of backward holds
    the log-probs, their gradient and the logits' gradient (12 B T V). For vocab 32000 this term
    dwarfs the layers of a small model. Under ``settings.fused_loss`` it is
    ``fused_loss_bytes`` instead.
    """
    tokens = settings.micro_batch * settings.seq_length
    compute = compute or settings.precision
    saved = SAVED[compute]
    mlp = saved.mlp * arch.active_intermediate
    width = saved.norms * arch.hidden + saved.query * arch.q_dim + mlp
    per_token = width + saved.key_value * arch.kv_dim + 4 * arch.heads + 2 * 4
    layer = tokens * per_token
    per_layer = layer
    if settings.activation_checkpointing:
        per_layer = tokens * arch.hidden * PRECISION_BYTES[compute].residual
    logits = tokens * arch.vocab
    fp32_logits = settings.precision == "fp32"
    loss_forward, loss_backward = (8 if fp32_logits else 10) * logits, 12 * logits
    if settings.fused_loss:
        loss_forward, loss_backward = fused_loss_bytes(arch, settings, compute)
    return ActivationEstimate(
        saved=arch.layers * per_layer + tokens * (arch.hidden * saved.head + 4),
        layer=layer,
        loss_forward=loss_forward,
        loss_backward=loss_backward,
    )


def fused_loss_bytes(arch: Architecture, settings: PlanSettings, compute: str) -> tuple[int, int]:
    """Bytes of Liger's fused linear cross-entropy for one micro-batch of B T tokens: (during
    forward, at the start of backward). Its forward computes the gradients too, so it holds
    the hidden states' gradient [B T, H] (the residual stream's dtype), lm_head's weight gradient
    [V, H] (the weight's dtype as computed: fp32 under DDP, bf16 gathered under FSDP's
    bf16-mixed; none for a frozen head under LoRA) and one chunk of logits [C, V] (bf16 unless
    fp32), C = min(next power of 2 of ceil(B T / ceil(V / H)), B T), as
    ``liger_kernel.ops.fused_linear_cross_entropy`` sizes it; backward starts with the two
    gradients only."""
    tokens = settings.micro_batch * settings.seq_length
    residual = PRECISION_BYTES[compute].residual
    head = 0 if settings.lora else residual
    grads = tokens * arch.hidden * residual + arch.vocab * arch.hidden * head
    chunk = min(
        1 << (math.ceil(tokens / math.ceil(arch.vocab / arch.hidden)) - 1).bit_length(), tokens
    )
    logit_bytes = 4 if settings.precision == "fp32" else 2
    return grads + chunk * arch.vocab * logit_bytes, grads


def autocast_copy_bytes(arch: Architecture, settings: PlanSettings) -> tuple[int, int]:
    """The bf16 weight copies autocast caches, in bytes: (at the end of forward, at the start of
    backward).

    Under bf16-mixed every ``nn.Linear`` weight (the layers' seven and lm_head) is cast once to
    bf16, 2 bytes per element, and cached until autocast exits; the linears also save the copy
    for backward. With checkpointing only lm_head's copy (outside the checkpointed layers) is
    still saved when backward starts. Zero for fp32 and bf16.
    """
    if settings.precision != "bf16-mixed":
        return 0, 0
    lm_head = 2 * arch.vocab * arch.hidden
    every = 2 * arch.layers * arch.layer_linear_parameters() + lm_head
    return every, lm_head if settings.activation_checkpointing else every
