"""Range and combination checks of a merged TrainConfig, and the --keep-global-batch split.

``validate`` runs on every parsed config (``config_io.parse_config``) and raises ``UserError``
naming the flag and the fix, before any process group starts.
"""

from __future__ import annotations

from torchrun_ddp.config import TrainConfig, flag_name
from torchrun_ddp.errors import UserError

_POSITIVE = ("seq_length", "batch_size", "accumulation_steps", "learning_rate", "epochs")
_POSITIVE += ("log_every", "eval_batches", "restart_every", "restart_mult", "timeout_s")
_POSITIVE += ("keep_checkpoints", "compression_topk", "powersgd_rank", "ddp_bucket_cap_mb")
_NON_NEGATIVE = ("weight_decay", "warmup_steps", "eval_every", "threads", "min_lr")
_NON_NEGATIVE += ("max_grad_norm", "shuffle_buffer", "checkpoint_every", "compression_start_step")
_NON_NEGATIVE += ("max_bad_records", "train_timeout_s", "buddy_copies")
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
    if not 0.0 < config.compression_ratio <= 1.0:
        raise UserError(f"--compression-ratio must be in (0, 1], got {config.compression_ratio}")
    if config.compression_block_size < 2:
        raise UserError(
            f"--compression-block-size must be >= 2, got {config.compression_block_size}"
        )
    _validate_combinations(config)


def _validate_combinations(config: TrainConfig) -> None:
    """Reject options that are valid alone but not together."""
    if config.min_lr > config.learning_rate:
        raise UserError("--min-lr must not exceed --learning-rate")
    _validate_lora(config)
    _validate_demo(config)
    _validate_local_updates(config)
    if config.ddp_static_graph and config.accumulation_steps > 1:
        raise UserError(
            "--ddp-static-graph does not work with --accumulation-steps > 1 (torch's DDP "
            "crashes under no_sync with a static graph, pytorch/pytorch#143580); drop one of them"
        )


def _validate_demo(config: TrainConfig) -> None:
    """Reject DeMo hyperparameters out of range (whatever --optimizer is) and settings that
    DeMo, DiLoCo and SparseLoCo (optimizers that communicate themselves) cannot run with."""
    if config.demo_topk < 1 or config.demo_tile_size < 2 or not 0.0 <= config.demo_beta < 1.0:
        raise UserError(
            f"--demo-topk must be >= 1, --demo-tile-size >= 2 and --demo-beta in [0, 1), got "
            f"{config.demo_topk}, {config.demo_tile_size} and {config.demo_beta}"
        )
    if config.overlap_exchange and config.optimizer == "adamw":
        raise UserError(
            "--overlap-exchange delays the exchange of --optimizer demo, diloco or sparseloco "
            "and does nothing for adamw (DDP already overlaps backward); drop it"
        )
    if config.sync_delay and not (config.overlap_exchange and config.optimizer != "demo"):
        raise UserError(
            "--sync-delay sets when an overlapped DiLoCo/SparseLoCo sync lands; use it with "
            "--optimizer diloco or sparseloco and --overlap-exchange, or drop it"
        )
    if config.optimizer == "adamw":
        return
    if config.compression_scope != "global" and config.optimizer == "diloco":
        raise UserError(
            f"--compression-scope {config.compression_scope} works with --optimizer adamw, demo "
            "or sparseloco, not diloco (its all-reduce needs no node-aware exchange); use "
            "--compression-scope global"
        )
    if config.compression != "none":
        raise UserError(
            f"--optimizer {config.optimizer} does its own communication and cannot run on top of "
            f"--compression {config.compression}; use --compression none"
        )
    if config.zero1:
        raise UserError(
            f"--optimizer {config.optimizer} does not work with --zero1 (ZeRO-1 shards one "
            "optimizer state over ranks that step the same gradient; here each rank's state and "
            "update are its own); drop --zero1"
        )


def _validate_local_updates(config: TrainConfig) -> None:
    """Reject DiLoCo/SparseLoCo hyperparameters out of range, whatever --optimizer is."""
    if config.sparseloco_preset != "none" and config.optimizer != "sparseloco":
        raise UserError(
            f"--sparseloco-preset {config.sparseloco_preset} sets SparseLoCo's settings; use it "
            "with --optimizer sparseloco, or drop it"
        )
    if config.eager_updates and not (
        config.overlap_exchange and config.optimizer in ("diloco", "sparseloco")
    ):
        raise UserError(
            "--eager-updates changes an overlapped DiLoCo/SparseLoCo sync; use it with "
            "--optimizer diloco or sparseloco and --overlap-exchange, or drop it"
        )
    if config.eager_updates and config.compression_scope != "global":
        raise UserError(
            "--eager-updates works with --compression-scope global (a node-aware sync's own "
            "part is split over the node's ranks); use --compression-scope global"
        )
    if config.sync_delay < 0:
        raise UserError(f"--sync-delay must be >= 0 (0: a whole window), got {config.sync_delay}")
    if config.local_steps < 0 or config.outer_lr < 0 or not 0.0 <= config.outer_momentum < 1.0:
        raise UserError(
            f"--local-steps and --outer-lr must be >= 0 (0: the paper's) and --outer-momentum in "
            f"[0, 1), got {config.local_steps}, {config.outer_lr} and {config.outer_momentum}"
        )
    if config.sparseloco_topk < 1 or config.sparseloco_chunk < 2:
        raise UserError(
            f"--sparseloco-topk must be >= 1 and --sparseloco-chunk >= 2, got "
            f"{config.sparseloco_topk} and {config.sparseloco_chunk}"
        )
    if not 0.0 <= config.sparseloco_beta < 1.0 or not 0 <= config.quant_bits <= 8:
        raise UserError(
            f"--sparseloco-beta must be in [0, 1) and --quant-bits 0 (none) to 8, got "
            f"{config.sparseloco_beta} and {config.quant_bits}"
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
