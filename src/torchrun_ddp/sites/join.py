"""A site's start among the live sites, and what it sends a site that heals from it (the
methods that sync every few steps; AdamW's exchange every step: ``sites.adamw``).

``join_sites`` runs before the first step of a ``--fault-tolerance sites`` run: it tells the
site's ``SiteLink`` what to send a healing peer (``heal_state``) and how to take a peer's state
(``take_heal_state``), then joins (``SiteSync.join``; at the start, again until every site is
in the quorum or ``--site-start-wait-s`` has passed). What a healing site takes: the synced
parameters and the outer momentum (``SyncedState``), the step and the tokens trained; the
learning-rate schedule is stepped on to that step. Its inner optimizer state stays its own (its
checkpoint's, or the start's), and its data position is its own at its last committed sync
(``positions``).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import cast

from torchrun_ddp.build import Trainer
from torchrun_ddp.checkpoint.replicas import state_digest
from torchrun_ddp.inputs import checkpoint_root
from torchrun_ddp.optim import SyncedState
from torchrun_ddp.sites.adamw import (
    SharedAdamW,
    SiteAdamW,
    adamw_heal_state,
    join_adamw,
    take_adamw_state,
    take_run_state,
)
from torchrun_ddp.sites.demo import (
    SharedDeMo,
    SiteDeMo,
    demo_heal_state,
    join_demo,
    take_demo_state,
)
from torchrun_ddp.sites.link import HealState
from torchrun_ddp.sites.positions import pack, read_position, unpack, write_position
from torchrun_ddp.sites.sync import SiteSync

log = logging.getLogger("torchrun_ddp")

START_POLL_S = 0.5
"""Seconds between two joins of a site that waits for the others at the start."""


SiteOptimizer = SiteSync | SiteAdamW | SiteDeMo
"""A run's optimizer across sites: a sync every few steps, or AdamW's or DeMo's exchange every
step."""


def site_optimizer(trainer: Trainer) -> SiteOptimizer | None:
    """The run's optimizer across sites under ``--fault-tolerance sites``, else None."""
    optimizer = trainer.optimizer
    return optimizer if isinstance(optimizer, (SiteSync, SiteAdamW, SiteDeMo)) else None


def heal_state(trainer: Trainer, optimizer: SiteSync, in_step: bool) -> HealState:
    """This site's state for a healing peer, taken at a sync: the synced parameters and outer
    momentum (fp32, the parameters' shapes), the step the sync completes (``in_step``: the sync
    runs inside an optimizer step, which counts) and the tokens trained over all ranks."""
    assert optimizer.link is not None
    return {
        "outer": SyncedState(optimizer).state_dict(),
        "step": trainer.step + int(in_step),
        "tokens_seen": trainer.tokens_seen,
        "positions": {str(site): blob for site, blob in optimizer.link.book.items()},
    }


def take_heal_state(trainer: Trainer, optimizer: SiteSync, state: HealState, in_step: bool) -> None:
    """Load a live peer's ``heal_state``: the outer state, the step, the tokens trained, and
    the schedule stepped on to the step (``in_step``: the sync runs inside an optimizer step,
    which the loop then counts and schedules). Raises ValueError for a state of another
    model."""
    SyncedState(optimizer).load_state_dict(cast(Mapping[str, object], state["outer"]))
    step = int(cast(int, state["step"])) - int(in_step)
    take_run_state(trainer, optimizer.site_link(), state, step)


def join_sites(trainer: Trainer) -> None:
    """Collective over the live sites under ``--fault-tolerance sites`` (nothing otherwise):
    register this site's healing state and its data position's record after each committed
    sync (``positions``), and join (``SiteSync.join``), again while the join is held for the
    other sites at the start (``--site-start-wait-s``: ``SiteLink._holds_start``). A site that
    healed goes on from its own data position at its last committed sync
    (``take_own_position``)."""
    optimizer = site_optimizer(trainer)
    if optimizer is None or optimizer.link is None:
        return
    link, root, rank = optimizer.link, checkpoint_root(trainer.config), trainer.env.rank
    join = _register(trainer, optimizer)
    link.after_commit = lambda: write_position(root, rank, link.shared)
    link.begin_start(trainer.step)
    healed = join()
    for _ in range(start_rounds(trainer.config.site_start_wait_s)):
        if link.committed or link.healed:  # the same on every rank of the site
            break
        time.sleep(START_POLL_S)  # the join held (SiteLink._holds_start)
        healed = join()
    link.end_start()
    if healed:
        log.info("sites: healed, training on from step %d", trainer.step)
        take_own_position(trainer, root)
    site = trainer.config.site_id
    link.share = lambda digest: pack(site, trainer.step + 1, trainer.data.state_dict(), digest)


def start_rounds(wait_s: int) -> int:
    """The most joins a site runs again at the start: each after ``START_POLL_S``, so a rank's
    wait of ``wait_s`` seconds for the other sites is over before the last, with 10 to spare
    (the ranks' clocks start a moment apart; a site held because it resumed an older step heals
    in the next, once the newest has begun). A count, not a clock, so that every rank of a site
    runs as many joins."""
    return math.ceil(wait_s / START_POLL_S) + 10


def _register(trainer: Trainer, optimizer: SiteOptimizer) -> Callable[[], bool]:
    """Tell ``optimizer``'s link what to send a healing peer, how to take a peer's state and
    what to fingerprint after a heal; returns the optimizer's join. While the join is under way
    (``SiteLink.joining``) a local-update method's sync is not inside an optimizer step; after
    it, one is (and counts that step)."""
    link = optimizer.site_link()
    if isinstance(optimizer, SiteAdamW):
        link.register(
            lambda: adamw_heal_state(trainer, optimizer),
            lambda state: take_adamw_state(trainer, optimizer, state),
        )
        link.check.fingerprint = lambda: state_digest({"adamw": SharedAdamW(optimizer)})
        optimizer.steps = lambda: trainer.step
        return lambda: join_adamw(trainer, optimizer)
    if isinstance(optimizer, SiteDeMo):
        link.register(
            lambda: demo_heal_state(trainer, optimizer),
            lambda state: take_demo_state(trainer, optimizer, state),
        )
        link.check.fingerprint = lambda: state_digest({"demo": SharedDeMo(optimizer)})
        return lambda: join_demo(trainer, optimizer)
    link.register(
        lambda: heal_state(trainer, optimizer, not link.joining),
        lambda state: take_heal_state(trainer, optimizer, state, not link.joining),
    )
    link.check.fingerprint = lambda: state_digest({"outer": SyncedState(optimizer)})
    return optimizer.join


def take_own_position(trainer: Trainer, root: Path) -> None:
    """After a heal: this rank's data position at its last committed sync, from its record
    under ``root`` or from the copy a live site sent (``SiteLink.book``), whichever is newer;
    where there is neither (a new disk, and no committed sync of this site while the live site
    was up) the resumed checkpoint's, with a warning."""
    optimizer = site_optimizer(trainer)
    assert optimizer is not None and optimizer.link is not None
    found: list[tuple[int, Mapping[str, object], str]] = []
    if record := read_position(root, trainer.env.rank):
        found.append((*record, "its own disk"))
    blob = optimizer.link.book.get(trainer.config.site_id)
    if blob is not None:
        shared = unpack(blob)
        found.append((shared.step, shared.position, "its copy on a live site"))
    if not found:
        log.warning(
            "sites: no record of this rank's data position at its last committed sync, on its "
            "disk (%s) or on a live site: going on from the resumed checkpoint's (or the "
            "start's)",
            root / "sites",
        )
        return
    step, position, source = max(found, key=lambda entry: entry[0])
    trainer.data.load_state_dict(position)
    log.info("sites: own data position of step %d (its last committed sync), from %s", step, source)


def leave_sites(trainer: Trainer) -> None:
    """Stop this rank's torchft Manager (nothing without sites)."""
    optimizer = site_optimizer(trainer)
    if optimizer is not None and optimizer.link is not None:
        optimizer.link.close()
