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
- ``ranks``: rank, world size, barrier and agreement, JSON broadcast and gather, with or without
  a process group.
- ``storage``: which ranks see one checkpoint folder (storage domains, found out with a probe at
  start), ``StorageLayout`` (leaders, buddy copies, each domain's process group).
- ``transfer``: files sent between ranks in bounded chunks over the process group, checked with
  SHA-256 (a peer's recovery, buddy copies).
- ``peers``: with several folders, each folder's inventory and the plan: the step every rank
  can resume, and the copies that give a folder what it lacks.
- ``recovery``: the collective start with several folders (``agree_across``): inventories
  gathered, rank 0's plan carried out in every folder, failures told to every rank.

Callers import from the package: ``from torchrun_ddp.checkpoint import save_checkpoint``.

Folders: with one shared file system (NFS, Lustre, ...) ``root`` is one folder and rank 0
creates, renames and prunes the step folders that every rank writes into. Across sites or on
node-local disks each storage domain has its own ``root``, holding a whole checkpoint, and its
leader does that for it (``storage``, ``peers``).

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
from torchrun_ddp.checkpoint.peers import inventory, plan_across
from torchrun_ddp.checkpoint.ranks import all_gather_json, broadcast_json
from torchrun_ddp.checkpoint.recovery import agree_across
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
    load_owned_shards,
    load_rank_states,
    save_checkpoint,
)
from torchrun_ddp.checkpoint.storage import (
    STORAGE_MODES,
    StorageLayout,
    detect_storage,
    single_layout,
)
from torchrun_ddp.checkpoint.transfer import Moved, Stream, exchange

__all__ = [
    "MARKER",
    "RUN_FILE",
    "STORAGE_MODES",
    "ModelAndOptimizer",
    "Moved",
    "ShardedOptimizer",
    "StartPlan",
    "Stateful",
    "StorageLayout",
    "Stream",
    "agree_across",
    "all_gather_json",
    "broadcast_json",
    "capture_rng_state",
    "check_compatible",
    "check_start",
    "delete_run",
    "detect_storage",
    "exchange",
    "find_latest",
    "inventory",
    "load_checkpoint",
    "load_owned_shards",
    "load_rank_states",
    "model_fingerprint",
    "new_run_id",
    "plan_across",
    "plan_start",
    "read_meta",
    "read_run_id",
    "record_run_id",
    "restore_rng_state",
    "save_checkpoint",
    "seed_rng",
    "single_layout",
    "verify_start",
    "write_run_id",
]
