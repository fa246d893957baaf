"""What a sharded tensor is made of, for the components that store or exchange one: a leaf
module (torch only), so that ``checkpoint``, ``compression`` and ``optim`` handle FSDP2's
DTensors without testing types themselves.

Source: torch's DTensor, https://docs.pytorch.org/docs/stable/distributed.tensor.html.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``tensor`` (same dtype, sharing its storage; not detached): a
    DTensor's local shard (FSDP2 splits dim 0), any other tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The whole of ``tensor``: a DTensor gathered from every rank of its mesh (collective for
    a sharded one; a replicated one, such as a norm FSDP computed over the shards, is read
    locally), any other tensor itself."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def laid_out_like(tensor: torch.Tensor, parameter: torch.Tensor) -> torch.Tensor:
    """``tensor`` (``parameter``'s local shape) laid out as ``parameter``: a DTensor on the same
    mesh and placements sharing ``tensor``'s storage when ``parameter`` is one (so DCP saves
    every shard and loads into it in place), ``tensor`` itself otherwise."""
    if not isinstance(parameter, DTensor):
        return tensor
    return DTensor.from_local(
        tensor, parameter.device_mesh, parameter.placements, run_check=False,
        shape=parameter.shape, stride=parameter.stride(),
    )  # fmt: skip


def reshard_rows(pieces: list[torch.Tensor], shards: int, index: int) -> torch.Tensor:
    """Shard ``index`` of ``shards`` of the tensor whose dim-0 shards ``pieces`` are, in rank
    order, as FSDP2 splits a parameter (``torch.chunk`` along dim 0, ranks past the last chunk
    holding none of its rows): the pieces joined and cut again. A tensor of no dimension (a
    step count) is the first piece's."""
    if pieces[0].dim() == 0:
        return pieces[0]
    whole = torch.cat(pieces, dim=0)
    chunks = torch.chunk(whole, shards, dim=0)
    if index < len(chunks):
        return chunks[index].clone()
    return whole.new_empty((0, *whole.shape[1:]))
