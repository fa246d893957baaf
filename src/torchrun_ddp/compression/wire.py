"""Bytes on the wire: payload sizes of the compressed messages."""

import torch

from torchrun_ddp.compression.transform import index_dtype


def dct_payload_bytes(n_blocks: int, kept: int, value_dtype: torch.dtype = torch.float32) -> int:
    """Bytes ``dct`` hands to its collective for one bucket: ``n_blocks * kept`` coefficients of
    ``value_dtype`` (float32: all-reduce; 16-bit: this rank's part of an all-gather)."""
    return n_blocks * kept * torch.empty(0, dtype=value_dtype).element_size()


def topk_payload_bytes(n_blocks: int, topk: int, block_size: int, value_dtype: torch.dtype) -> int:
    """Bytes ``dct-topk`` hands to all-gather for one bucket (per rank): values plus indices."""
    per_pair = torch.empty(0, dtype=value_dtype).element_size()
    per_pair += torch.empty(0, dtype=index_dtype(block_size)).element_size()
    return n_blocks * topk * per_pair
