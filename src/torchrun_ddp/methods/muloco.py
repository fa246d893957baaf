"""MuLoCo (``--optimizer muloco``): DiLoCo with Muon as the inner optimizer (Therien, Huang,
Rish & Belilovsky 2025, "MuLoCo: Muon is a practical inner optimizer for DiLoCo",
arXiv:2505.23725).

Each rank steps Muon (torch.optim.Muon, its Newton-Schulz iterates in fp32 on a CPU:
``DeviceMuon``) on the hidden layers' matrices (``model.hidden_matrices``:
every 2-D trained weight but the embedding and the head) and AdamW on the rest, as torch's Muon
documentation prescribes; Muon's learning rate is scaled to match AdamW's update RMS
(``adjust_lr_fn="match_rms_adamw"``, Liu et al. 2025, arXiv:2502.16982), so that
--learning-rate, --weight-decay and the schedule serve both. Every ``--local-steps`` the
pseudo-gradient goes through error feedback and is compressed before it is sent, which the
paper finds Muon's pseudo-gradients take at 2 bits with next to no loss: here SparseLoCo's
exchange (``optim.sparseloco``: error feedback with decay --sparseloco-beta, top-k per chunk,
--quant-bits values, one all-gather), followed by DiLoCo's outer Nesterov SGD. Defaults: H 30
(the paper's Figure 1, 8 workers), outer lr 0.7 with Nesterov momentum 0.9 (DiLoCo's), and
SparseLoCo's k 64 of 4096-value chunks, 2-bit values and decay 0.95.

Muon keeps one momentum per matrix value where AdamW keeps two moments, so the memory plan
counts 1 moment on the matrices and 2 on the rest (``plan.settings.Footprint``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from typing import ClassVar

import torch
from torch.optim import AdamW, Muon, Optimizer

from torchrun_ddp.config import TrainConfig
from torchrun_ddp.methods.base import FP32, CheckpointBytes, MemoryRow, PlanSizes
from torchrun_ddp.methods.sparseloco import SparseLoCoMethod
from torchrun_ddp.model import hidden_matrices
from torchrun_ddp.optim import LocalUpdateSettings, adamw_options
from torchrun_ddp.plan.settings import Footprint

MUON_LR_ADJUSTMENT = "match_rms_adamw"
"""Muon's per-matrix learning-rate scale: ``0.2 sqrt(max(A, B))``, so that AdamW's learning rate
and weight decay carry over (torch.optim.Muon's ``adjust_lr_fn``)."""


def newton_schulz(
    matrix: torch.Tensor, coefficients: tuple[float, float, float], steps: int, eps: float,
    dtype: torch.dtype,
) -> torch.Tensor:  # fmt: skip
    """The quintic Newton-Schulz iteration of torch.optim.Muon (Jordan et al. 2024, "Muon: An
    optimizer for hidden layers in neural networks"), computed in ``dtype``: ``matrix`` [A, B]
    scaled to norm 1, then ``steps`` times ``X <- a X + (b G + c G^2) X`` with ``G = X X^T``
    (on the transpose when A > B). Returns the near-orthogonal [A, B] in ``dtype``; in bf16 it
    is torch's result bit for bit."""
    ortho = matrix.to(dtype=dtype, copy=True)
    tall = matrix.size(0) > matrix.size(1)
    ortho = ortho.T if tall else ortho
    ortho.div_(ortho.norm().clamp(min=eps))
    a, b, c = coefficients
    for _ in range(steps):
        gram = ortho @ ortho.T
        ortho = torch.addmm(ortho, torch.addmm(gram, gram, gram, beta=b, alpha=c), ortho, beta=a)
    return ortho.T if tall else ortho


class DeviceMuon(Muon):
    """``torch.optim.Muon`` with its Newton-Schulz iterates in the device's matmul dtype: bf16
    where the device multiplies bf16 natively (CUDA: torch's Muon exactly), fp32 elsewhere (a
    CPU without bf16 instructions emulates bf16 matmuls: 20x slower than fp32 on this project's
    AVX2 CI machine, which made a 1,050-step llama-8m run 5 hours). The same groups, state
    (``momentum_buffer``, the parameter's shape and dtype) and update as torch's otherwise."""

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One Muon step per group (torch's ``_single_tensor_muon``, ``newton_schulz`` in the
        device's dtype); returns ``closure()``'s loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params: list[torch.Tensor] = []
            grads: list[torch.Tensor] = []
            buffers: list[torch.Tensor] = []
            self._init_group(group, params, grads, buffers)
            for param, grad, buffer in zip(params, grads, buffers, strict=True):
                self._update(group, param, grad, buffer)
        return loss

    def _update(
        self, group: Mapping[str, object], param: torch.Tensor, grad: torch.Tensor,
        buffer: torch.Tensor,
    ) -> None:  # fmt: skip
        """Momentum, Newton-Schulz, decoupled weight decay and the scaled step of one matrix."""
        lr, decay = float(group["lr"]), float(group["weight_decay"])  # type: ignore[arg-type]
        momentum = float(group["momentum"])  # type: ignore[arg-type]
        buffer.lerp_(grad, 1 - momentum)
        update = grad.lerp(buffer, momentum) if group["nesterov"] else buffer
        dtype = torch.bfloat16 if param.device.type == "cuda" else torch.float32
        coefficients = group["ns_coefficients"]
        steps, eps = int(group["ns_steps"]), float(group["eps"])  # type: ignore[arg-type]
        update = newton_schulz(update, coefficients, steps, eps, dtype)  # type: ignore[arg-type]
        param.mul_(1 - lr * decay)
        param.add_(update, alpha=-lr * lr_ratio(str(group["adjust_lr_fn"]), param.shape))


def lr_ratio(adjust_lr_fn: str, shape: torch.Size) -> float:
    """torch.optim.Muon's learning-rate scale of an [A, B] matrix for ``adjust_lr_fn``:
    ``original`` (or None) sqrt(max(1, A / B)), ``match_rms_adamw`` 0.2 sqrt(max(A, B)),
    ``spectral_unclamped`` sqrt(A / B)."""
    rows, cols = shape[:2]
    if adjust_lr_fn == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    if adjust_lr_fn == "spectral_unclamped":
        return math.sqrt(rows / cols)
    return math.sqrt(max(1, rows / cols))


class MuonAdamW(Optimizer):
    """Muon (``DeviceMuon``) over the hidden matrices and ``torch.optim.AdamW`` over the other
    parameters, as one optimizer: one list of parameter groups (Muon's first, the same dicts the
    two hold, so a learning-rate schedule sets both), one ``state`` (Muon's ``momentum_buffer``
    [rows, cols] in the parameter's dtype; AdamW's ``exp_avg``, ``exp_avg_sq`` and ``step``),
    ``step`` stepping both, and ``state_dict`` in torch's format over all groups.

    ``muon`` and ``adamw`` must hold disjoint parameters (``muloco_inner_optimizer``)."""

    def __init__(self, muon: Muon, adamw: AdamW) -> None:
        self.parts = (muon, adamw)
        super().__init__([*muon.param_groups, *adamw.param_groups], {})
        self._share()

    def _share(self) -> None:
        """Point the two optimizers at this one's groups and state."""
        muon, adamw = self.parts
        count = len(muon.param_groups)
        muon.param_groups, adamw.param_groups = self.param_groups[:count], self.param_groups[count:]
        muon.state = adamw.state = self.state

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One Muon step and one AdamW step; returns ``closure()``'s loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for part in self.parts:
            part.step()
        return loss

    def load_state_dict(self, state_dict: Mapping[str, object]) -> None:  # type: ignore[override]
        """``Optimizer.load_state_dict`` (which replaces the group dicts), then shared again."""
        super().load_state_dict(dict(state_dict))  # type: ignore[arg-type]
        self._share()


def muloco_inner_optimizer(
    model: torch.nn.Module, learning_rate: float, weight_decay: float, implementation: str
) -> MuonAdamW:
    """Muon (Nesterov momentum 0.95, 5 Newton-Schulz steps: torch's defaults) on
    ``hidden_matrices(model)`` and AdamW (``implementation``: fused, foreach or for-loop) on the
    other trained parameters, weight decay on the 2-D ones (the embedding and head) only."""
    matrices = hidden_matrices(model)
    chosen = {id(p) for p in matrices}
    rest = [p for p in model.parameters() if p.requires_grad and id(p) not in chosen]
    muon = DeviceMuon(matrices, lr=learning_rate, weight_decay=weight_decay,
                      adjust_lr_fn=MUON_LR_ADJUSTMENT)  # fmt: skip
    groups = _adamw_groups(rest, weight_decay) or [{"params": [], "weight_decay": 0.0}]
    adamw = AdamW(groups, lr=learning_rate, **adamw_options(implementation))
    return MuonAdamW(muon, adamw)


def _adamw_groups(params: Iterable[torch.Tensor], weight_decay: float) -> list[dict[str, object]]:
    """AdamW's non-empty groups: ``weight_decay`` on matrices, none on vectors."""
    params = list(params)
    decay = [p for p in params if p.dim() >= 2]
    plain = [p for p in params if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": plain, "weight_decay": 0.0},
    ]
    return [group for group in groups if group["params"]]


class MuLoCoMethod(SparseLoCoMethod):
    """``--optimizer muloco``: SparseLoCo's exchange and state (its error feedback per rank)
    with a Muon inner optimizer and DiLoCo's outer Nesterov momentum; no presets."""

    name = "muloco"
    summary = (
        "MuLoCo (Therien et al. 2025): DiLoCo with Muon on the hidden matrices (AdamW on the "
        "rest) and the pseudo-gradient compressed with error feedback (SparseLoCo's exchange)"
    )
    paper_local_steps = 30
    paper_outer_lr = 0.7
    reads_outer_momentum = True
    preset_field = ""
    presets: ClassVar[Mapping[str, Mapping[str, object]]] = {}
    flags = (
        *(flag for flag in SparseLoCoMethod.flags if flag != "sparseloco_preset"),
        "outer_momentum",
    )

    @classmethod
    def check_config(cls, config: TrainConfig, given: frozenset[str] = frozenset()) -> None:
        """The local-update checks under this method's name; SparseLoCo's flags are checked
        by ``SparseLoCoMethod.check_config`` under its own (every method's check runs, and it
        refuses --sparseloco-preset with any other method)."""
        super(SparseLoCoMethod, cls).check_config(config, given)

    def inner_optimizer(self, model: torch.nn.Module) -> Optimizer:
        """Muon on the hidden matrices, AdamW on the rest (``muloco_inner_optimizer``)."""
        config = self.config
        return muloco_inner_optimizer(
            model, config.learning_rate, config.weight_decay, config.adamw_implementation
        )

    @classmethod
    def footprint(cls) -> Footprint:
        """Muon's one momentum on the hidden matrices, AdamW's two moments on the rest; Muon
        orthogonalizes one matrix at a time (its momentum-mixed update and bf16 iterates: about
        two fp32 copies of the largest)."""
        return Footprint(
            moments=2.0, matrix_moments=1.0, step_copies=2, label="Muon inner",
            state="Muon momentum + AdamW moments", step="Muon + AdamW, largest matrix",
            zero1=False,
        )  # fmt: skip

    @classmethod
    def exchange_rows(
        cls, settings: LocalUpdateSettings, shapes: list[tuple[int, ...]], world_size: int
    ) -> list[MemoryRow]:
        """SparseLoCo's rows (error feedback, the sync's messages and work) and the outer
        Nesterov momentum (fp32, kept; when > 0)."""
        rows = super().exchange_rows(settings, shapes, world_size)
        if not settings.outer_momentum:
            return rows
        numel = sum(math.prod(shape) for shape in shapes)
        return [MemoryRow("outer Nesterov momentum (fp32)", FP32 * numel, True), *rows]

    def checkpoint_bytes(self, sizes: PlanSizes) -> CheckpointBytes:
        """SparseLoCo's (the error feedback per rank) and the replicated outer momentum."""
        base = super().checkpoint_bytes(sizes)
        outer = FP32 * sizes.trained if self.settings.outer_momentum else 0
        return CheckpointBytes(base.replicated + outer, base.per_rank)

    @classmethod
    def describe_exchange(cls, settings: LocalUpdateSettings) -> str:
        """SparseLoCo's message and decay, then the outer step: ``k=64/4096 2-bit beta 0.95 lr
        0.7 Nesterov 0.9``."""
        momentum = f" Nesterov {settings.outer_momentum:g}" if settings.outer_momentum else ""
        return f"{super().describe_exchange(settings)}{momentum}"
