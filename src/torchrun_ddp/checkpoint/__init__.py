"""Exact-resume checkpoints of a run: safetensors and JSON only, published atomically.

One concern per module (they import each other; nothing else in the package does):

- ``save_load``: ``save_checkpoint`` / ``load_checkpoint`` (collective), ``load_rank_states``,
  ``check_compatible``; what goes through DCP, into JSON and into per-rank files.
- ``folders``: the ``step-<N>`` layout, atomic publication, the ``COMPLETE`` marker, pruning,
  ``find_latest``, ``read_meta``.
- ``start``: the one start path (``agree_on_start``, collective): every storage domain's folder
  listed, rank 0's plan (``peers``) broadcast and carried out in every folder (``settle``: newer
  steps set aside, copies published), every rank's check that it sees the chosen checkpoint
  (``verify_start``), a failure on one rank told to every rank; ``StartFlags``, ``StartPlan``.
- ``listing``: what a folder holds (``list_folder``: an ``Inventory`` of ``StepListing``s;
  ``inventory`` in its JSON form).
- ``peers``: the plan (``decide``, files only) from every folder's ``Inventory``: the step
  every rank can resume (--resume, --resume-from, --no-resume and another run's folder), the
  copies that give a folder what it lacks (none with one folder), as a ``StartDecision``;
  ``plan_across`` is the same in its JSON form.
- ``run_identity``: ``run.json`` and the run id, ``delete_run``.
- ``adapters``: the ``Stateful`` protocol, ``ModelAndOptimizer`` and ``ShardedOptimizer`` (ZeRO-1
  state by parameter name, loadable at any world size), ``model_fingerprint``.
- ``rng``: capture, restore and seed the global RNGs.
- ``codec``: state trees split into JSON and tensors and joined back; fsynced file writes.
- ``ranks``: rank, world size, barrier and agreement, JSON broadcast and gather, with or without
  a process group; the ``json_*`` readers that the typed values' ``from_json`` use (what
  crosses the process group is a frozen dataclass on both sides, JSON only in between).
- ``storage``: which ranks see one checkpoint folder (storage domains, found out with a probe at
  start), ``StorageLayout`` (leaders, buddy copies, each domain's process group).
- ``transfer``: files sent between ranks in bounded chunks over the process group, checked with
  SHA-256 (a peer's recovery, buddy copies), each file hashed while written.
- ``manifest``: checksums at rest: each step's ``manifest.json`` (every file's size and
  SHA-256, written before ``COMPLETE``), ``verify_step`` (full, size, off) before a step is
  chosen; a copy from a peer checked against the manifest it came with.
- ``replicas``: after a resume, the ranks' hashes of the replicated state compared in one
  collective (``check_replicas``).

Callers import from the package: ``from torchrun_ddp.checkpoint import save_checkpoint``. The
package imports no other component but ``errors``, ``faults`` (the test-only fault hook) and the
``torch.distributed`` types it is handed; what the start needs from the rest of the run (the
checkpoint root, the metrics check, whether lost per-rank state can be rebuilt) ``main`` passes
in as values and callables.

Folders: with one shared file system (NFS, Lustre, ...) ``root`` is one folder, one storage
domain, and rank 0 creates, renames and prunes the step folders that every rank writes into.
Across sites or on node-local disks each storage domain has its own ``root``, holding a whole
checkpoint, and its leader does that for it. Either way a start takes the same path
(``start.agree_on_start``).

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
from torchrun_ddp.checkpoint.listing import Inventory, inventory, list_folder
from torchrun_ddp.checkpoint.manifest import MANIFEST, VERIFY_MODES, verify_step
from torchrun_ddp.checkpoint.peers import StartDecision, decide, plan_across
from torchrun_ddp.checkpoint.ranks import all_gather_json, broadcast_json
from torchrun_ddp.checkpoint.replicas import check_replicas, state_digest
from torchrun_ddp.checkpoint.rng import capture_rng_state, restore_rng_state, seed_rng
from torchrun_ddp.checkpoint.run_identity import (
    RUN_FILE,
    delete_run,
    new_run_id,
    read_run_id,
    record_run_id,
    write_run_id,
)
from torchrun_ddp.checkpoint.save_load import (
    check_compatible,
    load_checkpoint,
    load_owned_shards,
    load_rank_states,
    save_checkpoint,
)
from torchrun_ddp.checkpoint.start import (
    StartFlags,
    StartPlan,
    agree_on_start,
    check_start,
    verify_start,
)
from torchrun_ddp.checkpoint.storage import (
    STORAGE_MODES,
    StorageLayout,
    detect_storage,
    single_layout,
)
from torchrun_ddp.checkpoint.transfer import Moved, Stream, exchange

__all__ = [
    "MANIFEST",
    "MARKER",
    "RUN_FILE",
    "STORAGE_MODES",
    "VERIFY_MODES",
    "Inventory",
    "ModelAndOptimizer",
    "Moved",
    "ShardedOptimizer",
    "StartDecision",
    "StartFlags",
    "StartPlan",
    "Stateful",
    "StorageLayout",
    "Stream",
    "agree_on_start",
    "all_gather_json",
    "broadcast_json",
    "capture_rng_state",
    "check_compatible",
    "check_replicas",
    "check_start",
    "decide",
    "delete_run",
    "detect_storage",
    "exchange",
    "find_latest",
    "inventory",
    "list_folder",
    "load_checkpoint",
    "load_owned_shards",
    "load_rank_states",
    "model_fingerprint",
    "new_run_id",
    "plan_across",
    "read_meta",
    "read_run_id",
    "record_run_id",
    "restore_rng_state",
    "save_checkpoint",
    "seed_rng",
    "single_layout",
    "state_digest",
    "verify_start",
    "verify_step",
    "write_run_id",
]
