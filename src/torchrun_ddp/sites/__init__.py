"""Fault-tolerant sites (``--fault-tolerance sites``): each site its own torchrun job and a torchft
replica group; the settings and checks (``settings``), the link to the other sites (``link``),
DiLoCo across them (``diloco``) and a site's start, healing included (``join``). Only the
settings are imported here: the rest pulls in torchft and the trainer."""

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
