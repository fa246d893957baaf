"""The base of the methods whose optimizer runs its own exchange (DeMo, DiLoCo, SparseLoCo): DDP
keeps each rank's gradient, so no comm hook compresses it and ZeRO-1 cannot shard the state.
Under --data-parallel hsdp FSDP averages the gradient within a replica (a node's ranks) and the
optimizer exchanges this rank's shards across the replicas: each replica is one worker.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from torchrun_ddp.compression import CompressionSettings, CompressionState, ShardedExchange
from torchrun_ddp.config import TrainConfig
from torchrun_ddp.errors import UserError
from torchrun_ddp.methods.base import Method
from torchrun_ddp.parallel.modes import MODES, mode_class


class ExchangingMethod(Method):
    """A method whose optimizer exchanges itself: DDP's hook keeps each rank's gradient (or its
    node's mean) instead of averaging it (``Method.register_hook``'s default)."""

    node_aware: bool = True
    """Whether ``--compression-scope inter-node`` gives it a node-aware exchange."""

    @classmethod
    def refusing_modes(cls) -> tuple[str, ...]:
        """The modes without replicas to exchange between
        (``DataParallel.accepts_exchanging_methods``): fsdp."""
        return tuple(mode.name for mode in MODES.values() if not mode.accepts_exchanging_methods)

    @classmethod
    def check_exchange(cls, config: TrainConfig) -> None:
        """Raise UserError for settings an optimizer that communicates itself cannot run with:
        a mode without replicas to exchange between (``DataParallel.check_exchanging_method``),
        a comm hook on top, ZeRO-1, or a node-aware scope it has no exchange for."""
        mode_class(config.data_parallel).check_exchanging_method(cls.name, config)
        if config.compression_scope != "global" and not cls.node_aware:
            raise UserError(
                f"--compression-scope {config.compression_scope} works with --optimizer adamw, "
                f"demo or sparseloco, not {cls.name} (its all-reduce needs no node-aware "
                "exchange); use --compression-scope global"
            )
        if config.compression != "none":
            raise UserError(
                f"--optimizer {cls.name} does its own communication and cannot run on top of "
                f"--compression {config.compression}; use --compression none"
            )
        if config.zero1:
            raise UserError(
                f"--optimizer {cls.name} does not work with --zero1 (ZeRO-1 shards one "
                "optimizer state over ranks that step the same gradient; here each rank's state "
                "and update are its own); drop --zero1"
            )

    def exchanges_replicas(self, replicate_dim: bool) -> bool:
        """hsdp: the method exchanges the shards across replicas; FSDP stays in a replica."""
        return replicate_dim

    def register_sharded(
        self, model: torch.nn.Module, exchange: ShardedExchange, replicate: ProcessGroup | None
    ) -> CompressionState:
        """The state that counts FSDP's collectives within a replica every step and the
        method's own collectives over ``replicate`` (the group its optimizer exchanges in)."""
        settings = CompressionSettings(method="none")
        state = CompressionState(settings, model.parameters(), process_group=replicate)
        state.count_sharded_exchange(exchange, hooked=True)
        return state

    def exchange_group(self, compression: CompressionState) -> dist.ProcessGroup | None:
        """A process group of its own for a flat exchange that stays in flight across steps
        (--overlap-exchange), so that the loop's own collectives (the log step's all-reduce,
        evaluation, FSDP's) do not queue behind it on the same connections: the mode's
        (``DataParallel.new_exchange_group``: every rank, or under hsdp this rank's replicas;
        collective), else None (the compression state's group). Node-aware exchanges already
        cross the uplinks in their own inter-node group."""
        if not self.config.overlap_exchange or compression.node_groups is not None:
            return None
        if not dist.is_initialized():
            return None
        return self.mode.new_exchange_group() if self.mode is not None else dist.new_group()
