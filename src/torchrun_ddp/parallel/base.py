"""What every data-parallel mode answers (:class:`DataParallel`), so that the loop, the
checkpoints, the plan and the methods never ask which mode a run uses.

A mode is one object, built once from the run's config and its ranks (``modes.mode_for``). It
owns the device mesh (the shard degree and the replica groups, from one function that the plan
uses too: :meth:`DataParallel.mesh_shape`), wrapping the model (DDP's buckets and buffers, or
FSDP2's units), the gradient exchange's no-sync, gradient clipping, the full state export, which
checkpoint folders may hold whole replicas, its flag checks, and its rows in the plan (memory and
communication). The three modes: :mod:`.ddp` (every rank a whole replica), :mod:`.fsdp` (``fsdp``
shards over every rank, ``hsdp`` within groups of ``--shard-degree`` ranks, replicated across).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, Protocol

import torch
import torch.distributed as dist

from torchrun_ddp.compression.settings import CompressionSettings
from torchrun_ddp.errors import UserError
from torchrun_ddp.plan.communication import (
    CommEstimate,
    CommSection,
    Topology,
    estimate,
    hook_rows,
    reference_methods,
)

if TYPE_CHECKING:
    from torchrun_ddp.checkpoint import StorageLayout
    from torchrun_ddp.compression import CompressionState
    from torchrun_ddp.config import TrainConfig
    from torchrun_ddp.distributed import DistEnv
    from torchrun_ddp.model import ModelSpec
    from torchrun_ddp.plan.memory import MemoryPlan, PlanRequest


@dataclass(frozen=True)
class MeshShape:
    """The data-parallel ranks as ``replicate`` groups of ``shard`` ranks (world = product;
    ranks numbered shard-fastest, so that a node's ranks share a shard group)."""

    replicate: int
    shard: int


@dataclass(frozen=True)
class Built:
    """What a mode builds: ``model`` (the causal LM: a PeftModel under LoRA, sharded in place by
    FSDP), ``runner`` (what the loop runs: the DDP wrapper, or the sharded model itself) and the
    method's ``compression`` state (its comm hook's, or the sharded exchange's wire bytes)."""

    model: torch.nn.Module
    runner: torch.nn.Module
    compression: CompressionState


class ExchangingRun(Protocol):
    """What a mode needs of the training method while it builds: its comm hook (DDP), and
    whether and how it exchanges a sharded model's shards across replicas (hsdp)."""

    def register_hook(
        self, ddp_model: torch.nn.parallel.DistributedDataParallel, node_groups: object
    ) -> CompressionState:
        """Register the DDP comm hook; its state counts wire bytes."""
        ...

    def exchanges_replicas(self, replicate_dim: bool) -> bool:
        """Whether the method averages a sharded model's shards over the replicas itself, on a
        mesh with (``replicate_dim``) or without a replicate dimension."""
        ...

    def register_sharded(
        self, model: torch.nn.Module, exchange: object, replicate: object
    ) -> CompressionState:
        """The state counting a sharded model's collectives (and the method's own)."""
        ...


@dataclass(frozen=True)
class Refusal:
    """A setting a mode refuses (``DataParallel.refusals``): config field ``field`` where
    ``refuses(config, given)`` holds (``given``: the fields set on the command line or in the
    config file, ``config_io.given_fields``). ``message``: the one line of the UserError, naming
    what to use instead ({mode}: the mode, {value}: the field's value, {replicas} and {shard}:
    the mesh); ``values``: the refused values as ``--help`` names them; ``one_replica``: refused
    only on a mesh of one replica, checked once the ranks are known (``check_mesh``)."""

    field: str
    values: str
    refuses: Callable[[TrainConfig, frozenset[str]], bool]
    message: str
    one_replica: bool = False


class DataParallel:
    """One ``--data-parallel`` mode (subclasses name it in ``name``; ``modes.MODES`` is the
    table) on its mesh: ``world_size`` ranks, ``ranks_per_node`` of them on a node, and
    ``shard_degree`` (--shard-degree; 0: a node) where the mode reads it. The run's other
    settings come with each call that needs them.

    Raises UserError from the constructor when the mesh does not divide the ranks (before any
    process group starts, as the start-up checks build it)."""

    name: ClassVar[str] = ""
    """``--data-parallel``'s value."""
    flags: ClassVar[tuple[str, ...]] = ()
    """Config fields only this mode reads; one given under another mode is refused."""
    refusals: ClassVar[tuple[Refusal, ...]] = ()
    """The settings this mode refuses (``check_config``, ``check_mesh``); ``--help`` names the
    modes that refuse each (``modes.refusal_notes``)."""
    accepts_exchanging_methods: ClassVar[bool] = True
    """Whether an optimizer that exchanges between replicas itself (DeMo, DiLoCo, SparseLoCo,
    MuLoCo) can run here (``check_exchanging_method``)."""
    sharded: ClassVar[bool] = False
    """Whether each rank holds a shard of the weights (FSDP2) rather than all of them."""
    across_sites: ClassVar[bool] = False
    """Whether a site of ``--fault-tolerance sites`` may run this mode inside it (its replicas
    then exchange across the sites through torchft's process group)."""
    replicate_dim: ClassVar[bool] = False
    """Whether the mesh has a replicate dimension over which a sharded model's shards are
    exchanged (hsdp), by FSDP or by the training method itself."""

    def __init__(self, world_size: int, ranks_per_node: int, shard_degree: int = 0) -> None:
        self.world_size = world_size
        self.ranks_per_node = ranks_per_node
        self.shape = self.mesh_shape(world_size, ranks_per_node, shard_degree)

    # -- the mesh --------------------------------------------------------------------------------

    @classmethod
    def mesh_shape(cls, world_size: int, ranks_per_node: int, shard_degree: int = 0) -> MeshShape:
        """The mesh on ``world_size`` ranks (``ranks_per_node`` a node, ``shard_degree`` as
        --shard-degree gives it): each subclass. The plan calls it with the planned cluster."""
        raise NotImplementedError

    def new_exchange_group(self) -> dist.ProcessGroup:
        """Collective (every rank): a new process group over the ranks a method's own exchange
        runs between, for an exchange left in flight across steps: every rank by default."""
        return dist.new_group()

    def replica_groups(self) -> list[list[int]] | None:
        """The ranks that hold the same shared state, whose copies must be equal after a
        resume: None when every rank does (ddp), else one group per shard."""
        return None

    # -- checks ----------------------------------------------------------------------------------

    @classmethod
    def check_config(cls, config: TrainConfig, given: frozenset[str] = frozenset()) -> None:
        """Raise UserError, one line naming the mode that accepts it, for the first of the
        mode's ``refusals`` (but those that need the mesh) that ``config`` holds; ``given``: the
        fields set on the command line or in the config file."""
        for refusal in cls.refusals:
            if not refusal.one_replica and refusal.refuses(config, given):
                value = getattr(config, refusal.field)
                raise UserError(refusal.message.format(mode=cls.name, value=value))

    def check_mesh(self, config: TrainConfig) -> None:
        """Raise UserError for a refusal that holds on this mesh only (one replica: a hook
        across the replicas would exchange with nobody), naming what to use instead."""
        if self.shape.replicate > 1:
            return
        for refusal in self.refusals:
            if refusal.one_replica and refusal.refuses(config, frozenset()):
                raise UserError(
                    refusal.message.format(
                        mode=self.name,
                        value=getattr(config, refusal.field),
                        replicas=self.shape.replicate,
                        shard=self.shape.shard,
                    )
                )

    @classmethod
    def check_exchanging_method(cls, method: str, config: TrainConfig) -> None:
        """Raise UserError where ``method`` (DeMo, DiLoCo, SparseLoCo: an optimizer that
        exchanges between replicas itself) cannot run under this mode
        (``accepts_exchanging_methods``), naming the mode that accepts it."""
        if cls.accepts_exchanging_methods:
            return
        raise UserError(
            f"--optimizer {method} exchanges between replicas, and --data-parallel {cls.name} "
            "has none; use --data-parallel hsdp (shards within a node, replicas across)"
        )

    @classmethod
    def accepts_node_folders(cls, config: TrainConfig) -> bool:
        """Whether ``config`` may keep a checkpoint folder per node under this mode (none of its
        ``refusals`` refuses ``--checkpoint-storage node-local``): the checkpoint plan's
        per-node rows apply."""
        node_local = replace(config, checkpoint_storage="node-local")
        return not any(
            refusal.field == "checkpoint_storage" and refusal.refuses(node_local, frozenset())
            for refusal in cls.refusals
        )

    def check_storage(self, root: Path, storage: StorageLayout) -> None:
        """Raise UserError where a folder of ``storage`` (the checkpoint folders' domains)
        cannot hold a whole copy of the state."""

    # -- the model -------------------------------------------------------------------------------

    def build(
        self,
        spec: ModelSpec,
        device: torch.device,
        env: DistEnv,
        method: ExchangingRun,
        config: TrainConfig,
    ) -> Built:
        """Collective: the model of ``spec`` on ``device``, wrapped or sharded as ``config``
        says, with the method's comm hook or exchange (each subclass)."""
        raise NotImplementedError

    def no_sync(self, runner: torch.nn.Module) -> AbstractContextManager[None]:
        """A backward inside runs without the gradient exchange (each subclass)."""
        raise NotImplementedError

    def module(self, runner: torch.nn.Module) -> torch.nn.Module:
        """The model inside ``runner`` (its parameters' names are the checkpoint's)."""
        return runner

    def clip_grad_norm(self, runner: torch.nn.Module, max_norm: float) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over ``runner``'s parameters; returns the global L2
        norm before clipping as a plain scalar tensor (collective for a sharded model)."""
        return torch.nn.utils.clip_grad_norm_(runner.parameters(), max_norm)

    def full_state_dict(self, runner: torch.nn.Module) -> dict[str, torch.Tensor] | None:
        """Collective for a sharded model: its whole state dict on rank 0's host (an empty dict
        on the other ranks); None when the model holds its whole weights already."""
        return None

    def export_module(
        self, runner: torch.nn.Module, weights: dict[str, torch.Tensor] | None
    ) -> torch.nn.Module:
        """The module rank 0 exports (``model.export_final_model``), given ``full_state_dict``'s
        ``weights``: the model inside ``runner`` by default."""
        return self.module(runner)

    def identity(self) -> dict[str, object]:
        """The keys a checkpoint must match to be resumed by this mode."""
        return {"data_parallel": self.name}

    def checkpoint_meta(self) -> dict[str, object]:
        """What a checkpoint records of the mesh it was saved on (``mesh``: [replicate,
        shard]), for a resume on another mesh to re-split per-rank shards."""
        return {"mesh": [self.shape.replicate, self.shape.shard]}

    def describe(self) -> str:
        """The mode for log lines, e.g. ``hsdp on a mesh of 2 x 4 ranks (replicate x shard)``."""
        return self.name

    # -- the plan --------------------------------------------------------------------------------

    def plan_memory(self, request: PlanRequest) -> MemoryPlan:
        """The per-rank memory plan of ``request`` under this mode (each subclass)."""
        raise NotImplementedError

    def plan_bucket_view(self, config: TrainConfig) -> bool:
        """Whether the plan counts gradients as views of DDP's buckets."""
        return False

    def shard_shapes(self, shapes: Sequence[tuple[int, ...]]) -> list[tuple[int, ...]]:
        """One rank's part of each of ``shapes``: FSDP2 splits dim 0 (``ceil(rows / S)``
        rows); the shapes themselves when nothing is sharded."""
        degree = self.shape.shard
        return [(-(-s[0] // degree), *s[1:]) if s else s for s in shapes]

    def fit_changes(self) -> frozenset[str]:
        """The setting changes the plan's fit suggestions may try under this mode."""
        return frozenset()

    def nothing_fits(self, device_gib: float, smallest_gib: float, floor_gib: float) -> str:
        """Why nothing fits: the smallest plan per rank ``smallest_gib`` and the weights and
        gradients it cannot shed ``floor_gib`` (each subclass)."""
        raise NotImplementedError

    def communication(
        self,
        config: TrainConfig,
        shapes: Sequence[tuple[int, ...]],
        topo: Topology,
        method: PlannedMethod,
    ) -> CommSection:
        """The communication plan's rows under this mode for the trained parameters of
        ``shapes`` (ddp: the method's own rows, its --compression hook, then the reference
        hooks, each once; every rank a whole replica, so the rows span all ranks)."""
        sizes = [math.prod(shape) for shape in shapes]
        bucket = config.ddp_bucket_cap_mb * 2**20
        rows = method.communication_rows(list(shapes), topo)
        hooks = [*method.plan_hooks(), *reference_methods(config.compression_block_size)]
        rows += hook_rows(hooks, sizes, topo, shapes, bucket, [name for name, _ in rows])
        run = method.step_estimate(list(shapes), topo, bucket)
        name = next((name for name, comm in rows if comm == run), method.describe())
        dense = estimate(CompressionSettings("none"), sizes, topo, shapes, bucket)
        return CommSection([], rows, dense, run, f"the {name} row")


class PlannedMethod(Protocol):
    """What a mode's communication plan asks of the training method."""

    def exchanges_replicas(self, replicate_dim: bool) -> bool:
        """Whether the method exchanges a sharded model's shards across replicas itself."""
        ...

    def describe(self) -> str:
        """The method for tables."""
        ...

    def plan_hooks(self) -> list[CompressionSettings]:
        """Its comm hooks (AdamW's --compression), planned as DDP's."""
        ...

    def communication_rows(
        self, shapes: list[tuple[int, ...]], topo: Topology
    ) -> list[tuple[str, CommEstimate]]:
        """Its own exchange's rows."""
        ...

    def step_estimate(
        self, shapes: list[tuple[int, ...]], topo: Topology, bucket_bytes: float
    ) -> CommEstimate:
        """Its communication per step."""
        ...
