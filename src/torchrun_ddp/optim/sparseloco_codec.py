"""SparseLoCo's message codec: top-k per chunk, quantization, bit packing and the decode.

A parameter is cut into chunks (DeMo's tiles without the DCT, :func:`chunk_codec`); each chunk
sends the positions of its ``k`` largest-magnitude values and those values, quantized to ``b``
bits with one fp32 scale per chunk (levels ``(2 q / (2^b - 1) - 1) * scale``, ``scale`` the
chunk's largest magnitude: Sarfi et al. 2025, arXiv:2508.15706, which uses 2 bits). Positions and
codes are packed back to back (:func:`pack_bits`); the byte counts are ``wire``'s. Used by
``local_updates`` at each SparseLoCo sync.
"""

from __future__ import annotations

import math

import torch

from torchrun_ddp.compression.transform import tile_shape
from torchrun_ddp.compression.wire import SCALE_BYTES, packed_bytes, position_bits
from torchrun_ddp.optim.demo import TileCodec


def chunk_codec(shape: tuple[int, ...], chunk: int, topk: int) -> TileCodec:
    """SparseLoCo's chunks of a parameter of ``shape``: DeMo's tiles (sides at most ``chunk``),
    used without the DCT; ``k = min(topk, chunk values)``."""
    sides = tile_shape(shape, chunk)
    return TileCodec(shape, sides, min(topk, math.prod(sides)))


def encode_chunks(
    chunks: torch.Tensor, codec: TileCodec, bits: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """One parameter's message: per chunk (a row of ``chunks``, fp32 [n_chunks, chunk values])
    the ``codec.k`` largest-magnitude values, quantized to ``bits`` bits (0: fp32 values).

    Returns the message, uint8 [positions | codes | scales] (or [positions | fp32 values]), of
    ``wire.sparseloco_chunk_payload`` bytes, and what it sends: the dequantized values scattered
    back into place, fp32 [n_chunks, chunk values] (zero elsewhere), for the error feedback.
    """
    positions = chunks.abs().topk(codec.k, dim=1, sorted=False).indices
    values = chunks.gather(1, positions)
    parts = [pack_bits(positions.reshape(-1), position_bits(codec.tile_numel))]
    if bits:
        codes, scale = quantize(values, bits)
        values = dequantize(codes, scale, bits)
        parts += [pack_bits(codes.reshape(-1), bits), _bytes(scale)]
    else:
        parts.append(_bytes(values))
    sent = torch.zeros_like(chunks).scatter_(1, positions, values)
    return torch.cat(parts), sent


def decode_mean(rows: torch.Tensor, codec: TileCodec, bits: int) -> torch.Tensor:
    """All ranks' messages of one parameter (uint8 [world_size, message bytes], as
    :func:`encode_chunks` wrote them) -> the mean of the values they sent, fp32 in the
    parameter's shape; ranks are summed in rank order, so every rank gets the same bits."""
    count = codec.n_tiles * codec.k
    split = packed_bytes(count, position_bits(codec.tile_numel))
    total = torch.zeros(codec.n_tiles, codec.tile_numel, device=rows.device)
    for rank in range(rows.shape[0]):  # rank order: the same sums on every rank
        row = rows[rank]
        positions = unpack_bits(row[:split], position_bits(codec.tile_numel), count)
        values = _values(row[split:], codec, bits)
        total.scatter_add_(1, positions.view(codec.n_tiles, codec.k), values)
    return codec.join(total / rows.shape[0])


def pack_bits(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Integers in ``[0, 2^bits)`` (any integer dtype, [n]) packed back to back, least
    significant bit first: uint8 [ceil(n * bits / 8)] (:func:`.wire.packed_bytes`)."""
    if bits == 0:
        return values.new_empty(0, dtype=torch.uint8)
    shifts = torch.arange(bits, device=values.device, dtype=torch.int32)
    planes = (values.to(torch.int32).unsqueeze(1) >> shifts) & 1
    flat = planes.reshape(-1).to(torch.uint8)
    flat = torch.cat([flat, flat.new_zeros(-flat.numel() % 8)])
    weights = 1 << torch.arange(8, device=values.device, dtype=torch.int32)
    return (flat.view(-1, 8).to(torch.int32) * weights).sum(1).to(torch.uint8)


def unpack_bits(data: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: the first ``count`` values, int64 [count]."""
    if bits == 0:
        return torch.zeros(count, dtype=torch.int64, device=data.device)
    shifts = torch.arange(8, device=data.device, dtype=torch.int32)
    planes = (data.to(torch.int32).unsqueeze(1) >> shifts) & 1
    flat = planes.reshape(-1)[: count * bits].view(count, bits)
    weights = 1 << torch.arange(bits, device=data.device, dtype=torch.int32)
    return (flat * weights).sum(1).to(torch.int64)


def quantize(values: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of ``values`` (fp32 [n, k]): codes in ``[0, 2^bits)`` (int64 [n, k]) and the
    scale (fp32 [n], the row's largest magnitude). Levels are evenly spaced over
    ``[-scale, scale]`` (:func:`dequantize`); each value goes to the nearest."""
    levels = 2**bits - 1
    scale = values.abs().amax(dim=1)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = ((values / safe.unsqueeze(1) + 1.0) * (levels / 2)).round_().clamp_(0, levels)
    return codes.to(torch.int64), scale


def dequantize(codes: torch.Tensor, scale: torch.Tensor, bits: int) -> torch.Tensor:
    """Values of ``codes`` (int [n, k]) under per-row ``scale`` (fp32 [n]): fp32 [n, k],
    ``(2 q / (2^bits - 1) - 1) * scale``; 2 bits: ``{-1, -1/3, 1/3, 1} * scale``."""
    levels = 2**bits - 1
    return (codes.to(torch.float32) * (2.0 / levels) - 1.0) * scale.unsqueeze(1)


def _bytes(values: torch.Tensor) -> torch.Tensor:
    """An fp32 tensor's raw bytes, uint8 [4 numel]."""
    return values.contiguous().reshape(-1).view(torch.uint8)


def _values(data: torch.Tensor, codec: TileCodec, bits: int) -> torch.Tensor:
    """The values part of one rank's message -> fp32 [n_chunks, k] (dequantized)."""
    count = codec.n_tiles * codec.k
    if bits == 0:
        return data.clone().view(torch.float32).view(codec.n_tiles, codec.k)
    split = packed_bytes(count, bits)
    codes = unpack_bits(data[:split], bits, count).view(codec.n_tiles, codec.k)
    scale = data[split : split + SCALE_BYTES * codec.n_tiles].clone().view(torch.float32)
    return dequantize(codes, scale, bits)
