"""Bytes on the wire: payload sizes of the compressed messages and ring-model wire bytes.

A rank's wire bytes are what it sends to other ranks, modelled on the ring algorithms that NCCL
and gloo use for large messages (Patarasuk & Yuan 2009, "Bandwidth optimal all-reduce algorithms
for clusters of workstations", JPDC 69(2)). In a group of ``G`` ranks, each rank sends

- all-reduce of ``S`` bytes: ``2 (G - 1) / G * S`` (reduce-scatter then all-gather);
- reduce-scatter of ``S`` bytes (each rank keeps ``S / G``): ``(G - 1) / G * S``;
- all-gather of ``p`` bytes per rank: ``(G - 1) * p``.

A group of one sends nothing. All-reduce therefore sends about ``2 S`` at any ``G``, while an
all-gather of a per-rank payload ``p`` grows with ``G``: it beats a dense fp32 all-reduce of ``S``
bytes only while ``G < 2 S / p``.
"""

import torch

from torchrun_ddp.compression.transform import index_dtype

COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather")


def wire_bytes(collective: str, nbytes: float, group_size: int) -> float:
    """Bytes one rank sends for ``collective`` in a ring of ``group_size`` ranks.

    ``nbytes``: the tensor handed to the collective (all-reduce, reduce-scatter: the full input;
    all-gather: this rank's contribution). Raises ``ValueError`` for an unknown collective.
    """
    peers = group_size - 1
    if collective == "all_reduce":
        return 2.0 * peers * nbytes / group_size
    if collective == "reduce_scatter":
        return peers * nbytes / group_size
    if collective == "all_gather":
        return float(peers * nbytes)
    raise ValueError(f"unknown collective {collective!r}; use one of {', '.join(COLLECTIVES)}")


def dense_wire_bytes(numel: int, world_size: int) -> float:
    """Wire bytes of a dense fp32 ring all-reduce of ``numel`` values over ``world_size`` ranks."""
    return wire_bytes("all_reduce", numel * 4, world_size)


def dct_payload_bytes(n_blocks: int, kept: int, value_dtype: torch.dtype = torch.float32) -> int:
    """Bytes ``dct`` hands to its all-reduce for one bucket: ``n_blocks * kept`` coefficients of
    ``value_dtype``."""
    return n_blocks * kept * torch.empty(0, dtype=value_dtype).element_size()


def topk_payload_bytes(n_blocks: int, topk: int, block_size: int, value_dtype: torch.dtype) -> int:
    """Bytes ``dct-topk`` hands to all-gather for one bucket (per rank): values plus indices."""
    per_pair = torch.empty(0, dtype=value_dtype).element_size()
    per_pair += torch.empty(0, dtype=index_dtype(block_size)).element_size()
    return n_blocks * topk * per_pair


def topk_break_even_world_size(topk: int, block_size: int, value_dtype: torch.dtype) -> float:
    """World size at which ``dct-topk`` sends as many wire bytes as a dense fp32 all-reduce.

    Dense: ``2 (W - 1) / W * 4 B`` per block of ``B`` values; top-k: ``(W - 1) * k * pair``.
    Equal at ``W = 8 B / (k * pair)``; above it top-k sends more than dense.
    """
    pair = topk_payload_bytes(1, topk, block_size, value_dtype) / topk
    return 8.0 * block_size / (topk * pair)
