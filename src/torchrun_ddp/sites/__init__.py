"""Fault-tolerant sites (``--fault-tolerance sites``): each site its own torchrun job and a torchft
replica group; the settings and checks (``settings``), the link to the other sites (``link``),
DiLoCo across them (``diloco``) and a site's start, healing included (``join``). Only the
settings are imported here: the rest pulls in torchft and the trainer."""

import importlib
from types import ModuleType

from torchrun_ddp.sites.settings import (
    SITE_FLAGS,
    SiteSettings,
    check_sites,
    data_place,
    lighthouse_url,
    site_settings,
)

__all__ = [
    "SITE_FLAGS",
    "SiteSettings",
    "check_sites",
    "data_place",
    "lighthouse_url",
    "site_settings",
]


def sites_join() -> ModuleType:
    """``sites.join`` (joining, healing and leaving the live sites), imported only for a run
    across sites: it imports torchft (about 3 s)."""
    return importlib.import_module("torchrun_ddp.sites.join")
