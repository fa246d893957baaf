"""DiLoCo and SparseLoCo checkpoint state: what is shared by all ranks, what is each rank's.

:class:`SyncedState` and :class:`RankState` wrap a :class:`.local_updates.LocalUpdates`, a
:class:`.diloco.DiLoCo` or a :class:`.sparseloco.SparseLoCo`: the same keys for both, the error
feedback empty but for SparseLoCo and the outer momentum empty without one. Between syncs the
local parameters and the inner AdamW moments differ between ranks, and the moments differ at a
sync too (each rank keeps its own). The project saves model and optimizer as *shared* state
through DCP, which writes one rank's copy of a replicated tensor; that would resume every rank with
one rank's moments and parameters. Two choices were possible: checkpoint only at sync boundaries, or
save per-rank state. Boundaries alone do not suffice: the inner moments are per rank at a boundary
too, and a SIGTERM or ``--checkpoint-every`` falls anywhere in a window (stopping only at a boundary
would lose up to H - 1 steps, or force an early sync that changes the run). So the state is split:

- shared (DCP, written once, loadable at any world size): the synced fp32 parameters, the outer
  momentum (DiLoCo) and the position inside the window;
- per rank (safetensors + JSON): the inner AdamW state, the error feedback (SparseLoCo), and the
  local parameters only when the checkpoint falls inside a window (at a boundary they are the
  synced ones rounded to the parameter dtype, so nothing is written).

An overlapped sync still pending (``--overlap-exchange``) is settled when saved: the checkpoint
waits for its exchange and takes the outer step, so the shared state holds the new synced
parameters and nothing in flight; each rank adds its parameters at the sync's start (for the
rebase still to come) to its own state. The outer step is the same whenever it is taken, so the
resumed run stays bit-exact.

Resume at the same world size is bit-exact anywhere in a window. At another world size the synced
parameters, the outer momentum and the position carry over exactly; each new rank ``r`` takes old
rank ``r mod W_old``'s inner AdamW state (on a sharded model, each new replica an old replica's,
re-split to the new shards: ``methods.local_updates``); the local progress since the last sync
is dropped (every rank restarts from the synced parameters, an outer update still pending
included) and the error feedback is reset, each with a warning.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, cast

import torch

from torchrun_ddp.compression.replicas import local_shard
from torchrun_ddp.optim.local_updates import PendingSync

if TYPE_CHECKING:
    from torchrun_ddp.optim.local_updates import LocalUpdates


def _indexed(tensors: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    return {str(index): tensor for index, tensor in enumerate(tensors)}


class SyncedState:
    """A :class:`LocalUpdates`' replicated state as shared checkpoint state (the same on every
    rank, so DCP writes each tensor once and loads it at any world size).

    ``{"position": int, "synced": {"<i>": fp32 tensor}, "momentum": {"<i>": fp32 tensor}}``, keyed
    by the trained parameter's position (``Optimizer.state_dict``'s numbering); ``momentum`` is
    empty without outer momentum; with eager updates ``"last_mean"`` too (fp32, the mean the
    last outer step applied). ``state_dict`` returns the live tensors, so DCP loads them in
    place; ``load_state_dict`` copies where they are other tensors.
    """

    def __init__(self, optimizer: LocalUpdates) -> None:
        self.optimizer = optimizer

    def _momentum(self) -> list[torch.Tensor]:
        state = self.optimizer.outer.state
        return [state[copy]["momentum_buffer"] for copy in self.optimizer.synced if copy in state]

    def state_dict(self) -> dict[str, object]:
        """The window position, the synced parameters and the outer momentum (after the outer
        step of a pending sync: :meth:`LocalUpdates.settle`, a collective when it waits)."""
        self.optimizer.settle()
        laid_out = self.optimizer.laid_out
        state = {
            "position": self.optimizer.position,
            "synced": _indexed(laid_out(self.optimizer.synced)),
            "momentum": _indexed(laid_out(self._momentum()) if self._momentum() else []),
        }
        if self.optimizer.last_mean:  # eager updates: the mean their estimate starts from
            state["last_mean"] = _indexed(self.optimizer.last_mean)
        return state

    @torch.no_grad()
    def load_state_dict(self, state_dict: Mapping[str, object], /) -> None:
        """Restore what ``state_dict`` returned (any rank's, any world size), bit for bit."""
        self.optimizer.position = int(cast(int, state_dict["position"]))
        _copy_into(self.optimizer.synced, state_dict["synced"])
        _copy_into(self._momentum(), state_dict["momentum"])
        if self.optimizer.last_mean:
            _copy_into(self.optimizer.last_mean, state_dict["last_mean"])


def _laid_out_state(optimizer: LocalUpdates, index: int, values: object) -> dict[str, object]:
    """One parameter's saved inner state with its shard-shaped tensors laid out as the
    parameter (a DTensor on a sharded model; ``step`` and any scalar stay as they are)."""
    state = dict(cast(Mapping[str, object], values))
    local = optimizer.trained[index]
    for key, value in state.items():
        if isinstance(value, torch.Tensor) and value.dim() and value.shape == local.shape:
            state[key] = optimizer.laid_out_one(index, value.to(local.device))
    return state


def _copy_into(targets: list[torch.Tensor], saved: object) -> None:
    """Copy ``saved`` (``{"<i>": tensor}``) into ``targets`` by position; raises ValueError when
    the counts differ (another model or outer momentum setting)."""
    pieces = cast(Mapping[str, torch.Tensor], saved)
    if len(pieces) != len(targets):
        raise ValueError(f"saved state has {len(pieces)} tensors, this run {len(targets)}")
    for index, target in enumerate(targets):
        piece = local_shard(pieces[str(index)])  # DCP loaded a DTensor view of ``target``
        if piece is not target and piece.data_ptr() != target.data_ptr():
            target.copy_(piece)


class RankState:
    """A :class:`LocalUpdates`' per-rank state as per-rank checkpoint state (JSON + tensors,
    nothing pickled): the inner optimizer's ``state_dict`` (parameter positions as string keys),
    the error feedback (SparseLoCo), inside a window the local parameters, and with a sync
    pending this rank's parameters when it started (``sync_start``).

    Load it after :class:`SyncedState` (``load_checkpoint`` restores shared state first): the
    local parameters are the saved ones inside a window, else the synced ones.
    """

    def __init__(self, optimizer: LocalUpdates) -> None:
        self.optimizer = optimizer

    def state_dict(self) -> dict[str, object]:
        """``{"inner": {"state", "param_groups"}, "error_feedback": {...}, "local": {...},
        "share": [...], "sync_start": {...}}``."""
        optimizer = self.optimizer
        optimizer.settle()
        inner = optimizer.inner.state_dict()
        inner["state"] = {
            index: {key: local_shard(value) for key, value in values.items()}
            for index, values in inner["state"].items()
        }  # a sharded model's moments are DTensors: this rank's shards
        trained = [p.detach() for p in optimizer.trained]
        pending = optimizer.pending
        return {
            "inner": {
                "state": {str(index): values for index, values in inner["state"].items()},
                "param_groups": inner["param_groups"],
            },
            "error_feedback": _indexed(optimizer.error),
            "local": _indexed(trained) if optimizer.position or pending else {},
            "share": optimizer.share(),
            "sync_start": _indexed(pending.start) if pending else {},
            "last_own": _indexed(optimizer.last_own),
        }

    @torch.no_grad()
    def load_state_dict(self, state_dict: Mapping[str, object], /) -> None:
        """Restore this rank's own state, bit for bit. Raises ``ValueError`` when the error
        feedback was kept for another share of the tensors (node-aware SparseLoCo under another
        ranks-per-node layout, or another --compression-scope)."""
        saved_share = state_dict.get("share")
        if saved_share is not None and saved_share != self.optimizer.share():
            raise ValueError(
                "the saved SparseLoCo error feedback covers another share of the tensors "
                "(another --compression-scope or ranks per node); resume with the saved layout"
            )
        self.load_inner(state_dict)
        _copy_into(self.optimizer.error, state_dict["error_feedback"])
        _copy_into(self.optimizer.last_own, state_dict.get("last_own", {}))
        local = cast(Mapping[str, torch.Tensor], state_dict["local"])
        _copy_into(self.optimizer.trained, local or _indexed(self.optimizer.synced))
        self._load_pending(cast(Mapping[str, torch.Tensor], state_dict.get("sync_start") or {}))

    def _load_pending(self, start: Mapping[str, torch.Tensor]) -> None:
        """The settled sync whose rebase is still to come (the shared state holds its outer
        step); raises ``ValueError`` when the run has no sync delay to apply it with."""
        optimizer = self.optimizer
        optimizer.pending = None
        if not start:
            return
        if not optimizer.settings.sync_delay:
            raise ValueError(
                "the checkpoint holds a DiLoCo/SparseLoCo sync in flight (--overlap-exchange); "
                "resume with --overlap-exchange"
            )
        device = optimizer.trained[0].device  # checkpoint tensors load on the CPU
        copies = [start[str(index)].to(device, copy=True) for index in range(len(start))]
        optimizer.pending = PendingSync(copies, stepped=True)

    @torch.no_grad()
    def load_resharded(self, state_dict: Mapping[str, object]) -> list[str]:
        """Continue at another world size from one old rank's state: its inner optimizer state;
        the local parameters restart from the synced ones and the error feedback from zero.
        Returns what was dropped, one line each, for the caller to log as warnings."""
        optimizer = self.optimizer
        self.load_inner(state_dict)
        dropped = []
        if optimizer.position:
            dropped.append(
                f"the {optimizer.position} local steps since the last sync started (every rank "
                "restarts from the synced parameters, a pending outer update applied)"
            )
        optimizer.pending = None
        if optimizer.error:
            dropped.append("the SparseLoCo error feedback (reset to zero)")
            for error in optimizer.error:
                error.zero_()
        if optimizer.last_own:
            dropped.append("this rank's last part of the mean (eager updates; reset to zero)")
        _copy_into(optimizer.trained, _indexed(optimizer.synced))
        return dropped

    def load_inner(self, state_dict: Mapping[str, object]) -> None:
        """Load the inner optimizer's state; the wrapper then shares the new parameter groups
        (``Optimizer.load_state_dict`` replaces the group dicts)."""
        optimizer = self.optimizer
        inner = cast(Mapping[str, object], state_dict["inner"])
        states = cast(Mapping[str, object], inner["state"])
        optimizer.inner.load_state_dict(
            {
                "state": {
                    int(index): _laid_out_state(optimizer, int(index), values)
                    for index, values in states.items()
                },
                "param_groups": inner["param_groups"],
            }
        )
        optimizer.param_groups = optimizer.inner.param_groups
