"""What every training method answers, so that the loop, the checkpoint wiring and the plan never
ask which method a run uses.

A method is one object (:class:`Method`), made from the run's config (:func:`methods.method_for`)
with its settings validated once. ``build`` registers its DDP comm hook (sharded by FSDP:
``register_sharded``) and builds its optimizer; after that the object answers for its state in
checkpoints (shared, per rank, sharded), its identity keys, what happens to its per-rank state
at another world size or when no folder holds it, and its rows in the ``--dry-run`` plan. The
four methods: :mod:`.adamw` (AdamW with the comm-hook family and ZeRO-1), :mod:`.demo`,
:mod:`.diloco` and :mod:`.sparseloco` (the last two on :mod:`.local_updates`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

import torch
from torch.distributed import ProcessGroup
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer

from torchrun_ddp.checkpoint import ShardedOptimizer, Stateful
from torchrun_ddp.compression import (
    CompressionSettings,
    CompressionState,
    ShardedExchange,
    register_local_gradients,
)
from torchrun_ddp.config import TrainConfig, flag_name
from torchrun_ddp.errors import UserError
from torchrun_ddp.plan.communication import CommEstimate, Topology
from torchrun_ddp.plan.settings import Footprint

if TYPE_CHECKING:
    from torchrun_ddp.distributed import NodeGroups
    from torchrun_ddp.parallel.base import DataParallel

FP32 = 4
"""Bytes of one fp32 value."""


@dataclass(frozen=True)
class MemoryRow:
    """One row of the memory a local-update optimizer adds per rank, in bytes; ``persistent``
    rows live through the run, the others only during a sync (in the optimizer step)."""

    name: str
    nbytes: int
    persistent: bool


@dataclass(frozen=True)
class CheckpointBytes:
    """Bytes of one checkpoint that a method adds: ``replicated`` (in every folder, written once)
    and ``per_rank`` (one rank's own files)."""

    replicated: int
    per_rank: int


@dataclass(frozen=True)
class PlanSizes:
    """The sizes a method's plan rows are computed from: ``trained`` parameters (elements; the
    adapters under LoRA), ``parameters`` in the model, ``weight_bytes`` per value of the weights'
    dtype, ``world_size`` ranks, the trained parameters' ``shapes``, and ``matrices``: the trained
    elements in the hidden layers' matrices (``model.hidden_matrices``)."""

    trained: int
    parameters: int
    weight_bytes: int
    world_size: int
    shapes: tuple[tuple[int, ...], ...]
    matrices: int = 0


Owners = Mapping[str, tuple[str, tuple[str, ...]]]
"""Config field -> (the field that decides whether it is read, the values of that field under
which it is), e.g. ``{"lora_rank": ("peft", ("lora",))}``."""


def refuse_unused(config: TrainConfig, given: frozenset[str], owners: Owners) -> None:
    """Raise UserError, one line, for the first field of ``owners`` that was ``given`` (set on the
    command line or in the config file, ``config_io.given_fields``) while the field that decides
    whether it is read has a value under which it is not: such a flag would change nothing."""
    for name in sorted(given & owners.keys()):
        switch, values = owners[name]
        actual = getattr(config, switch)
        if actual in values:
            continue
        owner = " or ".join(values)
        raise UserError(
            f"--{flag_name(name)} is a setting of --{flag_name(switch)} {owner} and does nothing "
            f"under --{flag_name(switch)} {actual}; drop it, or use --{flag_name(switch)} "
            f"{values[0]}"
        )


class Method:
    """One training method (subclasses name it in ``name``; ``methods.METHODS`` is the table).

    Made from the run's config; ``build`` then registers the DDP comm hook and builds the
    optimizer (collective: every rank builds it). Before ``build`` only the settings, the plan
    and the checks are available. Raises UserError (one line) from the constructor for settings
    that do not fit together.
    """

    name: ClassVar[str] = ""
    """``--optimizer``'s value."""
    summary: ClassVar[str] = ""
    """One line for --help and the configuration page: what the method does, and its source."""
    preset_field: ClassVar[str] = ""
    """The config field that names one of its ``presets`` ("" for none)."""
    presets: ClassVar[Mapping[str, Mapping[str, object]]] = {}
    """Preset name -> field values it gives where neither a flag nor the config file sets them
    (``config_io.parse_config`` applies them)."""
    flags: ClassVar[tuple[str, ...]] = ()
    """Config fields that only this method (and the other methods that list them) reads; one of
    them given under another --optimizer is refused (``methods.check_methods``)."""

    def __init__(self, config: TrainConfig) -> None:
        self.config = config
        self.mode: DataParallel | None = None
        self._optimizer: Optimizer | None = None

    @classmethod
    def refusing_modes(cls) -> tuple[str, ...]:
        """The ``--data-parallel`` modes that refuse this method (``--help`` says so, and the
        plan's hints name only the others): none by default."""
        return ()

    @classmethod
    def site_problem(cls, config: TrainConfig) -> str:
        """Why this method cannot exchange across fault-tolerant sites with ``config``
        (``--fault-tolerance sites``), as a clause naming the fix; "" when it can."""
        return (
            f"--optimizer {cls.name} does not exchange across sites yet; use --optimizer adamw, "
            "demo, diloco, sparseloco or muloco"
        )

    @classmethod
    def check_config(cls, config: TrainConfig, given: frozenset[str] = frozenset()) -> None:
        """Raise UserError for values of this method's flags out of range (checked whatever
        --optimizer is, as every flag is) and, when ``config`` chooses this method, for flags that
        do not go with it; ``given``: the fields set on the command line or in the config file.
        Nothing by default."""

    # -- build ---------------------------------------------------------------------------------

    def register_hook(
        self, ddp_model: DistributedDataParallel, node_groups: NodeGroups | None
    ) -> CompressionState:
        """Register the DDP comm hook on ``ddp_model`` and return the state that counts its wire
        bytes: by default the hook that keeps each rank's gradient (or its node's mean) for an
        optimizer that exchanges itself (``compression.register_local_gradients``)."""
        return register_local_gradients(ddp_model, node_groups=node_groups)

    def register_sharded(
        self, model: torch.nn.Module, exchange: ShardedExchange, replicate: ProcessGroup | None
    ) -> CompressionState:
        """The state that counts the wire bytes of a model sharded by FSDP (``--data-parallel
        fsdp|hsdp``; ``exchange``: its collectives' sizes; ``replicate``: under hsdp, the group
        of the ranks holding this rank's shards when the method exchanges over it itself, None
        when FSDP all-reduces them). A method that cannot train sharded refuses it in
        ``check_config``; this default raises the same UserError."""
        raise UserError(
            f"--optimizer {self.name} does not run under --data-parallel "
            f"{self.config.data_parallel} yet; use --optimizer adamw or --data-parallel ddp"
        )

    def exchanges_replicas(self, replicate_dim: bool) -> bool:
        """Whether, on a sharded model's mesh with a replicate dimension (``replicate_dim``:
        hsdp's replicate x shard), the method averages the gradient shards over it itself;
        FSDP then shards on the shard dimension alone. False by default (FSDP's all-reduce)."""
        return False

    def build(
        self,
        model: torch.nn.Module,
        compression: CompressionState,
        mode: DataParallel | None = None,
    ) -> Optimizer:
        """Build and keep this rank's optimizer over ``model``'s trained parameters, counting any
        exchange's wire bytes in ``compression``; ``mode``: the run's data-parallel mode (kept as
        ``self.mode``: a method that exchanges asks it for a group of its own). Collective where
        the optimizer makes a process group."""
        self.mode = mode
        self._optimizer = self.build_optimizer(model, compression)
        return self._optimizer

    def build_optimizer(self, model: torch.nn.Module, compression: CompressionState) -> Optimizer:
        """The optimizer itself (each subclass)."""
        raise NotImplementedError

    @property
    def optimizer(self) -> Optimizer:
        """The optimizer ``build`` made; RuntimeError before it."""
        if self._optimizer is None:
            raise RuntimeError(f"the {self.name} method is not built yet: call build() first")
        return self._optimizer

    # -- the loop ------------------------------------------------------------------------------

    def before_forward(self) -> None:
        """Before the step's first forward: work that may overlap the step's compute. Nothing by
        default."""

    def after_backward(self) -> None:
        """After the step's last backward, before clipping and the optimizer step: any exchange
        of gradients the method runs itself outside backward (collective). Nothing by default."""

    def flush(self) -> bool:
        """Apply an update still in flight (a collective for some); True if there was one."""
        return False

    def end_warning(self) -> str:
        """A warning for the end of training ("" for none), e.g. ranks left between syncs."""
        return ""

    # -- checkpoints ---------------------------------------------------------------------------

    def shared_optimizer(self) -> Optimizer | None:
        """The optimizer when its whole state is the same on every rank (saved once, with the
        model, through DCP); None when its state is per rank or sharded."""
        return None

    def shared_state(self) -> dict[str, Stateful]:
        """Replicated state beyond the model, the optimizer and the schedule."""
        return {}

    def rank_state(
        self, model: DistributedDataParallel, shards_in_files: bool = False
    ) -> dict[str, Stateful]:
        """State that differs between ranks (saved in each rank's own files)."""
        return {}

    def sharded_state(
        self, model: DistributedDataParallel, shards_in_files: bool = False
    ) -> dict[str, ShardedOptimizer]:
        """Optimizer state sharded over ranks and saved through DCP (loads at any world size)."""
        return {}

    def identity(self) -> dict[str, object]:
        """The keys, beyond the run's, that a checkpoint must match to be resumed exactly."""
        return {}

    def checkpoint_meta(self, shards_in_files: bool) -> dict[str, object]:
        """What a checkpoint's meta records of the method's layout, for its resume
        (``shards_in_rank_files``); ``shards_in_files``: whether sharded optimizer state goes
        to the ranks' own files (several checkpoint folders). Nothing by default."""
        return {}

    def shards_in_rank_files(self, saved: Mapping[str, object]) -> bool:
        """Whether the checkpoint whose meta is ``saved`` holds the method's sharded optimizer
        state in the ranks' own files rather than in DCP. False by default."""
        return False

    def identity_defaults(self) -> dict[str, object]:
        """Values of ``identity`` keys that checkpoints written before the key existed held."""
        return {}

    def rebuild_problem(self) -> str:
        """Why a rank's own state cannot be rebuilt when no checkpoint folder holds it ("" when it
        can: the method's per-rank state restarts from zero)."""
        return ""

    def rebuild_rank_state(self, path: Path, donors: list[int], lrs: list[float]) -> list[str]:
        """Continue this rank with its own state of the checkpoint at ``path`` lost (``donors``:
        ranks whose files the folder holds, at most one; ``lrs``: the schedule's learning rate
        per parameter group). Returns what was reset, for the warning; nothing by default."""
        return []

    def load_resharded(
        self, model: DistributedDataParallel, path: Path, saved: Mapping[str, object], rank: int
    ) -> None:
        """Per-rank state from the checkpoint at ``path`` written at another world size
        (``saved``: its meta; the shared and sharded state are loaded already); logs what is
        dropped."""

    # -- the plan ------------------------------------------------------------------------------

    @classmethod
    def footprint(cls) -> Footprint:
        """What its optimizer holds per trained parameter and allocates in its step, for the
        memory plan: AdamW's by default (two moments in the weights' dtype; ZeRO-1 can shard
        them)."""
        return Footprint()

    def describe(self) -> str:
        """One line for logs and plan tables."""
        return self.name

    def plan_hooks(self) -> list[CompressionSettings]:
        """Comm hooks whose rows lead the communication plan (AdamW's --compression); none for
        a method that exchanges itself."""
        return []

    def communication_rows(
        self, shapes: list[tuple[int, ...]], topo: Topology
    ) -> list[tuple[str, CommEstimate]]:
        """The communication plan's first rows for the trained parameters of ``shapes``: the
        method's own exchange, then what it is compared with. None by default."""
        return []

    def step_estimate(
        self, shapes: list[tuple[int, ...]], topo: Topology, bucket_bytes: float
    ) -> CommEstimate:
        """This run's communication per optimizer step (benchmarks compare it with measured step
        times): the first row of ``communication_rows`` by default."""
        return self.communication_rows(shapes, topo)[0][1]

    def memory_rows(self, sizes: PlanSizes) -> list[MemoryRow]:
        """What the method holds per rank beyond weights, gradients and optimizer state."""
        return []

    def checkpoint_bytes(self, sizes: PlanSizes) -> CheckpointBytes:
        """The bytes the optimizer's state adds to one checkpoint."""
        raise NotImplementedError

    def heal_bytes(self, sizes: PlanSizes, shard: int) -> int:
        """Bytes a live site sends each rank of a healing site under ``--fault-tolerance
        sites``, whose state is sharded ``shard`` ways (hsdp; 1: whole; ``sizes.shapes``: one
        rank's shards, ``Mode.shard_shapes``): the replicated
        optimizer state by default (the local-update methods' synced fp32 copy and outer
        momentum, from which the parameters are set)."""
        return self.checkpoint_bytes(sizes).replicated // shard
