"""One rank's link to the other sites: a torchft ``Manager`` over a torchft ``ProcessGroupGloo``
that the lighthouse's quorum reconfigures to the live sites, healing through ``HealTransport``.

The Manager of rank ``r`` of site ``s`` meets rank ``r`` of every other live site (torchft's
replica groups: a site is one, its ranks the group's ranks). The site's store for its Managers,
new in each attempt (``attempt_store``: hosted by its rank 0 on ``--site-store-port``, else a
free port, at ``--site-address``, else MASTER_ADDR), is advertised to the lighthouse for the
cross-site process group; the Manager's server advertises ``--site-address`` (else the host
name) on TORCHFT_MANAGER_PORT (else a free port).

A sync (``average``) takes a quorum, sums a tensor over the live sites and votes whether to
commit (torchft's ``should_commit``: False when a collective of this sync failed, for instance a
site died during it). A site whose step is behind the quorum's (one that restarted) receives a
live site's state, takes it once the quorum is in and before the sync's exchange
(``_take_now``), and contributes zeros to that sync.

At the start, a site's vote on its join is no while the quorum holds fewer than ``--sites``
sites and a member still waits for them (``--site-start-wait-s``), or while another site
resumed a newer step (``_holds_start``): the join is then not committed, no step is counted,
and the site joins again (``sites.join.join_sites``). So sites started minutes apart begin
together at their first step, as one torchrun job of all their ranks would, instead of the
first training alone and the others healing into its run; and a site that resumed an older
checkpoint heals from the newest instead of training on beside it.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp, TCPStore
from torch.distributed.distributed_c10d import AllreduceOptions
from torchft.manager import Manager
from torchft.process_group import ProcessGroupGloo

from torchrun_ddp.checkpoint.heal import HealTransport
from torchrun_ddp.checkpoint.ranks import collective_device
from torchrun_ddp.faults import perturbation
from torchrun_ddp.sites.check import HealCheck
from torchrun_ddp.sites.positions import PendingBlobs, peek
from torchrun_ddp.sites.settings import SiteSettings

log = logging.getLogger("torchrun_ddp")

HealState = dict[str, object]
"""What a live site sends a healing one: a tree of tensors and JSON values (``heal.encode``)."""


class SiteLink:
    """This rank's torchft Manager for ``settings``' site (module docstring); ``rank`` and
    ``world_size``: the rank's place in its site (torchrun's RANK and WORLD_SIZE).

    Call ``register`` (what to send and how to take a peer's state) before the first sync
    (``average``: DiLoCo's sum; ``gather``: SparseLoCo's messages). ``healed`` is True once
    this rank took a peer's state; ``participants`` is the number of sites whose values the
    last sync summed or gathered; ``site``: this site's index."""

    def __init__(self, settings: SiteSettings, rank: int, world_size: int) -> None:
        timeout = timedelta(seconds=settings.timeout_s)
        self.group = ProcessGroupGloo(timeout=timeout)
        self.transport = HealTransport(self.group, timeout)
        self.healed = False
        self.participating = True
        """Whether this site takes part in the current sync (False while it heals in it: it
        sends zeros, or a message marked as not taking part)."""
        self.participants = 0
        self._started = False
        self._send: Callable[[], HealState] = dict
        self._take: Callable[[HealState], None] = lambda state: None
        self.after_commit: Callable[[], None] = lambda: None
        """Called after every committed sync but a site's join (``sites.sync``)."""
        self.share: Callable[[str], torch.Tensor] = lambda digest: torch.zeros(0, dtype=torch.uint8)
        """This rank's packed data position, with the given digest, to share at a sync
        (``positions.pack``; empty: none, as in a site's join)."""
        self.shared = torch.zeros(0, dtype=torch.uint8)
        """What this rank shared at the last sync (``share``'s blob): after a commit, its record
        on disk (``positions.write_position``)."""
        self.check = HealCheck(settings.site_id)
        self.site = settings.site_id
        self.book: dict[int, torch.Tensor] = {}
        """Site -> its rank's packed data position at its last committed sync (``positions``:
        the copy on the peers)."""
        self.timeout = timeout
        self.sites = settings.sites
        self.start_wait_s = settings.start_wait_s
        self.joining = False
        """Whether the site is in its join at the start (``begin_start`` .. ``end_start``)."""
        self.start_by = 0.0
        """Until when (``time.monotonic``) this rank waits for missing sites in its join; 0:
        it does not (no wait, or the wait is over)."""
        self.resumed = 0
        """The step this site resumed (0: a new run), compared in an all-joining quorum."""
        self.committed = False
        """Whether the site committed the last sync (every rank of it alike)."""
        self._waited_log = 0.0
        self._started_short = False
        self._voted_no = False
        self._no_quorum = (
            f"sites: no quorum within --quorum-timeout-s {settings.quorum_timeout_s} s: the "
            f"lighthouse ({settings.lighthouse or 'TORCHFT_LIGHTHOUSE'}) was down longer than "
            "that, or fewer sites than its --min_replicas are up; this site stops with its "
            "checkpoints kept (torchrun restarts it where MAX_RESTARTS allows: it resumes them "
            "and joins once the lighthouse answers)"
        )
        store = settings.address or os.environ.get("MASTER_ADDR", "127.0.0.1")
        self.store, port = attempt_store(settings.store_port, timeout)
        self.manager = Manager(
            pg=self.group, load_state_dict=self._load, state_dict=self._state,
            min_replica_size=1, use_async_quorum=True, timeout=timeout,
            quorum_timeout=timedelta(seconds=settings.quorum_timeout_s),
            connect_timeout=timeout, rank=rank, world_size=world_size, store_addr=store,
            store_port=port,
            lighthouse_addr=settings.lighthouse or None, replica_id=settings.replica_id,
            hostname=settings.address or socket.gethostname(),
            heartbeat_interval=timedelta(milliseconds=settings.heartbeat_ms),
            checkpoint_transport=self.transport, init_sync=False,
            quorum_retries=settings.quorum_retries,
        )  # fmt: skip

    def register(self, send: Callable[[], HealState], take: Callable[[HealState], None]) -> None:
        """``send``: this site's state for a healing peer (called in torchft's quorum thread
        while this rank waits for the quorum); ``take``: load a live peer's state (called once
        the quorum is in, before the sync's exchange: ``_take_now``)."""
        self._send, self._take = send, take

    def _state(self) -> HealState:
        self.check.mark(took=False)
        return self._send()

    def _load(self, state: HealState) -> None:
        self._take(state)
        self.healed = True
        self.check.mark(took=True)
        log.info(
            "sites: healed from a live site at sync %d: %.2f MiB in %.3f s",
            self.manager.current_step(), self.transport.last.bytes / 2**20,
            self.transport.last.seconds,
        )  # fmt: skip

    def average(self, tensor: torch.Tensor) -> bool:
        """Collective over the live sites: take the quorum, sum ``tensor`` in place over them
        (zeros from a site that heals in this sync) and vote. Returns whether every rank of this
        site commits the sync; ``participants`` is the sites summed. Raises RuntimeError when
        the quorum cannot be formed within the quorum timeout (the lighthouse unreachable past
        its retries)."""
        options = AllreduceOptions()
        options.reduceOp = ReduceOp.SUM

        def exchange() -> None:
            if not self.participating:
                tensor.zero_()
            self.group.allreduce([tensor], options).wait(self.timeout)

        return self.run(exchange)

    def run(self, exchange: Callable[[], None]) -> bool:
        """Collective over the live sites: take the quorum, set ``participants``, run
        ``exchange`` (its collectives on ``group``, every live site's rank alike; a site that
        heals in this sync, ``participating`` False, must send zeros) and vote. An
        error in the exchange (gloo's, for a site lost during it) is reported to the Manager,
        so the vote drops the sync. Returns whether every rank of this site commits it. Raises
        RuntimeError as ``average``."""
        self._quorum()
        self.participants = self.manager.num_participants()
        shares = self._start_share()
        if self.manager.errored() is None:
            try:
                exchange()
            except RuntimeError as exc:
                self.manager.report_error(exc)
        return self._vote(shares)

    def gather(self, blob: Callable[[bool], torch.Tensor]) -> tuple[bool, list[torch.Tensor]]:
        """Collective over the live sites: take the quorum, all-gather ``blob(participating)``
        (uint8, any length; ``participating``: False while this site heals in this sync) from
        the same rank of every live site, in the group's order, and vote. Returns whether every
        rank of this site commits the sync, and the blobs (empty after an error). Raises
        RuntimeError as ``average``."""
        self._quorum()
        shares = self._start_share()
        mine = blob(self.participating)
        blobs = self._all_gather(mine)
        self.participants = len(blobs)
        return self._vote(shares), blobs

    def start_quorum(self) -> None:
        """Start the next sync's quorum without waiting for it (torchft's async quorum), so that
        it overlaps the step's forward and backward; the sync (``average``, ``gather``) then
        waits for it. Call it only before a sync that follows."""
        if not self._started:
            self.manager.start_quorum()
            self._started = True

    def _quorum(self) -> None:
        """Start the quorum unless ``start_quorum`` did, and wait for it (a heal's transfer
        included)."""
        if not self._started:
            self.manager.start_quorum()
        self._started = False
        try:
            self.manager.wait_quorum()
        except TimeoutError as exc:
            raise RuntimeError(self._no_quorum) from exc
        self.participating = self.manager.is_participating()
        self._take_now()

    def _take_now(self) -> None:
        """A healing site's received state, taken once the quorum is in, before the sync's
        exchange: torchft (0.2.0) takes it in ``should_commit``, after the exchange, and a site
        that runs the exchange at its own old step (PowerSGD's compression starts at a step) or
        with its own shared state (PowerSGD's P and Q) would not run the live sites' exchange.
        Through the Manager's own method for it (private in torchft 0.2, pinned below 0.3).
        ``participating`` was read before, and stays False after: with ``init_sync=False`` a
        site heals only when its step is behind the quorum's, and then torchft gives it no
        participating rank, so its Manager's all-reduce still sends zeros. should_commit's wait
        for a recovery stream is not needed first: ``HealTransport`` receives into CPU tensors
        before the quorum returns."""
        manager = self.manager
        if manager._healing:  # torchft's flag: a heal received, not yet taken
            manager._apply_pending_state_dict()
            manager._healing = False  # taken: should_commit must not take it again

    def _start_share(self) -> PendingBlobs | None:
        """Start the all-gather of this rank's data position (``share``, with the replica
        check's digest when one is due: ``HealCheck``) with the live sites, once the quorum is
        in, so that it runs beside the sync's exchange instead of after it."""
        self.shared = self.share(self.check.due())
        return self._start_gather(self.shared)

    def _start_gather(self, blob: torch.Tensor) -> PendingBlobs | None:
        """Start an all-gather of ``blob`` on the Managers' group; None after an error in this
        sync, which is reported to the Manager (the vote then drops the sync)."""
        if self.manager.errored() is not None:
            return None
        try:
            return PendingBlobs(self.group, blob, self.timeout)
        except RuntimeError as exc:
            self.manager.report_error(exc)
            return None

    def _finish_gather(self, pending: PendingBlobs | None) -> list[torch.Tensor]:
        """Every live site's blob of ``_start_gather``'s all-gather; [] after an error in this
        sync (reported to the Manager)."""
        if pending is None or self.manager.errored() is not None:
            return []
        try:
            return pending.wait()
        except RuntimeError as exc:  # gloo's error for a site lost during the sync
            self.manager.report_error(exc)
            return []

    def _vote(self, shares: PendingBlobs | None) -> bool:
        """Take the data positions (``_start_share``), vote (no on a join held for the other
        sites: ``_holds_start``), and on a commit file the sites' positions in the book; the
        replica check after a heal (``HealCheck``)."""
        gathered = self._finish_gather(shares)
        if self._holds_start(len(gathered)):
            self.manager.report_error(RuntimeError("sites: waiting for the others to start"))
        if not self._voted_no and perturbation("vote-no") == self.manager.current_step():
            self._voted_no = True  # tests only (TORCHRUN_DDP_PERTURB): a failed sync
            self.manager.report_error(RuntimeError("sites: the test hook vote-no"))
        committed = self.committed = self.manager.should_commit()
        shared = [peek(blob) for blob in filter(torch.Tensor.numel, gathered)]
        if committed:
            for entry, blob in zip(shared, filter(torch.Tensor.numel, gathered), strict=True):
                self.book[entry.site] = blob
        elif not self.joining:
            log.warning(
                "sites: sync %d not committed (a site failed during it): its update is "
                "dropped, the local progress kept for the next sync",
                self.manager.current_step(),
            )
        self.check.settle(shared if committed else None)
        return committed

    def begin_start(self, step: int) -> None:
        """The site's join begins: it resumed ``step`` (0: a new run), and waits for missing
        sites until ``--site-start-wait-s`` from now (``_holds_start``)."""
        self.joining, self.resumed = True, step
        self.start_by = time.monotonic() + self.start_wait_s if self.start_wait_s else 0.0

    def end_start(self) -> None:
        """The join is over: no later sync is held."""
        self.joining, self.start_by = False, 0.0

    def _holds_start(self, members: int) -> bool:
        """Collective over the quorum's ``members`` sites when every one of them is in its join
        (the quorum's step is 0: none has committed a sync, so none trains; a site joining a
        run under way heals instead): each shares the step it resumed and whether it waits
        for missing sites, and this rank votes no where ``start_held`` says so. Every member
        decides from the same table, so the sites of one quorum commit or hold alike."""
        manager = self.manager
        if not self.joining or self.healed or manager.errored() is not None:
            return False
        if manager.current_step() != 0:
            return False
        now = time.monotonic()
        wants = members < self.sites and now < self.start_by
        mine = torch.tensor([self.resumed, int(wants)], dtype=torch.int64)
        rows = [row.view(torch.int64).tolist() for row in self._all_gather(mine.view(torch.uint8))]
        table = [(step, bool(waits)) for step, waits in rows]
        if not table:
            return False  # an error: the vote drops this join anyway
        held = start_held(self.resumed, table, members, self.sites)
        self._log_start(held, members, max(step for step, _ in table), now)
        return held

    def _log_start(self, held: bool, members: int, newest: int, now: float) -> None:
        """The wait's log lines: every 10 s while held, once when starting short of sites."""
        if held and now >= self._waited_log:
            self._waited_log = now + 10
            if self.resumed < newest:
                log.info(
                    "sites: this site resumed step %d and another site step %d: waiting for "
                    "that site to start, then healing from it", self.resumed, newest,
                )  # fmt: skip
                return
            log.info(
                "sites: %d of %d sites in the quorum, waiting up to %.0f s more for the others "
                "before the first step (--site-start-wait-s)",
                members, self.sites, max(0.0, self.start_by - now),
            )  # fmt: skip
        if not held and members < self.sites and not self._started_short:
            self._started_short = True
            log.warning(
                "sites: starting with %d of %d sites after --site-start-wait-s; the others heal "
                "in when they come", members, self.sites,
            )  # fmt: skip

    def _all_gather(self, blob: torch.Tensor) -> list[torch.Tensor]:
        """Every live site's ``blob`` by an all-gather on the Managers' group, waited for; []
        after an error in this sync (``_start_gather``)."""
        return self._finish_gather(self._start_gather(blob))

    def close(self) -> None:
        """Stop the Manager's server and threads (the lighthouse then times this site out)."""
        self.manager.shutdown(wait=False)


def start_held(mine: int, table: list[tuple[int, bool]], members: int, sites: int) -> bool:
    """Whether a site's join is held at the start, from its quorum's ``table``: each member's
    resumed step and whether it waits for missing sites (the ``members`` in the quorum are fewer
    than the run's ``sites``, and its wait has not passed). Held where this site resumed an older
    step (``mine``) than another (the newest starts, and this one then heals from it: the newest
    state wins), or where sites are missing and a member still waits for them."""
    newest = max(step for step, _ in table)
    return mine < newest or (members < sites and any(wants for _, wants in table))


def attempt_store(port: int, timeout: timedelta) -> tuple[TCPStore | None, int]:
    """Collective over the site's ranks (the default group): a store for their torchft
    Managers that no earlier attempt of the site used, and its port. Rank 0 hosts it on
    ``port`` (0: a free one; the old attempt's store died with its process) and broadcasts the
    port; the others get ``(None, port)``. torchft's Managers file rank 0's server address in
    the store they are given under a fixed key; in torchrun's store, which outlives a restart,
    a rank of a restarted site could read the dead attempt's address before rank 0 files the
    new one, and fail to connect."""
    server = None
    found = torch.zeros(1, dtype=torch.int64, device=collective_device())
    if dist.get_rank() == 0:
        server = TCPStore("0.0.0.0", port, is_master=True, wait_for_workers=False, timeout=timeout)
        found.fill_(server.port)
    dist.broadcast(found, src=0)
    return server, int(found.item())
