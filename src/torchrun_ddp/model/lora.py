"""LoRA through peft (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models"):
the adapters' settings, adding them to a frozen model, and the two outputs (the adapter, and the
adapter merged into the base weights); also the final export of any run.
"""

from __future__ import annotations

import copy
import logging
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from torchrun_ddp.errors import UserError, first_line

if TYPE_CHECKING:
    from torchrun_ddp.config import TrainConfig

log = logging.getLogger("torchrun_ddp")


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
            f"{first_line(exc)}; change --lora-target-modules (e.g. q_proj v_proj) or, for "
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
    chat_template: str | None = None,
) -> Path:
    """Write ``output/final_model`` (safetensors + tokenizer) and return it; call on one rank.

    Under LoRA it first writes the adapter to ``output/adapter`` (peft's ``save_pretrained``),
    then merges it into the base weights (``save_lora_outputs``): ``final_model`` is then a plain
    model that ``AutoModelForCausalLM.from_pretrained`` loads. ``state_dict``: the weights to
    write instead of ``model``'s own (a sharded model's, gathered onto this rank).
    ``chat_template``: the Jinja text that rendered training's conversations, saved with the
    tokenizer (its own ``save_pretrained``: ``chat_template.jinja``), so that
    ``apply_chat_template`` on the saved tokenizer renders as training did; None keeps the
    tokenizer's own. The tokenizer handed in is not changed (a shallow copy carries it).
    """
    target = output / "final_model"
    if lora:
        save_lora_outputs(model, output / "adapter", target)
        log.info("saved the LoRA adapter to %s", output / "adapter")
    else:
        model.save_pretrained(target, safe_serialization=True, state_dict=state_dict)
    if chat_template is not None:
        tokenizer = copy.copy(tokenizer)
        tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(target)
    log.info("saved the final model to %s", target)
    return target
