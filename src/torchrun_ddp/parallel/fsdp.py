"""``--data-parallel fsdp|hsdp`` with torch's FSDP2 ``fully_shard`` (its blocks: ``sharding``; its
traffic in the plan: ``traffic``).

``fsdp`` shards every parameter, its gradient and (through the optimizer, which only sees the
shards) its AdamW moments over all ranks: a 1-D device mesh ``("shard",)``. ``hsdp`` shards within
a group of ``--shard-degree`` ranks (a node by default) and replicates across the groups: a 2-D
mesh ``("replicate", "shard")``, on which FSDP reduce-scatters within the shard group and then
all-reduces (plain average) each shard over the replicate group, unless the training method
exchanges the shards across the replicas itself (a comm hook, DeMo, DiLoCo, SparseLoCo); FSDP
then shards on the shard dimension alone.

The model is split into units as torchtitan's ``parallelize.py`` does: one ``fully_shard`` per
decoder layer (the classes the model lists in ``_no_split_modules``), then one over the root, so
the embedding, the final norm and the head share the root unit (tied embedding and head stay one
parameter). Each unit's parameters are all-gathered just before its forward and again before its
backward (the root's are kept from forward to backward), and its gradients reduce-scattered as
its backward ends. Under ``bf16-mixed`` the gathered copies and the computation are bfloat16 and
gradients are reduced in float32 into float32 shards (``MixedPrecisionPolicy``).

Initialisation: only rank 0 builds real weights (seeded, or loaded from a checkpoint on the
hub), on its GPU when the whole model fits there twice over, else on its host
(``rank0_build_device``); the other ranks build the model on the meta device. After sharding,
every rank allocates its shards (``to_empty``) and rank 0's weights are scattered with
``set_model_state_dict(..., broadcast_from_rank0=True)``; buffers that are not in the state dict
(LLaMA's rotary ``inv_freq``) are broadcast from rank 0. Sources: ``sharding``'s.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from torchrun_ddp.compression import ShardedExchange
from torchrun_ddp.errors import UserError
from torchrun_ddp.model import PRECISION_DTYPES, compile_blocks, trainable_parameter_sizes
from torchrun_ddp.parallel.base import Built, DataParallel, ExchangingRun, MeshShape, Refusal
from torchrun_ddp.parallel.sharding import (
    ShardedUnits,
    build_mesh,
    decoder_layers,
    full_state_dict,
    gradient_sync_off,
    holds_whole_replicas,
    shard_from_rank0,
)
from torchrun_ddp.parallel.shards import full_tensor
from torchrun_ddp.parallel.traffic import sharded_communication
from torchrun_ddp.plan.memory import sharded_lora_plan, sharded_plan

if TYPE_CHECKING:
    from torchrun_ddp.checkpoint import StorageLayout
    from torchrun_ddp.config import TrainConfig
    from torchrun_ddp.distributed import DistEnv
    from torchrun_ddp.model import ModelSpec
    from torchrun_ddp.parallel.base import PlannedMethod
    from torchrun_ddp.plan.communication import CommSection, Topology
    from torchrun_ddp.plan.memory import MemoryPlan, PlanRequest

log = logging.getLogger("torchrun_ddp")

SHARDED_REFUSALS = (
    Refusal(
        "zero1", "true", lambda config, given: config.zero1,
        "--zero1 shards AdamW's state over DDP replicas; --data-parallel {mode} already shards "
        "it with the weights and gradients: drop --zero1",
    ),
    Refusal(
        "ddp_static_graph", "true", lambda config, given: config.ddp_static_graph,
        "--ddp-static-graph is a DDP setting and does nothing under --data-parallel {mode}; drop "
        "it, or use --data-parallel ddp",
    ),
    Refusal(
        "gradient_as_bucket_view", "given",
        lambda config, given: "gradient_as_bucket_view" in given,
        "--gradient-as-bucket-view makes gradients views of DDP's buckets and does nothing under "
        "--data-parallel {mode} (FSDP keeps gradient shards of its own); drop it, or use "
        "--data-parallel ddp",
    ),
    Refusal(
        "compression_scope", "inter-node",
        lambda config, given: config.compression_scope != "global",
        "--compression-scope {value} is a DDP comm-hook setting; use --compression-scope global "
        "under --data-parallel {mode}",
    ),
    Refusal(
        "eval_multiple_choice", "a file", lambda config, given: bool(config.eval_multiple_choice),
        "--eval-multiple-choice is not supported under --data-parallel {mode} yet (ranks score "
        "different numbers of questions, and FSDP's forward is collective); use --data-parallel "
        "ddp or drop --eval-multiple-choice",
    ),
)  # fmt: skip
"""What both sharded modes refuse: DDP's and ZeRO-1's settings, a node-aware comm hook, and
multiple-choice evaluation."""

FSDP_REFUSALS = (
    Refusal(
        "compression", "other than none", lambda config, given: config.compression != "none",
        "--compression {value} compresses the exchange between replicas, and --data-parallel "
        "{mode} has none (FSDP reduce-scatters the gradients over every rank); use "
        "--data-parallel hsdp, or --compression none",
    ),
    Refusal(
        "ddp_bucket_cap_mb", "given", lambda config, given: "ddp_bucket_cap_mb" in given,
        "--ddp-bucket-cap-mb sizes DDP's gradient buckets and does nothing under --data-parallel "
        "{mode} (FSDP reduce-scatters unit by unit); drop it, or use --data-parallel ddp (or "
        "hsdp with a --compression hook, whose buckets it sizes)",
    ),
    Refusal(
        "checkpoint_storage", "node-local",
        lambda config, given: config.checkpoint_storage == "node-local",
        "--checkpoint-storage node-local needs every node's folder to hold a whole copy, and "
        "--data-parallel {mode} shards over every node; use --data-parallel hsdp (a replica per "
        "node) or a shared folder",
    ),
)  # fmt: skip
"""What fsdp refuses beyond ``SHARDED_REFUSALS``: a comm hook (no replicas), DDP's bucket size,
a folder per node (no folder would hold whole shard groups)."""

HSDP_REFUSALS = (
    Refusal(
        "ddp_bucket_cap_mb", "given without a --compression hook",
        lambda config, given: "ddp_bucket_cap_mb" in given and config.compression == "none",
        "--ddp-bucket-cap-mb sizes DDP's buckets and those of a --compression hook across hsdp's "
        "replicas, and does nothing under --data-parallel {mode} with --compression none; drop "
        "it, or use --data-parallel ddp or a --compression hook",
    ),
    Refusal(
        "compression", "other than none",
        lambda config, given: config.compression != "none" and config.fault_tolerance != "sites",
        "--compression {value} compresses the exchange across hsdp's replicas, and this mesh has "
        "{replicas} replica of {shard} ranks (--shard-degree, or a node's ranks), so it would "
        "exchange with none; use --data-parallel ddp for a comm hook on one node, more replicas "
        "(a smaller --shard-degree, or more nodes), or --compression none",
        one_replica=True,
    ),
)  # fmt: skip
"""What hsdp refuses beyond ``SHARDED_REFUSALS``: DDP's bucket size where no hook reads it, and
a comm hook on a mesh of one replica."""


class FSDP(DataParallel):
    """``--data-parallel fsdp``: one shard group of every rank, ``(1, world_size)``."""

    name = "fsdp"
    sharded = True
    refusals = SHARDED_REFUSALS + FSDP_REFUSALS
    accepts_exchanging_methods = False
    spec: ModelSpec | None = None
    """What ``build`` built (for a host copy at the export)."""

    @classmethod
    def mesh_shape(cls, world_size: int, ranks_per_node: int, shard_degree: int = 0) -> MeshShape:
        """Every rank in one shard group."""
        return MeshShape(1, world_size)

    def replica_groups(self) -> list[list[int]]:
        """The ranks that hold the same shard (one per replicate group): their sharded state must
        be equal after a resume. fsdp: every rank alone."""
        world = self.shape.replicate * self.shape.shard
        return [list(range(index, world, self.shape.shard)) for index in range(self.shape.shard)]

    def check_storage(self, root: Path, storage: StorageLayout) -> None:
        """Raise UserError when a checkpoint folder would hold only part of a shard group."""
        if storage.shared or holds_whole_replicas(storage.domains, self.shape):
            return
        raise UserError(
            f"--checkpoint-dir {root} is a folder per node or site, and under --data-parallel "
            f"{self.name} with {self.shape.shard} ranks per shard group a folder would hold "
            "only part of the shards; use --data-parallel hsdp with a --shard-degree within a "
            "node, or one shared folder (--checkpoint-storage shared)"
        )

    # -- the model -------------------------------------------------------------------------------

    def build(
        self,
        spec: ModelSpec,
        device: torch.device,
        env: DistEnv,
        method: ExchangingRun,
        config: TrainConfig,
    ) -> Built:
        """Collective: the model sharded by FSDP2 over the mesh (``shard_from_rank0``), and the
        method's state for it (``register_sharded``): over the shard dimension alone when the
        method exchanges the shards across hsdp's replicas itself."""
        self.spec = spec
        mesh = build_mesh(device, self.shape, hybrid=self.replicate_dim)
        exchanging = method.exchanges_replicas(self.replicate_dim)
        replicate = mesh.get_group("replicate") if exchanging else None
        model, units = shard_from_rank0(spec, device, mesh["shard"] if exchanging else mesh)
        if config.compile:
            compile_blocks(decoder_layers(model))
        exchange = self.exchange(model, units, config)
        log.info(
            "--data-parallel %s: %d decoder-layer units + root on a mesh of %d x %d ranks "
            "(replicate x shard)%s",
            self.name, units.layers, self.shape.replicate, self.shape.shard,
            "" if replicate is None else f"; --compression {config.compression} across replicas",
        )  # fmt: skip
        return Built(model, model, method.register_sharded(model, exchange, replicate))

    def exchange(
        self, model: torch.nn.Module, units: ShardedUnits, config: TrainConfig
    ) -> ShardedExchange:
        """The sizes of FSDP's collectives in one step of ``config``, for the wire counters."""
        precision = config.precision
        gather_dtype = torch.bfloat16 if precision != "fp32" else torch.float32
        return ShardedExchange(
            parameters=sum(trainable_parameter_sizes(model)),
            gathered=units.gathered,
            shard=self.shape.shard,
            replicate=self.shape.replicate,
            micro_batches=config.accumulation_steps,
            gather_bytes=gather_dtype.itemsize,
            reduce_bytes=PRECISION_DTYPES[precision].itemsize,
        )

    def no_sync(self, runner: torch.nn.Module) -> AbstractContextManager[None]:
        """FSDP's ``set_requires_gradient_sync(False)``: each rank accumulates the unsharded
        gradients of this micro-batch, reduce-scattered with the last one's."""
        return gradient_sync_off(runner)

    def clip_grad_norm(self, runner: torch.nn.Module, max_norm: float) -> torch.Tensor:
        """On FSDP's DTensor gradients torch computes each shard's norm and all-reduces them (one
        small collective per step); the DTensor result is made local (replicated)."""
        return full_tensor(torch.nn.utils.clip_grad_norm_(runner.parameters(), max_norm))

    def full_state_dict(self, runner: torch.nn.Module) -> dict[str, torch.Tensor]:
        """Collective: the whole model's state dict gathered unit by unit onto rank 0's CPU."""
        return full_state_dict(runner)

    def export_module(
        self, runner: torch.nn.Module, weights: dict[str, torch.Tensor] | None
    ) -> torch.nn.Module:
        """Under LoRA, a host copy of the model (``spec.build`` on the meta device, allocated on
        the CPU and filled with the gathered ``weights``: peft saves and merges its own
        tensors); else the sharded model itself (its ``weights`` are written instead)."""
        if self.spec is None or self.spec.lora is None or weights is None:
            return runner
        host = self.spec.build(torch.device("meta")).to_empty(device="cpu")
        host.load_state_dict(weights)
        return host

    def describe(self) -> str:
        """``fsdp on a mesh of 1 x 8 ranks (replicate x shard)``."""
        return f"{self.name} on a mesh of {self.shape.replicate} x {self.shape.shard} ranks"

    # -- the plan --------------------------------------------------------------------------------

    def plan_memory(self, request: PlanRequest) -> MemoryPlan:
        """1/S of the weights, gradients and optimizer state per rank (``plan.memory
        .sharded_plan``), S the shard group's ranks."""
        shards = self.shape.shard
        layout = f"{self.name} over {shards}"
        if request.settings.lora:
            return sharded_lora_plan(request, shards, layout)
        return sharded_plan(request, shards, layout)

    def nothing_fits(self, device_gib: float, smallest_gib: float, floor_gib: float) -> str:
        """Even sharded, a rank's share does not fit."""
        return (
            f"needs {smallest_gib:.1f} GiB per rank; shard over more ranks or use GPUs with "
            "more memory"
        )

    def communication(
        self,
        config: TrainConfig,
        shapes: Sequence[tuple[int, ...]],
        topo: Topology,
        method: PlannedMethod,
    ) -> CommSection:
        """FSDP's collectives within the shard groups, and under hsdp what crosses between the
        replicas (``traffic.sharded_communication``)."""
        return sharded_communication(self, config, shapes, topo, method)


class HSDP(FSDP):
    """``--data-parallel hsdp``: replicas of ``--shard-degree`` ranks (a node by default)."""

    name = "hsdp"
    flags = ("shard_degree",)
    replicate_dim = True
    across_sites = True
    refusals = SHARDED_REFUSALS + HSDP_REFUSALS
    accepts_exchanging_methods = True

    @classmethod
    def mesh_shape(cls, world_size: int, ranks_per_node: int, shard_degree: int = 0) -> MeshShape:
        """``(world / S, S)`` with S = ``shard_degree`` or ``ranks_per_node`` (a node).

        Raises UserError (before any process group starts) where S does not divide the world
        size."""
        degree = shard_degree or ranks_per_node
        if degree < 1 or world_size % degree:
            raise UserError(
                f"--data-parallel hsdp shards over {degree} ranks (--shard-degree, or "
                f"LOCAL_WORLD_SIZE for 0), which does not divide WORLD_SIZE {world_size}; pass a "
                "--shard-degree that divides it"
            )
        return MeshShape(world_size // degree, degree)

    def new_exchange_group(self) -> dist.ProcessGroup:
        """Collective: a new group over this rank's replicas (the ranks holding its shards, one
        per replicate group), every rank building every replicate group's."""
        group, _ = dist.new_subgroups_by_enumeration(self.replica_groups())
        return group
