"""The orthonormal DCT-II and the block layout of a flat gradient buffer.

Blocks never straddle two parameters: each parameter's slice of a bucket is zero-padded to a
multiple of ``block_size`` on its own. The compressed result therefore does not depend on how DDP
groups parameters into buckets, which changes once after the first iteration (DDP rebuilds its
buckets in gradient-ready order) and again in every fresh process (resume).
"""

import functools
import itertools
import math
from dataclasses import dataclass

import torch


def index_dtype(block_size: int) -> torch.dtype:
    """Narrowest dtype for in-block indices: uint8 up to 256, int16 up to 32768, else int32."""
    if block_size <= 256:
        return torch.uint8
    if block_size <= 32768:
        return torch.int16
    return torch.int32


@functools.lru_cache(maxsize=32)
def _cached_basis(block_size: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    n = torch.arange(block_size, dtype=torch.float64)
    freq = n.unsqueeze(1)
    basis = torch.cos(math.pi * (2.0 * n + 1.0) * freq / (2.0 * block_size))
    basis *= math.sqrt(2.0 / block_size)
    basis[0] /= math.sqrt(2.0)
    return basis.to(device=device, dtype=dtype)


def dct_basis(
    block_size: int, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Orthonormal DCT-II matrix (Ahmed, Natarajan & Rao 1974), shape [block_size, block_size].

    Row k is basis vector k: ``D[k, n] = s_k cos(pi (2n + 1) k / (2 N))`` with ``s_0 = sqrt(1/N)``
    and ``s_k = sqrt(2/N)`` otherwise, so ``D @ D.T == I``; ``x @ D.T`` transforms rows of ``x``
    and ``c @ D`` inverts. Computed in float64 once per (block_size, device, dtype) and cached:
    callers share the tensor and must not modify it in place.
    """
    return _cached_basis(block_size, torch.device(device), dtype)


@dataclass(frozen=True)
class BlockLayout:
    """How one bucket's flat buffer maps onto DCT blocks.

    Every parameter's slice is zero-padded on its own to a multiple of ``block_size``.
    ``positions`` (int64, [numel]) gives each buffer element's place in the padded array of
    ``n_blocks * block_size`` values; it is ``None`` when no slice needs padding.
    """

    numel: int
    block_size: int
    n_blocks: int
    positions: torch.Tensor | None

    def to_blocks(self, flat: torch.Tensor) -> torch.Tensor:
        """[numel] -> [n_blocks, block_size] (zero-padded)."""
        if self.positions is None:
            return flat.view(self.n_blocks, self.block_size)
        padded = flat.new_zeros(self.n_blocks * self.block_size)
        padded[self.positions] = flat
        return padded.view(self.n_blocks, self.block_size)

    def from_blocks(self, blocks: torch.Tensor) -> torch.Tensor:
        """[n_blocks, block_size] -> [numel] (padding dropped)."""
        flat = blocks.reshape(-1)
        return flat if self.positions is None else flat[self.positions]


def block_layout(
    starts: list[int], numel: int, block_size: int, device: torch.device | str = "cpu"
) -> BlockLayout:
    """Layout for a buffer of ``numel`` values whose parameter slices begin at ``starts``."""
    bounds = [*sorted({0, *[s for s in starts if s < numel]}), numel]
    lengths = torch.tensor([b - a for a, b in itertools.pairwise(bounds)], dtype=torch.int64)
    padded = (lengths + block_size - 1) // block_size * block_size
    n_blocks = int(padded.sum()) // block_size
    if torch.equal(padded, lengths):
        return BlockLayout(numel, block_size, n_blocks, None)
    shift = (torch.cumsum(padded, 0) - padded) - (torch.cumsum(lengths, 0) - lengths)
    positions = torch.arange(numel) + torch.repeat_interleave(shift, lengths)
    return BlockLayout(numel, block_size, n_blocks, positions.to(device))


def kept_frequencies(
    block_size: int, kept: int, step: int, selection: str, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """DCT frequencies ``dct`` sends at optimizer ``step``: int64 [kept], the same on all ranks.

    ``low-pass``: ``0 .. kept - 1`` at every step. ``rotating``: ``(step * kept + j) mod
    block_size`` for ``j < kept``, a cyclic walk through all frequencies: each one is sent at
    least once in every ``ceil(block_size / kept)`` consecutive steps, so an error-feedback
    residual holds at most that many steps of gradient (cyclic coordinate selection, as in the
    block-coordinate methods of Nesterov 2012, "Efficiency of coordinate descent methods").
    """
    offsets = torch.arange(kept, dtype=torch.int64, device=device)
    if selection == "low-pass":
        return offsets
    return (offsets + step * kept) % block_size


def largest_divisor(n: int, limit: int) -> int:
    """The largest divisor of ``n`` that is at most ``limit`` (1 when ``n`` is a prime above
    it). DeMo's tile side (``_get_smaller_split`` in bloc97/DeMo): tiles cover a dimension
    exactly, so no padding is ever transmitted."""
    for side in range(min(n, limit), 0, -1):
        if n % side == 0:
            return side
    return 1


def tile_shape(shape: tuple[int, ...], limit: int) -> tuple[int, ...]:
    """DeMo's DCT tile for a parameter of ``shape``: ``(r, c)`` for a matrix [R, C], each side the
    largest divisor of R (of C) at most ``limit``; ``(c,)`` for a vector [N]. Tensors with more
    than two dimensions are treated as the matrix [prod(shape[:-1]), shape[-1]] (a mixture of
    experts' 3-D weights), a scalar as a vector of one."""
    if len(shape) <= 1:
        return (largest_divisor(max(1, math.prod(shape)), limit),)
    rows = math.prod(shape[:-1])
    return (largest_divisor(rows, limit), largest_divisor(shape[-1], limit))
