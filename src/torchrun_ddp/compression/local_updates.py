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

Defaults (see ``config.py``): DiLoCo H 500, outer lr 0.7, Nesterov momentum 0.9 (DiLoCo paper,
section 3); SparseLoCo H 15, k 64 of 4096-value chunks (1.56% density: the paper reports 1-3%),
error-feedback decay 0.95, 2-bit values, outer lr 1 (SparseLoCo paper's main setting).

Checkpoints (:class:`SyncedState`, :class:`RankState`). Between syncs the local parameters
and the inner AdamW moments differ between ranks, and the moments differ at a sync too (each rank
keeps its own). The project saves model and optimizer as *shared* state through DCP, which writes
one rank's copy of a replicated tensor; that would resume every rank with one rank's moments and
parameters. Two choices were possible: checkpoint only at sync boundaries, or save per-rank
state. Boundaries alone do not suffice: the inner moments are per rank at a boundary too, and a
SIGTERM or ``--checkpoint-every`` falls anywhere in a window (stopping only at a boundary would
lose up to H - 1 steps, or force an early sync that changes the run). So the state is split:

- shared (DCP, written once, loadable at any world size): the synced fp32 parameters, the outer
  momentum (DiLoCo) and the position inside the window;
- per rank (safetensors + JSON): the inner AdamW state, the error feedback (SparseLoCo), and the
  local parameters only when the checkpoint falls inside a window (at a boundary they are the
  synced ones rounded to the parameter dtype, so nothing is written).

Resume at the same world size is bit-exact anywhere in a window. At another world size the synced
parameters, the outer momentum and the position carry over exactly; each new rank ``r`` takes old
rank ``r mod W_old``'s inner AdamW state; the local progress since the last sync is dropped (every
rank restarts from the synced parameters) and the error feedback is reset, each with a warning.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch
import torch.distributed as dist
from torch.optim import SGD, Optimizer

from torchrun_ddp.compression.demo import Counter, TileCodec
from torchrun_ddp.compression.state import CompressionState
from torchrun_ddp.compression.transform import tile_shape
from torchrun_ddp.compression.wire import (
    SCALE_BYTES,
    packed_bytes,
    position_bits,
    sparseloco_chunk_payload,
    sparseloco_payload_bytes,
)
from torchrun_ddp.errors import UserError

if TYPE_CHECKING:
    from torchrun_ddp.config import TrainConfig

log = logging.getLogger("torchrun_ddp")

LOCAL_UPDATE_METHODS = ("diloco", "sparseloco")
PSEUDO_GRADIENT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
PAPER_LOCAL_STEPS = {"diloco": 500, "sparseloco": 15}
"""H of each paper's main runs (DiLoCo sec. 3; SparseLoCo's main comparison)."""
PAPER_OUTER_LR = {"diloco": 0.7, "sparseloco": 1.0}
"""Outer learning rate of each paper (DiLoCo: Nesterov SGD 0.7; SparseLoCo: plain SGD 1)."""
MAX_QUANT_BITS = 8


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
    if settings.topk < 1 or settings.chunk < 2 or not 0.0 <= settings.beta < 1.0:
        raise ValueError(
            f"SparseLoCo needs topk >= 1, chunk >= 2 and beta in [0, 1), got {settings.topk}, "
            f"{settings.chunk} and {settings.beta}"
        )
    if not 0 <= settings.quant_bits <= MAX_QUANT_BITS:
        raise ValueError(f"quant bits must be 0 (none) to 8, got {settings.quant_bits}")


def local_update_settings(config: TrainConfig) -> LocalUpdateSettings:
    """The settings of ``--optimizer diloco|sparseloco`` from the run's config: ``0`` for
    ``--local-steps`` and ``--outer-lr`` means the method's paper value; SparseLoCo ignores
    ``--outer-momentum`` (it has none). Raises UserError for values out of range."""
    method = config.optimizer
    settings = LocalUpdateSettings(
        method=method,
        local_steps=config.local_steps or PAPER_LOCAL_STEPS.get(method, 1),
        outer_lr=config.outer_lr or PAPER_OUTER_LR.get(method, 1.0),
        outer_momentum=config.outer_momentum if method == "diloco" else 0.0,
        pseudo_gradient_dtype=config.pseudo_gradient_dtype,
        topk=config.sparseloco_topk,
        chunk=config.sparseloco_chunk,
        beta=config.sparseloco_beta,
        quant_bits=config.quant_bits,
    )
    try:
        validate_local_updates(settings)
    except ValueError as exc:  # validate_local_updates raises ValueError for bad settings only
        raise UserError(f"--optimizer {method}: {exc}") from exc
    return settings


def describe(settings: LocalUpdateSettings) -> str:
    """One line for logs and tables, e.g. ``sparseloco H=15 k=64/4096 2-bit beta 0.95 lr 1``."""
    head = f"{settings.method} H={settings.local_steps}"
    if settings.method == "diloco":
        momentum = f"Nesterov {settings.outer_momentum:g}" if settings.outer_momentum else "SGD"
        dtype = "bf16" if settings.pseudo_gradient_dtype == "bfloat16" else "fp32"
        return f"{head} {dtype} outer {momentum} lr {settings.outer_lr:g}"
    values = f"{settings.quant_bits}-bit" if settings.quant_bits else "fp32"
    size = settings.chunk * settings.chunk
    return (
        f"{head} k={settings.topk}/{size} {values} beta {settings.beta:g} lr {settings.outer_lr:g}"
    )


def pack_bits(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Integers in ``[0, 2^bits)`` (any integer dtype, [n]) packed back to back, least
    significant bit first: uint8 [ceil(n * bits / 8)] (:func:`.wire.packed_bytes`)."""
    if bits == 0:
        return values.new_empty(0, dtype=torch.uint8)
    shifts = torch.arange(bits, device=values.device, dtype=torch.int32)
    planes = (values.to(torch.int32).unsqueeze(1) >> shifts) & 1
    flat = planes.reshape(-1).to(torch.uint8)
    flat = torch.cat([flat, flat.new_zeros(-flat.numel() % 8)])
    weights = 1 << torch.arange(8, device=values.device, dtype=torch.int32)
    return (flat.view(-1, 8).to(torch.int32) * weights).sum(1).to(torch.uint8)


def unpack_bits(data: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: the first ``count`` values, int64 [count]."""
    if bits == 0:
        return torch.zeros(count, dtype=torch.int64, device=data.device)
    shifts = torch.arange(8, device=data.device, dtype=torch.int32)
    planes = (data.to(torch.int32).unsqueeze(1) >> shifts) & 1
    flat = planes.reshape(-1)[: count * bits].view(count, bits)
    weights = 1 << torch.arange(bits, device=data.device, dtype=torch.int32)
    return (flat * weights).sum(1).to(torch.int64)


def quantize(values: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of ``values`` (fp32 [n, k]): codes in ``[0, 2^bits)`` (int64 [n, k]) and the
    scale (fp32 [n], the row's largest magnitude). Levels are evenly spaced over
    ``[-scale, scale]`` (:func:`dequantize`); each value goes to the nearest."""
    levels = 2**bits - 1
    scale = values.abs().amax(dim=1)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = ((values / safe.unsqueeze(1) + 1.0) * (levels / 2)).round_().clamp_(0, levels)
    return codes.to(torch.int64), scale


def dequantize(codes: torch.Tensor, scale: torch.Tensor, bits: int) -> torch.Tensor:
    """Values of ``codes`` (int [n, k]) under per-row ``scale`` (fp32 [n]): fp32 [n, k],
    ``(2 q / (2^bits - 1) - 1) * scale``; 2 bits: ``{-1, -1/3, 1/3, 1} * scale``."""
    levels = 2**bits - 1
    return (codes.to(torch.float32) * (2.0 / levels) - 1.0) * scale.unsqueeze(1)


class LocalUpdates(Optimizer):
    """DiLoCo or SparseLoCo (module docstring) around an inner optimizer, as an ``Optimizer``.

    ``inner``: the per-rank optimizer (AdamW over ``optimizer.parameter_groups``); this wrapper
    shares its parameter groups (the same dicts), so a learning-rate schedule built on the
    wrapper sets the inner learning rate. ``step()`` runs one inner step and, every
    ``settings.local_steps`` calls, the sync, a collective: every rank of ``process_group``
    must call it in the same step. ``counter`` (``CompressionState.count``) is told the bytes
    handed to the sync's collective, in the step that sends them.

    State: ``synced`` (fp32 copies of the trained parameters, the same on all ranks),
    ``outer`` (``torch.optim.SGD`` over ``synced``: Nesterov momentum for DiLoCo, whose buffers
    are created at zero here so that a checkpoint's keys never depend on the step; none for
    SparseLoCo), ``error`` (SparseLoCo: fp32 error feedback per parameter, per rank) and
    ``position`` (inner steps since the last sync, 0 <= position < H). Checkpointed by
    :class:`SyncedState` (shared) and :class:`RankState` (per rank).

    Raises ``ValueError`` for bad settings and ``RuntimeError`` (from torch) in ``step`` without
    an initialised process group.
    """

    def __init__(
        self,
        inner: Optimizer,
        settings: LocalUpdateSettings,
        process_group: dist.ProcessGroup | None = None,
        counter: Counter | None = None,
    ) -> None:
        validate_local_updates(settings)
        super().__init__(inner.param_groups, inner.defaults)
        self.inner = inner
        self.settings = settings
        self.process_group = process_group
        self.counter = counter
        self.position = 0
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
        self.codecs = (
            [chunk_codec(tuple(p.shape), settings) for p in self.trained] if sparse else []
        )

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One inner step; the sync when it completes a window. Returns ``closure()``'s loss."""
        loss = self.inner.step(closure)
        self.position += 1
        if self.position >= self.settings.local_steps:
            if self.settings.method == "diloco":
                self._sync_diloco()
            else:
                self._sync_sparseloco()
            self._finish_sync()
        return loss

    def payload_bytes(self) -> int:
        """Bytes this rank hands to the sync's collective (all-reduce input for DiLoCo, this
        rank's all-gather part for SparseLoCo); see ``wire.diloco_payload_bytes`` and
        ``wire.sparseloco_payload_bytes``."""
        if self.settings.method == "diloco":
            dtype = PSEUDO_GRADIENT_DTYPES[self.settings.pseudo_gradient_dtype]
            return sum(p.numel() for p in self.trained) * dtype.itemsize
        bits = self.settings.quant_bits
        return sum(
            sparseloco_chunk_payload(codec.n_tiles, codec.k, codec.tile_numel, bits)
            for codec in self.codecs
        )

    def _count(self, collective: str, nbytes: int) -> None:
        if self.counter is not None:
            self.counter(collective, nbytes, self.process_group)

    def _sync_diloco(self) -> None:
        """Mean pseudo-gradient over ranks by one all-reduce, set as ``synced``'s gradients."""
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
        self._count("all_reduce", wire.numel() * wire.element_size())
        dist.all_reduce(wire, group=self.process_group)
        if wire is not flat:
            flat.copy_(wire)
        flat.div_(dist.get_world_size(self.process_group))

    def _sync_sparseloco(self) -> None:
        """Error feedback, top-k per chunk, quantization; one all-gather; the mean of every
        rank's sent values set as ``synced``'s gradients."""
        messages = [self._compress(index) for index in range(len(self.trained))]
        payload = torch.cat(messages)
        world = dist.get_world_size(self.process_group)
        self._count("all_gather", payload.numel())
        gathered = payload.new_empty(world * payload.numel())
        dist.all_gather_into_tensor(gathered, payload, group=self.process_group)
        rows = gathered.view(world, -1)
        offset = 0
        for index, message in enumerate(messages):
            part = rows[:, offset : offset + message.numel()]
            offset += message.numel()
            self.synced[index].grad = self._decode(index, part)

    def _finish_sync(self) -> None:
        """Outer step on ``synced``, then every rank restarts from it."""
        self.outer.step()
        for param, copy in zip(self.trained, self.synced, strict=True):
            copy.grad = None
            param.copy_(copy)
        self.position = 0

    def _compress(self, index: int) -> torch.Tensor:
        """``e <- beta e + (synced - local)``; per chunk the top-k values of ``e``, quantized;
        ``e`` minus what was sent. The message: uint8 [positions | codes | scales] (or
        [positions | fp32 values] without quantization)."""
        settings, codec = self.settings, self.codecs[index]
        error = self.error[index]
        error.mul_(settings.beta).add_(self.synced[index] - self.trained[index].float())
        chunks = codec.split(error)
        positions = chunks.abs().topk(codec.k, dim=1, sorted=False).indices
        values = chunks.gather(1, positions)
        parts = [pack_bits(positions.reshape(-1), position_bits(codec.tile_numel))]
        if settings.quant_bits:
            codes, scale = quantize(values, settings.quant_bits)
            values = dequantize(codes, scale, settings.quant_bits)
            parts += [pack_bits(codes.reshape(-1), settings.quant_bits), _bytes(scale)]
        else:
            parts.append(_bytes(values))
        sent = torch.zeros_like(chunks).scatter_(1, positions, values)
        error.sub_(codec.join(sent))
        return torch.cat(parts)

    def _decode(self, index: int, rows: torch.Tensor) -> torch.Tensor:
        """All ranks' messages of one parameter ([world_size, message bytes] uint8) -> the mean
        of the values they sent, in the parameter's shape (fp32); ranks summed in rank order."""
        codec, bits = self.codecs[index], self.settings.quant_bits
        count = codec.n_tiles * codec.k
        split = packed_bytes(count, position_bits(codec.tile_numel))
        total = torch.zeros(codec.n_tiles, codec.tile_numel, device=rows.device)
        for rank in range(rows.shape[0]):  # rank order: the same sums on every rank
            row = rows[rank]
            positions = unpack_bits(row[:split], position_bits(codec.tile_numel), count)
            values = _values(row[split:], codec, bits)
            total.scatter_add_(1, positions.view(codec.n_tiles, codec.k), values)
        return codec.join(total / rows.shape[0])


def _bytes(values: torch.Tensor) -> torch.Tensor:
    """An fp32 tensor's raw bytes, uint8 [4 numel]."""
    return values.contiguous().reshape(-1).view(torch.uint8)


def _values(data: torch.Tensor, codec: TileCodec, bits: int) -> torch.Tensor:
    """The values part of one rank's message -> fp32 [n_chunks, k] (dequantized)."""
    count = codec.n_tiles * codec.k
    if bits == 0:
        return data.clone().view(torch.float32).view(codec.n_tiles, codec.k)
    split = packed_bytes(count, bits)
    codes = unpack_bits(data[:split], bits, count).view(codec.n_tiles, codec.k)
    scale = data[split : split + SCALE_BYTES * codec.n_tiles].clone().view(torch.float32)
    return dequantize(codes, scale, bits)


def chunk_codec(shape: tuple[int, ...], settings: LocalUpdateSettings) -> TileCodec:
    """SparseLoCo's chunks of a parameter of ``shape``: DeMo's tiles (sides at most
    ``settings.chunk``), used without the DCT; ``k = min(topk, chunk values)``."""
    sides = tile_shape(shape, settings.chunk)
    return TileCodec(shape, sides, min(settings.topk, math.prod(sides)))


def build_local_updates(
    inner: Optimizer, settings: LocalUpdateSettings, state: CompressionState
) -> LocalUpdates:
    """:class:`LocalUpdates` around ``inner``, syncing in ``state``'s process group and counting
    its bytes there (``state``: :func:`.demo.register_local_gradients`'s)."""
    return LocalUpdates(inner, settings, state.process_group, counter=state.count)


SPARSELOCO_WORK_COPIES = 5
"""fp32 copies of one parameter alive at once in SparseLoCo's compression: the pseudo-gradient,
its chunks, their magnitudes for top-k, the sent values scattered back and their join."""


@dataclass(frozen=True)
class MemoryRow:
    """One row of the memory a local-update optimizer adds per rank, in bytes; ``persistent``
    rows live through the run, the others only during a sync (in the optimizer step)."""

    name: str
    nbytes: int
    persistent: bool


def memory_rows(
    settings: LocalUpdateSettings, shapes: list[tuple[int, ...]], world_size: int
) -> list[MemoryRow]:
    """What DiLoCo or SparseLoCo holds beyond the inner AdamW, per rank, for trained parameters
    of ``shapes`` (``N`` values): the synced fp32 copy (4 N); DiLoCo's outer momentum (4 N, when
    > 0) or SparseLoCo's error feedback (4 N); and at a sync, the fp32 pseudo-gradient handed
    to the outer SGD (4 N) plus DiLoCo's bf16 wire copy (2 N) or SparseLoCo's own and gathered
    messages ((1 + W) x payload) and ``SPARSELOCO_WORK_COPIES`` fp32 copies of the largest
    parameter (it compresses one parameter at a time)."""
    sizes = [math.prod(shape) for shape in shapes]
    numel = sum(sizes)
    rows = [MemoryRow("synced parameters (fp32 copy, the same on every rank)", 4 * numel, True)]
    if settings.method == "diloco":
        if settings.outer_momentum:
            rows.append(MemoryRow("outer Nesterov momentum (fp32)", 4 * numel, True))
        bf16 = settings.pseudo_gradient_dtype == "bfloat16"
        name = "sync: pseudo-gradient (fp32" + (", and its bf16 wire copy)" if bf16 else ")")
        rows.append(MemoryRow(name, 4 * numel + (2 * numel if bf16 else 0), False))
        return rows
    rows.append(MemoryRow("error feedback (fp32, per rank)", 4 * numel, True))
    payload = sparseloco_payload_bytes(shapes, settings.topk, settings.chunk, settings.quant_bits)
    work = SPARSELOCO_WORK_COPIES * 4 * max(sizes, default=0)
    temporary = 4 * numel + (1 + world_size) * payload + work
    rows.append(MemoryRow("sync: mean pseudo-gradient, messages, chunk work", temporary, False))
    return rows


def _indexed(tensors: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    return {str(index): tensor for index, tensor in enumerate(tensors)}


class SyncedState:
    """A :class:`LocalUpdates`' replicated state as shared checkpoint state (the same on every
    rank, so DCP writes each tensor once and loads it at any world size).

    ``{"position": int, "synced": {"<i>": fp32 tensor}, "momentum": {"<i>": fp32 tensor}}``, keyed
    by the trained parameter's position (``Optimizer.state_dict``'s numbering); ``momentum`` is
    empty without outer momentum. ``state_dict`` returns the live tensors, so DCP loads them in
    place; ``load_state_dict`` copies where they are other tensors.
    """

    def __init__(self, optimizer: LocalUpdates) -> None:
        self.optimizer = optimizer

    def _momentum(self) -> list[torch.Tensor]:
        state = self.optimizer.outer.state
        return [state[copy]["momentum_buffer"] for copy in self.optimizer.synced if copy in state]

    def state_dict(self) -> dict[str, object]:
        """The window position, the synced parameters and the outer momentum."""
        return {
            "position": self.optimizer.position,
            "synced": _indexed(self.optimizer.synced),
            "momentum": _indexed(self._momentum()),
        }

    @torch.no_grad()
    def load_state_dict(self, state_dict: Mapping[str, object], /) -> None:
        """Restore what ``state_dict`` returned (any rank's, any world size), bit for bit."""
        self.optimizer.position = int(cast(int, state_dict["position"]))
        _copy_into(self.optimizer.synced, state_dict["synced"])
        _copy_into(self._momentum(), state_dict["momentum"])


def _copy_into(targets: list[torch.Tensor], saved: object) -> None:
    """Copy ``saved`` (``{"<i>": tensor}``) into ``targets`` by position; raises ValueError when
    the counts differ (another model or outer momentum setting)."""
    pieces = cast(Mapping[str, torch.Tensor], saved)
    if len(pieces) != len(targets):
        raise ValueError(f"saved state has {len(pieces)} tensors, this run {len(targets)}")
    for index, target in enumerate(targets):
        piece = pieces[str(index)]
        if piece is not target:
            target.copy_(piece)


class RankState:
    """A :class:`LocalUpdates`' per-rank state as per-rank checkpoint state (JSON + tensors,
    nothing pickled): the inner optimizer's ``state_dict`` (parameter positions as string keys),
    the error feedback (SparseLoCo) and, inside a window, the local parameters.

    Load it after :class:`SyncedState` (``load_checkpoint`` restores shared state first): the
    local parameters are the saved ones inside a window, else the synced ones.
    """

    def __init__(self, optimizer: LocalUpdates) -> None:
        self.optimizer = optimizer

    def state_dict(self) -> dict[str, object]:
        """``{"inner": {"state", "param_groups"}, "error_feedback": {...}, "local": {...}}``."""
        optimizer = self.optimizer
        inner = optimizer.inner.state_dict()
        trained = [p.detach() for p in optimizer.trained]
        return {
            "inner": {
                "state": {str(index): values for index, values in inner["state"].items()},
                "param_groups": inner["param_groups"],
            },
            "error_feedback": _indexed(optimizer.error),
            "local": _indexed(trained) if optimizer.position else {},
        }

    @torch.no_grad()
    def load_state_dict(self, state_dict: Mapping[str, object], /) -> None:
        """Restore this rank's own state, bit for bit."""
        self.load_inner(state_dict)
        _copy_into(self.optimizer.error, state_dict["error_feedback"])
        local = cast(Mapping[str, torch.Tensor], state_dict["local"])
        _copy_into(self.optimizer.trained, local or _indexed(self.optimizer.synced))

    @torch.no_grad()
    def load_resharded(self, state_dict: Mapping[str, object]) -> list[str]:
        """Continue at another world size from one old rank's state: its inner optimizer state;
        the local parameters restart from the synced ones and the error feedback from zero.
        Returns what was dropped, one line each, for the caller to log as warnings."""
        optimizer = self.optimizer
        self.load_inner(state_dict)
        dropped = []
        if optimizer.position:
            dropped.append(
                f"the {optimizer.position} local steps since the last sync (every rank restarts "
                "from the synced parameters)"
            )
        if optimizer.error:
            dropped.append("the SparseLoCo error feedback (reset to zero)")
            for error in optimizer.error:
                error.zero_()
        _copy_into(optimizer.trained, _indexed(optimizer.synced))
        return dropped

    def load_inner(self, state_dict: Mapping[str, object]) -> None:
        """Load the inner optimizer's state; the wrapper then shares the new parameter groups
        (``Optimizer.load_state_dict`` replaces the group dicts)."""
        optimizer = self.optimizer
        inner = cast(Mapping[str, object], state_dict["inner"])
        states = cast(Mapping[str, object], inner["state"])
        optimizer.inner.load_state_dict(
            {
                "state": {int(index): values for index, values in states.items()},
                "param_groups": inner["param_groups"],
            }
        )
        optimizer.param_groups = optimizer.inner.param_groups
