"""The comm hooks on the replicate dimension of a sharded model (``--data-parallel hsdp`` with
``--compression`` other than ``none``).

FSDP2 shards the model within each group of ``--shard-degree`` ranks (a 1-D mesh per group) and
reduce-scatters the gradients there, averaged over the group. The groups then hold the same
shards of different gradients: rank ``i`` of every group holds shard ``i``. Torch's native HSDP
would all-reduce each shard over the replicate group in full; its ``set_all_reduce_hook`` fires
only after that all-reduce. Here the replicate exchange is built by hand instead: after the
step's last backward, :class:`ReplicaExchange` packs this rank's gradient shards (the local
tensors of the DTensor gradients, float32 [numel] each) into buckets of at most
``bucket_cap_bytes`` and hands each bucket to :func:`~torchrun_ddp.compression.hooks
.compression_hook` over the replicate group, exactly as DDP hands it a gradient bucket. So the
same hooks (``bf16``, ``fp16``, ``dct``, ``dct-topk``, ``powersgd``) with their error feedback
run on the shards, once per optimizer step, and only their payload crosses between the groups.

What changes against DDP: a hook sees shard-shaped gradients (FSDP2 keeps a 2-D weight's shard
2-D, ``[ceil(R / S), C]``), so PowerSGD's factors and the DCT blocks are those of the shard. The
exchange waits for each bucket and runs after the backward, so it does not overlap the backward
as DDP's hooks do.

Sources: torch FSDP2 (``fully_shard``, per-rank shards as DTensor local tensors); the
torchtitan/torchft HSDP recipe, whose replicate dimension is exchanged by its own code
(``experiments/torchft``); DDP's ``GradBucket`` interface, which :class:`ShardBucket` presents.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from torchrun_ddp.compression.hooks import bf16_transport, compression_hook
from torchrun_ddp.compression.settings import CompressionSettings
from torchrun_ddp.compression.state import CompressionState
from torchrun_ddp.parallel.shards import local_tensor


class ShardBucket:
    """A flat float32 buffer of gradient shards, presented to :func:`compression_hook` as DDP's
    ``GradBucket`` (``buffer``, ``index``, ``is_last``, ``parameters``, ``gradients``).

    ``gradients()`` are views of the buffer with the shards' shapes, so their storage offsets
    give each parameter's place in it, as in a DDP bucket."""

    def __init__(
        self,
        index: int,
        last: bool,
        parameters: Sequence[torch.nn.Parameter],
        shards: Sequence[torch.Tensor],
    ) -> None:
        self._index, self._last, self._parameters = index, last, list(parameters)
        self._buffer = torch.cat([shard.detach().reshape(-1).float() for shard in shards])
        views, start = [], 0
        for shard in shards:
            views.append(self._buffer[start : start + shard.numel()].view(shard.shape))
            start += shard.numel()
        self._views = views

    def buffer(self) -> torch.Tensor:
        """The flat float32 buffer [sum of the shards' numel]."""
        return self._buffer

    def index(self) -> int:
        """The bucket's position in the step (the key of its error feedback)."""
        return self._index

    def is_last(self) -> bool:
        """Whether this is the step's last bucket (the hook then counts a step)."""
        return self._last

    def parameters(self) -> list[torch.nn.Parameter]:
        """The parameters whose shards the bucket holds, in buffer order."""
        return self._parameters

    def gradients(self) -> list[torch.Tensor]:
        """Views of the buffer, one per parameter, shaped as its local shard."""
        return self._views


def local_shard(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``tensor``, sharing its storage (detached): a DTensor's local shard
    (FSDP), any other tensor itself (``parallel.shards.local_tensor``)."""
    return local_tensor(tensor.detach())


class ReplicaExchange:
    """Averages a sharded model's gradient shards over the replicate group through the comm hook
    of ``state``; call :meth:`average` on every rank after the step's last backward.

    ``state``: the hook's state, its ``process_group`` the ranks that hold the same shards (one
    per replica; under ``--fault-tolerance sites`` the live sites' torchft group, ``sites
    .adamw``) and its ``world_size`` the divisor of the mean; ``parameters``: the sharded
    model's ``parameters()`` (their order numbers the error-feedback keys in checkpoints and
    the buckets); ``bucket_cap_bytes``: the most float32 bytes in one bucket (DDP's bucket
    cap). :meth:`over` builds one over a torch process group."""

    def __init__(
        self,
        state: CompressionState,
        parameters: Sequence[torch.nn.Parameter],
        bucket_cap_bytes: int,
    ) -> None:
        self.state = state
        self.parameters = list(parameters)
        self.bucket_cap_bytes = bucket_cap_bytes

    @classmethod
    def over(
        cls,
        settings: CompressionSettings,
        parameters: Sequence[torch.nn.Parameter],
        group: dist.ProcessGroup,
        bucket_cap_bytes: int,
    ) -> ReplicaExchange:
        """The exchange of ``settings``' hook over ``group`` (hsdp's replicate group). Collective
        for bf16 payloads on gloo (``hooks.bf16_transport``)."""
        parameters = list(parameters)
        state = CompressionState(settings, parameters, process_group=group)
        state.bf16_transport = bf16_transport(settings, group, parameters[0].device)
        return cls(state, parameters, bucket_cap_bytes)

    def _buckets(self) -> list[list[tuple[torch.nn.Parameter, torch.Tensor]]]:
        """(parameter, its gradient shard) of the trained parameters with a non-empty shard,
        grouped in model order up to the cap."""
        buckets: list[list[tuple[torch.nn.Parameter, torch.Tensor]]] = [[]]
        size = 0
        for param in self.parameters:
            shard = None if param.grad is None else local_shard(param.grad)
            if shard is None or shard.numel() == 0:
                continue
            if buckets[-1] and size + shard.numel() * 4 > self.bucket_cap_bytes:
                buckets.append([])
                size = 0
            buckets[-1].append((param, shard))
            size += shard.numel() * 4
        return [bucket for bucket in buckets if bucket]

    def average(self) -> None:
        """Collective over the replicate group: replace every gradient shard by its average over
        the replicas, as the comm hook computes it (compressed, with error feedback). Every
        replica holds the same shard shapes, so the buckets and collectives line up."""
        buckets = self._buckets()
        for index, pairs in enumerate(buckets):
            params, shards = [param for param, _ in pairs], [shard for _, shard in pairs]
            bucket = ShardBucket(index, index == len(buckets) - 1, params, shards)
            averaged = compression_hook(self.state, bucket).wait()  # type: ignore[arg-type]
            if averaged.data_ptr() != bucket.buffer().data_ptr():
                bucket.buffer().copy_(averaged.reshape(-1))
            for shard, mean in zip(shards, bucket.gradients(), strict=True):
                shard.copy_(mean)
