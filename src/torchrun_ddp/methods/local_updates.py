"""The base of DiLoCo and SparseLoCo as methods: an inner AdamW stepped on each rank's own
gradient, a sync every ``--local-steps`` (``optim.local_updates``), the synced parameters and
outer state replicated in checkpoints, each rank's inner state its own.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, cast

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer

from torchrun_ddp.checkpoint import Stateful, load_rank_states
from torchrun_ddp.compression import CompressionState, ShardedExchange
from torchrun_ddp.config import TrainConfig
from torchrun_ddp.errors import UserError
from torchrun_ddp.methods.base import FP32, CheckpointBytes, MemoryRow, PlanSizes
from torchrun_ddp.methods.exchanging import ExchangingMethod
from torchrun_ddp.methods.local_update_memory import kept_rows
from torchrun_ddp.optim import (
    LocalUpdates,
    LocalUpdateSettings,
    RankState,
    SyncedState,
    build_optimizer,
    outer_sgd,
    validate_local_updates,
)
from torchrun_ddp.parallel.shards import reshard_rows
from torchrun_ddp.plan.communication import (
    CommEstimate,
    Topology,
    demo_estimate,
    local_update_estimates,
)
from torchrun_ddp.plan.settings import Footprint
from torchrun_ddp.sites import site_settings

if TYPE_CHECKING:
    from collections.abc import Callable

log = logging.getLogger("torchrun_ddp")


class LocalUpdatesMethod(ExchangingMethod):
    """DiLoCo's and SparseLoCo's shared answers; ``settings``: ``optim.LocalUpdateSettings``,
    from the config with this method's defaults (``settings_of``). A subclass names its
    optimizer (``optimizer_class``: the exchange), its paper's defaults, its outer momentum,
    its description (``describe_exchange``) and its sync's memory (``exchange_rows``); it may
    build its own inner and outer optimizers (``inner_optimizer``, ``outer_optimizer``), which
    the optimizer is handed (as torchft's DiLoCo is).

    Under --data-parallel hsdp each replica (a node's ranks, FSDP within it) is one worker: the
    inner AdamW steps the shards on the replica's gradient, and a sync exchanges each rank's
    pseudo-gradient shard over the replicate group (torchft's DiLoCo on ``p.to_local()``;
    INTELLECT-1 ran FSDP inside a node and DiLoCo across)."""

    flags = (
        "local_steps",
        "outer_lr",
        "overlap_exchange",
        "sync_delay",
        "eager_updates",
        "adamw_implementation",
    )

    optimizer_class: ClassVar[type[LocalUpdates]] = LocalUpdates
    """The optimizer that runs the sync (its exchange of the pseudo-gradient)."""
    paper_local_steps: ClassVar[int] = 1
    """H when --local-steps is 0: the method's paper's."""
    paper_outer_lr: ClassVar[float] = 1.0
    """The outer learning rate when --outer-lr is 0: the method's paper's."""
    reads_outer_momentum: ClassVar[bool] = False
    """Whether its outer optimizer takes --outer-momentum (Nesterov); 0 otherwise."""

    def __init__(self, config: TrainConfig) -> None:
        super().__init__(config)
        self.settings: LocalUpdateSettings = self.settings_of(config)
        self._sharded = False

    @classmethod
    def settings_of(cls, config: TrainConfig) -> LocalUpdateSettings:
        """This method's settings from the run's config: ``0`` for --local-steps and --outer-lr
        means the paper's value, --outer-momentum only where the method reads it, a sync delay
        (--sync-delay, or a whole window) under --overlap-exchange. Raises UserError for
        values that do not fit together."""
        settings = cls.unchecked_settings(config)
        try:
            validate_local_updates(settings)
        except ValueError as exc:  # validate_local_updates raises ValueError for bad settings only
            raise UserError(f"--optimizer {cls.name}: {exc}") from exc
        return settings

    @classmethod
    def unchecked_settings(cls, config: TrainConfig) -> LocalUpdateSettings:
        """``settings_of`` without the checks (the flags' ranges are checked for every
        method)."""
        local_steps = config.local_steps or cls.paper_local_steps
        return LocalUpdateSettings(
            method=cls.name,
            local_steps=local_steps,
            outer_lr=config.outer_lr or cls.paper_outer_lr,
            outer_momentum=config.outer_momentum if cls.reads_outer_momentum else 0.0,
            pseudo_gradient_dtype=config.pseudo_gradient_dtype,
            topk=config.sparseloco_topk,
            chunk=config.sparseloco_chunk,
            beta=config.sparseloco_beta,
            quant_bits=config.quant_bits,
            sync_delay=(config.sync_delay or local_steps) if config.overlap_exchange else 0,
            quantizer=config.sparseloco_quantizer,
            aggregate=config.sparseloco_aggregate,
            clip=config.sparseloco_clip,
            eager=config.eager_updates,
        )

    @classmethod
    def footprint(cls) -> Footprint:
        """The inner AdamW's (two moments); ZeRO-1 cannot shard a state each rank steps on its
        own gradient. The synced copy and the outer state are ``memory_rows``."""
        return Footprint(zero1=False)

    def register_sharded(
        self, model: torch.nn.Module, exchange: ShardedExchange, replicate: ProcessGroup | None
    ) -> CompressionState:
        """``ExchangingMethod.register_sharded``, remembering that the model is sharded (its
        inner state is then shard-shaped)."""
        self._sharded = True
        return super().register_sharded(model, exchange, replicate)

    def load_resharded(
        self, model: torch.nn.Module, path: Path, saved: Mapping[str, object], rank: int
    ) -> None:
        """Each new replica (a rank under ddp) takes an old one's inner state, re-split to its
        shard under hsdp (``_load_resharded``); the rest restarts (``RankState
        .load_resharded``), with a warning."""
        old_ranks, states = self._old_replica(path, saved, rank)
        merged = self._resharded(states, rank) if self._sharded else states[0]
        dropped = RankState(self.local_updates).load_resharded(merged)
        log.warning(
            "local updates at another world size: inner optimizer state of old rank(s) %s",
            ", ".join(map(str, old_ranks)),
        )
        for line in dropped:
            log.warning("local updates at another world size: dropped %s", line)

    @classmethod
    def check_config(cls, config: TrainConfig, given: frozenset[str] = frozenset()) -> None:
        """The local-update flags' ranges (``check_local_update_ranges``, whatever --optimizer
        is) and, when ``config`` chooses this method, the overlap flags and what it cannot run
        with."""
        check_local_update_ranges(config)
        if config.optimizer == cls.name:
            check_overlap_flags(config)
            cls.check_exchange(config)

    def build_optimizer(self, model: torch.nn.Module, compression: CompressionState) -> Optimizer:
        """The method's inner optimizer (``inner_optimizer``) in its ``optimizer_class``, which
        syncs over the exchange group (``exchange_group``, else the compression state's) and
        builds the outer optimizer with ``outer_optimizer``."""
        log.info("local updates: %s", self.describe())
        group = self.exchange_group(compression) or compression.process_group
        built = self.optimizer_class
        if self.config.fault_tolerance == "sites":
            built = self._site_class()
        optimizer = built(
            self.inner_optimizer(model), self.settings, group, compression.count,
            compression.node_groups, outer=self.outer_optimizer(),
        )  # fmt: skip
        if self.config.fault_tolerance == "sites":
            self._link(optimizer)
        return optimizer

    def _site_class(self) -> type[LocalUpdates]:
        """The optimizer class whose sync spans the live sites (``sites.sync``; imports
        torchft, about 3 s, so only for runs across sites)."""
        from torchrun_ddp.sites.sync import site_optimizer_class  # noqa: PLC0415

        return site_optimizer_class(self.optimizer_class)

    def _link(self, optimizer: LocalUpdates) -> None:
        """Give ``optimizer`` (a ``sites.SiteSync``) its torchft Manager (``sites.SiteLink``)."""
        from torchrun_ddp.sites.link import SiteLink  # noqa: PLC0415
        from torchrun_ddp.sites.sync import SiteSync  # noqa: PLC0415

        assert isinstance(optimizer, SiteSync)
        optimizer.link = SiteLink(
            site_settings(self.config), dist.get_rank(), dist.get_world_size()
        )

    def inner_optimizer(self, model: torch.nn.Module) -> Optimizer:
        """AdamW over the model's two parameter groups (``optim.build_optimizer``)."""
        config = self.config
        return build_optimizer(
            model,
            config.learning_rate,
            config.weight_decay,
            implementation=config.adamw_implementation,
        )

    def outer_optimizer(self) -> Callable[[list[torch.Tensor]], Optimizer]:
        """Builds the outer optimizer over the synced copies: SGD at the outer learning rate,
        with Nesterov momentum where the method reads --outer-momentum (``optim.outer_sgd``)."""
        return outer_sgd(self.settings)

    @property
    def local_updates(self) -> LocalUpdates:
        """The built optimizer."""
        return cast("LocalUpdates", self.optimizer)

    def flush(self) -> bool:
        """Apply an overlapped sync's outer update still pending."""
        return self.local_updates.flush()

    def end_warning(self) -> str:
        """Training that ends between two syncs evaluates the ranks' own parameters."""
        position = self.local_updates.position
        if not position:
            return ""
        return (
            f"training ends {position} steps after the last sync: the last evaluation averages "
            "the ranks' own parameters and rank 0's are exported; end on a multiple of "
            f"--local-steps ({self.settings.local_steps}) for the synchronised model"
        )

    def shared_state(self) -> dict[str, Stateful]:
        """The synced parameters, outer state and window position (``optim.SyncedState``)."""
        return {"outer": SyncedState(self.local_updates)}

    def rank_state(
        self, model: DistributedDataParallel, shards_in_files: bool = False
    ) -> dict[str, Stateful]:
        """Each rank's inner AdamW, local parameters inside a window, error feedback."""
        return {"optimizer": RankState(self.local_updates)}

    def identity(self) -> dict[str, object]:
        """The outer state's tensors must match."""
        settings = self.settings
        return {
            "outer_momentum": bool(settings.outer_momentum),
            "sync_delay": settings.sync_delay,
            "eager": settings.eager,
        }

    def identity_defaults(self) -> dict[str, object]:
        """Checkpoints from before --sync-delay and --eager-updates."""
        return {"sync_delay": 0, "eager": False}

    def rebuild_problem(self) -> str:
        """The inner optimizer's state exists nowhere else."""
        return f"the {self.name} inner optimizer state cannot be rebuilt"

    def _old_replica(
        self, path: Path, saved: Mapping[str, object], rank: int
    ) -> tuple[list[int], list[Mapping[str, object]]]:
        """The old ranks whose inner state this rank continues, and their per-rank states: under
        ddp old rank ``r mod W_old``; sharded, every rank of old replica ``j mod R_old`` (``j``
        this rank's replica; the meshes from the mode and the checkpoint's ``mesh``). Raises
        UserError for a sharded checkpoint that does not record its mesh."""
        world = int(cast("int", saved["world_size"]))
        old_ranks = [rank % world]
        if self._sharded:
            mesh = saved.get("mesh")
            if not isinstance(mesh, list) or self.mode is None:
                raise UserError(
                    f"{path} does not record the mesh it was saved on; --optimizer {self.name} "
                    f"under --data-parallel hsdp resumes it at its world size ({world}) only"
                )
            replicas, shards = (int(size) for size in mesh)
            first = rank // self.mode.shape.shard % replicas * shards
            old_ranks = list(range(first, first + shards))
        states = load_rank_states(path, "optimizer", old_ranks)
        return old_ranks, [cast("Mapping[str, object]", state) for state in states]

    def _resharded(self, states: list[Mapping[str, object]], rank: int) -> Mapping[str, object]:
        """One replica's per-rank states (its shards, in rank order) as this rank's: each inner
        state tensor joined along dim 0 and cut to this rank's shard
        (``parallel.shards.reshard_rows``); the rest as the first rank's."""
        assert self.mode is not None
        shards, index = self.mode.shape.shard, rank % self.mode.shape.shard
        inners = [cast("Mapping[str, Mapping[str, object]]", s["inner"]) for s in states]
        joined: dict[str, dict[str, object]] = {}
        for key, values in cast("Mapping[str, Mapping[str, object]]", inners[0]["state"]).items():
            pieces = [cast("Mapping[str, object]", inner["state"][key]) for inner in inners]
            joined[key] = {
                name: reshard_rows([cast(torch.Tensor, p[name]) for p in pieces], shards, index)
                if isinstance(value, torch.Tensor)
                else value
                for name, value in values.items()
            }
        return {**states[0], "inner": {**inners[0], "state": joined}}

    def describe(self) -> str:
        """One line, e.g. ``sparseloco H=15 k=64/4096 2-bit beta 0.95 lr 1``
        (``describe_settings``)."""
        return self.describe_settings(self.settings)

    @classmethod
    def describe_settings(cls, settings: LocalUpdateSettings) -> str:
        """``<name> H=<local steps> <the exchange>`` (``describe_exchange``), then ``overlapped
        tau=<delay>`` and ``eager`` where they apply."""
        tail = f" overlapped tau={settings.sync_delay}" if settings.sync_delay else ""
        tail += " eager" if settings.eager else ""
        head = f"{settings.method} H={settings.local_steps}"
        return f"{head} {cls.describe_exchange(settings)}{tail}"

    @classmethod
    def describe_exchange(cls, settings: LocalUpdateSettings) -> str:
        """The exchange and outer step for ``describe_settings`` (each subclass)."""
        raise NotImplementedError

    def sync_payload(self, shapes: list[tuple[int, ...]]) -> tuple[str, float]:
        """(collective, bytes per rank) of one sync (each subclass)."""
        raise NotImplementedError

    def node_aware_numel(self, shapes: list[tuple[int, ...]]) -> int:
        """Trained parameters when the sync is node-aware (``plan.local_update_estimates``)."""
        return 0

    def communication_rows(
        self, shapes: list[tuple[int, ...]], topo: Topology
    ) -> list[tuple[str, CommEstimate]]:
        """One sync, its share of a step (``plan.local_update_estimates``), then DeMo at its
        defaults (k 32, 64 x 64 tiles, bf16) for comparison."""
        settings = self.settings
        collective, payload = self.sync_payload(shapes)
        numel = self.node_aware_numel(shapes)
        sync, per_step = local_update_estimates(
            collective, payload, settings.local_steps, topo, numel, settings.sync_delay
        )
        demo = demo_estimate(shapes, 32, 64, torch.bfloat16, topo)
        name = self.describe() + (" inter-node" if numel else "")
        return [
            (f"{name}: one sync", sync),
            (f"{name}: per step (sync / {settings.local_steps})", per_step),
            ("demo k=32 tile 64 (default, for comparison)", demo),
        ]

    def step_estimate(
        self, shapes: list[tuple[int, ...]], topo: Topology, bucket_bytes: float
    ) -> CommEstimate:
        """The sync's share of one step."""
        return self.communication_rows(shapes, topo)[1][1]

    def memory_rows(self, sizes: PlanSizes) -> list[MemoryRow]:
        """``rows`` of this run's settings for ``sizes``."""
        shapes = list(sizes.shapes)
        return self.rows(self.settings, shapes, sizes.world_size, sizes.weight_bytes)

    @classmethod
    def rows(
        cls,
        settings: LocalUpdateSettings,
        shapes: list[tuple[int, ...]],
        world_size: int,
        param_bytes: int = 4,
    ) -> list[MemoryRow]:
        """What the method holds per rank beyond the inner optimizer, for trained parameters of
        ``shapes``: the rows every local-update method keeps (``local_update_memory.kept_rows``:
        the synced copy, with a delay the sync's start, eager updates' terms), then the
        subclass's (``exchange_rows``)."""
        rows = kept_rows(settings, shapes, param_bytes)
        return rows + cls.exchange_rows(settings, shapes, world_size)

    @classmethod
    def exchange_rows(
        cls, settings: LocalUpdateSettings, shapes: list[tuple[int, ...]], world_size: int
    ) -> list[MemoryRow]:
        """The memory of the method's outer state and its sync (each subclass)."""
        raise NotImplementedError

    def checkpoint_bytes(self, sizes: PlanSizes) -> CheckpointBytes:
        """Replicated: the synced fp32 copy. Per rank: the inner optimizer's state (``footprint``)
        and, inside a window, the local parameters (the largest case)."""
        share = sizes.matrices / sizes.trained if sizes.trained else 0.0
        moments = round(self.footprint().state_bytes(sizes.weight_bytes, share) * sizes.trained)
        own = moments + sizes.weight_bytes * sizes.trained
        return CheckpointBytes(FP32 * sizes.trained, own)


def local_update_names() -> str:
    """The methods that take local updates (the subclasses of :class:`LocalUpdatesMethod` with a
    name), as ``diloco or sparseloco``, for messages."""
    found: list[str] = []
    pending = list(LocalUpdatesMethod.__subclasses__())
    while pending:
        method = pending.pop()
        pending.extend(method.__subclasses__())
        found += [method.name] if method.name else []
    names = sorted(set(found))
    return " or ".join([", ".join(names[:-1]), names[-1]] if len(names) > 1 else names)


def check_overlap_flags(config: TrainConfig) -> None:
    """Raise UserError for --sync-delay or --eager-updates without --overlap-exchange, and eager
    updates with a node-aware scope (checked for the local-update method a run chooses)."""
    names = local_update_names()
    if config.sync_delay and not config.overlap_exchange:
        raise UserError(
            "--sync-delay sets when an overlapped local-update sync lands; use it with "
            f"--optimizer {names} and --overlap-exchange, or drop it"
        )
    if config.eager_updates and not config.overlap_exchange:
        raise UserError(
            "--eager-updates changes an overlapped local-update sync; use it with "
            f"--optimizer {names} and --overlap-exchange, or drop it"
        )
    if config.eager_updates and config.compression_scope != "global":
        raise UserError(
            "--eager-updates works with --compression-scope global (a node-aware sync's own "
            "part is split over the node's ranks); use --compression-scope global"
        )


def check_local_update_ranges(config: TrainConfig) -> None:
    """Raise UserError for the local-update flags out of range (checked whatever --optimizer
    is, as every flag's range is)."""
    if config.sync_delay < 0:
        raise UserError(f"--sync-delay must be >= 0 (0: a whole window), got {config.sync_delay}")
    if config.local_steps < 0 or config.outer_lr < 0 or not 0.0 <= config.outer_momentum < 1.0:
        raise UserError(
            f"--local-steps and --outer-lr must be >= 0 (0: the paper's) and --outer-momentum in "
            f"[0, 1), got {config.local_steps}, {config.outer_lr} and {config.outer_momentum}"
        )
