"""Codecs that several optimizers share: a parameter cut into tiles, with or without the DCT.

:class:`TileCodec` maps one parameter onto tiles (a matrix [R, C] into ``r x c`` tiles, each side
the largest divisor of its dimension at most the tile size, :func:`.transform.tile_shape`; a
vector into 1-D chunks) and holds ``k``, the values sent per tile. DeMo (``demo``) sends the top-k
DCT-II coefficients of every tile (:meth:`TileCodec.encode` / :meth:`TileCodec.decode`);
SparseLoCo (``sparseloco_codec``) sends the top-k values of every tile ("chunk") as they are
(:meth:`TileCodec.split` / :meth:`TileCodec.join`). What each method puts on the wire stays in
its own module (``demo``, ``sparseloco_codec``).
"""

import math
from dataclasses import dataclass

import torch

from torchrun_ddp.compression.transform import dct_basis, index_dtype


@dataclass(frozen=True)
class TileCodec:
    """How one parameter maps onto tiles, and the DCT transform of the tiles both ways.

    ``shape``: the parameter's; ``sides``: its tile, ``(r, c)`` or ``(c,)``
    (:func:`.transform.tile_shape`); ``k``: values (coefficients) sent per tile. Tiles are
    [n_tiles, tile_numel] fp32, in row-major order of the tile grid, values row-major inside a
    tile.
    """

    shape: tuple[int, ...]
    sides: tuple[int, ...]
    k: int

    @property
    def tile_numel(self) -> int:
        """Elements per tile."""
        return math.prod(self.sides)

    @property
    def n_tiles(self) -> int:
        """Tiles of the parameter: none for an empty one (a shard with no rows, which FSDP2
        gives a rank when a tensor has fewer rows than the shard degree), so it sends nothing."""
        return math.prod(self.shape) // self.tile_numel

    @property
    def index_dtype(self) -> torch.dtype:
        """Dtype of a position inside a tile on the wire (uint8 up to 256 elements, else int16)."""
        return index_dtype(self.tile_numel)

    def split(self, x: torch.Tensor) -> torch.Tensor:
        """Tiles of ``x`` (the parameter's shape) as rows, [n_tiles, tile_numel], without a
        transform: a view of ``x`` for 1-D tiles, a copy for 2-D ones."""
        return self._grid(x).reshape(self.n_tiles, self.tile_numel)

    def join(self, tiles: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`split`: [n_tiles, tile_numel] -> the parameter's shape."""
        if len(self.sides) == 1:
            return tiles.reshape(self.shape)
        r, c = self.sides
        grid = tiles.reshape(-1, self.shape[-1] // c, r, c)
        return grid.transpose(1, 2).reshape(self.shape)

    def _grid(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` as [n_tiles, c] (1-D tiles) or [R / r, C / c, r, c] (2-D tiles), a view."""
        if len(self.sides) == 1:
            return x.reshape(-1, self.sides[0])
        r, c = self.sides
        return x.reshape(-1, r, self.shape[-1] // c, c).transpose(1, 2)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Tiles of ``x`` (the parameter's shape, fp32) -> DCT coefficients [n_tiles, tile_numel].

        A 2-D tile ``X`` [r, c] becomes ``D_r X D_c^T`` with the orthonormal DCT-II matrices.
        """
        if len(self.sides) == 1:
            (c,) = self.sides
            return self._grid(x) @ dct_basis(c, x.device).T
        r, c = self.sides
        coeffs = dct_basis(r, x.device) @ self._grid(x) @ dct_basis(c, x.device).T
        return coeffs.reshape(self.n_tiles, self.tile_numel)

    def decode(self, coeffs: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`encode`: [n_tiles, tile_numel] fp32 -> the parameter's shape."""
        if len(self.sides) == 1:
            (c,) = self.sides
            return self.join(coeffs @ dct_basis(c, coeffs.device))
        r, c = self.sides
        tiles = coeffs.reshape(-1, self.shape[-1] // c, r, c)
        values = dct_basis(r, coeffs.device).T @ tiles @ dct_basis(c, coeffs.device)
        return self.join(values.reshape(self.n_tiles, self.tile_numel))

    @property
    def value_count(self) -> int:
        """Values (coefficients) this parameter sends per exchange: ``n_tiles * k``."""
        return self.n_tiles * self.k
