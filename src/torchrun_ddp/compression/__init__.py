"""Gradient compression for DDP: settings, DCT transform, comm hooks, per-rank state, wire bytes.

``settings`` (methods and their parameters), ``transform`` (DCT-II basis, block layout, DeMo
tiles), ``hooks`` (one comm hook per method, :func:`register_compression`), ``state`` (error
feedback, PowerSGD memories, ``state_dict``/``load_state_dict``), ``wire`` (bytes on the wire),
``demo`` (the DeMo optimizer, which compresses momentum and runs its own all-gather, and the comm
hook that leaves DDP's gradients local for it), ``local_updates`` (DiLoCo and SparseLoCo: local
AdamW steps, a sync every H steps) with ``sparseloco_codec`` (SparseLoCo's messages),
``local_update_state`` (their checkpoint state) and ``local_update_memory`` (their memory rows),
``plan`` (costs before a run).
"""

from torchrun_ddp.compression.demo import (
    DeMo,
    DemoSettings,
    LocalMomentum,
    build_demo,
    register_local_gradients,
    validate_demo,
)
from torchrun_ddp.compression.hooks import compression_hook, register_compression
from torchrun_ddp.compression.local_update_state import RankState, SyncedState
from torchrun_ddp.compression.local_updates import (
    LOCAL_UPDATE_METHODS,
    LocalUpdates,
    LocalUpdateSettings,
    build_local_updates,
    local_update_settings,
)
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
    dct_payload_bytes,
    demo_payload_bytes,
    dense_wire_bytes,
    diloco_payload_bytes,
    sparseloco_payload_bytes,
    topk_break_even_world_size,
    topk_payload_bytes,
    wire_bytes,
)

__all__ = [
    "LOCAL_UPDATE_METHODS",
    "METHODS",
    "SCOPED_METHODS",
    "SCOPES",
    "SELECTIONS",
    "TOPK_VALUE_DTYPES",
    "BlockLayout",
    "CompressionSettings",
    "CompressionState",
    "DeMo",
    "DemoSettings",
    "LocalMomentum",
    "LocalUpdateSettings",
    "LocalUpdates",
    "RankState",
    "StepBytes",
    "SyncedState",
    "block_layout",
    "build_demo",
    "build_local_updates",
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
    "local_update_settings",
    "powersgd_slices",
    "register_compression",
    "register_local_gradients",
    "sparseloco_payload_bytes",
    "tile_shape",
    "topk_break_even_world_size",
    "topk_payload_bytes",
    "validate_demo",
    "validate_settings",
    "wire_bytes",
]
