"""run(config, env): build the pieces, then train with DDP; the loop reads like the algorithm.

For each optimizer step: take ``accumulation_steps`` micro-batches (all ranks agree there is
data), forward and backward through the DDP model (``no_sync`` on all but the last micro-batch, so
gradients are all-reduced once per step by the comm hook), clip, step, schedule, log, evaluate.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Iterator
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from datasets import IterableDataset
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler
from transformers import PretrainedConfig, PreTrainedTokenizerBase

from torchrun_ddp.compression import CompressionSettings, CompressionState, register_compression
from torchrun_ddp.config import TrainConfig, save_config
from torchrun_ddp.distributed import (
    DistEnv,
    init_distributed,
    pick_device,
    setup_logging,
    shutdown_distributed,
)
from torchrun_ddp.errors import UserError
from torchrun_ddp.metrics import MetricsLogger, Record, build_metrics, peak_memory_bytes
from torchrun_ddp.model import build_model, load_model_config, max_positions, wrap_ddp
from torchrun_ddp.optimizer import build_optimizer, build_scheduler
from torchrun_ddp.training_data import (
    PackedWindows,
    build_loader,
    eval_batches,
    load_tokenizer,
    open_documents,
    resolve_files,
    shard_for_rank,
)

log = logging.getLogger("torchrun_ddp")


@dataclass
class Inputs:
    """What is checked and loaded before any process group starts."""

    model_config: PretrainedConfig
    tokenizer: PreTrainedTokenizerBase
    train_documents: IterableDataset
    eval_documents: IterableDataset


@dataclass
class Trainer:
    """The built pieces the loop composes."""

    config: TrainConfig
    env: DistEnv
    device: torch.device
    model: DistributedDataParallel
    optimizer: Optimizer
    scheduler: LRScheduler
    compression: CompressionState
    train_batches: Iterator[torch.Tensor]
    eval_set: list[torch.Tensor]
    metrics: MetricsLogger
    tokenizer: PreTrainedTokenizerBase


def prepare_inputs(config: TrainConfig) -> Inputs:
    """Check the model, tokenizer and data paths; raises UserError on the first problem."""
    model_config = load_model_config(config.model)
    limit = max_positions(model_config)
    if limit and config.seq_length > limit:
        raise UserError(
            f"--seq-length {config.seq_length} exceeds the model's {limit} positions; "
            f"use --seq-length {limit} or less"
        )
    tokenizer = load_tokenizer(config.tokenizer or config.model)
    train_files = resolve_files(config.data_files, "--data-files")
    eval_files = resolve_files(config.eval_files, "--eval-files")
    hub = (config.dataset, config.dataset_config)
    return Inputs(
        model_config=model_config,
        tokenizer=tokenizer,
        train_documents=open_documents(train_files, *hub, split="train"),
        eval_documents=open_documents(eval_files, *hub, split="validation"),
    )


def run(config: TrainConfig, env: DistEnv) -> None:
    """Train as one rank of a torchrun job (or alone), always tearing the process group down."""
    setup_logging(env.rank)
    inputs = prepare_inputs(config)
    device = pick_device(env, config.device)
    torch.set_num_threads(config.threads or max(1, (os.cpu_count() or 1) // env.local_world_size))
    init_distributed(env, device, config.backend, config.timeout_s)
    try:
        trainer = build_trainer(config, env, device, inputs)
        train(trainer)
        save_final_model(trainer)
    finally:
        shutdown_distributed()


def build_trainer(
    config: TrainConfig, env: DistEnv, device: torch.device, inputs: Inputs
) -> Trainer:
    """Model in DDP with its comm hook, optimizer, schedule, data and metrics for this rank."""
    output_dir = Path(config.output_dir)
    if env.is_main:
        save_config(config, output_dir / "config.toml")
    model = build_model(
        config.model, inputs.model_config, config.init, config.model_dtype, config.seed, device
    )
    ddp_model = wrap_ddp(model, device)
    compression = register_compression(
        ddp_model,
        CompressionSettings(
            method=config.compression,
            ratio=config.compression_ratio,
            block_size=config.compression_block_size,
        ),
    )
    optimizer = build_optimizer(model, config.learning_rate, config.weight_decay)
    torch.manual_seed(config.seed + env.rank)
    log.info(
        "world_size %d, device %s, backend %s, %.1fM parameters, %d tokens per step",
        env.world_size,
        device,
        dist.get_backend(),
        sum(p.numel() for p in model.parameters()) / 1e6,
        tokens_per_step(config, env),
    )
    return Trainer(
        config=config,
        env=env,
        device=device,
        model=ddp_model,
        optimizer=optimizer,
        scheduler=build_scheduler(
            optimizer, config.warmup_steps, config.restart_every, config.restart_mult, config.min_lr
        ),
        compression=compression,
        train_batches=iter(build_train_windows(config, env, inputs)),
        eval_set=build_eval_set(config, env, inputs),
        metrics=build_metrics(output_dir, env.is_main),
        tokenizer=inputs.tokenizer,
    )


def tokens_per_step(config: TrainConfig, env: DistEnv) -> int:
    """Tokens trained per optimizer step over all ranks."""
    return config.batch_size * config.accumulation_steps * config.seq_length * env.world_size


def build_train_windows(
    config: TrainConfig, env: DistEnv, inputs: Inputs
) -> torch.utils.data.DataLoader:
    """This rank's shuffled, packed training micro-batches."""
    shard = shard_for_rank(inputs.train_documents, env.rank, env.world_size)
    windows = PackedWindows(
        shard,
        inputs.tokenizer,
        config.seq_length,
        epochs=config.epochs,
        shuffle_buffer=config.shuffle_buffer,
        seed=config.seed + env.rank,
    )
    return build_loader(windows, config.batch_size)


def build_eval_set(config: TrainConfig, env: DistEnv, inputs: Inputs) -> list[torch.Tensor]:
    """This rank's fixed held-out micro-batches (same documents every evaluation)."""
    shard = shard_for_rank(inputs.eval_documents, env.rank, env.world_size)
    windows = PackedWindows(shard, inputs.tokenizer, config.seq_length)
    return eval_batches(windows, config.batch_size, config.eval_batches)


def next_micro_batches(trainer: Trainer) -> list[torch.Tensor] | None:
    """The next step's micro-batches, or None once any rank has run out of data.

    Every rank contributes a flag to an all-reduce (MIN), so all ranks stop on the same step
    and nobody waits forever in a collective another rank never joins.
    """
    batches: list[torch.Tensor] = []
    for batch in trainer.train_batches:
        batches.append(batch.to(trainer.device, non_blocking=True))
        if len(batches) == trainer.config.accumulation_steps:
            break
    complete = len(batches) == trainer.config.accumulation_steps
    flag = torch.tensor([1 if complete else 0], device=trainer.device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return batches if flag.item() == 1 else None


def forward_backward(model: DistributedDataParallel, batches: list[torch.Tensor]) -> torch.Tensor:
    """Accumulate gradients over the micro-batches; returns the step's mean loss (detached).

    Each micro-batch's loss is divided by their number, so the accumulated gradient equals one
    large batch's (every window has the same token count). Gradients are all-reduced only on the
    last micro-batch; ``no_sync`` skips communication on the others.
    """
    total = torch.zeros((), device=batches[0].device)
    for index, input_ids in enumerate(batches):
        last = index == len(batches) - 1
        with nullcontext() if last else model.no_sync():
            loss = model(input_ids=input_ids, labels=input_ids).loss / len(batches)
            loss.backward()
        total += loss.detach()
    return total


def train(trainer: Trainer) -> int:
    """The training loop; returns the number of optimizer steps taken."""
    config, model = trainer.config, trainer.model
    max_steps = config.max_steps if config.max_steps > 0 else math.inf
    step, window = 0, Window(trainer)
    model.train()
    while step < max_steps:
        batches = next_micro_batches(trainer)
        if batches is None:
            log.info("end of training data after %d steps", step)
            break
        loss = forward_backward(model, batches)
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), config.max_grad_norm)
        trainer.optimizer.step()
        trainer.scheduler.step()
        trainer.optimizer.zero_grad(set_to_none=True)
        step += 1
        window.add(loss, grad_norm)
        if step % config.log_every == 0:
            trainer.metrics.log(window.flush(step))
        if config.eval_every and step % config.eval_every == 0:
            trainer.metrics.log({"step": step, **evaluate(trainer)})
    if config.eval_every == 0 or step % config.eval_every != 0:
        trainer.metrics.log({"step": step, **evaluate(trainer)})
    return step


class Window:
    """Sums over the steps since the last log line; ``flush`` turns them into one record."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer
        self.reset()

    def reset(self) -> None:
        """Start a new logging window."""
        self.loss = torch.zeros((), device=self.trainer.device)
        self.grad_norm = 0.0
        self.steps = 0
        self.comm_bytes = 0
        self.comm_bytes_dense = 0
        self.start = time.perf_counter()

    def add(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> None:
        """Record one optimizer step (no synchronisation with other ranks)."""
        self.loss += loss
        self.grad_norm = float(grad_norm)
        self.steps += 1
        sent, dense = self.trainer.compression.pop_step_bytes()
        self.comm_bytes += sent
        self.comm_bytes_dense += dense

    def flush(self, step: int) -> Record:
        """Mean loss over the window and the ranks, throughput and memory; then reset."""
        elapsed = time.perf_counter() - self.start
        loss = mean_over_ranks(self.loss / self.steps)
        trainer = self.trainer
        tokens = tokens_per_step(trainer.config, trainer.env) * self.steps
        record: Record = {
            "step": step,
            "loss": float(loss),
            "lr": float(trainer.scheduler.get_last_lr()[0]),
            "tokens_per_s": tokens / elapsed,
            "grad_norm": self.grad_norm,
            "peak_mem_bytes": peak_memory_bytes(trainer.device),
            "comm_bytes": self.comm_bytes // self.steps,
            "comm_bytes_dense": self.comm_bytes_dense // self.steps,
            "compression_ratio": self.comm_bytes_dense / max(1, self.comm_bytes),
        }
        self.reset()
        return record


def mean_over_ranks(value: torch.Tensor) -> torch.Tensor:
    """The mean of ``value`` over all ranks (SUM then divide: gloo has no AVG reduction)."""
    dist.all_reduce(value)
    return value / dist.get_world_size()


@torch.no_grad()
def evaluate(trainer: Trainer) -> Record:
    """Mean loss and perplexity over every rank's fixed held-out windows."""
    model = trainer.model
    model.eval()
    totals = torch.zeros(2, device=trainer.device, dtype=torch.float64)
    for batch in trainer.eval_set:
        input_ids = batch.to(trainer.device)
        totals[0] += model(input_ids=input_ids, labels=input_ids).loss.double()
        totals[1] += 1
    dist.all_reduce(totals)
    model.train()
    if totals[1] == 0:
        log.warning("no held-out windows to evaluate on; check --eval-files")
        return {}
    eval_loss = float(totals[0] / totals[1])
    return {"eval_loss": eval_loss, "eval_ppl": math.exp(min(eval_loss, 50.0))}


def save_final_model(trainer: Trainer) -> None:
    """Rank 0 writes ``<output_dir>/final_model`` (safetensors + tokenizer); all ranks wait."""
    if trainer.env.is_main:
        target = Path(trainer.config.output_dir) / "final_model"
        trainer.model.module.save_pretrained(target, safe_serialization=True)
        trainer.tokenizer.save_pretrained(target)
        log.info("saved the final model to %s", target)
    dist.barrier()
    trainer.metrics.close()
