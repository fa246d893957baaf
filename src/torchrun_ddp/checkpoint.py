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

Run identity: ``<root>/run.json`` holds the ``run_id`` (a random hex string) of the one run whose
checkpoints the folder holds, and every ``meta.json`` repeats it. ``plan_start`` (rank 0) decides
what a starting run resumes and refuses to start a different run in a folder that holds another
run's checkpoints, unless told to overwrite them; ``verify_start`` checks on every rank that it
sees the checkpoint rank 0 chose.

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

import errno
import importlib
import json
import os
import random
import re
import shutil
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Protocol, cast

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from safetensors.torch import load_file
from safetensors.torch import save as safetensors_bytes
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
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
from torchrun_ddp.faults import fault_point

MARKER = "COMPLETE"
_STEP_DIR = re.compile(r"step-(\d+)")
_TENSOR = "__tensor__"
_TUPLE = "__tuple__"
_DCP_DIR = "dcp"
_SHARED_JSON = "shared.json"
_META_JSON = "meta.json"
_HINT = "use --no-resume or a matching --resume-from"
RUN_FILE = "run.json"
_OTHER_RUN = (
    "pass a new --checkpoint-dir (and --output-dir), or add --no-resume --overwrite-output-dir "
    "to delete the old run's checkpoints and metrics"
)


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
    """A ``ZeroRedundancyOptimizer`` (ZeRO-1) as checkpoint state that loads at any world size.

    The AdamW moments and step counts of the parameters a rank owns go through DCP under keys
    named by parameter (``owned_state``: ``{name: {"exp_avg": ..., ...}}``), each rank writing
    its own; at load every rank asks DCP for the parameters it owns under the current partition,
    which may be another world size's (DCP reshards: it reads any subset of the saved keys).
    ``state_dict`` is the JSON rest, the same on every rank: the local AdamW's hyperparameters
    and ZeRO's own ``param_groups`` (the scheduler sets the next step's learning rate there, and
    ZeRO copies it to the local optimizer only when it steps).
    """

    def __init__(self, zero: ZeroRedundancyOptimizer, model: nn.Module) -> None:
        self.zero = zero
        inner = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
        self.names = {id(param): name for name, param in inner.named_parameters()}

    def _owned(self) -> list[tuple[str, torch.Tensor]]:
        return [
            (self.names[id(param)], param)
            for group in self.zero.optim.param_groups
            for param in group["params"]
        ]

    def owned_names(self) -> list[str]:
        """Names of the parameters whose optimizer state this rank holds."""
        return [name for name, _ in self._owned()]

    def owned_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """``{parameter name: {state key: tensor}}`` of this rank's parameters (AdamW:
        ``exp_avg``, ``exp_avg_sq`` like the parameter, ``step`` a float32 scalar).

        Raises TypeError for a non-tensor value in the optimizer state."""
        out: dict[str, dict[str, torch.Tensor]] = {}
        for name, param in self._owned():
            state = self.zero.optim.state.get(param, {})
            for key, value in state.items():
                if not isinstance(value, torch.Tensor):
                    raise TypeError(f"optimizer state {name}/{key} is not a tensor")
            if state:
                out[name] = dict(state)
        return out

    def load_owned(self, state: Mapping[str, Mapping[str, torch.Tensor]]) -> None:
        """Set the state of this rank's parameters from ``owned_state`` values (any device;
        ``Optimizer.load_state_dict`` moves them to the parameters')."""
        local = self.zero.optim.state_dict()
        by_name = {name: index for index, (name, _) in enumerate(self._owned())}
        local["state"] = {by_name[name]: dict(values) for name, values in state.items()}
        self.zero.optim.load_state_dict(local)

    def state_dict(self) -> dict[str, object]:
        """``{"param_groups": [...], "zero_groups": [...]}``: the local optimizer's and ZeRO's
        groups without their parameters (JSON)."""
        local = self.zero.optim.state_dict()["param_groups"]
        inner = [{k: v for k, v in group.items() if k != "params"} for group in local]
        outer = [
            {k: v for k, v in group.items() if k != "params"} for group in self.zero.param_groups
        ]
        return {"param_groups": inner, "zero_groups": outer}

    def load_state_dict(self, state_dict: Mapping[str, object], /) -> None:
        """Restore the hyperparameters of ``state_dict`` (from any rank of any world size)."""
        inner = cast(list[Mapping[str, object]], state_dict["param_groups"])
        for group, saved_group in zip(self.zero.optim.param_groups, inner, strict=True):
            group.update(saved_group)
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
    sharded: Mapping[str, ShardedOptimizer] | None = None,
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

    Raises ``ValueError`` for ``keep < 1`` and ``TypeError`` for a value JSON cannot hold, both
    before any file is touched or any collective is entered. Raises UserError when the device
    of ``root`` is full (ENOSPC): the unfinished ``step-<step>.tmp`` is never published, so the
    newest complete checkpoint stays loadable (the next save removes the leftover).
    """
    if keep < 1:
        raise ValueError(f"keep must be at least 1, got {keep}")
    rank, world_size = _rank_and_world()
    shared_tree, shared_tensors = _split_shared(shared)
    rank_tensors: dict[str, torch.Tensor] = {}
    rank_tree = _split(per_rank, "", rank_tensors)
    dcp_tensors = {**shared_tensors, **_sharded_tensors(sharded or {})}
    meta_text = json.dumps({**meta, "step": step, "world_size": world_size})
    final, tmp = root / f"step-{step}", root / f"step-{step}.tmp"
    if rank == 0:
        _remove_incomplete(root)
        tmp.mkdir(parents=True)
    _barrier()
    failure: BaseException | None = None
    try:
        if shared_tensors or sharded:  # the same on every rank: all or none enter it
            dcp.save(_unshared(dcp_tensors), storage_writer=_writer(tmp / _DCP_DIR))
        cpu = {key: value.cpu().contiguous() for key, value in _unshared(rank_tensors).items()}
        _write_bytes(tmp / f"rank-{rank}.safetensors", safetensors_bytes(cpu))
        _write_json(tmp / f"rank-{rank}.json", rank_tree)
        if rank == 0:
            _write_json(tmp / _SHARED_JSON, shared_tree)
            _write_bytes(tmp / _META_JSON, meta_text.encode())
    except (OSError, CheckpointException) as exc:
        if not _disk_full(exc):
            raise
        failure = exc
    if not _every_rank_ok(failure is None):  # one rank's full disk stops every rank alike
        raise UserError(
            f"no space left on the device of --checkpoint-dir {root} while writing step {step}; "
            "the newest complete checkpoint is kept: free space (or lower --keep-checkpoints) "
            "and restart to resume from it"
        ) from failure
    fault_point("checkpoint-write", step)
    _barrier()
    if rank == 0:
        _publish(tmp, final, step)
        _prune(root, keep)
    else:
        fault_point("publish", step)
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


def load_checkpoint(
    path: Path,
    shared: Mapping[str, Stateful],
    sharded: Mapping[str, ShardedOptimizer] | None = None,
    reshard: bool = False,
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

    Raises UserError if ``path`` is incomplete, was saved with another world size (unless
    ``reshard``), or its tensors do not match the objects in ``shared`` (names or count).
    """
    rank, world_size = _rank_and_world()
    meta = read_meta(path)
    if not reshard:
        check_compatible(meta, {"world_size": world_size})
    saved_tree = json.loads((path / _SHARED_JSON).read_text())
    _, template = _split_shared(shared)
    _require_same_keys(path, _tensor_keys(saved_tree), set(template))
    if template or sharded:
        reader = dcp.HuggingFaceStorageReader(str(path / _DCP_DIR))
        owned = _sharded_template(reader, sharded or {})
        dcp.load({**template, **owned}, storage_reader=reader)
        _load_sharded(sharded or {}, owned)
    restored = cast(dict[str, Mapping[str, object]], _join(saved_tree, template))
    for name, obj in shared.items():
        obj.load_state_dict(restored[name])
    state = _load_tree(path, f"rank-{rank}") if meta["world_size"] == world_size else None
    _barrier()
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
            raise UserError(f"{skeleton_path} is missing; {_HINT}")
        tree = json.loads(skeleton_path.read_text())[name]
        tensors: dict[str, torch.Tensor] = {}
        with safe_open(path / f"rank-{rank}.safetensors", framework="pt") as handle:
            for key in _tensor_keys(tree):
                tensors[key] = handle.get_tensor(key)
        out.append(_join(tree, tensors))
    return out


def _sharded_key(name: str, parameter: str, key: str) -> str:
    return f"sharded/{name}/{parameter}/{key}"


def _sharded_tensors(sharded: Mapping[str, ShardedOptimizer]) -> dict[str, torch.Tensor]:
    """Every ``owned_state`` tensor of ``sharded`` under its DCP key."""
    return {
        _sharded_key(name, parameter, key): tensor
        for name, obj in sharded.items()
        for parameter, values in obj.owned_state().items()
        for key, tensor in values.items()
    }


def _sharded_template(
    reader: dcp.HuggingFaceStorageReader, sharded: Mapping[str, ShardedOptimizer]
) -> dict[str, torch.Tensor]:
    """Empty CPU tensors, shaped as saved, for the saved state of the parameters that
    ``sharded`` own now (parameters without saved state are left out)."""
    if not sharded:
        return {}
    saved = reader.read_metadata().state_dict_metadata
    template: dict[str, torch.Tensor] = {}
    for name, obj in sharded.items():
        for parameter in obj.owned_names():
            prefix = _sharded_key(name, parameter, "")
            for key, item in saved.items():
                if key.startswith(prefix) and "/" not in key[len(prefix) :]:
                    template[key] = torch.empty(tuple(item.size), dtype=item.properties.dtype)
    return template


def _load_sharded(
    sharded: Mapping[str, ShardedOptimizer], tensors: Mapping[str, torch.Tensor]
) -> None:
    """Hand each ``sharded`` object its loaded tensors as ``{parameter: {key: tensor}}``."""
    for name, obj in sharded.items():
        state: dict[str, dict[str, torch.Tensor]] = {}
        for parameter in obj.owned_names():
            prefix = _sharded_key(name, parameter, "")
            for key, tensor in tensors.items():
                if key.startswith(prefix) and "/" not in key[len(prefix) :]:
                    state.setdefault(parameter, {})[key[len(prefix) :]] = tensor
        obj.load_owned(state)


@dataclass(frozen=True)
class StartPlan:
    """What a starting run does: resume ``path`` (``step`` steps done) or start fresh (``path``
    None, ``step`` 0); ``run_id`` names the run either way."""

    run_id: str
    path: str | None = None
    step: int = 0


def read_run_id(root: Path) -> str | None:
    """The run id in ``<root>/run.json``, or None when there is none (a new folder).

    Raises UserError if the file exists but is not a JSON object with a string ``run_id``.
    """
    file = root / RUN_FILE
    if not file.is_file():
        return None
    try:
        value = json.loads(file.read_text()).get("run_id")
    except (OSError, json.JSONDecodeError, AttributeError) as exc:
        raise UserError(f"cannot read the run id in {file} ({exc}); {_OTHER_RUN}") from exc
    if not isinstance(value, str):
        raise UserError(f"{file} has no run_id string; {_OTHER_RUN}")
    return value


def write_run_id(root: Path, run_id: str) -> None:
    """Write ``<root>/run.json`` atomically (temporary file, fsync, rename)."""
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f"{RUN_FILE}.tmp"
    _write_json(tmp, {"run_id": run_id})
    tmp.replace(root / RUN_FILE)
    _fsync_dir(root)


def new_run_id() -> str:
    """A fresh random run id (32 hex digits, uuid4)."""
    return uuid.uuid4().hex


def plan_start(root: Path, resume: bool, resume_from: str, overwrite: bool) -> StartPlan:
    """Rank 0's decision what to resume from ``root`` (file system only, no collective).

    - ``resume_from``: that complete checkpoint, continuing its run id.
    - ``resume``: the newest complete checkpoint of ``root``; without one, the run of
      ``run.json`` starts over (a crash before the first checkpoint) or a new run starts.
    - neither (``--no-resume``): a new run; if ``root`` holds a run, its checkpoints and
      ``run.json`` are deleted when ``overwrite`` is set, otherwise UserError.

    Raises UserError if ``root`` holds another run than the one resumed, or if the checkpoint to
    resume is incomplete or unreadable. The caller records the run id (``record_run_id``) once
    its own checks pass.
    """
    existing = read_run_id(root)
    if not resume and not resume_from:
        if existing is not None or _step_dirs(root):
            if not overwrite:
                raise UserError(
                    f"--no-resume: --checkpoint-dir {root} holds the checkpoints of run "
                    f"{existing or '(unnamed)'}, which a new run must not mix with; {_OTHER_RUN}"
                )
            delete_run(root)
        return StartPlan(new_run_id())
    path = Path(resume_from) if resume_from else find_latest(root)
    if path is None:
        return StartPlan(existing or new_run_id())
    meta = read_meta(path)
    run_id = str(meta.get("run_id") or existing or new_run_id())
    if existing is not None and existing != run_id:
        raise UserError(
            f"--checkpoint-dir {root} holds run {existing} but {path} belongs to run {run_id}; "
            "resume into the checkpoint's own folder, or pass a new --checkpoint-dir"
        )
    return StartPlan(run_id, str(path), int(meta["step"]))


def record_run_id(root: Path, run_id: str) -> None:
    """Write ``run_id`` to ``<root>/run.json`` unless it is there already."""
    if read_run_id(root) != run_id:
        write_run_id(root, run_id)


def delete_run(root: Path) -> None:
    """Delete every ``step-<N>`` and ``*.tmp`` folder and ``run.json`` under ``root`` (markers
    first, so a crash halfway never leaves a loadable partial checkpoint)."""
    for _, path in _step_dirs(root):
        (path / MARKER).unlink(missing_ok=True)
    _remove_incomplete(root)
    (root / RUN_FILE).unlink(missing_ok=True)


def check_start(plan: StartPlan) -> str:
    """Why this rank cannot resume ``plan`` ("" when it can): the checkpoint must be complete
    here, at the same step and of the same run. Reads files only; see ``verify_start``."""
    if plan.path is None:
        return ""
    path = Path(plan.path)
    if not (path / MARKER).is_file():
        return f"{path} is not complete here"
    try:
        meta = json.loads((path / _META_JSON).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        return f"cannot read {path / _META_JSON} ({exc})"
    if meta.get("step") != plan.step or meta.get("run_id", plan.run_id) != plan.run_id:
        return f"{path} holds step {meta.get('step')} of run {meta.get('run_id')}"
    return ""


def verify_start(plan: StartPlan, device: torch.device) -> None:
    """Collective: every rank checks ``check_start(plan)``; one all-reduce (MIN) of the verdicts.

    Raises UserError on every rank (so none waits in a later collective) when any rank does not
    see the checkpoint rank 0 chose, e.g. a node-local or stale --checkpoint-dir.
    """
    problem = check_start(plan)
    verdict = torch.tensor([0 if problem else 1], device=device)
    if _distributed():
        dist.all_reduce(verdict, op=dist.ReduceOp.MIN)
    if int(verdict.item()) == 1:
        return
    rank, _ = _rank_and_world()
    raise UserError(
        f"not every rank sees the checkpoint {plan.path} (step {plan.step}) that rank 0 chose "
        f"(rank {rank}: {problem or 'sees it'}); put --checkpoint-dir on a file system shared "
        "by all nodes, at the same path"
    )


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


def seed_rng(seed: str) -> None:
    """Seed the global RNGs (python, numpy if installed, torch CPU and CUDA) from a string, for
    a rank that has no saved RNG state of its own (a resume at another world size)."""
    value = random.Random(seed).getrandbits(63)
    random.seed(value)
    torch.manual_seed(value)
    numpy = _numpy()
    if numpy is not None:
        numpy.random.seed(value % 2**32)


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


def _disk_full(exc: BaseException) -> bool:
    """Whether ``exc`` (an OSError, or DCP's CheckpointException gathering every rank's
    failure) comes from ENOSPC on some rank."""
    if isinstance(exc, CheckpointException):
        return any(_disk_full(failure) for failure, _ in exc.failures.values())
    return isinstance(exc, OSError) and exc.errno == errno.ENOSPC


def _publish(tmp: Path, final: Path, step: int = -1) -> None:
    """Rename ``tmp`` to ``final`` (replacing an older copy), then write the marker."""
    if (tmp / _DCP_DIR).is_dir():
        _fsync_dir(tmp / _DCP_DIR)
    _fsync_dir(tmp)
    if final.exists():
        (final / MARKER).unlink(missing_ok=True)  # never loadable from here on
        shutil.rmtree(final)
    tmp.rename(final)
    _fsync_dir(final.parent)
    fault_point("publish", step)
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


def _every_rank_ok(ok: bool) -> bool:
    """Whether ``ok`` holds on every rank (one all-reduce MIN; just ``ok`` without a group)."""
    if not _distributed():
        return ok
    device = torch.device("cpu")
    if dist.get_backend() == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    flag = torch.tensor([int(ok)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


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
