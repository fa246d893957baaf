"""DiLoCo (``--optimizer diloco``): every ``--local-steps`` the ranks all-reduce their
pseudo-gradients and step an outer Nesterov SGD (Douillard et al. 2023, arXiv:2311.08105;
``optim.local_updates``)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path

import torch
from torch.distributed import ProcessGroup

from torchrun_ddp.compression import (
    CompressionSettings,
    CompressionState,
    ShardedExchange,
    diloco_payload_bytes,
)
from torchrun_ddp.errors import UserError
from torchrun_ddp.methods.base import FP32, CheckpointBytes, PlanSizes
from torchrun_ddp.methods.local_updates import LocalUpdatesMethod
from torchrun_ddp.optim import PSEUDO_GRADIENT_DTYPES


class DiLoCoMethod(LocalUpdatesMethod):
    """``--optimizer diloco``: its all-reduce has no node-aware form. Under --data-parallel hsdp
    each replica (a node's ranks, FSDP within it) is one DiLoCo worker: the inner AdamW steps
    the shards on the replica's gradient, and a sync all-reduces each rank's pseudo-gradient
    shard over the replicate group (torchft's DiLoCo on ``p.to_local()``, INTELLECT-1's FSDP
    inside a node and DiLoCo across)."""

    name = "diloco"
    flags = (*LocalUpdatesMethod.flags, "outer_momentum", "pseudo_gradient_dtype")
    node_aware = False
    on_shards = True

    def exchanges_replicas(self, mesh_dims: int) -> bool:
        """hsdp: the sync exchanges the shards across replicas; FSDP stays in a replica."""
        return mesh_dims == 2

    def register_sharded(
        self, model: torch.nn.Module, exchange: ShardedExchange, replicate: ProcessGroup | None
    ) -> CompressionState:
        """The state that counts FSDP's collectives within a replica every step and the syncs'
        all-reduces over ``replicate`` (the group the optimizer then syncs in)."""
        settings = CompressionSettings(method="none")
        state = CompressionState(settings, model.parameters(), process_group=replicate)
        state.count_sharded_exchange(exchange, hooked=True)
        return state

    def load_resharded(
        self, model: torch.nn.Module, path: Path, saved: Mapping[str, object], rank: int
    ) -> None:
        """Under hsdp the inner state is shard-shaped: refused at another world size."""
        if self.config.data_parallel != "ddp":
            raise UserError(
                f"{path} was saved by {saved['world_size']} ranks; --optimizer diloco under "
                "--data-parallel hsdp resumes at the saved world size only; start with "
                "that many ranks"
            )
        super().load_resharded(model, path, saved, rank)  # type: ignore[arg-type]

    def sync_payload(self, shapes: list[tuple[int, ...]]) -> tuple[str, float]:
        """An all-reduce of the pseudo-gradient in --pseudo-gradient-dtype."""
        dtype = PSEUDO_GRADIENT_DTYPES[self.settings.pseudo_gradient_dtype]
        return "all_reduce", diloco_payload_bytes(sum(map(math.prod, shapes)), dtype)

    def checkpoint_bytes(self, sizes: PlanSizes) -> CheckpointBytes:
        """The local-update state plus the replicated outer momentum (when > 0)."""
        base = super().checkpoint_bytes(sizes)
        outer = FP32 * sizes.trained if self.settings.outer_momentum else 0
        return CheckpointBytes(base.replicated + outer, base.per_rank)
