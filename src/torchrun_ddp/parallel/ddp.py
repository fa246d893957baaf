"""``--data-parallel ddp``: every rank holds the whole model; DDP averages the gradients in
backward, bucket by bucket, through the training method's comm hook.

The wrapping (``wrap_ddp``: buckets, buffers that are never broadcast again, buckets settled
before the first step), no-sync for the micro-batches before a step's last, and the plan of a
replicated model (``plan.memory.replicated_plan``, LoRA's ``plan.memory.lora_plan``). Source:
https://pytorch.org/docs/stable/notes/ddp.html.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING

import torch
from torch.nn.parallel import DistributedDataParallel

from torchrun_ddp.distributed import new_node_groups
from torchrun_ddp.model import autocast_context, compile_model
from torchrun_ddp.parallel.base import Built, DataParallel, ExchangingRun, MeshShape
from torchrun_ddp.plan.memory import lora_plan, replicated_plan

if TYPE_CHECKING:
    from torchrun_ddp.config import TrainConfig
    from torchrun_ddp.distributed import DistEnv
    from torchrun_ddp.model import ModelSpec
    from torchrun_ddp.plan.memory import MemoryPlan, PlanRequest


class DDP(DataParallel):
    """``--data-parallel ddp``: a mesh of ``world_size`` replicas of one rank each."""

    name = "ddp"
    across_sites = True

    @classmethod
    def mesh_shape(cls, world_size: int, ranks_per_node: int, shard_degree: int = 0) -> MeshShape:
        """Every rank a replica: ``(world_size, 1)``."""
        return MeshShape(world_size, 1)

    def build(
        self,
        spec: ModelSpec,
        device: torch.device,
        env: DistEnv,
        method: ExchangingRun,
        config: TrainConfig,
    ) -> Built:
        """Collective: the model built on ``device`` (every rank the same weights), wrapped in
        DDP with the config's buckets, its buckets settled (``settle_buckets``), the method's comm
        hook registered (node-aware groups with --compression-scope inter-node), then compiled
        under --compile. Under LoRA only the adapters are DDP's parameters that need
        gradients, so only they are bucketed and all-reduced."""
        model = spec.build(device)
        ddp = wrap_ddp(
            model, device, config.ddp_bucket_cap_mb, config.gradient_as_bucket_view,
            config.ddp_static_graph,
        )  # fmt: skip
        vocab = spec.model_config.vocab_size
        settle_buckets(ddp, (config.batch_size, config.seq_length), vocab, config.precision)
        node_groups = new_node_groups(env) if config.compression_scope == "inter-node" else None
        compression = method.register_hook(ddp, node_groups)
        if config.compile:
            compile_model(ddp)
        return Built(model, ddp, compression)

    def no_sync(self, runner: torch.nn.Module) -> AbstractContextManager[None]:
        """DDP's ``no_sync`` (each rank accumulates its own gradients)."""
        return runner.no_sync() if isinstance(runner, DistributedDataParallel) else nullcontext()

    def module(self, runner: torch.nn.Module) -> torch.nn.Module:
        """DDP's ``module``."""
        return unwrap(runner)

    def plan_memory(self, request: PlanRequest) -> MemoryPlan:
        """A whole replica per rank (``plan.memory.replicated_plan``, LoRA's ``lora_plan``)."""
        if request.settings.lora:
            return lora_plan(request)
        return replicated_plan(request)

    def plan_bucket_view(self, config: TrainConfig) -> bool:
        """--gradient-as-bucket-view."""
        return config.gradient_as_bucket_view

    def fit_changes(self) -> frozenset[str]:
        """ZeRO-1 and gradient bucket views shed replicated state."""
        return frozenset({"--zero1", "--gradient-as-bucket-view"})

    def nothing_fits(self, device_gib: float, smallest_gib: float, floor_gib: float) -> str:
        """DDP replicates the weights and gradients on every rank: shard them."""
        return (
            f"needs {smallest_gib:.1f} GiB per rank, because DDP replicates the weights and "
            f"gradients ({floor_gib:.1f} GiB) on every rank; shard them (--data-parallel fsdp "
            "for AdamW, hsdp for a --compression hook or --optimizer demo, diloco, sparseloco or "
            "muloco, which fsdp refuses) or use GPUs with more memory"
        )


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The model inside a DDP wrapper (any other model is its own module)."""
    return model.module if isinstance(model, DistributedDataParallel) else model


def wrap_ddp(
    model: torch.nn.Module,
    device: torch.device,
    bucket_cap_mb: float = 25.0,
    gradient_as_bucket_view: bool = True,
    static_graph: bool = False,
    sync_buffers: bool | None = None,
) -> DistributedDataParallel:
    """Wrap ``model`` in DDP: ``device_ids=[index]`` on CUDA, none on CPU.

    DDP broadcasts rank 0's parameters and buffers at construction, then all-reduces (averages)
    gradients bucket by bucket (``bucket_cap_mb`` MiB each) during backward, overlapping the
    communication with the rest of backward. ``gradient_as_bucket_view`` makes ``param.grad`` a
    view into its bucket, saving one gradient-sized copy. ``static_graph`` declares that every
    step uses the same parameters in the same order, so DDP can skip its per-step checks for
    unused parameters (https://pytorch.org/docs/stable/notes/ddp.html).

    ``sync_buffers`` (DDP's ``forward_sync_buffers``; None: ``not constant_buffers(model)``):
    DDP would otherwise broadcast rank 0's buffers before every forward, one collective per
    micro-batch, although a causal LM's buffers (rotary ``inv_freq``, masks) never change after
    construction; DDP still broadcasts them once, at construction.
    """
    device_ids = [device.index] if device.type == "cuda" else None
    if sync_buffers is None:
        sync_buffers = not constant_buffers(model)
    return DistributedDataParallel(
        model,
        device_ids=device_ids,
        bucket_cap_mb=bucket_cap_mb,
        gradient_as_bucket_view=gradient_as_bucket_view,
        static_graph=static_graph,
        forward_sync_buffers=sync_buffers,
    )


def settle_buckets(
    model: DistributedDataParallel, shape: tuple[int, int], vocab_size: int, precision: str
) -> None:
    """Collective: one forward and backward through ``model`` of random token ids (``shape``:
    [micro-batch, seq_length], drawn from a generator of its own) with the loss times zero, so
    that DDP rebuilds its gradient buckets (it does so once, in the order gradients became
    ready in the first backward) before the first real step; the gradients, all zero, are
    dropped. Call before registering a comm hook.

    Why: a run that resumes starts a new DDP wrapper, whose first step would all-reduce in
    DDP's initial buckets while the uninterrupted run's step uses the rebuilt ones. With more
    than two ranks the ring all-reduce then sums some elements in another order, and the resumed
    run differs in the last bits (seen on 2 nodes x 2 ranks). With the buckets settled at
    start, every step of every run uses the rebuilt layout. Costs one micro-batch's forward and
    backward at start-up. DDP internals: https://pytorch.org/docs/stable/notes/ddp.html.
    """
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(vocab_size, shape, generator=generator).to(device)
    with autocast_context(precision, device):
        loss = model(input_ids=ids, labels=ids).loss
    (loss * 0).backward()
    model.zero_grad(set_to_none=True)


def constant_buffers(model: torch.nn.Module) -> bool:
    """Whether no module of ``model`` updates its buffers in a training forward pass.

    Batch normalisation is the layer that does (running statistics); causal LMs have none, so
    their buffers are constants that DDP's construction-time broadcast already made equal.
    """
    return not any(
        isinstance(module, torch.nn.modules.batchnorm._NormBase) for module in model.modules()
    )
