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

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

from torchrun_ddp.compression.settings import (
    FP32_BYTES,
    POWERSGD_MIN_RATE,
    TOPK_VALUE_DTYPES,
    CompressionSettings,
    kept_coefficients,
    validate_settings,
)
from torchrun_ddp.compression.state import (
    BlockPlan,
    CompressionState,
    PowerSGDSlices,
    cached_plan,
    powersgd_slices,
)
from torchrun_ddp.compression.transform import BlockLayout, block_layout, dct_basis, index_dtype


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
) -> tuple[BlockPlan, torch.Tensor, torch.Tensor]:
    """Plan, the fp32 gradient plus residual [numel], and its blocks [n_blocks, block_size]."""
    buffer = bucket.buffer()

    def build() -> BlockPlan:
        slices = state.bucket_slices(bucket)
        starts = [start for _, start, _ in slices]
        size = state.settings.block_size
        return BlockPlan(slices, block_layout(starts, buffer.numel(), size, buffer.device))

    plan = cached_plan(state._block_plans, bucket, build)
    grad = buffer.to(torch.float32, copy=True)
    if state.settings.error_feedback:
        store = state._residuals
        residual = store.fetch(bucket.index(), plan.slices, state.step, grad, require_all=False)
        if residual is not None:
            grad[: residual.numel()] += residual
    return plan, grad, plan.layout.to_blocks(grad)


def _keep_residual(
    state: CompressionState, bucket: dist.GradBucket, plan: BlockPlan, residual: torch.Tensor
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


def _powersgd_layout(state: CompressionState, bucket: dist.GradBucket) -> PowerSGDSlices:
    def build() -> PowerSGDSlices:
        slices = state.bucket_slices(bucket)
        shapes = [tuple(grad.shape) for grad in bucket.gradients()]
        indices = [index for index, _, _ in slices]
        rank = state.settings.powersgd_rank
        p, q = powersgd_slices(shapes, indices, rank, POWERSGD_MIN_RATE)
        return PowerSGDSlices(slices, p, q)

    return cached_plan(state._powersgd_plans, bucket, build)


def _install_powersgd(
    state: CompressionState, bucket: dist.GradBucket, layout: PowerSGDSlices
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
