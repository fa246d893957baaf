"""Fault-tolerant sites (``--fault-tolerance sites``): each site its own torchrun job and a torchft
replica group; the settings and checks (``settings``), the link to the other sites (``link``),
the methods' syncs across them (``sync``, ``diloco``, ``sparseloco``) and a site's start,
healing included (``join``). Only the settings are imported here, and ``join_sites`` /
``leave_sites`` import the rest (torchft and the trainer) only for a run across sites."""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import TYPE_CHECKING

from torchrun_ddp.sites.settings import (
    SITE_FLAGS,
    SiteSettings,
    check_sites,
    data_place,
    lighthouse_url,
    site_settings,
)

if TYPE_CHECKING:
    from torchrun_ddp.build import Trainer

__all__ = [
    "SITE_FLAGS",
    "SiteSettings",
    "check_sites",
    "data_place",
    "join_sites",
    "leave_sites",
    "lighthouse_url",
    "site_settings",
]


def _join_module() -> ModuleType:
    """``sites.join`` (joining, healing and leaving the live sites), imported only for a run
    across sites: it imports torchft (about 3 s)."""
    return importlib.import_module("torchrun_ddp.sites.join")


def join_sites(trainer: Trainer) -> None:
    """Before the first step of a ``--fault-tolerance sites`` run (nothing otherwise): join
    the live sites, a site behind them healing from one (``sites.join.join_sites``)."""
    if trainer.config.fault_tolerance == "sites":
        _join_module().join_sites(trainer)


def leave_sites(trainer: Trainer) -> None:
    """After training under ``--fault-tolerance sites`` (nothing otherwise): stop this rank's
    torchft Manager (``sites.join.leave_sites``)."""
    if trainer.config.fault_tolerance == "sites":
        _join_module().leave_sites(trainer)
