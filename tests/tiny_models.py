"""A LLaMA small enough that spawned gloo ranks build and train it in seconds."""

from __future__ import annotations

from transformers import LlamaConfig


def tiny_llama_config(vocab_size: int = 128) -> LlamaConfig:
    """2 layers, hidden 32, 4 heads, MLP 64, 64 positions; untied embeddings (transformers'
    default), about 16k parameters at vocabulary 128."""
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=64,
    )
