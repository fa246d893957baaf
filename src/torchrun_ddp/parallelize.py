"""Sharded data parallelism (``--data-parallel fsdp|hsdp``) with torch's FSDP2 ``fully_shard``.

``fsdp`` shards every parameter, its gradient and (through the optimizer, which only sees the
shards) its AdamW moments over all ranks: a 1-D device mesh ``("shard",)``. ``hsdp`` shards within
a group of ``--shard-degree`` ranks (a node by default) and replicates across the groups: a 2-D
mesh ``("replicate", "shard")``, on which FSDP reduce-scatters within the shard group and then
all-reduces (plain average) each shard over the replicate group.

The model is split into units as torchtitan's ``parallelize.py`` does: one ``fully_shard`` per
decoder layer (the classes the model lists in ``_no_split_modules``), then one over the root, so
the embedding, the final norm and the head share the root unit (tied embedding and head stay one
parameter). Each unit's parameters are all-gathered just before its forward and again before its
backward (the root's are kept from forward to backward), and its gradients reduce-scattered as
its backward ends. Under ``bf16-mixed`` the gathered copies and the computation are bfloat16 and
gradients are reduced in float32 into float32 shards (``MixedPrecisionPolicy``).

Initialisation: only rank 0 builds real weights (seeded, or loaded from a checkpoint on the
hub); the other ranks build the model on the meta device. After sharding, every rank allocates
its shards (``to_empty``) and rank 0's weights are scattered with
``set_model_state_dict(..., broadcast_from_rank0=True)``; buffers that are not in the state dict
(LLaMA's rotary ``inv_freq``) are broadcast from rank 0. So ``fsdp`` starts from DDP's weights
with one full copy in host memory on rank 0 only.

Imports: ``errors`` only (a component). Sources: FSDP2,
https://docs.pytorch.org/docs/stable/distributed.fsdp.fully_shard.html; torchtitan's
``torchtitan/models/llama3/infra/parallelize.py`` (units, mixed precision, root unit);
``torch.distributed.checkpoint.state_dict`` for the broadcast and the full export.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from torchrun_ddp.errors import UserError

DATA_PARALLEL = ("ddp", "fsdp", "hsdp")
"""``--data-parallel``: ddp replicates the model on every rank; fsdp shards it over every rank;
hsdp shards it within groups of ``--shard-degree`` ranks and replicates across the groups."""


@dataclass(frozen=True)
class MeshShape:
    """The data-parallel ranks as ``replicate`` groups of ``shard`` ranks (world = product)."""

    replicate: int
    shard: int


def mesh_shape(
    data_parallel: str, world_size: int, local_world_size: int, shard_degree: int = 0
) -> MeshShape:
    """The mesh of ``--data-parallel`` on ``world_size`` ranks: fsdp ``(1, world)``, hsdp
    ``(world / S, S)`` with S = ``shard_degree`` or ``local_world_size`` (a node) for 0.

    Raises UserError (before any process group starts) where S does not divide the world size,
    or for a data-parallel mode that does not shard (ddp)."""
    if data_parallel == "fsdp":
        return MeshShape(1, world_size)
    if data_parallel != "hsdp":
        raise UserError(f"--data-parallel {data_parallel} does not shard; use fsdp or hsdp")
    degree = shard_degree or local_world_size
    if degree < 1 or world_size % degree:
        raise UserError(
            f"--data-parallel hsdp shards over {degree} ranks (--shard-degree, or "
            f"LOCAL_WORLD_SIZE for 0), which does not divide WORLD_SIZE {world_size}; pass a "
            "--shard-degree that divides it"
        )
    return MeshShape(world_size // degree, degree)


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


@dataclass(frozen=True)
class ShardedUnits:
    """What ``shard_model`` made: ``layers`` decoder-layer units and the elements all-gathered
    per forward and backward (``gathered``: layers twice, the root once; global counts)."""

    layers: int
    gathered: int


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


def rank0_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Rank 0's full weights and buffers, captured before sharding (an empty dict on the other
    ranks, whose ``model`` is on the meta device). CPU tensors as they are; no copy."""
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


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The model inside a DDP wrapper (an FSDP model is its own module)."""
    return model.module if isinstance(model, DistributedDataParallel) else model


@contextmanager
def no_gradient_sync(model: torch.nn.Module) -> Iterator[None]:
    """Backward without the gradient exchange, for the micro-batches before a step's last:
    DDP's ``no_sync``; FSDP's ``set_requires_gradient_sync(False)`` (each rank accumulates the
    unsharded gradients of this micro-batch, reduce-scattered with the last one's)."""
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
        return
    context = model.no_sync() if isinstance(model, DistributedDataParallel) else nullcontext()
    with context:
        yield


def clip_grad_norm(model: torch.nn.Module, max_norm: float) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` over ``model``'s parameters; returns the global L2
    norm before clipping as a plain (float32 or the gradients' dtype) scalar tensor.

    On FSDP's DTensor gradients torch computes each shard's norm and all-reduces them (one small
    collective per step); the DTensor result is made local (replicated on every rank)."""
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    return norm.full_tensor() if isinstance(norm, DTensor) else norm


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Collective: the whole model's state dict gathered unit by unit onto rank 0's CPU
    (``full_state_dict`` and ``cpu_offload``: at most one full copy, on rank 0's host); the
    other ranks get an empty dict."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=options)


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether ``model`` is sharded by FSDP."""
    return isinstance(model, FSDPModule)


def replica_groups(shape: MeshShape) -> list[list[int]]:
    """The ranks that hold the same shard (one per replicate group): their sharded state must
    be equal after a resume. fsdp: every rank alone."""
    world = shape.replicate * shape.shard
    return [list(range(index, world, shape.shard)) for index in range(shape.shard)]


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
