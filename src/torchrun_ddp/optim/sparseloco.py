"""SparseLoCo: error feedback, top-k per chunk, quantization and one all-gather per sync.

Sarfi, Therien, Lidin & Belilovsky 2025, "Communication Efficient LLM Pre-training with
SparseLoCo", arXiv:2508.15706. On the shared machinery of :class:`.local_updates.LocalUpdates`
(inner AdamW stepped locally, a sync every ``H = local_steps`` steps, overlapped syncs and eager
updates), a sync runs, on each rank ``r`` with pseudo-gradient ``delta_r = theta - theta_r``:
error feedback ``e_r <- beta e_r + delta_r``; every chunk of ``e_r`` (the parameter cut into
tiles of at most ``chunk x chunk`` values, :func:`.transform.tile_shape`, as DeMo tiles but
without the DCT) sends its ``k`` largest-magnitude values, quantized to ``quant_bits`` bits with
one fp32 scale per chunk (levels ``(2 q / (2^b - 1) - 1) * scale``, ``scale`` = the chunk's
largest magnitude, so the largest value is sent exactly; other quantizers, aggregates and clips:
``sparseloco_codec``); what was sent (the dequantized values) is subtracted from ``e_r``; one
all-gather of (positions, codes, scales); every rank decodes all messages the same way, in rank
order, into ``delta = mean_r sent_r``, and ``torch.optim.SGD`` without momentum steps ``theta
<- theta - outer_lr * delta`` (the error feedback takes the outer momentum's role).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from torchrun_ddp.compression.wire import sparseloco_chunk_payload
from torchrun_ddp.optim.exchange import Counter, MessageExchange, assign_owners
from torchrun_ddp.optim.local_updates import (
    LocalUpdates,
    LocalUpdateSettings,
    OuterOptimizer,
    PendingSync,
)
from torchrun_ddp.optim.sparseloco_codec import chunk_codec, decode_mean, encode_chunks

if TYPE_CHECKING:
    from torchrun_ddp.distributed import NodeGroups


class SparseLoCo(LocalUpdates):
    """SparseLoCo (module docstring) around an inner optimizer; see :class:`LocalUpdates` for
    the arguments, the state and the errors. Adds ``error`` (this rank's fp32 error feedback per
    parameter), ``codecs`` (each parameter's chunks, :func:`.sparseloco_codec.chunk_codec`) and
    ``exchange`` (the :class:`.exchange.MessageExchange` that carries the messages).

    ``node_groups`` (``--compression-scope inter-node``): every node is one replica. Its ranks
    train on the node's mean gradient (the hook of
    ``compression.local_gradients.register_local_gradients`` with ``node_groups``), so they hold
    the same parameters and pseudo-gradient; at a sync local rank ``j`` compresses its share of
    the tensors (``exchange.assign_owners``) with its share's error feedback, one message per
    share crosses the uplinks and the node shares the gathered messages inside
    (``exchange.MessageExchange``). The mean is then over nodes, not ranks.
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
        super().__init__(inner, settings, process_group, counter, node_groups, outer)
        self.error = [torch.zeros_like(copy) for copy in self.synced]
        self.codecs = [
            chunk_codec(tuple(p.shape), settings.chunk, settings.topk) for p in self.trained
        ]
        self._plan_exchange(node_groups)

    def _plan_exchange(self, node_groups: NodeGroups | None) -> None:
        """Which local rank sends which tensors, and the exchange that carries it."""
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

    def payload_bytes(self) -> int:
        """Bytes of this rank's all-gather part per sync (node-aware: the largest share's, to
        which every share is padded); ``wire.sparseloco_payload_bytes``."""
        return self.exchange.padded

    def _start_exchange(self, start: list[torch.Tensor]) -> PendingSync:
        """Error feedback, top-k per chunk and quantization of this rank's tensors (all of them,
        or its share when node-aware), and the all-gather of the message, started."""
        compressed = [self._compress(index) for index in self.share()]
        messages = [message for message, _ in compressed]
        device = self.synced[0].device
        payload = torch.cat(messages) if messages else torch.zeros(0, dtype=torch.uint8)
        own = [sent for _, sent in compressed] if self.settings.eager else []
        return PendingSync(start, flight=self.exchange.start(payload.to(device), []), own=own)

    def _finish_exchange(self, pending: PendingSync) -> None:
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
