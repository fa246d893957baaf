"""Names other trainers give the same settings, and this project's flag for each.

Hugging Face ``transformers.TrainingArguments`` (and ``run_clm.py``, TRL's ``SFTConfig``) spell
flags with underscores; torchtitan's ``JobConfig`` uses ``--section.key`` flags and TOML
sections. ``config_io`` answers an unknown flag or config key found here with this project's
name before it guesses by spelling. Names the two projects share with this one (``learning_rate``,
``max_steps``, ``weight_decay``, ``warmup_steps``, ``seed``, ``output_dir``, ``max_grad_norm``,
``lora_target_modules``, ``report_to``)
are flags here already and are not listed.

Imports nothing; read by ``config_io``.
"""

from __future__ import annotations

HF_TRAINER: dict[str, str] = {
    "per_device_train_batch_size": "--batch-size",
    "per_device_eval_batch_size": "--batch-size (evaluation uses the training micro-batch)",
    "gradient_accumulation_steps": "--accumulation-steps",
    "num_train_epochs": "--epochs",
    "lr_scheduler_type": "--lr-scheduler (cosine, linear, constant, wsd, cosine-restarts)",
    "warmup_ratio": "--warmup-steps (a step count, not a ratio)",
    "logging_steps": "--log-every",
    "logging_strategy": "--log-every (steps only)",
    "logging_dir": "--output-dir (--tensorboard writes to <output-dir>/tensorboard)",
    "eval_steps": "--eval-every",
    "eval_strategy": "--eval-every (steps only; 0: at the end only)",
    "evaluation_strategy": "--eval-every (steps only; 0: at the end only)",
    "save_steps": "--checkpoint-every",
    "save_strategy": "--checkpoint-every (steps only; --no-save-at-end for none at the end)",
    "save_total_limit": "--keep-checkpoints",
    "resume_from_checkpoint": "--resume-from (a step-N folder; the newest is resumed by default)",
    "bf16": "--precision bf16-mixed",
    "fp16": "--precision bf16-mixed (there is no fp16 autocast)",
    "gradient_checkpointing": "--activation-checkpointing",
    "torch_compile": "--compile",
    "use_liger_kernel": "--fused-loss liger (the fused linear cross-entropy only)",
    "optim": "--optimizer (the training method; --help lists every one)",
    "ddp_timeout": "--timeout-s",
    "ddp_backend": "--backend",
    "model_name_or_path": "--model",
    "tokenizer_name": "--tokenizer",
    "dataset_name": "--dataset",
    "dataset_config_name": "--dataset-config",
    "train_file": "--data-files",
    "validation_file": "--eval-files",
    "block_size": "--seq-length",
    "max_seq_length": "--seq-length",
    "max_length": "--seq-length",
    "use_peft": "--peft lora",
    "lora_r": "--lora-rank",
    "fsdp": "--data-parallel fsdp (full_shard: every rank a shard), or --data-parallel hsdp "
    "(hybrid_shard: sharded within a node, replicated across; --shard-degree sets the ranks)",
    "fsdp_config": "--data-parallel fsdp (one unit per decoder layer; no FSDP config is read)",
    "deepspeed": "--data-parallel fsdp (ZeRO-3: weights, gradients and AdamW state sharded) or "
    "--zero1 (ZeRO-1 under --data-parallel ddp); no DeepSpeed config is read",
}
"""``TrainingArguments`` (and the example scripts' and TRL's) names -> this project's flag."""

TORCHTITAN: dict[str, str] = {
    "job.dump_folder": "--output-dir",
    "job.config_file": "--config (a flat TOML file of this project's keys)",
    "model.name": "--model (a hub id or local folder)",
    "model.flavor": "--model (a hub id or local folder)",
    "model.tokenizer_path": "--tokenizer",
    "model.hf_assets_path": "--model and --tokenizer",
    "training.batch_size": "--batch-size",
    "training.local_batch_size": "--batch-size",
    "training.global_batch_size": "--accumulation-steps (global batch = ranks x --batch-size "
    "x --accumulation-steps)",
    "training.seq_len": "--seq-length",
    "training.steps": "--max-steps",
    "training.max_norm": "--max-grad-norm",
    "training.seed": "--seed",
    "training.dataset": "--dataset",
    "training.dataset_path": "--data-files",
    "training.mixed_precision_param": "--precision bf16-mixed",
    "training.compile": "--compile",
    "compile.enable": "--compile",
    "optimizer.name": "--optimizer",
    "optimizer.lr": "--learning-rate",
    "optimizer.weight_decay": "--weight-decay",
    "optimizer.implementation": "--adamw-implementation",
    "lr_scheduler.warmup_steps": "--warmup-steps",
    "lr_scheduler.decay_type": "--lr-scheduler wsd (a linear decay)",
    "lr_scheduler.decay_ratio": "--decay-steps (a step count, with --lr-scheduler wsd)",
    "lr_scheduler.min_lr_factor": "--min-lr (a learning rate, not a factor)",
    "lr_scheduler.lr_min": "--min-lr (a learning rate, not a factor)",
    "checkpoint.interval": "--checkpoint-every",
    "checkpoint.folder": "--checkpoint-dir",
    "checkpoint.keep_latest_k": "--keep-checkpoints",
    "checkpoint.enable_checkpoint": "--checkpoint-every (0: only at the end and on SIGTERM)",
    "metrics.log_freq": "--log-every",
    "metrics.enable_tensorboard": "--tensorboard",
    "metrics.enable_wandb": "--report-to wandb",
    "activation_checkpoint.mode": "--activation-checkpointing",
    "validation.freq": "--eval-every",
    "validation.steps": "--eval-batches",
    "comm.init_timeout_seconds": "--timeout-s",
    "comm.train_timeout_seconds": "--train-timeout-s",
    "parallelism.data_parallel_shard_degree": "--data-parallel fsdp (-1 or every rank: one shard "
    "group), or --data-parallel hsdp --shard-degree N (N ranks a shard group)",
    "parallelism.data_parallel_replicate_degree": "--data-parallel hsdp (replicas = WORLD_SIZE / "
    "--shard-degree)",
}
"""torchtitan's ``--section.key`` flags and TOML keys -> this project's flag."""


def peer_flag(key: str) -> str:
    """This project's flag for another trainer's option ``key`` (``per_device_train_batch_size``
    or ``training.steps``, dashes already made underscores), or "" when neither table has it."""
    return HF_TRAINER.get(key) or TORCHTITAN.get(key, "")
