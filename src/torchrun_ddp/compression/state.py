"""Per-rank compression state: error-feedback residuals, PowerSGD memories, checkpointing.

Error feedback (Seide et al. 2014; Karimireddy et al. 2019; used by PowerSGD and DeMo) keeps on
each rank what its compressed message failed to carry, and adds it to the next step's gradient.
Residuals are stored per bucket for speed but converted to per-parameter pieces whenever the
bucket layout changes and in :meth:`CompressionState.state_dict`, so they survive the DDP rebuild
and a resume into a differently bucketed process. No state is kept while ``step < start_step``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState

from torchrun_ddp.compression.settings import (
    POWERSGD_EPSILON,
    POWERSGD_MIN_RATE,
    POWERSGD_MIN_START,
    CompressionSettings,
    keeps_residual,
    validate_settings,
)
from torchrun_ddp.compression.transform import BlockLayout
from torchrun_ddp.compression.wire import (
    ShardedExchange,
    dense_wire_bytes,
    sharded_step_bytes,
    wire_bytes,
)

if TYPE_CHECKING:
    from torchrun_ddp.distributed import NodeGroups


class StepBytes(NamedTuple):
    """One step's communication on one rank, in bytes (see :class:`CompressionState`)."""

    wire: int
    dense: int
    collective: int


NO_BYTES = StepBytes(0, 0, 0)


def _plus(first: StepBytes, second: StepBytes) -> StepBytes:
    return StepBytes(*(a + b for a, b in zip(first, second, strict=True)))


Slices = tuple[tuple[int, int, int], ...]
"""Per parameter: (parameter index, start, length) inside a flat per-bucket tensor."""


class BucketStore:
    """Flat per-bucket tensors that survive DDP bucket rebuilds.

    Each entry remembers the slices (parameter layout) and the step it was stored for. When a
    bucket arrives whose layout differs, every entry stored before the current step is split into
    per-parameter pieces, and the bucket's tensor is rebuilt from the pieces. ``tensors`` may
    alias a dict owned by someone else (PowerSGDState's memories).
    """

    def __init__(self, tensors: dict[int, torch.Tensor] | None = None) -> None:
        self.tensors: dict[int, torch.Tensor] = {} if tensors is None else tensors
        self.layouts: dict[int, tuple[Slices, int]] = {}
        self.pieces: dict[int, torch.Tensor] = {}

    def fetch(
        self, index: int, slices: Slices, step: int, like: torch.Tensor, require_all: bool
    ) -> torch.Tensor | None:
        """The bucket's flat tensor for ``slices`` (dtype/device of ``like``), None if unknown.

        A tensor rebuilt from pieces spans ``max(start + length)`` of ``slices``; parameters
        without a piece are zero, or the result is None if ``require_all``.
        """
        recorded = self.layouts.get(index)
        if recorded is not None and recorded[0] == slices:
            return self.tensors.get(index)
        self._flush_before(step)
        return self._join(slices, like, require_all)

    def keep(self, index: int, slices: Slices, step: int, tensor: torch.Tensor) -> None:
        """Store the bucket's tensor for ``slices``, made at ``step``."""
        self.tensors[index] = tensor
        self.layouts[index] = (slices, step)

    def export(self) -> dict[int, torch.Tensor]:
        """Copies of every per-parameter piece, including those still held per bucket."""
        out = {index: piece.clone() for index, piece in self.pieces.items()}
        for bucket, (slices, _) in self.layouts.items():
            if bucket in self.tensors:
                out.update(_split(self.tensors[bucket], slices))
        return out

    def load(self, pieces: Mapping[int, torch.Tensor]) -> None:
        """Replace everything with ``pieces`` (parameter index -> flat tensor)."""
        self.tensors.clear()
        self.layouts.clear()
        self.pieces = {index: piece.detach().clone().reshape(-1) for index, piece in pieces.items()}

    def _flush_before(self, step: int) -> None:
        for bucket, (slices, made) in list(self.layouts.items()):
            if made >= step:
                continue
            del self.layouts[bucket]
            tensor = self.tensors.pop(bucket, None)
            if tensor is not None:
                self.pieces.update(_split(tensor, slices))

    def _join(self, slices: Slices, like: torch.Tensor, require_all: bool) -> torch.Tensor | None:
        present = [index in self.pieces for index, _, _ in slices]
        if not any(present) or (require_all and not all(present)):
            return None
        length = max((start + size for _, start, size in slices), default=0)
        out = torch.zeros(length, dtype=like.dtype, device=like.device)
        for index, start, size in slices:
            piece = self.pieces.pop(index, None)
            if piece is not None and piece.numel() == size:
                out[start : start + size].copy_(piece)
        return out


def _split(flat: torch.Tensor, slices: Slices) -> dict[int, torch.Tensor]:
    return {index: flat[start : start + size].clone() for index, start, size in slices}


@dataclass(frozen=True)
class BlockPlan:
    slices: Slices
    layout: BlockLayout


@dataclass(frozen=True)
class PowerSGDSlices:
    error: Slices
    p: Slices
    q: Slices


def powersgd_slices(
    shapes: list[tuple[int, ...]], indices: list[int], rank: int, min_rate: float
) -> tuple[Slices, Slices]:
    """Where each parameter's P and Q factors sit in torch's per-bucket PowerSGD memories.

    Mirrors ``powerSGD_hook``: a gradient viewed as [n, m] is compressed when
    ``(n + m) * r * min_rate < n * m`` with ``r = min(n, m, rank)``; compressed matrices are grouped
    by shape in order of first appearance; P takes ``n * r`` values and Q ``m * r``.
    """
    groups: dict[tuple[int, int], list[tuple[int, int, int, int]]] = {}
    for index, shape in zip(indices, shapes, strict=True):
        if not shape:
            continue
        n = shape[0]
        m = math.prod(shape) // n if n else 0
        r = min(n, m, rank)
        if (n + m) * r * min_rate < n * m:
            groups.setdefault((n, m), []).append((index, n, m, r))
    p_slices: list[tuple[int, int, int]] = []
    q_slices: list[tuple[int, int, int]] = []
    p_at = q_at = 0
    for members in groups.values():
        for index, n, m, r in members:
            p_slices.append((index, p_at, n * r))
            q_slices.append((index, q_at, m * r))
            p_at += n * r
            q_at += m * r
    return tuple(p_slices), tuple(q_slices)


class CompressionState:
    """State of :func:`compression_hook` on one rank; create it with :func:`register_compression`.

    Byte counters cover the current optimizer step on this rank (see :meth:`pop_step_bytes`):
    ``comm_bytes`` is what this rank sends on the wire under the ring model of
    :mod:`torchrun_ddp.compression.wire` (every collective of every bucket, in its group),
    ``comm_bytes_dense`` what a dense fp32 ring all-reduce of the same buckets over all
    ``world_size`` ranks would send, and ``comm_bytes_collective`` the bytes handed to
    collectives (``numel * element_size`` of every input; for all-gather the rank's own
    contribution). ``hook_calls`` counts hook invocations since creation; ``step`` counts
    optimizer steps seen (incremented on the last bucket of each backward pass).
    """

    def __init__(
        self,
        settings: CompressionSettings,
        parameters: Iterable[torch.nn.Parameter],
        process_group: dist.ProcessGroup | None = None,
        node_groups: NodeGroups | None = None,
    ) -> None:
        """``parameters``: the DDP model's ``parameters()``, whose order numbers checkpoint keys.

        ``node_groups``: the intra- and inter-node groups, needed for ``scope = "inter-node"``.
        Raises ``ValueError`` for invalid settings or a missing ``node_groups``. Needs an
        initialised process group.
        """
        validate_settings(settings)
        if settings.scope == "inter-node" and node_groups is None:
            raise ValueError("compression scope inter-node needs the intra- and inter-node groups")
        self.settings = settings
        self.process_group = process_group
        self.node_groups = node_groups
        self.world_size = dist.get_world_size(process_group)
        self.comm_bytes = 0.0
        self.comm_bytes_dense = 0.0
        self.comm_bytes_collective = 0
        self.hook_calls = 0
        self.step = 0
        self.builtin_step_bytes: StepBytes | None = None
        """Set when DDP's built-in all-reduce runs instead of a hook (``none``)."""
        self.fsdp_step_bytes: StepBytes | None = None
        """FSDP's collectives within the shard group, added to the hook's counts (hsdp)."""
        self.bf16_transport = "all_reduce"
        """``all_reduce`` (native bfloat16) or ``all_gather`` (raw bits, summed in fp32)."""
        self._param_index = {id(param): index for index, param in enumerate(parameters)}
        self._block_plans: dict[int, tuple[tuple[int, ...], BlockPlan]] = {}
        self._powersgd_plans: dict[int, tuple[tuple[int, ...], PowerSGDSlices]] = {}
        self._residuals = BucketStore()
        self._powersgd: PowerSGDState | None = None
        self._ps_stores: tuple[BucketStore, BucketStore, BucketStore] | None = None
        if settings.method == "powersgd":
            self._init_powersgd()

    def _init_powersgd(self) -> None:
        state = PowerSGDState(
            process_group=self.process_group,
            matrix_approximation_rank=self.settings.powersgd_rank,
            start_powerSGD_iter=max(self.settings.start_step, POWERSGD_MIN_START),
            min_compression_rate=POWERSGD_MIN_RATE,
            orthogonalization_epsilon=POWERSGD_EPSILON,
        )
        self._powersgd = state
        self._ps_stores = (
            BucketStore(state.error_dict),
            BucketStore(state.p_memory_dict),
            BucketStore(state.q_memory_dict),
        )

    def count(self, collective: str, nbytes: int, group: dist.ProcessGroup | None) -> None:
        """Record one collective of ``nbytes`` input bytes (all-gather: this rank's part)."""
        self.comm_bytes_collective += nbytes
        self.comm_bytes += wire_bytes(collective, nbytes, dist.get_world_size(group))

    def count_builtin_all_reduce(self, parameters: Iterable[torch.nn.Parameter]) -> None:
        """Count DDP's built-in all-reduce (no comm hook) analytically, once per optimizer step.

        DDP all-reduces every bucket of the gradients of ``parameters`` that require grad, in
        their dtype, once per step (``no_sync`` on the other micro-batches); the ring model is
        linear in the size, so the buckets' wire bytes sum to those of one all-reduce of all of
        them. :meth:`pop_step_bytes` then returns these counts for every step.
        """
        trained = [param for param in parameters if param.requires_grad]
        nbytes = sum(param.numel() * param.element_size() for param in trained)
        numel = sum(param.numel() for param in trained)
        group = self.process_group
        self.builtin_step_bytes = StepBytes(
            round(wire_bytes("all_reduce", nbytes, dist.get_world_size(group))),
            round(dense_wire_bytes(numel, self.world_size)),
            nbytes,
        )

    def count_sharded_exchange(self, exchange: ShardedExchange, hooked: bool = False) -> None:
        """Count FSDP's collectives analytically, once per optimizer step, like
        :meth:`count_builtin_all_reduce`: ``sharded_step_bytes`` of ``exchange``, next to a
        dense fp32 all-reduce of its trained parameters over all ranks. ``hooked``: a comm
        hook exchanges the shards across the replicate group (``replicas.ReplicaExchange``),
        so FSDP's part is its shard group's collectives only, and each step adds what the hook
        counts to it (the dense figure stays the whole world's)."""
        fsdp = replace(exchange, replicate=1) if hooked else exchange
        wire, collective = sharded_step_bytes(fsdp)
        world = exchange.shard * exchange.replicate
        dense = dense_wire_bytes(exchange.parameters, world)
        counts = StepBytes(round(wire), round(dense), collective)
        if hooked:
            self.fsdp_step_bytes = counts
        else:
            self.builtin_step_bytes = counts

    def pop_step_bytes(self) -> StepBytes:
        """Return this step's byte counts (rounded to whole bytes) and reset them to 0: the
        analytic counts of DDP's or FSDP's own collectives where set (``builtin_step_bytes``,
        ``fsdp_step_bytes``, whose dense figure is the whole world's), plus what the hook counted
        (under ``--fault-tolerance sites`` the builtin counts are the site's own collectives,
        the hook's the exchange across sites)."""
        counted = StepBytes(
            round(self.comm_bytes), round(self.comm_bytes_dense), self.comm_bytes_collective
        )
        self.comm_bytes = 0.0
        self.comm_bytes_dense = 0.0
        self.comm_bytes_collective = 0
        if self.builtin_step_bytes is not None:
            return _plus(self.builtin_step_bytes, counted)
        if self.fsdp_step_bytes is not None:
            fsdp = self.fsdp_step_bytes
            counted = StepBytes(
                counted.wire + fsdp.wire, fsdp.dense, counted.collective + fsdp.collective
            )
        return counted

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Flat ``{name: tensor}``: loadable by safetensors and ``torch.load(weights_only=True)``.

        Keys: ``step`` (int64 scalar); ``residual.<i>`` (fp32, flat, error feedback of parameter i
        in ``model.parameters()`` order; only methods that keep residuals, see
        :func:`~torchrun_ddp.compression.settings.keeps_residual`); for powersgd
        ``powersgd.{error,p,q}.<i>`` and ``powersgd.rng.*`` (the numpy RNG that seeds fresh Q
        factors).
        """
        out = self.shared_state_dict()
        for index, piece in self._residuals.export().items():
            out[f"residual.{index}"] = piece
        if self._ps_stores is not None:
            for index, piece in self._ps_stores[0].export().items():
                out[f"powersgd.error.{index}"] = piece
        return out

    def load_state_dict(self, state: Mapping[str, torch.Tensor | int]) -> None:
        """Restore from :meth:`state_dict` output; buckets pick their pieces up lazily.

        Residuals saved by a method that no longer keeps them (low-pass ``dct`` checkpoints from
        before it dropped its dead residual) are ignored: they were never sent.
        """
        if keeps_residual(self.settings):
            self._residuals.load(_pieces(state, "residual."))
        if self._ps_stores is not None:
            self._ps_stores[0].load(_pieces(state, "powersgd.error."))
        self.load_shared_state_dict(state)

    def exchange_over(self, group: dist.ProcessGroup, world_size: int, step: int) -> None:
        """Run the hook's next collectives on ``group``, divide its sums by ``world_size`` and
        count ``step`` as the optimizer steps seen (across fault-tolerant sites: the quorum's
        torchft group, the sites taking part, which a site that heals in this step, in the
        group but sending zeros, is not, and the run's step, which a site's join does not
        advance)."""
        self.process_group, self.world_size, self.step = group, world_size, step
        if self._powersgd is not None:
            self._powersgd.process_group, self._powersgd.iter = group, step

    @contextmanager
    def error_feedback_aside(self) -> Iterator[None]:
        """Within: the hook sends the gradient it is given, adds no error feedback to it, and
        what it would keep is dropped; after: this rank's error feedback (``residual.*``,
        ``powersgd.error.*``) as it was. The shared state (``step``, PowerSGD's P and Q) moves
        on as on the other ranks: for a rank that must send zeros, a site that joins or heals
        across fault-tolerant sites (``sites.adamw``)."""
        residuals, stores, power = self._residuals, self._ps_stores, self._powersgd
        self._residuals = BucketStore()
        errors = None if power is None else power.error_dict
        if power is not None and stores is not None:
            power.error_dict = {}
            self._ps_stores = (BucketStore(power.error_dict), stores[1], stores[2])
        try:
            yield
        finally:
            self._residuals, self._ps_stores = residuals, stores
            if power is not None and errors is not None:
                power.error_dict = errors

    def shared_state_dict(self) -> dict[str, torch.Tensor]:
        """The part of :meth:`state_dict` that every rank holds alike (copies): ``step`` and,
        for powersgd, the P and Q memories (all-reduced, ``rank`` columns per matrix) and the
        RNG that seeds new ones. What a site that heals takes from a live one; the error
        feedback stays each rank's own."""
        out = {"step": torch.tensor(self.step, dtype=torch.int64)}
        if self._powersgd is None or self._ps_stores is None:
            return out
        for name, store in zip(("p", "q"), self._ps_stores[1:], strict=True):
            for index, piece in store.export().items():
                out[f"powersgd.{name}.{index}"] = piece
        out.update(_rng_to_tensors(self._powersgd.rng))
        return out

    def load_shared_state_dict(self, state: Mapping[str, torch.Tensor | int]) -> None:
        """Load a :meth:`shared_state_dict` (another rank's, or this one's from before an
        exchange that is undone) and keep this rank's own error feedback."""
        self.step = int(state["step"])
        if self._powersgd is None or self._ps_stores is None:
            return
        self._powersgd.iter = self.step
        for name, store in zip(("p", "q"), self._ps_stores[1:], strict=True):
            store.load(_pieces(state, f"powersgd.{name}."))
        if "powersgd.rng.keys" in state:
            _rng_from_tensors(self._powersgd.rng, state)

    def load_resharded(self, state: Mapping[str, torch.Tensor | int]) -> int:
        """Continue at another world size from one old rank's :meth:`state_dict` (rank 0's).

        Kept: ``step`` and, for powersgd, the P and Q memories (the same on every rank after
        their all-reduce) and the RNG. Dropped: the error-feedback residuals (``residual.*``,
        ``powersgd.error.*``): they are per rank, only their mean over the old ranks would carry
        over exactly, and that needs every old rank's copy (a model-sized read per old rank).
        Returns how many residual tensors were dropped; the caller logs it as a warning. A
        dropped residual loses at most one step's worth of unsent gradient per parameter.
        """
        dropped = [key for key in state if _own(key)]
        kept = {key: value for key, value in state.items() if key not in dropped}
        self.load_state_dict(kept)
        return len(dropped)

    def bucket_slices(self, bucket: dist.GradBucket) -> Slices:
        """(parameter index, offset, numel) of every gradient in the bucket's buffer."""
        base = bucket.buffer().storage_offset()
        return tuple(
            (self._param_index[id(param)], grad.storage_offset() - base, grad.numel())
            for param, grad in zip(bucket.parameters(), bucket.gradients(), strict=True)
        )


def cached_plan[T](
    cache: dict[int, tuple[tuple[int, ...], T]], bucket: dist.GradBucket, build: Callable[[], T]
) -> T:
    """Per-bucket plan, rebuilt only when the bucket's parameters change (DDP rebuild)."""
    ids = tuple(map(id, bucket.parameters()))
    cached = cache.get(bucket.index())
    if cached is not None and cached[0] == ids:
        return cached[1]
    value = build()
    cache[bucket.index()] = (ids, value)
    return value


def _own(key: str) -> bool:
    """Whether a :meth:`CompressionState.state_dict` key is a rank's own error feedback."""
    return key.startswith(("residual.", "powersgd.error."))


def _pieces(state: Mapping[str, torch.Tensor | int], prefix: str) -> dict[int, torch.Tensor]:
    return {
        int(key[len(prefix) :]): value
        for key, value in state.items()
        if key.startswith(prefix) and isinstance(value, torch.Tensor)
    }


def _rng_to_tensors(rng: np.random.RandomState) -> dict[str, torch.Tensor]:
    _, keys, pos, has_gauss, gauss = rng.get_state(legacy=True)
    return {
        "powersgd.rng.keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
        "powersgd.rng.pos": torch.tensor(int(pos), dtype=torch.int64),
        "powersgd.rng.has_gauss": torch.tensor(int(has_gauss), dtype=torch.int64),
        "powersgd.rng.gauss": torch.tensor(float(gauss), dtype=torch.float64),
    }


def _rng_from_tensors(rng: np.random.RandomState, state: Mapping[str, torch.Tensor | int]) -> None:
    keys = torch.as_tensor(state["powersgd.rng.keys"]).numpy().astype(np.uint32)
    rng.set_state(
        (
            "MT19937",
            keys,
            int(state["powersgd.rng.pos"]),
            int(state["powersgd.rng.has_gauss"]),
            float(state["powersgd.rng.gauss"]),
        )
    )
