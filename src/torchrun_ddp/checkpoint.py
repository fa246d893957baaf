"""Exact-resume checkpoints of a DDP run: safetensors and JSON only, published atomically.

A checkpoint is the folder ``<root>/step-<N>/`` (``N`` = optimizer steps done) holding:

- ``dcp/shard-<i>-model-00001-of-00001.safetensors``: every tensor of the *shared* state (model
  parameters and buffers, optimizer moments and step counts), written collectively by
  ``torch.distributed.checkpoint`` (DCP) through its safetensors storage writer. DCP spreads the
  replicated DDP tensors over the ranks, so each rank writes one shard file and no tensor twice.
- ``shared.json``: the rest of the shared state (optimizer hyperparameters, LR-scheduler state),
  with a ``{"__tensor__": key}`` placeholder wherever a tensor sits in ``dcp/``.
- ``rank-<r>.safetensors`` + ``rank-<r>.json``: rank ``r``'s own state (data position, RNG
  states, compression residuals): tensors in the first file, everything else in the second.
- ``meta.json``: ``step``, ``world_size`` and whatever the caller adds (fingerprints, config).
- ``COMPLETE``: an empty marker, written last. A folder without it is never loaded.

Nothing is pickled: DCP's default file format pickles its ``.metadata`` file and non-tensor
values, so only tensors go through DCP, in its safetensors format (metadata rebuilt from the
safetensors headers), and everything else is JSON. Tuples survive the trip as tuples.

Atomic publication: all ranks write into ``<root>/step-<N>.tmp/``; every file is fsynced; after a
barrier rank 0 renames the folder to ``step-<N>/``, fsyncs ``<root>`` and only then writes the
marker. Leftover ``*.tmp`` folders and marker-less ``step-*`` folders from a crash are removed at
the start of the next save.

Multi-node rule: ``root`` must be a shared file system (NFS, Lustre, ...) mounted at the same path
on every node; rank 0 creates, renames and prunes folders that the other ranks write into and read.

Sources: DCP, https://docs.pytorch.org/docs/stable/distributed.checkpoint.html and the recipe
https://docs.pytorch.org/tutorials/recipes/distributed_checkpoint_recipe.html (state dicts of a
DDP model and its optimizer via ``get_state_dict`` / ``set_state_dict``, keys without ``module.``).
"""

from __future__ import annotations

import importlib
import json
import os
import random
import re
import shutil
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType
from typing import Protocol, cast

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from safetensors.torch import save as safetensors_bytes
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.optim import Optimizer

from torchrun_ddp.errors import UserError

MARKER = "COMPLETE"
_STEP_DIR = re.compile(r"step-(\d+)")
_TENSOR = "__tensor__"
_TUPLE = "__tuple__"
_DCP_DIR = "dcp"
_SHARED_JSON = "shared.json"
_META_JSON = "meta.json"
_HINT = "use --no-resume or a matching --resume-from"


class Stateful(Protocol):
    """Anything with ``state_dict()`` / ``load_state_dict()`` (modules, optimizers, schedulers)."""

    def state_dict(self) -> Mapping[str, object]:
        """Current state: nested dicts, lists, tuples, tensors, numbers, strings, None."""
        ...

    def load_state_dict(self, state_dict: Mapping[str, object], /) -> object:
        """Restore what ``state_dict`` returned."""
        ...


class ModelAndOptimizer:
    """A DDP (or plain) model and its optimizer as one Stateful, keyed by parameter names.

    ``state_dict`` is ``{"model": ..., "optimizer": ...}`` from DCP's ``get_state_dict``: no
    ``module.`` prefix, optimizer state keyed by parameter name instead of position, so it loads
    into a freshly built model and optimizer (``set_state_dict``). A fresh optimizer's moments are
    created by DCP with one zero-learning-rate step, so ``load_checkpoint`` can fill them in place.
    With ``optimizer=None`` only the model is saved (a ZeRO-1 optimizer's shards are per-rank
    state: see ``ShardedOptimizer``). With ``trainable_only`` frozen parameters
    (``requires_grad=False``, e.g. a LoRA base model) are left out (DCP's ``ignore_frozen_params``):
    the caller rebuilds them identically before loading.
    """

    def __init__(
        self, model: nn.Module, optimizer: Optimizer | None, trainable_only: bool = False
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.options = StateDictOptions(
            ignore_frozen_params=trainable_only, strict=not trainable_only
        )

    def state_dict(self) -> dict[str, object]:
        """``{"model": {name: tensor}, "optimizer": {"state": ..., "param_groups": ...}}``."""
        if self.optimizer is None:
            return {"model": get_model_state_dict(self.model, options=self.options)}
        model_state, optimizer_state = get_state_dict(
            self.model, self.optimizer, options=self.options
        )
        return {"model": model_state, "optimizer": optimizer_state}

    def load_state_dict(self, state_dict: Mapping[str, object], /) -> None:
        """Copy a ``state_dict`` result into the model and the optimizer."""
        if self.optimizer is None:
            set_model_state_dict(self.model, state_dict["model"], options=self.options)
            return
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state_dict["model"],
            optim_state_dict=state_dict["optimizer"],
            options=self.options,
        )


class ShardedOptimizer:
    """This rank's shard of a ``ZeroRedundancyOptimizer`` as per-rank checkpoint state.

    Each rank saves the AdamW state of the parameters it owns (``zero.optim``, the local AdamW),
    with positions as string keys so the state is JSON + tensors; resuming needs the same world
    size (and so the same partition), which ``load_checkpoint`` checks. ZeRO's own
    ``param_groups`` are saved too: the scheduler sets the next step's learning rate there, and
    ZeRO copies it to the local optimizer only when it steps.
    """

    def __init__(self, zero: ZeroRedundancyOptimizer) -> None:
        self.zero = zero

    def state_dict(self) -> dict[str, object]:
        """``{"state": {"<position>": {name: tensor}}, "param_groups": [...], "zero_groups":
        [...]}`` of this rank (``zero_groups``: ZeRO's groups without their parameters)."""
        local = self.zero.optim.state_dict()
        state = {str(index): values for index, values in local["state"].items()}
        outer = [
            {k: v for k, v in group.items() if k != "params"} for group in self.zero.param_groups
        ]
        return {"state": state, "param_groups": local["param_groups"], "zero_groups": outer}

    def load_state_dict(self, state_dict: Mapping[str, object], /) -> None:
        """Restore what ``state_dict`` returned on this rank (tensors move to the parameters'
        device inside ``Optimizer.load_state_dict``)."""
        saved = cast(Mapping[str, Mapping[str, object]], state_dict["state"])
        state = {int(index): values for index, values in saved.items()}
        groups = state_dict["param_groups"]
        self.zero.optim.load_state_dict({"state": state, "param_groups": groups})
        outer = cast(list[Mapping[str, object]], state_dict["zero_groups"])
        for group, saved_group in zip(self.zero.param_groups, outer, strict=True):
            group.update(saved_group)


def model_fingerprint(model: nn.Module) -> dict[str, str]:
    """``{parameter name: "dtype[shape]"}``, DDP's ``module.`` prefix removed; for ``meta``.

    Two models whose fingerprints are equal load each other's checkpoints.
    """
    inner = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    return {
        name: f"{str(param.dtype).removeprefix('torch.')}{list(param.shape)}"
        for name, param in inner.named_parameters()
    }


def save_checkpoint(
    root: Path,
    step: int,
    shared: Mapping[str, Stateful],
    per_rank: Mapping[str, object],
    meta: Mapping[str, object],
    keep: int,
) -> Path:
    """Write ``<root>/step-<step>/`` from every rank (collective) and return its path.

    ``shared``: replicated state, the same on every rank (e.g. ``{"train":
    ModelAndOptimizer(model, optimizer), "scheduler": scheduler}``); tensors go through DCP,
    the rest into ``shared.json`` (rank 0). ``per_rank``: this rank's state as nested dicts /
    lists / tuples of tensors (any device and dtype; saved as is, loaded on the CPU), ints,
    floats, strings, bools and None; written to ``rank-<r>.safetensors`` / ``rank-<r>.json``.
    ``meta``: JSON-serialisable facts for ``check_compatible`` (``step`` and ``world_size`` are
    added). An existing ``step-<step>`` is replaced. Afterwards only the newest ``keep``
    complete checkpoints remain. Every rank returns after the marker is written.

    Raises ``ValueError`` for ``keep < 1`` and ``TypeError`` for a value JSON cannot hold, both
    before any file is touched or any collective is entered.
    """
    if keep < 1:
        raise ValueError(f"keep must be at least 1, got {keep}")
    rank, world_size = _rank_and_world()
    shared_tree, shared_tensors = _split_shared(shared)
    rank_tensors: dict[str, torch.Tensor] = {}
    rank_tree = _split(per_rank, "", rank_tensors)
    meta_text = json.dumps({**meta, "step": step, "world_size": world_size})
    final, tmp = root / f"step-{step}", root / f"step-{step}.tmp"
    if rank == 0:
        _remove_incomplete(root)
        tmp.mkdir(parents=True)
    _barrier()
    if shared_tensors:  # the same on every rank, so all or none enter the collective
        dcp.save(_unshared(shared_tensors), storage_writer=_writer(tmp / _DCP_DIR))
    cpu = {key: value.cpu().contiguous() for key, value in _unshared(rank_tensors).items()}
    _write_bytes(tmp / f"rank-{rank}.safetensors", safetensors_bytes(cpu))
    _write_json(tmp / f"rank-{rank}.json", rank_tree)
    if rank == 0:
        _write_json(tmp / _SHARED_JSON, shared_tree)
        _write_bytes(tmp / _META_JSON, meta_text.encode())
    _barrier()
    if rank == 0:
        _publish(tmp, final)
        _prune(root, keep)
    _barrier()
    return final


def find_latest(root: Path) -> Path | None:
    """The complete ``step-<N>`` folder under ``root`` with the largest ``N``, or None.

    Folders without the ``COMPLETE`` marker (a crash mid-save) and ``*.tmp`` folders are skipped.
    """
    steps = _complete_steps(root)
    return steps[-1][1] if steps else None


def read_meta(path: Path) -> dict[str, object]:
    """``meta.json`` of the checkpoint folder ``path`` (``step``, ``world_size``, caller's keys).

    Raises UserError if ``path`` is not a complete checkpoint or its ``meta.json`` is unreadable.
    """
    _require_complete(path)
    try:
        meta = json.loads((path / _META_JSON).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise UserError(f"cannot read {path / _META_JSON} ({exc}); {_HINT}") from exc
    if not isinstance(meta, dict):
        raise UserError(f"{path / _META_JSON} is not a JSON object; {_HINT}")
    return meta


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
            raise UserError(f"checkpoint at step {saved.get('step')} has no {key!r}; {_HINT}")
        if saved[key] != value:
            detail = _difference(saved[key], value)
            raise UserError(
                f"checkpoint at step {saved.get('step')} does not match this run: "
                f"{key} {detail}; {_HINT}"
            )


def load_checkpoint(path: Path, shared: Mapping[str, Stateful]) -> dict[str, object]:
    """Restore ``shared`` in place from ``path`` (collective) and return this rank's ``per_rank``.

    ``shared`` must hold the same names and kinds of objects as at save time; their current
    tensors (e.g. a freshly built model) receive the saved values through ``dcp.load``, then
    ``load_state_dict`` gets the full saved state. Per-rank tensors come back on the CPU.

    Raises UserError if ``path`` is incomplete, was saved with another world size, or its tensors
    do not match the objects in ``shared`` (names or count).
    """
    rank, world_size = _rank_and_world()
    check_compatible(read_meta(path), {"world_size": world_size})
    saved_tree = json.loads((path / _SHARED_JSON).read_text())
    _, template = _split_shared(shared)
    _require_same_keys(path, _tensor_keys(saved_tree), set(template))
    if template:
        dcp.load(template, storage_reader=dcp.HuggingFaceStorageReader(str(path / _DCP_DIR)))
    restored = cast(dict[str, Mapping[str, object]], _join(saved_tree, template))
    for name, obj in shared.items():
        obj.load_state_dict(restored[name])
    state = _load_tree(path, f"rank-{rank}")
    _barrier()
    return state


def capture_rng_state() -> dict[str, object]:
    """Global RNG states: ``python`` (random), ``numpy`` (if installed), ``torch`` (CPU, uint8
    tensor) and ``cuda`` (current device, uint8 tensor; only with CUDA). Save it per rank."""
    state: dict[str, object] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    numpy = _numpy()
    if numpy is not None:
        name, keys, position, has_gauss, gauss = numpy.random.get_state()
        state["numpy"] = (str(name), keys.tolist(), int(position), int(has_gauss), float(gauss))
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def restore_rng_state(state: Mapping[str, object]) -> None:
    """Set the global RNGs to ``capture_rng_state``'s result; entries whose library (numpy) or
    device (CUDA) is missing here are skipped."""
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    numpy = _numpy()
    if numpy is not None and "numpy" in state:
        name, keys, position, has_gauss, gauss = state["numpy"]
        numpy.random.set_state(
            (name, numpy.asarray(keys, dtype=numpy.uint32), position, has_gauss, gauss)
        )
    if torch.cuda.is_available() and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])


# ----------------------------------------------------------------------------- tree <-> JSON


def _split(tree: object, path: str, tensors: dict[str, torch.Tensor]) -> object:
    """JSON-able copy of ``tree`` with tensors replaced by ``{"__tensor__": path}`` placeholders
    and collected in ``tensors``; tuples become ``{"__tuple__": [...]}``."""
    if isinstance(tree, torch.Tensor):
        if path in tensors:
            raise ValueError(f"two tensors map to the checkpoint key {path!r}")
        tensors[path] = tree
        return {_TENSOR: path}
    if isinstance(tree, Mapping):
        out: dict[str, object] = {}
        for key, value in tree.items():
            if not isinstance(key, str) or key in (_TENSOR, _TUPLE):
                raise TypeError(f"cannot save the key {key!r} under {path!r}: use string keys")
            out[key] = _split(value, f"{path}/{key}" if path else key, tensors)
        return out
    if isinstance(tree, list | tuple):
        items = [_split(value, f"{path}/{index}", tensors) for index, value in enumerate(tree)]
        return {_TUPLE: items} if isinstance(tree, tuple) else items
    if tree is None or isinstance(tree, bool | int | float | str):
        return tree
    raise TypeError(f"cannot save a {type(tree).__name__} at {path!r}: not a tensor or JSON value")


def _join(tree: object, tensors: Mapping[str, torch.Tensor]) -> object:
    """Inverse of ``_split``: put the tensors back and turn tuple records into tuples."""
    if isinstance(tree, list):
        return [_join(value, tensors) for value in tree]
    if not isinstance(tree, dict):
        return tree
    if set(tree) == {_TENSOR}:
        return tensors[tree[_TENSOR]]
    if set(tree) == {_TUPLE}:
        return tuple(_join(value, tensors) for value in tree[_TUPLE])
    return {key: _join(value, tensors) for key, value in tree.items()}


def _tensor_keys(tree: object) -> set[str]:
    """The placeholder keys in a ``_split`` result."""
    if isinstance(tree, list):
        return set().union(*(_tensor_keys(value) for value in tree))
    if not isinstance(tree, dict):
        return set()
    if set(tree) == {_TENSOR}:
        return {tree[_TENSOR]}
    return set().union(*(_tensor_keys(value) for value in tree.values()))


def _split_shared(shared: Mapping[str, Stateful]) -> tuple[object, dict[str, torch.Tensor]]:
    """``_split`` of ``{name: obj.state_dict()}``: the JSON tree and ``{key: tensor}``."""
    tensors: dict[str, torch.Tensor] = {}
    tree = _split({name: obj.state_dict() for name, obj in shared.items()}, "", tensors)
    return tree, tensors


def _unshared(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Detached tensors, cloning any that share memory with an earlier one (tied weights):
    safetensors refuses to write shared storage."""
    seen: set[tuple[str, int]] = set()
    out: dict[str, torch.Tensor] = {}
    for key, tensor in tensors.items():
        storage = (str(tensor.device), tensor.untyped_storage().data_ptr())
        out[key] = tensor.detach().clone() if storage in seen else tensor.detach()
        seen.add(storage)
    return out


def _load_tree(folder: Path, stem: str) -> dict[str, object]:
    """``<stem>.json`` with the tensors of ``<stem>.safetensors`` (CPU) put back in place.

    Raises UserError if the JSON file is missing."""
    skeleton_path = folder / f"{stem}.json"
    if not skeleton_path.is_file():
        raise UserError(f"{skeleton_path} is missing; {_HINT}")
    tensors = load_file(folder / f"{stem}.safetensors")
    return cast(dict[str, object], _join(json.loads(skeleton_path.read_text()), tensors))


# ----------------------------------------------------------------------------- files and folders


def _writer(folder: Path) -> dcp.HuggingFaceStorageWriter:
    """DCP's safetensors writer, one shard file per rank (fsynced), no pickled metadata."""
    return dcp.HuggingFaceStorageWriter(str(folder), save_distributed=True)


def _write_bytes(path: Path, data: bytes) -> None:
    with path.open("wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())


def _write_json(path: Path, value: object) -> None:
    _write_bytes(path, json.dumps(value).encode())


def _fsync_dir(folder: Path) -> None:
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _step_dirs(root: Path) -> list[tuple[int, Path]]:
    """Every ``step-<N>`` folder under ``root`` (complete or not), sorted by ``N``."""
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        match = _STEP_DIR.fullmatch(entry.name)
        if match and entry.is_dir():
            found.append((int(match.group(1)), entry))
    return sorted(found)


def _complete_steps(root: Path) -> list[tuple[int, Path]]:
    return [(step, path) for step, path in _step_dirs(root) if (path / MARKER).is_file()]


def _require_complete(path: Path) -> None:
    if not (path / MARKER).is_file():
        raise UserError(f"{path} is not a complete checkpoint (no {MARKER} marker); {_HINT}")


def _require_same_keys(path: Path, saved: set[str], current: set[str]) -> None:
    if saved == current:
        return
    differ = sorted(saved ^ current)
    raise UserError(
        f"{path} holds other tensors than this run's model and optimizer "
        f"({len(differ)} differ, e.g. {differ[0]!r}); {_HINT}"
    )


def _remove_incomplete(root: Path) -> None:
    """Delete ``*.tmp`` folders and marker-less ``step-<N>`` folders left by a crash."""
    if not root.is_dir():
        return
    for entry in root.iterdir():
        if entry.is_dir() and entry.name.endswith(".tmp"):
            shutil.rmtree(entry)
    for _, path in _step_dirs(root):
        if not (path / MARKER).is_file():
            shutil.rmtree(path)


def _publish(tmp: Path, final: Path) -> None:
    """Rename ``tmp`` to ``final`` (replacing an older copy), then write the marker."""
    if (tmp / _DCP_DIR).is_dir():
        _fsync_dir(tmp / _DCP_DIR)
    _fsync_dir(tmp)
    if final.exists():
        (final / MARKER).unlink(missing_ok=True)  # never loadable from here on
        shutil.rmtree(final)
    tmp.rename(final)
    _fsync_dir(final.parent)
    _write_bytes(final / MARKER, b"")
    _fsync_dir(final)


def _prune(root: Path, keep: int) -> None:
    """Delete all but the newest ``keep`` complete checkpoints, marker first."""
    for _, path in _complete_steps(root)[:-keep]:
        (path / MARKER).unlink()
        shutil.rmtree(path)


# ----------------------------------------------------------------------------- small helpers


def _distributed() -> bool:
    """Whether a default process group exists (without one: a single process, rank 0 of 1)."""
    return dist.is_available() and dist.is_initialized()


def _rank_and_world() -> tuple[int, int]:
    if _distributed():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _barrier() -> None:
    if _distributed():
        dist.barrier()


def _numpy() -> ModuleType | None:
    """The numpy module if installed (optional: only its global RNG is checkpointed)."""
    try:
        return importlib.import_module("numpy")
    except ImportError:
        return None


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


__all__ = [
    "MARKER",
    "ModelAndOptimizer",
    "Stateful",
    "capture_rng_state",
    "check_compatible",
    "find_latest",
    "load_checkpoint",
    "model_fingerprint",
    "read_meta",
    "restore_rng_state",
    "save_checkpoint",
]
