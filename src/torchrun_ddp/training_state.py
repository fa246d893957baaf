"""What a checkpoint holds, and saving it: the wiring between the trainer's pieces and the
``checkpoint`` package.

Which state is the same on every rank (model, optimizer, schedule, the method's replicated state:
DCP), which is per rank (data position, error feedback, RNG, the method's own: JSON +
safetensors), which is sharded (ZeRO-1 optimizer state by parameter: DCP, reshardable), and what a
checkpoint must match to be resumed (``run_identity``); the training method (``methods``) answers
for its part. ``resume`` reads it back. Like main.py, it composes the components.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import torch
import torch.distributed as dist

from torchrun_ddp.build import Trainer, train_timeout_s
from torchrun_ddp.checkpoint import (
    ModelAndOptimizer,
    ShardedOptimizer,
    Stateful,
    capture_rng_state,
    model_fingerprint,
    save_checkpoint,
)
from torchrun_ddp.distributed import collective_timeout
from torchrun_ddp.errors import UserError
from torchrun_ddp.faults import perturbed_note
from torchrun_ddp.inputs import checkpoint_root
from torchrun_ddp.model import export_final_model, lora_settings
from torchrun_ddp.parallel.shards import local_tensor
from torchrun_ddp.training_data import DATA_ORDER

log = logging.getLogger("torchrun_ddp")


def shared_state(trainer: Trainer) -> dict[str, Stateful]:
    """State that is the same on every rank: model, optimizer (``Method.shared_optimizer``:
    unless ZeRO-1 shards it or it is per rank), learning-rate schedule, and the method's own
    (``Method.shared_state``: DiLoCo's/SparseLoCo's synced parameters, outer momentum and window
    position). Between two syncs the ranks' parameters differ: ``train`` then holds one rank's
    for each tensor, and ``rank_state`` each rank's own."""
    optimizer = trainer.method.shared_optimizer()
    frozen_base = trainer.config.peft != "none"  # rebuilt from --model (and --seed) on resume
    return {
        "train": ModelAndOptimizer(trainer.model, optimizer, trainable_only=frozen_base),
        "scheduler": trainer.scheduler,
        **trainer.method.shared_state(),
    }


def several_folders(trainer: Trainer) -> bool:
    """Whether the run's checkpoints go to more than one folder (storage domains)."""
    return trainer.storage is not None and not trainer.storage.shared


def rank_state(trainer: Trainer, shards_in_files: bool = False) -> dict[str, Stateful]:
    """State that differs between ranks: data position, the comm hook's error feedback, and the
    method's (``Method.rank_state``: a ZeRO-1 shard, with ``shards_in_files`` its tensors too as
    with several checkpoint folders; DeMo's momentum; DiLoCo's/SparseLoCo's inner AdamW state)."""
    state: dict[str, Stateful] = {"data": trainer.data, "compression": trainer.compression}
    return {**state, **trainer.method.rank_state(trainer.model, shards_in_files)}


def sharded_state(trainer: Trainer, shards_in_files: bool = False) -> dict[str, ShardedOptimizer]:
    """Optimizer state by parameter (ZeRO-1), saved through DCP to load at any world size (with
    ``shards_in_files`` it is per-rank state instead: a storage domain's DCP folder holds only
    its own ranks' shards, so the shards go where buddy copies reach them)."""
    return trainer.method.sharded_state(trainer.model, shards_in_files)


def run_identity(trainer: Trainer) -> dict[str, object]:
    """What a checkpoint must match to be resumed by this run (the method adds its own keys)."""
    config = trainer.config
    identity: dict[str, object] = {
        "model": model_fingerprint(trainer.parallel.module(trainer.model)),
        "vocab_size": trainer.parallel.module(trainer.model).config.vocab_size,
        **trainer.parallel.identity(),
        "compression": config.compression,
        "optimizer": config.optimizer,
        "lr_scheduler": config.lr_scheduler,
        "seq_length": config.seq_length,
        "zero1": config.zero1,
        "seed": config.seed,
        "shuffle_buffer": config.shuffle_buffer,
        "data_order": DATA_ORDER,
        "epochs": config.epochs,
        "data_files": config.data_files,
        "dataset": [config.dataset, config.dataset_config] if not config.data_files else None,
        "peft": None if config.peft == "none" else dataclasses.asdict(lora_settings(config)),
    }
    return {**identity, **trainer.method.identity()}


def save(trainer: Trainer) -> Path:
    """Save an exact-resume checkpoint of the step just finished (collective), under the
    start-up timeout (--timeout-s): a rank's write to a slow shared file system may take longer
    than a training step's collectives may wait.

    Raises UserError (every rank alike, one line) when a weight on any rank is NaN or infinite
    (``check_weights``): nothing is saved over the last good checkpoint, and no final model
    follows (it is exported after the last save)."""
    check_weights(trainer)
    in_files = several_folders(trainer)
    per_rank = {name: obj.state_dict() for name, obj in rank_state(trainer, in_files).items()}
    per_rank["rng"] = capture_rng_state()
    meta = {**run_identity(trainer), "config": dataclasses.asdict(trainer.config)}
    meta["run_id"] = trainer.run_id
    meta["tokens_seen"] = trainer.tokens_seen
    meta["data_since"] = trainer.data_since
    meta["segment"] = trainer.segment
    meta.update(trainer.method.checkpoint_meta(in_files))
    meta.update(trainer.parallel.checkpoint_meta())
    config = trainer.config
    with collective_timeout(config.timeout_s, then=train_timeout_s(config)):
        path = save_checkpoint(
            checkpoint_root(config),
            trainer.step,
            shared_state(trainer),
            per_rank,
            meta,
            keep=config.keep_checkpoints,
            sharded=sharded_state(trainer, in_files),
            layout=trainer.storage,
        )
    log.info("saved checkpoint %s", path)
    return path


def check_weights(trainer: Trainer) -> None:
    """Collective: stop when any rank's parameters (its shards under FSDP) hold a NaN or an
    infinity, as a NaN gradient or a diverged update leaves them while the step's loss, computed
    before the update, was still finite. One all-reduce of one flag per rank.

    Raises UserError (every rank alike) with one line."""
    local = [local_tensor(p.detach()) for p in trainer.model.parameters()]
    finite = torch.stack([t.isfinite().all() for t in local if t.numel()]).all()
    bad = (~finite).to(torch.int32).reshape(1)
    if dist.is_initialized():
        dist.all_reduce(bad)
    if not bad.item():
        return
    raise UserError(
        f"the weights are not finite (NaN or infinite) after step {trainer.step}: stopped without "
        "a checkpoint or final_model; resume the last good checkpoint with a lower "
        f"--learning-rate, more --warmup-steps or a --max-grad-norm{perturbed_note()}"
    )


def save_final_model(trainer: Trainer) -> None:
    """Rank 0 writes ``<output_dir>/final_model`` (``model.export_final_model``: merged
    weights under LoRA, safetensors, with the tokenizer and the chat template that rendered
    training's conversations); all ranks wait for it. A sharded
    model's weights are first gathered onto rank 0's host (``DataParallel.full_state_dict``,
    collective)."""
    config = trainer.config
    with collective_timeout(config.timeout_s, then=train_timeout_s(config)):
        weights = trainer.parallel.full_state_dict(trainer.model)
        if trainer.env.is_main:
            output, lora = Path(config.output_dir), config.peft == "lora"
            model = trainer.parallel.export_module(trainer.model, weights)
            written = None if lora else weights  # peft writes a LoRA model's own tensors
            export_final_model(
                model, trainer.tokenizer, output, lora, written, trainer.chat_template
            )
        dist.barrier()
