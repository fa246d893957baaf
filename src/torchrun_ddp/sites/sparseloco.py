"""SparseLoCo (and MuLoCo, which syncs as SparseLoCo does) across fault-tolerant sites: the
same sync as ``optim.sparseloco.SparseLoCo``, its all-gather taken over the live sites through
their torchft Managers (``SiteLink.gather``); dropped syncs and the join: ``sites.sync``.

At a sync each rank compresses its own pseudo-gradient with its own error feedback (its site's,
never shared) and sends its message, behind a 24-byte header (whether it takes part in this
sync, its site, its rank in the site), to the same rank of the live sites; with several ranks
per site, the ranks of a site then all-gather what each received. Every rank keeps the
messages of the sites that take part (not those of a site that joins or heals in this sync:
torchft's all-reduce gives those zero weight, an all-gather must drop them by hand), orders
them by site, then rank, which is one torchrun job's rank order over the same ranks, and
decodes their mean as SparseLoCo does. With every site up the run is one torchrun job's over
the same ranks, bit for bit (the same messages, decoded in the same order).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from torchrun_ddp.optim.exchange import InFlight
from torchrun_ddp.optim.local_updates import PendingSync
from torchrun_ddp.optim.sparseloco import SparseLoCo
from torchrun_ddp.optim.sparseloco_codec import decode_mean
from torchrun_ddp.sites.sync import SiteSync

HEADER = 3
"""int64 values before a message: takes part (1 or 0), site, rank in the site."""


class SiteSparseLoCo(SiteSync, SparseLoCo):
    """:class:`SparseLoCo` whose all-gather spans the live sites (module docstring);
    ``process_group`` is the site's own group (never node-aware)."""

    def _start_exchange(self, start: list[torch.Tensor]) -> PendingSync:
        """Error feedback, top-k and quantization of every tensor; the messages of the live
        sites gathered at once (blocking)."""
        messages = [self._compress(index)[0] for index in range(len(self.codecs))]
        payload = torch.cat(messages)
        rows = self._site_rows(payload, joining=False)
        if self.committed:
            self.site_link().after_commit()
        return PendingSync(start, flight=InFlight(payload, None, [], [rows]))

    def _finish_exchange(self, pending: PendingSync) -> None:
        """The mean of the gathered messages becomes ``synced``'s gradients."""
        assert pending.flight is not None
        self._decode(pending.flight.rows[0])

    def _join_exchange(self) -> bool:
        """A gather to which this site sends an empty message (marked as not taking part); on
        a heal, the live sites' mean becomes ``synced``'s gradients."""
        size = sum(self._message_bytes(index) for index in range(len(self.codecs)))
        rows = self._site_rows(torch.zeros(size, dtype=torch.uint8), joining=True)
        if not (self.site_link().healed and self.committed and len(rows)):
            return False
        self._decode(rows)
        return True

    def _decode(self, rows: torch.Tensor) -> None:
        """``rows`` (uint8 [senders, message bytes]) -> the mean per parameter into
        ``synced``'s gradients (fp32, the parameters' shapes)."""
        offset = 0
        for index, codec in enumerate(self.codecs):
            size = self._message_bytes(index)
            part = rows[:, offset : offset + size].to(self.synced[index].device)
            self.synced[index].grad = decode_mean(part, codec, self.settings.message_format)
            offset += size

    def _site_rows(self, payload: torch.Tensor, joining: bool) -> torch.Tensor:
        """Every live site's rank's message of this sync that takes part, uint8 [senders,
        message bytes], by site then rank (empty when the sync is not committed). Sets
        ``committed``."""
        link = self.site_link()
        rank = dist.get_rank(self.process_group)

        def blob(participating: bool) -> torch.Tensor:
            header = torch.tensor([int(participating and not joining), link.site, rank])
            return torch.cat([header.view(torch.uint8), payload.cpu()])

        self.committed, blobs = link.gather(blob)
        self._count_across("all_gather", 8 * HEADER + payload.numel())
        if not self.committed or not blobs:
            return torch.zeros(0, payload.numel(), dtype=torch.uint8)
        stacked = torch.stack(blobs)
        if dist.get_world_size(self.process_group) > 1:
            stacked = self._site_all_gather(stacked)
        head = stacked[:, : 8 * HEADER].contiguous().view(torch.int64)
        keep = sorted(
            (int(site), int(member), row)
            for row, (flag, site, member) in enumerate(head.tolist())
            if flag
        )
        return stacked[[row for _, _, row in keep], 8 * HEADER :]

    def _site_all_gather(self, stacked: torch.Tensor) -> torch.Tensor:
        """What each rank of this site received (uint8 [sites, bytes], the same shape on every
        rank of a committed sync), gathered over the site: [ranks x sites, bytes]."""
        device = self.synced[0].device
        parts = [
            torch.empty_like(stacked, device=device)
            for _ in range(dist.get_world_size(self.process_group))
        ]
        self._count("all_gather", stacked.numel())
        dist.all_gather(parts, stacked.to(device), group=self.process_group)
        return torch.cat(parts).cpu()
