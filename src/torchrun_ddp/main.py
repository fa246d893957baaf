"""run(config, env): build the pieces, then train with DDP; the loop reads like the algorithm.

For each optimizer step: take ``accumulation_steps`` micro-batches (all ranks agree there is
data), forward and backward through the DDP model (``no_sync`` on all but the last micro-batch, so
gradients are all-reduced once per step by the comm hook), clip, step, schedule, log, evaluate.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import signal
import sys
import time
from collections.abc import Iterator
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

import torch
import torch.distributed as dist
from datasets import IterableDataset
from torch import Tensor
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler
from tqdm import tqdm
from transformers import PretrainedConfig, PreTrainedTokenizerBase
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from torchrun_ddp.checkpoint import (
    ModelAndOptimizer,
    ShardedOptimizer,
    StartPlan,
    Stateful,
    capture_rng_state,
    check_compatible,
    load_checkpoint,
    model_fingerprint,
    plan_start,
    read_meta,
    record_run_id,
    restore_rng_state,
    save_checkpoint,
    verify_start,
)
from torchrun_ddp.compression import (
    CompressionSettings,
    CompressionState,
    DeMo,
    DemoSettings,
    LocalMomentum,
    build_demo,
    register_compression,
    register_local_gradients,
    validate_settings,
)
from torchrun_ddp.compression.plan import (
    Topology,
    communication_table,
    reference_methods,
    state_bytes,
)
from torchrun_ddp.config import TrainConfig, save_config
from torchrun_ddp.distributed import (
    DistEnv,
    init_distributed,
    new_node_groups,
    pick_device,
    setup_logging,
    shutdown_distributed,
)
from torchrun_ddp.errors import UserError
from torchrun_ddp.faults import fault_point
from torchrun_ddp.memory_plan import (
    MemoryPlan,
    PlanSettings,
    llama2_7b_config,
    matmul_parameter_count,
    meta_model,
    missing_sizes,
    model_flops_per_token,
    parameter_sizes,
    plan_memory,
    suggestions,
)
from torchrun_ddp.metrics import (
    MetricsLogger,
    Record,
    build_metrics,
    check_records,
    device_peak_flops,
    peak_memory_bytes,
    restart_records,
)
from torchrun_ddp.model import (
    LoraSettings,
    apply_lora,
    autocast_context,
    build_model,
    compile_model,
    enable_activation_checkpointing,
    load_model_config,
    max_positions,
    parameter_count,
    save_lora_outputs,
    trainable_parameter_sizes,
    wrap_ddp,
)
from torchrun_ddp.optimizer import build_optimizer, build_scheduler, parameter_groups
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
    windows: PackedWindows
    eval_set: list[torch.Tensor]
    metrics: MetricsLogger
    tokenizer: PreTrainedTokenizerBase
    flops_per_token: float
    """Training FLOPs per token (6N + attention), for MFU."""
    peak_flops_total: float
    """Peak FLOP/s of all ranks together; inf when unknown (MFU then reads 0)."""
    run_id: str = ""
    """The run's identity, stamped in checkpoints and metrics.jsonl."""
    step: int = 0
    """Optimizer steps done (restored on resume)."""


def compression_settings(config: TrainConfig) -> CompressionSettings:
    """The comm hook's settings from the config; raises UserError if they do not fit together."""
    settings = CompressionSettings(
        method=config.compression,
        ratio=config.compression_ratio,
        block_size=config.compression_block_size,
        topk=config.compression_topk,
        error_feedback=config.compression_error_feedback,
        start_step=config.compression_start_step,
        powersgd_rank=config.powersgd_rank,
        topk_value_dtype=config.compression_value_dtype,
        selection=config.compression_selection,
        scope=config.compression_scope,
    )
    try:
        validate_settings(settings)
    except ValueError as exc:  # validate_settings raises ValueError for bad settings only
        raise UserError(str(exc)) from exc
    return settings


def prepare_inputs(config: TrainConfig, env: DistEnv) -> Inputs:
    """Check the model, memory plan, tokenizer, data paths and compression settings; raises
    UserError on the first problem."""
    compression_settings(config)
    check_device(config.device)
    if config.compression_scope == "inter-node":
        check_node_layout(env)
    model_config = load_model_config(config.model)
    check_causal_lm(model_config, config.model)
    limit = max_positions(model_config)
    if limit and config.seq_length > limit:
        raise UserError(
            f"--seq-length {config.seq_length} exceeds the model's {limit} positions; "
            f"use --seq-length {limit} or less"
        )
    check_fits(config, model_config, env)
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


def lora_settings(config: TrainConfig) -> LoraSettings:
    """The LoRA hyperparameters of the config."""
    return LoraSettings(
        rank=config.lora_rank,
        alpha=config.lora_alpha,
        dropout=config.lora_dropout,
        target_modules=tuple(config.lora_target_modules),
    )


def plan_settings(
    config: TrainConfig, world_size: int, memory_gib: float, adapter_sizes: tuple[int, ...] = ()
) -> PlanSettings:
    """The memory plan's view of this run's settings, on devices of ``memory_gib`` GiB
    (``adapter_sizes``: the LoRA adapters' element counts under --peft lora)."""
    return PlanSettings(
        world_size=world_size,
        micro_batch=config.batch_size,
        seq_length=config.seq_length,
        precision=config.precision,
        zero1=config.zero1,
        activation_checkpointing=config.activation_checkpointing,
        device_memory_gib=memory_gib,
        ddp_bucket_cap_mb=config.ddp_bucket_cap_mb,
        gradient_as_bucket_view=config.gradient_as_bucket_view,
        accumulation_steps=config.accumulation_steps,
        fused_adamw=config.adamw_implementation == "fused",
        adapter_sizes=adapter_sizes,
        optimizer=config.optimizer,
    )


def plan_run(
    config: TrainConfig, model_config: PretrainedConfig, world_size: int, memory_gib: float
) -> tuple[MemoryPlan, list[str]]:
    """This run's per-rank memory plan (parameters counted on the meta device) and, when it does
    not fit, the setting changes that would make it fit."""
    model = meta_model(model_config)
    sizes = parameter_sizes(model)
    active = matmul_parameter_count(model, model_config)
    adapters: tuple[int, ...] = ()
    if config.peft == "lora":
        adapters = tuple(trainable_parameter_sizes(apply_lora(model, lora_settings(config))))
    state, buffers = state_bytes(  # DDP buckets only what is trained: the adapters under LoRA
        compression_settings(config),
        list(adapters) or sizes,
        world_size,
        config.ddp_bucket_cap_mb * 2**20,
    )
    settings = dataclasses.replace(
        plan_settings(config, world_size, memory_gib, adapters),
        compression_state_bytes=state,
        compression_buffer_bytes=buffers,
    )
    plan = plan_memory(model_config, sum(sizes), settings, sizes, active_parameters=active)
    if plan.fits:
        return plan, []
    return plan, suggestions(model_config, sum(sizes), settings, parameter_sizes=sizes)


def dry_run(config: TrainConfig, env: DistEnv) -> str:
    """The memory and FLOP plan of this run, as text; nothing is allocated or downloaded.

    LLaMA-2-7B's architecture comes from the facts the package carries (no hub access or token
    needed); other models' configs are loaded as usual. Device memory is --device-memory-gib,
    else the visible GPU's, else 80 GiB.
    """
    if config.model == "meta-llama/Llama-2-7b-hf":
        model_config: PretrainedConfig = llama2_7b_config()
    else:
        model_config = load_model_config(config.model)
    memory = config.device_memory_gib or visible_device_gib() or 80.0
    plan, hints = plan_run(config, model_config, config.plan_world_size or env.world_size, memory)
    adapters = sum(plan.settings.adapter_sizes)
    trained = f" (+ {adapters:,} LoRA adapter parameters, trained)" if adapters else ""
    lines = [
        f"model {config.model}: {plan.parameters:,} parameters{trained}, "
        f"{plan.flops_per_token:.4g} training FLOPs per token at seq length {config.seq_length}",
        f"plan per rank: {plan.settings.describe()}",
        plan.table(),
    ]
    if hints:
        lines.append("would fit with:")
        lines.extend(f"  {hint}" for hint in hints)
    # DDP buckets what trains: under LoRA only the adapters cross the wire.
    sizes = list(plan.settings.adapter_sizes) or parameter_sizes(meta_model(model_config))
    lines.append(communication_plan(config, env, sizes, plan.flops_per_token))
    return "\n".join(lines)


def communication_plan(
    config: TrainConfig, env: DistEnv, sizes: list[int], flops_per_token: float
) -> str:
    """Wire bytes and predicted times per step of this run's method and the reference methods
    (``compression.plan``) for gradients of ``sizes`` elements (the trained parameters), for
    --plan-world-size ranks (else WORLD_SIZE), --plan-gpus-per-node and the --plan-*-gbit links;
    compute at --plan-tflops per rank."""
    world = config.plan_world_size or env.world_size
    per_node = min(config.plan_gpus_per_node, world)
    topo = Topology(
        world, per_node, config.plan_intra_node_gbit * 1e9, config.plan_inter_node_gbit * 1e9
    )
    tokens = config.batch_size * config.seq_length * config.accumulation_steps
    compute_s = tokens * flops_per_token / (config.plan_tflops * 1e12)
    run_method = compression_settings(config)
    methods = [run_method, *reference_methods(config.compression_block_size)]
    header = (
        f"communication plan: {world} ranks = {topo.nodes} node(s) x {per_node}, links "
        f"{config.plan_intra_node_gbit:g} Gbit/s in a node, {config.plan_inter_node_gbit:g} "
        f"Gbit/s between nodes; compute {compute_s:.4g} s per step ({tokens} tokens per rank at "
        f"{config.plan_tflops:g} TFLOP/s); first row: this run's --compression"
    )
    return "\n".join([header, communication_table(methods, sizes, topo, compute_s)])


def check_fits(config: TrainConfig, model_config: PretrainedConfig, env: DistEnv) -> None:
    """Refuse a run whose memory plan does not fit the device, naming settings that would.

    Checked when the device memory is known: --device-memory-gib, or the visible GPU when the
    run uses CUDA. Raises UserError before any weights are loaded or any process group starts.
    """
    uses_cuda = config.device != "cpu" and torch.cuda.is_available()
    memory = config.device_memory_gib or (visible_device_gib() if uses_cuda else 0.0)
    if not memory:
        return
    if missing_sizes(model_config):
        log.warning(
            "no memory plan: the model config lacks %s", ", ".join(missing_sizes(model_config))
        )
        return
    plan, hints = plan_run(config, model_config, env.world_size, memory)
    if plan.fits:
        return
    fix = hints[0] if hints[0].startswith("no combination") else f"it would fit with {hints[0]}"
    raise UserError(
        f"the memory plan needs {plan.total / 2**30:.1f} GiB per rank but the device has "
        f"{memory:g} GiB ({plan.settings.describe()}); {fix} (see --dry-run)"
    )


def visible_device_gib() -> float:
    """Memory of the visible GPU in GiB, or 0 without one."""
    if not torch.cuda.is_available():
        return 0.0
    return torch.cuda.get_device_properties(0).total_memory / 2**30


def run(config: TrainConfig, env: DistEnv) -> bool:
    """Train as one rank of a torchrun job (or alone), always tearing the process group down.

    Returns True when training finished (or for --dry-run) and False when SIGTERM/SIGINT stopped
    it after a checkpoint (train.py then exits with status 143).
    """
    setup_logging(env.rank, config.verbose)
    if config.dry_run:
        if env.is_main:
            print(dry_run(config, env))
        return True
    inputs = prepare_inputs(config, env)
    device = pick_device(env, config.device)
    torch.set_num_threads(config.threads or max(1, (os.cpu_count() or 1) // env.local_world_size))
    init_distributed(env, device, config.backend, config.timeout_s)
    try:
        trainer = start(config, env, device, inputs)
        finished = train(trainer)
        if finished:
            save_final_model(trainer)
        trainer.metrics.close()
        return finished
    finally:
        shutdown_distributed()


def start(config: TrainConfig, env: DistEnv, device: torch.device, inputs: Inputs) -> Trainer:
    """Collective: agree on what to resume, build this rank's trainer and resume it; rank 0 then
    trims ``metrics.jsonl`` to the resumed step and saves the resolved config."""
    plan = agree_on_start(config, env, device)
    trainer = build_trainer(config, env, device, inputs, plan.run_id)
    resume(trainer, plan)
    if env.is_main:  # every start check has passed: the folder now belongs to this run
        record_run_id(checkpoint_root(config), plan.run_id)
        metrics = Path(config.output_dir) / "metrics.jsonl"
        restart_records(metrics, plan.run_id, trainer.step if plan.path else -1)
        save_config(config, Path(config.output_dir) / "config.toml")
    return trainer


def decide_start(config: TrainConfig) -> StartPlan:
    """Rank 0: what to resume (``checkpoint.plan_start``). Raises UserError when the
    checkpoint folder or metrics.jsonl hold another run (see --overwrite-output-dir) or the
    checkpoint cannot be read."""
    root = checkpoint_root(config)
    overwrite = config.overwrite_output_dir and not config.resume and not config.resume_from
    plan = plan_start(root, config.resume, config.resume_from, overwrite)
    check_records(Path(config.output_dir) / "metrics.jsonl", plan.run_id, overwrite)
    return plan


def agree_on_start(config: TrainConfig, env: DistEnv, device: torch.device) -> StartPlan:
    """Collective: rank 0 decides (``decide_start``) and broadcasts the plan or its error as
    JSON; every rank then checks it sees the same complete checkpoint (``verify_start``).

    Raises the same UserError on every rank, so no rank is left waiting in a collective.
    """
    decision: dict[str, object] = {}
    if env.is_main:
        try:
            decision = {"plan": dataclasses.asdict(decide_start(config))}
        except UserError as exc:  # only bad input: every rank must stop with the same message
            decision = {"error": str(exc)}
    decision = broadcast_json(decision, device)
    if "error" in decision:
        raise UserError(str(decision["error"]))
    plan = StartPlan(**decision["plan"])
    verify_start(plan, device)
    return plan


def broadcast_json(value: dict[str, object], device: torch.device) -> dict[str, object]:
    """Rank 0's ``value`` on every rank, sent as UTF-8 JSON bytes (two broadcasts: the length,
    then a uint8 tensor); JSON, not pickle, so nothing received is unpickled."""
    data = json.dumps(value).encode() if dist.get_rank() == 0 else b""
    length = torch.tensor([len(data)], dtype=torch.int64, device=device)
    dist.broadcast(length, src=0)
    buffer = torch.zeros(int(length.item()), dtype=torch.uint8, device=device)
    if dist.get_rank() == 0:
        buffer.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    dist.broadcast(buffer, src=0)
    return json.loads(bytes(buffer.cpu().tolist()).decode())


def build_ddp_model(
    config: TrainConfig, device: torch.device, inputs: Inputs, env: DistEnv
) -> tuple[torch.nn.Module, DistributedDataParallel, CompressionState]:
    """The model (a PeftModel under --peft lora), its DDP wrapper with the compression comm hook,
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
    node_groups = new_node_groups(env) if config.compression_scope == "inter-node" else None
    if config.optimizer == "demo":  # DeMo exchanges momentum itself: DDP keeps gradients local
        compression = register_local_gradients(ddp_model)
    else:
        compression = register_compression(
            ddp_model, compression_settings(config), node_groups=node_groups
        )
    if config.compile:
        compile_model(ddp_model)
    return model, ddp_model, compression


def build_trainer(
    config: TrainConfig, env: DistEnv, device: torch.device, inputs: Inputs, run_id: str = ""
) -> Trainer:
    """Model in DDP with its comm hook, optimizer, schedule, data and metrics for this rank."""
    model, ddp_model, compression = build_ddp_model(config, device, inputs, env)
    if config.optimizer == "demo":
        demo = DemoSettings(
            config.demo_beta, config.demo_topk, config.demo_tile_size, config.demo_value_dtype
        )
        groups = parameter_groups(model, config.weight_decay)
        optimizer: Optimizer = build_demo(groups, config.learning_rate, demo, compression)
    else:
        optimizer = build_optimizer(
            model,
            config.learning_rate,
            config.weight_decay,
            implementation=config.adamw_implementation,
            zero1=config.zero1,
        )
    scheduler = build_scheduler(
        optimizer, config.warmup_steps, config.restart_every, config.restart_mult, config.min_lr
    )
    torch.manual_seed(config.seed + env.rank)
    compute_dtype = torch.float32 if config.precision == "fp32" else torch.bfloat16
    peak, peak_source = device_peak_flops(device, compute_dtype)
    flops = flops_per_token(model, inputs.model_config, config.seq_length)
    log.info(
        "world_size %d, device %s, backend %s, %.1fM parameters (%.2fM trained), "
        "%d tokens per step, %.3g FLOPs per token, peak %.3g FLOP/s per rank (%s)",
        env.world_size, device, dist.get_backend(), parameter_count(model) / 1e6,
        sum(trainable_parameter_sizes(model)) / 1e6, tokens_per_step(config, env), flops, peak,
        peak_source,
    )  # fmt: skip
    return Trainer(
        config=config,
        env=env,
        device=device,
        model=ddp_model,
        optimizer=optimizer,
        scheduler=scheduler,
        compression=compression,
        windows=build_train_windows(config, env, inputs),
        eval_set=build_eval_set(config, env, inputs, device),
        metrics=build_metrics(Path(config.output_dir), env.is_main, config.tensorboard, run_id),
        tokenizer=inputs.tokenizer,
        flops_per_token=flops,
        peak_flops_total=peak * env.world_size if peak else math.inf,
        run_id=run_id,
    )


def flops_per_token(model: torch.nn.Module, config: PretrainedConfig, seq_length: int) -> float:
    """Training FLOPs per token at ``seq_length`` (see ``memory_plan.model_flops_per_token``),
    over the parameters a token passes through (a mixture of experts runs some experts); 0 for
    sizes a config does not name."""
    layers = int(getattr(config, "num_hidden_layers", 0) or 0)
    hidden = int(getattr(config, "hidden_size", 0) or 0)
    active = matmul_parameter_count(model, config)
    return model_flops_per_token(active, layers, hidden, seq_length)


def tokens_per_step(config: TrainConfig, env: DistEnv) -> int:
    """Tokens trained per optimizer step over all ranks."""
    return config.batch_size * config.accumulation_steps * config.seq_length * env.world_size


def build_train_windows(config: TrainConfig, env: DistEnv, inputs: Inputs) -> PackedWindows:
    """This rank's shuffled, packed training windows (a resumable stream)."""
    shard = shard_for_rank(inputs.train_documents, env.rank, env.world_size)
    return PackedWindows(
        shard,
        inputs.tokenizer,
        config.seq_length,
        epochs=config.epochs,
        shuffle_buffer=config.shuffle_buffer,
        seed=config.seed + env.rank,
    )


def build_eval_set(
    config: TrainConfig, env: DistEnv, inputs: Inputs, device: torch.device
) -> list[torch.Tensor]:
    """This rank's fixed held-out micro-batches (same documents every evaluation).

    Collective: every rank keeps as many batches as the rank with the fewest (one all-reduce,
    MIN), so all ranks run the same number of DDP forwards in ``evaluate``; DDP broadcasts
    buffers (LLaMA's rotary ``inv_freq``) in every forward, and an unmatched one would hang.
    """
    shard = shard_for_rank(inputs.eval_documents, env.rank, env.world_size)
    windows = PackedWindows(shard, inputs.tokenizer, config.seq_length)
    batches = eval_batches(windows, config.batch_size, config.eval_batches)
    count = torch.tensor([len(batches)], device=device)
    dist.all_reduce(count, op=dist.ReduceOp.MIN)
    if int(count.item()) < len(batches):
        log.warning("evaluating on %d batches per rank: a rank has no more", int(count.item()))
    return batches[: int(count.item())]


def next_micro_batches(
    trainer: Trainer, loader: Iterator[torch.Tensor], stop_requested: bool
) -> tuple[list[torch.Tensor] | None, bool]:
    """The next step's micro-batches (None once any rank has run out of data), and whether any
    rank was asked to stop (SIGTERM or SIGINT).

    Every rank contributes its two flags to one all-reduce (MAX), so all ranks end on the same
    step and nobody waits forever in a collective another rank never joins.
    """
    batches: list[torch.Tensor] = []
    for batch in loader:
        batches.append(batch.to(trainer.device, non_blocking=True))
        if len(batches) == trainer.config.accumulation_steps:
            break
    missing = len(batches) < trainer.config.accumulation_steps
    flags = torch.tensor([int(missing), int(stop_requested)], device=trainer.device)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    return (None if flags[0] else batches), bool(flags[1])


def forward_backward(
    model: DistributedDataParallel, batches: list[torch.Tensor], precision: str = "fp32"
) -> torch.Tensor:
    """Accumulate gradients over the micro-batches; returns the step's mean loss (detached).

    Each micro-batch's loss is divided by their number, so the accumulated gradient equals one
    large batch's (every window has the same token count). Gradients are all-reduced only on the
    last micro-batch; ``no_sync`` skips communication on the others. The forward runs under
    ``autocast_context(precision)`` (bf16-mixed: bfloat16 matmuls); backward runs outside it, as
    torch's AMP recipe says.
    """
    total = torch.zeros((), device=batches[0].device)
    for index, input_ids in enumerate(batches):
        last = index == len(batches) - 1
        with nullcontext() if last else model.no_sync():
            with autocast_context(precision, input_ids.device):
                loss = model(input_ids=input_ids, labels=input_ids).loss / len(batches)
            loss.backward()
        total += loss.detach()
    return total


def optimizer_step(trainer: Trainer, batches: list[torch.Tensor]) -> tuple[Tensor, Tensor]:
    """One optimizer step over ``batches``: returns (mean loss, gradient norm before clipping)."""
    loss = forward_backward(trainer.model, batches, trainer.config.precision)
    fault_point("step", trainer.step + 1)  # tests only (TORCHRUN_DDP_FAULT)
    params = trainer.model.parameters()
    grad_norm = torch.nn.utils.clip_grad_norm_(params, trainer.config.max_grad_norm)
    trainer.optimizer.step()
    trainer.scheduler.step()
    trainer.optimizer.zero_grad(set_to_none=True)
    return loss, grad_norm


def train(trainer: Trainer) -> bool:
    """The training loop. Returns True when training finished (step limit or end of data) and
    False when it was stopped by SIGTERM/SIGINT, after saving a checkpoint."""
    config = trainer.config
    max_steps = config.max_steps if config.max_steps > 0 else math.inf
    with torch.random.fork_rng(devices=[]):  # the iterator draws a seed from the CPU RNG, which
        loader = iter(build_loader(trainer.windows, config.batch_size))  # resume just restored
    window, progress = Window(trainer), progress_bar(trainer, max_steps)
    if trainer.step == 0 and config.eval_every:
        trainer.metrics.log({"step": 0, **evaluate(trainer)})  # the untrained baseline
    trainer.model.train()
    with StopRequest() as stop:
        while trainer.step < max_steps:
            start = time.perf_counter()
            batches, stopping = next_micro_batches(trainer, loader, stop.requested)
            data_time = time.perf_counter() - start
            if batches is None:
                log.info("end of training data after %d steps", trainer.step)
                break
            loss, grad_norm = optimizer_step(trainer, batches)
            trainer.step += 1
            window.add(loss, grad_norm, data_time, time.perf_counter() - start)
            progress.update()
            if stopping:
                trainer.metrics.log(window.flush(trainer.step))
                save(trainer)
                log.warning("stopped by a signal: checkpoint saved at step %d", trainer.step)
                return False
            after_step(trainer, window, progress)
    progress.close()
    finish(trainer, window)
    return True


def after_step(trainer: Trainer, window: Window, progress: tqdm) -> None:
    """Log, evaluate and checkpoint on their cadences."""
    config, step = trainer.config, trainer.step
    if step % config.log_every == 0:
        record = window.flush(step)
        progress.set_postfix(loss=round(record["loss"], 3), tok_s=int(record["tokens_per_s"]))
        trainer.metrics.log(record)
    if config.eval_every and step % config.eval_every == 0:
        trainer.metrics.log({"step": step, **evaluate(trainer)})
    if config.checkpoint_every and step % config.checkpoint_every == 0:
        save(trainer)


def finish(trainer: Trainer, window: Window) -> None:
    """The last partial logging window, evaluation and checkpoint, unless the last step already
    made them."""
    config, step = trainer.config, trainer.step
    if window.steps:
        trainer.metrics.log(window.flush(step))
    if config.eval_every == 0 or step % config.eval_every != 0:
        trainer.metrics.log({"step": step, **evaluate(trainer)})
    if config.checkpoint_every == 0 or step % config.checkpoint_every != 0:
        save(trainer)


def progress_bar(trainer: Trainer, max_steps: float) -> tqdm:
    """A tqdm bar on rank 0 when stderr is a terminal; disabled (silent) otherwise."""
    return tqdm(
        initial=trainer.step,
        total=None if max_steps == math.inf else int(max_steps),
        disable=not (trainer.env.is_main and sys.stderr.isatty()),
        unit="step",
        dynamic_ncols=True,
    )


class StopRequest:
    """Turns SIGTERM and SIGINT into a flag the loop checks once per step (preemption).

    The handlers are installed on entering the ``with`` block and the previous ones restored on
    leaving it.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.requested = False
        self.previous: dict[int, object] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.requested = True

    def __enter__(self) -> StopRequest:
        for signum in self.SIGNALS:
            self.previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)


class Window:
    """Sums over the steps since the last log line; ``flush`` turns them into one record.

    Times count the steps alone (data, forward, backward, communication, optimizer), not
    evaluation or saving, so tokens/s and MFU describe training.
    """

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer
        self.reset()

    def reset(self) -> None:
        """Start a new logging window."""
        self.loss = torch.zeros((), device=self.trainer.device)
        self.grad_norm = torch.zeros((), device=self.trainer.device)
        self.steps = 0
        self.comm_bytes = 0
        self.comm_bytes_dense = 0
        self.comm_bytes_collective = 0
        self.step_time = 0.0
        self.data_time = 0.0

    def add(self, loss: Tensor, grad_norm: Tensor, data_time: float, step_time: float) -> None:
        """Record one optimizer step (no synchronisation with other ranks or the device)."""
        self.loss += loss
        self.grad_norm = grad_norm.detach()
        self.steps += 1
        self.data_time += data_time
        self.step_time += step_time
        counts = self.trainer.compression.pop_step_bytes()
        self.comm_bytes += counts.wire
        self.comm_bytes_dense += counts.dense
        self.comm_bytes_collective += counts.collective

    def flush(self, step: int) -> Record:
        """Mean loss over the window and the ranks, throughput and memory; then reset."""
        trainer = self.trainer
        loss = mean_over_ranks(self.loss / self.steps)
        tokens_per_s = tokens_per_step(trainer.config, trainer.env) * self.steps / self.step_time
        record: Record = {
            "step": step,
            "loss": float(loss),
            "lr": float(trainer.scheduler.get_last_lr()[0]),
            "tokens_per_s": tokens_per_s,
            "mfu": trainer.flops_per_token * tokens_per_s / trainer.peak_flops_total,
            "step_time_s": self.step_time / self.steps,
            "data_time_s": self.data_time / self.steps,
            "grad_norm": float(self.grad_norm),
            "peak_mem_bytes": peak_memory_bytes(trainer.device),
            "comm_bytes": self.comm_bytes // self.steps,
            "comm_bytes_dense": self.comm_bytes_dense // self.steps,
            "comm_bytes_collective": self.comm_bytes_collective // self.steps,
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
        with autocast_context(trainer.config.precision, trainer.device):
            totals[0] += model(input_ids=input_ids, labels=input_ids).loss.double()
        totals[1] += 1
    dist.all_reduce(totals)
    model.train()
    if totals[1] == 0:
        log.warning("no held-out windows to evaluate on; check --eval-files")
        return {}
    eval_loss = float(totals[0] / totals[1])
    return {"eval_loss": eval_loss, "eval_ppl": math.exp(min(eval_loss, 50.0))}


def checkpoint_root(config: TrainConfig) -> Path:
    """Where step-N checkpoints live: --checkpoint-dir, or <output-dir>/checkpoints."""
    return Path(config.checkpoint_dir or Path(config.output_dir) / "checkpoints")


def shared_state(trainer: Trainer) -> dict[str, Stateful]:
    """State that is the same on every rank: model, optimizer (unless ZeRO-1 shards it or it is
    DeMo, whose momentum differs per rank), learning-rate schedule."""
    per_rank = trainer.config.zero1 or trainer.config.optimizer == "demo"  # see rank_state
    optimizer = None if per_rank else trainer.optimizer
    frozen_base = trainer.config.peft != "none"  # rebuilt from --model (and --seed) on resume
    return {
        "train": ModelAndOptimizer(trainer.model, optimizer, trainable_only=frozen_base),
        "scheduler": trainer.scheduler,
    }


def rank_state(trainer: Trainer) -> dict[str, Stateful]:
    """State that differs between ranks: data position, error feedback, ZeRO-1 optimizer shard,
    DeMo momentum."""
    state: dict[str, Stateful] = {"data": trainer.windows, "compression": trainer.compression}
    if isinstance(trainer.optimizer, ZeroRedundancyOptimizer):
        state["optimizer"] = ShardedOptimizer(trainer.optimizer)
    if isinstance(trainer.optimizer, DeMo):  # each rank's momentum is its own
        state["optimizer"] = LocalMomentum(trainer.optimizer)
    return state


def run_identity(trainer: Trainer) -> dict[str, object]:
    """What a checkpoint must match to be resumed by this run."""
    config = trainer.config
    return {
        "model": model_fingerprint(trainer.model),
        "vocab_size": trainer.model.module.config.vocab_size,
        "compression": config.compression,
        "optimizer": config.optimizer,
        "seq_length": config.seq_length,
        "zero1": config.zero1,
        "seed": config.seed,
        "shuffle_buffer": config.shuffle_buffer,
        "epochs": config.epochs,
        "data_files": config.data_files,
        "dataset": [config.dataset, config.dataset_config] if not config.data_files else None,
        "peft": None if config.peft == "none" else dataclasses.asdict(lora_settings(config)),
    }


def save(trainer: Trainer) -> Path:
    """Save an exact-resume checkpoint of the step just finished (collective)."""
    per_rank = {name: obj.state_dict() for name, obj in rank_state(trainer).items()}
    per_rank["rng"] = capture_rng_state()
    meta = {**run_identity(trainer), "config": dataclasses.asdict(trainer.config)}
    meta["run_id"] = trainer.run_id
    meta["tokens_seen"] = trainer.step * tokens_per_step(trainer.config, trainer.env)
    path = save_checkpoint(
        checkpoint_root(trainer.config),
        trainer.step,
        shared_state(trainer),
        per_rank,
        meta,
        keep=trainer.config.keep_checkpoints,
    )
    log.info("saved checkpoint %s", path)
    return path


def resume(trainer: Trainer, plan: StartPlan) -> None:
    """Restore the checkpoint that ``plan`` names (every rank agreed on it), if any.

    Raises UserError, before any training state changes, if the checkpoint does not fit this
    run (model, data stream, world size...).
    """
    if plan.path is None:
        return
    path = Path(plan.path)
    saved = read_meta(path)
    check_compatible(saved, {**run_identity(trainer), "world_size": trainer.env.world_size})
    per_rank = load_checkpoint(path, shared_state(trainer))
    for name, obj in rank_state(trainer).items():
        obj.load_state_dict(per_rank[name])
    restore_rng_state(per_rank["rng"])
    trainer.step = int(saved["step"])
    log.info("resumed from %s at step %d", path, trainer.step)


def save_final_model(trainer: Trainer) -> None:
    """Rank 0 writes ``<output_dir>/final_model`` (safetensors + tokenizer); all ranks wait.

    Under --peft lora it first writes the adapter to ``<output_dir>/adapter`` (peft's
    ``save_pretrained``), then merges it into the base weights: ``final_model`` is then a plain
    model that ``AutoModelForCausalLM.from_pretrained`` loads."""
    if trainer.env.is_main:
        output = Path(trainer.config.output_dir)
        target = output / "final_model"
        model = trainer.model.module
        if trainer.config.peft == "lora":
            save_lora_outputs(model, output / "adapter", target)
            log.info("saved the LoRA adapter to %s", output / "adapter")
        else:
            model.save_pretrained(target, safe_serialization=True)
        trainer.tokenizer.save_pretrained(target)
        log.info("saved the final model to %s", target)
    dist.barrier()
