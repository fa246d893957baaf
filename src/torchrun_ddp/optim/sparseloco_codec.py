"""SparseLoCo's message codec: top-k per chunk, quantization, bit packing and the decode.

A parameter is cut into chunks (DeMo's tiles without the DCT: :func:`chunk_codec`, a
:class:`.codecs.TileCodec`); each chunk sends the positions of its ``k`` largest-magnitude values
and those values, quantized to ``b`` bits (Sarfi et al. 2025, arXiv:2508.15706, which uses 2
bits) in one of two ways:

- ``chunk``: one fp32 scale per chunk, the chunk's largest magnitude, levels evenly spaced over
  ``[-scale, scale]`` (``(2 q / (2^b - 1) - 1) * scale``), so the largest value is sent exactly;
- ``statistical``: Templar's (``tplr-ai/templar``, ``src/tplr/compress.py``,
  ``_quantize_values``): per tensor, the selected values' mean is the shift and ``2^b`` bins of
  width ``6 std / 2^b`` cover them (bin ``round(c / width + 2^b / 2)``, clamped); each bin is sent
  as the mean of the values that fell in it (a codebook the sender computes), so a value comes
  back as ``codebook[bin] + shift``.

Positions and codes are packed back to back (:func:`pack_bits`); the byte counts are ``wire``'s.
The decode sums every rank's values in rank order (the same bits on every rank) and divides by
the number of ranks (``all``, the paper's mean) or, per value, by the ranks that sent it
(``senders``, Templar's ``scatter_reduce(..., reduce="mean", include_self=False)``); with
``clip`` ``median`` each rank's values of a tensor are first scaled down to the median of the
ranks' norms (Templar's outer step). Used by ``sparseloco`` at each SparseLoCo sync.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from torchrun_ddp.compression.transform import tile_shape
from torchrun_ddp.compression.wire import SCALE_BYTES, packed_bytes, position_bits
from torchrun_ddp.optim.codecs import TileCodec

RANGE_SIGMAS = 6.0
"""Templar's ``quantization_range``: the statistical quantizer's bins span 6 standard
deviations in all (``hparams.json``)."""


@dataclass(frozen=True)
class MessageFormat:
    """How SparseLoCo's values travel and are combined: ``bits`` per value (0: fp32 values),
    ``quantizer`` (``chunk`` or ``statistical``), ``aggregate`` (``all`` or ``senders``) and
    ``clip`` (``none`` or ``median``); see the module docstring."""

    bits: int = 2
    quantizer: str = "chunk"
    aggregate: str = "all"
    clip: str = "none"


def chunk_codec(shape: tuple[int, ...], chunk: int, topk: int) -> TileCodec:
    """SparseLoCo's chunks of a parameter of ``shape``: DeMo's tiles (sides at most ``chunk``),
    used without the DCT; ``k = min(topk, chunk values)``."""
    sides = tile_shape(shape, chunk)
    return TileCodec(shape, sides, min(topk, math.prod(sides)))


def encode_chunks(
    chunks: torch.Tensor, codec: TileCodec, form: MessageFormat
) -> tuple[torch.Tensor, torch.Tensor]:
    """One parameter's message: per chunk (a row of ``chunks``, fp32 [n_chunks, chunk values])
    the ``codec.k`` largest-magnitude values, quantized as ``form`` says (0 bits: fp32 values).

    Returns the message, uint8 [positions | codes | scales or shift and codebook] (or
    [positions | fp32 values]), of ``wire.sparseloco_chunk_payload`` bytes, and what it sends:
    the dequantized values scattered back into place, fp32 [n_chunks, chunk values] (zero
    elsewhere), for the error feedback.
    """
    positions = chunks.abs().topk(codec.k, dim=1, sorted=False).indices
    values = chunks.gather(1, positions)
    parts = [pack_bits(positions.reshape(-1), position_bits(codec.tile_numel))]
    if form.bits and form.quantizer == "statistical":
        codes, table = quantize_statistical(values, form.bits)
        values = table[1:][codes] + table[0]
        parts += [pack_bits(codes.reshape(-1), form.bits), _bytes(table)]
    elif form.bits:
        codes, scale = quantize(values, form.bits)
        values = dequantize(codes, scale, form.bits)
        parts += [pack_bits(codes.reshape(-1), form.bits), _bytes(scale)]
    else:
        parts.append(_bytes(values))
    sent = torch.zeros_like(chunks).scatter_(1, positions, values)
    return torch.cat(parts), sent


def decode_mean(rows: torch.Tensor, codec: TileCodec, form: MessageFormat) -> torch.Tensor:
    """All ranks' messages of one parameter (uint8 [world_size, message bytes], as
    :func:`encode_chunks` wrote them) -> the mean of the values they sent (``form.aggregate``:
    over every rank, or per value over its senders; ``form.clip``: median norm clipping
    first), fp32 in the parameter's shape; ranks are summed in rank order, so every rank gets
    the same bits."""
    count = codec.n_tiles * codec.k
    split = packed_bytes(count, position_bits(codec.tile_numel))
    shape = (codec.n_tiles, codec.k)
    positions = [
        unpack_bits(row[:split], position_bits(codec.tile_numel), count).view(shape) for row in rows
    ]
    values = [_values(row[split:], codec, form) for row in rows]
    if form.clip == "median":
        values = _clip_to_median(values)
    total = torch.zeros(codec.n_tiles, codec.tile_numel, device=rows.device)
    senders = torch.zeros_like(total)
    for where, sent in zip(positions, values, strict=True):  # rank order
        total.scatter_add_(1, where, sent)
        senders.scatter_add_(1, where, torch.ones_like(sent))
    if form.aggregate == "senders":
        return codec.join(total / senders.clamp_min(1.0))
    return codec.join(total / rows.shape[0])


def _clip_to_median(values: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each rank's values scaled down, where their norm exceeds it, to the median of the ranks'
    norms (``torch.median``: the lower middle value for an even count, as Templar's)."""
    norms = torch.stack([sent.norm() for sent in values])
    median = norms.median()
    return [
        sent * torch.clamp(median / (norm + 1e-8), max=1.0)
        for sent, norm in zip(values, norms, strict=True)
    ]


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


def quantize_statistical(values: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Templar's quantizer over all of ``values`` (fp32 [n, k], one tensor's selected values):
    codes (int64 [n, k]) in ``[0, 2^bits)`` and the table, fp32 [1 + 2^bits]: the shift (the
    mean), then each bin's level (the mean of the centred values in it; 0 for an empty bin).
    Bins are ``6 std / 2^bits`` wide; bin ``2^bits / 2`` holds the values within half a bin of
    the mean."""
    bins = 2**bits
    shift = values.mean()
    centred = values - shift
    std = centred.norm() / math.sqrt(max(values.numel() - 1, 1))
    width = RANGE_SIGMAS * std / bins
    safe = torch.where(width > 0, width, torch.ones_like(width))
    codes = (centred / safe + bins // 2).round_().clamp_(0, bins - 1).to(torch.int64)
    sums = torch.zeros(bins, device=values.device).scatter_add_(
        0, codes.reshape(-1), centred.reshape(-1)
    )
    counts = torch.zeros(bins, device=values.device).scatter_add_(
        0, codes.reshape(-1), torch.ones_like(centred).reshape(-1)
    )
    levels = sums / counts.clamp_min(1.0)
    return codes, torch.cat([shift.reshape(1), levels])


def _values(data: torch.Tensor, codec: TileCodec, form: MessageFormat) -> torch.Tensor:
    """The values part of one rank's message -> fp32 [n_chunks, k] (dequantized)."""
    count = codec.n_tiles * codec.k
    if form.bits == 0:
        return data.clone().view(torch.float32).view(codec.n_tiles, codec.k)
    split = packed_bytes(count, form.bits)
    codes = unpack_bits(data[:split], form.bits, count).view(codec.n_tiles, codec.k)
    if form.quantizer == "statistical":
        table = data[split : split + 4 * (1 + 2**form.bits)].clone().view(torch.float32)
        return table[1:][codes] + table[0]
    scale = data[split : split + SCALE_BYTES * codec.n_tiles].clone().view(torch.float32)
    return dequantize(codes, scale, form.bits)
