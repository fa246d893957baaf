"""Replicas fingerprinted after a heal (``HealCheck``), as ``checkpoint.replicas`` does after a
resume: a torchrun job's ranks compare their state's SHA-256 there; sites compare theirs in the
all-gather of data positions that every sync already makes (``SiteLink``)."""

from __future__ import annotations

import logging
from collections.abc import Callable

from torchrun_ddp.errors import UserError
from torchrun_ddp.sites.positions import Shared, differing_sites

log = logging.getLogger("torchrun_ddp")


class HealCheck:
    """Replicas fingerprinted after a heal, as after a resume (``checkpoint.replicas``): a site
    that healed and the live site that sent it the state each share, at their first sync after
    the heal, the SHA-256 of their synced state before that sync's outer step (``fingerprint``:
    the synced parameters and outer momentum), and compare it with the other's in that sync's
    all-gather of data positions. Sites that took no part share none."""

    def __init__(self, site: int) -> None:
        self.site = site
        self.stage = ""
        """"": nothing to check; "next": a heal in this sync, check in the next; "now"."""
        self.fingerprint: Callable[[], str] = lambda: ""
        self.digest = ""
        self.took = False

    def mark(self, took: bool) -> None:
        """A heal in this sync: this site sent the state, or ``took`` it."""
        self.stage, self.took = "next", took

    def due(self) -> str:
        """The digest to share in this sync: the fingerprint when a check is due, else ""."""
        self.digest = self.fingerprint() if self.stage == "now" else ""
        return self.digest

    def settle(self, shared: list[Shared] | None) -> None:
        """After a sync: compare this site's digest with the others' in ``shared`` (None: the
        sync was not committed, the check waits for the next). Raises UserError on a site that
        took the state and differs; a site that sent it logs an error instead (its replica is
        the quorum's)."""
        if self.stage == "next":
            self.stage = "now"
            return
        if self.stage != "now" or shared is None:
            return
        self.stage = ""
        others = sorted(entry.site for entry in shared if entry.digest and entry.site != self.site)
        differ = differing_sites(Shared(self.site, 0, {}, self.digest), shared)
        if not others:
            return
        if not differ:
            log.info("sites: replicas agree after the heal (sites %s, SHA-256 %s)",
                     sorted([self.site, *others]), self.digest[:16])  # fmt: skip
            return
        message = (
            f"sites: site {self.site}'s synced state differs from site(s) {differ} after a heal "
            f"(SHA-256 of the synced parameters and outer momentum)"
        )
        if self.took:
            raise UserError(f"{message}: this site stops; start it again to heal anew")
        log.error("%s: the healed site stops, this one trains on", message)
