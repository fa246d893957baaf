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

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from torchrun_ddp.compression.transform import index_dtype, tile_shape

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
    return n_blocks * kept * value_dtype.itemsize


def topk_payload_bytes(n_blocks: int, topk: int, block_size: int, value_dtype: torch.dtype) -> int:
    """Bytes ``dct-topk`` hands to all-gather for one bucket (per rank): values plus indices."""
    per_pair = value_dtype.itemsize
    per_pair += index_dtype(block_size).itemsize
    return n_blocks * topk * per_pair


def topk_break_even_world_size(topk: int, block_size: int, value_dtype: torch.dtype) -> float:
    """World size at which ``dct-topk`` sends as many wire bytes as a dense fp32 all-reduce.

    Dense: ``2 (W - 1) / W * 4 B`` per block of ``B`` values; top-k: ``(W - 1) * k * pair``.
    Equal at ``W = 8 B / (k * pair)``; above it top-k sends more than dense.
    """
    pair = topk_payload_bytes(1, topk, block_size, value_dtype) / topk
    return 8.0 * block_size / (topk * pair)


def tile_counts(shape: tuple[int, ...], topk: int, tile: int) -> tuple[int, int, int]:
    """``(n_tiles, k, tile_numel)`` of a parameter of ``shape`` cut into :func:`tile_shape`
    tiles of sides at most ``tile``, ``k = min(topk, tile_numel)`` values sent per tile."""
    tile_numel = math.prod(tile_shape(shape, tile))
    n_tiles = max(1, math.prod(shape)) // tile_numel
    return n_tiles, min(topk, tile_numel), tile_numel


def demo_tile_payload(shape: tuple[int, ...], topk: int, tile: int) -> tuple[int, int, int]:
    """DeMo's message for one parameter of ``shape``: ``(n_tiles, k, index_bytes)``.

    Tiles come from :func:`tile_shape`; ``k = min(topk, tile elements)`` coefficients of every
    tile are sent, each with its position in the tile as :func:`index_dtype` of the tile's
    element count (uint8 up to 256 elements, int16 up to 32768: a 64 x 64 tile needs int16).
    """
    n_tiles, k, tile_numel = tile_counts(shape, topk, tile)
    return n_tiles, k, index_dtype(tile_numel).itemsize


def demo_payload_bytes(
    shapes: Iterable[tuple[int, ...]], topk: int, tile: int, value_dtype: torch.dtype
) -> int:
    """Bytes one rank hands to DeMo's all-gather per optimizer step (its own part).

    ``sum over parameters of n_tiles * k * (value bytes + index bytes)``
    (:func:`demo_tile_payload`); wire bytes at ``W`` ranks are ``(W - 1)`` times this
    (:func:`wire_bytes` of ``all_gather``). Example: a 4096 x 4096 matrix in 64 x 64 tiles with
    ``k = 32`` and bf16 values sends 4096 tiles x 32 x (2 + 2) bytes = 512 KiB, 1/128 of its
    fp32 size.
    """
    value = value_dtype.itemsize
    total = 0
    for shape in shapes:
        n_tiles, k, width = demo_tile_payload(tuple(shape), topk, tile)
        total += n_tiles * k * (value + width)
    return total


def position_bits(chunk_numel: int) -> int:
    """Bits of a position inside a chunk of ``chunk_numel`` values: ``ceil(log2(n))`` (12 for
    4096, 0 for a chunk of one value)."""
    return (chunk_numel - 1).bit_length()


def packed_bytes(count: int, bits: int) -> int:
    """Bytes of ``count`` values of ``bits`` bits each, packed back to back: ``ceil(c b / 8)``."""
    return (count * bits + 7) // 8


SCALE_BYTES = 4
"""A SparseLoCo chunk's quantization scale travels as one fp32 value."""

SPARSELOCO_QUANTIZERS = ("chunk", "statistical")
"""How SparseLoCo's values are quantized: ``chunk``, one fp32 scale per chunk; ``statistical``
(Templar's), per tensor a shift and a codebook of ``2^bits`` fp32 levels."""


def sparseloco_chunk_payload(
    n_chunks: int, k: int, chunk_numel: int, quant_bits: int, quantizer: str = "chunk"
) -> int:
    """Bytes of one parameter's SparseLoCo message: ``n_chunks * k`` positions packed at
    :func:`position_bits`, then the values: ``quant_bits``-bit codes packed plus one fp32 scale
    per chunk (``quantizer`` chunk) or one fp32 shift and ``2^quant_bits`` fp32 codebook levels
    per tensor (statistical), or fp32 values when ``quant_bits`` is 0 (no quantization)."""
    values = n_chunks * k
    positions = packed_bytes(values, position_bits(chunk_numel))
    if quant_bits == 0:
        return positions + 4 * values
    extra = SCALE_BYTES * n_chunks if quantizer == "chunk" else 4 * (1 + 2**quant_bits)
    return positions + packed_bytes(values, quant_bits) + extra


def sparseloco_payload_bytes(
    shapes: Iterable[tuple[int, ...]],
    topk: int,
    chunk: int,
    quant_bits: int,
    quantizer: str = "chunk",
) -> int:
    """Bytes one rank hands to SparseLoCo's all-gather per sync (its own part).

    Every parameter is cut into :func:`tile_shape` chunks (sides at most ``chunk``: 64 x 64 =
    4096 values for matrices, up to 64 for vectors); each chunk sends ``k = min(topk, chunk
    values)`` values (:func:`sparseloco_chunk_payload`). Example: a 4096 x 4096 matrix with k 64
    of 4096 and 2-bit values sends 4096 chunks x (64 x 12 bits + 64 x 2 bits + 4 bytes) =
    4096 x 116 bytes = 464 KiB, 1/141 of its fp32 size. Wire bytes at ``W`` ranks are
    ``(W - 1)`` times this per sync.
    """
    total = 0
    for shape in shapes:
        n_chunks, k, chunk_numel = tile_counts(tuple(shape), topk, chunk)
        total += sparseloco_chunk_payload(n_chunks, k, chunk_numel, quant_bits, quantizer)
    return total


def diloco_payload_bytes(numel: int, dtype: torch.dtype) -> int:
    """Bytes DiLoCo hands to its all-reduce per sync: the pseudo-gradient of ``numel`` trained
    values in ``dtype`` (fp32 or bf16); wire bytes at ``W`` ranks: ``2 (W - 1) / W`` times this."""
    return numel * dtype.itemsize


@dataclass(frozen=True)
class ShardedExchange:
    """FSDP's exchange in one optimizer step, in the sizes the ring model needs: ``parameters``
    trained (elements over the whole model), ``gathered`` elements all-gathered per micro-batch
    (each unit before its forward and again before its backward; the root unit once), a mesh of
    ``replicate`` groups of ``shard`` ranks, ``micro_batches`` per step, and the bytes of one
    gathered value (``gather_bytes``: bf16 under bf16-mixed) and one reduced gradient value
    (``reduce_bytes``)."""

    parameters: int
    gathered: int
    shard: int
    replicate: int
    micro_batches: int
    gather_bytes: int
    reduce_bytes: int


def sharded_step_bytes(exchange: ShardedExchange) -> tuple[float, int]:
    """(wire bytes one rank sends, bytes it hands to collectives) in one step of FSDP: every
    micro-batch all-gathers the units within the shard group, the last one reduce-scatters the
    gradients there, and under hsdp each gradient shard is then all-reduced over the replicate
    group (torch's FSDP2 collectives; ring model of this module)."""
    ex = exchange
    gathered = ex.micro_batches * ex.gathered * ex.gather_bytes / ex.shard  # this rank's parts
    reduced = ex.parameters * ex.reduce_bytes
    wire = wire_bytes("all_gather", gathered, ex.shard)
    wire += wire_bytes("reduce_scatter", reduced, ex.shard)
    wire += wire_bytes("all_reduce", reduced / ex.shard, ex.replicate)
    replicated = reduced / ex.shard if ex.replicate > 1 else 0.0
    return wire, round(gathered + reduced + replicated)
