"""The per-rank memory plan of training a causal LM, in bytes, before a run: the rows, the
peak over a step, and the three calculations that fill them (a whole replica per rank, LoRA's
frozen base with trained adapters, FSDP's shards), which the data-parallel modes call.

Everything here is byte arithmetic over the architecture (``architecture.Architecture``, read
from the model config; parameters counted on a meta-device model). The plan is an estimate, not
a measurement:

- Persistent state per rank: weights, DDP's gradient buckets and the optimizer's state (its
  ``settings.Footprint``: AdamW's two moments, DeMo's momentum; sharded by
  ``ZeroRedundancyOptimizer`` under zero1 or with the weights by FSDP), plus a fixed overhead the
  caller can set (the CUDA context and NCCL buffers on a GPU, or the measured resident size of
  the Python process on CPU).
- Compression state, as the caller computes it (``plan.communication.state_bytes``): persistent
  error-feedback residuals and PowerSGD memories, and the comm hook's payload and decode buffers
  at the end of backward.
- Transient state: gradients (``zero_grad(set_to_none=True)`` frees them every step),
  activations saved for backward and the loss's tensors (``activations``), the bf16 weight copies
  that autocast caches, and the optimizer step's temporaries.

The per-rank total is the peak over four moments of a training step (end of forward, start of
backward, end of backward, optimizer step), not the sum of every row: gradients are allocated
while activations are freed, so both are never at their maximum together. The sum is reported as
an upper bound. Not modelled: caching-allocator fragmentation on CUDA (reserved memory is usually
a few percent above allocated), evaluation, checkpoint saving, and the first step (AdamW creates
its state lazily, so step 1 peaks lower).

Which plan a run gets (its mode's and its method's rows) and which setting changes make it fit:
``planning``.

Sources: DDP buckets, https://pytorch.org/docs/stable/notes/ddp.html; ZeRO stage 1, Rajbhandari
et al. 2020 and ``torch.distributed.optim.ZeroRedundancyOptimizer``; FSDP2,
https://docs.pytorch.org/docs/stable/distributed.fsdp.fully_shard.html.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from torchrun_ddp.errors import UserError
from torchrun_ddp.plan.activations import (
    PRECISION_BYTES,
    ActivationEstimate,
    activation_estimate,
    autocast_copy_bytes,
)
from torchrun_ddp.plan.architecture import Architecture, model_flops_per_token
from torchrun_ddp.plan.settings import GIB, MIB, Footprint, PlanSettings


@dataclass(frozen=True)
class PlanRequest:
    """What a plan is computed from: the model's ``arch`` with its ``parameters`` (elements;
    ``sizes``: each tensor's, for ZeRO-1's partition and the optimizer's step; ``active``: those
    a token passes through, for FLOPs), the run's ``settings`` and its optimizer's
    ``footprint``."""

    arch: Architecture
    parameters: int
    settings: PlanSettings
    footprint: Footprint
    sizes: Sequence[int] | None = None
    active: int | None = None


@dataclass(frozen=True)
class RowLabels:
    """The names of a plan's rows that depend on the mode and the optimizer, and their parts of
    the plan's one-line description (``layout``: "fsdp over 8"; ``optimizer``: "DeMo")."""

    weights: str = "weights"
    buckets: str = "DDP buckets"
    state: str = "AdamW moments"
    step: str = "foreach AdamW"
    layout: str = ""
    optimizer: str = ""


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
    labels: RowLabels = field(default_factory=RowLabels)
    """The names of its rows and of its setting, from the mode and the optimizer."""

    def describe(self) -> str:
        """A one-line label, e.g. ``bf16-mixed + zero1 + checkpointing, 8 x 80 GiB, micro-batch
        4 x 512 tokens``: the settings, the mode's sharding and the optimizer's label."""
        s = self.settings
        parts = [s.precision, *([self.labels.layout] if self.labels.layout else [])]
        parts += ["zero1"] if s.zero1 else []
        parts += ["checkpointing"] if s.activation_checkpointing else []
        parts += ["grad bucket view"] if s.gradient_as_bucket_view else []
        parts += ["LoRA"] if s.lora else []
        parts += [self.labels.optimizer] if self.labels.optimizer else []
        parts += ["fused loss"] if s.fused_loss else []
        return (
            f"{' + '.join(parts)}, {s.world_size} x {s.device_memory_gib:g} GiB, "
            f"micro-batch {s.micro_batch} x {s.seq_length} tokens"
        )

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

    def table(self) -> str:
        """The plan as a Markdown table in GiB per rank, with the verdict."""
        labels = self.labels
        trained = " of adapters" if self.settings.lora else ""
        rows = [
            (labels.weights, self.weights),
            (f"gradients{trained}", self.gradients),
            (labels.buckets, self.ddp_buckets),
            (f"optimizer state ({labels.state}{trained})", self.optimizer_state),
            (f"optimizer step temporaries ({labels.step})", self.optimizer_step_temporaries),
            ("activations (per micro-batch, with the loss)", self.activations),
            ("autocast bf16 weight copies", self.autocast_weight_copies),
            ("FSDP gathered units (root + 2 layers, compute dtype)", self.gathered_units),
            ("compression state (error-feedback residuals)", self.compression_state),
            ("compression buffers (payloads, decode; end of backward)", self.compression_buffers),
            ("overhead (CUDA context, NCCL / process baseline)", self.overhead),
        ]
        lines = [f"| {self.describe()} | GiB per rank |", "|---|---:|"]
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


def unpack(request: PlanRequest) -> tuple[Architecture, int, PlanSettings, Footprint]:
    """(arch, parameters, settings, footprint) of ``request``."""
    return request.arch, request.parameters, request.settings, request.footprint


def matrix_share(arch: Architecture, parameters: int) -> float:
    """The share of a fully trained model's ``parameters`` in its hidden layers' matrices
    (``Architecture.layer_linear_parameters``; ``model.hidden_matrices`` finds the same on a
    LLaMA), for an optimizer that treats those apart (``Footprint.matrix_moments``)."""
    return min(1.0, arch.layers * arch.layer_linear_parameters() / max(parameters, 1))


def check_positions(arch: Architecture, settings: PlanSettings) -> None:
    """Raise UserError when ``settings.seq_length`` exceeds the model's positions."""
    if arch.max_positions and settings.seq_length > arch.max_positions:
        raise UserError(
            f"seq_length {settings.seq_length} exceeds the model's {arch.max_positions} "
            "positions; plan a shorter sequence"
        )


def _labels(settings: PlanSettings, footprint: Footprint, **rows: str) -> RowLabels:
    """Row labels from the optimizer's ``footprint`` and the mode's ``rows``."""
    return RowLabels(
        state=footprint.state,
        step=footprint.step_name(settings.fused_adamw),
        optimizer=footprint.label,
        **rows,
    )


def _bucket_label(settings: PlanSettings, gradients: int) -> str:
    """DDP's buckets row: how many of --ddp-bucket-cap-mb, and whether gradients view them."""
    cap = settings.ddp_bucket_cap_mb
    buckets = math.ceil(gradients / (cap * MIB))
    views = " (the gradients are views into them)" if settings.gradient_as_bucket_view else ""
    return f"DDP buckets (about {buckets} of {cap:g} MiB{views})"


def replicated_plan(request: PlanRequest) -> MemoryPlan:
    """The plan of a whole replica per rank (DDP), every weight trained, in bytes.

    Per parameter (N = ``parameters``): weights 4 B (fp32, bf16-mixed) or 2 B (bf16); gradients
    the same; DDP's bucket copy the same again (DDP keeps a flat copy of the gradients for the
    all-reduce unless ``gradient_as_bucket_view=True``, when the gradients are views into the
    buckets and stay allocated between steps); the optimizer's state (``footprint``: AdamW's
    exp_avg and exp_avg_sq 2 x 4 B, 2 x 2 B in bf16, where torch keeps them in the parameters'
    dtype), on ceil(N / world_size) parameters under zero1 (the busiest rank of
    ZeroRedundancyOptimizer's partition when ``parameter_sizes`` is given); foreach AdamW's
    ``step()`` allocates one more moment-sized buffer (the square root of exp_avg_sq) over the
    rank's parameters. So fp32 DDP holds 20 B per parameter before activations (LLaMA-2-7B:
    125.5 GiB), and peaks at 24 B in the optimizer step.

    The phases, with P = weights + buckets + optimizer state + overhead: end of forward = P +
    saved activations + forward logits + autocast copies; start of backward = P + saved
    activations + backward logits (+ copies still saved); end of backward = P + gradients + one
    layer's activations; optimizer step = P + gradients + step temporaries. Gradients join the
    first two when accumulation keeps them or they are bucket views. FLOPs per token use
    ``active_parameters`` when given (a mixture of experts runs only some experts per token).
    Raises UserError when ``seq_length`` exceeds the model's positions.
    """
    arch, parameters, settings, footprint = unpack(request)
    parameter_sizes, active_parameters = request.sizes, request.active
    check_positions(arch, settings)
    size = PRECISION_BYTES[settings.precision]
    shard = parameters
    if settings.zero1:
        shard = zero_shard(parameters, settings.world_size, parameter_sizes)
    gradients = parameters * size.grad
    activations = activation_estimate(arch, settings)
    copies_forward, copies_backward = autocast_copy_bytes(arch, settings)
    sizes = parameter_sizes or arch.parameter_sizes()
    state = footprint.state_bytes(size.moment, matrix_share(arch, parameters))
    plan = MemoryPlan(
        settings=settings,
        parameters=parameters,
        weights=parameters * size.weight,
        gradients=gradients,
        ddp_buckets=0 if settings.gradient_as_bucket_view else gradients,
        optimizer_state=round(state * shard),
        optimizer_step_temporaries=footprint.step_bytes(
            settings.fused_adamw, size.moment * shard, sizes
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
        labels=_labels(settings, footprint, buckets=_bucket_label(settings, gradients)),
    )
    return replace(plan, phases=_phases(plan, activations, copies_backward))


def lora_plan(request: PlanRequest) -> MemoryPlan:
    """The plan of a whole replica per rank under LoRA: frozen base weights (2 B, or 4 B under
    fp32), fp32 adapters (A: r x in, B: out x r) with fp32 gradients, buckets and the
    optimizer's state (ZeRO-1 partitions the adapters).

    Activations: the full fine-tuning estimate with bf16 coefficients when the base is bf16 (the
    residual stream is then bf16), fp32 ones under fp32; approximate, because frozen linears do
    not save their inputs while each adapter saves its (dropped-out) input and an r-wide tensor.
    Autocast copies (bf16-mixed): only the adapters' weights are cast (2 B each); the base is
    already bf16. Raises UserError when ``seq_length`` exceeds the model's positions.
    """
    arch, parameters, settings, footprint = unpack(request)
    active = request.active
    check_positions(arch, settings)
    trainable = sum(settings.adapter_sizes)
    base_bytes = 4 if settings.precision == "fp32" else 2
    shard = trainable
    if settings.zero1:
        shard = zero_shard(trainable, settings.world_size, settings.adapter_sizes)
    activation_precision = "fp32" if settings.precision == "fp32" else "bf16"
    activations = activation_estimate(arch, replace(settings, precision=activation_precision))
    copies = 2 * trainable if settings.precision == "bf16-mixed" else 0
    base = "fp32" if settings.precision == "fp32" else "bf16"
    plan = MemoryPlan(
        settings=settings,
        parameters=parameters,
        weights=parameters * base_bytes + 4 * trainable,
        gradients=4 * trainable,
        ddp_buckets=0 if settings.gradient_as_bucket_view else 4 * trainable,
        optimizer_state=round(footprint.state_bytes(4, 1.0) * shard),  # adapters: matrices
        optimizer_step_temporaries=footprint.step_bytes(
            settings.fused_adamw, 4 * shard, settings.adapter_sizes
        ),
        autocast_weight_copies=copies,
        activations=activations.saved + activations.loss_backward,
        overhead=int(settings.overhead_gib * GIB),
        compression_state=settings.compression_state_bytes,
        compression_buffers=settings.compression_buffer_bytes,
        flops_per_token=model_flops_per_token(
            trainable, arch.layers, arch.hidden, settings.seq_length, frozen=active or parameters
        ),
        approximate=("activations",) if arch.exact else ("activations", "autocast"),
        labels=_labels(
            settings, footprint, weights=f"weights (frozen {base} base + fp32 LoRA adapters)",
            buckets=_bucket_label(settings, 4 * trainable),
        ),
    )  # fmt: skip
    return replace(plan, phases=_phases(plan, activations, copies))


def sharded_plan(request: PlanRequest, shards: int, layout: str) -> MemoryPlan:
    """The plan of a model sharded by FSDP over ``shards`` = S ranks (1 or more; ``layout``
    names it, e.g. "fsdp over 8"): each rank keeps a 1/S shard of the weights, the gradients and
    the optimizer's state (FSDP2 pads each tensor's rows to a multiple of S: at most S - 1 rows
    more, not counted). Units are gathered in the compute dtype (bf16 under bf16-mixed) one layer
    at a time: the root unit (embedding, final norm, head) stays gathered from forward to
    backward, plus the layer computing and the one prefetched (``gathered_units``); the gradient
    of one unit is reduce-scattered at a time, in the reduce dtype (the compression-buffer row).
    Under gradient accumulation the micro-batches before the last keep each unit's unsharded
    gradient (``set_requires_gradient_sync(False)``): a whole model's gradients in float32 (in
    the gradients row). No autocast copies (the gathered units are already bf16, so the layers
    save what pure bf16 saves) and no DDP buckets. Raises UserError when ``seq_length`` exceeds
    the model's positions.
    """
    arch, parameters, settings, footprint = unpack(request)
    active = request.active
    check_positions(arch, settings)
    size = PRECISION_BYTES[settings.precision]
    shard = math.ceil(parameters / shards)
    compute = 4 if settings.precision == "fp32" else 2
    root = arch.vocab * arch.hidden * (1 if arch.tied_embeddings else 2) + arch.hidden
    layer = (parameters - root) // max(arch.layers, 1)
    unsharded = parameters * size.grad if settings.accumulation_steps > 1 else 0
    saved = "bf16" if settings.precision == "bf16-mixed" else settings.precision
    activations = activation_estimate(arch, settings, saved)
    weights = f"weights (a 1/{shards} shard)" if shards > 1 else "weights"
    state = footprint.state_bytes(size.moment, matrix_share(arch, parameters))
    plan = MemoryPlan(
        settings=settings,
        parameters=parameters,
        weights=shard * size.weight,
        gradients=shard * size.grad + unsharded,
        ddp_buckets=0,
        optimizer_state=round(state * shard),
        optimizer_step_temporaries=footprint.step_bytes(
            settings.fused_adamw, size.moment * shard, [shard]
        ),
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
        labels=_labels(
            settings, footprint, weights=weights, layout=layout if shards > 1 else "",
            buckets="DDP buckets (none: FSDP reduce-scatters unit by unit)",
        ),
    )  # fmt: skip
    return replace(plan, phases=_phases(plan, activations, 0))


def sharded_lora_plan(request: PlanRequest, shards: int, layout: str) -> MemoryPlan:
    """``sharded_plan`` under LoRA: each rank keeps a 1/S shard of the frozen base (2 B, or 4 B
    under fp32) and of the fp32 adapters, with the adapters' fp32 gradients and optimizer state
    (and, under gradient accumulation, every adapter's unsharded gradient); units gathered in the
    compute dtype, the adapters' gradients of one unit reduce-scattered at a time; activations
    as ``lora_plan`` counts them (approximate). Raises UserError when ``seq_length`` exceeds the
    model's positions."""
    arch, parameters, settings, footprint = unpack(request)
    check_positions(arch, settings)
    trainable = sum(settings.adapter_sizes)
    base_bytes, compute = (4, 4) if settings.precision == "fp32" else (2, 2)
    trained = math.ceil(trainable / shards)
    unsharded = 4 * trainable if settings.accumulation_steps > 1 else 0
    saved = "fp32" if settings.precision == "fp32" else "bf16"
    activations = activation_estimate(arch, replace(settings, precision=saved))
    root = arch.vocab * arch.hidden * (1 if arch.tied_embeddings else 2) + arch.hidden
    layer = (parameters + trainable - root) // max(arch.layers, 1)
    base = "fp32" if settings.precision == "fp32" else "bf16"
    fused = settings.fused_adamw
    per_layer = 4 * trainable // max(arch.layers, 1)  # one unit's adapter gradients
    frozen = request.active or parameters
    plan = MemoryPlan(
        settings=settings,
        parameters=parameters,
        weights=math.ceil(parameters / shards) * base_bytes + 4 * trained,
        gradients=4 * trained + unsharded,
        ddp_buckets=0,
        optimizer_state=round(footprint.state_bytes(4, 1.0) * trained),  # adapters: matrices
        optimizer_step_temporaries=footprint.step_bytes(fused, 4 * trained, [trained]),
        autocast_weight_copies=0,
        activations=activations.saved + activations.loss_backward,
        overhead=int(settings.overhead_gib * GIB),
        compression_state=settings.compression_state_bytes,
        compression_buffers=settings.compression_buffer_bytes + per_layer,
        gathered_units=(root + 2 * layer) * compute,
        flops_per_token=model_flops_per_token(
            trainable, arch.layers, arch.hidden, settings.seq_length, frozen=frozen
        ),
        approximate=("activations",),
        labels=_labels(
            settings, footprint, layout=layout if shards > 1 else "",
            weights=f"weights (a 1/{shards} shard of the frozen {base} base + fp32 LoRA adapters)",
            buckets="DDP buckets (none: FSDP reduce-scatters unit by unit)",
        ),
    )  # fmt: skip
    return replace(plan, phases=_phases(plan, activations, 0))


def _phases(plan: MemoryPlan, act: ActivationEstimate, copies_backward: int) -> dict[str, int]:
    """Bytes per rank at four moments of a step (see ``replicated_plan``)."""
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
