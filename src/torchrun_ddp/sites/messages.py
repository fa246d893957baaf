"""Compressed messages gathered over the live sites, as one torchrun job of all their ranks would
all-gather them: SparseLoCo's and MuLoCo's at each sync, DeMo's every step.

Each rank sends its message, behind a 24-byte header (whether it takes part in this exchange,
its site, its rank in its exchange group), to the same rank of the live sites through their
torchft Managers (``SiteLink.gather``); with several ranks in the exchange group (DDP inside the
site), the ranks then all-gather what each received. Every rank keeps the messages of the sites
that take part (not those of a site that joins or heals in this exchange: torchft's all-reduce
gives those zero weight, an all-gather must drop them by hand) and orders them by site, then
rank, which is one torchrun job's rank order over the same ranks: decoded in that order, the
result is that job's, bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from torchrun_ddp.sites.link import SiteLink

HEADER = 3
"""int64 values before a message: takes part (1 or 0), site, rank in the exchange group."""
HEADER_BYTES = 8 * HEADER

Count = Callable[[str, int, dist.ProcessGroup | None], None]
"""``CompressionState.count``: one collective's input bytes and its group."""


def gather_messages(
    link: SiteLink,
    payload: torch.Tensor,
    group: dist.ProcessGroup | None,
    joining: bool,
    count: Count | None,
    device: torch.device,
) -> tuple[bool, torch.Tensor]:
    """Collective over the live sites and ``group`` (this rank's exchange group in its site):
    every taking-part rank's ``payload`` (uint8 [bytes], the same length on every rank), as uint8
    [senders, bytes] by site then rank; ``joining``: this rank's own is marked as not taking
    part (a site's join). Returns whether every rank of this site commits the exchange, and the
    rows (none when it is not committed). ``count`` is told the bytes sent across the sites and
    in ``group``; ``device``: where ``group``'s collectives take their tensors. Raises
    RuntimeError when no quorum forms (``SiteLink.gather``)."""
    rank = dist.get_rank(group)

    def blob(participating: bool) -> torch.Tensor:
        header = torch.tensor([int(participating and not joining), link.site, rank])
        return torch.cat([header.view(torch.uint8), payload.cpu()])

    committed, blobs = link.gather(blob)
    if count is not None:
        count("all_gather", HEADER_BYTES + payload.numel(), link.group)
    if not committed or not blobs:
        return False, torch.zeros(0, payload.numel(), dtype=torch.uint8)
    stacked = torch.stack(blobs)
    if dist.get_world_size(group) > 1:
        stacked = _gather_in_site(stacked, device, group, count)
    head = stacked[:, :HEADER_BYTES].contiguous().view(torch.int64)
    keep = sorted(
        (int(site), int(member), row)
        for row, (flag, site, member) in enumerate(head.tolist())
        if flag
    )
    return True, stacked[[row for _, _, row in keep], HEADER_BYTES:]


def _gather_in_site(
    stacked: torch.Tensor,
    device: torch.device,
    group: dist.ProcessGroup | None,
    count: Count | None,
) -> torch.Tensor:
    """What each rank of ``group`` received (uint8 [sites, bytes], the same shape on every rank
    of a committed exchange), gathered over it: [ranks x sites, bytes]."""
    parts = [torch.empty_like(stacked, device=device) for _ in range(dist.get_world_size(group))]
    if count is not None:
        count("all_gather", stacked.numel(), group)
    dist.all_gather(parts, stacked.to(device), group=group)
    return torch.cat(parts).cpu()
