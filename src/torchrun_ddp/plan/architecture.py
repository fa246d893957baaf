"""Sizes and training FLOPs of a decoder-only causal LM, from its transformers config alone.

``architecture`` reads the decoder sizes (layers, widths, heads, vocabulary, FFN and
mixture-of-experts widths) of any causal LM config into an ``Architecture``; ``meta_model`` builds
the model on the meta device (no storage) so parameters can be counted exactly, and
``matmul_parameter_count`` / ``model_flops_per_token`` give the training FLOPs per token that the
memory plan, the trainer's MFU and the benchmarks use. ``llama2_7b_config`` carries LLaMA-2-7B's
architecture so none of this needs the hub.

Layouts: ``LLAMA_LAYOUT`` (LLaMA, Mistral, Qwen2) is the decoder layer the memory plan's
activation rows are derived for (``Architecture.exact``); other configs are read with their own
sizes (two-matrix GELU MLPs, tied embeddings, experts).

Sources: FLOPs per token, Kaplan et al. 2020 and Chowdhery et al. 2022 (PaLM), appendix B;
LLaMA-2-7B, Touvron et al. 2023.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, PretrainedConfig

from torchrun_ddp.errors import UserError

LLAMA2_7B: dict[str, int | float | str | bool] = {
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "vocab_size": 32000,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "use_cache": False,
}
"""LlamaConfig fields of LLaMA-2-7B (Touvron et al. 2023, the ``meta-llama/Llama-2-7b-hf``
config), carried by the package so the plan needs neither the hub nor HF_TOKEN."""


def llama2_7b_config() -> LlamaConfig:
    """The LLaMA-2-7B architecture as a ``LlamaConfig`` (6,738,415,616 parameters)."""
    return LlamaConfig(**LLAMA2_7B)


def meta_model(config: PretrainedConfig) -> torch.nn.Module:
    """``AutoModelForCausalLM.from_config(config)`` built on the meta device: parameters have
    shapes and dtypes (fp32) but no storage, so a 7B model costs no memory and well under a
    second."""
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def parameter_count(model: torch.nn.Module) -> int:
    """Number of parameters (elements) in ``model``; works on meta-device models."""
    return sum(p.numel() for p in model.parameters())


def parameter_sizes(model: torch.nn.Module) -> list[int]:
    """Element count of each parameter tensor, for ZeroRedundancyOptimizer's partition."""
    return [p.numel() for p in model.parameters()]


def model_flops_per_token(
    parameters: int, layers: int, hidden: int, seq_length: int, frozen: int = 0
) -> float:
    """Training FLOPs per token, forward plus backward: ``6 N + 4 F + 12 L H T``.

    ``N`` (``parameters``) counts the trained parameters that take part in a matmul
    (``matmul_parameter_count``: no looked-up embedding tables). ``6 N``: two FLOPs per such
    parameter per token for the forward matmuls, four for the backward (input and weight
    gradients). ``F`` (``frozen``): frozen matmul parameters, such as a LoRA base model, cost
    the forward and the input gradient only, ``4 F``. ``12 L H T``: the
    attention scores and weighted sum over ``T`` positions in each of ``L`` layers of width ``H``
    (no causal halving). Chowdhery et al. 2022 (PaLM), appendix B; the same formula as the training
    metrics use. Checked against ``torch.utils.flop_counter.FlopCounterMode`` in the tests.
    """
    return 6.0 * parameters + 4.0 * frozen + 12.0 * layers * hidden * seq_length


LLAMA_LAYOUT = ("llama", "mistral", "qwen2")
"""``model_type``s whose decoder layer is LLaMA's (RMSNorm, q/k/v/o, gated SiLU MLP): the layout
the activation and autocast rows are derived for."""

UNGATED_MLP = ("gpt2", "gpt_neox", "gptj", "gpt_bigcode", "opt", "phi", "falcon", "bloom")
"""``model_type``s whose MLP has two matrices (up, activation, down) instead of LLaMA's three."""


@dataclass(frozen=True)
class Architecture:
    """The sizes of a decoder-only transformer the plan needs (from a transformers config).

    ``intermediate`` is the FFN width of one expert (of the dense MLP when ``experts`` is 1);
    ``experts_per_token`` experts run per token, plus ``shared_intermediate`` of a shared expert
    (Qwen2-MoE). ``exact`` is False outside ``LLAMA_LAYOUT``: activations and autocast copies are
    then approximate.
    """

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    max_positions: int
    tied_embeddings: bool
    ffn_matrices: int = 3
    experts: int = 1
    experts_per_token: int = 1
    shared_intermediate: int = 0
    exact: bool = True

    @property
    def active_intermediate(self) -> int:
        """FFN width a token passes through: its experts' widths plus the shared expert's."""
        return self.experts_per_token * self.intermediate + self.shared_intermediate

    @property
    def q_dim(self) -> int:
        """Width of the query projection and of the attention output: heads x head_dim."""
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        """Width of the key and value projections: kv_heads x head_dim (smaller under GQA)."""
        return self.kv_heads * self.head_dim

    def layer_linear_parameters(self) -> int:
        """Weights of one decoder layer's linear maps, in elements: LLaMA's seven bias-free
        ``nn.Linear`` (q, k, v, o, gate, up, down); two MLP matrices for ungated MLPs; every
        expert's MLP and the router for mixtures of experts."""
        attention = self.hidden * (2 * self.q_dim + 2 * self.kv_dim)
        ffn = self.ffn_matrices * self.hidden * (self.experts * self.intermediate)
        ffn += self.ffn_matrices * self.hidden * self.shared_intermediate
        router = self.experts * self.hidden if self.experts > 1 else 0
        return attention + ffn + router

    def parameter_sizes(self) -> list[int]:
        """Element counts of ``LlamaForCausalLM``'s parameters in module order (embedding,
        layers, final norm, lm_head unless tied)."""
        layer = [self.hidden * self.q_dim, self.hidden * self.kv_dim, self.hidden * self.kv_dim]
        layer += [self.q_dim * self.hidden] + [self.hidden * self.intermediate] * 3
        layer += [self.hidden, self.hidden]
        head = [] if self.tied_embeddings else [self.vocab * self.hidden]
        return [self.vocab * self.hidden, *layer * self.layers, self.hidden, *head]


_REQUIRED = ("num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size")
"""Sizes every decoder-only config has (transformers maps GPT-2's n_layer, n_embd, n_head)."""


def missing_sizes(config: PretrainedConfig) -> list[str]:
    """The sizes of ``_REQUIRED`` that ``config`` lacks; [] when the plan can be made."""
    return [name for name in _REQUIRED if not getattr(config, name, None)]


def _ffn_sizes(config: PretrainedConfig) -> dict[str, int]:
    """FFN width per expert, expert counts and shared-expert width of any causal LM config.

    Dense: ``intermediate_size``, else GPT-2's ``n_inner``, else 4 x hidden (GPT-2's default).
    Mixture of experts: ``num_local_experts`` (Mixtral) or ``num_experts`` (Qwen2-MoE) experts of
    ``moe_intermediate_size`` (else ``intermediate_size``), ``num_experts_per_tok`` per token, and
    ``shared_expert_intermediate_size``.
    """
    hidden = int(config.hidden_size)
    dense = getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None)
    experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
    if not experts or int(experts) <= 1:
        return {"intermediate": int(dense or 4 * hidden)}
    width = getattr(config, "moe_intermediate_size", None) or dense or 4 * hidden
    return {
        "intermediate": int(width),
        "experts": int(experts),
        "experts_per_token": int(getattr(config, "num_experts_per_tok", None) or 1),
        "shared_intermediate": int(getattr(config, "shared_expert_intermediate_size", None) or 0),
    }


def architecture(config: PretrainedConfig) -> Architecture:
    """Read the decoder sizes from a causal LM config (LLaMA, GPT-2, Mistral, Qwen2, MoE, ...).

    Raises UserError when a size of ``_REQUIRED`` is missing (not a decoder-only transformer
    config); callers that must not refuse a run check ``missing_sizes`` first.
    """
    missing = missing_sizes(config)
    if missing:
        raise UserError(
            f"model config lacks {', '.join(missing)}; the memory plan needs a decoder-only "
            "transformer config (hidden size, layers, attention heads, vocabulary)"
        )
    heads = int(config.num_attention_heads)
    model_type = str(getattr(config, "model_type", ""))
    ungated = model_type in UNGATED_MLP or not hasattr(config, "intermediate_size")
    return Architecture(
        layers=int(config.num_hidden_layers),
        hidden=int(config.hidden_size),
        heads=heads,
        kv_heads=int(getattr(config, "num_key_value_heads", None) or heads),
        head_dim=int(getattr(config, "head_dim", None) or config.hidden_size // heads),
        vocab=int(config.vocab_size),
        max_positions=int(getattr(config, "max_position_embeddings", 0) or 0),
        tied_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        ffn_matrices=2 if ungated else 3,
        exact=model_type in LLAMA_LAYOUT,
        **_ffn_sizes(config),
    )


def active_parameter_count(model: torch.nn.Module, config: PretrainedConfig) -> int:
    """Parameters one token passes through, for FLOPs: all of them in a dense model; in a mixture
    of experts, each expert parameter (names with ``.experts.``, e.g. Mixtral's 3-D
    ``mlp.experts.gate_up_proj``) counts ``experts_per_token / experts`` of itself."""
    ffn = _ffn_sizes(config)
    share = ffn.get("experts_per_token", 1) / ffn.get("experts", 1)
    total = 0.0
    for name, param in model.named_parameters():
        total += param.numel() * (share if ".experts." in name else 1.0)
    return round(total)


def matmul_parameter_count(model: torch.nn.Module, config: PretrainedConfig) -> int:
    """The ``N`` of the training-FLOPs formula: parameters that take part in a matmul per token.

    ``active_parameter_count`` (mixture-of-experts share applied) less every embedding table that
    is only looked up, not multiplied: the input embedding unless it is tied to the output head,
    and learned position embeddings (GPT-2's ``wpe``). Chowdhery et al. 2022 (PaLM), appendix B,
    count non-embedding parameters; the output head is a matmul and counts. Norm weights and
    biases (vectors) are left in: they are under 0.1% of a model's parameters.
    """
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    head_weight = getattr(head, "weight", None)
    lookups = sum(
        module.weight.numel()
        for module in model.modules()
        if isinstance(module, torch.nn.Embedding) and module.weight is not head_weight
    )
    return active_parameter_count(model, config) - lookups
