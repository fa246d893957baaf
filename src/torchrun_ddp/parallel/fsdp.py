"""``--data-parallel fsdp|hsdp`` with torch's FSDP2 ``fully_shard``.

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
(LLaMA's rotary ``inv_freq``) are broadcast from rank 0.

Sources: FSDP2, https://docs.pytorch.org/docs/stable/distributed.fsdp.fully_shard.html;
torchtitan's ``torchtitan/models/llama3/infra/parallelize.py`` (units, mixed precision, root
unit); ``torch.distributed.checkpoint.state_dict`` for the broadcast and the full export.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from torchrun_ddp.compression import ShardedExchange, sharded_step_bytes
from torchrun_ddp.errors import UserError
from torchrun_ddp.model import PRECISION_DTYPES, compile_blocks, trainable_parameter_sizes
from torchrun_ddp.parallel.base import Built, DataParallel, ExchangingRun, MeshShape
from torchrun_ddp.parallel.shards import full_tensor
from torchrun_ddp.plan import meta_model, parameter_count
from torchrun_ddp.plan.memory import sharded_plan

if TYPE_CHECKING:
    from torchrun_ddp.checkpoint import StorageLayout
    from torchrun_ddp.config import TrainConfig
    from torchrun_ddp.distributed import DistEnv
    from torchrun_ddp.model import ModelSpec
    from torchrun_ddp.parallel.base import PlannedMethod
    from torchrun_ddp.plan.communication import Topology
    from torchrun_ddp.plan.memory import MemoryPlan, PlanRequest

log = logging.getLogger("torchrun_ddp")

_NOT_SHARDED = {
    "zero1": "--zero1 shards AdamW's state over DDP replicas; --data-parallel {dp} already "
    "shards it with the weights and gradients: drop --zero1",
    "ddp_static_graph": "--ddp-static-graph is a DDP setting; drop it under --data-parallel {dp}",
}
"""Flags refused under --data-parallel fsdp/hsdp -> the one line that says so ({dp}: the mode)."""


class FSDP(DataParallel):
    """``--data-parallel fsdp``: one shard group of every rank, ``(1, world_size)``."""

    name = "fsdp"
    sharded = True

    @classmethod
    def mesh_shape(cls, world_size: int, ranks_per_node: int, shard_degree: int = 0) -> MeshShape:
        """Every rank in one shard group."""
        return MeshShape(1, world_size)

    def replica_groups(self) -> list[list[int]]:
        """The ranks that hold the same shard (one per replicate group): their sharded state must
        be equal after a resume. fsdp: every rank alone."""
        world = self.shape.replicate * self.shape.shard
        return [list(range(index, world, self.shape.shard)) for index in range(self.shape.shard)]

    @classmethod
    def check_config(cls, config: TrainConfig, given: frozenset[str] = frozenset()) -> None:
        """Settings a sharded model does not take: ZeRO-1, DDP's static graph, a node-aware comm
        hook, multiple-choice evaluation; fsdp also a folder per node (no folder would hold whole
        shard groups)."""
        mode = cls.name
        for name, message in _NOT_SHARDED.items():
            if getattr(config, name):
                raise UserError(message.format(dp=mode))
        if config.peft != "none":
            raise UserError(
                f"--peft {config.peft} is not supported under --data-parallel {mode} yet; use "
                "--data-parallel ddp (LoRA's base is frozen: a 7B model fits one 24 GB GPU)"
            )
        if config.compression_scope != "global":
            raise UserError(
                f"--compression-scope {config.compression_scope} is a DDP comm-hook setting; use "
                f"--compression-scope global under --data-parallel {mode}"
            )
        if config.eval_multiple_choice:
            raise UserError(
                f"--eval-multiple-choice is not supported under --data-parallel {mode} yet "
                "(ranks score different numbers of questions, and FSDP's forward is collective); "
                "use --data-parallel ddp or drop --eval-multiple-choice"
            )
        cls.check_storage_setting(config)

    @classmethod
    def check_storage_setting(cls, config: TrainConfig) -> None:
        """fsdp: a folder per node cannot hold whole shard groups."""
        if config.checkpoint_storage == "node-local":
            raise UserError(
                "--checkpoint-storage node-local needs every node's folder to hold a whole copy, "
                "and --data-parallel fsdp shards over every node; use --data-parallel hsdp (a "
                "replica per node) or a shared folder"
            )

    @classmethod
    def check_exchanging_method(cls, method: str, config: TrainConfig) -> None:
        """fsdp has no replicas for DeMo, DiLoCo or SparseLoCo to exchange between."""
        raise UserError(
            f"--optimizer {method} exchanges between replicas, and --data-parallel {cls.name} "
            "has none; use --data-parallel hsdp (shards within a node, replicas across)"
        )

    @classmethod
    def check_comm_hook(cls, config: TrainConfig) -> None:
        """fsdp has no exchange between replicas for a comm hook to compress."""
        if config.compression == "none":
            return
        raise UserError(
            f"--compression {config.compression} compresses the exchange between replicas, "
            f"and --data-parallel {cls.name} has none (FSDP reduce-scatters the gradients over "
            "every rank); use --data-parallel hsdp, or --compression none"
        )

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

    def describe(self) -> str:
        """``fsdp on a mesh of 1 x 8 ranks (replicate x shard)``."""
        return f"{self.name} on a mesh of {self.shape.replicate} x {self.shape.shard} ranks"

    # -- the plan --------------------------------------------------------------------------------

    def plan_memory(self, request: PlanRequest) -> MemoryPlan:
        """1/S of the weights, gradients and optimizer state per rank (``plan.memory
        .sharded_plan``), S the shard group's ranks."""
        shards = self.shape.shard
        return sharded_plan(request, shards, f"{self.name} over {shards}")

    def nothing_fits(self, device_gib: float, smallest_gib: float, floor_gib: float) -> str:
        """Even sharded, a rank's share does not fit."""
        return (
            f"needs {smallest_gib:.1f} GiB per rank; shard over more ranks or use GPUs with "
            "more memory"
        )

    def traffic(
        self,
        config: TrainConfig,
        shapes: Sequence[tuple[int, ...]],
        topo: Topology,
        method: PlannedMethod,
    ) -> list[str]:
        """FSDP's bytes per rank and step (``sharded_traffic``), and with a method on hsdp's
        replicas its bytes across them."""
        return sharded_traffic(self, config, shapes, topo, method)


class HSDP(FSDP):
    """``--data-parallel hsdp``: replicas of ``--shard-degree`` ranks (a node by default)."""

    name = "hsdp"
    flags = ("shard_degree",)
    replicate_dim = True

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

    @classmethod
    def check_storage_setting(cls, config: TrainConfig) -> None:
        """hsdp: a folder per node holds its replicas when a shard group stays in a node
        (checked at start, ``check_storage``)."""

    @classmethod
    def check_exchanging_method(cls, method: str, config: TrainConfig) -> None:
        """Each replica is a worker; an overlapped exchange is not wired here yet."""
        if config.overlap_exchange:
            raise UserError(
                f"--overlap-exchange is not supported under --data-parallel {cls.name} yet; drop it"
            )

    @classmethod
    def check_comm_hook(cls, config: TrainConfig) -> None:
        """A comm hook compresses the exchange across hsdp's replicas."""


@dataclass(frozen=True)
class ShardedUnits:
    """What ``shard_model`` made: ``layers`` decoder-layer units and the elements all-gathered
    per forward and backward (``gathered``: layers twice, the root once; global counts)."""

    layers: int
    gathered: int


def build_mesh(device: torch.device, shape: MeshShape, hybrid: bool) -> DeviceMesh:
    """Collective: the device mesh of ``shape``, ranks numbered shard-fastest (a node's ranks
    share a shard group); 2-D ``("replicate", "shard")`` when ``hybrid``, else 1-D
    ``("shard",)``."""
    if not hybrid:
        return init_device_mesh(device.type, (shape.shard,), mesh_dim_names=("shard",))
    dims = (shape.replicate, shape.shard)
    return init_device_mesh(device.type, dims, mesh_dim_names=("replicate", "shard"))


def mixed_precision(precision: str) -> MixedPrecisionPolicy:
    """FSDP's policy for ``--precision``: bf16-mixed gathers bfloat16 copies of the float32
    shards for the forward and backward and reduces gradients in float32; fp32 and bf16 compute
    and reduce in the weights' own dtype."""
    if precision == "bf16-mixed":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def shard_model(model: torch.nn.Module, mesh: DeviceMesh, precision: str) -> ShardedUnits:
    """``fully_shard`` each decoder layer of ``model`` (modules whose class is named in the
    model's ``_no_split_modules``), then the root, in place; the model becomes an FSDPModule.

    Raises UserError for a model that names no decoder-layer class (no units to shard)."""
    layers = decoder_layers(model)
    if not layers:
        raise UserError(
            f"{type(model).__name__} names no decoder-layer class (_no_split_modules), so "
            "--data-parallel fsdp/hsdp cannot split it into units; use --data-parallel ddp"
        )
    policy = mixed_precision(precision)
    layer_elements = sum(p.numel() for layer in layers for p in layer.parameters())
    for layer in layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    total = sum(p.numel() for p in model.parameters())
    return ShardedUnits(len(layers), total + layer_elements)


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules of ``model`` of a class its ``_no_split_modules`` names (a transformers
    model's decoder layers: FSDP's units, and the blocks ``--compile`` compiles under FSDP),
    also once ``fully_shard`` has given them its subclass (``FSDP<name>``)."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    return [
        module
        for module in model.modules()
        if any(cls.__name__ in names for cls in type(module).__mro__)
    ]


def rank0_build_device(spec: ModelSpec, device: torch.device) -> torch.device:
    """Where rank 0 builds the full weights it scatters to FSDP's shards: its GPU for a random
    init whose weights take at most half of the GPU's free memory (drawn there in seconds; the
    shards and the full copy then both fit), else the host (pretrained weights load there, and a
    GPU too small for the whole model is the reason to shard). The other ranks build on meta."""
    if dist.get_rank() != 0:
        return torch.device("meta")
    if device.type != "cuda" or spec.init != "random":
        return torch.device("cpu")
    dtype = PRECISION_DTYPES[spec.precision]
    weights = parameter_count(meta_model(spec.model_config)) * dtype.itemsize
    free, _ = torch.cuda.mem_get_info(device)
    return device if 2 * weights <= free else torch.device("cpu")


def shard_from_rank0(
    spec: ModelSpec, device: torch.device, mesh: DeviceMesh
) -> tuple[torch.nn.Module, ShardedUnits]:
    """Collective: the model of ``spec`` sharded by FSDP2 over ``mesh`` (``shard_model``), with
    one full copy on rank 0 (``rank0_build_device``: its GPU or its host), the shapes on the
    meta device on the other ranks; rank 0's weights are then scattered to the shards
    (``load_from_rank0``)."""
    model = spec.build(rank0_build_device(spec, device))
    rank0_state = rank0_weights(model)
    units = shard_model(model, mesh, spec.precision)
    load_from_rank0(model, device, rank0_state)
    return model, units


def rank0_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Rank 0's full weights and buffers, captured before sharding (an empty dict on the other
    ranks, whose ``model`` is on the meta device). Its own tensors as they are; no copy."""
    if dist.get_rank() != 0:
        return {}
    state = dict(model.state_dict())
    state.update({f"buffer:{name}": buffer for name, buffer in model.named_buffers()})
    return state


def load_from_rank0(
    model: torch.nn.Module, device: torch.device, rank0_state: dict[str, torch.Tensor]
) -> None:
    """Collective: allocate the sharded ``model``'s memory on ``device`` (``to_empty``) and
    fill it with rank 0's ``rank0_state`` (``rank0_weights``): the weights scattered shard by
    shard (``set_model_state_dict`` with ``broadcast_from_rank0``), then every buffer broadcast
    (the non-persistent ones, such as LLaMA's rotary ``inv_freq``, are not in the state dict)."""
    model.to_empty(device=device)
    weights = {k: v for k, v in rank0_state.items() if not k.startswith("buffer:")}
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, weights, options=options)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if dist.get_rank() == 0:
                buffer.copy_(rank0_state[f"buffer:{name}"])
            dist.broadcast(buffer, src=0)


@contextmanager
def gradient_sync_off(model: torch.nn.Module) -> Iterator[None]:
    """FSDP's ``set_requires_gradient_sync(False)`` around the block, restored after it."""
    if not isinstance(model, FSDPModule):
        yield
        return
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Collective: the whole model's state dict gathered unit by unit onto rank 0's CPU
    (``full_state_dict`` and ``cpu_offload``: at most one full copy, on rank 0's host); the
    other ranks get an empty dict."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=options)


def holds_whole_replicas(domains: Sequence[Sequence[int]], shape: MeshShape) -> bool:
    """Whether every storage domain (the ranks that see one checkpoint folder) holds whole
    shard groups, so that DCP in the domain's group writes a complete copy of the sharded state
    into its folder (ranks are numbered shard-fastest: group ``k`` is ranks ``k S .. k S + S -
    1``)."""
    return all(
        {rank // shape.shard * shape.shard + i for rank in domain for i in range(shape.shard)}
        <= set(domain)
        for domain in domains
    )


@dataclass(frozen=True)
class ShardedTraffic:
    """Wire bytes one rank sends per optimizer step under --data-parallel fsdp/hsdp: ``within``
    its shard group (FSDP's all-gathers and reduce-scatter) and ``across`` the groups (native
    hsdp: FSDP's all-reduce of the shards; ``hooked``: the method's own exchange on the
    replicas); ``shard`` ranks per group, ``replicas`` groups. ``fsdp``: FSDP's own bytes."""

    within: float
    across: float
    hooked: bool
    shard: int
    replicas: int

    @property
    def fsdp(self) -> float:
        """FSDP's collectives (native hsdp: its all-reduce across the groups included)."""
        return self.within if self.hooked else self.within + self.across


def sharded_traffic_bytes(
    mode: FSDP,
    config: TrainConfig,
    shapes: Sequence[tuple[int, ...]],
    topo: Topology,
    method: PlannedMethod,
) -> ShardedTraffic:
    """FSDP's wire bytes per rank and step (``compression.sharded_step_bytes``: every
    micro-batch all-gathers the units, layers twice and the root once, then the gradients are
    reduce-scattered, under native hsdp also all-reduced over the replicas). Under hsdp with a
    method on the replicas (``exchanges_replicas``) FSDP stays within each group, and ``across``
    is the method's estimate for the shard's shapes on a ring of the R replicas."""
    world, sizes = topo.world_size, [math.prod(shape) for shape in shapes]
    parameters = sum(sizes)
    shard = mode.shape.shard
    hooked = method.exchanges_replicas(mode.replicate_dim)
    exchange = ShardedExchange(
        parameters=parameters,
        gathered=2 * parameters - max(sizes),  # the root's bulk: the embedding (and the head)
        shard=shard,
        replicate=1 if hooked else world // shard,
        micro_batches=config.accumulation_steps,
        gather_bytes=4 if config.precision == "fp32" else 2,
        reduce_bytes=PRECISION_DTYPES[config.precision].itemsize,
    )
    within, _ = sharded_step_bytes(replace(exchange, replicate=1))
    across = sharded_step_bytes(exchange)[0] - within
    if hooked:
        replicas = replace(topo, world_size=world // shard, per_node=1)
        bucket = config.ddp_bucket_cap_mb * 2**20
        estimate = method.step_estimate(mode.shard_shapes(shapes), replicas, bucket)
        across = estimate.wire_bytes
    return ShardedTraffic(within, across, hooked, shard, world // shard)


def sharded_traffic(
    mode: FSDP,
    config: TrainConfig,
    shapes: Sequence[tuple[int, ...]],
    topo: Topology,
    method: PlannedMethod,
) -> list[str]:
    """FSDP's line of :func:`sharded_traffic_bytes` (the table's rows are then DDP's comm hooks,
    for comparison), where its collectives cross nodes, and with a method on hsdp's replicas its
    line across them."""
    bytes_ = sharded_traffic_bytes(mode, config, shapes, topo, method)
    lines = [
        f"--data-parallel {mode.name} ({bytes_.replicas} x {bytes_.shard} ranks): "
        f"FSDP sends {bytes_.fsdp / 1e6:.4g} MB per rank per step (all-gathers of every "
        "micro-batch, one reduce-scatter"
        + ("" if bytes_.hooked else ", and under hsdp the shards' all-reduce across replicas")
        + "); the rows below are DDP's comm hooks, for comparison"
    ]
    if bytes_.hooked:
        lines.append(
            f"{method.describe()} across the {bytes_.replicas} replicas: "
            f"{bytes_.across / 1e6:.4g} MB per rank per step, each rank its 1/{bytes_.shard} "
            "shard (the method's estimate for the shard's shapes; only this crosses between "
            "groups)"
        )
    return lines
