"""DeMo (``--optimizer demo``): each rank keeps its own momentum, sends its top-k DCT coefficients
per tile, and steps along the sign of the decoded mean (Peng, Quesnelle & Kingma 2024,
arXiv:2411.19870; ``optim.demo``). DDP keeps each rank's gradient (or its node's mean with
``--compression-scope inter-node``).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer

from torchrun_ddp.checkpoint import Stateful, load_rank_states
from torchrun_ddp.compression import TOPK_VALUE_DTYPES, CompressionState
from torchrun_ddp.config import TrainConfig
from torchrun_ddp.errors import UserError
from torchrun_ddp.methods.base import FP32, CheckpointBytes, PlanSizes
from torchrun_ddp.methods.exchanging import ExchangingMethod
from torchrun_ddp.optim import (
    DeMo,
    DemoSettings,
    LocalMomentum,
    build_demo,
    parameter_groups,
    validate_demo,
)
from torchrun_ddp.plan.communication import CommEstimate, Topology, demo_estimate
from torchrun_ddp.plan.settings import Footprint
from torchrun_ddp.sites import site_settings

if TYPE_CHECKING:
    from torchrun_ddp.sites.link import SiteLink

log = logging.getLogger("torchrun_ddp")

DEMO_STEP_COPIES = 5
"""fp32 copies of one parameter alive at once in DeMo's step: its momentum's DCT coefficients,
the sent coefficients and their inverse, then the decode's sum, sender count and inverse."""


def demo_settings(config: TrainConfig) -> DemoSettings:
    """DeMo's settings from the run's config (``--demo-*``); UserError for values out of range
    (``optim.validate_demo``)."""
    settings = DemoSettings(
        config.demo_beta, config.demo_topk, config.demo_tile_size, config.demo_value_dtype
    )
    try:
        validate_demo(settings)
    except ValueError as exc:  # validate_demo raises ValueError for bad settings only
        raise UserError(str(exc)) from exc
    return settings


class DeMoMethod(ExchangingMethod):
    """``--optimizer demo``: per-rank momentum as per-rank checkpoint state (rebuilt from zero
    when lost; reset at another world size), an update in flight with --overlap-exchange."""

    name = "demo"
    summary = (
        "DeMo (Peng et al. 2024): momentum on local gradients, top-k DCT coefficients per "
        "tile all-gathered, sign step (--learning-rate is then the sign step's size)"
    )
    flags = (
        "demo_topk",
        "demo_tile_size",
        "demo_beta",
        "demo_value_dtype",
        "overlap_exchange",
        "compression_scope",
    )

    def __init__(self, config: TrainConfig) -> None:
        super().__init__(config)
        self.settings = demo_settings(config)
        self._site_link: SiteLink | None = None

    @classmethod
    def site_problem(cls, config: TrainConfig) -> str:
        """DeMo exchanges across sites every step, flat and waited for."""
        if config.overlap_exchange:
            return "demo exchanges across sites without --overlap-exchange for now; drop it"
        if config.compression_scope != "global":
            return "demo exchanges across sites with --compression-scope global; drop it"
        return ""

    @classmethod
    def footprint(cls) -> Footprint:
        """One fp32 momentum per trained parameter, never sharded; its step transforms one
        parameter at a time (``DEMO_STEP_COPIES`` fp32 copies of the largest)."""
        return Footprint(
            moments=0, fp32_state=FP32, step_copies=DEMO_STEP_COPIES, label="DeMo",
            state="DeMo momentum", step="DeMo tile transforms, largest parameter", zero1=False,
        )  # fmt: skip

    @classmethod
    def check_config(cls, config: TrainConfig, given: frozenset[str] = frozenset()) -> None:
        """DeMo's ranges (whatever --optimizer is), then what DeMo cannot run with."""
        demo_settings(config)
        if config.optimizer == cls.name:
            cls.check_exchange(config)

    def build_optimizer(self, model: torch.nn.Module, compression: CompressionState) -> Optimizer:
        """``optim.build_demo`` over AdamW's two parameter groups."""
        config = self.config
        groups = parameter_groups(model, config.weight_decay)
        if config.fault_tolerance == "sites":
            return self._site_optimizer(groups, compression)
        group = self.exchange_group(compression)
        overlap = config.overlap_exchange
        return build_demo(groups, config.learning_rate, self.settings, compression, overlap, group)

    def _site_optimizer(
        self, groups: list[dict[str, object]], compression: CompressionState
    ) -> Optimizer:
        """DeMo whose all-gather spans the live sites every step, with its torchft Manager
        (``sites.demo``; imports torchft, about 3 s, so only for runs across sites)."""
        from torchrun_ddp.sites.demo import SiteDeMo  # noqa: PLC0415
        from torchrun_ddp.sites.link import SiteLink  # noqa: PLC0415

        config = self.config
        optimizer = SiteDeMo(
            groups, config.learning_rate, self.settings, process_group=compression.process_group,
            counter=compression.count,
        )  # fmt: skip
        optimizer.link = SiteLink(site_settings(config), dist.get_rank(), dist.get_world_size())
        self._site_link = optimizer.link
        return optimizer

    def before_forward(self) -> None:
        """Across fault-tolerant sites: start the step's quorum, so that the lighthouse's round
        trip overlaps forward and backward (``SiteLink.start_quorum``); nothing otherwise."""
        if self._site_link is not None:
            self._site_link.start_quorum()

    @property
    def demo(self) -> DeMo:
        """The built DeMo optimizer."""
        return cast("DeMo", self.optimizer)

    def flush(self) -> bool:
        """Apply the update in flight (--overlap-exchange)."""
        return self.demo.flush()

    def rank_state(
        self, model: DistributedDataParallel, shards_in_files: bool = False
    ) -> dict[str, Stateful]:
        """Each rank's momentum (and an update in flight) is its own."""
        return {"optimizer": LocalMomentum(self.demo)}

    def identity(self) -> dict[str, object]:
        """The exchange's layout: per-node shares and an update in flight must match."""
        return {"exchange": [self.config.compression_scope, self.config.overlap_exchange]}

    def identity_defaults(self) -> dict[str, object]:
        """Checkpoints from before --compression-scope and --overlap-exchange."""
        return {"exchange": ["global", False]}

    def rebuild_rank_state(self, path: Path, donors: list[int], lrs: list[float]) -> list[str]:
        """The momentum restarts from zero; hyperparameters and an update in flight come from a
        donor rank's files (or, without one, the schedule's learning rates ``lrs``)."""
        donor = load_rank_states(path, "optimizer", donors)[0] if donors else None
        LocalMomentum(self.demo).load_reset(cast("Mapping[str, object] | None", donor), lrs)
        return ["DeMo momentum reset to zero"]

    def load_resharded(
        self, model: DistributedDataParallel, path: Path, saved: Mapping[str, object], rank: int
    ) -> None:
        """Per-rank momentum saved by W ranks cannot be shared by W' ranks: it restarts."""
        log.warning(
            "DeMo momentum (and an --overlap-exchange update in flight) saved at another world "
            "size is reset to zero"
        )

    def describe(self) -> str:
        """E.g. ``demo k=32 tile 64``."""
        return f"demo k={self.settings.topk} tile {self.settings.tile}"

    def communication_rows(
        self, shapes: list[tuple[int, ...]], topo: Topology
    ) -> list[tuple[str, CommEstimate]]:
        """The run's own exchange (node-aware with --compression-scope inter-node, overlapped
        with --overlap-exchange), then the flat and node-aware exchanges it is not
        (``plan.communication.demo_estimate``)."""
        config, settings = self.config, self.settings
        dtype = TOPK_VALUE_DTYPES[settings.value_dtype]
        own = (config.compression_scope == "inter-node", config.overlap_exchange)
        rows = []
        for node_aware, overlap in [own, *[v for v in [(False, False), (True, False)] if v != own]]:
            name = self.describe() + (" inter-node" if node_aware else "")
            name += " overlapped" if overlap else ""
            comm = demo_estimate(
                shapes, settings.topk, settings.tile, dtype, topo, node_aware, overlap
            )
            rows.append((name, comm))
        return rows

    def heal_bytes(self, sizes: PlanSizes, shard: int) -> int:
        """Across sites: the trained parameters in the weights' dtype, this rank's ``shard``-th
        of them (the momentum is each rank's own and stays with it)."""
        return sizes.weight_bytes * sizes.trained // shard

    def checkpoint_bytes(self, sizes: PlanSizes) -> CheckpointBytes:
        """One fp32 momentum per trained parameter, per rank."""
        return CheckpointBytes(0, FP32 * sizes.trained)
