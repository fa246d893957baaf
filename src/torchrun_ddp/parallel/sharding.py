"""FSDP2's building blocks, as the fsdp and hsdp modes use them: the device mesh, the mixed
precision policy, one ``fully_shard`` unit per decoder layer then the root, rank 0's weights
scattered to the shards, no-sync for accumulation, the full state dict gathered for the export,
and which checkpoint folders hold whole shard groups.

Sources: FSDP2, https://docs.pytorch.org/docs/stable/distributed.fsdp.fully_shard.html;
torchtitan's ``torchtitan/models/llama3/infra/parallelize.py`` (units, mixed precision, root
unit); ``torch.distributed.checkpoint.state_dict`` for the broadcast and the full export.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
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

from torchrun_ddp.errors import UserError
from torchrun_ddp.model import weight_dtype
from torchrun_ddp.parallel.base import MeshShape
from torchrun_ddp.plan import meta_model, parameter_count

if TYPE_CHECKING:
    from torchrun_ddp.model import ModelSpec


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


def mixed_precision(precision: str, lora: bool = False) -> MixedPrecisionPolicy:
    """FSDP's policy for ``--precision``: bf16-mixed gathers bfloat16 copies of the float32
    shards for the forward and backward and reduces gradients in float32; fp32 and bf16 compute
    and reduce in the weights' own dtype. Under ``lora`` with bf16 the fp32 adapters beside the
    bf16 base are gathered in bfloat16 too (one dtype per unit) and their gradients reduced in
    float32, as under bf16-mixed."""
    if precision == "bf16-mixed" or (lora and precision == "bf16"):
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def shard_model(
    model: torch.nn.Module, mesh: DeviceMesh, precision: str, lora: bool = False
) -> ShardedUnits:
    """``fully_shard`` each decoder layer of ``model`` (modules whose class is named in the
    model's ``_no_split_modules``; under ``lora`` the PeftModel's, with their adapters), then
    the root, in place; the model becomes an FSDPModule. A frozen parameter is sharded and
    gathered like any other; only the trained ones get gradients to reduce-scatter.

    Raises UserError for a model that names no decoder-layer class (no units to shard)."""
    layers = decoder_layers(model)
    if not layers:
        raise UserError(
            f"{type(model).__name__} names no decoder-layer class (_no_split_modules), so "
            "--data-parallel fsdp/hsdp cannot split it into units; use --data-parallel ddp"
        )
    policy = mixed_precision(precision, lora)
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
    names = set(getattr(model, "_no_split_modules", None) or ())  # a PeftModel forwards it
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
    dtype = weight_dtype(spec.precision, "lora" if spec.lora else "none")
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
    units = shard_model(model, mesh, spec.precision, spec.lora is not None)
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
