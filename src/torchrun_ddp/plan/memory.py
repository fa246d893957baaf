"""Dry-run memory and FLOP plan for DDP training of a causal LM: bytes per rank, before a run.

One concern in about 610 lines, kept whole on purpose: every row (weights, gradients, optimizer,
activations, LoRA, FSDP shards) feeds the same four-moment peak below, and a row read apart from
that peak would invite the sum-of-rows mistake the plan exists to avoid.

Everything here is byte arithmetic over the architecture (``architecture.Architecture``, read
from the model config; parameters counted on a meta-device model). The plan is an estimate, not
a measurement:

- Persistent state per rank: weights, DDP's gradient buckets and the AdamW moments (sharded by
  ``ZeroRedundancyOptimizer`` under zero1), plus a fixed overhead the caller can set (the CUDA
  context and NCCL buffers on a GPU, or the measured resident size of the Python process on CPU).
- Compression state, as the caller computes it (``plan.communication.state_bytes``): persistent
  error-feedback residuals and PowerSGD memories, and the comm hook's payload and decode buffers
  at the end of backward.
- Transient state: gradients (``zero_grad(set_to_none=True)`` frees them every step),
  activations saved for backward, the fp32 log-probabilities of the loss, the bf16 weight copies
  that autocast caches, and the one parameter-sized buffer foreach AdamW allocates in ``step()``.

The per-rank total is the peak over four moments of a training step (end of forward, start of
backward, end of backward, optimizer step), not the sum of every row: gradients are allocated
while activations are freed, so both are never at their maximum together. The sum is reported as
an upper bound. Not modelled: caching-allocator fragmentation on CUDA (reserved memory is usually
a few percent above allocated), evaluation, checkpoint saving, and the first step (AdamW creates
its state lazily, so step 1 peaks lower).

Architectures: the activation and autocast rows are derived for the LLaMA decoder layer
(``architecture.LLAMA_LAYOUT``: LLaMA, Mistral, Qwen2). Other causal LMs are planned from the
same formula with their own sizes and those rows are marked approximate; weights, gradients,
buckets and optimizer state are counted exactly for every architecture. LoRA
(``PlanSettings.adapter_sizes``): frozen base weights (bf16, or fp32 under fp32), fp32 adapters
with their gradients and AdamW moments; activations are full fine-tuning's estimate for a bf16
residual stream (approximate: frozen linears save less, adapters add rank-wide tensors).
Which setting changes make a plan fit, and several plans side by side: ``plan.fit``. The
settings, the byte tables, the activation derivation and the plans (full, LoRA, FSDP-sharded)
are one calculation, read top to bottom.

Sources: DDP buckets, https://pytorch.org/docs/stable/notes/ddp.html; ZeRO stage 1, Rajbhandari
et al. 2020 and ``torch.distributed.optim.ZeroRedundancyOptimizer``; activation accounting in
the style of Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer
Models"), redone for transformers' ``LlamaDecoderLayer`` with SDPA attention.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from transformers import PretrainedConfig

from torchrun_ddp.errors import UserError
from torchrun_ddp.plan.architecture import Architecture, architecture, model_flops_per_token

GIB = 2**30
MIB = 2**20
PRECISIONS = ("fp32", "bf16-mixed", "bf16")
"""fp32: everything fp32. bf16-mixed: fp32 weights, gradients and AdamW state, forward and
backward under ``torch.autocast(dtype=torch.bfloat16)``. bf16: weights and gradients in bf16
(``model_dtype = "bfloat16"``), no autocast, no fp32 master copy."""

DEFAULT_OVERHEAD_GIB = 1.0
"""Fixed per-rank overhead outside the tensors the plan counts, in GiB: a CUDA context (about
0.5 GiB on an H100 with lazy module loading) plus NCCL communicator buffers and cuBLAS workspaces
(about 0.5 GiB). An assumption, not a measurement: pass 0 to compare with
``torch.cuda.max_memory_allocated``, or a measured process baseline for CPU resident memory."""


@dataclass(frozen=True)
class PlanSettings:
    """One DDP training setup to plan for, per rank.

    ``device_memory_gib`` and ``overhead_gib`` are GiB (2**30 bytes); ``ddp_bucket_cap_mb`` is
    DDP's ``bucket_cap_mb`` (MiB). ``gradient_as_bucket_view`` is DDP's argument of that name
    (the trainer turns it on by default: --gradient-as-bucket-view). ``accumulation_steps`` > 1
    keeps the gradients of earlier micro-batches alive through the next forward. Raises UserError
    on a bad value.
    """

    world_size: int
    micro_batch: int
    seq_length: int
    precision: str = "fp32"
    zero1: bool = False
    activation_checkpointing: bool = False
    device_memory_gib: float = 80.0
    ddp_bucket_cap_mb: float = 25.0
    gradient_as_bucket_view: bool = False
    accumulation_steps: int = 1
    overhead_gib: float = DEFAULT_OVERHEAD_GIB
    fused_adamw: bool = False
    """torch's fused AdamW updates in place in one kernel: no step temporaries (foreach: one
    moment-sized buffer)."""
    compression_state_bytes: int = 0
    """Persistent comm-hook state per rank, bytes (error-feedback residuals, PowerSGD memories)."""
    compression_buffer_bytes: int = 0
    """Comm-hook payloads and decode buffers alive at the end of backward, bytes per rank."""
    adapter_sizes: tuple[int, ...] = ()
    """LoRA: element counts of the adapter parameters, the only ones that train (fp32); empty
    for full fine-tuning. The base weights are then frozen: bf16, or fp32 under fp32."""
    optimizer: str = "adamw"
    """``adamw`` (two moments per trained parameter) or ``demo`` (DeMo: one fp32 momentum per
    trained parameter, plus per-parameter transform buffers in its step)."""
    data_parallel: str = "ddp"
    """``ddp`` (every rank a whole replica), ``fsdp`` (weights, gradients and AdamW moments
    sharded over all ``world_size`` ranks) or ``hsdp`` (sharded over ``shard_degree`` ranks)."""
    shard_degree: int = 0
    """hsdp: ranks one replica is sharded over (0: ``world_size``, as fsdp)."""
    fused_loss: bool = False
    """Liger's fused linear cross-entropy (--fused-loss): no [B, T, V] logits; see
    ``fused_loss_bytes``."""

    @property
    def shard_ranks(self) -> int:
        """Ranks the weights, gradients and optimizer state are sharded over (1 under ddp)."""
        if self.data_parallel == "ddp":
            return 1
        if self.data_parallel == "hsdp" and self.shard_degree:
            return self.shard_degree
        return self.world_size

    @property
    def lora(self) -> bool:
        """Whether only LoRA adapters train."""
        return bool(self.adapter_sizes)

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise UserError(
                f"precision {self.precision!r} is not one of {', '.join(PRECISIONS)}; pick one"
            )
        counts = ("world_size", "micro_batch", "seq_length", "accumulation_steps")
        for name in counts:
            if getattr(self, name) < 1:
                raise UserError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.device_memory_gib <= 0 or self.ddp_bucket_cap_mb <= 0 or self.overhead_gib < 0:
            raise UserError(
                "device_memory_gib and ddp_bucket_cap_mb must be positive and overhead_gib "
                f"non-negative, got {self.device_memory_gib}, {self.ddp_bucket_cap_mb}, "
                f"{self.overhead_gib}"
            )

    def describe(self) -> str:
        """A one-line label, e.g. ``bf16-mixed + zero1 + checkpointing, 8 x 80 GiB, micro-batch
        4 x 512 tokens``."""
        parts = [self.precision]
        parts += [f"{self.data_parallel} over {self.shard_ranks}"] if self.shard_ranks > 1 else []
        parts += ["zero1"] if self.zero1 else []
        parts += ["checkpointing"] if self.activation_checkpointing else []
        parts += ["grad bucket view"] if self.gradient_as_bucket_view else []
        parts += ["LoRA"] if self.lora else []
        parts += ["DeMo"] if self.optimizer == "demo" else []
        parts += ["fused loss"] if self.fused_loss else []
        return (
            f"{' + '.join(parts)}, {self.world_size} x {self.device_memory_gib:g} GiB, "
            f"micro-batch {self.micro_batch} x {self.seq_length} tokens"
        )


@dataclass(frozen=True)
class _Bytes:
    """Bytes per element of each kind of state under one precision."""

    weight: int
    grad: int
    moment: int
    residual: int
    """The residual stream between layers (what activation checkpointing keeps per layer)."""


_PRECISION_BYTES = {
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


_SAVED = {
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


def activation_estimate(arch: Architecture, settings: PlanSettings) -> ActivationEstimate:
    """Estimate the activations of one micro-batch of B x T tokens, in bytes.

    Per layer: ``B T (norms H + query Q + key_value K + mlp I + 4 A + 8)`` with the per-precision
    coefficients of ``_SAVED`` (Q = heads x head_dim, K = kv_heads x head_dim, A = heads; 4 A is
    SDPA's fp32 log-sum-exp, 8 the fp32 inverse RMS of the two norms). After the layers, the final
    norm and lm_head's input, ``B T (head H + 4)``. Under activation checkpointing (transformers'
    non-reentrant ``gradient_checkpointing_enable``) a layer keeps only its input, ``B T H``
    residual-stream elements, and recomputes the rest during backward.

    The loss: transformers upcasts the [B, T, V] logits to fp32 and cross-entropy saves fp32
    log-probabilities, 4 B T V bytes; the end of forward also holds the logits themselves (fp32:
    8 B T V in all; bf16 logits plus their fp32 copy: 10 B T V), and the start of backward holds
    the log-probs, their gradient and the logits' gradient (12 B T V). For vocab 32000 this term
    dwarfs the layers of a small model. Under ``settings.fused_loss`` it is
    ``fused_loss_bytes`` instead.
    """
    tokens = settings.micro_batch * settings.seq_length
    compute = _activation_precision(settings)
    saved = _SAVED[compute]
    mlp = saved.mlp * arch.active_intermediate
    width = saved.norms * arch.hidden + saved.query * arch.q_dim + mlp
    per_token = width + saved.key_value * arch.kv_dim + 4 * arch.heads + 2 * 4
    layer = tokens * per_token
    per_layer = layer
    if settings.activation_checkpointing:
        per_layer = tokens * arch.hidden * _PRECISION_BYTES[compute].residual
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
    residual = _PRECISION_BYTES[compute].residual
    head = 0 if settings.lora else residual
    grads = tokens * arch.hidden * residual + arch.vocab * arch.hidden * head
    chunk = min(
        1 << (math.ceil(tokens / math.ceil(arch.vocab / arch.hidden)) - 1).bit_length(), tokens
    )
    logit_bytes = 4 if settings.precision == "fp32" else 2
    return grads + chunk * arch.vocab * logit_bytes, grads


def _activation_precision(settings: PlanSettings) -> str:
    """The precision the activations are saved in: bf16-mixed under FSDP gathers bf16 weights
    and runs without autocast (``MixedPrecisionPolicy(param_dtype=bfloat16)``), so its layers
    save what pure bf16 saves, with a bf16 residual stream."""
    if settings.precision == "bf16-mixed" and settings.data_parallel != "ddp":
        return "bf16"
    return settings.precision


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


def zero_shard(parameters: int, world_size: int, sizes: Sequence[int] | None = None) -> int:
    """Parameters whose AdamW state the busiest rank holds under ZeroRedundancyOptimizer.

    With ``sizes`` (element counts of the parameter tensors): ZeroRedundancyOptimizer's greedy
    partition, largest tensor first onto the rank with the fewest elements so far (one parameter
    group assumed). Without: an even split, ``ceil(parameters / world_size)``.
    """
    if not sizes:
        return math.ceil(parameters / world_size)
    loads = [0] * world_size
    for size in sorted(sizes, reverse=True):
        rank = loads.index(min(loads))
        loads[rank] += size
    return max(loads)


@dataclass(frozen=True)
class MemoryPlan:
    """Per-rank memory of one training setup, in bytes, and the model FLOPs per token.

    ``activations`` is the peak for one micro-batch (saved tensors plus the loss's logits at the
    start of backward); ``phases`` maps each moment of a step to its total, and ``total`` is the
    largest. ``headroom`` is device memory minus total (negative when it does not fit).
    """

    settings: PlanSettings
    parameters: int
    weights: int
    gradients: int
    ddp_buckets: int
    optimizer_state: int
    optimizer_step_temporaries: int
    autocast_weight_copies: int
    activations: int
    overhead: int
    flops_per_token: float
    compression_state: int = 0
    compression_buffers: int = 0
    gathered_units: int = 0
    """FSDP: the units all-gathered at once (the root, kept from forward to backward, and two
    decoder layers: the one computing and the one prefetched), in the compute dtype."""
    phases: dict[str, int] = field(default_factory=dict)
    approximate: tuple[str, ...] = ()
    """Rows estimated by analogy rather than derived for this architecture: ``activations``
    and ``autocast`` outside ``LLAMA_LAYOUT``, ``activations`` under LoRA."""

    @property
    def total(self) -> int:
        """Peak bytes per rank: the largest phase."""
        return max(self.phases.values())

    @property
    def peak_phase(self) -> str:
        """The moment of the step at which the peak occurs."""
        return max(self.phases, key=lambda name: self.phases[name])

    @property
    def upper_bound(self) -> int:
        """Every row added up, bytes: what a plan that ignored the timing would claim."""
        rows = (self.weights, self.gradients, self.ddp_buckets, self.optimizer_state)
        rows += (self.optimizer_step_temporaries, self.autocast_weight_copies)
        rows += (self.compression_state, self.compression_buffers, self.gathered_units)
        return sum(rows) + self.activations + self.overhead

    @property
    def device_memory(self) -> int:
        """The device's memory in bytes."""
        return int(self.settings.device_memory_gib * GIB)

    @property
    def headroom(self) -> int:
        """Device memory minus the peak, bytes (negative: short by that much)."""
        return self.device_memory - self.total

    @property
    def fits(self) -> bool:
        """Whether the peak fits in device memory."""
        return self.headroom >= 0

    def verdict(self) -> str:
        """``fits, 12.3 GiB headroom`` or ``does not fit, 4.5 GiB short``."""
        if self.fits:
            return f"fits, {self.headroom / GIB:.1f} GiB headroom"
        return f"does not fit, {-self.headroom / GIB:.1f} GiB short"

    def _bucket_label(self, buckets: int, views: str) -> str:
        """The DDP-buckets row's name (none under FSDP, which has no buckets)."""
        if self.settings.shard_ranks > 1:
            return "DDP buckets (none: FSDP reduce-scatters unit by unit)"
        return f"DDP buckets (about {buckets} of {self.settings.ddp_bucket_cap_mb:g} MiB{views})"

    def table(self) -> str:
        """The plan as a Markdown table in GiB per rank, with the verdict."""
        cap = self.settings.ddp_bucket_cap_mb
        buckets = math.ceil(self.gradients / (cap * MIB))
        views = (
            " (the gradients are views into them)" if self.settings.gradient_as_bucket_view else ""
        )
        kernel = "fused" if self.settings.fused_adamw else "foreach"
        state, step = "AdamW moments", f"{kernel} AdamW"
        if self.settings.optimizer == "demo":
            state, step = "DeMo momentum", "DeMo tile transforms, largest parameter"
        weights, trained = "weights", ""
        if self.settings.shard_ranks > 1:
            weights = f"weights (a 1/{self.settings.shard_ranks} shard)"
        if self.settings.lora:
            base = "fp32" if self.settings.precision == "fp32" else "bf16"
            weights, trained = f"weights (frozen {base} base + fp32 LoRA adapters)", " of adapters"
        rows = [
            (weights, self.weights),
            (f"gradients{trained}", self.gradients),
            (self._bucket_label(buckets, views), self.ddp_buckets),
            (f"optimizer state ({state}{trained})", self.optimizer_state),
            (f"optimizer step temporaries ({step})", self.optimizer_step_temporaries),
            ("activations (per micro-batch, with the loss)", self.activations),
            ("autocast bf16 weight copies", self.autocast_weight_copies),
            ("FSDP gathered units (root + 2 layers, compute dtype)", self.gathered_units),
            ("compression state (error-feedback residuals)", self.compression_state),
            ("compression buffers (payloads, decode; end of backward)", self.compression_buffers),
            ("overhead (CUDA context, NCCL / process baseline)", self.overhead),
        ]
        lines = [f"| {self.settings.describe()} | GiB per rank |", "|---|---:|"]
        for name, size in rows:
            rough = any(name.startswith(row) for row in self.approximate)
            lines.append(f"| {name}{' (approximate)' if rough else ''} | {size / GIB:.2f} |")
        lines += [
            f"| **total (peak, at {self.peak_phase})** | **{self.total / GIB:.2f}** |",
            f"| sum of all rows (upper bound) | {self.upper_bound / GIB:.2f} |",
            f"| device memory | {self.device_memory / GIB:.2f} |",
            f"| verdict | {self.verdict()} |",
        ]
        return "\n".join(lines)


def plan_memory(
    config: PretrainedConfig,
    parameters: int,
    settings: PlanSettings,
    parameter_sizes: Sequence[int] | None = None,
    active_parameters: int | None = None,
) -> MemoryPlan:
    """The per-rank memory plan of DDP training with torch's foreach AdamW, in bytes.

    Per parameter (N = ``parameters``): weights 4 B (fp32, bf16-mixed) or 2 B (bf16); gradients
    the same; DDP's bucket copy the same again (DDP keeps a flat copy of the gradients for the
    all-reduce unless ``gradient_as_bucket_view=True``, when the gradients are views into the
    buckets and stay allocated between steps); AdamW's exp_avg and exp_avg_sq 2 x 4 B (2 x 2 B in
    bf16, where torch keeps them in the parameters' dtype), on ceil(N / world_size) parameters
    under zero1 (the busiest rank of ZeroRedundancyOptimizer's partition when ``parameter_sizes``
    is given); foreach AdamW's ``step()`` allocates one more moment-sized buffer (the square root
    of exp_avg_sq) over the rank's parameters. So fp32 DDP holds 20 B per parameter before
    activations (LLaMA-2-7B: 125.5 GiB), and peaks at 24 B in the optimizer step. Under
    ``optimizer="demo"`` the state is DeMo's one fp32 momentum (4 B; never sharded) and its
    step temporaries are ``DEMO_STEP_COPIES`` fp32 copies of the largest parameter.

    The phases, with P = weights + buckets + optimizer state + overhead: end of forward = P +
    saved activations + forward logits + autocast copies; start of backward = P + saved
    activations + backward logits (+ copies still saved); end of backward = P + gradients + one
    layer's activations; optimizer step = P + gradients + step temporaries. Gradients join the
    first two when accumulation keeps them or they are bucket views.

    LoRA (``settings.adapter_sizes``, ``parameters`` = the base model's): weights are the frozen
    base (2 B, or 4 B under fp32) plus the fp32 adapters; gradients, buckets, moments and step
    temporaries cover the adapters only, at fp32 sizes (see ``_lora_plan``). FLOPs per token use
    ``active_parameters`` when given (a mixture of experts runs only some experts per token).
    Raises UserError when the config is not a decoder config or ``seq_length`` exceeds its
    positions.
    """
    arch = architecture(config)
    if arch.max_positions and settings.seq_length > arch.max_positions:
        raise UserError(
            f"seq_length {settings.seq_length} exceeds the model's {arch.max_positions} "
            "positions; plan a shorter sequence"
        )
    if settings.lora:
        return _lora_plan(arch, parameters, settings, active_parameters)
    if settings.data_parallel != "ddp":
        return _sharded_plan(arch, parameters, settings, active_parameters)
    size = _PRECISION_BYTES[settings.precision]
    shard = parameters
    if settings.zero1:
        shard = zero_shard(parameters, settings.world_size, parameter_sizes)
    gradients = parameters * size.grad
    activations = activation_estimate(arch, settings)
    copies_forward, copies_backward = autocast_copy_bytes(arch, settings)
    plan = MemoryPlan(
        settings=settings,
        parameters=parameters,
        weights=parameters * size.weight,
        gradients=gradients,
        ddp_buckets=0 if settings.gradient_as_bucket_view else gradients,
        optimizer_state=_state_bytes(settings, size.moment) * shard,
        optimizer_step_temporaries=_step_temporaries(
            settings, size.moment * shard, parameter_sizes or arch.parameter_sizes()
        ),
        autocast_weight_copies=copies_forward,
        activations=activations.saved + activations.loss_backward,
        overhead=int(settings.overhead_gib * GIB),
        compression_state=settings.compression_state_bytes,
        compression_buffers=settings.compression_buffer_bytes,
        flops_per_token=model_flops_per_token(
            active_parameters or parameters, arch.layers, arch.hidden, settings.seq_length
        ),
        approximate=() if arch.exact else ("activations", "autocast"),
    )
    return replace(plan, phases=_phases(plan, activations, copies_backward))


def _lora_plan(
    arch: Architecture, parameters: int, settings: PlanSettings, active: int | None
) -> MemoryPlan:
    """``plan_memory`` under LoRA: frozen base weights, fp32 adapters (A: r x in, B: out x r)
    with fp32 gradients, buckets and AdamW moments (ZeRO-1 partitions the adapters).

    Activations: the full fine-tuning estimate with bf16 coefficients when the base is bf16 (the
    residual stream is then bf16), fp32 ones under fp32; approximate, because frozen linears do
    not save their inputs while each adapter saves its (dropped-out) input and an r-wide tensor.
    Autocast copies (bf16-mixed): only the adapters' weights are cast (2 B each); the base is
    already bf16.
    """
    trainable = sum(settings.adapter_sizes)
    base_bytes = 4 if settings.precision == "fp32" else 2
    shard = trainable
    if settings.zero1:
        shard = zero_shard(trainable, settings.world_size, settings.adapter_sizes)
    activation_precision = "fp32" if settings.precision == "fp32" else "bf16"
    activations = activation_estimate(arch, replace(settings, precision=activation_precision))
    copies = 2 * trainable if settings.precision == "bf16-mixed" else 0
    plan = MemoryPlan(
        settings=settings,
        parameters=parameters,
        weights=parameters * base_bytes + 4 * trainable,
        gradients=4 * trainable,
        ddp_buckets=0 if settings.gradient_as_bucket_view else 4 * trainable,
        optimizer_state=_state_bytes(settings, 4) * shard,
        optimizer_step_temporaries=_step_temporaries(settings, 4 * shard, settings.adapter_sizes),
        autocast_weight_copies=copies,
        activations=activations.saved + activations.loss_backward,
        overhead=int(settings.overhead_gib * GIB),
        compression_state=settings.compression_state_bytes,
        compression_buffers=settings.compression_buffer_bytes,
        flops_per_token=model_flops_per_token(
            trainable, arch.layers, arch.hidden, settings.seq_length, frozen=active or parameters
        ),
        approximate=("activations",) if arch.exact else ("activations", "autocast"),
    )
    return replace(plan, phases=_phases(plan, activations, copies))


def _sharded_plan(
    arch: Architecture, parameters: int, settings: PlanSettings, active: int | None
) -> MemoryPlan:
    """``plan_memory`` under FSDP (``settings.shard_ranks`` = S, 1 or more): each rank keeps a 1/S
    shard of the weights, the gradients and the AdamW moments (FSDP2 pads each tensor's rows to
    a multiple of S: at most S - 1 rows more, not counted). Units are gathered in the compute
    dtype (bf16 under bf16-mixed) one layer at a time: the root unit (embedding, final norm,
    head) stays gathered from forward to backward, plus the layer computing and the one
    prefetched (``gathered_units``); the gradient of one unit is reduce-scattered at a time, in
    the reduce dtype (the compression-buffer row). Under gradient accumulation the micro-batches
    before the last keep each unit's unsharded gradient (``set_requires_gradient_sync(False)``):
    a whole model's gradients in float32 (in the gradients row). No autocast copies (the
    gathered units are already bf16) and no DDP buckets.
    """
    size = _PRECISION_BYTES[settings.precision]
    shards = settings.shard_ranks
    shard = math.ceil(parameters / shards)
    compute = 4 if settings.precision == "fp32" else 2
    root = arch.vocab * arch.hidden * (1 if arch.tied_embeddings else 2) + arch.hidden
    layer = (parameters - root) // max(arch.layers, 1)
    unsharded = parameters * size.grad if settings.accumulation_steps > 1 else 0
    activations = activation_estimate(arch, settings)
    plan = MemoryPlan(
        settings=settings,
        parameters=parameters,
        weights=shard * size.weight,
        gradients=shard * size.grad + unsharded,
        ddp_buckets=0,
        optimizer_state=_state_bytes(settings, size.moment) * shard,
        optimizer_step_temporaries=_step_temporaries(settings, size.moment * shard, [shard]),
        autocast_weight_copies=0,
        activations=activations.saved + activations.loss_backward,
        overhead=int(settings.overhead_gib * GIB),
        compression_state=settings.compression_state_bytes,
        compression_buffers=settings.compression_buffer_bytes + max(root, layer) * size.grad,
        gathered_units=(root + 2 * layer) * compute,
        flops_per_token=model_flops_per_token(
            active or parameters, arch.layers, arch.hidden, settings.seq_length
        ),
        approximate=() if arch.exact else ("activations",),
    )
    return replace(plan, phases=_phases(plan, activations, 0))


DEMO_STEP_COPIES = 5
"""fp32 copies of one parameter alive at once in DeMo's step: its momentum's DCT coefficients,
the sent coefficients and their inverse, then the decode's sum, sender count and inverse."""


def _state_bytes(settings: PlanSettings, moment: int) -> int:
    """Optimizer state bytes per trained parameter: AdamW two moments of ``moment`` bytes,
    DeMo one fp32 momentum."""
    return 4 if settings.optimizer == "demo" else 2 * moment


def _step_temporaries(settings: PlanSettings, moment_bytes: int, sizes: Sequence[int]) -> int:
    """Bytes the optimizer step allocates: fused AdamW none, foreach AdamW one moment-sized
    buffer (``moment_bytes``), DeMo ``DEMO_STEP_COPIES`` fp32 copies of the largest parameter
    (it works one parameter at a time)."""
    if settings.optimizer == "demo":
        return DEMO_STEP_COPIES * 4 * max(sizes, default=0)
    return 0 if settings.fused_adamw else moment_bytes


def _phases(plan: MemoryPlan, act: ActivationEstimate, copies_backward: int) -> dict[str, int]:
    """Bytes per rank at four moments of a step (see ``plan_memory``)."""
    persistent = plan.weights + plan.ddp_buckets + plan.optimizer_state + plan.overhead
    persistent += plan.compression_state + plan.gathered_units
    settings = plan.settings
    kept = settings.accumulation_steps > 1 or settings.gradient_as_bucket_view
    held = plan.gradients if kept else 0
    forward = act.saved + plan.autocast_weight_copies + act.loss_forward
    return {
        "end of forward": persistent + held + forward,
        "start of backward": persistent + held + act.saved + copies_backward + act.loss_backward,
        "end of backward": persistent + plan.gradients + act.layer + plan.compression_buffers,
        "optimizer step": persistent + plan.gradients + plan.optimizer_step_temporaries,
    }
