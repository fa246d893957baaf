"""AdamW across fault-tolerant sites: DDP averages the gradients inside each site in backward,
then every step the site means are averaged over the live sites through their torchft Managers
(``SiteLink.average``: the quorum, a sum on torchft's process group, the commit vote) before
clipping and AdamW's step; a step whose exchange is not committed (a site died during it) is
dropped: no update, its micro-batches lost to every site (at most the step in flight).

With one rank per site this is one torchrun job's DDP over the same ranks, bit for bit: DDP
averages ``g_i / W`` summed, this path ``(sum g_i) / W``, and a division by a power of two is
exact (more ranks per site sum in another order: the last bits may differ).

With a ``--compression`` hook (bf16, fp16, dct; dct-topk, whose all-gather of top-k pairs is
sized by the group and divided by the sites taking part; PowerSGD, whose sums are rescaled to
those sites and whose P and Q factors the sites share) the exchange across sites is the
hook's, as hsdp's replicate exchange in one job (``compression.ReplicaExchange`` over torchft's
process group, the mean over the sites taking part); the sites' own collectives stay dense.

A site that starts or restarts joins (``join``) with an exchange of zeros that meets the live
sites' exchange of their next step; a site behind them heals in it from a live one (the trained
parameters, AdamW's moments and step counts, the hook's shared state, the step and the tokens
trained) and then takes that step's update as they do. Source: torchft's Manager (quorum,
``should_commit``, healing), as torchtitan's FT-HSDP uses it per step (``experiments/torchft``).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from contextlib import nullcontext
from typing import cast

import torch
from torch.optim import AdamW

from torchrun_ddp.build import Trainer
from torchrun_ddp.compression import CompressionState, ReplicaExchange, dense_wire_bytes
from torchrun_ddp.parallel.shards import laid_out_like, local_tensor
from torchrun_ddp.sites.link import HealState, SiteLink


class SiteAdamW(AdamW):
    """torch's AdamW whose gradients are averaged over the live sites (``exchange``, after
    backward) and whose step is skipped when that exchange was not committed (module
    docstring). Set ``link`` and ``counts`` before the first step, ``replicas`` for a
    ``--compression`` hook across sites, ``steps`` once the trainer is built."""

    link: SiteLink | None = None
    committed: bool = True
    """Whether the last exchange was committed by every rank of this site."""
    counts: CompressionState | None = None
    """The run's comm-hook state (``Trainer.compression``), which counts this rank's bytes."""
    replicas: ReplicaExchange | None = None
    """The ``--compression`` hook's exchange over the live sites (its state ``counts``), or None:
    dense fp32 sums."""
    _before: Mapping[str, torch.Tensor]
    """The hook's shared state before the last exchange (``_compressed``; empty: none ran)."""
    steps: Callable[[], int] = staticmethod(lambda: 0)
    """The optimizer steps completed (the trainer's ``step``): the hook's step at an exchange."""

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
        mean; under hsdp this rank's shard, which rank ``r`` of every site holds alike; a
        missing one counts as zeros) becomes the mean over the live sites, unless the exchange
        is not committed (``committed`` then False, the gradients not to be used). Dense: fp32
        on the wire, 4 bytes per element of the rank's parameters per step; with ``replicas``:
        the comm hook's payload (``_compressed``). ``contribute`` False (a site's join) sends
        zeros. The bytes sent are counted in ``counts``."""
        link = self.site_link()
        if self.replicas is None:
            self.committed = self._dense(contribute)
        else:
            self._before = {}
            self.committed = link.run(lambda: self._compressed(contribute))
            undo = not self.committed or not (contribute or link.healed)
            if undo and self._before:  # empty: the Manager had errored before it
                self.replicas.state.load_shared_state_dict(self._before)
        if self.committed and contribute:
            link.after_commit()

    def _dense(self, contribute: bool) -> bool:
        """The dense exchange: one fp32 sum over the live sites, divided by the sites summed.
        Returns whether it was committed (the gradients then hold the mean)."""
        params, link = self.trained(), self.site_link()
        locals_ = [local_tensor(param) for param in params]
        sizes = [local.numel() for local in locals_]
        if contribute:
            grads = [
                torch.zeros_like(local) if param.grad is None else local_tensor(param.grad)
                for param, local in zip(params, locals_, strict=True)
            ]
            flat = torch.cat([grad.reshape(-1) for grad in grads]).float()
        else:
            flat = torch.zeros(sum(sizes), device=locals_[0].device)
        committed = link.average(flat)
        if self.counts is not None:
            self.counts.count("all_reduce", flat.numel() * flat.element_size(), link.group)
            self.counts.comm_bytes_dense += dense_wire_bytes(flat.numel(), link.group.size())
        if not committed:
            return False
        flat.div_(max(1, link.participants))
        for param, mean in zip(params, flat.split(sizes), strict=True):
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            local = local_tensor(param.grad)
            local.copy_(mean.view_as(local))
        return True

    def _compressed(self, contribute: bool) -> None:
        """The hook's exchange over the live sites (run by ``SiteLink.run`` after the quorum):
        ``replicas`` with its group the Managers' and its mean over the sites that take part.
        A site that sends zeros (its join, or a heal in this sync) sends them with its error
        feedback set aside (``CompressionState.error_feedback_aside``): its own stays as it
        was, while the state the sites share (PowerSGD's P and Q) moves on as theirs. The shared
        state before the exchange is kept (``_before``): ``exchange`` puts it back after an
        exchange that is not committed, and after a join in which this site did not heal, which
        is one of every site in the quorum (a site that starts later is behind and heals), all
        sending zeros."""
        link, replicas = self.site_link(), self.replicas
        assert replicas is not None and self.counts is not None
        sends = contribute and link.participating
        for param in self.trained():
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            elif not sends:
                param.grad.zero_()
        state = replicas.state
        state.exchange_over(link.group, max(1, link.participants), self.steps())
        state.bf16_transport = "all_reduce"
        self._before = state.shared_state_dict()
        with nullcontext() if sends else state.error_feedback_aside():
            replicas.average()

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
        """``{"parameters": {"<i>": tensor}, "moments": {"<i>": {name: tensor}}}``, and with a
        ``--compression`` hook across sites ``"hook"``: the part of its state the sites share
        (``CompressionState.shared_state_dict``: its step; PowerSGD's P, Q and RNG)."""
        saved = self.optimizer.state_dict()["state"]
        state: dict[str, object] = {
            "parameters": {str(i): p.detach() for i, p in enumerate(self.optimizer.trained())},
            "moments": {str(index): dict(entry) for index, entry in saved.items()},
        }
        if self.optimizer.replicas is not None:
            state["hook"] = self.optimizer.replicas.state.shared_state_dict()
        return state


def adamw_heal_state(trainer: Trainer, optimizer: SiteAdamW) -> HealState:
    """This site's state for a healing peer, taken in an exchange (before the step's update):
    ``SharedAdamW``'s tree (the hook's shared state included), the steps completed, the
    tokens trained over all ranks, and the sites' data positions' copies."""
    return {
        **SharedAdamW(optimizer).state_dict(),
        "step": trainer.step,
        "tokens_seen": trainer.tokens_seen,
        "positions": {str(site): blob for site, blob in optimizer.site_link().book.items()},
    }


def take_adamw_state(trainer: Trainer, optimizer: SiteAdamW, state: HealState) -> None:
    """Load a live peer's ``adamw_heal_state`` (the hook's shared state beside this site's own
    error feedback) and step the schedule on to its step (the update of the step in flight then
    uses the peer's learning rate). Raises ValueError for a state of another model."""
    trained = optimizer.trained()
    params = cast(Mapping[str, torch.Tensor], state["parameters"])
    shapes = [local_tensor(param).shape for param in trained]
    if [params[str(i)].shape for i in range(len(params))] != shapes:
        raise ValueError("a healing peer sent parameters of other shapes (another model)")
    with torch.no_grad():
        for index, param in enumerate(trained):
            local_tensor(param).copy_(params[str(index)])
    moments = cast(Mapping[str, Mapping[str, torch.Tensor]], state["moments"])
    taken = {
        int(index): {name: _laid_out(value, trained[int(index)]) for name, value in entry.items()}
        for index, entry in moments.items()
    }
    own = optimizer.state_dict()["param_groups"]
    optimizer.load_state_dict({"state": taken, "param_groups": own})
    if optimizer.replicas is not None and "hook" in state:
        hook = cast(Mapping[str, torch.Tensor], state["hook"])
        optimizer.replicas.state.load_shared_state_dict(hook)
    take_run_state(trainer, optimizer.site_link(), state, int(cast(int, state["step"])))


def take_run_state(trainer: Trainer, link: SiteLink, state: HealState, step: int) -> None:
    """What every method's heal takes besides its own state: ``step`` as the trainer's step,
    the tokens trained, the sites' data positions' copies (``link.book``), and the schedule
    stepped on to ``step``."""
    trainer.step = step
    trainer.tokens_seen = int(cast(int, state["tokens_seen"]))
    books = cast(Mapping[str, torch.Tensor], state.get("positions", {}))
    link.book = {int(site): blob for site, blob in books.items()}
    with warnings.catch_warnings():  # "scheduler.step() before optimizer.step()": on purpose
        warnings.simplefilter("ignore", UserWarning)
        while trainer.scheduler.last_epoch < step:
            trainer.scheduler.step()


def _laid_out(value: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """A received moment (this rank's shard) laid out as its parameter (a DTensor under
    hsdp); a step count (no dimension) as it came."""
    return value if value.dim() == 0 else laid_out_like(value, param)


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
