"""SparseLoCo (``--optimizer sparseloco``): every ``--local-steps`` each rank sends the top-k of
its error-feedback-corrected pseudo-gradient per chunk, quantized, in one all-gather (Sarfi et al.
2025, arXiv:2508.15706; ``optim.local_updates``, ``optim.sparseloco_codec``)."""

from __future__ import annotations

import math

from torchrun_ddp.compression import sparseloco_payload_bytes
from torchrun_ddp.config import TrainConfig
from torchrun_ddp.errors import UserError
from torchrun_ddp.methods.base import FP32, CheckpointBytes, PlanSizes
from torchrun_ddp.methods.local_updates import LocalUpdatesMethod
from torchrun_ddp.optim.local_update_config import settings_from_config, validate_sparseloco_fields


class SparseLoCoMethod(LocalUpdatesMethod):
    """``--optimizer sparseloco``: its per-rank shares and a sync in flight are part of the
    checkpoint's identity; each rank's error feedback is per-rank state."""

    name = "sparseloco"
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
            validate_sparseloco_fields(settings_from_config(config, cls.name))
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
