"""DiLoCo and SparseLoCo: H local AdamW steps per rank, then one outer step on the pseudo-gradient.

DiLoCo: Douillard et al. 2023, "DiLoCo: Distributed Low-Communication Training of Language
Models", arXiv:2311.08105. SparseLoCo: Sarfi, Therien, Lidin & Belilovsky 2025, "Communication
Efficient LLM Pre-training with SparseLoCo", arXiv:2508.15706. The wrapper's shape (an inner
optimizer stepped every step, a sync every H steps against a kept copy of the synchronised
parameters) follows torchft's ``local_sgd.py``; the code is this project's.

Per rank ``r``, with ``theta`` the synchronised ("synced") parameters, kept in fp32 and the same on
every rank, and ``theta_r`` the rank's own (the model's) parameters:

1. every optimizer step: the inner optimizer (the project's AdamW) steps ``theta_r`` on the rank's
   *local* gradient (DDP communicates nothing in backward: :func:`.demo.register_local_gradients`);
2. every ``H = local_steps`` steps, the sync: the pseudo-gradient ``delta_r = theta - theta_r``;

   - **DiLoCo**: ``delta = mean_r delta_r`` by one all-reduce (fp32, or bf16 on the wire); the
     outer optimizer, ``torch.optim.SGD`` with Nesterov momentum, steps ``theta`` along
     ``delta`` (paper: outer lr 0.7, momentum 0.9, H = 500);
   - **SparseLoCo**: error feedback ``e_r <- beta e_r + delta_r``; every chunk of ``e_r`` (the
     parameter cut into tiles of at most ``chunk x chunk`` values, :func:`.transform.tile_shape`,
     as DeMo tiles but without the DCT) sends its ``k`` largest-magnitude values, quantized to
     ``quant_bits`` bits with one fp32 scale per chunk (levels ``(2 q / (2^b - 1) - 1) * scale``,
     ``scale`` = the chunk's largest magnitude, so the largest value is sent exactly); what was
     sent (the dequantized values) is subtracted from ``e_r``; one all-gather of (positions,
     codes, scales); every rank decodes all messages the same way, in rank order, into
     ``delta = mean_r sent_r``, and ``torch.optim.SGD`` without momentum steps
     ``theta <- theta - outer_lr * delta`` (the error feedback takes the outer momentum's role);

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

Defaults (see ``config.py``): DiLoCo H 500, outer lr 0.7, Nesterov momentum 0.9 (DiLoCo paper,
section 3); SparseLoCo H 15, k 64 of 4096-value chunks (1.56% density: the paper reports 1-3%),
error-feedback decay 0.95, 2-bit values, outer lr 1 (SparseLoCo paper's main setting).

Checkpoint state (why shared and per rank, resume at another world size) is
``local_update_state``; the codec of SparseLoCo's messages is ``sparseloco_codec``; the memory
rows of --dry-run are ``local_update_memory``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.optim import SGD, Optimizer

from torchrun_ddp.compression.state import CompressionState
from torchrun_ddp.compression.wire import sparseloco_chunk_payload
from torchrun_ddp.errors import UserError
from torchrun_ddp.optim.exchange import (
    Counter,
    InFlight,
    MessageExchange,
    assign_owners,
)
from torchrun_ddp.optim.sparseloco_codec import (
    MessageFormat,
    chunk_codec,
    decode_mean,
    encode_chunks,
)

if TYPE_CHECKING:
    from torchrun_ddp.config import TrainConfig
    from torchrun_ddp.distributed import NodeGroups

log = logging.getLogger("torchrun_ddp")

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
    _validate_sparseloco(settings)
    if settings.eager and not settings.sync_delay:
        raise ValueError("eager updates need an overlapped sync (a sync delay of 1 or more)")
    if not 0 <= settings.sync_delay <= settings.local_steps:
        raise ValueError(
            f"the sync delay (--sync-delay) must be 0 to the local steps ({settings.local_steps}), "
            f"got {settings.sync_delay}; lower it or raise --local-steps"
        )


def _validate_sparseloco(settings: LocalUpdateSettings) -> None:
    """SparseLoCo's fields (checked whatever the method, as the flags are)."""
    if settings.topk < 1 or settings.chunk < 2 or not 0.0 <= settings.beta < 1.0:
        raise ValueError(
            f"SparseLoCo needs topk >= 1, chunk >= 2 and beta in [0, 1), got {settings.topk}, "
            f"{settings.chunk} and {settings.beta}"
        )
    if not 0 <= settings.quant_bits <= MAX_QUANT_BITS:
        raise ValueError(f"quant bits must be 0 (none) to 8, got {settings.quant_bits}")
    options = (settings.quantizer, settings.aggregate, settings.clip)
    if options not in {(q, a, c) for q in QUANTIZERS for a in AGGREGATES for c in CLIPS}:
        raise ValueError(
            f"unknown SparseLoCo quantizer, aggregate or clip {options}; use {QUANTIZERS}, "
            f"{AGGREGATES} and {CLIPS}"
        )


def local_update_settings(config: TrainConfig) -> LocalUpdateSettings:
    """The settings of ``--optimizer diloco|sparseloco`` from the run's config: ``0`` for
    ``--local-steps`` and ``--outer-lr`` means the method's paper value; SparseLoCo ignores
    ``--outer-momentum`` (it has none). Raises UserError for values out of range."""
    method = config.optimizer
    local_steps = config.local_steps or PAPER_LOCAL_STEPS.get(method, 1)
    settings = LocalUpdateSettings(
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
    try:
        validate_local_updates(settings)
    except ValueError as exc:  # validate_local_updates raises ValueError for bad settings only
        raise UserError(f"--optimizer {method}: {exc}") from exc
    return settings


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
    """DiLoCo or SparseLoCo (module docstring) around an inner optimizer, as an ``Optimizer``.

    ``inner``: the per-rank optimizer (AdamW over ``optim.parameter_groups``); this wrapper
    shares its parameter groups (the same dicts), so a learning-rate schedule built on the
    wrapper sets the inner learning rate. ``step()`` runs one inner step and, every
    ``settings.local_steps`` calls, the sync, a collective: every rank of ``process_group``
    must call it in the same step. ``counter`` (``CompressionState.count``) is told the bytes
    handed to the sync's collective, in the step that sends them. With ``settings.sync_delay``
    the sync's outer update lands that many steps after its exchange starts (the module
    docstring's overlapped sync); :meth:`flush` applies one still pending.

    State: ``synced`` (fp32 copies of the trained parameters, the same on all ranks),
    ``outer`` (``torch.optim.SGD`` over ``synced``: Nesterov momentum for DiLoCo, whose buffers
    are created at zero here so that a checkpoint's keys never depend on the step; none for
    SparseLoCo), ``error`` (SparseLoCo: fp32 error feedback per parameter, per rank),
    ``position`` (inner steps since the last sync started, 0 <= position < H) and ``pending``
    (an overlapped sync not yet applied). Checkpointed by
    :class:`.local_update_state.SyncedState` (shared) and ``RankState`` (per rank).

    ``node_groups`` (SparseLoCo only; ``--compression-scope inter-node``): every node is one
    replica. Its ranks train on the node's mean gradient (the hook of
    ``demo.register_local_gradients`` with ``node_groups``), so they hold the same parameters and
    pseudo-gradient; at a sync local rank ``j`` compresses its share of the tensors
    (``demo_exchange.assign_owners``) with its share's error feedback, one message per share
    crosses the uplinks and the node shares the gathered messages inside
    (``demo_exchange.MessageExchange``). The mean is then over nodes, not ranks.

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
        self.trained = [p for group in self.param_groups for p in group["params"]]
        self.synced = [p.detach().to(torch.float32, copy=True) for p in self.trained]
        momentum = settings.outer_momentum
        self.outer = SGD(
            self.synced, lr=settings.outer_lr, momentum=momentum, nesterov=momentum > 0
        )
        if momentum:
            for copy in self.synced:
                self.outer.state[copy]["momentum_buffer"] = torch.zeros_like(copy)
        sparse = settings.method == "sparseloco"
        self.error = [torch.zeros_like(copy) for copy in self.synced] if sparse else []
        eager = settings.eager
        self.last_mean = [torch.zeros_like(copy) for copy in self.synced] if eager else []
        """Eager updates: the mean the last outer step applied (the same on every rank)."""
        self.last_own = [torch.zeros_like(copy) for copy in self.synced] if eager else []
        """Eager updates: this rank's part of that mean, as it entered it (before dividing)."""
        self.codecs = (
            [chunk_codec(tuple(p.shape), settings.chunk, settings.topk) for p in self.trained]
            if sparse
            else []
        )
        self._plan_exchange(node_groups)

    def _plan_exchange(self, node_groups: NodeGroups | None) -> None:
        """SparseLoCo: which local rank sends which tensors, and the exchange that carries it."""
        sizes = [self._message_bytes(index) for index in range(len(self.codecs))]
        parts = node_groups.local_world_size if node_groups else 1
        self.owners = assign_owners(sizes, parts)
        self.local_rank = dist.get_rank(node_groups.intra) if node_groups else 0
        lengths = [0] * parts
        for size, owner in zip(sizes, self.owners, strict=True):
            lengths[owner] += size
        self.exchange = MessageExchange(lengths, self.process_group, node_groups, self.counter)

    def _message_bytes(self, index: int) -> int:
        codec, settings = self.codecs[index], self.settings
        return sparseloco_chunk_payload(
            codec.n_tiles, codec.k, codec.tile_numel, settings.quant_bits, settings.quantizer
        )

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
        if self.settings.method == "diloco":
            self._finish_diloco(pending)
        else:
            self._finish_sparseloco(pending)
        self.outer.step()
        for index, copy in enumerate(self.synced):
            if self.last_mean:
                self.last_mean[index].copy_(copy.grad)
            copy.grad = None
        pending.stepped = True
        self.syncs_applied += 1

    def payload_bytes(self) -> int:
        """Bytes this rank hands to the sync's collective (all-reduce input for DiLoCo, this
        rank's all-gather part for SparseLoCo); see ``wire.diloco_payload_bytes`` and
        ``wire.sparseloco_payload_bytes``."""
        if self.settings.method == "diloco":
            dtype = PSEUDO_GRADIENT_DTYPES[self.settings.pseudo_gradient_dtype]
            return sum(p.numel() for p in self.trained) * dtype.itemsize
        return self.exchange.padded

    def _count(self, collective: str, nbytes: int) -> None:
        if self.counter is not None:
            self.counter(collective, nbytes, self.process_group)

    def _start_sync(self) -> PendingSync:
        """The pseudo-gradient and the start of its exchange (not waited for); with eager
        updates, the local parameters then move to this rank's estimate of the outer update,
        and the rebase measures the delay's progress from there."""
        start = [p.detach().clone() for p in self.trained] if self.settings.sync_delay else []
        if self.settings.method == "diloco":
            pending = self._start_diloco(start)
        else:
            pending = self._start_sparseloco(start)
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

    def _start_diloco(self, start: list[torch.Tensor]) -> PendingSync:
        """The pseudo-gradient ``synced - local`` in one fp32 buffer (``synced``'s gradients are
        views of it) and its all-reduce (fp32, or a bf16 wire copy), started."""
        numel = sum(p.numel() for p in self.trained)
        flat = torch.empty(numel, dtype=torch.float32, device=self.synced[0].device)
        offset = 0
        for param, copy in zip(self.trained, self.synced, strict=True):
            view = flat[offset : offset + copy.numel()].view_as(copy)
            torch.sub(copy, param.float(), out=view)
            copy.grad = view
            offset += copy.numel()
        dtype = PSEUDO_GRADIENT_DTYPES[self.settings.pseudo_gradient_dtype]
        wire = flat if dtype == torch.float32 else flat.to(dtype)
        own = self._parts(wire.float()) if self.settings.eager else []
        self._count("all_reduce", wire.numel() * wire.element_size())
        work = dist.all_reduce(wire, group=self.process_group, async_op=True)
        return PendingSync(start, work=work, flat=flat, wire=wire, own=own)

    def _parts(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """``flat`` (fp32 [N]) cut into the trained parameters' shapes (copies)."""
        sizes = [copy.numel() for copy in self.synced]
        pieces = flat.split(sizes)
        return [
            piece.view_as(copy).clone() for piece, copy in zip(pieces, self.synced, strict=True)
        ]

    def _finish_diloco(self, pending: PendingSync) -> None:
        """Wait for the all-reduce; ``flat`` (``synced``'s gradients) becomes the mean."""
        assert pending.flat is not None and pending.wire is not None and pending.work is not None
        pending.work.wait()
        if pending.wire is not pending.flat:
            pending.flat.copy_(pending.wire)
        pending.flat.div_(dist.get_world_size(self.process_group))

    def _start_sparseloco(self, start: list[torch.Tensor]) -> PendingSync:
        """Error feedback, top-k per chunk and quantization of this rank's tensors (all of them,
        or its share when node-aware), and the all-gather of the message, started."""
        mine = [i for i, owner in enumerate(self.owners) if owner == self.local_rank]
        compressed = [self._compress(index) for index in mine]
        messages = [message for message, _ in compressed]
        device = self.synced[0].device
        payload = torch.cat(messages) if messages else torch.zeros(0, dtype=torch.uint8)
        own = [sent for _, sent in compressed] if self.settings.eager else []
        return PendingSync(start, flight=self.exchange.start(payload.to(device), []), own=own)

    def _finish_sparseloco(self, pending: PendingSync) -> None:
        """Wait for the all-gather(s); the mean of every sender's decoded values becomes
        ``synced``'s gradients."""
        assert pending.flight is not None
        rows = self.exchange.finish(pending.flight)
        offsets = [0] * len(rows)
        for index, owner in enumerate(self.owners):
            size = self._message_bytes(index)
            part = rows[owner][:, offsets[owner] : offsets[owner] + size]
            offsets[owner] += size
            self.synced[index].grad = decode_mean(
                part, self.codecs[index], self.settings.message_format
            )

    def _compress(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``e <- beta e + (synced - local)``; per chunk the top-k values of ``e``, quantized;
        ``e`` minus what was sent. Returns the message, uint8 [positions | codes | scales] (or
        [positions | fp32 values] without quantization), and what it sends (fp32, the
        parameter's shape)."""
        settings, codec = self.settings, self.codecs[index]
        error = self.error[index]
        error.mul_(settings.beta).add_(self.synced[index] - self.trained[index].float())
        message, sent = encode_chunks(codec.split(error), codec, settings.message_format)
        joined = codec.join(sent)
        error.sub_(joined)
        return message, joined


def build_local_updates(
    inner: Optimizer,
    settings: LocalUpdateSettings,
    state: CompressionState,
    process_group: dist.ProcessGroup | None = None,
) -> LocalUpdates:
    """:class:`LocalUpdates` around ``inner``, syncing in ``process_group`` (default: ``state``'s)
    and counting its bytes in ``state`` (:func:`.demo.register_local_gradients`'s; node-aware
    when it has node groups)."""
    group = process_group or state.process_group
    return LocalUpdates(inner, settings, group, state.count, state.node_groups)
