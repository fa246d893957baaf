"""Range and combination checks of a merged TrainConfig, and the --keep-global-batch split.

``validate`` runs on every parsed config (``config_io.parse_config``) and raises ``UserError``
naming the flag and the fix, before any process group starts. Each training method checks its own
flags (``methods.check_methods``).
"""

from __future__ import annotations

from torchrun_ddp.config import TrainConfig, flag_name
from torchrun_ddp.errors import UserError
from torchrun_ddp.methods import Owners, check_methods, check_sites_method, refuse_unused
from torchrun_ddp.parallel.modes import check_modes
from torchrun_ddp.sites import check_sites

_POSITIVE = ("seq_length", "batch_size", "accumulation_steps", "learning_rate", "epochs")
_POSITIVE += ("log_every", "eval_batches", "restart_every", "restart_mult", "timeout_s")
_POSITIVE += ("keep_checkpoints", "compression_topk", "powersgd_rank", "ddp_bucket_cap_mb")
_NON_NEGATIVE = ("weight_decay", "warmup_steps", "eval_every", "threads", "min_lr")
_NON_NEGATIVE += ("max_grad_norm", "shuffle_buffer", "checkpoint_every", "compression_start_step")
_NON_NEGATIVE += ("max_bad_records", "train_timeout_s", "buddy_copies", "max_loss")
_NON_NEGATIVE += ("device_memory_gib", "peak_tflops", "plan_tflops")
_POSITIVE += ("plan_intra_node_gbit", "plan_inter_node_gbit")
_POSITIVE += ("plan_gpus_per_node",)
_NON_NEGATIVE += ("plan_world_size", "shard_degree", "decay_steps")

LORA_FLAGS: Owners = {
    name: ("peft", ("lora",))
    for name in ("lora_rank", "lora_alpha", "lora_dropout", "lora_target_modules")
}
"""The adapters' flags, read under --peft lora only."""
SCHEDULE_FLAGS: Owners = {
    "restart_every": ("lr_scheduler", ("cosine-restarts",)),
    "restart_mult": ("lr_scheduler", ("cosine-restarts",)),
    "min_lr": ("lr_scheduler", ("cosine-restarts", "cosine", "wsd")),
    "decay_steps": ("lr_scheduler", ("wsd",)),
}
"""The schedules' own flags and the --lr-scheduler values that read them."""
LENGTH_SCHEDULES = ("cosine", "linear", "wsd")
"""The schedules that need the run's length (--max-steps)."""


def validate(config: TrainConfig, given: frozenset[str] = frozenset()) -> None:
    """Reject invalid values with a UserError naming the flag and the fix; ``given``: the fields
    set on the command line or in the config file (``config_io.given_fields``), whose flags are
    refused where the chosen method, --compression or --peft does not read them."""
    for name in _POSITIVE:
        if getattr(config, name) <= 0:
            raise UserError(f"--{flag_name(name)} must be > 0, got {getattr(config, name)}")
    for name in _NON_NEGATIVE:
        if getattr(config, name) < 0:
            raise UserError(f"--{flag_name(name)} must be >= 0, got {getattr(config, name)}")
    if config.max_steps == 0 or config.max_steps < -1:
        raise UserError(f"--max-steps must be -1 (end of data) or > 0, got {config.max_steps}")
    _validate_combinations(config, given)


def _validate_combinations(config: TrainConfig, given: frozenset[str]) -> None:
    """Reject options that are valid alone but not together."""
    if not 0.0 <= config.eval_fraction < 1.0:
        raise UserError(f"--eval-fraction must be in [0, 1), got {config.eval_fraction}")
    if config.min_lr > config.learning_rate:
        raise UserError("--min-lr must not exceed --learning-rate")
    _validate_lora(config)
    _validate_schedule(config)
    check_modes(config, given)
    refuse_unused(config, given, {**LORA_FLAGS, **SCHEDULE_FLAGS})
    check_methods(config, given)
    check_sites(config, given)
    check_sites_method(config)
    if config.ddp_static_graph and config.accumulation_steps > 1:
        raise UserError(
            "--ddp-static-graph does not work with --accumulation-steps > 1 (torch's DDP "
            "crashes under no_sync with a static graph, pytorch/pytorch#143580); drop one of them"
        )


def _validate_schedule(config: TrainConfig) -> None:
    """Reject a schedule that needs the run's length without --max-steps, and a wsd decay that
    does not fit after the warmup."""
    name = config.lr_scheduler
    if name in LENGTH_SCHEDULES and config.max_steps < 0:
        raise UserError(
            f"--lr-scheduler {name} decays over the run's length; set --max-steps, or use "
            "--lr-scheduler cosine-restarts or constant"
        )
    if name == "wsd" and config.warmup_steps + config.decay_steps > config.max_steps:
        raise UserError(
            f"--lr-scheduler wsd: --warmup-steps {config.warmup_steps} + --decay-steps "
            f"{config.decay_steps} exceed --max-steps {config.max_steps}; lower them"
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
