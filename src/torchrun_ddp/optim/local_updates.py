"""DiLoCo and SparseLoCo: H local AdamW steps per rank, then one outer step on the pseudo-gradient.

DiLoCo: Douillard et al. 2023, "DiLoCo: Distributed Low-Communication Training of Language
Models", arXiv:2311.08105. SparseLoCo: Sarfi, Therien, Lidin & Belilovsky 2025, "Communication
Efficient LLM Pre-training with SparseLoCo", arXiv:2508.15706. The wrapper's shape (an inner
optimizer stepped every step, a sync every H steps against a kept copy of the synchronised
parameters) follows torchft's ``local_sgd.py``; the code is this project's.

This module is what both methods share, :class:`LocalUpdates`; each method is a subclass that
says how the pseudo-gradient is exchanged and averaged: :class:`.diloco.DiLoCo` (all-reduce,
outer Nesterov SGD) and :class:`.sparseloco.SparseLoCo` (error feedback, top-k per chunk,
quantization, all-gather). Per rank ``r``, with ``theta`` the synchronised ("synced")
parameters, kept in fp32 and the same on every rank, and ``theta_r`` the rank's own (the
model's) parameters:

1. every optimizer step: the inner optimizer (the project's AdamW) steps ``theta_r`` on the rank's
   *local* gradient (DDP communicates nothing in backward:
   ``compression.local_gradients.register_local_gradients``);
2. every ``H = local_steps`` steps, the sync: the pseudo-gradient ``delta_r = theta - theta_r``
   is exchanged and averaged into ``delta`` (the subclass's part), and the outer optimizer,
   ``torch.optim.SGD`` over ``theta`` (with Nesterov momentum where the settings have outer
   momentum), steps ``theta`` along ``delta``;
3. every rank sets ``theta_r <- theta`` (rounded to the parameter dtype): after a sync the
   parameters are bit-identical on all ranks (an all-reduce result is the same on every rank,
   and the all-gather decode runs the same operations on the same bytes). The inner AdamW state
   is never reset or exchanged.

**Overlapped sync** (``sync_delay = tau >= 1``, ``--overlap-exchange``): step 2's collective is
started and left running; the rank keeps taking inner steps from its own ``theta_r``, and
``tau`` inner steps later (``1 <= tau <= H``; ``tau = H``: at the next window's end, just
before that window's exchange starts) the outer step is applied and the rank *rebases*:
``theta_r <- theta_new + (theta_r - s_r)``, ``s_r`` being its parameters when the exchange
started. So no inner step is lost (the ``tau`` steps taken meanwhile count in the next
pseudo-gradient, ``theta_new - theta_r``), the synced parameters stay bit-identical on all
ranks, and the local parameters differ by their progress since the exchange started. What it
changes: the next window starts from a point that has not seen the last outer update (a delay
of ``tau`` inner steps). This is Streaming DiLoCo's overlap (Douillard et al. 2025,
arXiv:2501.18512, ``tau`` there; its merge with ``alpha = 0`` drops the ``tau`` local steps
instead of keeping them) and, at ``tau = H``, the one-outer-step delay of Kale et al. 2025
(arXiv:2502.12996) without their "eager" local term. torchft's ``local_sgd.py`` calls ``tau``
``fragment_sync_delay``.

**Eager updates** (``settings.eager``, with a sync delay): the delay's inner steps start from
this rank's estimate of the outer update (:meth:`LocalUpdates._eager_step`, Kale et al. 2025)
instead of its own parameters.

**Sharded models** (``--data-parallel hsdp``, DiLoCo): the parameters are FSDP2 DTensors and
``theta_r`` is this rank's local shard (``p.to_local()``, sharing its storage, as torchft's
DiLoCo does); ``theta`` and the outer momentum are shard-shaped, the sync runs over the
replicate group, and checkpoints lay them out as DTensors (:meth:`LocalUpdates.laid_out`).

The settings (flags, checks, paper defaults) are ``local_update_config``; checkpoint state (why
shared and per rank, resume at another world size) is ``local_update_state``; the memory rows of
--dry-run are ``plan.local_update_memory``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.optim import SGD, Optimizer

from torchrun_ddp.compression.replicas import local_shard
from torchrun_ddp.optim.exchange import Counter, InFlight
from torchrun_ddp.optim.local_update_config import (
    AGGREGATES,
    CLIPS,
    MAX_QUANT_BITS,
    PSEUDO_GRADIENT_DTYPES,
    QUANTIZERS,
    LocalUpdateSettings,
    validate_local_updates,
)
from torchrun_ddp.parallel.shards import laid_out_like

if TYPE_CHECKING:
    from torchrun_ddp.distributed import NodeGroups

__all__ = [  # the settings' names stay importable from here (``local_update_config`` owns them)
    "AGGREGATES",
    "CLIPS",
    "MAX_QUANT_BITS",
    "PSEUDO_GRADIENT_DTYPES",
    "QUANTIZERS",
    "LocalUpdateSettings",
    "LocalUpdates",
    "OuterOptimizer",
    "PendingSync",
    "outer_sgd",
    "validate_local_updates",
]


OuterOptimizer = Callable[[list[torch.Tensor]], Optimizer]
"""Builds the outer optimizer over the synced fp32 copies (a method hands its own in, as
torchft's DiLoCo takes its outer optimizer); ``outer_sgd`` by default. An optimizer with
momentum gets its buffers at zero at once, so that a checkpoint's keys never depend on the
step."""


def outer_sgd(settings: LocalUpdateSettings) -> OuterOptimizer:
    """``torch.optim.SGD`` at ``settings.outer_lr`` with Nesterov momentum
    ``settings.outer_momentum`` (plain SGD at 0): DiLoCo's outer optimizer, SparseLoCo's
    without momentum."""
    momentum = settings.outer_momentum

    def build(params: list[torch.Tensor]) -> Optimizer:
        return SGD(params, lr=settings.outer_lr, momentum=momentum, nesterov=momentum > 0)

    return build


@dataclass
class PendingSync:
    """A sync whose exchange has started and whose outer update this rank has not yet applied.

    DiLoCo: ``work`` (the all-reduce, None once waited for) fills ``wire``, the pseudo-gradient
    on the wire, of which ``flat`` (fp32, [N]) is the mean once waited for; ``synced``'s
    gradients are views of ``flat``. SparseLoCo: ``flight``, its all-gather(s). ``start``: this
    rank's parameters when the exchange started (overlapped syncs only, for the rebase).
    ``stepped``: the outer step is done (``synced`` holds the new parameters), only the rebase
    of the local parameters is left.
    """

    start: list[torch.Tensor]
    work: dist.Work | None = None
    flat: torch.Tensor | None = None
    wire: torch.Tensor | None = None
    flight: InFlight | None = None
    stepped: bool = False
    own: list[torch.Tensor] = field(default_factory=list)
    """Eager updates, while the sync starts: this rank's part of the mean (fp32, as it enters
    the sum: the pseudo-gradient on the wire, or the values SparseLoCo sent)."""


class LocalUpdates(Optimizer):
    """What DiLoCo and SparseLoCo share (module docstring) around an inner optimizer, as an
    ``Optimizer``; a method is a subclass (:class:`.diloco.DiLoCo`,
    :class:`.sparseloco.SparseLoCo`) that starts the exchange of the pseudo-gradient
    (:meth:`_start_exchange`), finishes it into ``synced``'s gradients
    (:meth:`_finish_exchange`) and says its payload (:meth:`payload_bytes`). The training
    method (``methods``) picks the subclass and builds the optimizers it hands in.

    ``inner``: the per-rank optimizer (AdamW over ``optim.parameter_groups``, or the method's
    own); ``outer``: builds the outer optimizer over the synced copies (``outer_sgd`` of the
    settings when None); this wrapper
    shares its parameter groups (the same dicts), so a learning-rate schedule built on the
    wrapper sets the inner learning rate. ``step()`` runs one inner step and, every
    ``settings.local_steps`` calls, the sync, a collective: every rank of ``process_group``
    must call it in the same step. ``counter`` (``CompressionState.count``) is told the bytes
    handed to the sync's collective, in the step that sends them. With ``settings.sync_delay``
    the sync's outer update lands that many steps after its exchange starts (the module
    docstring's overlapped sync); :meth:`flush` applies one still pending.

    State: ``synced`` (fp32 copies of the trained parameters, the same on all ranks),
    ``outer`` (the outer optimizer over ``synced``; momentum buffers, where it has momentum, are
    created at zero here so that a checkpoint's keys never depend on the step), ``error``
    (per-rank fp32 error feedback per parameter; empty but for SparseLoCo), ``owners`` and
    ``local_rank`` (which local rank keeps each tensor's error feedback; empty and 0 but for
    node-aware SparseLoCo), ``position``
    (inner steps since the last sync started, 0 <= position < H), ``pending`` (an overlapped
    sync not yet applied) and, with eager updates, ``last_mean`` and ``last_own``. Checkpointed
    by :class:`.local_update_state.SyncedState` (shared) and ``RankState`` (per rank).

    Raises ``ValueError`` for bad settings and ``RuntimeError`` (from torch) in ``step`` without
    an initialised process group.
    """

    def __init__(
        self,
        inner: Optimizer,
        settings: LocalUpdateSettings,
        process_group: dist.ProcessGroup | None = None,
        counter: Counter | None = None,
        node_groups: NodeGroups | None = None,
        outer: OuterOptimizer | None = None,
    ) -> None:
        validate_local_updates(settings)
        if settings.eager and node_groups is not None:
            raise ValueError("eager updates need a flat sync (no node groups)")
        super().__init__(inner.param_groups, inner.defaults)
        self.inner = inner
        self.settings = settings
        self.process_group = process_group
        self.counter = counter
        self.position = 0
        self.pending: PendingSync | None = None
        self.syncs_applied = 0
        """Outer updates this process has applied (with a sync delay: behind the syncs started)."""
        self.parameters = [p for group in self.param_groups for p in group["params"]]
        """The inner optimizer's parameters (DTensors on a model sharded by FSDP)."""
        self.trained = [local_shard(p) for p in self.parameters]
        """This rank's part of each (the parameter itself, or its shard): what is synced."""
        self.synced = [p.detach().to(torch.float32, copy=True) for p in self.trained]
        self.outer = (outer or outer_sgd(settings))(self.synced)
        if self.outer.defaults.get("momentum"):
            for copy in self.synced:
                self.outer.state[copy]["momentum_buffer"] = torch.zeros_like(copy)
        self.error: list[torch.Tensor] = []
        """Per-rank error feedback (fp32, a parameter's shape): SparseLoCo's, empty otherwise."""
        self.owners: list[int] = []
        """Per trained tensor, the local rank that keeps its error feedback (node-aware)."""
        self.local_rank = 0
        eager = settings.eager
        self.last_mean = [torch.zeros_like(copy) for copy in self.synced] if eager else []
        """Eager updates: the mean the last outer step applied (the same on every rank)."""
        self.last_own = [torch.zeros_like(copy) for copy in self.synced] if eager else []
        """Eager updates: this rank's part of that mean, as it entered it (before dividing)."""

    def laid_out(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """``tensors`` (one per trained tensor, its local shape) laid out as the parameters:
        on a sharded model a DTensor sharing each tensor's storage, so that DCP saves every
        shard and loads into it in place; the tensors themselves otherwise."""
        return [self.laid_out_one(index, tensor) for index, tensor in enumerate(tensors)]

    def laid_out_one(self, index: int, tensor: torch.Tensor) -> torch.Tensor:
        """:meth:`laid_out` for the trained tensor at ``index``."""
        return laid_out_like(tensor, self.parameters[index])

    def share(self) -> list[int]:
        """The tensors (positions) whose error feedback this rank keeps: all of them, or its
        share when node-aware (``owners``); empty without error feedback."""
        return [index for index, owner in enumerate(self.owners) if owner == self.local_rank]

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One inner step; the outer update of a pending sync when its delay is over; the start
        of a sync when the step completes a window (and its outer update at once without a
        delay). Returns ``closure()``'s loss."""
        loss = self.inner.step(closure)
        self.position += 1
        if self.pending is not None and self.position == self.settings.sync_delay:
            self.flush()
        if self.position >= self.settings.local_steps:
            self.position = 0
            self.pending = self._start_sync()
            if not self.settings.sync_delay:
                self.flush()
        return loss

    @torch.no_grad()
    def flush(self) -> bool:
        """Apply the pending sync's outer update and rebase (a collective when its exchange is
        unfinished); True if there was one. Called at the end of training so that the last
        sync is not lost."""
        pending = self.pending
        if pending is None:
            return False
        self.settle()
        for index, (param, copy) in enumerate(zip(self.trained, self.synced, strict=True)):
            if not pending.start:
                param.copy_(copy)
                continue
            progress = param.float() - pending.start[index].float()
            param.copy_(copy + progress)
        self.pending = None
        return True

    @torch.no_grad()
    def settle(self) -> None:
        """Wait for the pending sync's exchange and take the outer step on ``synced`` (the rebase
        of the local parameters waits for :meth:`flush`); nothing when none is pending or it is
        settled. Checkpoints call it, so that they hold the outer step, not a collective."""
        pending = self.pending
        if pending is None or pending.stepped:
            return
        self._finish_exchange(pending)
        self.outer.step()
        for index, copy in enumerate(self.synced):
            if self.last_mean:
                self.last_mean[index].copy_(copy.grad)
            copy.grad = None
        pending.stepped = True
        self.syncs_applied += 1

    def payload_bytes(self) -> int:
        """Bytes this rank hands to the sync's collective (the subclass's)."""
        raise NotImplementedError(f"{type(self).__name__} names no payload")

    def _start_exchange(self, start: list[torch.Tensor]) -> PendingSync:
        """The subclass's: the pseudo-gradient ``synced - local`` and the start of its exchange
        (not waited for), as a :class:`PendingSync` holding ``start``; with eager updates its
        ``own`` holds this rank's part of the mean."""
        raise NotImplementedError(f"{type(self).__name__} has no exchange")

    def _finish_exchange(self, pending: PendingSync) -> None:
        """The subclass's: wait for ``pending``'s exchange; the mean pseudo-gradient becomes
        ``synced``'s gradients (fp32, the parameters' shapes)."""
        raise NotImplementedError(f"{type(self).__name__} has no exchange")

    def _count(self, collective: str, nbytes: int) -> None:
        if self.counter is not None:
            self.counter(collective, nbytes, self.process_group)

    def _start_sync(self) -> PendingSync:
        """The pseudo-gradient and the start of its exchange (not waited for); with eager
        updates, the local parameters then move to this rank's estimate of the outer update,
        and the rebase measures the delay's progress from there."""
        start = [p.detach().clone() for p in self.trained] if self.settings.sync_delay else []
        pending = self._start_exchange(start)
        if self.settings.eager:
            self._eager_step(pending.own)
            for param, copy in zip(self.trained, pending.start, strict=True):
                copy.copy_(param)
        pending.own = []
        return pending

    def _eager_step(self, own: list[torch.Tensor]) -> None:
        """Kale et al. 2025 (arXiv:2502.12996): the outer step on ``last_mean + (own -
        last_own) / W`` (the last mean with this rank's old part swapped for its new one),
        taken on a copy of the synced parameters and outer momentum and written into the local
        parameters; ``own`` becomes ``last_own``. SparseLoCo's sender mean and median
        clipping are left out of the estimate (it divides by W)."""
        world = dist.get_world_size(self.process_group)
        momentum, lr = self.settings.outer_momentum, self.settings.outer_lr
        for index, (param, copy) in enumerate(zip(self.trained, self.synced, strict=True)):
            estimate = self.last_mean[index] + (own[index] - self.last_own[index]) / world
            if momentum:  # Nesterov, as torch.optim.SGD: buf' = m buf + g, step = g + m buf'
                buffer = self.outer.state[copy]["momentum_buffer"]
                estimate = estimate + momentum * (momentum * buffer + estimate)
            param.copy_(copy - lr * estimate)
            self.last_own[index].copy_(own[index])
