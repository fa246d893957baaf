"""Build the LLaMA model (pretrained weights or a seeded random init) and wrap it in DDP.

Uses transformers' ``LlamaForCausalLM`` (Touvron et al. 2023, "Llama 2"); any causal LM that
``AutoModelForCausalLM`` loads works the same way.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from torchrun_ddp.errors import UserError

GATED_ORGS = ("meta-llama/",)
"""Hub organisations whose models need an accepted licence and HF_TOKEN."""

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _is_local(name: str) -> bool:
    """True for anything that reads as a path rather than a hub id ("org/name")."""
    return name.startswith((".", "/", "~")) or name.endswith(".json") or Path(name).exists()


def check_access(name: str) -> None:
    """Raise UserError if ``name`` is a gated hub model and HF_TOKEN is not set."""
    if _is_local(name) or not name.startswith(GATED_ORGS):
        return
    if not os.environ.get("HF_TOKEN"):
        raise UserError(
            f"{name} is a gated model: accept its licence on the Hugging Face hub and put "
            "HF_TOKEN=<your token> in .env (see .env.example)"
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


def build_model(
    name: str, config: PretrainedConfig, init: str, dtype: str, seed: int, device: torch.device
) -> PreTrainedModel:
    """The causal LM on ``device`` in ``dtype``, ``use_cache=False`` for training.

    ``init="pretrained"`` loads weights with ``from_pretrained`` (HF_TOKEN is read from the
    environment by huggingface_hub); ``init="random"`` builds the architecture from ``config``
    after ``torch.manual_seed(seed)``, so every rank starts from the same weights.
    """
    torch_dtype = DTYPES[dtype]
    if init == "pretrained":
        try:
            model = AutoModelForCausalLM.from_pretrained(name, config=config, dtype=torch_dtype)
        except OSError as exc:
            raise UserError(f"cannot load the weights of {name}: {_first_line(exc)}") from exc
    else:
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
    model.config.use_cache = False
    return model.to(device)


def wrap_ddp(model: torch.nn.Module, device: torch.device) -> DistributedDataParallel:
    """Wrap ``model`` in DDP: ``device_ids=[index]`` on CUDA, none on CPU.

    DDP broadcasts rank 0's parameters and buffers at construction, then all-reduces (averages)
    gradients bucket by bucket during backward
    (https://pytorch.org/docs/stable/notes/ddp.html).
    """
    device_ids = [device.index] if device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=device_ids)


def parameter_count(model: torch.nn.Module) -> int:
    """Number of parameters (elements) in ``model``."""
    return sum(p.numel() for p in model.parameters())
