"""How DeMo's and SparseLoCo's compressed messages travel between ranks: flat, or node-aware.

**Flat** (``--compression-scope global``): one all-gather of every rank's message over all ``W``
ranks. A ring all-gather passes ``W - 1`` messages through every link, a node's uplink included:
its bytes grow with the ranks, not with the nodes.

**Node-aware** (``--compression-scope inter-node``): the ranks of a node first average their
gradients over the fast intra-node links (the DDP comm hook of
``compression.local_gradients.register_local_gradients``), so they all hold the node's mean
gradient. The trained parameters are split among the node's local ranks (:func:`assign_owners`,
balanced by message bytes); local rank ``j`` keeps the DeMo momentum (or SparseLoCo error
feedback) of its share only and compresses it. Messages cross the uplinks in one all-gather among
the ranks with local rank ``j`` (one per node, the ``inter`` group of
``distributed.new_node_groups``), so each node sends one message per share: its uplink carries
``N - 1`` whole-model messages per exchange instead of ``W - 1``. A second all-gather inside
the node then hands every rank all ``L`` shares' gathered messages, which every rank decodes the
same way: parameters stay bit-identical on all ``W`` ranks.

That is a different algorithm from flat DeMo: the momentum is the node's (of the node-averaged
gradient), not each rank's, and the decode averages ``N`` nodes' coefficients, not ``W`` ranks'.
It equals flat DeMo where the selection keeps everything (top-k = tile size, fp32 values, no
sign): then both step along the mean momentum of all ranks. With one rank per node it is flat
DeMo exactly.

Both exchanges can be started and finished apart (``overlap``: the all-gather runs while the next
step's forward and backward compute; see ``DeMo``), which is why :meth:`MessageExchange.start`
returns an :class:`InFlight` handle.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from torchrun_ddp.distributed import NodeGroups

Counter = Callable[[str, int, dist.ProcessGroup | None], None]
"""``CompressionState.count``: records one collective's input bytes for the metrics."""


def assign_owners(sizes: Sequence[int], parts: int) -> list[int]:
    """Split items of ``sizes`` (bytes) among ``parts`` owners, largest first onto the least
    loaded (ties: the lower owner, then the earlier item), the same on every rank.

    Returns the owner (0 to ``parts - 1``) of each item in the order of ``sizes``. Raises
    ``ValueError`` for ``parts`` < 1.
    """
    if parts < 1:
        raise ValueError(f"cannot split parameters among {parts} owners; need at least 1")
    loads = [0] * parts
    owners = [0] * len(sizes)
    for index in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        owner = min(range(parts), key=lambda j: (loads[j], j))
        owners[index] = owner
        loads[owner] += sizes[index]
    return owners


@dataclass
class InFlight:
    """An exchange that was started: ``buffer`` fills when ``work`` completes.

    ``lrs``: (learning rate, weight decay) per trained parameter of the step that sent it, so
    that a delayed update is applied with its own step's rates. ``rows`` (set by
    :meth:`MessageExchange.finish`, or restored from a checkpoint): per owner, the gathered
    messages, [senders, message bytes] uint8.
    """

    buffer: torch.Tensor
    work: dist.Work | None
    lrs: list[tuple[float, float]]
    rows: list[torch.Tensor] = field(default_factory=list)


class MessageExchange:
    """The all-gather(s) that hand every rank all messages (see the module docstring).

    ``lengths``: message bytes of each owner's share (one entry for the flat exchange, ``L`` for
    the node-aware one); every rank pads its message to the longest, so that all-gathers have
    equal parts. ``counter`` is told each collective's input bytes; ``inter_node_bytes`` (only
    node-aware; 0 for the flat exchange) sums the bytes this rank has sent over the inter-node
    group (ring model: ``N - 1`` parts per all-gather), which over a node's ``L`` ranks is the
    node's uplink traffic.
    """

    def __init__(
        self,
        lengths: Sequence[int],
        process_group: dist.ProcessGroup | None,
        node_groups: NodeGroups | None,
        counter: Counter | None,
    ) -> None:
        self.lengths = list(lengths)
        self.padded = max([1, *self.lengths])
        self.process_group = process_group
        self.node_groups = node_groups
        self.counter = counter
        self.inter_node_bytes = 0

    @property
    def outer_group(self) -> dist.ProcessGroup | None:
        """The group of the first all-gather: all ranks (flat) or one rank per node."""
        return self.node_groups.inter if self.node_groups else self.process_group

    def start(self, message: torch.Tensor, lrs: list[tuple[float, float]]) -> InFlight:
        """Start the (first) all-gather of this rank's ``message`` (uint8, at most the padded
        length) without waiting for it; a collective every rank must call in the same order."""
        payload = message.new_zeros(self.padded)
        payload[: message.numel()] = message
        group = self.outer_group
        senders = dist.get_world_size(group)
        if self.counter is not None:
            self.counter("all_gather", self.padded, group)
        if self.node_groups is not None:
            self.inter_node_bytes += (senders - 1) * self.padded
        buffer = payload.new_empty(senders * self.padded)
        work = dist.all_gather_into_tensor(buffer, payload, group=group, async_op=True)
        return InFlight(buffer, work, lrs)

    def finish(self, flight: InFlight) -> list[torch.Tensor]:
        """Wait for ``flight`` and return (and keep in it) each owner's gathered messages,
        [senders, length] uint8; node-aware: after the all-gather of the shares in the node."""
        if flight.rows:
            return flight.rows
        if flight.work is not None:
            flight.work.wait()
            flight.work = None
        gathered = flight.buffer.view(-1, self.padded)
        if self.node_groups is not None:
            gathered = self._share_in_node(flight.buffer).view(len(self.lengths), -1, self.padded)
        else:
            gathered = gathered.unsqueeze(0)
        flight.rows = [gathered[j, :, :length] for j, length in enumerate(self.lengths)]
        return flight.rows

    def _share_in_node(self, buffer: torch.Tensor) -> torch.Tensor:
        """All-gather of each local rank's gathered messages inside the node, [L * len] uint8."""
        assert self.node_groups is not None
        intra = self.node_groups.intra
        if self.counter is not None:
            self.counter("all_gather", buffer.numel(), intra)
        shared = buffer.new_empty(dist.get_world_size(intra) * buffer.numel())
        dist.all_gather_into_tensor(shared, buffer, group=intra)
        return shared
