"""The inputs of a run, checked before any process group starts by one function,
``check_inputs``, that a real start (``prepare_inputs``) and ``--dry-run`` both run: the
settings, device and node layout, the model's config, the memory fit (a real start only:
--dry-run prints the plan instead), the tokenizer, data and output paths, an earlier data error,
the example format of the data with its chat template, every data and held-out file against it,
the multiple-choice questions and enough tokens for one step. Every problem is a UserError of
one line, raised before any rank waits for another.

Like build.py, this module composes components (model, training_data, methods, metrics,
dry_run's fit check); they do not import each other.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from datasets import IterableDataset
from transformers import PretrainedConfig, PreTrainedTokenizerBase
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from torchrun_ddp.checkpoint import find_latest, read_meta
from torchrun_ddp.config import TrainConfig
from torchrun_ddp.distributed import DistEnv
from torchrun_ddp.dry_run import DataCount, check_fits, dry_run, plan_model_config, run_device_type
from torchrun_ddp.errors import DataError, UserError
from torchrun_ddp.faults import check_hooks
from torchrun_ddp.methods import Method, method_for
from torchrun_ddp.metrics import (
    check_wandb_installed,
)
from torchrun_ddp.model import (
    check_fused_loss,
    load_model_config,
    max_positions,
)
from torchrun_ddp.parallel.base import DataParallel
from torchrun_ddp.parallel.modes import mode_for
from torchrun_ddp.training_data import (
    ExampleFormat,
    GlobalPackedWindows,
    MultipleChoiceQuestion,
    check_record,
    check_tokenizer,
    count_tokens,
    data_format,
    example_tokens,
    expand_patterns,
    first_record,
    hub_format,
    is_local_path,
    load_chat_template,
    load_tokenizer,
    open_documents,
    read_questions,
    resolve_files,
    windows_per_rank,
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
    method: Method | None = None
    """The run's training method, built and checked once (``check_settings``)."""
    mode: DataParallel | None = None
    """The run's data-parallel mode on its ranks, built once (``check_settings``)."""
    test_hooks: str = ""
    """The test hooks the harness armed (``faults.check_hooks``), "" in every real run."""


@dataclass
class CheckedInputs:
    """What ``check_inputs`` found, for a real start and --dry-run alike."""

    method: Method
    """The run's training method, built and checked once."""
    mode: DataParallel
    """The run's data-parallel mode on its ranks, built once."""
    tokenizer: PreTrainedTokenizerBase | None
    """None only under --dry-run for a hub tokenizer, which it does not download."""
    example_format: ExampleFormat
    train_files: list[str]
    eval_files: list[str]
    questions: list[MultipleChoiceQuestion]
    """The --eval-multiple-choice questions, tokenised ([] without a tokenizer)."""
    data_tokens: int | None
    """Tokens of the local training files (``check_enough_tokens``), None where not counted."""


def prepare_inputs(config: TrainConfig, env: DistEnv) -> Inputs:
    """A real start's inputs: the test hooks (a hook variable set but not armed by the test
    harness is refused: ``faults.check_hooks``), the model's config, then ``check_inputs`` (the
    checks --dry-run runs too), the documents opened. Raises UserError on the first problem."""
    test_hooks = check_hooks()
    model_config = load_model_config(config.model)
    checked = check_inputs(config, env, model_config)
    assert checked.tokenizer is not None  # only --dry-run leaves a hub tokenizer unloaded
    warn_long_warmup(config, env)
    train_files, eval_files, fmt = checked.train_files, checked.eval_files, checked.example_format
    hub = (config.dataset, config.dataset_config)
    fraction = config.eval_fraction if train_files and not eval_files else 0.0
    return Inputs(
        model_config=model_config,
        tokenizer=checked.tokenizer,
        train_documents=open_documents(train_files, *hub, config.dataset_split, fmt, fraction),
        eval_documents=eval_documents(config, train_files, eval_files, fmt),
        example_format=fmt,
        questions=checked.questions,
        method=checked.method,
        mode=checked.mode,
        test_hooks=test_hooks,
    )


def check_inputs(
    config: TrainConfig, env: DistEnv, model_config: PretrainedConfig
) -> CheckedInputs:
    """The start-up checks, one function for a real start and --dry-run (``config.dry_run``):
    the settings (``check_settings``); a real start only, the fused loss on this device and the
    memory fit (--dry-run reports the plan instead); the output and checkpoint folders, an
    earlier data error, the tokenizer (under --dry-run only a local one: a hub id is not
    downloaded), the example format (``example_format``: detected, its chat template loaded
    and the first example rendered), every --data-files and --eval-files file read against
    it, the --eval-multiple-choice questions and enough tokens for one step
    (``check_enough_tokens``). Raises UserError (DataError for a kept data error) on the first
    problem."""
    method, mode = check_settings(config, env, model_config)
    if not config.dry_run:
        if config.fused_loss == "liger":
            check_fused_loss(run_device_type(config), str(model_config.model_type or ""))
        check_fits(config, model_config, env, method)
    check_paths(config)
    check_data_error(config)
    name = config.tokenizer or config.model
    local = is_local_path(name) or not config.dry_run
    tokenizer = load_tokenizer(name) if local else None
    fmt = example_format(config, tokenizer)
    train_files = resolve_files(config.data_files, "--data-files", config.max_bad_records, fmt)
    eval_files = resolve_files(config.eval_files, "--eval-files", config.max_bad_records, fmt)
    questions = multiple_choice_questions(config, tokenizer)
    tokens = check_enough_tokens(config, env, tokenizer, train_files, fmt)
    return CheckedInputs(method, mode, tokenizer, fmt, train_files, eval_files, questions, tokens)


def check_settings(
    config: TrainConfig, env: DistEnv, model_config: PretrainedConfig
) -> tuple[Method, DataParallel]:
    """The start-up checks that need no file but the model's config: the method's settings, the
    device (a real start's only: --dry-run plans a GPU run without one), the node layout of a
    node-aware scope, a causal LM, --seq-length within its positions, a --data-parallel mesh
    that divides the ranks. Returns the run's method and mode, built once here. Raises
    UserError on the first problem."""
    method = method_for(config)
    if config.report_to == "wandb":
        check_wandb_installed()
    if not config.dry_run:
        check_device(config.device)
    if config.compression_scope == "inter-node":
        check_node_layout(env)
    mode = mode_for(config, env.world_size, env.local_world_size)  # its mesh divides the ranks
    check_causal_lm(model_config, config.model)
    limit = max_positions(model_config)
    if limit and config.seq_length > limit:
        raise UserError(
            f"--seq-length {config.seq_length} exceeds the model's {limit} positions; "
            f"use --seq-length {limit} or less"
        )
    return method, mode


def print_plan(config: TrainConfig, env: DistEnv) -> None:
    """--dry-run: a real start's input checks (``check_inputs``), then rank 0 prints the plan
    (``dry_run.dry_run``) with what was counted of the data (``planned_data``). Raises
    UserError as a start would."""
    model_config = plan_model_config(config)
    checked = check_inputs(config, env, model_config)
    if env.is_main:
        data = planned_data(config, env, checked)
        print(dry_run(config, env, data, model_config, checked.method))


def planned_data(config: TrainConfig, env: DistEnv, checked: CheckedInputs) -> DataCount:
    """What --dry-run's run length needs of the local training files that ``check_inputs``
    read: their tokens (``checked.data_tokens``) and the windows each planned rank
    (--plan-world-size, else WORLD_SIZE) packs from them over --epochs, as training deals and
    packs them (``training_data.windows_per_rank``, counted up to --max-steps' windows);
    nothing where the tokens were not counted (a hub tokenizer, hub streaming, large files)."""
    if checked.data_tokens is None or checked.tokenizer is None:
        return DataCount()
    fmt = checked.example_format
    fraction = config.eval_fraction if not config.eval_files else 0.0
    documents = open_documents(checked.train_files, "", "", "", fmt, fraction)
    order = GlobalPackedWindows(
        documents, checked.tokenizer, config.seq_length, 0, 1, config.epochs,
        config.shuffle_buffer, config.seed, config.max_bad_records, fmt,
    )  # fmt: skip
    per_step = config.batch_size * config.accumulation_steps
    limit = config.max_steps * per_step if config.max_steps > 0 else sys.maxsize
    world = config.plan_world_size or env.world_size
    return DataCount(checked.data_tokens, tuple(windows_per_rank(order, world, limit)))


def multiple_choice_questions(
    config: TrainConfig, tokenizer: PreTrainedTokenizerBase | None
) -> list[MultipleChoiceQuestion]:
    """The --eval-multiple-choice questions, tokenised ([] without the flag, or checked only
    without a tokenizer); raises UserError in one line for a file that cannot be read or a
    question that is not well formed."""
    if not config.eval_multiple_choice:
        return []
    return read_questions(config.eval_multiple_choice, tokenizer)


def example_format(config: TrainConfig, tokenizer: PreTrainedTokenizerBase | None) -> ExampleFormat:
    """The example format of the training data: --data-format, or detected from the first
    record of --data-files (or of the hub's --dataset-split; not under --dry-run, which streams
    nothing: the format then stays ``auto`` and each --eval-files file is read as its own);
    the chat template loaded and the first record rendered with it. Raises UserError for data
    of no known format (with the fix, naming the file and line), a missing or failing
    --chat-template, or a slow tokenizer for examples (``check_tokenizer``)."""
    fmt = ExampleFormat(
        name=config.data_format,
        text_field=config.text_field,
        train_on_prompt=config.train_on_prompt,
        separate=config.separate_documents,
        packing=config.packing,
    )
    first: tuple[dict[str, object], str] | None = None
    if config.data_files:
        first = first_record(expand_patterns(config.data_files, "--data-files"), "--data-files")
        fmt = data_format(fmt, *first)
    elif not config.dry_run:
        fmt = hub_format(fmt, config.dataset, config.dataset_config, config.dataset_split)
    if fmt.name == "text":
        return fmt
    fmt = replace(fmt, chat_template=load_chat_template(config.chat_template, tokenizer))
    if tokenizer is None or fmt.name == "auto":
        return fmt
    check_tokenizer(tokenizer, fmt)
    if first is not None:
        check_first_example(tokenizer, fmt, first[0])
    return fmt


def check_first_example(
    tokenizer: PreTrainedTokenizerBase, fmt: ExampleFormat, record: dict[str, object]
) -> None:
    """Tokenise the first record as training will (``example_tokens``: the chat template
    renders a conversation), so that a template that fails, or renders turns that do not add
    up, stops the start in one line (UserError) rather than the loader; a damaged first record
    is left to the file check."""
    example, _ = check_record(record, fmt)
    if example is not None:
        example_tokens(tokenizer, example, fmt)


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
    tokenizer: PreTrainedTokenizerBase | None,
    files: list[str],
    fmt: ExampleFormat | None = None,
) -> int | None:
    """The tokens the local training ``files`` give (the held-out slice left out), counted as
    training packs them: a real start stops at one optimizer step's worth, --dry-run counts
    them all for its run length. None where they are not counted (no tokenizer, hub
    streaming, files over 64 MiB: ``count_tokens``; a real start that resumes).

    Raises UserError when they give (over all --epochs) fewer tokens than one optimizer step
    takes over all ranks (--plan-world-size under --dry-run), so a run that could train nothing
    stops before any process group; not where a checkpoint is there to resume (a finished run
    restarted has nothing left to train, and that is success)."""
    resuming = bool(config.resume_from or (config.resume and find_latest(checkpoint_root(config))))
    if tokenizer is None or (resuming and not config.dry_run):
        return None
    world = (config.plan_world_size if config.dry_run else 0) or env.world_size
    needed = tokens_per_step(config, replace(env, world_size=world))
    held = config.eval_fraction if not config.eval_files else 0.0
    limit = sys.maxsize if config.dry_run else -(-needed // config.epochs)
    found = count_tokens(files, tokenizer, limit, fmt, held)
    if found is None or resuming or found * config.epochs >= needed:
        return found
    epochs = f" x --epochs {config.epochs}" if config.epochs > 1 else ""
    raise UserError(
        f"--data-files give {found} tokens{epochs}, fewer than one optimizer step trains: "
        f"{needed} (world_size {world} x --batch-size {config.batch_size} x "
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


def checkpoint_root(config: TrainConfig) -> Path:
    """Where step-N checkpoints live: --checkpoint-dir, or <output-dir>/checkpoints."""
    return Path(config.checkpoint_dir or Path(config.output_dir) / "checkpoints")


def tokens_per_step(config: TrainConfig, env: DistEnv) -> int:
    """Tokens trained per optimizer step over all ranks."""
    return config.batch_size * config.accumulation_steps * config.seq_length * env.world_size
