"""DDP comm hooks for optimizers that exchange themselves (DeMo, DiLoCo, SparseLoCo): DDP
still wraps the model (parameter broadcast, ``no_sync`` for accumulation), but each rank keeps
its local gradient (``_local_hook``: nothing is sent) or the mean over its node's ranks
(``_node_mean_hook``: an all-reduce on the fast links only, for the node-aware scope). The
optimizer then runs its own collective in ``step()``.

Source: DDP comm hooks, https://docs.pytorch.org/docs/stable/ddp_comm_hooks.html.
"""

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from torchrun_ddp.compression.settings import CompressionSettings
from torchrun_ddp.compression.state import CompressionState
from torchrun_ddp.compression.wire import dense_wire_bytes

if TYPE_CHECKING:
    from torchrun_ddp.distributed import NodeGroups


def _local_hook(
    state: CompressionState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook that leaves the bucket as it is: each rank keeps its local gradient.

    Counts the dense fp32 all-reduce it replaces (``comm_bytes_dense``) so the metrics' ratio
    compares DeMo's all-gather with it; sends nothing.
    """
    buffer = bucket.buffer()
    state.hook_calls += 1
    state.comm_bytes_dense += dense_wire_bytes(buffer.numel(), state.world_size)
    if bucket.is_last():
        state.step += 1
    done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    done.set_result(buffer)
    return done


def _node_mean_hook(
    state: CompressionState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook of node-aware DeMo: the bucket becomes the mean over the ranks of this
    node (an fp32 all-reduce in ``state.node_groups.intra``, the fast links); nothing crosses
    the uplinks. Counts that all-reduce and the dense one it replaces, as :func:`_local_hook`."""
    buffer = bucket.buffer()
    state.hook_calls += 1
    state.comm_bytes_dense += dense_wire_bytes(buffer.numel(), state.world_size)
    if bucket.is_last():
        state.step += 1
    assert state.node_groups is not None
    intra = state.node_groups.intra
    flat = buffer if buffer.dtype == torch.float32 else buffer.float()
    flat.div_(dist.get_world_size(intra))
    state.count("all_reduce", flat.numel() * flat.element_size(), intra)
    work = dist.all_reduce(flat, group=intra, async_op=True)

    def averaged(future: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        total = future.value()[0]
        return total if total is buffer else buffer.copy_(total)

    return work.get_future().then(averaged)


def register_local_gradients(
    model: DistributedDataParallel,
    process_group: dist.ProcessGroup | None = None,
    node_groups: "NodeGroups | None" = None,
) -> CompressionState:
    """Register :func:`_local_hook` on ``model`` (DDP then communicates nothing in backward), or
    with ``node_groups`` :func:`_node_mean_hook` (gradients averaged inside each node), and
    return the state that counts bytes; pass it to the optimizer (``optim.build_demo``,
    ``methods.local_updates``).

    Call on every rank after constructing the DDP model and before the first backward. Raises
    whatever ``register_comm_hook`` raises (e.g. a hook already registered).
    """
    settings = CompressionSettings(method="none")
    state = CompressionState(settings, model.parameters(), process_group, node_groups)
    model.register_comm_hook(state, _node_mean_hook if node_groups else _local_hook)
    return state
