"""AdamW in DDP with a comm hook (``--compression``: none, bf16, fp16, PowerSGD, ``dct``,
``dct-topk``), optionally ZeRO-1 (``--zero1``).

DDP averages the gradients in backward through the hook (``compression.register_compression``);
every rank then steps the same AdamW (Loshchilov & Hutter 2019), whose state is the same on every
rank and saved once, or with ZeRO-1 (Rajbhandari et al. 2020) sharded over the ranks and saved by
parameter through DCP so that it loads at any world size.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer

from torchrun_ddp.checkpoint import (
    ShardedOptimizer,
    Stateful,
    load_owned_shards,
    load_rank_states,
)
from torchrun_ddp.compression import (
    CompressionSettings,
    CompressionState,
    ReplicaExchange,
    ShardedExchange,
    compression_settings,
    register_compression,
)
from torchrun_ddp.config import TrainConfig
from torchrun_ddp.errors import UserError
from torchrun_ddp.methods.base import (
    FP32,
    CheckpointBytes,
    Method,
    Owners,
    PlanSizes,
    refuse_unused,
)
from torchrun_ddp.optim import build_optimizer
from torchrun_ddp.plan.communication import (
    CommEstimate,
    Topology,
    estimate,
    label,
    powersgd_factor_numel,
)
from torchrun_ddp.sites import site_settings

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping

    from torchrun_ddp.distributed import NodeGroups
    from torchrun_ddp.sites.link import SiteLink


_DCT = ("dct", "dct-topk")
COMPRESSION_FLAGS: Owners = {
    "compression_ratio": ("compression", ("dct",)),
    "compression_selection": ("compression", ("dct",)),
    "compression_block_size": ("compression", _DCT),
    "compression_value_dtype": ("compression", _DCT),
    "compression_error_feedback": ("compression", _DCT),
    "compression_topk": ("compression", ("dct-topk",)),
    "powersgd_rank": ("compression", ("powersgd",)),
    "compression_start_step": ("compression", (*_DCT, "fp16", "bf16", "powersgd")),
}
"""The comm hooks' own flags and the --compression values that read them (``compression``'s
``CompressionSettings``)."""


class AdamWMethod(Method):
    """``--optimizer adamw``: DDP's all-reduce through the ``--compression`` comm hook, then AdamW
    (fused, foreach or for-loop), optionally ZeRO-1. ``hook``: the comm hook's settings."""

    name = "adamw"
    summary = "AdamW on the gradients DDP averages (through --compression)"
    flags = ("adamw_implementation", "compression_scope")

    def __init__(self, config: TrainConfig) -> None:
        super().__init__(config)
        self.hook: CompressionSettings = compression_settings(config)
        self._replicas: ReplicaExchange | None = None
        self._site_exchange: Callable[[], None] | None = None
        """Across fault-tolerant sites: ``SiteAdamW.exchange``, called after backward."""
        self._site_link: SiteLink | None = None

    @classmethod
    def check_config(cls, config: TrainConfig, given: frozenset[str] = frozenset()) -> None:
        """The comm hook's settings (``compression.validate_settings``), whatever --optimizer;
        a hook's flag given under a --compression that does not read it."""
        compression_settings(config)
        refuse_unused(config, given, COMPRESSION_FLAGS)
        if config.overlap_exchange and config.optimizer == cls.name:
            raise UserError(
                "--overlap-exchange delays the exchange of --optimizer demo, diloco or "
                "sparseloco and does nothing for adamw (DDP already overlaps backward); drop it"
            )

    @classmethod
    def site_problem(cls, config: TrainConfig) -> str:
        """AdamW exchanges across sites every step: dense fp32 gradients, or through any comm
        hook over the live sites; under hsdp each rank's shard."""
        if config.zero1:
            return "adamw exchanges across sites without --zero1 for now; drop it"
        if config.compression_scope != "global":
            return (
                "--compression-scope inter-node does not exchange across sites (the sites are "
                "the slow links already); use --compression-scope global"
            )
        return ""

    def register_hook(
        self, ddp_model: DistributedDataParallel, node_groups: NodeGroups | None
    ) -> CompressionState:
        """The ``--compression`` comm hook (``compression.register_compression``). Across
        fault-tolerant sites DDP averages inside the site with its own all-reduce, and the
        hook's state (counting those bytes) serves the exchange across sites."""
        if self.config.fault_tolerance != "sites":
            return register_compression(ddp_model, self.hook, node_groups=node_groups)
        state = CompressionState(self.hook, ddp_model.parameters())
        state.count_builtin_all_reduce(ddp_model.parameters())
        return state

    def exchanges_replicas(self, replicate_dim: bool) -> bool:
        """hsdp with a --compression hook: the hook exchanges the shards across replicas (across
        fault-tolerant sites the replicas are the sites, one per site: ``register_sharded``)."""
        return replicate_dim and self.hook.method != "none"

    def register_sharded(
        self, model: torch.nn.Module, exchange: ShardedExchange, replicate: ProcessGroup | None
    ) -> CompressionState:
        """FSDP reduce-scatters the gradients (and, without ``replicate``, all-reduces the shards
        over the replicate group under hsdp); the state counts those bytes analytically
        (``CompressionState.count_sharded_exchange``). With ``replicate`` (hsdp with a
        --compression hook) the hook averages the shards over that group after each step's
        backward (``compression.ReplicaExchange``, :meth:`after_backward`) and its state counts
        the hook's bytes on top of FSDP's within the shard group. Across fault-tolerant sites
        the hook runs between the sites (``sites.adamw``), so a site holds one replica; raises
        UserError for more."""
        if replicate is not None and self.config.fault_tolerance == "sites":
            if dist.get_world_size(replicate) > 1:
                raise UserError(
                    f"--compression {self.hook.method} across sites exchanges between the "
                    "sites, one hsdp replica each; set --shard-degree to the ranks of a site, "
                    "or use --compression none"
                )
            replicate = None  # the hook runs across sites (``sites.adamw``)
        if replicate is None:
            state = CompressionState(self.hook, model.parameters())
            state.count_sharded_exchange(exchange)
            return state
        cap = round(self.config.ddp_bucket_cap_mb * 2**20)
        self._replicas = ReplicaExchange.over(self.hook, list(model.parameters()), replicate, cap)
        self._replicas.state.count_sharded_exchange(exchange, hooked=True)
        return self._replicas.state

    def before_forward(self) -> None:
        """Across fault-tolerant sites: start the step's quorum, so that the lighthouse's round
        trip overlaps forward and backward (``SiteLink.start_quorum``); nothing otherwise."""
        if self._site_link is not None:
            self._site_link.start_quorum()

    def after_backward(self) -> None:
        """hsdp with a comm hook: average the gradient shards over the replicate group,
        compressed (collective); across fault-tolerant sites: the site means over the live sites
        (``sites.adamw.SiteAdamW.exchange``); nothing otherwise (DDP's hook and FSDP ran in
        backward)."""
        if self._replicas is not None:
            self._replicas.average()
        if self._site_exchange is not None:
            self._site_exchange()

    def build_optimizer(self, model: torch.nn.Module, compression: CompressionState) -> Optimizer:
        """torch's AdamW over two parameter groups (``optim.build_optimizer``), ZeRO-1 with
        --zero1."""
        config = self.config
        if config.fault_tolerance == "sites":
            return self._site_optimizer(model, compression)
        return build_optimizer(
            model,
            config.learning_rate,
            config.weight_decay,
            implementation=config.adamw_implementation,
            zero1=config.zero1,
        )

    def _site_optimizer(self, model: torch.nn.Module, compression: CompressionState) -> Optimizer:
        """AdamW whose gradients are averaged over the live sites every step, with its torchft
        Manager (``sites.adamw``; imports torchft, about 3 s, so only for runs across sites),
        through the --compression hook (its state ``compression``) where one is set."""
        from torchrun_ddp.sites.adamw import SiteAdamW  # noqa: PLC0415
        from torchrun_ddp.sites.link import SiteLink  # noqa: PLC0415

        config = self.config
        optimizer = build_optimizer(
            model, config.learning_rate, config.weight_decay,
            implementation=config.adamw_implementation, optimizer_class=SiteAdamW,
        )  # fmt: skip
        assert isinstance(optimizer, SiteAdamW)
        optimizer.link = SiteLink(site_settings(config), dist.get_rank(), dist.get_world_size())
        optimizer.counts = compression
        if self.hook.method != "none":
            cap = round(config.ddp_bucket_cap_mb * 2**20)
            optimizer.replicas = ReplicaExchange(compression, list(model.parameters()), cap)
        self._site_exchange, self._site_link = optimizer.exchange, optimizer.link
        return optimizer

    @property
    def zero1(self) -> ZeroRedundancyOptimizer | None:
        """The ZeRO-1 optimizer, or None without --zero1."""
        optimizer = self.optimizer
        return optimizer if isinstance(optimizer, ZeroRedundancyOptimizer) else None

    def shared_optimizer(self) -> Optimizer | None:
        """AdamW's state is the same on every rank, unless ZeRO-1 shards it."""
        return None if self.config.zero1 else self.optimizer

    def rank_state(
        self, model: DistributedDataParallel, shards_in_files: bool = False
    ) -> dict[str, Stateful]:
        """ZeRO-1: this rank's shard (its hyperparameters; with ``shards_in_files``, as with
        several checkpoint folders, its tensors too)."""
        sharded = self.zero1
        if sharded is None:
            return {}
        return {"optimizer": ShardedOptimizer(sharded, model, shards_in_files)}

    def sharded_state(
        self, model: DistributedDataParallel, shards_in_files: bool = False
    ) -> dict[str, ShardedOptimizer]:
        """ZeRO-1 state by parameter through DCP, unless it goes in the ranks' files."""
        sharded = self.zero1
        if shards_in_files or sharded is None:
            return {}
        return {"optimizer": ShardedOptimizer(sharded, model)}

    def checkpoint_meta(self, shards_in_files: bool) -> dict[str, object]:
        """Whether this checkpoint's ZeRO-1 shards are in the ranks' files."""
        return {"zero1_in_rank_files": shards_in_files and self.config.zero1}

    def shards_in_rank_files(self, saved: Mapping[str, object]) -> bool:
        """A checkpoint's ZeRO-1 shards are in the ranks' files where its meta says so."""
        return bool(saved.get("zero1_in_rank_files"))

    def rebuild_problem(self) -> str:
        """A ZeRO-1 shard cannot be rebuilt; AdamW's replicated state needs no rebuilding."""
        return "a ZeRO-1 optimizer shard cannot be rebuilt" if self.config.zero1 else ""

    def load_resharded(
        self, model: DistributedDataParallel, path: Path, saved: Mapping[str, object], rank: int
    ) -> None:
        """ZeRO-1 at another world size: hyperparameters as rank 0's (the tensors came through
        DCP, or from the ranks' files when a folder per node held them)."""
        sharded = self.zero1
        if sharded is None:
            return
        adapter = ShardedOptimizer(sharded, model)
        adapter.load_state_dict(cast("Mapping", load_rank_states(path, "optimizer", [0])[0]))
        if saved.get("zero1_in_rank_files"):
            load_owned_shards(path, adapter)

    def describe(self) -> str:
        """The comm hook's label, e.g. ``dct 0.25 bf16``."""
        return label(self.hook)

    def plan_hooks(self) -> list[CompressionSettings]:
        """The run's --compression leads the communication plan."""
        return [self.hook]

    def step_estimate(
        self, shapes: list[tuple[int, ...]], topo: Topology, bucket_bytes: float
    ) -> CommEstimate:
        """The comm hook's all-reduce per step (``plan.communication.estimate``)."""
        sizes = [math.prod(shape) for shape in shapes]
        return estimate(self.hook, sizes, topo, shapes, bucket_bytes)

    def heal_bytes(self, sizes: PlanSizes, shard: int) -> int:
        """Across sites: the trained parameters and AdamW's two moments in the weights' dtype,
        this rank's ``shard``-th of them, and with ``powersgd`` its P and Q memories (fp32) of
        this rank's shards (``sizes.shapes``: a matrix ``[n, m]`` sharded ``[ceil(n / shard),
        m]`` by FSDP2 keeps ``(ceil(n / shard) + m) r`` values, rank 0's the largest)."""
        factors = 0
        if self.hook.method == "powersgd":
            factors = FP32 * powersgd_factor_numel(sizes.shapes, self.hook.powersgd_rank)
        return 3 * sizes.weight_bytes * sizes.trained // shard + factors

    def checkpoint_bytes(self, sizes: PlanSizes) -> CheckpointBytes:
        """AdamW's two moments in the weights' dtype: replicated, or a 1/W share per rank."""
        moments = 2 * sizes.weight_bytes * sizes.trained
        if self.config.zero1:
            return CheckpointBytes(0, moments // sizes.world_size)
        return CheckpointBytes(moments, 0)
