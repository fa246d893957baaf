"""DiLoCo across fault-tolerant sites: the same sync as ``optim.diloco.DiLoCo``, with the mean
taken over the live sites through their torchft Managers (``SiteLink``); dropped syncs and the
join: ``sites.sync``.

At a sync each rank's pseudo-gradient (fp32, or its bf16 wire copy) is summed over its site
(one all-reduce on the site's process group, skipped with one rank), then over the live sites
(``SiteLink.average``: the quorum, a sum on torchft's process group, the commit vote), and
divided in fp32 by the ranks summed (live sites x ranks per site). With one rank per site
that is the all-reduce of one torchrun job over the same ranks, bit for bit (a sum of two
values is the same in either order; more sites or ranks per site sum in another order, so
the result may differ in the last bits).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from torchrun_ddp.optim.diloco import DiLoCo
from torchrun_ddp.optim.local_updates import PendingSync
from torchrun_ddp.sites.sync import SiteSync


class SiteDiLoCo(SiteSync, DiLoCo):
    """:class:`DiLoCo` whose sync spans the live sites (module docstring); ``process_group`` is
    the site's own group."""

    def _site_sum(self, wire: torch.Tensor) -> int:
        """Sum ``wire`` in place over this site's ranks and then the live sites; returns the
        ranks summed. Sets ``committed``."""
        link, nbytes = self.site_link(), wire.numel() * wire.element_size()
        ranks = dist.get_world_size(self.process_group)
        if ranks > 1:
            self._count("all_reduce", nbytes)
            dist.all_reduce(wire, group=self.process_group)
        self.committed = link.average(wire)
        self._count_across("all_reduce", nbytes)
        return ranks * max(1, link.participants)

    def _start_exchange(self, start: list[torch.Tensor]) -> PendingSync:
        """The pseudo-gradient, summed over the live sites at once (blocking)."""
        flat, wire = self._pseudo_gradient()
        ranks = self._site_sum(wire)
        if self.committed:
            self.site_link().after_commit()
        if wire is not flat:
            flat.copy_(wire)
        flat.div_(ranks)
        return PendingSync(start, flat=flat, wire=flat)

    def _finish_exchange(self, pending: PendingSync) -> None:
        """Nothing left: ``_start_exchange`` waited for the sum."""

    def _join_exchange(self) -> bool:
        """A sum to which this site adds zeros; on a heal, the mean becomes ``synced``'s
        gradients."""
        flat = torch.zeros(sum(p.numel() for p in self.trained), device=self.synced[0].device)
        ranks = self._site_sum(flat)
        if not (self.site_link().healed and self.committed):
            return False
        flat.div_(ranks)
        offset = 0
        for copy in self.synced:
            copy.grad = flat[offset : offset + copy.numel()].view_as(copy)
            offset += copy.numel()
        return True
