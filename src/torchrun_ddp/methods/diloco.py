"""DiLoCo (``--optimizer diloco``): every ``--local-steps`` the ranks all-reduce their
pseudo-gradients and step an outer Nesterov SGD (Douillard et al. 2023, arXiv:2311.08105;
``optim.local_updates``)."""

from __future__ import annotations

import math

from torchrun_ddp.compression import diloco_payload_bytes
from torchrun_ddp.methods.base import FP32, CheckpointBytes, PlanSizes
from torchrun_ddp.methods.local_updates import LocalUpdatesMethod
from torchrun_ddp.optim import PSEUDO_GRADIENT_DTYPES


class DiLoCoMethod(LocalUpdatesMethod):
    """``--optimizer diloco``: its all-reduce has no node-aware form."""

    name = "diloco"
    flags = (*LocalUpdatesMethod.flags, "outer_momentum", "pseudo_gradient_dtype")
    node_aware = False

    def sync_payload(self, shapes: list[tuple[int, ...]]) -> tuple[str, float]:
        """An all-reduce of the pseudo-gradient in --pseudo-gradient-dtype."""
        dtype = PSEUDO_GRADIENT_DTYPES[self.settings.pseudo_gradient_dtype]
        return "all_reduce", diloco_payload_bytes(sum(map(math.prod, shapes)), dtype)

    def checkpoint_bytes(self, sizes: PlanSizes) -> CheckpointBytes:
        """The local-update state plus the replicated outer momentum (when > 0)."""
        base = super().checkpoint_bytes(sizes)
        outer = FP32 * sizes.trained if self.settings.outer_momentum else 0
        return CheckpointBytes(base.replicated + outer, base.per_rank)
