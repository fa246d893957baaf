"""What every method's sync across fault-tolerant sites shares (``SiteSync``): a sync that is
not committed is dropped, and a site joins the live sites before its first step.

A sync that is not committed (a site died during it) is dropped: no outer step, and the local
parameters keep their progress, which the next sync's pseudo-gradient then carries. A site that
starts (or restarts) first joins the sites (``join``): a sync to which it contributes nothing,
in which a site behind the others heals from a live one and then takes the same outer step as
they do. ``site_optimizer_class`` names each method's optimizer across sites.
"""

from __future__ import annotations

import importlib

import torch

from torchrun_ddp.optim.local_updates import LocalUpdates
from torchrun_ddp.sites.link import SiteLink

SITE_CLASSES = {
    "DiLoCo": "torchrun_ddp.sites.diloco:SiteDiLoCo",
    "SparseLoCo": "torchrun_ddp.sites.sparseloco:SiteSparseLoCo",
}
"""A method's optimizer class -> its class across sites (module:name)."""


def site_optimizer_class(base: type[LocalUpdates]) -> type[SiteSync]:
    """``base``'s class across sites (``SITE_CLASSES``). Raises KeyError for a class that has
    none (the method's ``site_problem`` refuses it before anything is built)."""
    module, name = SITE_CLASSES[base.__name__].split(":")
    found = getattr(importlib.import_module(module), name)
    assert issubclass(found, SiteSync) and issubclass(found, base)
    return found


class SiteSync(LocalUpdates):
    """A :class:`LocalUpdates` whose sync spans the live sites (module docstring); the method's
    own class comes after it in a subclass's bases (``SiteDiLoCo(SiteSync, DiLoCo)``), which
    also implements ``_join_exchange``. Set ``link`` before the first step."""

    link: SiteLink | None = None
    committed: bool = True
    """Whether the last sync was committed by every rank of this site."""

    def site_link(self) -> SiteLink:
        """The link; raises AssertionError before it is set."""
        assert self.link is not None, f"{type(self).__name__} needs its link before a sync"
        return self.link

    def _count_across(self, collective: str, nbytes: int) -> None:
        """Tell ``counter`` a collective of ``nbytes`` input bytes over the live sites' torchft
        group (at its size: the quorum's)."""
        if self.counter is not None:
            self.counter(collective, nbytes, self.site_link().group)

    @torch.no_grad()
    def flush(self) -> bool:
        """``LocalUpdates.flush``; a sync that was not committed is dropped instead (no outer
        step, the local parameters unchanged)."""
        if self.pending is not None and not self.committed:
            for copy in self.synced:
                copy.grad = None
            self.pending = None
            return True
        return super().flush()

    @torch.no_grad()
    def join(self) -> bool:
        """Collective over the live sites, before this site's first step: a sync to which this
        site contributes nothing. A site behind the quorum heals in it (``SiteLink.healed``) and
        then takes the live sites' outer step, its parameters set to the synced ones. Returns
        whether it healed; the parameters are untouched otherwise (every site joined at once)."""
        if not self._join_exchange():
            return False
        self.outer.step()
        for param, copy in zip(self.trained, self.synced, strict=True):
            copy.grad = None
            param.copy_(copy)
        self.position = 0
        self.syncs_applied += 1
        return True

    def _join_exchange(self) -> bool:
        """The subclass's: the join's sync, contributing nothing. Returns True when this site
        healed in it and it was committed, ``synced``'s gradients then the live sites' mean."""
        raise NotImplementedError(f"{type(self).__name__} has no join")
