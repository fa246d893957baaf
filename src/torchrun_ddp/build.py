"""Setting a run up, for ``main``, once ``inputs.prepare_inputs`` has checked its inputs: the
checkpoint folders' storage domains, the DDP model with the training method's comm hook and
optimizer (``methods``) or the model sharded by FSDP (``parallelize``, --data-parallel), and
this rank's training and held-out data.

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
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler
from transformers import PretrainedConfig, PreTrainedTokenizerBase

from torchrun_ddp.checkpoint import StorageLayout, detect_storage
from torchrun_ddp.compression import CompressionState, ShardedExchange
from torchrun_ddp.config import TrainConfig
from torchrun_ddp.distributed import DistEnv, new_node_groups, track_group
from torchrun_ddp.errors import UserError
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
    PRECISION_DTYPES,
    apply_fused_loss,
    apply_lora,
    build_model,
    check_fused_loss,
    compile_blocks,
    compile_model,
    enable_activation_checkpointing,
    lora_settings,
    settle_buckets,
    trainable_parameter_sizes,
    trained_tokens,
    uses_fused_loss,
    wrap_ddp,
)
from torchrun_ddp.optim import ScheduleSettings, build_scheduler
from torchrun_ddp.parallelize import (
    ShardedUnits,
    build_mesh,
    decoder_layers,
    holds_whole_replicas,
    load_from_rank0,
    mesh_shape,
    rank0_weights,
    shard_model,
)
from torchrun_ddp.plan import (
    matmul_parameter_count,
    meta_model,
    model_flops_per_token,
    parameter_count,
)
from torchrun_ddp.training_data import (
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
    if config.data_parallel == "ddp" or storage.shared:
        return storage
    shape = mesh_shape(
        config.data_parallel, env.world_size, env.local_world_size, config.shard_degree
    )
    if not holds_whole_replicas(storage.domains, shape):
        raise UserError(
            f"--checkpoint-dir {checkpoint_root(config)} is a folder per node or site, and "
            f"under --data-parallel {config.data_parallel} with {shape.shard} ranks per shard "
            "group a folder would hold only part of the shards; use --data-parallel hsdp with "
            "a --shard-degree within a node, or one shared folder (--checkpoint-storage shared)"
        )
    return storage


@dataclass(frozen=True)
class ModelSpec:
    """What ``model.build_model`` builds: ``name`` (hub id or config path), its config,
    ``init`` (pretrained or random), ``precision`` and the init ``seed``."""

    name: str
    model_config: PretrainedConfig
    init: str
    precision: str
    seed: int


def rank0_build_device(spec: ModelSpec, device: torch.device) -> torch.device:
    """Where rank 0 builds the full weights it scatters to FSDP's shards: its GPU for a random
    init whose weights take at most half of the GPU's free memory (drawn there in seconds; the
    shards and the full copy then both fit), else the host (pretrained weights load there, and a
    GPU too small for the whole model is the reason to shard). The other ranks build on meta."""
    if dist.get_rank() != 0:
        return torch.device("meta")
    if device.type != "cuda" or spec.init != "random":
        return torch.device("cpu")
    dtype = PRECISION_DTYPES[spec.precision]
    weights = parameter_count(meta_model(spec.model_config)) * dtype.itemsize
    free, _ = torch.cuda.mem_get_info(device)
    return device if 2 * weights <= free else torch.device("cpu")


def shard_from_rank0(
    spec: ModelSpec, device: torch.device, mesh: DeviceMesh, checkpointing: bool, fused: bool
) -> tuple[torch.nn.Module, ShardedUnits]:
    """Collective: the model of ``spec`` sharded by FSDP2 over ``mesh`` (``shard_model``), with
    one full copy on rank 0 (``rank0_build_device``: its GPU or its host), the shapes on the
    meta device on the other ranks; rank 0's weights are then scattered to the shards
    (``load_from_rank0``). Activation checkpointing first when ``checkpointing``, Liger's fused
    loss when ``fused``."""
    host = rank0_build_device(spec, device)
    model = build_model(spec.name, spec.model_config, spec.init, spec.precision, spec.seed, host)
    if checkpointing:
        enable_activation_checkpointing(model)
    if fused:
        apply_fused_loss(model)
    rank0_state = rank0_weights(model)
    units = shard_model(model, mesh, spec.precision)
    load_from_rank0(model, device, rank0_state)
    return model, units


def build_sharded_model(
    config: TrainConfig, device: torch.device, inputs: Inputs, env: DistEnv, method: Method
) -> tuple[torch.nn.Module, CompressionState]:
    """Collective: the model sharded by FSDP2 over --data-parallel's mesh (``parallelize``),
    and the method's state for it (``Method.register_sharded``). Rank 0 builds the weights
    (seeded as under DDP, or pretrained) on the host, the other ranks the shapes on the meta
    device; rank 0's weights are then scattered to the shards."""
    shape = mesh_shape(
        config.data_parallel, env.world_size, env.local_world_size, config.shard_degree
    )
    mesh = build_mesh(device, shape, hybrid=config.data_parallel == "hsdp")
    replicate = mesh.get_group("replicate") if method.exchanges_replicas(mesh.ndim) else None
    model, units = shard_from_rank0(
        ModelSpec(config.model, inputs.model_config, config.init, config.precision, config.seed),
        device, mesh if replicate is None else mesh["shard"], config.activation_checkpointing,
        fused_loss(config, device, inputs.model_config),
    )  # fmt: skip
    if config.compile:
        compile_blocks(decoder_layers(model))
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
        "(replicate x shard)%s",
        config.data_parallel, units.layers, shape.replicate, shape.shard,
        "" if replicate is None else f"; --compression {config.compression} across replicas",
    )  # fmt: skip
    return model, method.register_sharded(model, exchange, replicate)


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
    if fused_loss(config, device, inputs.model_config):
        apply_fused_loss(model)
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
