"""AdamW across fault-tolerant sites: DDP averages the gradients inside each site in backward,
then every step the site means are averaged over the live sites through their torchft Managers
(``SiteLink.average``: the quorum, a sum on torchft's process group, the commit vote) before
clipping and AdamW's step; a step whose exchange is not committed (a site died during it) is
dropped: no update, its micro-batches lost to every site (at most the step in flight).

With one rank per site this is one torchrun job's DDP over the same ranks, bit for bit: DDP
averages ``g_i / W`` summed, this path ``(sum g_i) / W``, and a division by a power of two is
exact (more ranks per site sum in another order: the last bits may differ).

A site that starts or restarts joins (``join``) with an exchange of zeros that meets the live
sites' exchange of their next step; a site behind them heals in it from a live one (the trained
parameters, AdamW's moments and step counts, the step and the tokens trained) and then takes that
step's update as they do. Source: torchft's Manager (quorum, ``should_commit``, healing), as
torchtitan's FT-HSDP uses it per step (``experiments/torchft``).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import cast

import torch
from torch.optim import AdamW

from torchrun_ddp.build import Trainer
from torchrun_ddp.sites.link import HealState, SiteLink


class SiteAdamW(AdamW):
    """torch's AdamW whose gradients are averaged over the live sites (``exchange``, after
    backward) and whose step is skipped when that exchange was not committed (module
    docstring). Set ``link`` before the first step."""

    link: SiteLink | None = None
    committed: bool = True
    """Whether the last exchange was committed by every rank of this site."""

    def site_link(self) -> SiteLink:
        """The link; raises AssertionError before it is set."""
        assert self.link is not None, "SiteAdamW needs its link before a step"
        return self.link

    def trained(self) -> list[torch.Tensor]:
        """The trained parameters, in the optimizer's order (its state's numbering)."""
        return [param for group in self.param_groups for param in group["params"]]

    @torch.no_grad()
    def exchange(self, contribute: bool = True) -> None:
        """Collective over the live sites: every trained parameter's gradient (this site's
        mean, any dtype; a missing one counts as zeros) becomes the mean over the live sites
        (fp32 on the wire, ``4 x parameters`` bytes per rank and step), unless the exchange is
        not committed (``committed`` then False, the gradients left as they were).
        ``contribute`` False (a site's join) sends zeros."""
        params, link = self.trained(), self.site_link()
        flat = torch.zeros(sum(p.numel() for p in params), device=params[0].device)
        offset = 0
        for param in params:
            if contribute and param.grad is not None:
                flat[offset : offset + param.numel()].copy_(param.grad.reshape(-1))
            offset += param.numel()
        self.committed = link.average(flat)
        if not self.committed:
            return
        if contribute:
            link.after_commit()
        flat.div_(max(1, link.participants))
        offset = 0
        for param in params:
            mean = flat[offset : offset + param.numel()].view_as(param).to(param.dtype)
            param.grad = mean if param.grad is None else param.grad.copy_(mean)
            offset += param.numel()

    def step(self, closure: None = None) -> None:  # type: ignore[override]
        """AdamW's step, skipped when the last exchange was not committed."""
        if self.committed:
            super().step(closure)


class SharedAdamW:
    """A ``SiteAdamW``'s replicated state by string keys, for ``replicas.state_digest``: the
    trained parameters and AdamW's per-parameter state, by the parameter's position."""

    def __init__(self, optimizer: SiteAdamW) -> None:
        self.optimizer = optimizer

    def state_dict(self) -> dict[str, object]:
        """``{"parameters": {"<i>": tensor}, "moments": {"<i>": {name: tensor}}}``."""
        saved = self.optimizer.state_dict()["state"]
        return {
            "parameters": {str(i): p.detach() for i, p in enumerate(self.optimizer.trained())},
            "moments": {str(index): dict(entry) for index, entry in saved.items()},
        }


def adamw_heal_state(trainer: Trainer, optimizer: SiteAdamW) -> HealState:
    """This site's state for a healing peer, taken in an exchange (before the step's update):
    ``SharedAdamW``'s tree, the steps completed, the tokens trained over all ranks, and the
    sites' data positions' copies."""
    return {
        **SharedAdamW(optimizer).state_dict(),
        "step": trainer.step,
        "tokens_seen": trainer.tokens_seen,
        "positions": {str(site): blob for site, blob in optimizer.site_link().book.items()},
    }


def take_adamw_state(trainer: Trainer, optimizer: SiteAdamW, state: HealState) -> None:
    """Load a live peer's ``adamw_heal_state`` and step the schedule on to its step (the
    update of the step in flight then uses the peer's learning rate). Raises ValueError for a
    state of another model."""
    trained = optimizer.trained()
    params = cast(Mapping[str, torch.Tensor], state["parameters"])
    if [params[str(i)].shape for i in range(len(params))] != [p.shape for p in trained]:
        raise ValueError("a healing peer sent parameters of other shapes (another model)")
    with torch.no_grad():
        for index, param in enumerate(trained):
            param.copy_(params[str(index)])
    moments = cast(Mapping[str, Mapping[str, torch.Tensor]], state["moments"])
    own = optimizer.state_dict()["param_groups"]
    optimizer.load_state_dict(
        {
            "state": {int(index): dict(entry) for index, entry in moments.items()},
            "param_groups": own,
        }
    )
    trainer.step = int(cast(int, state["step"]))
    trainer.tokens_seen = int(cast(int, state["tokens_seen"]))
    books = cast(Mapping[str, torch.Tensor], state.get("positions", {}))
    optimizer.site_link().book = {int(site): blob for site, blob in books.items()}
    with warnings.catch_warnings():  # "scheduler.step() before optimizer.step()": on purpose
        warnings.simplefilter("ignore", UserWarning)
        while trainer.scheduler.last_epoch < trainer.step:
            trainer.scheduler.step()


def join_adamw(trainer: Trainer, optimizer: SiteAdamW) -> bool:
    """Collective over the live sites, before this site's first step: an exchange of zeros
    (``SiteAdamW.exchange``). A site that healed in it takes the live sites' update of the
    step in flight as the loop does (clip, AdamW's step, the schedule's) and counts that step.
    Returns whether it healed."""
    link = optimizer.site_link()
    optimizer.exchange(contribute=False)
    if not (link.healed and optimizer.committed):
        optimizer.zero_grad(set_to_none=True)
        return False
    trainer.parallel.clip_grad_norm(trainer.model, trainer.config.max_grad_norm)
    optimizer.step()
    trainer.scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    trainer.step += 1
    trainer.tokens_seen += trainer.window.tokens_per_step
    return True
