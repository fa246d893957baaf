"""Exact-resume checkpoints of a DDP run: safetensors and JSON only, published atomically.

One concern per module (they import each other; nothing else in the package does):

- ``save_load``: ``save_checkpoint`` / ``load_checkpoint`` (collective), ``load_rank_states``,
  ``check_compatible``; what goes through DCP, into JSON and into per-rank files.
- ``folders``: the ``step-<N>`` layout, atomic publication, the ``COMPLETE`` marker, pruning,
  ``find_latest``, ``read_meta``.
- ``run_identity``: ``run.json`` and the run id, ``StartPlan``, ``plan_start`` (rank 0 decides
  what to resume), ``verify_start`` (every rank checks it), ``delete_run``.
- ``adapters``: the ``Stateful`` protocol, ``ModelAndOptimizer`` and ``ShardedOptimizer`` (ZeRO-1
  state by parameter name, loadable at any world size), ``model_fingerprint``.
- ``rng``: capture, restore and seed the global RNGs.
- ``codec``: state trees split into JSON and tensors and joined back; fsynced file writes.
- ``ranks``: rank, world size, barrier and agreement, with or without a process group.

Callers import from the package: ``from torchrun_ddp.checkpoint import save_checkpoint``.

Multi-node rule: ``root`` must be a shared file system (NFS, Lustre, ...) mounted at the same path
on every node; rank 0 creates, renames and prunes folders that the other ranks write into and read.

Sources: DCP, https://docs.pytorch.org/docs/stable/distributed.checkpoint.html and the recipe
https://docs.pytorch.org/tutorials/recipes/distributed_checkpoint_recipe.html.
"""

from torchrun_ddp.checkpoint.adapters import (
    ModelAndOptimizer,
    ShardedOptimizer,
    Stateful,
    model_fingerprint,
)
from torchrun_ddp.checkpoint.folders import MARKER, find_latest, read_meta
from torchrun_ddp.checkpoint.rng import capture_rng_state, restore_rng_state, seed_rng
from torchrun_ddp.checkpoint.run_identity import (
    RUN_FILE,
    StartPlan,
    check_start,
    delete_run,
    new_run_id,
    plan_start,
    read_run_id,
    record_run_id,
    verify_start,
    write_run_id,
)
from torchrun_ddp.checkpoint.save_load import (
    check_compatible,
    load_checkpoint,
    load_rank_states,
    save_checkpoint,
)

__all__ = [
    "MARKER",
    "RUN_FILE",
    "ModelAndOptimizer",
    "ShardedOptimizer",
    "StartPlan",
    "Stateful",
    "capture_rng_state",
    "check_compatible",
    "check_start",
    "delete_run",
    "find_latest",
    "load_checkpoint",
    "load_rank_states",
    "model_fingerprint",
    "new_run_id",
    "plan_start",
    "read_meta",
    "read_run_id",
    "record_run_id",
    "restore_rng_state",
    "save_checkpoint",
    "seed_rng",
    "verify_start",
    "write_run_id",
]
