"""The collective start of a run, for ``main``: which ranks share a checkpoint folder (storage
domains), and which checkpoint every rank resumes.

With one folder for every rank (a shared file system, or ``--checkpoint-storage shared``) rank 0
reads it and decides (``decide_start``), and every rank checks that it sees the checkpoint rank 0
chose. With several folders (a folder per node or per site) every domain lists its own, rank 0
picks the newest step that every rank can resume, and a folder that lacks it gets it from a peer
over the process group (``checkpoint.agree_across``). Like main.py, this module composes the
components (checkpoint, metrics, optim settings).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from datetime import timedelta
from functools import partial
from pathlib import Path

import torch

from torchrun_ddp.build import checkpoint_root
from torchrun_ddp.checkpoint import (
    StartPlan,
    StorageLayout,
    agree_across,
    broadcast_json,
    detect_storage,
    plan_start,
    verify_start,
)
from torchrun_ddp.config import TrainConfig
from torchrun_ddp.distributed import DistEnv, track_group
from torchrun_ddp.errors import UserError
from torchrun_ddp.metrics import check_records
from torchrun_ddp.optim import LOCAL_UPDATE_METHODS

log = logging.getLogger("torchrun_ddp")


def detect_checkpoint_storage(config: TrainConfig, env: DistEnv) -> StorageLayout:
    """Collective: the storage domains of --checkpoint-dir (``checkpoint.detect_storage``);
    their process groups get the start-up timeout now and the training timeout later, like
    every group of the run. Raises UserError (every rank) for views that do not fit."""
    root = checkpoint_root(config)
    timeout = timedelta(seconds=config.timeout_s)
    layout = detect_storage(
        root, config.checkpoint_storage, env.local_world_size, config.buddy_copies, timeout
    )
    if layout.group is not None:
        track_group(layout.group)
    if not layout.shared:
        log.info("%s", layout.describe())
    return layout


def decide_start(config: TrainConfig, restarted: bool = False) -> StartPlan:
    """Rank 0, one folder: what to resume (``checkpoint.plan_start``). --no-resume applies to a
    job's first attempt only: a ``restarted`` attempt (torchrun restart or re-rendezvous)
    resumes the run's own checkpoints. Raises UserError when the checkpoint folder or
    metrics.jsonl hold another run (see --overwrite-output-dir) or the checkpoint cannot be
    read."""
    root = checkpoint_root(config)
    resume, overwrite = _resume_flags(config, restarted)
    plan = plan_start(root, resume, config.resume_from, overwrite)
    check_records(Path(config.output_dir) / "metrics.jsonl", plan.run_id, overwrite)
    return plan


def _resume_flags(config: TrainConfig, restarted: bool) -> tuple[bool, bool]:
    """(resume the newest checkpoint, delete another run's checkpoints and metrics first)."""
    resume = config.resume or restarted
    return resume, config.overwrite_output_dir and not resume and not config.resume_from


def agree_on_start(
    config: TrainConfig,
    env: DistEnv,
    device: torch.device,
    restarted: bool = False,
    storage: StorageLayout | None = None,
) -> StartPlan:
    """Collective: the checkpoint every rank resumes (a fresh run: ``path`` None).

    One folder (``storage`` None or shared): rank 0 decides (``decide_start``) and broadcasts
    the plan or its error as JSON; every rank then checks it sees the same complete checkpoint
    (``verify_start``). Several folders: ``checkpoint.agree_across``, then the same check in
    each rank's own folder.

    Raises the same UserError on every rank, so no rank is left waiting in a collective. Any
    other exception on rank 0 is re-raised there, and the other ranks raise RuntimeError with
    its type and message, so every rank says why the start failed.
    """
    if storage is not None and not storage.shared:
        return _agree_across_folders(config, env, device, restarted, storage)
    decision: dict[str, object] = {}
    failure: Exception | None = None
    if env.is_main:
        try:
            decision = {"plan": dataclasses.asdict(decide_start(config, restarted))}
        except UserError as exc:  # only bad input: every rank must stop with the same message
            decision = {"error": str(exc)}
        except Exception as exc:  # re-raised below, once the other ranks are told
            decision, failure = {"failure": f"{type(exc).__name__}: {exc}"}, exc
    decision = dict(broadcast_json(decision, device))
    if failure is not None:
        raise failure
    if "failure" in decision:
        raise RuntimeError(f"rank 0 failed deciding what to resume: {decision['failure']}")
    if "error" in decision:
        raise UserError(str(decision["error"]))
    plan = StartPlan(**decision["plan"])
    verify_start(plan, device)
    return plan


def _agree_across_folders(
    config: TrainConfig,
    env: DistEnv,
    device: torch.device,
    restarted: bool,
    storage: StorageLayout,
) -> StartPlan:
    """Several folders: ``checkpoint.agree_across`` (rank 0 also checks metrics.jsonl), then
    every rank checks its own folder holds the chosen checkpoint."""
    resume, overwrite = _resume_flags(config, restarted)
    metrics = Path(config.output_dir) / "metrics.jsonl"
    plan = agree_across(
        checkpoint_root(config),
        storage,
        resume,
        config.resume_from,
        overwrite,
        partial(rebuild_problem, config),
        partial(check_records, metrics, overwrite=overwrite),
    )
    verify_start(plan, device, folder_per_node=True)
    return plan


def rebuild_problem(config: TrainConfig, meta: Mapping[str, object]) -> str:
    """Why a rank's own state of a checkpoint cannot be rebuilt when no folder holds it ("" when
    it can): its data position is replayed from the global document order (needs the same
    world size and accumulation since step 0: ``data_since`` 0), its RNGs are seeded from
    (seed, step, rank), and DeMo momentum and error feedback restart from zero; at another world
    size the lost old ranks' positions are replayed at the old one. ZeRO-1 optimizer shards and
    DiLoCo/SparseLoCo inner optimizer state cannot be rebuilt."""
    if config.zero1:
        return "a ZeRO-1 optimizer shard cannot be rebuilt"
    if config.optimizer in LOCAL_UPDATE_METHODS:
        return f"the {config.optimizer} inner optimizer state cannot be rebuilt"
    if meta.get("data_since") != 0:
        return "the data position cannot be replayed (the world size changed during the run)"
    return ""
