"""Saving and loading one checkpoint, collectively: what goes through DCP, what into JSON and
per-rank files, and the checks that a checkpoint matches the run loading it.

A checkpoint is the folder ``<root>/step-<N>/`` (``N`` = optimizer steps done; see ``folders``
for how it is published) holding:

- ``dcp/shard-<i>-model-00001-of-00001.safetensors``: every tensor of the *shared* state (model
  parameters and buffers, optimizer moments and step counts), written collectively by
  ``torch.distributed.checkpoint`` (DCP) through its safetensors storage writer. DCP spreads the
  replicated DDP tensors over the ranks, so each rank writes one shard file and no tensor twice.
  ZeRO-1 optimizer state goes there too, by parameter name (``adapters.ShardedOptimizer``).
- ``shared.json``: the rest of the shared state (optimizer hyperparameters, LR-scheduler state),
  with a ``{"__tensor__": key}`` placeholder wherever a tensor sits in ``dcp/``.
- ``rank-<r>.safetensors`` + ``rank-<r>.json``: rank ``r``'s own state (data position, RNG
  states, compression residuals): tensors in the first file, everything else in the second.
- ``meta.json``: ``step``, ``world_size``, ``manifest_version`` (the step has a manifest:
  ``manifest``) and whatever the caller adds (fingerprints, config).
- ``COMPLETE``: an empty marker, written last.

Nothing is pickled: DCP's default file format pickles its ``.metadata`` file and non-tensor
values, so only tensors go through DCP, in its safetensors format (metadata rebuilt from the
safetensors headers), and everything else is JSON (``codec``).

Source: DCP, https://docs.pytorch.org/docs/stable/distributed.checkpoint.html.
"""

from __future__ import annotations

import errno
import json
from collections.abc import Mapping
from pathlib import Path
from typing import cast

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from safetensors.torch import load_file
from safetensors.torch import save as safetensors_bytes
from torch.distributed.checkpoint.api import CheckpointException

from torchrun_ddp.checkpoint.adapters import (
    ShardedOptimizer,
    Stateful,
    load_sharded,
    sharded_template,
    sharded_tensors,
)
from torchrun_ddp.checkpoint.codec import (
    join_tree,
    split_tree,
    tensor_keys,
    untied,
    write_bytes,
)
from torchrun_ddp.checkpoint.folders import (
    DCP_DIR,
    HINT,
    META_JSON,
    SHARED_JSON,
    prune,
    publish,
    read_meta,
    remove_incomplete,
)
from torchrun_ddp.checkpoint.manifest import (
    MANIFEST_KEY,
    MANIFEST_VERSION,
    Entry,
    dcp_share,
    entries_from_json,
    entries_to_json,
    write_manifest,
)
from torchrun_ddp.checkpoint.ranks import (
    all_gather_json,
    barrier,
    every_rank_ok,
    json_int,
    json_list,
    rank_and_world,
)
from torchrun_ddp.checkpoint.storage import StorageLayout, single_layout
from torchrun_ddp.checkpoint.transfer import Stream, exchange, files_from_json, files_to_json
from torchrun_ddp.errors import UserError
from torchrun_ddp.faults import fault_point


def save_checkpoint(
    root: Path,
    step: int,
    shared: Mapping[str, Stateful],
    per_rank: Mapping[str, object],
    meta: Mapping[str, object],
    keep: int,
    sharded: Mapping[str, ShardedOptimizer] | None = None,
    layout: StorageLayout | None = None,
) -> Path:
    """Write ``<root>/step-<step>/`` from every rank (collective) and return its path.

    ``shared``: replicated state, the same on every rank (e.g. ``{"train":
    ModelAndOptimizer(model, optimizer), "scheduler": scheduler}``); tensors go through DCP,
    the rest into ``shared.json`` (rank 0). ``per_rank``: this rank's state as nested dicts /
    lists / tuples of tensors (any device and dtype; saved as is, loaded on the CPU), ints,
    floats, strings, bools and None; written to ``rank-<r>.safetensors`` / ``rank-<r>.json``.
    ``meta``: JSON-serialisable facts for ``check_compatible`` (``step`` and ``world_size`` are
    added). ``sharded``: state each rank holds for its own parameters (ZeRO-1), written through
    DCP next to the shared tensors under ``sharded/<name>/<parameter>/<key>``, so that
    ``load_checkpoint`` can load it at another world size.
    An existing ``step-<step>`` is replaced. Afterwards only the newest ``keep``
    complete checkpoints remain. Every rank returns after the marker is written.

    ``layout`` (default: one folder for every rank): with several storage domains each rank's
    ``root`` is its domain's folder; the domain's ranks write the whole replicated state there
    (DCP in the domain's process group), each rank its own files, and each rank's files are
    also copied to its buddy ranks' folders (``StorageLayout.buddy_targets``, bounded chunks);
    the domain's leader publishes and prunes its folder.

    Raises ``ValueError`` for ``keep < 1`` and ``TypeError`` for a value JSON cannot hold, both
    before any file is touched or any collective is entered. Raises UserError when the device
    of ``root`` is full (ENOSPC): the unfinished ``step-<step>.tmp`` is never published, so the
    newest complete checkpoint stays loadable (the next save removes the leftover).
    """
    if keep < 1:
        raise ValueError(f"keep must be at least 1, got {keep}")
    rank, world_size = rank_and_world()
    layout = layout or single_layout(world_size)
    leader = rank == layout.leader
    shared_tree, shared_tensors = _split_shared(shared)
    rank_tensors: dict[str, torch.Tensor] = {}
    rank_tree = split_tree(per_rank, "", rank_tensors)
    dcp_tensors = {**shared_tensors, **sharded_tensors(sharded or {})}
    facts = {"step": step, "world_size": world_size, MANIFEST_KEY: MANIFEST_VERSION}
    meta_text = json.dumps({**meta, **facts})
    final, tmp = root / f"step-{step}", root / f"step-{step}.tmp"
    if leader:
        remove_incomplete(root)
        tmp.mkdir(parents=True)
    barrier()
    failure: BaseException | None = None
    entries: dict[str, Entry] = {}  # this rank's files of the manifest, hashed while written
    try:
        if shared_tensors or sharded:  # the same on every rank: all or none enter it
            writer = _writer(tmp / DCP_DIR)
            dcp.save(untied(dcp_tensors), storage_writer=writer, process_group=layout.group)
        cpu = {key: value.cpu().contiguous() for key, value in untied(rank_tensors).items()}
        _write(tmp, f"rank-{rank}.safetensors", safetensors_bytes(cpu), entries)
        _write(tmp, f"rank-{rank}.json", json.dumps(rank_tree).encode(), entries)
        if leader:
            _write(tmp, SHARED_JSON, json.dumps(shared_tree).encode(), entries)
            _write(tmp, META_JSON, meta_text.encode(), entries)
    except (OSError, CheckpointException) as exc:
        if not _disk_full(exc):
            raise
        failure = exc
    if not every_rank_ok(failure is None):  # one rank's full disk stops every rank alike
        raise UserError(
            f"no space left on the device of --checkpoint-dir {root} while writing step {step}; "
            "the newest complete checkpoint is kept: free space (or lower --keep-checkpoints) "
            "and restart to resume from it"
        ) from failure
    if layout.buddy_copies:
        entries.update(exchange(buddy_streams(layout, tmp, rank), tmp, tmp).entries)
    _write_manifest(tmp, layout, rank, entries)
    fault_point("checkpoint-write", step)
    barrier()
    if leader:
        publish(tmp, final, step)
        prune(root, keep)
    else:
        fault_point("publish", step)
    barrier()
    return final


def _write(folder: Path, name: str, data: bytes, entries: dict[str, Entry]) -> None:
    """Write ``data`` to ``folder/name`` (fsynced) and record its manifest entry, hashed while
    writing."""
    entries[name] = Entry(len(data), write_bytes(folder / name, data))


def _write_manifest(tmp: Path, layout: StorageLayout, rank: int, entries: dict[str, Entry]) -> None:
    """Collective: the manifest of every domain's ``tmp`` folder. Each rank adds its share of
    the DCP shard files (hashed after DCP wrote them) to ``entries`` (what it wrote itself);
    every rank's entries are gathered and each domain's leader writes its folder's manifest."""
    home = layout.domain_of(rank)
    ranks = layout.domains[home]
    entries.update(dcp_share(tmp / DCP_DIR, ranks.index(rank), len(ranks)))
    every = [json_list(pair, 2) for pair in all_gather_json([home, entries_to_json(entries)])]
    if rank == layout.leader:
        mine: dict[str, Entry] = {}
        for domain, listed in every:
            if json_int(domain) == home:
                mine.update(entries_from_json(listed))
        write_manifest(tmp, mine)


def buddy_streams(layout: StorageLayout, folder: Path, rank: int) -> list[Stream]:
    """Collective: the streams that copy every rank's ``rank-<r>.json`` and
    ``rank-<r>.safetensors`` (sizes read in ``folder``, gathered) to its buddy targets."""
    names = (f"rank-{rank}.json", f"rank-{rank}.safetensors")
    sizes = tuple((name, (folder / name).stat().st_size) for name in names)
    every = [files_from_json(files) for files in all_gather_json(files_to_json(sizes))]
    return [
        Stream(sender, target, files)
        for sender, files in enumerate(every)
        for target in layout.buddy_targets(sender)
    ]


def check_compatible(saved: Mapping[str, object], current: Mapping[str, object]) -> None:
    """Raise UserError naming the first key of ``current`` whose value differs in ``saved``.

    ``saved`` is ``read_meta``'s result; ``current`` holds this run's values for the keys that must
    match (e.g. ``world_size``, ``model`` fingerprint, ``vocab_size``, ``compression``). Values are
    compared after a JSON round trip, so tuples equal lists. For dicts the message names the first
    differing entry. Nothing is read or written.
    """
    normalised = json.loads(json.dumps(dict(current)))
    for key, value in normalised.items():
        if key not in saved:
            raise UserError(f"checkpoint at step {saved.get('step')} has no {key!r}; {HINT}")
        if saved[key] != value:
            detail = _difference(saved[key], value)
            raise UserError(
                f"checkpoint at step {saved.get('step')} does not match this run: "
                f"{key} {detail}; {HINT}"
            )


def load_checkpoint(
    path: Path,
    shared: Mapping[str, Stateful],
    sharded: Mapping[str, ShardedOptimizer] | None = None,
    reshard: bool = False,
    group: dist.ProcessGroup | None = None,
    own: bool = True,
) -> dict[str, object] | None:
    """Restore ``shared`` and ``sharded`` in place from ``path`` (collective) and return this
    rank's ``per_rank``.

    ``shared`` must hold the same names and kinds of objects as at save time; their current
    tensors (e.g. a freshly built model) receive the saved values through ``dcp.load``, then
    ``load_state_dict`` gets the full saved state. ``sharded`` objects get the saved state of
    the parameters they own now (``load_owned``), at the saved or, with ``reshard``, any world
    size. Per-rank tensors come back on the CPU. With ``reshard`` and a checkpoint of another
    world size, the per-rank state of the old ranks is not this rank's: None is returned (read
    it with ``load_rank_states``).

    ``group``: the ranks that read ``path``'s folder together (a storage domain's process
    group; None: every rank). ``own`` False: this rank's own files are not read (no folder
    holds them; the caller rebuilds its state) and None is returned.

    Raises UserError if ``path`` is incomplete, was saved with another world size (unless
    ``reshard``), or its tensors do not match the objects in ``shared`` (names or count).
    """
    rank, world_size = rank_and_world()
    meta = read_meta(path)
    if not reshard:
        check_compatible(meta, {"world_size": world_size})
    saved_tree = json.loads((path / SHARED_JSON).read_text())
    _, template = _split_shared(shared)
    _require_same_keys(path, tensor_keys(saved_tree), set(template))
    if template or sharded:
        reader = dcp.HuggingFaceStorageReader(str(path / DCP_DIR))
        owned = sharded_template(reader, sharded or {})
        dcp.load({**template, **owned}, storage_reader=reader, process_group=group)
        load_sharded(sharded or {}, owned)
    restored = cast(dict[str, Mapping[str, object]], join_tree(saved_tree, template))
    for name, obj in shared.items():
        obj.load_state_dict(restored[name])
    same_world = meta["world_size"] == world_size
    state = _load_tree(path, f"rank-{rank}") if same_world and own else None
    barrier()
    return state


def load_rank_states(path: Path, name: str, ranks: list[int] | None = None) -> list[object]:
    """The per-rank entry ``name`` of every rank that saved ``path`` (or of ``ranks``), in rank
    order; only that entry's tensors are read (CPU). No collective: any rank of a run at any
    world size may call it (e.g. to re-split the data positions of all old ranks).

    Raises UserError if ``path`` is incomplete or a rank's files are missing.
    """
    saved_world = int(read_meta(path)["world_size"])
    out: list[object] = []
    for rank in range(saved_world) if ranks is None else ranks:
        skeleton_path = path / f"rank-{rank}.json"
        if not skeleton_path.is_file():
            raise UserError(f"{skeleton_path} is missing; {HINT}")
        tree = json.loads(skeleton_path.read_text())[name]
        tensors: dict[str, torch.Tensor] = {}
        with safe_open(path / f"rank-{rank}.safetensors", framework="pt") as handle:
            for key in tensor_keys(tree):
                tensors[key] = handle.get_tensor(key)
        out.append(join_tree(tree, tensors))
    return out


def load_owned_shards(path: Path, sharded: ShardedOptimizer, entry: str = "optimizer") -> None:
    """Give ``sharded`` (ZeRO-1 at any world size) the state of the parameters it owns now, read
    from the ``<entry>/owned/<parameter>/<key>`` tensors of every old rank's per-rank file
    (where a checkpoint with several folders keeps the shards). Reads only those tensors. No
    collective. Raises UserError if a rank's file is missing."""
    owned = set(sharded.owned_names())
    state: dict[str, dict[str, torch.Tensor]] = {}
    prefix = f"{entry}/owned/"
    for rank in range(int(read_meta(path)["world_size"])):
        file = path / f"rank-{rank}.safetensors"
        if not file.is_file():
            raise UserError(f"{file} is missing; {HINT}")
        with safe_open(file, framework="pt") as handle:
            for key in handle.keys():  # noqa: SIM118 - safe_open has keys(), not iteration
                if not key.startswith(prefix):
                    continue
                parameter, name = key[len(prefix) :].rsplit("/", 1)
                if parameter in owned:
                    state.setdefault(parameter, {})[name] = handle.get_tensor(key)
    sharded.load_owned(state)


def _split_shared(shared: Mapping[str, Stateful]) -> tuple[object, dict[str, torch.Tensor]]:
    """``split_tree`` of ``{name: obj.state_dict()}``: the JSON tree and ``{key: tensor}``."""
    tensors: dict[str, torch.Tensor] = {}
    tree = split_tree({name: obj.state_dict() for name, obj in shared.items()}, "", tensors)
    return tree, tensors


def _load_tree(folder: Path, stem: str) -> dict[str, object]:
    """``<stem>.json`` with the tensors of ``<stem>.safetensors`` (CPU) put back in place.

    Raises UserError if the JSON file is missing."""
    skeleton_path = folder / f"{stem}.json"
    if not skeleton_path.is_file():
        raise UserError(f"{skeleton_path} is missing; {HINT}")
    tensors = load_file(folder / f"{stem}.safetensors")
    return cast(dict[str, object], join_tree(json.loads(skeleton_path.read_text()), tensors))


def _writer(folder: Path) -> dcp.HuggingFaceStorageWriter:
    """DCP's safetensors writer, one shard file per rank (fsynced), no pickled metadata."""
    return dcp.HuggingFaceStorageWriter(str(folder), save_distributed=True)


def _require_same_keys(path: Path, saved: set[str], current: set[str]) -> None:
    if saved == current:
        return
    differ = sorted(saved ^ current)
    raise UserError(
        f"{path} holds other tensors than this run's model and optimizer "
        f"({len(differ)} differ, e.g. {differ[0]!r}); {HINT}"
    )


def _disk_full(exc: BaseException) -> bool:
    """Whether ``exc`` (an OSError, or DCP's CheckpointException gathering every rank's
    failure) comes from ENOSPC on some rank."""
    if isinstance(exc, CheckpointException):
        return any(_disk_full(failure) for failure, _ in exc.failures.values())
    return isinstance(exc, OSError) and exc.errno == errno.ENOSPC


def _difference(saved: object, current: object) -> str:
    """``"is A in the checkpoint, B here"``, or for dicts the first entry that differs."""
    if isinstance(saved, dict) and isinstance(current, dict):
        for key in sorted(set(saved) | set(current)):
            there, here = saved.get(key), current.get(key)
            if there != here:
                return f"differs at {key!r}: {_short(there)} in the checkpoint, {_short(here)} here"
    return f"is {_short(saved)} in the checkpoint, {_short(current)} here"


def _short(value: object) -> str:
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."
