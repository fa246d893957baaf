"""Replicas proven equal after a resume: every rank hashes the replicated state it loaded (the
tensors of the model and of the shared optimizer state) and the ranks compare the hashes in one
collective, so a rank that loaded something else (a damaged or stale file, a bug) stops the run
instead of training apart from the others.

Source of the idea: torchtitan's and Megatron-LM's consistency checks across data-parallel
replicas (a parameter checksum compared across ranks).
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Mapping

import torch
import torch.distributed as dist

from torchrun_ddp.checkpoint.adapters import Stateful
from torchrun_ddp.checkpoint.codec import split_tree
from torchrun_ddp.checkpoint.ranks import all_gather_json, rank_and_world
from torchrun_ddp.errors import UserError
from torchrun_ddp.faults import perturbed_note
from torchrun_ddp.parallel.shards import local_tensor

log = logging.getLogger("torchrun_ddp")


def state_digest(shared: Mapping[str, Stateful]) -> str:
    """SHA-256 (hex) of every tensor of ``{name: obj.state_dict()}`` (any dtype and device; its
    key, dtype, shape and bytes, by sorted key; a DTensor by this rank's shard). Copies each
    tensor to the CPU once."""
    tensors: dict[str, torch.Tensor] = {}
    split_tree({name: obj.state_dict() for name, obj in shared.items()}, "", tensors)
    digest = hashlib.sha256()
    for key in sorted(tensors):
        tensor = tensors[key].detach()
        tensor = local_tensor(tensor)
        tensor = tensor.cpu().contiguous().reshape(-1)
        digest.update(f"{key}|{tensor.dtype}|{tuple(tensors[key].shape)}|".encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def check_replicas(
    shared: Mapping[str, Stateful], source: str, groups: list[list[int]] | None = None
) -> None:
    """Collective (every rank, one all-gather): compare the ranks' ``state_digest`` of the
    replicated state just loaded from ``source`` (named in the line). ``groups``: the ranks that
    hold the same state (a sharded model: the ranks of one shard; default: every rank).

    Raises UserError on every rank, naming the ranks whose state differs from their group's
    first rank's, when any does."""
    started = time.perf_counter()
    mine = state_digest(shared)
    _, world = rank_and_world()
    every = [str(d) for d in all_gather_json(mine)] if dist.is_initialized() else [mine]
    groups = groups or [list(range(world))]
    differ = sorted(rank for group in groups for rank in group if every[rank] != every[group[0]])
    log.info("replicas compared after the resume in %.2f s", time.perf_counter() - started)
    if differ:
        ranks = ", ".join(map(str, differ))
        than = "rank 0" if len(groups) == 1 else "the first rank that holds the same shard"
        raise UserError(
            f"the replicas differ after loading {source}: rank(s) {ranks} hold other model or "
            f"optimizer state than {than}; check the ranks' --checkpoint-dir folders (a damaged "
            f"or stale copy) and restart{perturbed_note()}"
        )
