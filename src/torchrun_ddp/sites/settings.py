"""The settings of fault-tolerant sites (``--fault-tolerance sites``): who this site is, where
the lighthouse is, what it advertises, and every timeout in one place with its default derived
from ``--train-timeout-s`` (the table of docs/fault-tolerance.md#fault-tolerant-sites).

Checked before any process group exists (``check_sites``): one-line ``UserError``s naming the
flag and the fix, also where two timeouts contradict each other.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from torchrun_ddp.config import TrainConfig, flag_name
from torchrun_ddp.errors import UserError

SITE_FLAGS = (
    "site_id",
    "sites",
    "lighthouse",
    "site_address",
    "site_store_port",
    "quorum_timeout_s",
    "quorum_retries",
    "site_timeout_s",
    "site_heartbeat_ms",
    "site_start_wait_s",
)
"""The flags only ``--fault-tolerance sites`` reads."""
LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"
"""torchft's variable for the lighthouse address (used when --lighthouse is empty)."""


@dataclass(frozen=True)
class SiteSettings:
    """One site's place among the sites, resolved from the config (``site_settings``)."""

    site_id: int
    """This site's index, 0 .. sites - 1 (torchft's replica id ``site<N>``)."""
    sites: int
    """The sites the data is split over."""
    lighthouse: str
    """The lighthouse's URL, ``http://host:port`` ("" : torchft reads TORCHFT_LIGHTHOUSE)."""
    address: str
    """The host advertised for this site's store and manager ("" : MASTER_ADDR, host name)."""
    store_port: int
    """The port of the site's store for its Managers (0: a free one)."""
    quorum_timeout_s: int
    """Seconds a quorum may take, lighthouse retries included."""
    quorum_retries: int
    """Tries of a failed lighthouse call within the quorum timeout."""
    timeout_s: int
    """Seconds a cross-site collective, commit vote or healing transfer may take."""
    heartbeat_ms: int
    """Milliseconds between heartbeats to the lighthouse."""
    start_wait_s: int = 0
    """Seconds a site's join waits for all ``sites`` sites at the start (0: none)."""

    @property
    def replica_id(self) -> str:
        """torchft's replica id of this site (its trailing digits are the site index)."""
        return f"site{self.site_id}"


def lighthouse_url(address: str) -> str:
    """``host:port`` as the ``http://host:port`` URL torchft's client dials ("" stays "")."""
    if not address or "://" in address:
        return address
    return f"http://{address}"


def site_settings(config: TrainConfig) -> SiteSettings:
    """The resolved settings: 0 timeouts take ``--train-timeout-s`` (or ``--timeout-s`` where
    that is 0)."""
    train = config.train_timeout_s or config.timeout_s
    return SiteSettings(
        site_id=config.site_id,
        sites=config.sites,
        lighthouse=lighthouse_url(config.lighthouse),
        address=config.site_address,
        store_port=config.site_store_port,
        quorum_timeout_s=config.quorum_timeout_s or train,
        quorum_retries=config.quorum_retries,
        timeout_s=config.site_timeout_s or train,
        heartbeat_ms=config.site_heartbeat_ms,
        start_wait_s=config.site_start_wait_s,
    )


def check_sites(config: TrainConfig, given: frozenset[str] = frozenset()) -> None:
    """The flags of ``--fault-tolerance sites``: refused without it, ranges, and timeouts that
    contradict each other (the method and the mode answer for themselves:
    ``methods.check_sites_method``, ``parallel.modes.check_modes``). Raises UserError, one line
    naming the flag and the fix."""
    if config.fault_tolerance != "sites":
        for name in SITE_FLAGS:
            if name in given:
                raise UserError(
                    f"--{flag_name(name)} applies to --fault-tolerance sites only; drop it or "
                    "add --fault-tolerance sites"
                )
        return
    if config.sites < 1 or not 0 <= config.site_id < config.sites:
        raise UserError(
            f"--fault-tolerance sites needs --sites N >= 1 and --site-id in 0 .. N - 1, got "
            f"--sites {config.sites} --site-id {config.site_id}"
        )
    for name in ("quorum_timeout_s", "quorum_retries", "site_timeout_s", "site_start_wait_s"):
        if getattr(config, name) < 0:
            raise UserError(f"--{flag_name(name)} must be >= 0, got {getattr(config, name)}")
    if not config.lighthouse and not os.environ.get(LIGHTHOUSE_ENV):
        raise UserError(
            "--fault-tolerance sites needs the torchft lighthouse's address: give --lighthouse "
            f"host:port (or set {LIGHTHOUSE_ENV}); start one with ./run.sh lighthouse"
        )
    _check_timeouts(site_settings(config))


def _check_timeouts(settings: SiteSettings) -> None:
    """Timeouts that cannot work together."""
    if settings.heartbeat_ms < 1:
        raise UserError(f"--site-heartbeat-ms must be >= 1, got {settings.heartbeat_ms}")
    if settings.heartbeat_ms * 2 > settings.quorum_timeout_s * 1000:
        raise UserError(
            f"--site-heartbeat-ms {settings.heartbeat_ms} leaves fewer than 2 heartbeats in "
            f"the quorum timeout ({settings.quorum_timeout_s} s): lower it or raise "
            "--quorum-timeout-s"
        )
    if settings.heartbeat_ms * 2 > settings.timeout_s * 1000:
        raise UserError(
            f"--site-heartbeat-ms {settings.heartbeat_ms} leaves fewer than 2 heartbeats in "
            f"--site-timeout-s {settings.timeout_s}: lower it or raise --site-timeout-s"
        )


def data_place(config: TrainConfig, rank: int, world_size: int) -> tuple[int, int]:
    """``(rank, world size)`` of this rank in the document order: under ``--fault-tolerance
    sites`` the order is split over sites x ranks (site ``s``'s rank ``r`` is ``s * world_size
    + r``), as one torchrun job over every site's ranks splits it; ``(rank, world_size)``
    otherwise."""
    if config.fault_tolerance != "sites":
        return rank, world_size
    return config.site_id * world_size + rank, config.sites * world_size
