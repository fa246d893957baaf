"""The values a memory plan is computed from (:class:`PlanSettings`), and what an optimizer
holds per trained parameter (:class:`Footprint`, each training method's own)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torchrun_ddp.errors import UserError

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
    """One training setup to plan for, per rank: plain values, read by the mode's and the
    method's plan rows (``planning.plan_memory``).

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
    """The training method (``--optimizer``), whose memory per trained parameter (its
    ``Footprint``) the planner asks it for."""
    data_parallel: str = "ddp"
    """The data-parallel mode (``--data-parallel``), whose rows the planner asks it for."""
    shard_degree: int = 0
    """hsdp: ranks one replica is sharded over (0: ``world_size``, as fsdp)."""
    fused_loss: bool = False
    """Liger's fused linear cross-entropy (--fused-loss): no [B, T, V] logits; see
    ``fused_loss_bytes``."""

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


@dataclass(frozen=True)
class Footprint:
    """What an optimizer holds per trained parameter and allocates in its step, for the plan:
    ``moments`` values of the moment dtype (the weights' dtype: AdamW 2, Muon 1), or
    ``matrix_moments`` on the hidden layers' matrices where an optimizer treats those apart
    (Muon on them and AdamW on the rest: 1 and 2; ``model.hidden_matrices``), plus
    ``fp32_state`` bytes (DeMo's fp32 momentum: 4, with no moments); its step allocates
    ``step_copies`` fp32 copies of the largest parameter (DeMo works one parameter at a time),
    or else torch's foreach kernel one moment-sized buffer (``foreach_buffer``; none when
    fused). ``label`` names it in the plan's first line ("" for AdamW), ``state`` and ``step``
    name its rows; ``zero1``: whether ZeRO-1 can shard the state."""

    moments: float = 2.0
    matrix_moments: float | None = None
    fp32_state: int = 0
    step_copies: int = 0
    foreach_buffer: bool = True
    label: str = ""
    state: str = "AdamW moments"
    step: str = "AdamW"
    zero1: bool = True

    def state_bytes(self, moment_bytes: int, matrix_share: float = 0.0) -> float:
        """Optimizer state bytes per trained parameter, moments of ``moment_bytes`` each, when
        ``matrix_share`` of the trained parameters (0 to 1) are hidden-layer matrices."""
        matrix = self.moments if self.matrix_moments is None else self.matrix_moments
        moments = matrix * matrix_share + self.moments * (1.0 - matrix_share)
        return moments * moment_bytes + self.fp32_state

    def step_bytes(self, fused: bool, moment_bytes: int, sizes: Sequence[int]) -> int:
        """Bytes its step allocates: ``step_copies`` fp32 copies of the largest of ``sizes``,
        else one moment-sized buffer of ``moment_bytes`` (all the rank's moments) unless
        ``fused`` or ``foreach_buffer`` is off."""
        if self.step_copies:
            return self.step_copies * 4 * max(sizes, default=0)
        return 0 if fused or not self.foreach_buffer else moment_bytes

    def step_name(self, fused: bool) -> str:
        """The step row's name: ``fused AdamW``, ``foreach AdamW``, or the step's own."""
        if self.step_copies or not self.foreach_buffer:
            return self.step
        return f"{'fused' if fused else 'foreach'} {self.step}"
