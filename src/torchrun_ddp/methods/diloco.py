"""DiLoCo (``--optimizer diloco``): every ``--local-steps`` the ranks all-reduce their
pseudo-gradients and step an outer Nesterov SGD (Douillard et al. 2023, arXiv:2311.08105;
``optim.diloco``). Defaults: H 500, outer lr 0.7, Nesterov momentum 0.9 (the paper, section
3)."""

from __future__ import annotations

import math

from torchrun_ddp.compression import diloco_payload_bytes
from torchrun_ddp.config import TrainConfig
from torchrun_ddp.methods.base import FP32, CheckpointBytes, MemoryRow, PlanSizes
from torchrun_ddp.methods.local_updates import LocalUpdatesMethod
from torchrun_ddp.optim import PSEUDO_GRADIENT_DTYPES, DiLoCo, LocalUpdateSettings


class DiLoCoMethod(LocalUpdatesMethod):
    """``--optimizer diloco``: its all-reduce has no node-aware form."""

    name = "diloco"
    summary = (
        "DiLoCo (Douillard et al. 2023): --local-steps of AdamW on each rank's own gradients, "
        "then an all-reduce of the pseudo-gradient and an outer Nesterov SGD step"
    )
    flags = (*LocalUpdatesMethod.flags, "outer_momentum", "pseudo_gradient_dtype")
    node_aware = False
    optimizer_class = DiLoCo
    paper_local_steps = 500
    paper_outer_lr = 0.7
    reads_outer_momentum = True

    @classmethod
    def site_problem(cls, config: TrainConfig) -> str:
        """DiLoCo syncs across sites at once (no --overlap-exchange yet)."""
        if config.overlap_exchange:
            return "DiLoCo syncs across sites without --overlap-exchange for now; drop it"
        return ""

    @classmethod
    def describe_exchange(cls, settings: LocalUpdateSettings) -> str:
        """``fp32 outer Nesterov 0.9 lr 0.7``: the wire dtype and the outer step."""
        momentum = f"Nesterov {settings.outer_momentum:g}" if settings.outer_momentum else "SGD"
        dtype = "bf16" if settings.pseudo_gradient_dtype == "bfloat16" else "fp32"
        return f"{dtype} outer {momentum} lr {settings.outer_lr:g}"

    @classmethod
    def exchange_rows(
        cls, settings: LocalUpdateSettings, shapes: list[tuple[int, ...]], world_size: int
    ) -> list[MemoryRow]:
        """The outer Nesterov momentum (4 N, when > 0) and, at a sync, the fp32 pseudo-gradient
        handed to the outer SGD (4 N) with its bf16 wire copy (2 N) under bf16; kept while the
        exchange runs with a sync delay."""
        numel = sum(map(math.prod, shapes))
        rows = []
        if settings.outer_momentum:
            rows.append(MemoryRow("outer Nesterov momentum (fp32)", 4 * numel, True))
        bf16 = settings.pseudo_gradient_dtype == "bfloat16"
        name = "sync: pseudo-gradient (fp32" + (", and its bf16 wire copy)" if bf16 else ")")
        wire = 2 * numel if bf16 else 0
        rows.append(MemoryRow(name, 4 * numel + wire, settings.sync_delay > 0))
        return rows

    def sync_payload(self, shapes: list[tuple[int, ...]]) -> tuple[str, float]:
        """An all-reduce of the pseudo-gradient in --pseudo-gradient-dtype."""
        dtype = PSEUDO_GRADIENT_DTYPES[self.settings.pseudo_gradient_dtype]
        return "all_reduce", diloco_payload_bytes(sum(map(math.prod, shapes)), dtype)

    def checkpoint_bytes(self, sizes: PlanSizes) -> CheckpointBytes:
        """The local-update state plus the replicated outer momentum (when > 0)."""
        base = super().checkpoint_bytes(sizes)
        outer = FP32 * sizes.trained if self.settings.outer_momentum else 0
        return CheckpointBytes(base.replicated + outer, base.per_rank)
