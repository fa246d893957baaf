"""Which ranks see one checkpoint folder: the storage domains of a run, found out at start.

A run on one shared file system has one domain (every rank). Across sites, or on node-local
disks, each site or node is a domain with a ``--checkpoint-dir`` of its own. Every domain's
folder holds a whole checkpoint: the replicated state (written by the domain's ranks through DCP
in a process group of their own), the own state of its ranks, and, as buddy copies, the own state
of the ranks of the ``buddy_copies`` domains before it, so that losing that many folders loses no
rank's state. The ranks find the domains with a probe: each writes a file named by its rank into
a fresh folder under ``--checkpoint-dir`` and looks for everyone else's.

The probe trusts the file system to show a file another node wrote and closed before a barrier
(close-to-open consistency: NFS, Lustre, GPFS and local disks do).
"""

from __future__ import annotations

import contextlib
import shutil
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from torchrun_ddp.checkpoint.codec import write_bytes
from torchrun_ddp.checkpoint.ranks import barrier, broadcast_json, collective_device
from torchrun_ddp.errors import UserError

STORAGE_MODES = ("auto", "shared", "node-local")
PROBE_DIR = ".storage-probe"


@dataclass(frozen=True)
class StorageLayout:
    """The storage domains of a run: ``domains[d]`` are the ranks (sorted) that see domain
    ``d``'s folder, domains ordered by their first rank; ``domain`` is this rank's.

    ``buddy_copies``: how many later domains also hold a domain's per-rank files (at most the
    number of other domains). ``group``: the process group of this rank's domain (None: the
    default group, with one domain), in which DCP writes and reads the replicated state."""

    domains: tuple[tuple[int, ...], ...]
    domain: int = 0
    buddy_copies: int = 0
    group: dist.ProcessGroup | None = field(default=None, compare=False, repr=False)

    @property
    def shared(self) -> bool:
        """One folder for every rank (a shared file system): today's single layout."""
        return len(self.domains) == 1

    @property
    def leader(self) -> int:
        """The rank that creates, publishes and prunes this domain's folders."""
        return self.domains[self.domain][0]

    def domain_of(self, rank: int) -> int:
        """The domain whose folder holds ``rank``'s own files first.

        Raises ValueError for a rank outside every domain."""
        for index, ranks in enumerate(self.domains):
            if rank in ranks:
                return index
        raise ValueError(f"rank {rank} is in no storage domain")

    def keeps(self, domain: int) -> list[int]:
        """The ranks whose own files ``domain``'s folder holds: its own ranks, then those of the
        ``buddy_copies`` domains before it (as buddy copies)."""
        count = len(self.domains)
        earlier = [(domain - back) % count for back in range(self.buddy_copies + 1)]
        return sorted(rank for index in earlier for rank in self.domains[index])

    def buddy_targets(self, rank: int) -> list[int]:
        """The ranks that write ``rank``'s buddy copies: in each of the next ``buddy_copies``
        domains, the member at ``rank``'s index in its own domain (modulo that domain's size)."""
        home = self.domain_of(rank)
        index = self.domains[home].index(rank)
        count = len(self.domains)
        targets = []
        for ahead in range(1, self.buddy_copies + 1):
            ranks = self.domains[(home + ahead) % count]
            targets.append(ranks[index % len(ranks)])
        return targets

    def describe(self) -> str:
        """``"2 checkpoint folders: ranks 0-1 | ranks 2-3, 1 buddy copy"``, for the log."""
        parts = " | ".join(span(ranks) for ranks in self.domains)
        copies = "copy" if self.buddy_copies == 1 else "copies"
        return (
            f"{len(self.domains)} checkpoint folders: {parts}, {self.buddy_copies} buddy {copies}"
        )


def span(ranks: Sequence[int]) -> str:
    """``ranks 0-3`` for consecutive ranks, ``rank 2`` for one, else ``ranks 0,2``."""
    if list(ranks) == list(range(ranks[0], ranks[-1] + 1)) and len(ranks) > 1:
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return "rank " + str(ranks[0]) if len(ranks) == 1 else "ranks " + ",".join(map(str, ranks))


def single_layout(world_size: int) -> StorageLayout:
    """Every rank sees one folder (``--checkpoint-storage shared``, or one process)."""
    return StorageLayout(domains=(tuple(range(world_size)),))


def detect_storage(
    root: Path,
    mode: str,
    local_world_size: int,
    buddy_copies: int,
    timeout: timedelta,
) -> StorageLayout:
    """Collective: the storage domains of ``root`` (each rank's own ``--checkpoint-dir``).

    ``mode`` ``shared`` trusts the folder to be shared (no probe: one domain); ``auto`` probes;
    ``node-local`` probes and requires one domain per node (``local_world_size`` ranks each,
    numbered node by node). With several domains, their process groups are created (every rank
    takes part) with ``timeout``.

    Raises UserError (the same on every rank) when the ranks' views do not form domains or do
    not match ``node-local``.
    """
    world = dist.get_world_size() if dist.is_initialized() else 1
    if mode == "shared" or world == 1:
        return single_layout(world)
    domains = _probe(root)
    if mode == "node-local":
        _require_nodes(domains, world, local_world_size)
    if len(domains) == 1:
        return single_layout(world)
    group, _ = dist.new_subgroups_by_enumeration([list(ranks) for ranks in domains], timeout)
    mine = next(i for i, ranks in enumerate(domains) if dist.get_rank() in ranks)
    copies = min(buddy_copies, len(domains) - 1)
    return StorageLayout(domains, mine, copies, group)


def _probe(root: Path) -> tuple[tuple[int, ...], ...]:
    """Each rank writes ``<root>/.storage-probe/<token>/rank-<r>`` and checks which ranks'
    files it sees; the views, gathered, must partition the ranks (``_domains``, the same
    verdict on every rank, given after the probe folder is removed). A rank that cannot write
    its file sees none, which ``_domains`` refuses on every rank."""
    token = str(broadcast_json(uuid.uuid4().hex))
    rank, world = dist.get_rank(), dist.get_world_size()
    folder = root / PROBE_DIR / token
    with contextlib.suppress(OSError):  # reported below as a view without its own file
        folder.mkdir(parents=True, exist_ok=True)
        write_bytes(folder / f"rank-{rank}", b"")
    barrier()
    seen = torch.tensor([(folder / f"rank-{r}").is_file() for r in range(world)], dtype=torch.uint8)
    device = collective_device()
    views = [torch.zeros(world, dtype=torch.uint8, device=device) for _ in range(world)]
    dist.all_gather(views, seen.to(device))
    matrix = [[bool(value) for value in view.tolist()] for view in views]
    (folder / f"rank-{rank}").unlink(missing_ok=True)
    barrier()
    if matrix[rank][rank] and rank == matrix[rank].index(True):  # the first rank seeing it
        shutil.rmtree(folder, ignore_errors=True)
        with contextlib.suppress(OSError):  # another run's probe may be there
            (root / PROBE_DIR).rmdir()
    barrier()
    return _domains(matrix, root)


def _domains(seen: list[list[bool]], root: Path) -> tuple[tuple[int, ...], ...]:
    """The partition that the views ``seen[i][j]`` (rank i sees rank j's probe) describe.

    Raises UserError when a view is not symmetric or not transitive (a file system that shows
    another node's files late or partly)."""
    domains: list[tuple[int, ...]] = []
    for rank, view in enumerate(seen):
        ranks = tuple(other for other, sees in enumerate(view) if sees)
        consistent = rank in ranks and all(
            [seen[other][o] for o in range(len(seen))] == view for other in ranks
        )
        if not consistent:
            raise UserError(
                f"the ranks disagree on which of them see the same --checkpoint-dir {root} "
                f"(rank {rank} sees the probe files of ranks {list(ranks)}); use a file system "
                "that shows other nodes' files at once, or --checkpoint-storage shared"
            )
        if ranks not in domains:
            domains.append(ranks)
    return tuple(sorted(domains))


def _require_nodes(domains: tuple[tuple[int, ...], ...], world: int, per_node: int) -> None:
    """Raise UserError unless every domain is exactly one node's ranks."""
    nodes = tuple(
        tuple(range(start, min(start + per_node, world))) for start in range(0, world, per_node)
    )
    if domains == nodes:
        return
    raise UserError(
        f"--checkpoint-storage node-local: the folders seen are {[list(d) for d in domains]}, "
        f"not one per node ({[list(n) for n in nodes]}); give each node its own "
        "--checkpoint-dir, or use --checkpoint-storage auto"
    )
