"""The typed training config: one dataclass, a TOML file plus command-line overrides.

Every field's ``help`` text is what ``python train.py --help`` prints. Parsing uses transformers'
``HfArgumentParser`` (flags accept ``--seq-length`` and ``--seq_length``); a TOML file given with
``--config FILE`` supplies defaults that flags then override. Config-file values are checked
like flags (types, choices, unknown keys) by a strict pydantic model built from the dataclass
fields (``file_schema``), and ``validate`` checks ranges of the merged config; both raise
``UserError`` before any process group starts.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import os
import tomllib
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Literal, get_type_hints

import tomli_w
from pydantic import BaseModel, ConfigDict, ValidationError, create_model
from transformers import HfArgumentParser

from torchrun_ddp.errors import UserError

COMPRESSION_METHODS = ("none", "dct", "dct-topk", "fp16", "bf16", "powersgd")


def _opt(default: object, help: str, **extra: object) -> object:
    """A dataclass field whose help text becomes the flag's ``--help`` entry."""
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"help": help, **extra})
    return field(default=default, metadata={"help": help, **extra})


@dataclass
class TrainConfig:
    """Everything a training run needs; saved (without secrets) as ``<output_dir>/config.toml``."""

    # Model
    model: str = _opt(
        "meta-llama/Llama-2-7b-hf",
        "Hugging Face hub id or local folder of a causal LM (any AutoModelForCausalLM), or a "
        "config.json path with --init random. Gated hub models need HF_TOKEN in the environment "
        "or .env.",
    )
    init: str = _opt(
        "pretrained",
        "pretrained: load the weights with from_pretrained; random: build the architecture "
        "from the model's config and initialise it from --seed.",
        choices=["pretrained", "random"],
    )
    precision: str = _opt(
        "fp32",
        "fp32: everything in float32. bf16-mixed: float32 weights, gradients and AdamW state, "
        "forward and backward under torch.autocast(bfloat16) on CPU and CUDA. bf16: bfloat16 "
        "weights, gradients and AdamW moments (half the memory; small updates can round away).",
        choices=["fp32", "bf16-mixed", "bf16"],
    )
    activation_checkpointing: bool = _opt(
        False,
        "Recompute each decoder layer's activations in backward (transformers' gradient "
        "checkpointing, non-reentrant, DDP-safe): less memory, about a third more compute.",
    )
    compile: bool = _opt(
        False,
        "torch.compile the model (inductor) before DDP wraps it; falls back to eager with a "
        "warning where compilation fails. Checkpoints stay loadable without compile.",
    )
    peft: str = _opt(
        "none",
        "Parameter-efficient fine-tuning: none trains every weight; lora freezes the base model "
        "(bf16 unless --precision fp32) and trains fp32 low-rank adapters (peft).",
        choices=["none", "lora"],
    )
    lora_rank: int = _opt(8, "--peft lora: rank r of each adapter (B A, A: r x in, B: out x r).")
    lora_alpha: float = _opt(16.0, "--peft lora: scaling alpha; the update is (alpha / r) B A x.")
    lora_dropout: float = _opt(0.1, "--peft lora: dropout on each adapter's input, in [0, 1).")
    lora_target_modules: list[str] = _opt(
        ["all-linear"],
        "--peft lora: modules that get adapters, by name or name suffix (e.g. q_proj v_proj), "
        "or all-linear: every linear layer except the output head.",
    )
    tokenizer: str = _opt("", "Tokenizer hub id or folder; empty means the same as --model.")
    # Data
    dataset: str = _opt("allenai/c4", "Hub dataset streamed when --data-files is empty.")
    dataset_config: str = _opt("en", "Config name of the hub dataset (C4: en).")
    data_files: list[str] = _opt(
        [], "Local json/json.gz training files in C4's layout (globs allowed); overrides --dataset."
    )
    eval_files: list[str] = _opt(
        [], "Local json/json.gz held-out files; empty means the hub dataset's validation split."
    )
    shuffle_buffer: int = _opt(
        1000,
        "Documents per shuffled block of the global document order (each block permuted by "
        "seed, epoch and block); 0 keeps stream order.",
    )
    max_bad_records: int = _opt(
        100,
        "Damaged training records (bad JSON, bad UTF-8, no text, a damaged gzip stream) skipped "
        "with a warning naming the file and line; one more stops the run with an error.",
    )
    seq_length: int = _opt(512, "Tokens per packed training window.")
    batch_size: int = _opt(4, "Micro-batch size in windows per rank.")
    accumulation_steps: int = _opt(1, "Micro-batches accumulated per optimizer step.")
    keep_global_batch: bool = _opt(
        False,
        "On resuming at another world size, keep the checkpoint's global batch (world size x "
        "--batch-size x accumulation) by changing --accumulation-steps; refused where the sizes "
        "do not divide. Off: the global batch follows the world size.",
    )
    # Optimisation
    learning_rate: float = _opt(
        1e-5,
        "Peak learning rate of AdamW (of DeMo's sign step; of the inner AdamW under diloco and "
        "sparseloco).",
    )
    weight_decay: float = _opt(0.01, "AdamW weight decay (not applied to norms and biases).")
    warmup_steps: int = _opt(250, "Optimizer steps of linear warmup.")
    restart_every: int = _opt(
        1000, "Length in optimizer steps of the first cosine cycle after warmup (T_0)."
    )
    restart_mult: int = _opt(1, "Factor by which each cosine cycle is longer than the last.")
    min_lr: float = _opt(0.0, "Learning rate at the bottom of each cosine cycle.")
    adamw_implementation: str = _opt(
        "fused",
        "AdamW kernel: fused (one kernel, fastest on CPU and CUDA), foreach (multi-tensor) or "
        "for-loop (torch's reference); all compute the same update.",
        choices=["fused", "foreach", "for-loop"],
    )
    optimizer: str = _opt(
        "adamw",
        "adamw: AdamW on the gradients DDP averages (through --compression); demo: DeMo (Peng et "
        "al. 2024): momentum on local gradients, top-k DCT coefficients per tile all-gathered, "
        "sign step (--learning-rate is then the sign step's size); diloco: DiLoCo (Douillard et "
        "al. 2023): --local-steps of AdamW on each rank's own gradients, then an all-reduce of the "
        "pseudo-gradient and an outer Nesterov SGD step; sparseloco: SparseLoCo (Sarfi et al. "
        "2025): the same with per-rank error feedback, top-k per chunk and 2-bit values, "
        "all-gathered (see docs/local_updates.md). demo, diloco and sparseloco need "
        "--compression none and no --zero1.",
        choices=["adamw", "demo", "diloco", "sparseloco"],
    )
    demo_topk: int = _opt(32, "--optimizer demo: DCT coefficients sent per tile (paper: 32).")
    demo_tile_size: int = _opt(
        64, "--optimizer demo: largest tile side; each is the largest divisor <= this."
    )
    demo_beta: float = _opt(0.999, "--optimizer demo: momentum decay in [0, 1) (paper: 0.999).")
    demo_value_dtype: str = _opt(
        "bfloat16",
        "--optimizer demo: dtype of the coefficient values sent (indices: uint8/int16).",
        choices=["bfloat16", "float16", "float32"],
    )
    local_steps: int = _opt(
        0,
        "--optimizer diloco/sparseloco: optimizer steps between syncs (H); 0: the paper's, "
        "DiLoCo 500 (Douillard et al. 2023, arXiv:2311.08105), SparseLoCo 15 (Sarfi et al. 2025, "
        "arXiv:2508.15706; it reports H 15 to 250).",
    )
    outer_lr: float = _opt(
        0.0,
        "--optimizer diloco/sparseloco: outer SGD learning rate; 0: the paper's, DiLoCo 0.7, "
        "SparseLoCo 1.",
    )
    outer_momentum: float = _opt(
        0.9,
        "--optimizer diloco: outer Nesterov momentum in [0, 1) (paper: 0.9); 0: plain outer SGD. "
        "SparseLoCo has none (its error feedback takes that role).",
    )
    pseudo_gradient_dtype: str = _opt(
        "float32",
        "--optimizer diloco: dtype of the all-reduced pseudo-gradient (bfloat16 halves the bytes).",
        choices=["float32", "bfloat16"],
    )
    sparseloco_topk: int = _opt(
        64,
        "--optimizer sparseloco: values sent per chunk (64 of a 64 x 64 chunk: density 1/64, "
        "1.6 percent; the paper reports 1 to 3 percent).",
    )
    sparseloco_chunk: int = _opt(
        64,
        "--optimizer sparseloco: largest chunk side; a matrix is cut into chunks of up to 64 x 64 "
        "= 4096 values (each side the largest divisor <= this, as DeMo's tiles), a vector into "
        "chunks of up to 64.",
    )
    sparseloco_beta: float = _opt(
        0.95, "--optimizer sparseloco: error-feedback decay in [0, 1) (e <- beta e + delta)."
    )
    quant_bits: int = _opt(
        2,
        "--optimizer sparseloco: bits per value sent, 1 to 8, with one fp32 scale per chunk "
        "(paper: 2); 0 sends fp32 values.",
    )
    max_grad_norm: float = _opt(1.0, "Gradient clipping threshold (global L2 norm).")
    epochs: int = _opt(1, "Passes over the training data.")
    max_steps: int = _opt(-1, "Stop after this many optimizer steps; -1 means end of data.")
    seed: int = _opt(42, "Seed for model init, data shuffle and dropout.")
    # Distributed and compression
    backend: str = _opt(
        "auto",
        "Process-group backend; auto is NCCL with CUDA, else gloo.",
        choices=["auto", "gloo", "nccl"],
    )
    device: str = _opt(
        "auto", "auto, cpu or cuda (cuda:LOCAL_RANK).", choices=["auto", "cpu", "cuda"]
    )
    timeout_s: int = _opt(
        600,
        "Collective timeout in seconds for start-up (rendezvous, resume, the first step), "
        "checkpoint writes and the final export.",
    )
    train_timeout_s: int = _opt(
        120,
        "Collective timeout in seconds once the first step has finished: how soon a rank that "
        "is gone without closing its connections (power loss, cut link) stops the others, "
        "so torchrun can restart. Must exceed the slowest step; 0 keeps --timeout-s.",
    )
    threads: int = _opt(0, "torch intra-op threads per process; 0 means cores / local world size.")
    compression: str = _opt(
        "none", "Gradient compression comm hook.", choices=list(COMPRESSION_METHODS)
    )
    compression_ratio: float = _opt(
        0.5, "dct: fraction of DCT coefficients sent per block (0 < ratio <= 1)."
    )
    compression_block_size: int = _opt(64, "dct, dct-topk: DCT block length in values.")
    compression_topk: int = _opt(8, "dct-topk: largest DCT coefficients sent per block.")
    compression_value_dtype: str = _opt(
        "float32",
        "dct, dct-topk: dtype of the DCT coefficients sent (dct all-reduces them; dct-topk "
        "all-gathers them with uint8/int16/int32 indices and feeds the rounding error back).",
        choices=["float32", "bfloat16", "float16"],
    )
    compression_error_feedback: bool = _opt(
        True, "dct, dct-topk: add what was not sent to the next step's gradient."
    )
    compression_start_step: int = _opt(
        0, "Optimizer steps of plain dense all-reduce before compression starts."
    )
    compression_selection: str = _opt(
        "low-pass",
        "dct: coefficients sent, the same on every rank: low-pass (the lowest frequencies, no "
        "error feedback) or rotating (a cyclic walk through all frequencies, with error feedback).",
        choices=["low-pass", "rotating"],
    )
    compression_scope: str = _opt(
        "global",
        "global: compress among all ranks; inter-node: dense reduce inside each node "
        "(LOCAL_WORLD_SIZE ranks), compress only between nodes (none, fp16, bf16, dct).",
        choices=["global", "inter-node"],
    )
    plan_world_size: int = _opt(0, "--dry-run: ranks to plan for; 0 means WORLD_SIZE.")
    plan_gpus_per_node: int = _opt(8, "--dry-run: ranks per node for the communication plan.")
    plan_intra_node_gbit: float = _opt(
        2400.0, "--dry-run: link bandwidth between ranks of one node, Gbit/s per direction."
    )
    plan_inter_node_gbit: float = _opt(
        100.0, "--dry-run: link bandwidth between nodes, Gbit/s per direction per node."
    )
    plan_tflops: float = _opt(
        400.0, "--dry-run: sustained training TFLOP/s per rank for the compute time."
    )
    powersgd_rank: int = _opt(4, "powersgd: rank of the low-rank gradient approximation.")
    zero1: bool = _opt(
        False,
        "Shard AdamW's state across the data-parallel ranks (ZeRO stage 1, torch's "
        "ZeroRedundancyOptimizer); each rank checkpoints its own shard.",
    )
    ddp_bucket_cap_mb: float = _opt(
        25.0, "DDP gradient bucket size in MiB (all-reduce starts as each bucket fills)."
    )
    gradient_as_bucket_view: bool = _opt(
        True,
        "Gradients are views into DDP's buckets (saves one gradient-sized copy); "
        "--no-gradient-as-bucket-view keeps separate copies.",
    )
    ddp_static_graph: bool = _opt(
        False,
        "Tell DDP the autograd graph is the same every step (DDP static_graph): it then skips "
        "per-step graph checks. Valid where every trainable parameter gets a gradient every step "
        "(all tested causal LMs, MoE included).",
    )
    # Checkpoints and resume
    checkpoint_dir: str = _opt(
        "",
        "Folder of step-N checkpoints; empty means <output-dir>/checkpoints. Multi-node runs need "
        "it on a file system shared by all nodes, at the same path.",
    )
    checkpoint_every: int = _opt(
        500, "Checkpoint every N optimizer steps (0: only at the end and on SIGTERM/SIGINT)."
    )
    keep_checkpoints: int = _opt(3, "Complete checkpoints kept; older ones are deleted.")
    resume: bool = _opt(
        True, "Resume from the newest complete checkpoint in --checkpoint-dir (--no-resume: fresh)."
    )
    resume_from: str = _opt("", "Resume from this step-N checkpoint folder instead of the newest.")
    overwrite_output_dir: bool = _opt(
        False,
        "With --no-resume: delete the checkpoints and metrics.jsonl of the run already in "
        "--checkpoint-dir/--output-dir (without it such a start is refused).",
    )
    # Outputs
    output_dir: str = _opt("outputs/run", "Folder for metrics.jsonl, config.toml and final_model/.")
    log_every: int = _opt(10, "Log training metrics every N optimizer steps.")
    eval_every: int = _opt(100, "Evaluate every N optimizer steps (and at the end); 0: end only.")
    eval_batches: int = _opt(8, "Micro-batches of held-out windows per rank in each evaluation.")
    tensorboard: bool = _opt(
        False, "Also write TensorBoard event files to <output-dir>/tensorboard."
    )
    dry_run: bool = _opt(
        False,
        "Build the model on the meta device (no weights), print the per-rank memory and FLOP "
        "plan for these settings and the world size, and exit without training.",
    )
    device_memory_gib: float = _opt(
        0.0, "Device memory per rank in GiB for the plan; 0: the visible GPU's, else 80."
    )
    verbose: bool = _opt(False, "Debug logging, and library logs (transformers, datasets) at info.")


def field_names() -> list[str]:
    """The names of all config fields, in declaration order."""
    return [f.name for f in dataclasses.fields(TrainConfig)]


def load_toml(path: str) -> dict[str, object]:
    """Read a TOML config file into a flat dict; raises UserError on a missing or bad file."""
    file = Path(path)
    if not file.is_file():
        raise UserError(
            f"config file {path} does not exist; pass an existing TOML file to --config"
        )
    try:
        values = tomllib.loads(file.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise UserError(f"config file {path} is not valid TOML ({exc}); fix the syntax") from exc
    unknown = [key for key in values if key.replace("-", "_") not in field_names()]
    if unknown:
        raise UserError(f"config file {path}: {_unknown_message(unknown[0])}")
    flat = {key.replace("-", "_"): value for key, value in values.items()}
    return resolve_input_paths(check_file_values(flat, path), file.resolve().parent)


@cache
def file_schema() -> type[BaseModel]:
    """A strict pydantic model of the config-file values, built from TrainConfig's fields.

    Each field keeps its annotated type; a field with ``choices`` becomes ``Literal[choices]``.
    Strict mode refuses what a flag's type would refuse: 4.5 or true for an int, a string for a
    list, an int for a string (an int is accepted for a float, as TOML writes ``1`` for 1.0).
    Unknown keys are refused (``extra="forbid"``).
    """
    hints = get_type_hints(TrainConfig)
    fields: dict[str, tuple[object, object]] = {}
    for item in dataclasses.fields(TrainConfig):
        choices = item.metadata.get("choices")
        kind = Literal[tuple(choices)] if choices else hints[item.name]
        fields[item.name] = (kind, None)
    strict = ConfigDict(strict=True, extra="forbid")
    return create_model("TrainConfigFile", __config__=strict, **fields)


def check_file_values(values: dict[str, object], path: str) -> dict[str, object]:
    """The config-file ``values`` (underscored keys, as TOML parsed them) after the checks a flag
    gets, ints for float fields made floats; raises UserError naming the first bad key."""
    try:
        return file_schema().model_validate(values).model_dump(exclude_unset=True)
    except ValidationError as exc:
        error = exc.errors()[0]
        key = ".".join(str(part) for part in error["loc"])
        raise UserError(
            f"config file {path}: {key} = {error['input']!r} is invalid ({error['msg']}); "
            f"fix it in the file (see --help for --{_flag(str(error['loc'][0]))})"
        ) from exc


# Inputs a config file may name by a path relative to itself. Outputs (output_dir,
# checkpoint_dir) stay relative to the working directory, as in torchtitan and HF Trainer.
_PATH_OR_HUB_ID = ("model", "tokenizer")
_PATHS = ("resume_from",)
_PATH_LISTS = ("data_files", "eval_files")


def _is_path(value: str) -> bool:
    """Whether ``value`` cannot be a hub id (``namespace/name``): it starts with ``.``, ``/`` or
    ``~``, ends in ``.json``, or has more than one ``/``."""
    return value.startswith((".", "/", "~")) or value.endswith(".json") or value.count("/") > 1


def resolve_input_paths(values: dict[str, object], base: Path) -> dict[str, object]:
    """Make the input paths of a config file absolute, relative to ``base`` (its folder).

    ``model`` and ``tokenizer`` may be hub ids: they are resolved when ``base / value`` exists
    or the value cannot be a hub id (``_is_path``), so a missing file is reported where it was
    looked for. ``resume_from`` and each glob of ``data_files``/``eval_files`` are always joined to
    ``base`` unless absolute or empty. Other values pass through unchanged.
    """
    resolved = dict(values)
    for name in _PATH_OR_HUB_ID:
        value = resolved.get(name)
        if isinstance(value, str) and value and ((base / value).exists() or _is_path(value)):
            resolved[name] = str((base / value).resolve())
    for name in _PATHS:
        value = resolved.get(name)
        if isinstance(value, str) and value:
            resolved[name] = _joined(base, value)
    for name in _PATH_LISTS:
        value = resolved.get(name)
        if isinstance(value, list):
            resolved[name] = [
                _joined(base, item) if isinstance(item, str) else item for item in value
            ]
    return resolved


def _joined(base: Path, value: str) -> str:
    """``value`` if absolute, else ``base / value`` normalised (globs kept as written)."""
    path = Path(value).expanduser()
    return str(path if path.is_absolute() else Path(os.path.normpath(base / path)))


def _unknown_message(name: str) -> str:
    """'unknown option X; did you mean Y?' with the nearest valid field name."""
    key = name.lstrip("-").split("=")[0].replace("-", "_")
    close = difflib.get_close_matches(key, [*field_names(), "config"], n=1)
    hint = f"; did you mean --{close[0].replace('_', '-')}?" if close else "; see --help"
    return f"unknown option {name}{hint}"


def build_parser() -> HfArgumentParser:
    """The command-line parser: ``--config FILE`` plus one flag per TrainConfig field."""
    parser = HfArgumentParser(
        TrainConfig,
        description="Train a causal LM (LLaMA and any AutoModelForCausalLM) with PyTorch DDP "
        "under torchrun.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        allow_abbrev=False,
        exit_on_error=False,
    )
    parser.add_argument("--config", default=None, help="TOML file of defaults; flags override it.")
    parser.add_argument(
        "--print-config",
        action="store_true",
        help="Print the resolved config as TOML (readable by --config) and exit.",
    )
    for action in parser._actions:  # show --seq-length before its alias --seq_length
        action.option_strings.sort(key=lambda option: "_" in option)
    return parser


def parse_config(argv: list[str]) -> TrainConfig:
    """Parse ``argv`` (without the program name) into a validated TrainConfig.

    Raises UserError for a bad config file, an unknown flag or an invalid value. ``--help``
    prints the options and exits 0 (argparse's SystemExit).
    """
    parser = build_parser()
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", default=None)
    known, _ = pre.parse_known_args(argv)
    if known.config:
        parser.set_defaults(**load_toml(known.config))
    try:
        namespace, unknown = parser.parse_known_args(argv)
    except argparse.ArgumentError as exc:
        raise UserError(f"{exc}; see --help") from exc
    if unknown:
        raise UserError(_unknown_message(unknown[0]))
    values = {name: getattr(namespace, name) for name in field_names()}
    # Flags name paths relative to the working directory; save them absolute so that the saved
    # config means the same from anywhere (config-file paths were resolved by load_toml).
    config = TrainConfig(**resolve_input_paths(values, Path.cwd()))
    validate(config)
    return config


_POSITIVE = ("seq_length", "batch_size", "accumulation_steps", "learning_rate", "epochs")
_POSITIVE += ("log_every", "eval_batches", "restart_every", "restart_mult", "timeout_s")
_POSITIVE += ("keep_checkpoints", "compression_topk", "powersgd_rank", "ddp_bucket_cap_mb")
_NON_NEGATIVE = ("weight_decay", "warmup_steps", "eval_every", "threads", "min_lr")
_NON_NEGATIVE += ("max_grad_norm", "shuffle_buffer", "checkpoint_every", "compression_start_step")
_NON_NEGATIVE += ("max_bad_records", "train_timeout_s")
_NON_NEGATIVE += ("device_memory_gib",)
_POSITIVE += ("plan_intra_node_gbit", "plan_inter_node_gbit", "plan_tflops")
_POSITIVE += ("plan_gpus_per_node",)
_NON_NEGATIVE += ("plan_world_size",)


def validate(config: TrainConfig) -> None:
    """Reject invalid values with a UserError naming the flag and the fix."""
    for name in _POSITIVE:
        if getattr(config, name) <= 0:
            raise UserError(f"--{_flag(name)} must be > 0, got {getattr(config, name)}")
    for name in _NON_NEGATIVE:
        if getattr(config, name) < 0:
            raise UserError(f"--{_flag(name)} must be >= 0, got {getattr(config, name)}")
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
    if config.optimizer == "adamw":
        return
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


def _flag(name: str) -> str:
    return name.replace("_", "-")


def to_toml(config: TrainConfig) -> str:
    """The config as TOML text that ``--config`` reads back to an equal config (no secrets)."""
    return tomli_w.dumps(dataclasses.asdict(config))


def save_config(config: TrainConfig, path: Path) -> None:
    """Write the resolved config to ``path`` as TOML (the config holds no secrets: HF_TOKEN
    is only ever read from the environment)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(to_toml(config))


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
