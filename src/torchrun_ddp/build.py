"""Setting a run up, for ``main``: inputs checked before any process group, the checkpoint
folders' storage domains, the DDP model with the training method's comm hook and optimizer
(``methods``) or the model sharded by FSDP (``parallelize``, --data-parallel), and this rank's
training and held-out data.

Like main.py, this module composes the components (model, data, methods, checkpoint, metrics);
they do not import each other.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import sys
import tempfile
from dataclasses import dataclass, field, replace
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from datasets import IterableDataset
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler
from transformers import PretrainedConfig, PreTrainedTokenizerBase
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from torchrun_ddp.checkpoint import StorageLayout, detect_storage, find_latest, read_meta
from torchrun_ddp.compression import CompressionState, ShardedExchange
from torchrun_ddp.config import TrainConfig
from torchrun_ddp.distributed import DistEnv, new_node_groups, track_group
from torchrun_ddp.dry_run import check_fits
from torchrun_ddp.errors import DataError, UserError
from torchrun_ddp.lookahead import LookaheadBatches
from torchrun_ddp.methods import Method, method_for
from torchrun_ddp.metrics import (
    LogWindow,
    MetricsLogger,
    build_metrics,
    check_wandb_installed,
    device_peak_flops,
)
from torchrun_ddp.model import (
    PRECISION_DTYPES,
    apply_lora,
    build_model,
    compile_model,
    enable_activation_checkpointing,
    load_model_config,
    lora_settings,
    max_positions,
    settle_buckets,
    trainable_parameter_sizes,
    trained_tokens,
    wrap_ddp,
)
from torchrun_ddp.optim import ScheduleSettings, build_scheduler
from torchrun_ddp.parallelize import (
    build_mesh,
    load_from_rank0,
    mesh_shape,
    rank0_weights,
    shard_model,
)
from torchrun_ddp.plan import (
    matmul_parameter_count,
    model_flops_per_token,
    parameter_count,
)
from torchrun_ddp.training_data import (
    ExampleFormat,
    MultipleChoiceQuestion,
    PackedWindows,
    build_train_loader,
    check_tokenizer,
    count_tokens,
    data_format,
    eval_batches,
    expand_patterns,
    first_record,
    hub_format,
    is_local_path,
    load_chat_template,
    load_tokenizer,
    open_documents,
    read_questions,
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
    eval_documents: IterableDataset | None
    """None: no held-out set (local data without --eval-files or --eval-fraction)."""
    example_format: ExampleFormat = field(default_factory=ExampleFormat)
    questions: list[MultipleChoiceQuestion] = field(default_factory=list)
    """The --eval-multiple-choice questions, tokenised (every rank holds them all)."""


def prepare_inputs(config: TrainConfig, env: DistEnv) -> Inputs:
    """Check the model, memory plan, tokenizer, data paths and the method's settings; raises
    UserError on the first problem."""
    model_config = load_model_config(config.model)
    check_settings(config, env, model_config)
    check_fits(config, model_config, env)
    check_paths(config)
    check_data_error(config)
    tokenizer = load_tokenizer(config.tokenizer or config.model)
    fmt = example_format(config, tokenizer)
    train_files = resolve_files(config.data_files, "--data-files", config.max_bad_records, fmt)
    eval_files = resolve_files(config.eval_files, "--eval-files", config.max_bad_records, fmt)
    check_enough_tokens(config, env, tokenizer, train_files, fmt)
    warn_long_warmup(config, env)
    hub = (config.dataset, config.dataset_config)
    fraction = config.eval_fraction if train_files and not eval_files else 0.0
    return Inputs(
        model_config=model_config,
        tokenizer=tokenizer,
        train_documents=open_documents(train_files, *hub, config.dataset_split, fmt, fraction),
        eval_documents=eval_documents(config, train_files, eval_files, fmt),
        example_format=fmt,
        questions=multiple_choice_questions(config, tokenizer),
    )


def check_settings(config: TrainConfig, env: DistEnv, model_config: PretrainedConfig) -> None:
    """The start-up checks that need no file but the model's config: the method's settings, the
    device, the node layout of a node-aware scope, a causal LM, --seq-length within its
    positions, a --data-parallel mesh that divides the ranks. Raises UserError on the first
    problem."""
    method_for(config)
    if config.report_to == "wandb":
        check_wandb_installed()
    check_device(config.device)
    if config.compression_scope == "inter-node":
        check_node_layout(env)
    if config.data_parallel != "ddp":  # the mesh must divide the ranks
        mesh_shape(config.data_parallel, env.world_size, env.local_world_size, config.shard_degree)
    check_causal_lm(model_config, config.model)
    limit = max_positions(model_config)
    if limit and config.seq_length > limit:
        raise UserError(
            f"--seq-length {config.seq_length} exceeds the model's {limit} positions; "
            f"use --seq-length {limit} or less"
        )


def check_dry_run_inputs(
    config: TrainConfig, env: DistEnv, model_config: PretrainedConfig
) -> int | None:
    """--dry-run's share of a real start's checks (``prepare_inputs`` but the memory fit, which
    the plan reports instead): settings, output and checkpoint folders, an earlier data error,
    a local tokenizer, the data files. Returns the tokens one pass over the local training
    files gives (``count_tokens``), or None where they are not counted (hub streaming, files
    over 64 MiB, or a hub tokenizer, which --dry-run does not download). Raises UserError."""
    check_settings(config, env, model_config)
    check_paths(config)
    check_data_error(config)
    name = config.tokenizer or config.model
    tokenizer = load_tokenizer(name) if is_local_path(name) else None
    train_files = resolve_files(config.data_files, "--data-files", config.max_bad_records)
    resolve_files(config.eval_files, "--eval-files", config.max_bad_records)
    if tokenizer is None:
        return None
    return count_tokens(train_files, tokenizer, sys.maxsize)


def multiple_choice_questions(
    config: TrainConfig, tokenizer: PreTrainedTokenizerBase
) -> list[MultipleChoiceQuestion]:
    """The --eval-multiple-choice questions, tokenised ([] without the flag); raises UserError
    in one line for a file that cannot be read or a question that is not well formed."""
    if not config.eval_multiple_choice:
        return []
    return read_questions(config.eval_multiple_choice, tokenizer)


def example_format(config: TrainConfig, tokenizer: PreTrainedTokenizerBase) -> ExampleFormat:
    """The example format of the training data: --data-format, or detected from the first
    record of --data-files (or of the hub's --dataset-split); the chat template loaded. Raises
    UserError for data of no known format (with the fix), a missing --chat-template, or a slow
    tokenizer for prompt-completion or messages (``check_tokenizer``)."""
    fmt = ExampleFormat(
        name=config.data_format,
        text_field=config.text_field,
        train_on_prompt=config.train_on_prompt,
        separate=config.separate_documents,
        packing=config.packing,
    )
    if config.data_files:
        files = expand_patterns(config.data_files, "--data-files")
        fmt = data_format(fmt, first_record(files, "--data-files"), "--data-files")
    else:
        fmt = hub_format(fmt, config.dataset, config.dataset_config, config.dataset_split)
    if fmt.name == "text":
        return fmt
    check_tokenizer(tokenizer, fmt)
    return replace(fmt, chat_template=load_chat_template(config.chat_template, tokenizer))


def eval_documents(
    config: TrainConfig, train_files: list[str], eval_files: list[str], fmt: ExampleFormat
) -> IterableDataset | None:
    """The held-out records: --eval-files; else the --eval-fraction slice of --data-files
    (nothing when it is 0, never the hub); else the hub dataset's --eval-split."""
    hub = (config.dataset, config.dataset_config)
    if eval_files:
        return open_documents(eval_files, *hub, "", fmt)
    if train_files:
        if not config.eval_fraction:
            return None
        return open_documents(train_files, *hub, "", fmt, config.eval_fraction, heldout=True)
    return open_documents([], *hub, config.eval_split, fmt) if config.eval_split else None


def check_enough_tokens(
    config: TrainConfig,
    env: DistEnv,
    tokenizer: PreTrainedTokenizerBase,
    files: list[str],
    fmt: ExampleFormat | None = None,
) -> None:
    """Raise UserError when the local training ``files`` (over all --epochs) give fewer tokens
    than one optimizer step takes over all ranks, so a run that could train nothing stops
    before any process group. Skipped where counting is too costly (``count_tokens``: hub
    streaming, files over 64 MiB) and where a checkpoint is there to resume (a finished run
    restarted has nothing left to train, and that is success)."""
    if config.resume_from or (config.resume and find_latest(checkpoint_root(config))):
        return
    needed = tokens_per_step(config, env)
    held = config.eval_fraction if not config.eval_files else 0.0
    found = count_tokens(files, tokenizer, -(-needed // config.epochs), fmt, held)
    if found is None or found * config.epochs >= needed:
        return
    epochs = f" x --epochs {config.epochs}" if config.epochs > 1 else ""
    raise UserError(
        f"--data-files give {found} tokens{epochs}, fewer than one optimizer step trains: "
        f"{needed} (world_size {env.world_size} x --batch-size {config.batch_size} x "
        f"--seq-length {config.seq_length} x --accumulation-steps {config.accumulation_steps}); "
        "add documents, raise --epochs, or lower --batch-size or --seq-length"
    )


def warn_long_warmup(config: TrainConfig, env: DistEnv) -> None:
    """Rank 0 warns once when --warmup-steps is not below --max-steps: the learning rate rises
    for the whole run (``optim.build_scheduler``: step s trains at lr (s + 1) / W)."""
    steps, warmup = config.max_steps, config.warmup_steps
    if not env.is_main or steps < 0 or warmup < steps:
        return
    log.warning(
        "--warmup-steps %d is not below --max-steps %d: the learning rate rises for the whole "
        "run and reaches %.3g (%d%% of --learning-rate) only at its last step; lower "
        "--warmup-steps", warmup, steps, config.learning_rate * steps / warmup,
        100 * steps // warmup,
    )  # fmt: skip


def check_paths(config: TrainConfig) -> None:
    """Raise UserError for an output or checkpoint folder that is a file or cannot be written,
    or a --resume-from that is not a complete checkpoint (unless it is missing here and folders
    may be per node: the start agreement then finds which nodes hold it); reads only (nothing
    is created), so it runs before the process group."""
    check_writable_folder(Path(config.output_dir), "--output-dir")
    check_writable_folder(checkpoint_root(config), "--checkpoint-dir")
    shared = config.checkpoint_storage == "shared"
    if config.resume_from and (shared or Path(config.resume_from).exists()):
        read_meta(Path(config.resume_from))  # with a folder per node, some nodes may lack it


def check_writable_folder(folder: Path, flag: str) -> None:
    """Raise UserError unless ``folder`` is, or can be created as, a folder this process can
    write. An existing folder is checked with ``os.access`` (nothing in it changes: a refused
    start touches no saved run); for a new one, a probe folder is made and removed in its
    nearest existing ancestor (``os.access`` alone passes root on /proc, say)."""
    existing = next(path for path in (folder, *folder.absolute().parents) if path.exists())
    if not existing.is_dir():
        what = "is a file" if existing == folder else f"is inside the file {existing}"
        raise UserError(f"{flag} {folder} {what}, not a folder; pass a folder path")
    try:
        if existing == folder and not os.access(folder, os.W_OK | os.X_OK):
            raise PermissionError(13, "Permission denied")
        if existing != folder:
            os.rmdir(tempfile.mkdtemp(prefix=".write-check-", dir=existing))
    except OSError as exc:
        raise UserError(
            f"{flag} {folder} cannot be written ({existing}: {exc.strerror}); "
            "pass a writable folder"
        ) from exc


DATA_ERROR_FILE = "data_error.json"
"""In --output-dir: the DataError that stopped an attempt, and the --max-bad-records it had."""


def record_data_error(config: TrainConfig, error: DataError) -> None:
    """Rank 0: keep ``error`` in ``<output_dir>/data_error.json`` for ``check_data_error``."""
    record = {"error": str(error), "max_bad_records": config.max_bad_records}
    (Path(config.output_dir) / DATA_ERROR_FILE).write_text(json.dumps(record) + "\n")


def check_data_error(config: TrainConfig) -> None:
    """Raise the DataError an earlier attempt of this output folder stopped on, unless
    --max-bad-records is now higher: a torchrun restart then stops at once with the same line
    instead of training back into the same damaged records."""
    file = Path(config.output_dir) / DATA_ERROR_FILE
    if not file.is_file():
        return
    try:
        record = json.loads(file.read_text())
        allowed = int(record["max_bad_records"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise UserError(f"cannot read {file} ({exc}); delete it once the data is repaired") from exc
    if config.max_bad_records > allowed:
        return
    raise DataError(f"{record['error']} (kept in {file}: delete it once the data is repaired)")


def check_node_layout(env: DistEnv) -> None:
    """Raise UserError unless the ranks form equal nodes numbered node by node, as the
    node-aware scope's groups (``distributed.new_node_groups``) need; checked before the process
    group starts, so no rank waits for one that refused."""
    per_node = env.local_world_size
    if per_node < 1 or env.world_size % per_node:
        raise UserError(
            f"--compression-scope inter-node needs the same ranks on every node, but WORLD_SIZE "
            f"{env.world_size} is not a multiple of LOCAL_WORLD_SIZE {per_node}; "
            "use --compression-scope global"
        )
    if env.rank != env.rank // per_node * per_node + env.local_rank:
        raise UserError(
            f"--compression-scope inter-node needs ranks numbered node by node, but rank "
            f"{env.rank} has LOCAL_RANK {env.local_rank}; use --compression-scope global"
        )


def check_device(device: str) -> None:
    """Raise UserError for ``--device cuda`` on a machine where torch sees no GPU."""
    if device == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda was asked for but torch sees no GPU; use --device cpu")


def check_causal_lm(model_config: PretrainedConfig, name: str) -> None:
    """Raise UserError unless ``AutoModelForCausalLM`` has a class for the config's model type
    (a BERT or T5 config cannot be trained as a causal LM)."""
    model_type = getattr(model_config, "model_type", "")
    if model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return
    raise UserError(
        f"--model {name} is a {model_type or 'unknown'} model, not a causal language model "
        "(AutoModelForCausalLM has no class for it); pass a causal LM such as LLaMA"
    )


def train_timeout_s(config: TrainConfig) -> int:
    """The collective timeout after the first step: --train-timeout-s, or --timeout-s for 0."""
    return config.train_timeout_s or config.timeout_s


def checkpoint_root(config: TrainConfig) -> Path:
    """Where step-N checkpoints live: --checkpoint-dir, or <output-dir>/checkpoints."""
    return Path(config.checkpoint_dir or Path(config.output_dir) / "checkpoints")


def checkpoint_storage(config: TrainConfig, env: DistEnv) -> StorageLayout:
    """Collective: the storage domains of --checkpoint-dir (``checkpoint.detect_storage``: which
    ranks see one folder, a probe at start); their process groups get the start-up timeout now
    and the training timeout later, like every group of the run. Raises UserError (every rank)
    for views that do not form storage domains."""
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
    if config.data_parallel != "ddp" and not storage.shared:
        raise UserError(
            f"--checkpoint-dir {checkpoint_root(config)} is a folder per node or site, which "
            f"--data-parallel {config.data_parallel} does not support yet (a folder would hold "
            "only its ranks' shards); use one shared folder (--checkpoint-storage shared)"
        )
    return storage


def build_sharded_model(
    config: TrainConfig, device: torch.device, inputs: Inputs, env: DistEnv, method: Method
) -> tuple[torch.nn.Module, CompressionState]:
    """Collective: the model sharded by FSDP2 over --data-parallel's mesh (``parallelize``),
    and the method's state for it (``Method.register_sharded``). Rank 0 builds the weights
    (seeded as under DDP, or pretrained) on the host, the other ranks the shapes on the meta
    device; rank 0's weights are then scattered to the shards."""
    host = torch.device("cpu") if env.rank == 0 else torch.device("meta")
    model = build_model(
        config.model, inputs.model_config, config.init, config.precision, config.seed, host
    )
    if config.activation_checkpointing:
        enable_activation_checkpointing(model)
    rank0_state = rank0_weights(model)
    shape = mesh_shape(
        config.data_parallel, env.world_size, env.local_world_size, config.shard_degree
    )
    mesh = build_mesh(device, shape, hybrid=config.data_parallel == "hsdp")
    units = shard_model(model, mesh, config.precision)
    load_from_rank0(model, device, rank0_state)
    del rank0_state
    gather_dtype = torch.bfloat16 if config.precision != "fp32" else torch.float32
    exchange = ShardedExchange(
        parameters=sum(trainable_parameter_sizes(model)),
        gathered=units.gathered,
        shard=shape.shard,
        replicate=shape.replicate,
        micro_batches=config.accumulation_steps,
        gather_bytes=gather_dtype.itemsize,
        reduce_bytes=PRECISION_DTYPES[config.precision].itemsize,
    )
    log.info(
        "--data-parallel %s: %d decoder-layer units + root on a mesh of %d x %d ranks "
        "(replicate x shard)",
        config.data_parallel, units.layers, shape.replicate, shape.shard,
    )  # fmt: skip
    return model, method.register_sharded(model, exchange)


def build_parallel_model(
    config: TrainConfig, device: torch.device, inputs: Inputs, env: DistEnv, method: Method
) -> tuple[torch.nn.Module, torch.nn.Module, CompressionState]:
    """(the model, what the loop runs: its DDP wrapper or the sharded model itself, the
    method's state) for --data-parallel."""
    if config.data_parallel == "ddp":
        return build_ddp_model(config, device, inputs, env, method)
    model, compression = build_sharded_model(config, device, inputs, env, method)
    return model, model, compression


def build_ddp_model(
    config: TrainConfig, device: torch.device, inputs: Inputs, env: DistEnv, method: Method
) -> tuple[torch.nn.Module, DistributedDataParallel, CompressionState]:
    """The model (a PeftModel under --peft lora), its DDP wrapper with the method's comm hook,
    and the hook's state. Under LoRA, DDP sees only the adapters as parameters that need
    gradients, so only they are bucketed and all-reduced."""
    model: torch.nn.Module = build_model(
        config.model,
        inputs.model_config,
        config.init,
        config.precision,
        config.seed,
        device,
        config.peft,
    )
    if config.activation_checkpointing:
        enable_activation_checkpointing(model)
    if config.peft == "lora":
        model = apply_lora(model, lora_settings(config))
    ddp_model = wrap_ddp(
        model,
        device,
        config.ddp_bucket_cap_mb,
        config.gradient_as_bucket_view,
        config.ddp_static_graph,
    )
    shape, vocab = (config.batch_size, config.seq_length), inputs.model_config.vocab_size
    settle_buckets(ddp_model, shape, vocab, config.precision)
    node_groups = new_node_groups(env) if config.compression_scope == "inter-node" else None
    compression = method.register_hook(ddp_model, node_groups)
    if config.compile:
        compile_model(ddp_model)
    return model, ddp_model, compression


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


def tokens_per_step(config: TrainConfig, env: DistEnv) -> int:
    """Tokens trained per optimizer step over all ranks."""
    return config.batch_size * config.accumulation_steps * config.seq_length * env.world_size


def build_train_data(
    config: TrainConfig, env: DistEnv, inputs: Inputs, device: torch.device
) -> LookaheadBatches:
    """This rank's micro-batches of the global document order (``training_data``: read and
    packed in a worker process, resumable, re-split at another world size), grouped by
    optimizer step and read ahead (``lookahead``)."""
    loader = build_train_loader(
        inputs.train_documents,
        inputs.tokenizer,
        config.seq_length,
        config.batch_size,
        env.rank,
        env.world_size,
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
    broadcasts in every forward (``model.constant_buffers`` false) cannot hang in ``evaluate``.
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


def build_trainer(
    config: TrainConfig,
    env: DistEnv,
    device: torch.device,
    inputs: Inputs,
    run_id: str = "",
    storage: StorageLayout | None = None,
) -> Trainer:
    """Model in DDP with the method's comm hook and optimizer, schedule, data and metrics for this
    rank;
    ``storage``: its checkpoint folders (``checkpoint_storage``)."""
    method = method_for(config)
    model, ddp_model, compression = build_parallel_model(config, device, inputs, env, method)
    optimizer = method.build(model, compression)
    scheduler = build_scheduler(optimizer, schedule_settings(config))
    torch.manual_seed(config.seed + env.rank)
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
        model=ddp_model,
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
        run_id=run_id,
        storage=storage,
        questions=inputs.questions[env.rank :: env.world_size],
    )
