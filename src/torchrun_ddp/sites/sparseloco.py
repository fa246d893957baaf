"""SparseLoCo (and MuLoCo, which syncs as SparseLoCo does) across fault-tolerant sites: the
same sync as ``optim.sparseloco.SparseLoCo``, its all-gather taken over the live sites through
their torchft Managers (``sites.messages``); dropped syncs and the join: ``sites.sync``.

At a sync each rank compresses its own pseudo-gradient with its own error feedback (its site's,
never shared), the messages of the live sites that take part are gathered in one torchrun job's
rank order, and every rank decodes their mean as SparseLoCo does. With every site up the run is
one torchrun job's over the same ranks, bit for bit (the same messages, decoded in the same
order).
"""

from __future__ import annotations

import torch

from torchrun_ddp.optim.exchange import InFlight
from torchrun_ddp.optim.local_updates import PendingSync
from torchrun_ddp.optim.sparseloco import SparseLoCo
from torchrun_ddp.optim.sparseloco_codec import decode_mean
from torchrun_ddp.sites.messages import gather_messages
from torchrun_ddp.sites.sync import SiteSync


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
        message bytes], by site then rank (empty when the sync is not committed;
        ``sites.messages``). Sets ``committed``."""
        self.committed, rows = gather_messages(
            self.site_link(), payload, self.process_group, joining, self.counter,
            self.synced[0].device,
        )  # fmt: skip
        return rows
