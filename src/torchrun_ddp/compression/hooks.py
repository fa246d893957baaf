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
    With ``scope = "inter-node"`` these all-reduces become reduce-scatter inside the node,
    all-reduce between nodes and all-gather inside the node (:func:`_node_aware_sum`).
``dct``
    Transform coding with the orthonormal DCT-II (Ahmed, Natarajan & Rao 1974, "Discrete Cosine
    Transform", IEEE Trans. Computers C-23): every parameter's gradient is cut into 1-D blocks of
    ``block_size`` values, each block is transformed and ``k`` of its coefficients, the same on
    every rank, are all-reduced in ``topk_value_dtype``: the lowest frequencies, like the
    low-pass quantisation of JPEG (Wallace 1991), or a selection rotating with the step.
``dct-topk``
    Top-k sparsification of the gradient (Aji & Heafield 2017, "Sparse Communication for
    Distributed Gradient Descent"; with error feedback as in Stich et al. 2018, "Sparsified SGD
    with Memory") applied to 1-D DCT coefficients: per block the ``topk`` largest-magnitude
    coefficients of the gradient (plus residual) are exchanged as (value, index) pairs with an
    all-gather, and the average feeds AdamW. This is *not* DeMo: DeMo (``optim.demo``,
    ``--optimizer demo``) compresses a decaying momentum in 2-D tiles, not the gradient, and
    takes a sign step instead of AdamW's.
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

import math
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

from torchrun_ddp.compression.settings import (
    POWERSGD_MIN_RATE,
    TOPK_VALUE_DTYPES,
    CompressionSettings,
    keeps_residual,
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
from torchrun_ddp.compression.transform import (
    block_layout,
    dct_basis,
    index_dtype,
    kept_frequencies,
)
from torchrun_ddp.compression.wire import dense_wire_bytes

if TYPE_CHECKING:
    from torchrun_ddp.distributed import NodeGroups


def _group(state: CompressionState) -> dist.ProcessGroup:
    group = state.process_group if state.process_group is not None else dist.group.WORLD
    if group is None:
        raise RuntimeError("torch.distributed is not initialised; call init_process_group first")
    return group


def _average(
    state: CompressionState, values: torch.Tensor, wire_dtype: torch.dtype
) -> torch.futures.Future[torch.Tensor]:
    """Mean of ``values`` (any shape, float) over all ranks, sent as ``wire_dtype``.

    The future's value has the shape and dtype of ``values`` and is bit-identical on all ranks.
    Every rank divides by the world size first (so 16-bit sums cannot overflow), casts to
    ``wire_dtype`` and sums with one all-reduce (``scope = "global"``; gloo and NCCL both reduce
    float16 and bfloat16), or with :func:`_node_aware_sum` (``scope = "inter-node"``). When the
    wire dtype equals ``values.dtype`` the global path divides ``values`` in place and reduces it.
    """
    world, dtype = state.world_size, values.dtype
    if state.settings.scope == "inter-node":
        done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        done.set_result(_node_aware_sum(state, values.div(world), wire_dtype).to(dtype))
        return done
    send = values.div_(world) if wire_dtype == dtype else values.div(world).to(wire_dtype)
    del values  # a 16-bit payload must not keep its fp32 source alive while it is in flight
    if wire_dtype == torch.bfloat16 and state.bf16_transport == "all_gather":
        return _gather_sum(state, send, dtype)
    state.count("all_reduce", send.numel() * send.element_size(), _group(state))
    work = dist.all_reduce(send, group=_group(state), async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0].to(dtype))


def _node_aware_sum(
    state: CompressionState, values: torch.Tensor, wire_dtype: torch.dtype
) -> torch.Tensor:
    """Sum ``values`` over all ranks in three collectives; returns a new tensor of its shape.

    1. reduce-scatter inside the node in the dtype of ``values`` (the node's sum, one shard of
       ``ceil(numel / local_world_size)`` values per local rank; fast links);
    2. all-reduce of the shard cast to ``wire_dtype`` between nodes, among the ranks with the same
       local rank (the only traffic on the slow links);
    3. all-gather of the summed shards inside the node.

    The two-level scheme of hierarchical all-reduce (e.g. Jia et al. 2018, "Highly Scalable Deep
    Learning Training System with Mixed-Precision", arXiv:1807.11205). Each step waits for its
    collective: issuing later collectives from completion callbacks would let gloo pair different
    buckets' collectives across ranks (see the module docstring), so these buckets do not overlap
    backward on gloo.
    """
    groups = state.node_groups
    assert groups is not None
    flat = values.reshape(-1)
    local = groups.local_world_size
    padded = math.ceil(flat.numel() / local) * local
    if padded != flat.numel():
        flat = torch.cat([flat, flat.new_zeros(padded - flat.numel())])
    shard = flat.new_empty(padded // local)
    state.count("reduce_scatter", flat.numel() * flat.element_size(), groups.intra)
    dist.reduce_scatter_tensor(shard, flat, group=groups.intra)
    wire = shard.to(wire_dtype)
    state.count("all_reduce", wire.numel() * wire.element_size(), groups.inter)
    dist.all_reduce(wire, group=groups.inter)
    shard.copy_(wire)
    gathered = flat.new_empty(padded)
    state.count("all_gather", shard.numel() * shard.element_size(), groups.intra)
    dist.all_gather_into_tensor(gathered, shard, group=groups.intra)
    return gathered[: values.numel()].view(values.shape)


def _gather_sum(
    state: CompressionState, send: torch.Tensor, out_dtype: torch.dtype
) -> torch.futures.Future[torch.Tensor]:
    """Lossless 16-bit transport for backends without a 16-bit reduction: all-gather raw bytes,
    sum the rows in fp32 in rank order on every rank (bit-identical everywhere)."""
    payload = send.reshape(-1).view(torch.uint8)
    gathered = payload.new_empty(state.world_size * payload.numel())
    state.count("all_gather", payload.numel(), _group(state))
    work = dist.all_gather_into_tensor(gathered, payload, group=_group(state), async_op=True)

    def unpack(fut: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        rows = gathered.view(state.world_size, -1).view(send.dtype)
        return rows.float().sum(0).view(send.shape).to(out_dtype)

    return work.get_future().then(unpack)


def _copy_into(
    buffer: torch.Tensor, fut: torch.futures.Future[torch.Tensor]
) -> torch.futures.Future[torch.Tensor]:
    return fut.then(lambda done: buffer.copy_(done.value()))


def _dense_hook(
    state: CompressionState, buffer: torch.Tensor
) -> torch.futures.Future[torch.Tensor]:
    """Dense mean of the bucket in its own dtype (global scope: in place)."""
    averaged = _average(state, buffer, buffer.dtype)
    return averaged if state.settings.scope == "global" else _copy_into(buffer, averaged)


def _half_hook(
    state: CompressionState, buffer: torch.Tensor, dtype: torch.dtype
) -> torch.futures.Future[torch.Tensor]:
    """fp16/bf16: divide in the buffer's precision, cast, reduce, cast back into ``buffer``."""
    return _copy_into(buffer, _average(state, buffer, dtype))


def _prepare_blocks(
    state: CompressionState, bucket: dist.GradBucket
) -> tuple[BlockPlan, torch.Tensor, torch.Tensor]:
    """Plan, the fp32 gradient plus residual [numel], and its blocks [n_blocks, block_size].

    Without a residual an fp32 buffer is used as it is (no copy); it is overwritten only when the
    averaged result arrives.
    """
    buffer = bucket.buffer()

    def build() -> BlockPlan:
        slices = state.bucket_slices(bucket)
        starts = [start for _, start, _ in slices]
        size = state.settings.block_size
        return BlockPlan(slices, block_layout(starts, buffer.numel(), size, buffer.device))

    plan = cached_plan(state._block_plans, bucket, build)
    if not keeps_residual(state.settings):
        return plan, buffer, plan.layout.to_blocks(buffer.to(torch.float32))
    grad = buffer.to(torch.float32, copy=True)
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
    """DCT with a selection shared by all ranks: all-reduce ``k`` coefficients of every block.

    The kept frequencies (:func:`kept_frequencies`: low-pass, or rotating with the step) are the
    same on every rank and the transform is linear, so the average of the compressed gradients
    equals the compression (projection onto the kept coefficients) of the average gradient; with
    ``ratio == 1`` it is the exact mean up to rounding. The coefficients [n_blocks, k] travel in
    ``topk_value_dtype`` through one all-reduce (:func:`_average`), so the wire bytes per rank
    are ``2 (W - 1) / W`` of the payload at any world size ``W``.

    Rotating selection with error feedback keeps on each rank the gradient minus its own sent
    part (16-bit global scope: minus its own rounded part), which the next steps' selections
    send; every frequency comes round within ``ceil(block_size / k)`` steps, so the residual
    stays bounded. Low-pass keeps no residual (see ``CompressionSettings.error_feedback``).
    """
    buffer = bucket.buffer()
    settings = state.settings
    plan, grad, blocks = _prepare_blocks(state, bucket)
    layout = plan.layout
    freqs = kept_frequencies(
        layout.block_size, kept_coefficients(settings), state.step, settings.selection, grad.device
    )
    kept = dct_basis(layout.block_size, buffer.device)[freqs]
    coeffs = blocks @ kept.T
    value_dtype = TOPK_VALUE_DTYPES[settings.topk_value_dtype]
    if keeps_residual(settings):
        own = coeffs
        if value_dtype != torch.float32 and settings.scope == "global":
            own = (coeffs / state.world_size).to(value_dtype).float() * state.world_size
        _keep_residual(state, bucket, plan, grad - layout.from_blocks(own @ kept))
    averaged = _average(state, coeffs, value_dtype)
    return averaged.then(lambda fut: buffer.copy_(layout.from_blocks(fut.value() @ kept)))


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
    value_bytes = shape[0] * shape[1] * value_dtype.itemsize
    values = rows[:, :value_bytes].contiguous().view(value_dtype).float()
    indices = rows[:, value_bytes:].contiguous().view(wire_index).long()
    return values.view(world_size, *shape), indices.view(world_size, *shape)


def _topk_hook(
    state: CompressionState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Top-k of the gradient's DCT: all-gather the ``topk`` largest coefficients per block as
    (value, index) pairs (not DeMo; see the module docstring).

    Every rank scatter-adds all the group's pairs in rank order, divides by ``state.world_size``
    and inverts the DCT, so all ranks compute bit-identical results. The divisor is the group's
    size, except across fault-tolerant sites, where a site that heals in this step is in the
    group but sends zeros (``sites.adamw``): the mean is then over the sites that take part.

    Values and indices travel in one uint8 payload per rank (gloo has no int16 collectives):
    ``n_blocks * topk`` values, then as many indices of :func:`index_dtype` (uint8 for blocks up
    to 256), gathered in the list form of all-gather, which torchft's process groups take.

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
    if keeps_residual(state.settings):
        own = torch.zeros_like(coeffs).scatter_(1, indices, values.float())
        _keep_residual(state, bucket, plan, grad - layout.from_blocks(own @ basis))
    wire_index = index_dtype(layout.block_size)
    payload = _pack_topk(values, indices.to(wire_index))
    group = _group(state)
    members = group.size()
    state.count("all_gather", payload.numel(), group)
    gathered = payload.new_empty(members * payload.numel())
    rows = list(gathered.view(members, -1).unbind(0))  # the list form: torchft's groups too
    work = dist.all_gather(rows, payload, group=group, async_op=True)
    shape = (layout.n_blocks, state.settings.topk)

    def decode(fut: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        all_values, all_indices = _unpack_topk(gathered, members, shape, value_dtype, wire_index)
        total = torch.zeros(layout.n_blocks, layout.block_size, device=buffer.device)
        for rank in range(members):
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
    collectives identical (see the module docstring for the failure this prevents). Where
    ``state.world_size`` is less than the group's size (across sites: a site heals in this step)
    the mean is over the ``world_size`` senders (``_mean_over_senders``).
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
    state.count("all_reduce", sent * buffer.element_size(), _group(state))
    if state.world_size != _group(state).size():
        _mean_over_senders(state, bucket.index(), fut.value(), compressing)
    if layout is not None:
        for store, slices in zip(state._ps_stores, (layout.error, layout.p, layout.q), strict=True):
            if bucket.index() in store.tensors:
                store.keep(bucket.index(), slices, state.step, store.tensors[bucket.index()])
    return fut


def _mean_over_senders(
    state: CompressionState, index: int, mean: torch.Tensor, compressing: bool
) -> None:
    """torch's PowerSGD divides its sums by the group's size; across fault-tolerant sites a site
    that heals in this step is in the group but sends zeros, so ``mean`` (the bucket's float32
    buffer, in place) is rescaled to the mean over the ``state.world_size`` sites that send, and
    the error feedback torch kept against the unscaled mean is moved by the difference."""
    factor = _group(state).size() / state.world_size
    assert state._powersgd is not None
    error = state._powersgd.error_dict.get(index) if compressing else None
    if error is not None:
        error.sub_(mean * (factor - 1))
    mean.mul_(factor)


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
    state.comm_bytes_dense += dense_wire_bytes(buffer.numel(), state.world_size)
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


def bf16_transport(
    settings: CompressionSettings, group: dist.ProcessGroup, device: torch.device
) -> str:
    """How the hook of ``settings`` sends bfloat16 over ``group``: ``all_reduce`` (natively), or
    ``all_gather`` (raw bits summed in fp32) where the backend cannot reduce bfloat16. A
    collective (one tiny all-reduce) only for bfloat16 payloads on gloo; call on every rank."""
    bf16_values = settings.method == "dct" and settings.topk_value_dtype == "bfloat16"
    if settings.method != "bf16" and not bf16_values:
        return "all_reduce"
    return "all_reduce" if _bf16_reduces(group, device) else "all_gather"


def register_compression(
    model: DistributedDataParallel,
    settings: CompressionSettings,
    process_group: dist.ProcessGroup | None = None,
    node_groups: "NodeGroups | None" = None,
) -> CompressionState:
    """Validate ``settings``, register :func:`compression_hook` on ``model``, return its state.

    Call on every rank, after constructing the DDP model and before the first backward.
    ``node_groups`` (``distributed.new_node_groups``) is needed for ``scope = "inter-node"``.
    ``none`` over the whole world registers no hook: DDP's built-in C++ all-reduce averages the
    buckets (no Python on the backward path), and the state counts its bytes analytically.
    Raises ``ValueError`` for bad settings (one line naming the field and the fix) and whatever
    ``register_comm_hook`` raises (e.g. a hook already registered). For bfloat16 on the wire
    (``bf16``, or ``dct`` with bfloat16 values) on gloo this runs one tiny all-reduce to see
    whether gloo reduces bfloat16 (else the all-gather transport; gloo in torch 2.15 reduces it).
    """
    validate_settings(settings)
    state = CompressionState(settings, model.parameters(), process_group, node_groups)
    if settings.method == "none" and settings.scope == "global" and process_group is None:
        state.count_builtin_all_reduce(model.parameters())  # DDP's C++ all-reduce, no hook
        return state
    device = next(model.parameters()).device
    state.bf16_transport = bf16_transport(settings, _group(state), device)
    model.register_comm_hook(state, compression_hook)
    return state
