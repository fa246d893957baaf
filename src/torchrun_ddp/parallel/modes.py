"""The data-parallel modes by ``--data-parallel`` value (:data:`MODES`), and the one object a
run builds from its config (:func:`mode_for`)."""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import TYPE_CHECKING

import torch
from torch.nn.parallel import DistributedDataParallel

from torchrun_ddp.config_fields import register_note
from torchrun_ddp.errors import UserError
from torchrun_ddp.parallel.base import DataParallel, MeshShape
from torchrun_ddp.parallel.ddp import DDP
from torchrun_ddp.parallel.fsdp import FSDP, HSDP
from torchrun_ddp.parallel.sharding import gradient_sync_off as fsdp_sync_off
from torchrun_ddp.parallel.shards import full_tensor

if TYPE_CHECKING:
    from torchrun_ddp.config import TrainConfig

MODES: dict[str, type[DataParallel]] = {DDP.name: DDP, FSDP.name: FSDP, HSDP.name: HSDP}
"""``--data-parallel`` value -> its mode class."""


def mode_class(name: str) -> type[DataParallel]:
    """The mode class of ``--data-parallel name``; raises UserError for an unknown name."""
    mode = MODES.get(name)
    if mode is None:
        raise UserError(f"unknown --data-parallel {name!r}; use one of {', '.join(MODES)}")
    return mode


def mode_for(config: TrainConfig, world_size: int, ranks_per_node: int) -> DataParallel:
    """The mode ``config`` chooses, for ``world_size`` ranks of which ``ranks_per_node`` share
    a node (a plan passes --plan-gpus-per-node); raises UserError where its mesh does not
    divide the ranks, or holds a setting the mesh refuses (``DataParallel.check_mesh``; a dry
    run checks the planned mesh instead, ``dry_run.dry_run``)."""
    mode = mode_class(config.data_parallel)(world_size, ranks_per_node, config.shard_degree)
    if not config.dry_run:
        mode.check_mesh(config)
    return mode


def mesh_shape(
    data_parallel: str, world_size: int, local_world_size: int, shard_degree: int = 0
) -> MeshShape:
    """The mesh of ``--data-parallel data_parallel`` on ``world_size`` ranks
    (``DataParallel.mesh_shape``): ddp ``(world, 1)``, fsdp ``(1, world)``, hsdp ``(world / S,
    S)`` with S = ``shard_degree`` or ``local_world_size``. Raises UserError where S does not
    divide the world size."""
    return mode_class(data_parallel).mesh_shape(world_size, local_world_size, shard_degree)


def check_modes(config: TrainConfig, given: frozenset[str] = frozenset()) -> None:
    """The chosen mode's flag checks, and a mode's own flag (``DataParallel.flags``, e.g.
    --shard-degree) given under another mode. Raises UserError, one line naming the flag."""
    mode = mode_class(config.data_parallel)
    for other in MODES.values():
        for flag in other.flags:
            if getattr(config, flag) and flag not in mode.flags:
                raise UserError(
                    f"--{flag.replace('_', '-')} applies to --data-parallel {other.name} only, "
                    f"not {mode.name}"
                )
    mode.check_config(config, given)
    if config.fault_tolerance == "sites" and not mode.across_sites:
        raise UserError(
            f"--fault-tolerance sites runs --data-parallel ddp or hsdp inside each site, not "
            f"{mode.name}; use --data-parallel hsdp with --shard-degree of the site's ranks "
            "to shard over the whole site"
        )


def refusal_notes() -> dict[str, str]:
    """Config field -> the sentence ``--help`` adds to it: the modes that refuse it and which
    of its values (``DataParallel.refusals``; a mode's own ``flags`` under the others), e.g.
    ``Refused under --data-parallel fsdp, hsdp (true).``"""
    refused: dict[str, dict[str, list[str]]] = {}
    for mode in MODES.values():
        for refusal in mode.refusals:
            when = " with one replica" if refusal.one_replica else ""
            values = refused.setdefault(refusal.field, {})
            values.setdefault(refusal.values, []).append(mode.name + when)
        for other in MODES.values():
            for flag in (flag for flag in other.flags if flag not in mode.flags):
                refused.setdefault(flag, {}).setdefault("other than 0", []).append(mode.name)
    return {
        field: "Refused under --data-parallel "
        + "; ".join(f"{', '.join(modes)} ({values})" for values, modes in by_values.items())
        + "."
        for field, by_values in refused.items()
    }


for _field, _note in refusal_notes().items():
    register_note(_field, _note)


def gradient_sync_off(model: torch.nn.Module) -> AbstractContextManager[None]:
    """Backward inside runs without the gradient exchange of whichever mode wrapped ``model``:
    DDP's ``no_sync``, FSDP's ``set_requires_gradient_sync(False)``, nothing for a plain
    module (``forward_backward``'s default when no mode is given)."""
    if isinstance(model, DistributedDataParallel):
        return model.no_sync()
    return fsdp_sync_off(model)


def clip_grad_norm(model: torch.nn.Module, max_norm: float) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` over ``model``'s parameters; returns the global L2 norm
    before clipping as a plain scalar tensor: on FSDP's DTensor gradients torch computes each
    shard's norm and all-reduces them (one small collective per step), and the DTensor result
    is made local (replicated on every rank)."""
    return full_tensor(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm))
