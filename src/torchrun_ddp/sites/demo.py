"""DeMo across fault-tolerant sites: the same step as ``optim.demo.DeMo``, its all-gather of
every rank's top-k message taken over the live sites every step (``sites.messages``: in one
torchrun job's rank order, so with every site up the run is that job's, bit for bit).

Each rank's momentum is its own (its site's, never sent or healed). A step whose exchange is not
committed (a site died during it) is dropped: no parameter update, and what this rank's message
took out of its momentum is put back, so the step's gradient stays in the momentum for the next
one (in fp32: the sum may differ from the momentum before in its last bit); so is a message that
the exchange did not use because this site healed in it.

A site that starts or restarts joins (``join_demo``) with a message marked as not taking part,
in the live sites' exchange of their next step; a site behind them heals in it from a live one
(the trained parameters, the step, the tokens trained, the sites' data positions' copies) and
then takes that step's update as they do, decoded from the same messages. Its momentum stays
its checkpoint's (or zeros on a new disk). Source: DeMo (Peng, Quesnelle & Kingma 2024,
arXiv:2411.19870) and torchft's Manager (quorum, ``should_commit``, healing).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import cast

import torch
import torch.distributed as dist

from torchrun_ddp.build import Trainer
from torchrun_ddp.optim.demo import DeMo
from torchrun_ddp.optim.exchange import Counter, InFlight, MessageExchange
from torchrun_ddp.parallel.shards import local_tensor
from torchrun_ddp.sites.adamw import take_run_state
from torchrun_ddp.sites.link import HealState, SiteLink
from torchrun_ddp.sites.messages import gather_messages


class SiteExchange(MessageExchange):
    """DeMo's flat exchange over the live sites (``sites.messages``), blocking: ``start``
    gathers, ``finish`` hands back what it gathered. ``owner``: the optimizer, whose link it
    uses and whose ``committed`` it sets."""

    def __init__(
        self,
        lengths: Sequence[int],
        process_group: dist.ProcessGroup | None,
        counter: Counter | None,
        owner: SiteDeMo,
    ) -> None:
        super().__init__(lengths, process_group, None, counter)
        self.owner = owner
        self.joining = False
        """True for a site's join: its message is marked as not taking part."""

    def start(self, message: torch.Tensor, lrs: list[tuple[float, float]]) -> InFlight:
        """Collective over the live sites: this rank's ``message`` (padded) and every live
        taking-part rank's, gathered; a committed exchange of a step (not a join) records the
        data position (``SiteLink.after_commit``). ``lrs``: the update's rates, taken again
        where this site healed in the exchange (its schedule then at the live sites' step)."""
        payload = message.new_zeros(self.padded)
        payload[: message.numel()] = message
        link = self.owner.site_link()
        committed, rows = gather_messages(
            link, payload, self.process_group, self.joining, self.counter, payload.device
        )
        self.owner.committed = committed
        self.owner.included = link.participating and not self.joining
        if committed and not self.joining:
            link.after_commit()
        if not link.participating:  # healed in it: the live sites' step's rates
            lrs = self.owner.rates()
        return InFlight(payload, None, lrs, [rows.to(payload.device)])

    def finish(self, flight: InFlight) -> list[torch.Tensor]:
        """The gathered messages (``start`` waited for them)."""
        return flight.rows


class SiteDeMo(DeMo):
    """:class:`DeMo` whose all-gather spans the live sites and whose update is dropped when
    that exchange was not committed (module docstring); flat, without ``overlap``. Set ``link``
    before the first step."""

    link: SiteLink | None = None
    committed: bool = True
    """Whether the last exchange was committed by every rank of this site."""
    included: bool = True
    """Whether the last exchange used this rank's message (False in a site's join, or in an
    exchange in which this site heals)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        flat = self.exchange
        self.exchange = SiteExchange(flat.lengths, flat.process_group, flat.counter, self)

    def site_link(self) -> SiteLink:
        """The link; raises AssertionError before it is set."""
        assert self.link is not None, "SiteDeMo needs its link before a step"
        return self.link

    def trained(self) -> list[torch.Tensor]:
        """The trained parameters, in the optimizer's order."""
        return self._trained()

    def _apply(self, flight: InFlight) -> None:
        """DeMo's update from the gathered messages; this rank's own message back into its
        momentum where the exchange did not use it: not committed (no update then), or this
        site healed in it."""
        if not (self.committed and self.included):
            self._unsend(flight.buffer)
        if self.committed and flight.rows[0].numel():
            super()._apply(flight)

    def _unsend(self, payload: torch.Tensor) -> None:
        """Add back to each momentum what ``_compress`` took out for ``payload``."""
        offset = 0
        for param in self._trained():
            codec = self.codecs[param]
            size = self._message_bytes(codec)
            row, offset = payload[offset : offset + size], offset + size
            if not codec.value_count:
                continue
            split = codec.value_count * self.value_dtype.itemsize
            values = row[:split].clone().view(self.value_dtype).float().view(codec.n_tiles, -1)
            positions = row[split:].clone().view(codec.index_dtype).long().view(codec.n_tiles, -1)
            sent = values.new_zeros(codec.n_tiles, codec.tile_numel).scatter_(1, positions, values)
            self.state[param]["delta"].add_(codec.decode(sent))

    def rates(self) -> list[tuple[float, float]]:
        """(learning rate, weight decay) of each trained parameter, as ``DeMo.step`` takes them."""
        return [
            (float(group["lr"]), float(group["weight_decay"]))
            for group in self.param_groups
            for param in group["params"]
            if param.requires_grad
        ]

    @torch.no_grad()
    def join(self) -> bool:
        """Collective over the live sites, before this site's first step: an exchange to which
        it sends a message marked as not taking part. A site that healed in it takes the live
        sites' update of that step (the schedule already at that step). Returns whether it
        healed."""
        exchange = cast(SiteExchange, self.exchange)
        device = local_tensor(self._trained()[0]).device
        exchange.joining = True
        try:
            flight = exchange.start(torch.zeros(0, dtype=torch.uint8, device=device), [])
        finally:
            exchange.joining = False
        if not (self.site_link().healed and self.committed and flight.rows[0].numel()):
            return False
        super()._apply(flight)  # lrs: the live sites' step's, taken after the heal (start)
        return True


def demo_heal_state(trainer: Trainer, optimizer: SiteDeMo) -> HealState:
    """This site's state for a healing peer, taken in an exchange (before the step's update):
    the trained parameters (this rank's shards under hsdp) by position, the steps completed, the
    tokens trained over all ranks and the sites' data positions' copies."""
    return {
        **SharedDeMo(optimizer).state_dict(),
        "step": trainer.step,
        "tokens_seen": trainer.tokens_seen,
        "positions": {str(site): blob for site, blob in optimizer.site_link().book.items()},
    }


class SharedDeMo:
    """A ``SiteDeMo``'s replicated state, the same on every site (its momentum is each rank's
    own): the trained parameters by position, for the heal and ``replicas.state_digest``."""

    def __init__(self, optimizer: SiteDeMo) -> None:
        self.optimizer = optimizer

    def state_dict(self) -> dict[str, object]:
        """``{"parameters": {"<i>": tensor}}`` (this rank's shards under hsdp)."""
        trained = self.optimizer.trained()
        return {"parameters": {str(i): local_tensor(p).detach() for i, p in enumerate(trained)}}


def take_demo_state(trainer: Trainer, optimizer: SiteDeMo, state: HealState) -> None:
    """Load a live peer's ``demo_heal_state`` and step the schedule on to its step. Raises
    ValueError for parameters of other shapes (another model)."""
    trained = optimizer.trained()
    params = cast(Mapping[str, torch.Tensor], state["parameters"])
    if [params[str(i)].shape for i in range(len(params))] != [
        local_tensor(p).shape for p in trained
    ]:
        raise ValueError("a healing peer sent parameters of other shapes (another model)")
    with torch.no_grad():
        for index, param in enumerate(trained):
            local_tensor(param).copy_(params[str(index)])
    take_run_state(trainer, optimizer.site_link(), state, int(cast(int, state["step"])))


def join_demo(trainer: Trainer, optimizer: SiteDeMo) -> bool:
    """Collective over the live sites, before this site's first step (``SiteDeMo.join``). A
    site that healed counts the step whose update it took, as the loop does (the schedule's
    step, the tokens). Returns whether it healed."""
    healed = optimizer.join()
    optimizer.zero_grad(set_to_none=True)
    if not healed:
        return False
    trainer.scheduler.step()
    trainer.step += 1
    trainer.tokens_seen += trainer.window.tokens_per_step
    return True
