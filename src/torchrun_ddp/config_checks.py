"""Range and combination checks of a merged TrainConfig, and the --keep-global-batch split.

``validate`` runs on every parsed config (``config_io.parse_config``) and raises ``UserError``
naming the flag and the fix, before any process group starts. Each training method checks its own
flags (``methods.check_methods``).
"""

from __future__ import annotations

from torchrun_ddp.config import TrainConfig, flag_name
from torchrun_ddp.errors import UserError
from torchrun_ddp.methods import check_methods

_POSITIVE = ("seq_length", "batch_size", "accumulation_steps", "learning_rate", "epochs")
_POSITIVE += ("log_every", "eval_batches", "restart_every", "restart_mult", "timeout_s")
_POSITIVE += ("keep_checkpoints", "compression_topk", "powersgd_rank", "ddp_bucket_cap_mb")
_NON_NEGATIVE = ("weight_decay", "warmup_steps", "eval_every", "threads", "min_lr")
_NON_NEGATIVE += ("max_grad_norm", "shuffle_buffer", "checkpoint_every", "compression_start_step")
_NON_NEGATIVE += ("max_bad_records", "train_timeout_s", "buddy_copies", "max_loss")
_NON_NEGATIVE += ("device_memory_gib", "peak_tflops")
_POSITIVE += ("plan_intra_node_gbit", "plan_inter_node_gbit", "plan_tflops")
_POSITIVE += ("plan_gpus_per_node",)
_NON_NEGATIVE += ("plan_world_size",)


def validate(config: TrainConfig) -> None:
    """Reject invalid values with a UserError naming the flag and the fix."""
    for name in _POSITIVE:
        if getattr(config, name) <= 0:
            raise UserError(f"--{flag_name(name)} must be > 0, got {getattr(config, name)}")
    for name in _NON_NEGATIVE:
        if getattr(config, name) < 0:
            raise UserError(f"--{flag_name(name)} must be >= 0, got {getattr(config, name)}")
    if config.max_steps == 0 or config.max_steps < -1:
        raise UserError(f"--max-steps must be -1 (end of data) or > 0, got {config.max_steps}")
    _validate_combinations(config)


def _validate_combinations(config: TrainConfig) -> None:
    """Reject options that are valid alone but not together."""
    if not 0.0 <= config.eval_fraction < 1.0:
        raise UserError(f"--eval-fraction must be in [0, 1), got {config.eval_fraction}")
    if config.min_lr > config.learning_rate:
        raise UserError("--min-lr must not exceed --learning-rate")
    _validate_lora(config)
    check_methods(config)
    if config.ddp_static_graph and config.accumulation_steps > 1:
        raise UserError(
            "--ddp-static-graph does not work with --accumulation-steps > 1 (torch's DDP "
            "crashes under no_sync with a static graph, pytorch/pytorch#143580); drop one of them"
        )


def _validate_lora(config: TrainConfig) -> None:
    """Reject LoRA hyperparameters peft cannot use (checked whatever --peft is)."""
    if config.lora_rank < 1 or config.lora_alpha <= 0:
        raise UserError(
            f"--lora-rank must be >= 1 and --lora-alpha > 0, got {config.lora_rank} and "
            f"{config.lora_alpha}"
        )
    if not 0.0 <= config.lora_dropout < 1.0:
        raise UserError(f"--lora-dropout must be in [0, 1), got {config.lora_dropout}")
    if not config.lora_target_modules:
        raise UserError("--lora-target-modules is empty; name modules or use all-linear")


def global_batch_accumulation(accumulation: int, old_world_size: int, world_size: int) -> int:
    """Micro-batches per step that keep ``old_world_size x accumulation`` micro-batches per
    optimizer step on ``world_size`` ranks (--keep-global-batch); raises UserError where
    ``world_size`` does not divide that product."""
    total = old_world_size * accumulation
    if total % world_size:
        raise UserError(
            f"--keep-global-batch: the checkpoint's {old_world_size} ranks x {accumulation} "
            f"micro-batches per step cannot be split over {world_size} ranks; use a world size "
            f"that divides {total}, or drop --keep-global-batch"
        )
    return total // world_size
