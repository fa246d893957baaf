"""Gradient-compression communication hooks for ``DistributedDataParallel``.

A DDP communication hook receives one gradient bucket at a time (a flat 1-D tensor holding the
gradients of several parameters) and returns a future whose value is the averaged bucket. This
module provides one hook, :func:`compression_hook`, that dispatches on
:attr:`CompressionSettings.method`:

``none``
    Dense all-reduce of the bucket, averaged over ranks. The reference, with byte counting.
``fp16`` / ``bf16``
    The bucket is divided by the world size in its own precision, cast to the 16-bit type,
    all-reduced and cast back (the scheme of torch's ``fp16_compress_hook``; bfloat16 from
    Kalamkar et al. 2019, "A Study of BFLOAT16 for Deep Learning Training"). If a gloo build cannot
    reduce bfloat16 (older gloo, or gloo on CUDA tensors), ``bf16`` all-gathers the raw 16-bit
    patterns as bytes instead and sums them in fp32 on every rank; that transport is lossless.
``dct``
    Transform coding with the orthonormal DCT-II (Ahmed, Natarajan & Rao 1974, "Discrete Cosine
    Transform", IEEE Trans. Computers C-23): every parameter's gradient is cut into 1-D blocks of
    ``block_size`` values, each block is transformed and only its ``k`` lowest-frequency
    coefficients are all-reduced, like the low-pass quantisation of JPEG (Wallace 1991). With a
    16-bit ``topk_value_dtype`` the coefficients are rounded and all-gathered instead.
``dct-topk``
    Per block the ``topk`` largest-magnitude DCT coefficients are exchanged as (value, index)
    pairs with an all-gather, as in DeMo (Peng, Quesnelle & Kingma 2024, "DeMo: Decoupled
    Momentum Optimization", arXiv:2411.19870).
``powersgd``
    torch's ``powerSGD_hook`` (Vogels, Karimireddy & Jaggi 2019, "PowerSGD: Practical Low-Rank
    Gradient Compression for Distributed Optimization", arXiv:1905.13727), made safe on gloo.

Blocks never straddle two parameters: each parameter's slice of the bucket is zero-padded to a
multiple of ``block_size`` on its own. The compressed result therefore does not depend on how DDP
groups parameters into buckets, which changes once after the first iteration (DDP rebuilds its
buckets in gradient-ready order) and again in every fresh process (resume).

Error feedback (Seide et al. 2014; Karimireddy et al. 2019; used by PowerSGD and DeMo) keeps on
each rank what its compressed message failed to carry, and adds it to the next step's gradient.
Residuals are stored per bucket for speed but converted to per-parameter pieces whenever the
bucket layout changes and in :meth:`CompressionState.state_dict`, so they survive the DDP rebuild
and a resume into a differently bucketed process. No state is kept while ``step < start_step``.

Why torch's PowerSGD hook fails on gloo with several buckets: the hook issues its first all-reduce
from the calling thread and the next two (P and Q) from ``Future.then`` callbacks. On gloo those
callbacks run on whichever thread completes the previous work: a gloo worker thread, or the
calling thread when the work finished before ``then`` was attached. Meanwhile DDP calls the hook
for the next bucket on the main thread, which issues that bucket's first all-reduce. Gloo pairs
collectives across ranks by issue order, so one rank can pair bucket i's P all-reduce with bucket
i+1's dense all-reduce on another rank: sizes differ, and gloo aborts with
``op.preamble.length <= op.nbytes`` or both ranks wait forever. With one bucket nothing
interleaves. The wrapper here waits for each bucket's future before returning, which serialises
the collectives of consecutive buckets identically on all ranks. On NCCL the wait only orders CUDA
streams and does not block the host.
"""

import functools
import itertools
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import (
    PowerSGDState,
    powerSGD_hook,
)
from torch.nn.parallel import DistributedDataParallel

METHODS = ("none", "dct", "dct-topk", "fp16", "bf16", "powersgd")
TOPK_VALUE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
POWERSGD_MIN_START = 2
POWERSGD_EPSILON = 1e-8
POWERSGD_MIN_RATE = 2.0
FP32_BYTES = 4

Slices = tuple[tuple[int, int, int], ...]
"""Per parameter: (parameter index, start, length) inside a flat per-bucket tensor."""


@dataclass
class CompressionSettings:
    """How DDP gradients are compressed. Plain values; checked by :func:`validate_settings`."""

    method: str = "none"
    """One of :data:`METHODS`."""
    ratio: float = 0.5
    """dct: fraction of the DCT coefficients of every block that is sent, 0 < ratio <= 1."""
    block_size: int = 64
    """dct, dct-topk: DCT block length in values (at least 2)."""
    topk: int = 8
    """dct-topk: coefficients sent per block, 1 <= topk <= block_size."""
    error_feedback: bool = True
    """dct, dct-topk: carry what was not sent into the next step's gradient."""
    start_step: int = 0
    """Steps before this one use the plain dense all-reduce (powersgd: at least 2)."""
    powersgd_rank: int = 4
    """powersgd: rank of the low-rank approximation of every weight matrix."""
    topk_value_dtype: str = "float32"
    """dct, dct-topk: dtype of the coefficients on the wire: float32, bfloat16 or float16."""


def validate_settings(settings: CompressionSettings) -> None:
    """Check every field; raise ``ValueError`` with a one-line message naming the fix."""
    if settings.method not in METHODS:
        raise ValueError(
            f"unknown compression method {settings.method!r}; use one of {', '.join(METHODS)}"
        )
    if not 0.0 < settings.ratio <= 1.0:
        raise ValueError(
            f"compression ratio must be in (0, 1], got {settings.ratio}; "
            "e.g. 0.25 sends a quarter of the DCT coefficients"
        )
    if settings.block_size < 2:
        raise ValueError(f"block_size must be at least 2, got {settings.block_size}; try 64")
    if not 1 <= settings.topk <= settings.block_size:
        raise ValueError(
            f"topk must be between 1 and block_size ({settings.block_size}), got "
            f"{settings.topk}; lower topk or raise block_size"
        )
    if settings.start_step < 0:
        raise ValueError(
            f"start_step must be >= 0, got {settings.start_step}; use 0 to compress from step 0"
        )
    if settings.powersgd_rank < 1:
        raise ValueError(f"powersgd_rank must be >= 1, got {settings.powersgd_rank}; try 4")
    if settings.topk_value_dtype not in TOPK_VALUE_DTYPES:
        raise ValueError(
            f"unknown topk_value_dtype {settings.topk_value_dtype!r}; "
            f"use one of {', '.join(TOPK_VALUE_DTYPES)}"
        )


def kept_coefficients(settings: CompressionSettings) -> int:
    """Coefficients sent per block by ``dct``: ``max(1, round(ratio * block_size))``."""
    return max(1, round(settings.ratio * settings.block_size))


def index_dtype(block_size: int) -> torch.dtype:
    """Narrowest dtype for in-block indices: uint8 up to 256, int16 up to 32768, else int32."""
    if block_size <= 256:
        return torch.uint8
    if block_size <= 32768:
        return torch.int16
    return torch.int32


@functools.lru_cache(maxsize=32)
def _cached_basis(block_size: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    n = torch.arange(block_size, dtype=torch.float64)
    freq = n.unsqueeze(1)
    basis = torch.cos(math.pi * (2.0 * n + 1.0) * freq / (2.0 * block_size))
    basis *= math.sqrt(2.0 / block_size)
    basis[0] /= math.sqrt(2.0)
    return basis.to(device=device, dtype=dtype)


def dct_basis(
    block_size: int, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Orthonormal DCT-II matrix (Ahmed, Natarajan & Rao 1974), shape [block_size, block_size].

    Row k is basis vector k: ``D[k, n] = s_k cos(pi (2n + 1) k / (2 N))`` with ``s_0 = sqrt(1/N)``
    and ``s_k = sqrt(2/N)`` otherwise, so ``D @ D.T == I``; ``x @ D.T`` transforms rows of ``x``
    and ``c @ D`` inverts. Computed in float64 once per (block_size, device, dtype) and cached:
    callers share the tensor and must not modify it in place.
    """
    return _cached_basis(block_size, torch.device(device), dtype)


@dataclass(frozen=True)
class BlockLayout:
    """How one bucket's flat buffer maps onto DCT blocks.

    Every parameter's slice is zero-padded on its own to a multiple of ``block_size``.
    ``positions`` (int64, [numel]) gives each buffer element's place in the padded array of
    ``n_blocks * block_size`` values; it is ``None`` when no slice needs padding.
    """

    numel: int
    block_size: int
    n_blocks: int
    positions: torch.Tensor | None

    def to_blocks(self, flat: torch.Tensor) -> torch.Tensor:
        """[numel] -> [n_blocks, block_size] (zero-padded)."""
        if self.positions is None:
            return flat.view(self.n_blocks, self.block_size)
        padded = flat.new_zeros(self.n_blocks * self.block_size)
        padded[self.positions] = flat
        return padded.view(self.n_blocks, self.block_size)

    def from_blocks(self, blocks: torch.Tensor) -> torch.Tensor:
        """[n_blocks, block_size] -> [numel] (padding dropped)."""
        flat = blocks.reshape(-1)
        return flat if self.positions is None else flat[self.positions]


def block_layout(
    starts: list[int], numel: int, block_size: int, device: torch.device | str = "cpu"
) -> BlockLayout:
    """Layout for a buffer of ``numel`` values whose parameter slices begin at ``starts``."""
    bounds = [*sorted({0, *[s for s in starts if s < numel]}), numel]
    lengths = torch.tensor([b - a for a, b in itertools.pairwise(bounds)], dtype=torch.int64)
    padded = (lengths + block_size - 1) // block_size * block_size
    n_blocks = int(padded.sum()) // block_size
    if torch.equal(padded, lengths):
        return BlockLayout(numel, block_size, n_blocks, None)
    shift = (torch.cumsum(padded, 0) - padded) - (torch.cumsum(lengths, 0) - lengths)
    positions = torch.arange(numel) + torch.repeat_interleave(shift, lengths)
    return BlockLayout(numel, block_size, n_blocks, positions.to(device))


def dct_payload_bytes(n_blocks: int, kept: int, value_dtype: torch.dtype = torch.float32) -> int:
    """Bytes ``dct`` hands to its collective for one bucket: ``n_blocks * kept`` coefficients of
    ``value_dtype`` (float32: all-reduce; 16-bit: this rank's part of an all-gather)."""
    return n_blocks * kept * torch.empty(0, dtype=value_dtype).element_size()


def topk_payload_bytes(n_blocks: int, topk: int, block_size: int, value_dtype: torch.dtype) -> int:
    """Bytes ``dct-topk`` hands to all-gather for one bucket (per rank): values plus indices."""
    per_pair = torch.empty(0, dtype=value_dtype).element_size()
    per_pair += torch.empty(0, dtype=index_dtype(block_size)).element_size()
    return n_blocks * topk * per_pair


class _BucketStore:
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
class _BlockPlan:
    slices: Slices
    layout: BlockLayout


@dataclass(frozen=True)
class _PowerSGDSlices:
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
    ``comm_bytes`` is what was handed to collectives (``numel * element_size`` of every input,
    indices included; for all-gather the rank's own contribution, not the gathered output),
    ``comm_bytes_dense`` what a dense fp32 all-reduce of the same buckets would hand over
    (``numel * 4``). ``hook_calls`` counts hook invocations since creation; ``step`` counts
    optimizer steps seen (incremented on the last bucket of each backward pass).
    """

    def __init__(
        self,
        settings: CompressionSettings,
        parameters: Iterable[torch.nn.Parameter],
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        """``parameters``: the DDP model's ``parameters()``, whose order numbers checkpoint keys.

        Raises ``ValueError`` for invalid settings. Needs an initialised process group.
        """
        validate_settings(settings)
        self.settings = settings
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.comm_bytes = 0
        self.comm_bytes_dense = 0
        self.hook_calls = 0
        self.step = 0
        self.bf16_transport = "all_reduce"
        """``all_reduce`` (native bfloat16) or ``all_gather`` (raw bits, summed in fp32)."""
        self._param_index = {id(param): index for index, param in enumerate(parameters)}
        self._block_plans: dict[int, tuple[tuple[int, ...], _BlockPlan]] = {}
        self._powersgd_plans: dict[int, tuple[tuple[int, ...], _PowerSGDSlices]] = {}
        self._residuals = _BucketStore()
        self._powersgd: PowerSGDState | None = None
        self._ps_stores: tuple[_BucketStore, _BucketStore, _BucketStore] | None = None
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
            _BucketStore(state.error_dict),
            _BucketStore(state.p_memory_dict),
            _BucketStore(state.q_memory_dict),
        )

    def pop_step_bytes(self) -> tuple[int, int]:
        """Return ``(comm_bytes, comm_bytes_dense)`` in bytes and reset both to 0."""
        counts = (self.comm_bytes, self.comm_bytes_dense)
        self.comm_bytes = 0
        self.comm_bytes_dense = 0
        return counts

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Flat ``{name: tensor}``: loadable by safetensors and ``torch.load(weights_only=True)``.

        Keys: ``step`` (int64 scalar); ``residual.<i>`` (fp32, flat, error feedback of parameter i
        in ``model.parameters()`` order); for powersgd ``powersgd.{error,p,q}.<i>`` and
        ``powersgd.rng.*`` (the numpy RNG that seeds fresh Q factors).
        """
        out = {"step": torch.tensor(self.step, dtype=torch.int64)}
        for index, piece in self._residuals.export().items():
            out[f"residual.{index}"] = piece
        if self._powersgd is not None and self._ps_stores is not None:
            for name, store in zip(("error", "p", "q"), self._ps_stores, strict=True):
                for index, piece in store.export().items():
                    out[f"powersgd.{name}.{index}"] = piece
            out.update(_rng_to_tensors(self._powersgd.rng))
        return out

    def load_state_dict(self, state: Mapping[str, torch.Tensor | int]) -> None:
        """Restore from :meth:`state_dict` output; buckets pick their pieces up lazily."""
        self.step = int(state["step"])
        self._residuals.load(_pieces(state, "residual."))
        if self._powersgd is None or self._ps_stores is None:
            return
        self._powersgd.iter = self.step
        for name, store in zip(("error", "p", "q"), self._ps_stores, strict=True):
            store.load(_pieces(state, f"powersgd.{name}."))
        if "powersgd.rng.keys" in state:
            _rng_from_tensors(self._powersgd.rng, state)

    def bucket_slices(self, bucket: dist.GradBucket) -> Slices:
        """(parameter index, offset, numel) of every gradient in the bucket's buffer."""
        base = bucket.buffer().storage_offset()
        return tuple(
            (self._param_index[id(param)], grad.storage_offset() - base, grad.numel())
            for param, grad in zip(bucket.parameters(), bucket.gradients(), strict=True)
        )


def _cached[T](
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


def _group(state: CompressionState) -> dist.ProcessGroup:
    group = state.process_group if state.process_group is not None else dist.group.WORLD
    if group is None:
        raise RuntimeError("torch.distributed is not initialised; call init_process_group first")
    return group


def _dense_hook(
    state: CompressionState, buffer: torch.Tensor
) -> torch.futures.Future[torch.Tensor]:
    """Average by all-reduce (division first, so fp16 buffers cannot overflow)."""
    buffer.div_(state.world_size)
    state.comm_bytes += buffer.numel() * buffer.element_size()
    work = dist.all_reduce(buffer, group=_group(state), async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def _half_hook(
    state: CompressionState, buffer: torch.Tensor, dtype: torch.dtype
) -> torch.futures.Future[torch.Tensor]:
    """fp16/bf16: divide in the buffer's precision, cast, reduce, cast back into ``buffer``."""
    send = buffer.div(state.world_size).to(dtype)
    state.comm_bytes += send.numel() * send.element_size()
    if dtype == torch.bfloat16 and state.bf16_transport == "all_gather":
        return _gather_half(state, buffer, send)
    work = dist.all_reduce(send, group=_group(state), async_op=True)

    def unpack(fut: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        return buffer.copy_(fut.value()[0])

    return work.get_future().then(unpack)


def _gather_half(
    state: CompressionState, buffer: torch.Tensor, send: torch.Tensor
) -> torch.futures.Future[torch.Tensor]:
    """Lossless 16-bit transport for backends without a 16-bit reduction: gather raw bytes."""
    payload = send.view(torch.uint8)
    gathered = payload.new_empty(state.world_size * payload.numel())
    work = dist.all_gather_into_tensor(gathered, payload, group=_group(state), async_op=True)

    def unpack(fut: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        rows = gathered.view(state.world_size, -1).view(send.dtype)
        return buffer.copy_(rows.float().sum(0))

    return work.get_future().then(unpack)


def _prepare_blocks(
    state: CompressionState, bucket: dist.GradBucket
) -> tuple[_BlockPlan, torch.Tensor, torch.Tensor]:
    """Plan, the fp32 gradient plus residual [numel], and its blocks [n_blocks, block_size]."""
    buffer = bucket.buffer()

    def build() -> _BlockPlan:
        slices = state.bucket_slices(bucket)
        starts = [start for _, start, _ in slices]
        size = state.settings.block_size
        return _BlockPlan(slices, block_layout(starts, buffer.numel(), size, buffer.device))

    plan = _cached(state._block_plans, bucket, build)
    grad = buffer.to(torch.float32, copy=True)
    if state.settings.error_feedback:
        store = state._residuals
        residual = store.fetch(bucket.index(), plan.slices, state.step, grad, require_all=False)
        if residual is not None:
            grad[: residual.numel()] += residual
    return plan, grad, plan.layout.to_blocks(grad)


def _keep_residual(
    state: CompressionState, bucket: dist.GradBucket, plan: _BlockPlan, residual: torch.Tensor
) -> None:
    """Error feedback: remember what this rank's message did not carry, [numel] fp32."""
    state._residuals.keep(bucket.index(), plan.slices, state.step, residual)


def _dct_hook(
    state: CompressionState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Low-pass DCT: all-reduce the ``k`` lowest-frequency coefficients of every block.

    The kept set is the same on every rank and the transform is linear, so the average of the
    compressed gradients equals the compression (projection onto the kept coefficients) of the
    average gradient; with ``ratio == 1`` it is the exact mean up to fp32 rounding.

    With a 16-bit ``topk_value_dtype`` each rank rounds its coefficients, keeps the rounding
    error in its error-feedback residual and all-gathers the 16-bit values
    (:func:`_gather_coeffs`); the result is then the projection of the mean of the rounded
    coefficients, and half the bytes.
    """
    buffer = bucket.buffer()
    plan, grad, blocks = _prepare_blocks(state, bucket)
    layout = plan.layout
    low = dct_basis(layout.block_size, buffer.device)[: kept_coefficients(state.settings)]
    coeffs = blocks @ low.T
    value_dtype = TOPK_VALUE_DTYPES[state.settings.topk_value_dtype]
    if value_dtype != torch.float32:
        coeffs = coeffs.to(value_dtype)
    if state.settings.error_feedback:
        _keep_residual(state, bucket, plan, grad - layout.from_blocks(coeffs.float() @ low))
    state.comm_bytes += coeffs.numel() * coeffs.element_size()
    if value_dtype != torch.float32:
        return _gather_coeffs(state, buffer, layout, low, coeffs)
    work = dist.all_reduce(coeffs, group=_group(state), async_op=True)

    def decode(fut: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        mean = fut.value()[0].div_(state.world_size)
        return buffer.copy_(layout.from_blocks(mean @ low))

    return work.get_future().then(decode)


def _gather_coeffs(
    state: CompressionState,
    buffer: torch.Tensor,
    layout: BlockLayout,
    low: torch.Tensor,
    coeffs: torch.Tensor,
) -> torch.futures.Future[torch.Tensor]:
    """16-bit ``dct``: all-gather every rank's rounded coefficients [n_blocks, k] as raw bytes.

    Every rank sums the gathered rows in fp32 in rank order, so all ranks get bit-identical
    results and nothing is rounded after the rank's own cast (which error feedback carries).
    """
    payload = coeffs.reshape(-1).view(torch.uint8)
    gathered = payload.new_empty(state.world_size * payload.numel())
    work = dist.all_gather_into_tensor(gathered, payload, group=_group(state), async_op=True)

    def decode(fut: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        rows = gathered.view(state.world_size, -1).view(coeffs.dtype).float()
        mean = rows.sum(0).div_(state.world_size).view(coeffs.shape)
        return buffer.copy_(layout.from_blocks(mean @ low))

    return work.get_future().then(decode)


def _pack_topk(values: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """One uint8 payload: all values' bytes, then all indices' bytes."""
    return torch.cat([values.reshape(-1).view(torch.uint8), indices.reshape(-1).view(torch.uint8)])


def _unpack_topk(
    gathered: torch.Tensor,
    world_size: int,
    shape: tuple[int, int],
    value_dtype: torch.dtype,
    wire_index: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gathered payloads -> values (fp32) and indices (int64), each [world, n_blocks, k]."""
    rows = gathered.view(world_size, -1)
    value_bytes = shape[0] * shape[1] * torch.empty(0, dtype=value_dtype).element_size()
    values = rows[:, :value_bytes].contiguous().view(value_dtype).float()
    indices = rows[:, value_bytes:].contiguous().view(wire_index).long()
    return values.view(world_size, *shape), indices.view(world_size, *shape)


def _topk_hook(
    state: CompressionState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """DeMo-style: all-gather the ``topk`` largest DCT coefficients per block as (value, index).

    Every rank scatter-adds all ranks' pairs in rank order, divides by the world size and inverts
    the DCT, so all ranks compute bit-identical results. Values and indices travel in one uint8
    payload per rank (gloo has no int16 collectives): ``n_blocks * topk`` values, then as many
    indices of :func:`index_dtype` (uint8 for blocks up to 256).

    Values default to float32: with ``topk == block_size`` the result is then the exact mean up
    to fp32 rounding, and nothing is rounded away. ``bfloat16`` cuts a pair from 5 to 3 bytes
    (uint8 index) at about 3 significant digits per value; error feedback is computed against the
    rounded values, so the rounding error is carried to the next step rather than lost.
    ``float16`` is finer but overflows above 65504, which DCT coefficients (up to
    ``sqrt(block_size)`` times the largest gradient entry) can reach after loss scaling.
    """
    buffer = bucket.buffer()
    plan, grad, blocks = _prepare_blocks(state, bucket)
    layout = plan.layout
    basis = dct_basis(layout.block_size, buffer.device)
    coeffs = blocks @ basis.T
    indices = coeffs.abs().topk(state.settings.topk, dim=1, sorted=False).indices
    value_dtype = TOPK_VALUE_DTYPES[state.settings.topk_value_dtype]
    values = coeffs.gather(1, indices).to(value_dtype)
    if state.settings.error_feedback:
        own = torch.zeros_like(coeffs).scatter_(1, indices, values.float())
        _keep_residual(state, bucket, plan, grad - layout.from_blocks(own @ basis))
    wire_index = index_dtype(layout.block_size)
    payload = _pack_topk(values, indices.to(wire_index))
    state.comm_bytes += payload.numel()
    gathered = payload.new_empty(state.world_size * payload.numel())
    work = dist.all_gather_into_tensor(gathered, payload, group=_group(state), async_op=True)
    shape = (layout.n_blocks, state.settings.topk)

    def decode(fut: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        all_values, all_indices = _unpack_topk(
            gathered, state.world_size, shape, value_dtype, wire_index
        )
        total = torch.zeros(layout.n_blocks, layout.block_size, device=buffer.device)
        for rank in range(state.world_size):
            total.scatter_add_(1, all_indices[rank], all_values[rank])
        total /= state.world_size
        return buffer.copy_(layout.from_blocks(total @ basis))

    return work.get_future().then(decode)


def _powersgd_layout(state: CompressionState, bucket: dist.GradBucket) -> _PowerSGDSlices:
    def build() -> _PowerSGDSlices:
        slices = state.bucket_slices(bucket)
        shapes = [tuple(grad.shape) for grad in bucket.gradients()]
        indices = [index for index, _, _ in slices]
        rank = state.settings.powersgd_rank
        p, q = powersgd_slices(shapes, indices, rank, POWERSGD_MIN_RATE)
        return _PowerSGDSlices(slices, p, q)

    return _cached(state._powersgd_plans, bucket, build)


def _install_powersgd(
    state: CompressionState, bucket: dist.GradBucket, layout: _PowerSGDSlices
) -> None:
    """Put this bucket's error / P / Q memories (rebuilt for its layout if needed) in place."""
    assert state._ps_stores is not None
    errors, ps, qs = state._ps_stores
    index, like = bucket.index(), bucket.buffer()
    error = errors.fetch(index, layout.error, state.step, like, require_all=False)
    if error is not None and error.numel() < like.numel():
        error = torch.cat([error, like.new_zeros(like.numel() - error.numel())])
    p = ps.fetch(index, layout.p, state.step, like, require_all=True)
    q = qs.fetch(index, layout.q, state.step, like, require_all=True)
    _set_or_drop(errors.tensors, index, error)
    both = p is not None and q is not None
    _set_or_drop(ps.tensors, index, p if both else None)
    _set_or_drop(qs.tensors, index, q if both else None)


def _set_or_drop(tensors: dict[int, torch.Tensor], index: int, value: torch.Tensor | None) -> None:
    if value is None:
        tensors.pop(index, None)
    else:
        tensors[index] = value


def _powersgd_hook(
    state: CompressionState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """torch's ``powerSGD_hook`` with byte counting, rebuild-safe memories and gloo ordering.

    The returned future is already complete: waiting here keeps every rank's sequence of
    collectives identical (see the module docstring for the failure this prevents).
    """
    power = state._powersgd
    assert power is not None and state._ps_stores is not None
    buffer = bucket.buffer()
    compressing = power.iter >= power.start_powerSGD_iter
    layout = _powersgd_layout(state, bucket) if compressing else None
    if layout is not None:
        _install_powersgd(state, bucket, layout)
    before = power.total_numel_after_compression
    fut = powerSGD_hook(power, bucket)
    fut.wait()
    sent = power.total_numel_after_compression - before if compressing else buffer.numel()
    state.comm_bytes += sent * buffer.element_size()
    if layout is not None:
        for store, slices in zip(state._ps_stores, (layout.error, layout.p, layout.q), strict=True):
            if bucket.index() in store.tensors:
                store.keep(bucket.index(), slices, state.step, store.tensors[bucket.index()])
    return fut


def compression_hook(
    state: CompressionState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: average ``bucket.buffer()`` (1-D) over ranks, compressed.

    The future's value has the buffer's shape and dtype. Steps before ``start_step`` use the
    dense all-reduce. Register with ``model.register_comm_hook(state, compression_hook)``, or use
    :func:`register_compression`.
    """
    state.hook_calls += 1
    buffer = bucket.buffer()
    state.comm_bytes_dense += buffer.numel() * FP32_BYTES
    method = state.settings.method
    try:
        if method == "powersgd":
            return _powersgd_hook(state, bucket)
        if method == "none" or state.step < state.settings.start_step:
            return _dense_hook(state, buffer)
        if method in ("fp16", "bf16"):
            return _half_hook(state, buffer, torch.float16 if method == "fp16" else torch.bfloat16)
        if method == "dct":
            return _dct_hook(state, bucket)
        return _topk_hook(state, bucket)
    finally:
        if bucket.is_last():
            state.step += 1


def _bf16_reduces(group: dist.ProcessGroup, device: torch.device) -> bool:
    """Whether the backend all-reduces bfloat16 on ``device`` (a collective: call on all ranks)."""
    if dist.get_backend(group) != "gloo":
        return True
    try:
        dist.all_reduce(torch.zeros(1, dtype=torch.bfloat16, device=device), group=group)
    except RuntimeError:
        return False
    return True


def register_compression(
    model: DistributedDataParallel,
    settings: CompressionSettings,
    process_group: dist.ProcessGroup | None = None,
) -> CompressionState:
    """Validate ``settings``, register :func:`compression_hook` on ``model``, return its state.

    Call on every rank, after constructing the DDP model and before the first backward. Raises
    ``ValueError`` for bad settings (one line naming the field and the fix) and whatever
    ``register_comm_hook`` raises (e.g. a hook already registered). For ``bf16`` on gloo this
    runs one tiny all-reduce to see whether gloo reduces bfloat16 (else the all-gather transport).
    """
    validate_settings(settings)
    state = CompressionState(settings, model.parameters(), process_group)
    if settings.method == "bf16":
        device = next(model.parameters()).device
        native = _bf16_reduces(_group(state), device)
        state.bf16_transport = "all_reduce" if native else "all_gather"
    model.register_comm_hook(state, compression_hook)
    return state


__all__ = [
    "METHODS",
    "TOPK_VALUE_DTYPES",
    "BlockLayout",
    "CompressionSettings",
    "CompressionState",
    "block_layout",
    "compression_hook",
    "dct_basis",
    "dct_payload_bytes",
    "index_dtype",
    "kept_coefficients",
    "powersgd_slices",
    "register_compression",
    "topk_payload_bytes",
    "validate_settings",
]
