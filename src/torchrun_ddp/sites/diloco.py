"""DiLoCo across fault-tolerant sites: the same sync as ``optim.diloco.DiLoCo``, with the mean
taken over the live sites through their torchft Managers (``SiteLink``).

At a sync each rank's pseudo-gradient (fp32, or its bf16 wire copy) is summed over its site
(one all-reduce on the site's process group, skipped with one rank), then over the live sites
(``SiteLink.average``: the quorum, a sum on torchft's process group, the commit vote), and
divided in fp32 by the ranks summed (live sites x ranks per site). With one rank per site
that is the all-reduce of one torchrun job over the same ranks, bit for bit (a sum of two
values is the same in either order; more sites or ranks per site sum in another order, so
the result may differ in the last bits).

A sync that is not committed (a site died during it) is dropped: no outer step, and the local
parameters keep their progress, which the next sync's pseudo-gradient then carries. A site that
starts (or restarts) first joins the sites (``join``): a sync with zeros, in which a site behind
the others heals from a live one and then takes the same outer step as they do.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from torchrun_ddp.optim.diloco import DiLoCo
from torchrun_ddp.optim.local_updates import PendingSync
from torchrun_ddp.sites.link import SiteLink

log = logging.getLogger("torchrun_ddp")


class SiteDiLoCo(DiLoCo):
    """:class:`DiLoCo` whose sync spans the live sites (module docstring); ``process_group`` is
    the site's own group. Set ``link`` before the first step."""

    link: SiteLink | None = None
    committed: bool = True
    """Whether the last sync was committed by every rank of this site."""

    def _site_sum(self, wire: torch.Tensor) -> int:
        """Sum ``wire`` in place over this site's ranks and then the live sites; returns the
        ranks summed. Sets ``committed``."""
        assert self.link is not None, "SiteDiLoCo needs its link before a sync"
        ranks = dist.get_world_size(self.process_group)
        if ranks > 1:
            dist.all_reduce(wire, group=self.process_group)
        self.committed = self.link.average(wire)
        return ranks * max(1, self.link.participants)

    def _start_exchange(self, start: list[torch.Tensor]) -> PendingSync:
        """The pseudo-gradient, summed over the live sites at once (blocking)."""
        assert self.link is not None, "SiteDiLoCo needs its link before a sync"
        flat, wire = self._pseudo_gradient()
        self._count("all_reduce", wire.numel() * wire.element_size())
        ranks = self._site_sum(wire)
        if self.committed:
            self.link.after_commit()
        if wire is not flat:
            flat.copy_(wire)
        flat.div_(ranks)
        return PendingSync(start, flat=flat, wire=flat)

    def _finish_exchange(self, pending: PendingSync) -> None:
        """Nothing left: ``_start_exchange`` waited for the sum."""

    @torch.no_grad()
    def flush(self) -> bool:
        """``DiLoCo.flush``; a sync that was not committed is dropped instead (no outer step,
        the local parameters unchanged)."""
        if self.pending is not None and not self.committed:
            for copy in self.synced:
                copy.grad = None
            self.pending = None
            return True
        return super().flush()

    @torch.no_grad()
    def join(self) -> bool:
        """Collective over the live sites, before this site's first step: a sync to which this
        site adds zeros. A site behind the quorum heals in it (``SiteLink.healed``) and then
        takes the live sites' outer step, its parameters set to the synced ones. Returns whether
        it healed; the parameters are untouched otherwise (every site joined at once)."""
        assert self.link is not None, "SiteDiLoCo needs its link before it joins"
        flat = torch.zeros(sum(p.numel() for p in self.trained), device=self.synced[0].device)
        ranks = self._site_sum(flat)
        if not (self.link.healed and self.committed):
            return False
        flat.div_(ranks)
        offset = 0
        for copy in self.synced:
            copy.grad = flat[offset : offset + copy.numel()].view_as(copy)
            offset += copy.numel()
        self.outer.step()
        for param, copy in zip(self.trained, self.synced, strict=True):
            copy.grad = None
            param.copy_(copy)
        self.position = 0
        self.syncs_applied += 1
        return True
