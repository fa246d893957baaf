"""The state adapters between the trainer's objects and DCP: the ``Stateful`` protocol,
``ModelAndOptimizer`` (a DDP model and its optimizer keyed by parameter name) and
``ShardedOptimizer`` (ZeRO-1's per-rank optimizer state, loadable at any world size), with the
DCP keys ``sharded/<name>/<parameter>/<key>`` of the sharded state.

Source: the DCP recipe https://docs.pytorch.org/tutorials/recipes/distributed_checkpoint_recipe.html
(state dicts of a DDP model and its optimizer via ``get_state_dict`` / ``set_state_dict``, keys
without ``module.``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol, cast

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.optim import Optimizer


class Stateful(Protocol):
    """Anything with ``state_dict()`` / ``load_state_dict()`` (modules, optimizers, schedulers)."""

    def state_dict(self) -> Mapping[str, object]:
        """Current state: nested dicts, lists, tuples, tensors, numbers, strings, None."""
        ...

    def load_state_dict(self, state_dict: Mapping[str, object], /) -> object:
        """Restore what ``state_dict`` returned."""
        ...


class ModelAndOptimizer:
    """A DDP (or plain) model and its optimizer as one Stateful, keyed by parameter names.

    ``state_dict`` is ``{"model": ..., "optimizer": ...}`` from DCP's ``get_state_dict``: no
    ``module.`` prefix, optimizer state keyed by parameter name instead of position, so it loads
    into a freshly built model and optimizer (``set_state_dict``). A fresh optimizer's moments are
    created by DCP with one zero-learning-rate step, so ``load_checkpoint`` can fill them in place.
    With ``optimizer=None`` only the model is saved (a ZeRO-1 optimizer's shards are per-rank
    state: see ``ShardedOptimizer``). With ``trainable_only`` frozen parameters
    (``requires_grad=False``, e.g. a LoRA base model) are left out (DCP's ``ignore_frozen_params``):
    the caller rebuilds them identically before loading.
    """

    def __init__(
        self, model: nn.Module, optimizer: Optimizer | None, trainable_only: bool = False
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.options = StateDictOptions(
            ignore_frozen_params=trainable_only, strict=not trainable_only
        )

    def state_dict(self) -> dict[str, object]:
        """``{"model": {name: tensor}, "optimizer": {"state": ..., "param_groups": ...}}``."""
        if self.optimizer is None:
            return {"model": get_model_state_dict(self.model, options=self.options)}
        model_state, optimizer_state = get_state_dict(
            self.model, self.optimizer, options=self.options
        )
        return {"model": model_state, "optimizer": optimizer_state}

    def load_state_dict(self, state_dict: Mapping[str, object], /) -> None:
        """Copy a ``state_dict`` result into the model and the optimizer."""
        if self.optimizer is None:
            set_model_state_dict(self.model, state_dict["model"], options=self.options)
            return
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state_dict["model"],
            optim_state_dict=state_dict["optimizer"],
            options=self.options,
        )


class ShardedOptimizer:
    """A ``ZeroRedundancyOptimizer`` (ZeRO-1) as checkpoint state that loads at any world size.

    The AdamW moments and step counts of the parameters a rank owns go through DCP under keys
    named by parameter (``owned_state``: ``{name: {"exp_avg": ..., ...}}``), each rank writing
    its own; at load every rank asks DCP for the parameters it owns under the current partition,
    which may be another world size's (DCP reshards: it reads any subset of the saved keys).
    ``state_dict`` is the JSON rest, the same on every rank: the local AdamW's hyperparameters
    and ZeRO's own ``param_groups`` (the scheduler sets the next step's learning rate there, and
    ZeRO copies it to the local optimizer only when it steps).
    """

    def __init__(
        self, zero: ZeroRedundancyOptimizer, model: nn.Module, owned_in_state: bool = False
    ) -> None:
        self.zero = zero
        inner = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
        self.names = {id(param): name for name, param in inner.named_parameters()}
        self.owned_in_state = owned_in_state

    def _owned(self) -> list[tuple[str, torch.Tensor]]:
        return [
            (self.names[id(param)], param)
            for group in self.zero.optim.param_groups
            for param in group["params"]
        ]

    def owned_names(self) -> list[str]:
        """Names of the parameters whose optimizer state this rank holds."""
        return [name for name, _ in self._owned()]

    def owned_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """``{parameter name: {state key: tensor}}`` of this rank's parameters (AdamW:
        ``exp_avg``, ``exp_avg_sq`` like the parameter, ``step`` a float32 scalar).

        Raises TypeError for a non-tensor value in the optimizer state."""
        out: dict[str, dict[str, torch.Tensor]] = {}
        for name, param in self._owned():
            state = self.zero.optim.state.get(param, {})
            for key, value in state.items():
                if not isinstance(value, torch.Tensor):
                    raise TypeError(f"optimizer state {name}/{key} is not a tensor")
            if state:
                out[name] = dict(state)
        return out

    def load_owned(self, state: Mapping[str, Mapping[str, torch.Tensor]]) -> None:
        """Set the state of this rank's parameters from ``owned_state`` values (any device;
        ``Optimizer.load_state_dict`` moves them to the parameters')."""
        local = self.zero.optim.state_dict()
        by_name = {name: index for index, (name, _) in enumerate(self._owned())}
        local["state"] = {by_name[name]: dict(values) for name, values in state.items()}
        self.zero.optim.load_state_dict(local)

    def state_dict(self) -> dict[str, object]:
        """``{"param_groups": [...], "zero_groups": [...]}``: the local optimizer's and ZeRO's
        groups without their parameters (JSON); with ``owned_in_state`` also ``"owned"``, the
        ``owned_state`` tensors (the shard kept in per-rank files, with several checkpoint
        folders)."""
        local = self.zero.optim.state_dict()["param_groups"]
        inner = [{k: v for k, v in group.items() if k != "params"} for group in local]
        outer = [
            {k: v for k, v in group.items() if k != "params"} for group in self.zero.param_groups
        ]
        state: dict[str, object] = {"param_groups": inner, "zero_groups": outer}
        if self.owned_in_state:
            state["owned"] = self.owned_state()
        return state

    def load_state_dict(self, state_dict: Mapping[str, object], /) -> None:
        """Restore the hyperparameters of ``state_dict`` (from any rank of any world size), and
        with ``owned_in_state`` the shard it holds (this rank's own, same world size)."""
        if self.owned_in_state and "owned" in state_dict:
            self.load_owned(cast(Mapping[str, Mapping[str, torch.Tensor]], state_dict["owned"]))
        inner = cast(list[Mapping[str, object]], state_dict["param_groups"])
        for group, saved_group in zip(self.zero.optim.param_groups, inner, strict=True):
            group.update(saved_group)
        outer = cast(list[Mapping[str, object]], state_dict["zero_groups"])
        for group, saved_group in zip(self.zero.param_groups, outer, strict=True):
            group.update(saved_group)


def model_fingerprint(model: nn.Module) -> dict[str, str]:
    """``{parameter name: "dtype[shape]"}``, DDP's ``module.`` prefix removed; for ``meta``.

    Two models whose fingerprints are equal load each other's checkpoints.
    """
    inner = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    return {
        name: f"{str(param.dtype).removeprefix('torch.')}{list(param.shape)}"
        for name, param in inner.named_parameters()
    }


def _sharded_key(name: str, parameter: str, key: str) -> str:
    """The DCP key of one tensor of ``parameter``'s state in the sharded object ``name``."""
    return f"sharded/{name}/{parameter}/{key}"


def sharded_tensors(sharded: Mapping[str, ShardedOptimizer]) -> dict[str, torch.Tensor]:
    """Every ``owned_state`` tensor of ``sharded`` under its DCP key."""
    return {
        _sharded_key(name, parameter, key): tensor
        for name, obj in sharded.items()
        for parameter, values in obj.owned_state().items()
        for key, tensor in values.items()
    }


def sharded_template(
    reader: dcp.HuggingFaceStorageReader, sharded: Mapping[str, ShardedOptimizer]
) -> dict[str, torch.Tensor]:
    """Empty CPU tensors, shaped as saved, for the saved state of the parameters that
    ``sharded`` own now (parameters without saved state are left out)."""
    if not sharded:
        return {}
    saved = reader.read_metadata().state_dict_metadata
    template: dict[str, torch.Tensor] = {}
    for name, obj in sharded.items():
        for parameter in obj.owned_names():
            prefix = _sharded_key(name, parameter, "")
            for key, item in saved.items():
                if key.startswith(prefix) and "/" not in key[len(prefix) :]:
                    template[key] = torch.empty(tuple(item.size), dtype=item.properties.dtype)
    return template


def load_sharded(
    sharded: Mapping[str, ShardedOptimizer], tensors: Mapping[str, torch.Tensor]
) -> None:
    """Hand each ``sharded`` object its loaded tensors as ``{parameter: {key: tensor}}``."""
    for name, obj in sharded.items():
        state: dict[str, dict[str, torch.Tensor]] = {}
        for parameter in obj.owned_names():
            prefix = _sharded_key(name, parameter, "")
            for key, tensor in tensors.items():
                if key.startswith(prefix) and "/" not in key[len(prefix) :]:
                    state.setdefault(parameter, {})[key[len(prefix) :]] = tensor
        obj.load_owned(state)
