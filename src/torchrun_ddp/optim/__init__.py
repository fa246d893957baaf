"""Optimizers and the learning-rate schedule, including the optimizers that run their own
exchanges instead of DDP's gradient all-reduce.

Modules: ``adamw`` (torch's AdamW over two parameter groups, ZeRO-1), ``schedule`` (the
learning-rate schedules: warmup, then cosine with restarts, transformers' cosine, linear,
constant, or warmup-stable-decay), ``codecs`` (the tile codec DeMo and SparseLoCo
share: a parameter cut into tiles, with or without the DCT), ``demo`` (DeMo: momentum top-k per
DCT tile, its own all-gather, sign step; per-rank momentum as checkpoint state),
``local_updates`` (what DiLoCo and SparseLoCo share, the base ``LocalUpdates``: an inner AdamW
stepped on the local gradient, a sync every ``--local-steps``, overlapped and eager syncs),
``diloco`` (``DiLoCo``: all-reduce of the pseudo-gradient, outer Nesterov SGD), ``sparseloco``
(``SparseLoCo``: error feedback, top-k per chunk, quantization, all-gather),
``local_update_config`` (their settings and the checks of their values),
``sparseloco_codec`` (SparseLoCo's messages: top-k per chunk, quantization, bit packing),
``exchange`` (how DeMo's and SparseLoCo's messages travel: flat all-gather or node-aware, in
flight across steps) and ``local_update_state`` (DiLoCo's and SparseLoCo's checkpoint state:
synced and per rank).

Imports: torch, ``errors``, the ``distributed`` types it is handed, ``parallel.shards`` (a
sharded parameter's local part), and ``compression`` (the DCT transform and tiles, wire sizes,
and ``CompressionState``, which counts every exchange's bytes). Nothing imports it but the
composing modules (``build``, ``main``, ``training_state``), ``methods`` and ``plan``.
"""

from torchrun_ddp.optim.adamw import (
    ADAMW_IMPLEMENTATIONS,
    adamw_options,
    build_optimizer,
    parameter_groups,
)
from torchrun_ddp.optim.demo import DeMo, DemoSettings, LocalMomentum, build_demo, validate_demo
from torchrun_ddp.optim.diloco import DiLoCo
from torchrun_ddp.optim.local_update_config import (
    PSEUDO_GRADIENT_DTYPES,
    LocalUpdateSettings,
    validate_local_updates,
    validate_sparseloco_fields,
)
from torchrun_ddp.optim.local_update_state import RankState, SyncedState
from torchrun_ddp.optim.local_updates import LocalUpdates, OuterOptimizer, outer_sgd
from torchrun_ddp.optim.schedule import SCHEDULERS, ScheduleSettings, build_scheduler
from torchrun_ddp.optim.sparseloco import SparseLoCo

__all__ = [
    "ADAMW_IMPLEMENTATIONS",
    "PSEUDO_GRADIENT_DTYPES",
    "SCHEDULERS",
    "DeMo",
    "DemoSettings",
    "DiLoCo",
    "LocalMomentum",
    "LocalUpdateSettings",
    "LocalUpdates",
    "OuterOptimizer",
    "RankState",
    "ScheduleSettings",
    "SparseLoCo",
    "SyncedState",
    "adamw_options",
    "build_demo",
    "build_optimizer",
    "build_scheduler",
    "outer_sgd",
    "parameter_groups",
    "validate_demo",
    "validate_local_updates",
    "validate_sparseloco_fields",
]
