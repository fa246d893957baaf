"""How a run resumes from the checkpoint every rank agreed on (``checkpoint.agree_start``), at its
own or another world size, and what it does when no folder holds a rank's own state.

In order: ``resumed_config`` (before anything is built: --keep-global-batch's accumulation),
then ``resume`` once the trainer is built: the checkpoint's identity is checked
(``training_state.run_identity``), the shared and sharded state loaded through DCP
(``checkpoint.load_checkpoint``), and this rank's own state restored, re-split at another world
size (``resume_resharded``: data positions re-split, the method's rule, ``methods.Method``), or
rebuilt when it was lost (``rebuild_own_state``). Like main.py, it composes the components.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import cast

import torch

from torchrun_ddp.build import Trainer
from torchrun_ddp.checkpoint import (
    StartPlan,
    check_compatible,
    check_replicas,
    load_checkpoint,
    load_rank_states,
    read_meta,
    restore_rng_state,
    seed_rng,
)
from torchrun_ddp.config import TrainConfig
from torchrun_ddp.config_checks import global_batch_accumulation
from torchrun_ddp.config_io import save_config
from torchrun_ddp.distributed import DistEnv
from torchrun_ddp.errors import UserError
from torchrun_ddp.faults import perturbation
from torchrun_ddp.inputs import tokens_per_step
from torchrun_ddp.methods import Method
from torchrun_ddp.metrics import restart_records
from torchrun_ddp.training_data import data_position
from torchrun_ddp.training_state import rank_state, run_identity, sharded_state, shared_state

log = logging.getLogger("torchrun_ddp")


IDENTITY_DEFAULTS: dict[str, object] = {"lr_scheduler": "cosine-restarts", "data_parallel": "ddp"}
"""Identity keys of checkpoints saved before the key existed: the value they all had."""


def resume(trainer: Trainer, plan: StartPlan) -> None:
    """Restore the checkpoint that ``plan`` names (every rank agreed on it), if any.

    Raises UserError, before any training state changes, if the checkpoint does not fit this
    run (model, data stream...). A checkpoint of another world size is resumed too (see
    ``resume_resharded``).
    """
    if plan.path is None:
        return
    path = Path(plan.path)
    saved = {**IDENTITY_DEFAULTS, **trainer.method.identity_defaults(), **read_meta(path)}
    check_compatible(saved, run_identity(trainer))
    same_layout = same_data_layout(trainer, saved)
    in_files = trainer.method.shards_in_rank_files(saved)
    shared, sharded = shared_state(trainer), sharded_state(trainer, in_files)
    group = trainer.storage.group if trainer.storage is not None else None
    own = trainer.env.rank not in plan.lost
    per_rank = load_checkpoint(path, shared, sharded, reshard=True, group=group, own=own)
    if perturbation("replica") == trainer.env.rank:  # tests only (TORCHRUN_DDP_PERTURB)
        with torch.no_grad():
            next(trainer.model.parameters()).add_(1.0)
    check_replicas(shared, str(path), trainer.parallel.replica_groups())  # before any rank's
    # own state changes
    trainer.step = int(saved["step"])
    trainer.tokens_seen = int(saved["tokens_seen"])
    trainer.data_since = saved.get("data_since") if same_layout else trainer.step
    trainer.segment = plan.segment
    if reshaped(trainer, saved):
        resume_resharded(trainer, path, saved, plan.lost)
    elif per_rank is None:
        rebuild_own_state(trainer, path)
    else:
        load_rank_state(trainer, per_rank, path, in_files)
    log.info("resumed from %s at step %d", path, trainer.step)


def load_rank_state(
    trainer: Trainer, per_rank: dict[str, object], path: Path, shards_in_files: bool = False
) -> None:
    """This rank's own state from a checkpoint of this world size; a layout that does not fit
    (e.g. DeMo's per-node shares under another ranks-per-node) is a UserError."""
    for name, obj in rank_state(trainer, shards_in_files).items():
        if name != "optimizer":
            obj.load_state_dict(per_rank[name])
            continue
        try:  # DeMo's or SparseLoCo's share of the tensors must be this rank's
            obj.load_state_dict(per_rank[name])
        except ValueError as exc:
            raise UserError(f"cannot resume {path}: {exc}") from exc
    restore_rng_state(per_rank["rng"])


def held_ranks(path: Path) -> list[int]:
    """The ranks whose own files the checkpoint folder ``path`` holds."""
    return sorted(int(file.stem.split("-")[1]) for file in path.glob("rank-*.json"))


def rebuild_problem(method: Method, meta: Mapping[str, object]) -> str:
    """Why a rank's own state of a checkpoint cannot be rebuilt when no folder holds it ("" when
    it can; ``checkpoint.agree_on_start`` asks): its data position is replayed from the global
    document order (needs the same world size and accumulation since step 0: ``data_since`` 0),
    its RNGs are seeded from (seed, step, rank), the error feedback restarts from zero, and the
    method says what its own per-rank state needs (``Method.rebuild_problem``: DeMo's momentum
    restarts from zero; a ZeRO-1 shard and DiLoCo's/SparseLoCo's inner state cannot be rebuilt).
    At another world size the lost old ranks' positions are replayed at the old one. ``method``:
    the run's training method."""
    if problem := method.rebuild_problem():
        return problem
    if meta.get("data_since") != 0:
        return "the data position cannot be replayed (the world size changed during the run)"
    return ""


def rebuild_own_state(trainer: Trainer, path: Path) -> None:
    """This rank's own state when no checkpoint folder holds it (more folders lost than
    --buddy-copies; ``rebuild_problem`` allowed it): the data position is replayed
    from the global document order (exact), the RNGs are seeded from (seed, step, rank), the
    error feedback restarts from zero (the step count and PowerSGD's shared memories from
    another rank), and so does DeMo's momentum (its hyperparameters and an update in flight
    from another rank, or the schedule's learning rate). Warns what was reset."""
    config, env, step = trainer.config, trainer.env, trainer.step
    windows = step * config.accumulation_steps * config.batch_size
    source = trainer.data.source
    source.load_position(source.windows.replayed(env.rank, env.world_size, windows))
    trainer.data.restored()
    donors = held_ranks(path)[:1]
    entry = load_rank_states(path, "compression", donors)[0] if donors else {"step": step}
    reset = ["RNGs seeded from (seed, step, rank)"]
    if trainer.compression.load_resharded(cast(Mapping, entry)):
        reset.append("error feedback reset to zero")
    lrs = [float(lr) for lr in trainer.scheduler.get_last_lr()]
    reset += trainer.method.rebuild_rank_state(path, donors, lrs)
    seed_rng(f"{config.seed}:{step}:{env.rank}")
    log.warning(
        "rank %d: no checkpoint folder holds its own state of step %d; rebuilt: data position "
        "replayed (exact), %s; the run is no longer bit-identical to an uninterrupted one",
        env.rank, step, ", ".join(reset),
    )  # fmt: skip


def resumed_config(config: TrainConfig, env: DistEnv, plan: StartPlan) -> TrainConfig:
    """The config this rank trains with once it resumes ``plan``, decided before anything is
    built: with --keep-global-batch the accumulation that keeps the checkpoint's global batch at
    this world size (``config_checks.global_batch_accumulation``; UserError where the sizes do
    not divide, the same on every rank); ``config`` itself otherwise."""
    if plan.path is None or not config.keep_global_batch:
        return config
    saved = read_meta(Path(plan.path))
    old_config = cast(Mapping[str, object], saved.get("config") or {})
    old = int(cast(int, old_config.get("accumulation_steps", config.accumulation_steps)))
    accumulation = global_batch_accumulation(old, int(saved["world_size"]), env.world_size)
    return dataclasses.replace(config, accumulation_steps=accumulation)


def same_data_layout(trainer: Trainer, saved: Mapping[str, object]) -> bool:
    """Whether each rank's share of the data per step is unchanged (world size, accumulation and
    micro-batch as saved). Logs the tokens per step when the world size changed."""
    config, world = trainer.config, trainer.env.world_size
    old_world = int(cast(int, saved["world_size"]))
    old_config = cast(Mapping[str, object], saved.get("config") or {})
    old_accumulation = int(
        cast(int, old_config.get("accumulation_steps", config.accumulation_steps))
    )
    old_batch = int(cast(int, old_config.get("batch_size", config.batch_size)))
    same = (old_world, old_accumulation, old_batch)
    if old_world == world:
        return same == (world, config.accumulation_steps, config.batch_size)
    old_tokens = old_world * config.batch_size * old_accumulation * config.seq_length
    log.warning(
        "world size %d -> %d: tokens per step %d -> %d (world_size x micro-batch %d x "
        "accumulation %d x seq_length %d); the schedule continues by optimizer step",
        old_world, world, old_tokens, tokens_per_step(config, trainer.env),
        config.batch_size, config.accumulation_steps, config.seq_length,
    )  # fmt: skip
    return False


def old_data_positions(
    trainer: Trainer, path: Path, saved: Mapping[str, object], lost: Sequence[int]
) -> list[Mapping[str, object]]:
    """Every old rank's data position: saved, or for the ``lost`` ranks replayed at the old
    world size (``GlobalPackedWindows.replayed``)."""
    old_world = int(saved["world_size"])
    old_config = cast(Mapping[str, object], saved.get("config") or {})
    per_rank = int(old_config["accumulation_steps"]) * int(old_config["batch_size"])
    windows = trainer.data.source.windows
    if lost:
        log.warning(
            "no checkpoint folder holds the own state of old ranks %s: their data positions "
            "are replayed from the document order (exact), their other state is dropped",
            ", ".join(map(str, lost)),
        )
    return [
        windows.replayed(rank, old_world, trainer.step * per_rank)
        if rank in lost
        else data_position(load_rank_states(path, "data", [rank])[0])
        for rank in range(old_world)
    ]


def reshaped(trainer: Trainer, saved: Mapping[str, object]) -> bool:
    """Whether the checkpoint was saved at another world size or on another device mesh (hsdp
    at another --shard-degree): each rank's own state is then re-split (``resume_resharded``).
    A checkpoint that does not record its mesh was saved on this world size's."""
    if int(cast(int, saved["world_size"])) != trainer.env.world_size:
        return True
    mesh = trainer.parallel.checkpoint_meta()["mesh"]
    return saved.get("mesh", mesh) != mesh


def resume_resharded(
    trainer: Trainer, path: Path, saved: Mapping[str, object], lost: Sequence[int] = ()
) -> None:
    """Per-rank state from a checkpoint of another world size or mesh: the data positions of all old
    ranks (replayed for ``lost`` ones) are re-split among the new ones (every document still
    trained once), ZeRO-1 and the schedule were loaded by ``load_checkpoint`` (a ZeRO-1 shard
    in per-rank files is read here), the error-feedback residuals are dropped (with a warning),
    and the RNGs are seeded from (seed, step, rank)."""
    trainer.data.source.load_resharded_positions(old_data_positions(trainer, path, saved, lost))
    trainer.data.restored()
    donor = min(set(range(int(saved["world_size"]))) - set(lost))
    entry = load_rank_states(path, "compression", [donor])[0]
    dropped = trainer.compression.load_resharded(cast(Mapping, entry))
    if dropped:
        log.warning("dropped %d error-feedback residuals saved at another world size", dropped)
    trainer.method.load_resharded(trainer.model, path, saved, trainer.env.rank)
    seed_rng(f"{trainer.config.seed}:{trainer.step}:{trainer.env.rank}")


def record_start(trainer: Trainer, config: TrainConfig, plan: StartPlan, test_hooks: str) -> None:
    """Rank 0, once every start check has passed: ``metrics.jsonl`` trimmed to the resumed
    step (``metrics.restart_records``), the resolved ``config`` (as given, before a resumed
    shape) saved as the run's config.toml with the armed ``test_hooks`` as a comment, and the
    ranks whose own state was rebuilt counted in the metrics."""
    output = Path(config.output_dir)
    step = trainer.step if plan.path else -1
    restart_records(output / "metrics.jsonl", plan.run_id, step)
    save_config(config, output / "config.toml", test_hooks)
    if plan.lost:  # counted where the run's metrics go: their own state was rebuilt
        trainer.metrics.log({"step": trainer.step, "rebuilt_ranks": len(plan.lost)})
