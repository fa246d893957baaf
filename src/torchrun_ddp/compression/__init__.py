"""Gradient compression inside DDP: comm hooks that compress the gradient all-reduce.

Modules: ``settings`` (methods and their parameters), ``transform`` (orthonormal DCT-II, block
layout, tiles), ``hooks`` (one comm hook per method: none, dct, dct-topk, fp16, bf16, powersgd;
:func:`register_compression`), ``replicas`` (the same hooks on a sharded model's gradient
shards across the replicate group, ``--data-parallel hsdp``), ``local_gradients`` (the hooks
that keep each rank's gradient, or its node's mean, for optimizers that exchange themselves),
``state`` (error feedback,
PowerSGD memories, bytes counted per step, ``state_dict``/``load_state_dict``) and ``wire``
(payload sizes and the ring model's wire bytes per collective).

Imports: torch, ``errors``, and the ``distributed`` types it is handed; nothing else of the
package. ``optim`` (DeMo, DiLoCo, SparseLoCo reuse the transform, the wire sizes and the byte
counter) and ``plan`` build on it; it imports neither.
"""

from torchrun_ddp.compression.hooks import compression_hook, register_compression
from torchrun_ddp.compression.local_gradients import register_local_gradients
from torchrun_ddp.compression.replicas import ReplicaExchange, ShardBucket
from torchrun_ddp.compression.settings import (
    METHODS,
    SCOPED_METHODS,
    SCOPES,
    SELECTIONS,
    TOPK_VALUE_DTYPES,
    CompressionSettings,
    compression_settings,
    keeps_residual,
    kept_coefficients,
    validate_settings,
)
from torchrun_ddp.compression.state import CompressionState, StepBytes, powersgd_slices
from torchrun_ddp.compression.transform import (
    BlockLayout,
    block_layout,
    dct_basis,
    index_dtype,
    kept_frequencies,
    tile_shape,
)
from torchrun_ddp.compression.wire import (
    ShardedExchange,
    dct_payload_bytes,
    demo_payload_bytes,
    dense_wire_bytes,
    diloco_payload_bytes,
    sharded_step_bytes,
    sparseloco_payload_bytes,
    topk_break_even_world_size,
    topk_payload_bytes,
    wire_bytes,
)

__all__ = [
    "METHODS",
    "SCOPED_METHODS",
    "SCOPES",
    "SELECTIONS",
    "TOPK_VALUE_DTYPES",
    "BlockLayout",
    "CompressionSettings",
    "CompressionState",
    "ReplicaExchange",
    "ShardBucket",
    "ShardedExchange",
    "StepBytes",
    "block_layout",
    "compression_hook",
    "compression_settings",
    "dct_basis",
    "dct_payload_bytes",
    "demo_payload_bytes",
    "dense_wire_bytes",
    "diloco_payload_bytes",
    "index_dtype",
    "keeps_residual",
    "kept_coefficients",
    "kept_frequencies",
    "powersgd_slices",
    "register_compression",
    "register_local_gradients",
    "sharded_step_bytes",
    "sparseloco_payload_bytes",
    "tile_shape",
    "topk_break_even_world_size",
    "topk_payload_bytes",
    "validate_settings",
    "wire_bytes",
]
