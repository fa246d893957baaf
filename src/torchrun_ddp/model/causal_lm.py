"""The causal LM itself: its config (a hub id, a local folder or a config.json, gated models'
token checked), its weights (pretrained, a seeded random init drawn on the device, or the shapes
on the meta device), how it runs (activation checkpointing, torch.compile, bf16 autocast) and
what a run asks of it (``ModelSpec``: every choice that shapes the built model).

Any architecture ``AutoModelForCausalLM`` builds works: LLaMA (Touvron et al. 2023, "Llama 2")
is the default, and GPT-2, Mistral, Qwen2 and Mixtral (mixture of experts) are tested.
"""

from __future__ import annotations

import logging
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path

import torch
from huggingface_hub import get_token
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from torchrun_ddp.errors import UserError, first_line
from torchrun_ddp.model.fused_loss import apply_fused_loss
from torchrun_ddp.model.lora import LoraSettings, apply_lora

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
        raise UserError(f"cannot load the config of {where} {name}: {first_line(exc)}") from exc


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
            raise UserError(f"cannot load the weights of {name}: {first_line(exc)}") from exc
        model.config.use_cache = False
        return model.to(device)
    if device.type != "meta":  # meta: shapes only, for the ranks that receive rank 0's weights
        torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
    model.config.use_cache = False
    return model


@dataclass(frozen=True)
class ModelSpec:
    """Every choice that shapes the built model: ``name`` (hub id or config path), its
    ``model_config``, ``init`` (pretrained or random), ``precision``, the init ``seed``,
    activation ``checkpointing``, Liger's ``fused_loss`` and the ``lora`` adapters (None: every
    weight trains)."""

    name: str
    model_config: PretrainedConfig
    init: str
    precision: str
    seed: int
    checkpointing: bool = False
    fused_loss: bool = False
    lora: LoraSettings | None = None

    def build(self, device: torch.device) -> torch.nn.Module:
        """``build_model`` on ``device`` (the meta device: shapes only), then activation
        checkpointing, the fused loss and the LoRA adapters (a PeftModel) as asked."""
        peft = "lora" if self.lora is not None else "none"
        model: torch.nn.Module = build_model(
            self.name, self.model_config, self.init, self.precision, self.seed, device, peft
        )
        if self.checkpointing:
            enable_activation_checkpointing(model)
        if self.fused_loss:
            apply_fused_loss(model)
        if self.lora is not None:
            model = apply_lora(model, self.lora)
        return model


def trainable_parameter_sizes(model: torch.nn.Module) -> list[int]:
    """Element counts of the parameters that train (``requires_grad``), in module order."""
    return [p.numel() for p in model.parameters() if p.requires_grad]


def hidden_matrices(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The trained 2-D parameters other than the input embedding and the output head, in module
    order: the hidden layers' matrices (every adapter under LoRA), which torch.optim.Muon's
    documentation keeps for Muon (the rest for AdamW). Found by identity, so a tied head and
    FSDP2's DTensor parameters count as what they are; works on the meta device."""
    ends = [getattr(model, name, lambda: None)() for name in ("get_input_embeddings",
            "get_output_embeddings")]  # fmt: skip
    excluded = {id(module.weight) for module in ends if module is not None}
    return [
        p for p in model.parameters() if p.requires_grad and p.dim() == 2 and id(p) not in excluded
    ]


def enable_activation_checkpointing(model: PreTrainedModel) -> None:
    """Recompute every decoder layer's activations during backward instead of keeping them.

    Uses transformers' ``activation_checkpointing_enable`` with torch's non-reentrant checkpoint
    (``use_reentrant=False``): it works under DDP with ``no_sync`` and comm hooks, without
    ``static_graph`` and without "marked ready twice" errors, because each parameter's gradient
    hook fires once per backward (https://pytorch.org/docs/stable/checkpoint.html).
    """
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})


def compile_model(model: torch.nn.Module) -> bool:
    """``model.compile()`` in place (torch.compile, inductor); returns True (it is compiled).

    Compiling in place keeps the module and its ``state_dict`` keys unchanged (no ``_orig_mod.``
    prefix), so checkpoints and ``save_pretrained`` are the same with and without compile. Call it
    on the DDP module: dynamo's DDPOptimizer then splits the graph at bucket boundaries so the
    all-reduces still overlap backward (https://pytorch.org/docs/stable/notes/ddp.html). There is
    no silent eager fallback: dynamo's ``suppress_errors`` is turned off, so a graph that fails
    to compile raises at its first call (``compile_failure`` words it in one line).

    Raises UserError (one line) where dynamo cannot run at all.
    """
    if not torch._dynamo.is_dynamo_supported():
        raise UserError(
            "--compile: torch.compile is not supported here (torch._dynamo.is_dynamo_supported() "
            "is False for this Python and platform); run without --compile"
        )
    torch._dynamo.config.suppress_errors = False
    model.compile()
    return True


def compile_failure(exc: BaseException) -> UserError:
    """The one-line UserError for a graph that --compile could not compile (a
    ``torch._dynamo.exc.TorchDynamoException`` from the first forward or backward), naming
    dynamo's reason."""
    inner = getattr(exc, "inner_exception", None)  # a backend's own error, under dynamo's
    reason = f"{type(inner).__name__}: {first_line(inner)}" if inner else first_line(exc)
    return UserError(
        f"--compile: torch.compile failed ({type(exc).__name__}: {reason}); run "
        "without --compile, or see TORCH_LOGS=dynamo for the graph that failed"
    )


def compile_blocks(blocks: list[torch.nn.Module]) -> bool:
    """--compile under FSDP2: each block (decoder layer) compiled in place by ``compile_model``,
    as torchtitan compiles per transformer block (``apply_compile`` in its ``parallelize.py``);
    the root (embeddings, final norm, head, loss) runs eagerly. FSDP2's unit hooks are not traced
    (dynamo's ``skip_fsdp_hooks``): they run eagerly around each compiled block. Returns whether
    the blocks are compiled (False where there are none). Raises UserError as
    ``compile_model``."""
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
