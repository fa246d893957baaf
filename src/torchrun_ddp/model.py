"""Build the causal LM (pretrained weights, a seeded random init, or its shapes on the meta
device), add LoRA adapters, wrap it in DDP (sharding: ``parallelize``).

Any architecture ``AutoModelForCausalLM`` builds works: LLaMA (Touvron et al. 2023, "Llama 2")
is the default, and GPT-2, Mistral, Qwen2 and Mixtral (mixture of experts) are tested. LoRA (Hu
et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models") comes from the ``peft``
library.
"""

from __future__ import annotations

import importlib.util
import logging
import warnings
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from huggingface_hub import get_token
from peft import LoraConfig, PeftModel, get_peft_model
from torch.nn.parallel import DistributedDataParallel
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from torchrun_ddp.errors import UserError

if TYPE_CHECKING:
    from torchrun_ddp.config import TrainConfig

GATED_ORGS = ("meta-llama/",)
"""Hub organisations whose models need an accepted licence and HF_TOKEN."""

PRECISION_DTYPES = {"fp32": torch.float32, "bf16-mixed": torch.float32, "bf16": torch.bfloat16}
"""Weight dtype of each ``--precision``: bf16-mixed keeps float32 weights (autocast computes in
bfloat16), bf16 stores the weights themselves in bfloat16."""

PEFT_METHODS = ("none", "lora")
"""``--peft``: none trains every weight; lora trains low-rank adapters on a frozen base."""

log = logging.getLogger("torchrun_ddp")


def _is_local(name: str) -> bool:
    """True for anything that reads as a path rather than a hub id ("org/name")."""
    return name.startswith((".", "/", "~")) or name.endswith(".json") or Path(name).exists()


def check_access(name: str) -> None:
    """Raise UserError if ``name`` is a gated hub model and no Hugging Face token is found.

    The token comes from huggingface_hub's own lookup (``get_token``: HF_TOKEN, then the file
    ``hf auth login`` saves); it is only tested for presence, never printed or stored.
    """
    if _is_local(name) or not name.startswith(GATED_ORGS):
        return
    if not get_token():
        raise UserError(
            f"{name} is a gated model: accept its licence on the Hugging Face hub, then run "
            "`hf auth login` or put HF_TOKEN=<your token> in .env (see .env.example)"
        )


def load_model_config(name: str) -> PretrainedConfig:
    """The model's architecture config from a hub id, a local folder or a config.json file.

    Raises UserError when it cannot be found or fetched (the message says which and why).
    """
    check_access(name)
    if _is_local(name) and not Path(name).expanduser().exists():
        raise UserError(
            f"model path {name} does not exist; pass a hub id, a model folder or a config.json"
        )
    try:
        return AutoConfig.from_pretrained(name)
    except OSError as exc:
        where = "local path" if _is_local(name) else "hub model (is the network reachable?)"
        raise UserError(f"cannot load the config of {where} {name}: {_first_line(exc)}") from exc


def _first_line(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


def max_positions(config: PretrainedConfig) -> int:
    """The longest sequence the model's position embedding supports, in tokens."""
    return int(getattr(config, "max_position_embeddings", 0) or 0)


def weight_dtype(precision: str, peft: str = "none") -> torch.dtype:
    """The dtype the base model's weights are stored in.

    Full fine-tuning: ``PRECISION_DTYPES[precision]``. LoRA: the frozen base weights need no
    fp32 master copy (they are never updated), so they are stored in bfloat16 under bf16-mixed
    and bf16; under fp32 they stay float32 (for CPUs without bf16 arithmetic).
    """
    if peft == "lora" and precision != "fp32":
        return torch.bfloat16
    return PRECISION_DTYPES[precision]


def build_model(
    name: str,
    config: PretrainedConfig,
    init: str,
    precision: str,
    seed: int,
    device: torch.device,
    peft: str = "none",
) -> PreTrainedModel:
    """The causal LM on ``device`` with weights in ``weight_dtype(precision, peft)``,
    ``use_cache=False`` for training.

    ``init="pretrained"`` loads weights with ``from_pretrained`` (HF_TOKEN is read from the
    environment by huggingface_hub); ``init="random"`` builds the architecture from ``config``
    after ``torch.manual_seed(seed)``, so every rank starts from the same weights, allocated and
    drawn on ``device`` itself (a GPU's own generator on CUDA: a 7B model takes seconds there,
    where a float32 build on the host takes minutes). On the ``meta`` device only the shapes are
    built (no weights read or drawn), whatever ``init``.
    """
    torch_dtype = weight_dtype(precision, peft)
    if init == "pretrained" and device.type != "meta":
        try:
            model = AutoModelForCausalLM.from_pretrained(name, config=config, dtype=torch_dtype)
        except OSError as exc:
            raise UserError(f"cannot load the weights of {name}: {_first_line(exc)}") from exc
        model.config.use_cache = False
        return model.to(device)
    if device.type != "meta":  # meta: shapes only, for the ranks that receive rank 0's weights
        torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
    model.config.use_cache = False
    return model


@dataclass(frozen=True)
class LoraSettings:
    """LoRA's hyperparameters (peft ``LoraConfig``): adapter rank r, scaling alpha (the update
    is ``(alpha / r) B A x``), dropout on the adapter's input, and the modules that get
    adapters: names or name suffixes, or ``["all-linear"]`` for every linear layer but the output
    head."""

    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.1
    target_modules: tuple[str, ...] = ("all-linear",)


def apply_lora(model: PreTrainedModel, settings: LoraSettings) -> PeftModel:
    """Freeze ``model`` and add trainable LoRA adapters with peft's ``get_peft_model``.

    The base weights keep their dtype and get ``requires_grad=False``, so DDP puts them in no
    gradient bucket and AdamW holds no state for them; the adapters ``lora_A`` (r x in, Kaiming
    uniform from the global RNG) and ``lora_B`` (out x r, zeros, so training starts from the base
    model) are float32 (peft's ``autocast_adapter_dtype``) whatever the base dtype. Works on meta
    models too (the memory plan counts adapters this way). Raises UserError when no module
    matches ``settings.target_modules``.
    """
    targets: str | list[str] = list(settings.target_modules)
    if targets == ["all-linear"]:
        targets = "all-linear"
    lora = LoraConfig(
        r=settings.rank,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        target_modules=targets,
        bias="none",
        task_type="CAUSAL_LM",
    )
    try:
        with warnings.catch_warnings():  # peft calls transformers' deprecated alias
            warnings.filterwarnings("ignore", "`is_gradient_checkpointing`", FutureWarning)
            return get_peft_model(model, lora, autocast_adapter_dtype=True)
    except ValueError as exc:  # peft: "Target modules {...} not found in the base model"
        if "not found in the base model" not in str(exc) and "dropout" not in str(exc):
            raise
        raise UserError(
            f"--peft lora with --lora-target-modules {' '.join(settings.target_modules)}: "
            f"{_first_line(exc)}; change --lora-target-modules (e.g. q_proj v_proj) or, for "
            "mixture-of-experts models, whose experts all-linear includes, --lora-dropout 0"
        ) from exc


def save_lora_outputs(model: PeftModel, adapter_dir: Path, merged_dir: Path) -> None:
    """Write the adapter (``PeftModel.save_pretrained``: ``adapter_config.json`` and
    ``adapter_model.safetensors``) to ``adapter_dir``, then merge the adapters into the base
    weights (``merge_and_unload``: ``W + (alpha / r) B A`` in the base dtype) and write that plain
    model with ``save_pretrained`` to ``merged_dir``, loadable by
    ``AutoModelForCausalLM.from_pretrained``. Merging changes ``model`` in place: call it last.
    """
    model.save_pretrained(adapter_dir, safe_serialization=True, save_embedding_layers=False)
    merged = model.merge_and_unload()
    merged.save_pretrained(merged_dir, safe_serialization=True)


def trainable_parameter_sizes(model: torch.nn.Module) -> list[int]:
    """Element counts of the parameters that train (``requires_grad``), in module order."""
    return [p.numel() for p in model.parameters() if p.requires_grad]


FUSED_LOSS_KERNELS_OFF = (
    "rope", "rms_norm", "swiglu", "geglu", "layer_norm", "cross_entropy", "fused_add_rms_norm",
)  # fmt: skip
"""Liger Kernel's other per-model replacements, turned off: ``--fused-loss liger`` swaps the
loss only, so the layers stay transformers' own (and inductor's under --compile)."""


FUSED_LOSS_AUTO_TYPES = ("llama",)
"""Model types for which ``--fused-loss auto`` picks liger on CUDA: those whose fused loss
tests/test_gpu.py checks against the plain loss on a GPU. ``--fused-loss liger`` takes any type
Liger Kernel has a forward for."""


def liger_installed() -> bool:
    """Whether the liger-kernel package is installed (found, not imported: it imports Triton)."""
    return importlib.util.find_spec("liger_kernel") is not None


def liger_model_types() -> frozenset[str]:
    """The ``model_type`` values Liger Kernel has a fused-loss forward for (empty where
    ``liger_kernel`` does not import). Imports Liger and Triton: seconds."""
    try:
        from liger_kernel.transformers.monkey_patch import (  # noqa: PLC0415 (imports Triton)
            MODEL_TYPE_TO_APPLY_LIGER_FN,
        )
    except ImportError:
        return frozenset()
    return frozenset(MODEL_TYPE_TO_APPLY_LIGER_FN)


def uses_fused_loss(choice: str, device_type: str, model_type: str) -> bool:
    """Whether ``--fused-loss`` ``choice`` trains with Liger's fused linear cross-entropy on a
    ``device_type`` ("cuda", "cpu") device for a ``model_type`` model: liger always (its
    Triton kernels then need CUDA, ``check_fused_loss``), none never, auto on CUDA for
    ``FUSED_LOSS_AUTO_TYPES`` where liger-kernel is installed."""
    if choice != "auto":
        return choice == "liger"
    return device_type == "cuda" and model_type in FUSED_LOSS_AUTO_TYPES and liger_installed()


def check_fused_loss(device_type: str, model_type: str) -> None:
    """Raise UserError where ``--fused-loss liger`` cannot run: a device other than CUDA (Liger's
    kernels are Triton GPU kernels), Liger Kernel not installed, or a model type it has no
    forward for."""
    if device_type != "cuda":
        raise UserError(
            f"--fused-loss liger runs Triton kernels on CUDA, and this run's device is "
            f"{device_type}; use --fused-loss none (or auto) on this device"
        )
    if not liger_installed():
        raise UserError(
            "--fused-loss liger needs the liger-kernel package (uv sync on Linux installs it); "
            "install it or use --fused-loss none"
        )
    if model_type not in liger_model_types():
        raise UserError(
            f"--fused-loss liger has no fused forward for {model_type or 'this'} models; use "
            "--fused-loss none (or auto, which falls back to it)"
        )


def apply_fused_loss(model: PreTrainedModel) -> None:
    """Give ``model`` (this instance only) Liger Kernel's forward for its model type: in
    training with labels, the hidden states [B, T, H] go to lm_head and cross-entropy in chunks
    of tokens (``LigerFusedLinearCrossEntropyFunction``), computing the loss (fp32, mean over
    trained tokens, or the sum over ``num_items_in_batch``) and the gradients of the hidden
    states and of lm_head's weight in the forward itself, so the [B, T, V] logits never exist
    (Hsu et al. 2024, "Liger Kernel: Efficient Triton Kernels for LLM Training",
    arXiv:2410.10989). In eval mode, or without labels, it computes the logits and
    transformers' loss as before. The same call HF Trainer makes for ``use_liger_kernel``
    (``_apply_liger_kernel_to_instance``), with Liger's other kernels off
    (``FUSED_LOSS_KERNELS_OFF``). Two host reads per training forward come with it (the count of
    trained tokens, and whether the loss's gradient is 1)."""
    from liger_kernel.transformers import _apply_liger_kernel_to_instance  # noqa: PLC0415

    off = dict.fromkeys(FUSED_LOSS_KERNELS_OFF, False)
    _apply_liger_kernel_to_instance(model=model, fused_linear_cross_entropy=True, **off)


def enable_activation_checkpointing(model: PreTrainedModel) -> None:
    """Recompute every decoder layer's activations during backward instead of keeping them.

    Uses transformers' ``activation_checkpointing_enable`` with torch's non-reentrant checkpoint
    (``use_reentrant=False``): it works under DDP with ``no_sync`` and comm hooks, without
    ``static_graph`` and without "marked ready twice" errors, because each parameter's gradient
    hook fires once per backward (https://pytorch.org/docs/stable/checkpoint.html).
    """
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})


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


def compile_model(model: torch.nn.Module) -> bool:
    """``model.compile()`` in place (torch.compile, inductor); returns whether it is compiled.

    Compiling in place keeps the module and its ``state_dict`` keys unchanged (no ``_orig_mod.``
    prefix), so checkpoints and ``save_pretrained`` are the same with and without compile. Call it
    on the DDP module: dynamo's DDPOptimizer then splits the graph at bucket boundaries so the
    all-reduces still overlap backward (https://pytorch.org/docs/stable/notes/ddp.html). Where
    dynamo cannot run, or a graph fails to compile, it warns and runs that code eagerly
    (``torch._dynamo.config.suppress_errors``).
    """
    if not torch._dynamo.is_dynamo_supported():
        log.warning("--compile: torch.compile is not supported here; running eagerly")
        return False
    torch._dynamo.config.suppress_errors = True
    model.compile()
    return True


def compile_blocks(blocks: list[torch.nn.Module]) -> bool:
    """--compile under FSDP2: each block (decoder layer) compiled in place by ``compile_model``,
    as torchtitan compiles per transformer block (``apply_compile`` in its ``parallelize.py``);
    the root (embeddings, final norm, head, loss) runs eagerly. FSDP2's unit hooks are not traced
    (dynamo's ``skip_fsdp_hooks``): they run eagerly around each compiled block. Returns whether
    the blocks are compiled (False, with one warning, where dynamo cannot run)."""
    if not blocks or not compile_model(blocks[0]):
        return False
    for block in blocks[1:]:
        block.compile()
    return True


def autocast_context(precision: str, device: torch.device) -> AbstractContextManager[object]:
    """``torch.autocast(device.type, dtype=torch.bfloat16)`` for bf16-mixed, else a no-op.

    Under autocast, matrix multiplies run in bfloat16 while weights, gradients and the optimizer
    stay float32; reductions such as the loss's log-softmax stay float32
    (https://pytorch.org/docs/stable/amp.html). Works on CPU and CUDA alike.
    """
    enabled = precision == "bf16-mixed"
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=enabled)


def lora_settings(config: TrainConfig) -> LoraSettings:
    """The LoRA hyperparameters of the run's config."""
    return LoraSettings(
        rank=config.lora_rank,
        alpha=config.lora_alpha,
        dropout=config.lora_dropout,
        target_modules=tuple(config.lora_target_modules),
    )


def export_final_model(
    model: torch.nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    output: Path,
    lora: bool,
    state_dict: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Write ``output/final_model`` (safetensors + tokenizer) and return it; call on one rank.

    Under LoRA it first writes the adapter to ``output/adapter`` (peft's ``save_pretrained``),
    then merges it into the base weights (``save_lora_outputs``): ``final_model`` is then a plain
    model that ``AutoModelForCausalLM.from_pretrained`` loads. ``state_dict``: the weights to
    write instead of ``model``'s own (a sharded model's, gathered onto this rank).
    """
    target = output / "final_model"
    if lora:
        save_lora_outputs(model, output / "adapter", target)
        log.info("saved the LoRA adapter to %s", output / "adapter")
    else:
        model.save_pretrained(target, safe_serialization=True, state_dict=state_dict)
    tokenizer.save_pretrained(target)
    log.info("saved the final model to %s", target)
    return target


IGNORED_LABEL = -100
"""Label of a token that is not trained on (transformers' loss ignores it)."""


def causal_lm_inputs(batch: torch.Tensor) -> dict[str, torch.Tensor | bool]:
    """The model's keyword inputs for a micro-batch: int64 [B, L] token ids (every token is
    its own label), or int64 [B, 3, L] with rows token ids, labels (-100: not trained) and
    position ids that restart per example. With no attention mask and no cache, transformers
    reads restarting positions as packed examples (``masking_utils.find_packed_sequence_indices``:
    a block-diagonal causal mask for sdpa/eager, varlen flash attention); ``use_cache`` is off
    because a cache turns that detection off."""
    if batch.dim() == 2:
        return {"input_ids": batch, "labels": batch}
    return {
        "input_ids": batch[:, 0],
        "labels": batch[:, 1],
        "position_ids": batch[:, 2],
        "use_cache": False,
    }


def trained_tokens(batch: torch.Tensor) -> torch.Tensor:
    """Tokens whose prediction is trained in a micro-batch (labels after the shift that the
    loss makes: position t's label is predicted from position t - 1), a 0-d int64 tensor on
    the batch's device (no host read)."""
    labels = batch if batch.dim() == 2 else batch[:, 1]
    return (labels[:, 1:] != IGNORED_LABEL).sum()
