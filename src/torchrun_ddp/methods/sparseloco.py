"""SparseLoCo (``--optimizer sparseloco``): every ``--local-steps`` each rank sends the top-k of
its error-feedback-corrected pseudo-gradient per chunk, quantized, in one all-gather (Sarfi et al.
2025, arXiv:2508.15706; ``optim.sparseloco``, ``optim.sparseloco_codec``). Defaults: H 15, k 64
of 4096-value chunks (1.56% density: the paper reports 1-3%), error-feedback decay 0.95, 2-bit
values, outer lr 1 with no outer momentum (the paper's main setting); ``--sparseloco-preset
templar`` (:data:`PRESETS`) fills the settings neither a flag nor the config file sets with
Templar's production ones."""

from __future__ import annotations

import math

from torchrun_ddp.compression import sparseloco_payload_bytes
from torchrun_ddp.config import TrainConfig
from torchrun_ddp.errors import UserError
from torchrun_ddp.methods.base import FP32, CheckpointBytes, MemoryRow, PlanSizes
from torchrun_ddp.methods.local_updates import LocalUpdatesMethod
from torchrun_ddp.optim import LocalUpdateSettings, SparseLoCo, validate_sparseloco_fields

SPARSELOCO_WORK_COPIES = 5
"""fp32 copies of one parameter alive at once in SparseLoCo's compression: the pseudo-gradient,
its chunks, their magnitudes for top-k, the sent values scattered back and their join."""

PRESETS: dict[str, dict[str, object]] = {
    "templar": {
        "local_steps": 30,
        "outer_lr": 1.0,
        "sparseloco_beta": 0.95,
        "sparseloco_topk": 64,
        "sparseloco_chunk": 64,
        "quant_bits": 2,
        "sparseloco_quantizer": "statistical",
        "sparseloco_aggregate": "senders",
        "sparseloco_clip": "median",
    },
}
"""--sparseloco-preset: field values a named preset gives where neither a flag nor the config
file sets them. templar: Templar's production SparseLoCo, ``tplr-ai/templar``
``hparams/hparams.json`` (inner_steps, outer_learning_rate, momentum_decay, topk_compression,
target_chunk, quantization_bins 4 = 2 bits) and ``src/tplr/compress.py`` (statistical values,
scatter-mean over senders, median norm clipping), as of 2025-09 (v2.1.3)."""


class SparseLoCoMethod(LocalUpdatesMethod):
    """``--optimizer sparseloco``: its per-rank shares and a sync in flight are part of the
    checkpoint's identity; each rank's error feedback is per-rank state."""

    name = "sparseloco"
    summary = (
        "SparseLoCo (Sarfi et al. 2025): DiLoCo's local steps with per-rank error feedback, "
        "top-k per chunk and 2-bit values, all-gathered"
    )
    optimizer_class = SparseLoCo
    paper_local_steps = 15
    paper_outer_lr = 1.0
    preset_field = "sparseloco_preset"
    presets = PRESETS
    flags = (
        *LocalUpdatesMethod.flags,
        "sparseloco_topk",
        "sparseloco_chunk",
        "sparseloco_beta",
        "quant_bits",
        "sparseloco_quantizer",
        "sparseloco_aggregate",
        "sparseloco_clip",
        "sparseloco_preset",
        "compression_scope",
    )

    @classmethod
    def site_problem(cls, config: TrainConfig) -> str:
        """SparseLoCo (and MuLoCo) sync across sites at once, with a flat exchange."""
        if config.overlap_exchange:
            return f"{cls.name} syncs across sites without --overlap-exchange for now; drop it"
        if config.compression_scope != "global":
            return f"{cls.name} syncs across sites with --compression-scope global; drop it"
        return ""

    @classmethod
    def check_config(cls, config: TrainConfig, given: frozenset[str] = frozenset()) -> None:
        """SparseLoCo's flags: the preset only with this method, the ranges whatever
        --optimizer is."""
        if config.sparseloco_preset != "none" and config.optimizer != cls.name:
            raise UserError(
                f"--sparseloco-preset {config.sparseloco_preset} sets SparseLoCo's settings; use "
                "it with --optimizer sparseloco, or drop it"
            )
        super().check_config(config, given)
        try:
            validate_sparseloco_fields(cls.unchecked_settings(config))
        except ValueError as exc:  # raised for values out of range only
            raise UserError(str(exc)) from exc

    def sync_payload(self, shapes: list[tuple[int, ...]]) -> tuple[str, float]:
        """An all-gather of each rank's top-k message."""
        settings = self.settings
        payload = sparseloco_payload_bytes(
            shapes, settings.topk, settings.chunk, settings.quant_bits, settings.quantizer
        )
        return "all_gather", payload

    def node_aware_numel(self, shapes: list[tuple[int, ...]]) -> int:
        """With --compression-scope inter-node: one message per local-rank share."""
        if self.config.compression_scope != "inter-node":
            return 0
        return sum(map(math.prod, shapes))

    def identity(self) -> dict[str, object]:
        """Also the exchange's layout (per-node shares, a sync in flight)."""
        exchange = [self.config.compression_scope, self.config.overlap_exchange]
        return {**super().identity(), "exchange": exchange}

    def identity_defaults(self) -> dict[str, object]:
        """Checkpoints from before --compression-scope and --overlap-exchange."""
        return {**super().identity_defaults(), "exchange": ["global", False]}

    def checkpoint_bytes(self, sizes: PlanSizes) -> CheckpointBytes:
        """The local-update state plus each rank's fp32 error feedback."""
        base = super().checkpoint_bytes(sizes)
        return CheckpointBytes(base.replicated, base.per_rank + FP32 * sizes.trained)

    @classmethod
    def describe_exchange(cls, settings: LocalUpdateSettings) -> str:
        """``k=64/4096 2-bit beta 0.95 lr 1``: the message per chunk, the error feedback's decay,
        the outer lr, and a non-default aggregate or clip."""
        values = f"{settings.quant_bits}-bit" if settings.quant_bits else "fp32"
        if settings.quant_bits and settings.quantizer != "chunk":
            values += f" {settings.quantizer}"
        size = settings.chunk * settings.chunk
        extra = "".join(
            f" {name}"
            for name, default in ((settings.aggregate, "all"), (settings.clip, "none"))
            if name != default
        )
        return (
            f"k={settings.topk}/{size} {values} beta {settings.beta:g} lr "
            f"{settings.outer_lr:g}{extra}"
        )

    @classmethod
    def exchange_rows(
        cls, settings: LocalUpdateSettings, shapes: list[tuple[int, ...]], world_size: int
    ) -> list[MemoryRow]:
        """Each rank's fp32 error feedback (4 N, kept) and, at a sync, the mean pseudo-gradient
        (4 N), its own and the gathered messages ((1 + W) x payload) and
        ``SPARSELOCO_WORK_COPIES`` fp32 copies of the largest parameter (it compresses one
        parameter at a time); with a sync delay the messages stay alive while the exchange
        runs."""
        sizes = [math.prod(shape) for shape in shapes]
        numel = sum(sizes)
        rows = [MemoryRow("error feedback (fp32, per rank)", 4 * numel, True)]
        payload = sparseloco_payload_bytes(
            shapes, settings.topk, settings.chunk, settings.quant_bits, settings.quantizer
        )
        work = SPARSELOCO_WORK_COPIES * 4 * max(sizes, default=0)
        temporary = 4 * numel + (1 + world_size) * payload + work
        rows.append(MemoryRow("sync: mean pseudo-gradient, messages, chunk work", temporary, False))
        if settings.sync_delay > 0:
            in_flight = (1 + world_size) * payload
            rows.append(MemoryRow("own and gathered messages in flight (overlap)", in_flight, True))
        return rows
