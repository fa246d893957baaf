"""Setting a run up, for ``main``, once ``inputs.prepare_inputs`` has checked its inputs: the
checkpoint folders' storage domains, the model built, wrapped or sharded by the run's
data-parallel mode (``parallel``) with the training method's comm hook and optimizer
(``methods``), and this rank's training and held-out data.

Like main.py, this module composes the components (model, data, methods, checkpoint, metrics);
they do not import each other.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler
from transformers import PretrainedConfig, PreTrainedTokenizerBase

from torchrun_ddp.checkpoint import StorageLayout, detect_storage
from torchrun_ddp.compression import CompressionState
from torchrun_ddp.config import TrainConfig
from torchrun_ddp.distributed import DistEnv, track_group
from torchrun_ddp.inputs import (
    Inputs,
    checkpoint_root,
    tokens_per_step,
)
from torchrun_ddp.lookahead import LookaheadBatches
from torchrun_ddp.methods import Method, method_for
from torchrun_ddp.metrics import (
    LogWindow,
    MetricsLogger,
    build_metrics,
    device_peak_flops,
)
from torchrun_ddp.model import (
    ModelSpec,
    check_fused_loss,
    lora_settings,
    trainable_parameter_sizes,
    trained_tokens,
    uses_fused_loss,
)
from torchrun_ddp.optim import ScheduleSettings, build_scheduler
from torchrun_ddp.parallel.base import DataParallel
from torchrun_ddp.parallel.modes import mode_for
from torchrun_ddp.plan import (
    matmul_parameter_count,
    model_flops_per_token,
    parameter_count,
)
from torchrun_ddp.sites import data_place
from torchrun_ddp.training_data import (
    ExampleFormat,
    MultipleChoiceQuestion,
    PackedWindows,
    build_train_loader,
    eval_batches,
    shard_for_rank,
)

log = logging.getLogger("torchrun_ddp")


def train_timeout_s(config: TrainConfig) -> int:
    """The collective timeout after the first step: --train-timeout-s, or --timeout-s for 0."""
    return config.train_timeout_s or config.timeout_s


def checkpoint_storage(config: TrainConfig, env: DistEnv, mode: DataParallel) -> StorageLayout:
    """Collective: the storage domains of --checkpoint-dir (``checkpoint.detect_storage``: which
    ranks see one folder, a probe at start); their process groups get the start-up timeout now
    and the training timeout later, like every group of the run. Raises UserError (every rank)
    for views that do not form storage domains, or folders that would hold only part of the
    ``mode``'s shards (``DataParallel.check_storage``)."""
    timeout = timedelta(seconds=config.timeout_s)
    storage = detect_storage(
        checkpoint_root(config),
        config.checkpoint_storage,
        env.local_world_size,
        config.buddy_copies,
        timeout,
    )
    if storage.group is not None:
        track_group(storage.group)
    mode.check_storage(checkpoint_root(config), storage)
    return storage


def model_spec(config: TrainConfig, device: torch.device, inputs: Inputs) -> ModelSpec:
    """What the run's model is made of (``model.ModelSpec``): --model, --init, --precision,
    --seed, activation checkpointing, the fused loss where it runs (``fused_loss``) and the
    LoRA adapters under --peft lora."""
    lora = lora_settings(config) if config.peft == "lora" else None
    return ModelSpec(
        name=config.model,
        model_config=inputs.model_config,
        init=config.init,
        precision=config.precision,
        seed=config.seed,
        checkpointing=config.activation_checkpointing,
        fused_loss=fused_loss(config, device, inputs.model_config),
        lora=lora,
    )


def fused_loss(config: TrainConfig, device: torch.device, model_config: PretrainedConfig) -> bool:
    """Whether this run trains with Liger's fused linear cross-entropy (``--fused-loss``,
    ``model.uses_fused_loss``). Raises UserError where --fused-loss liger cannot run here."""
    model_type = str(getattr(model_config, "model_type", "") or "")
    if config.fused_loss == "liger":
        check_fused_loss(device.type, model_type)
    used = uses_fused_loss(config.fused_loss, device.type, model_type)
    what = "Liger's fused linear cross-entropy" if used else "logits, then cross-entropy"
    log.info("training loss: %s (--fused-loss %s)", what, config.fused_loss)
    return used


def flops_per_token(
    model: torch.nn.Module, model_config: PretrainedConfig, config: TrainConfig
) -> float:
    """Training FLOPs per token at ``config.seq_length`` (``architecture.model_flops_per_token``,
    PaLM appendix B), over the matmul parameters a token passes through (a mixture of experts
    runs some experts); under --peft lora the base is frozen (4 FLOPs per parameter) and only
    the adapters train (6). 0 for sizes a config does not name."""
    layers = int(getattr(model_config, "num_hidden_layers", 0) or 0)
    hidden = int(getattr(model_config, "hidden_size", 0) or 0)
    matmul = matmul_parameter_count(model, model_config)
    if config.peft == "none":
        return model_flops_per_token(matmul, layers, hidden, config.seq_length)
    trained = sum(trainable_parameter_sizes(model))
    return model_flops_per_token(
        trained, layers, hidden, config.seq_length, frozen=matmul - trained
    )


def wandb_config(config: TrainConfig) -> dict[str, object] | None:
    """The config a Weights & Biases run records under --report-to wandb (the resolved config,
    which holds no secret), else None."""
    if config.report_to != "wandb":
        return None
    return dataclasses.asdict(config)


def schedule_settings(config: TrainConfig) -> ScheduleSettings:
    """The learning-rate schedule's settings (``optim.build_scheduler``) from the config."""
    return ScheduleSettings(
        name=config.lr_scheduler,
        lr=config.learning_rate,
        warmup_steps=config.warmup_steps,
        total_steps=config.max_steps,
        cycle_steps=config.restart_every,
        cycle_mult=config.restart_mult,
        min_lr=config.min_lr,
        decay_steps=config.decay_steps,
    )


def build_train_data(
    config: TrainConfig, env: DistEnv, inputs: Inputs, device: torch.device
) -> LookaheadBatches:
    """This rank's micro-batches of the global document order (``training_data``: read and
    packed in a worker process, resumable, re-split at another world size), grouped by
    optimizer step and read ahead (``lookahead``)."""
    rank, world_size = data_place(config, env.rank, env.world_size)
    loader = build_train_loader(
        inputs.train_documents,
        inputs.tokenizer,
        config.seq_length,
        config.batch_size,
        rank,
        world_size,
        epochs=config.epochs,
        shuffle_buffer=config.shuffle_buffer,
        seed=config.seed,
        max_bad_records=config.max_bad_records,
        fmt=inputs.example_format,
    )
    count = trained_tokens if inputs.example_format.labelled else None
    return LookaheadBatches(loader, config.accumulation_steps, device, count)


def build_eval_set(
    config: TrainConfig, env: DistEnv, inputs: Inputs, device: torch.device
) -> list[torch.Tensor]:
    """This rank's fixed held-out micro-batches (same documents every evaluation).

    Collective: every rank keeps as many batches as the rank with the fewest (one all-reduce,
    MIN), so the held-out loss is a mean over equal shares, and so a model whose buffers DDP
    broadcasts in every forward (``parallel.ddp.constant_buffers`` false) cannot hang in
    ``evaluate``.
    """
    batches: list[torch.Tensor] = []
    if inputs.eval_documents is not None:
        shard = shard_for_rank(inputs.eval_documents, env.rank, env.world_size)
        fmt = inputs.example_format
        windows = PackedWindows(shard, inputs.tokenizer, config.seq_length, fmt=fmt)
        batches = eval_batches(windows, config.batch_size, config.eval_batches)
    count = torch.tensor([len(batches)], device=device)
    dist.all_reduce(count, op=dist.ReduceOp.MIN)
    if int(count.item()) < len(batches):
        log.warning("evaluating on %d batches per rank: a rank has no more", int(count.item()))
    return batches[: int(count.item())]


@dataclass
class Trainer:
    """The built pieces the loop composes."""

    config: TrainConfig
    env: DistEnv
    device: torch.device
    model: torch.nn.Module
    """What the loop runs: the DDP wrapper, or the model sharded by FSDP (--data-parallel)."""
    parallel: DataParallel
    """The data-parallel mode (``parallel``): no-sync, clipping, the export, the replicas."""
    method: Method
    """The training method (``methods``): it built the comm hook and the optimizer."""
    optimizer: Optimizer
    scheduler: LRScheduler
    compression: CompressionState
    data: LookaheadBatches
    eval_set: list[torch.Tensor]
    metrics: MetricsLogger
    window: LogWindow
    tokenizer: PreTrainedTokenizerBase
    chat_template: str | None = None
    """The chat template that rendered the training conversations (messages, sharegpt) where it
    is not the tokenizer's own, kept in final_model; None: the tokenizer's own, or none used."""
    run_id: str = ""
    """The run's identity, stamped in checkpoints and metrics.jsonl."""
    step: int = 0
    """Optimizer steps done (restored on resume)."""
    tokens_seen: int = 0
    """Tokens trained over all ranks and steps, counted across world-size changes (restored on
    resume)."""
    storage: StorageLayout | None = None
    """Which ranks share a checkpoint folder (None: every rank one folder)."""
    questions: list[MultipleChoiceQuestion] = field(default_factory=list)
    """This rank's share of the --eval-multiple-choice questions (every world_size-th)."""
    segment: int = 0
    """How many times the run has been resumed (saved in checkpoints: a step saved again on a
    new timeline, after a resume from an older step, outranks a stale copy of it)."""
    data_since: int | None = 0
    """The step since which the world size (and so each rank's share of the document order) has
    not changed; 0 lets a lost rank's data position be replayed from the start (None: unknown,
    a checkpoint from before it was recorded)."""


def final_chat_template(fmt: ExampleFormat) -> str | None:
    """The template ``final_model`` keeps: the one that rendered a conversational format's
    examples (``--chat-template`` or the bundled one; None where the tokenizer's own did, or
    where no conversation was rendered)."""
    return fmt.chat_template if fmt.renders_chat else None


def build_trainer(
    config: TrainConfig,
    env: DistEnv,
    device: torch.device,
    inputs: Inputs,
    run_id: str = "",
    storage: StorageLayout | None = None,
    mode: DataParallel | None = None,
    method: Method | None = None,
) -> Trainer:
    """The model built by the run's data-parallel ``mode`` (``DataParallel.build``: wrapped in DDP
    or sharded by FSDP) with the training ``method``'s comm hook and optimizer, the schedule, data
    and metrics for this rank; ``storage``: its checkpoint folders (``checkpoint_storage``).
    ``mode`` and ``method``: the run's, built once by ``main.start`` (made here when None)."""
    mode = mode or mode_for(config, env.world_size, env.local_world_size)
    method = method or method_for(config)
    built = mode.build(model_spec(config, device, inputs), device, env, method, config)
    model, compression = built.model, built.compression
    optimizer = method.build(model, compression, mode)
    scheduler = build_scheduler(optimizer, schedule_settings(config))
    torch.manual_seed(config.seed + data_place(config, env.rank, env.world_size)[0])
    compute_dtype = torch.float32 if config.precision == "fp32" else torch.bfloat16
    peak, peak_source = config.peak_tflops * 1e12, "--peak-tflops"
    if not config.peak_tflops:
        peak, peak_source = device_peak_flops(device, compute_dtype)
    flops, tokens = (
        flops_per_token(model, inputs.model_config, config),
        tokens_per_step(config, env),
    )
    log.info(
        "world_size %d, device %s, backend %s, %.1fM parameters (%.2fM trained), "
        "%d tokens per step, %.3g FLOPs per token, peak %.3g FLOP/s per rank (%s)",
        env.world_size, device, dist.get_backend(), parameter_count(model) / 1e6,
        sum(trainable_parameter_sizes(model)) / 1e6, tokens, flops, peak, peak_source,
    )  # fmt: skip
    return Trainer(
        config=config,
        env=env,
        device=device,
        model=built.runner,
        parallel=mode,
        method=method,
        optimizer=optimizer,
        scheduler=scheduler,
        compression=compression,
        data=build_train_data(config, env, inputs, device),
        eval_set=build_eval_set(config, env, inputs, device),
        metrics=build_metrics(
            Path(config.output_dir), env.is_main, config.tensorboard, run_id, wandb_config(config)
        ),
        window=LogWindow(device, tokens, flops, peak * env.world_size if peak else math.inf),
        tokenizer=inputs.tokenizer,
        chat_template=final_chat_template(inputs.example_format),
        run_id=run_id,
        storage=storage,
        questions=inputs.questions[env.rank :: env.world_size],
    )
