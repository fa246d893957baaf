"""How checkpoint state becomes files: a nested state tree split into a JSON skeleton and a flat
``{key: tensor}`` map (and joined back), and durable (fsynced) writes of bytes and JSON.

A tensor in the tree becomes ``{"__tensor__": key}`` (``key``: its path, ``a/b/0``) and a tuple
``{"__tuple__": [...]}``, so the skeleton is plain JSON and tuples come back as tuples. Nothing is
pickled.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path

import torch

from torchrun_ddp.parallel.shards import local_tensor

TENSOR = "__tensor__"
TUPLE = "__tuple__"
_SCALARS = frozenset({int, float, str, bool, type(None)})
"""JSON scalar types, exactly (a subclass such as a numpy scalar goes the long way)."""


def split_tree(tree: object, path: str, tensors: dict[str, torch.Tensor]) -> object:
    """JSON-able copy of ``tree`` with tensors replaced by ``{"__tensor__": path}`` placeholders
    and collected in ``tensors``; tuples become ``{"__tuple__": [...]}``.

    Raises ValueError when two tensors map to one key, TypeError for a non-string key or a value
    that is neither a tensor nor JSON."""
    if isinstance(tree, torch.Tensor):
        if path in tensors:
            raise ValueError(f"two tensors map to the checkpoint key {path!r}")
        tensors[path] = tree
        return {TENSOR: path}
    if isinstance(tree, Mapping):
        out: dict[str, object] = {}
        for key, value in tree.items():
            if not isinstance(key, str) or key in (TENSOR, TUPLE):
                raise TypeError(f"cannot save the key {key!r} under {path!r}: use string keys")
            out[key] = split_tree(value, f"{path}/{key}" if path else key, tensors)
        return out
    if isinstance(tree, list | tuple):
        if all(type(value) in _SCALARS for value in tree):  # a data position's token ids
            items = list(tree)
            return {TUPLE: items} if isinstance(tree, tuple) else items
        items = [split_tree(value, f"{path}/{index}", tensors) for index, value in enumerate(tree)]
        return {TUPLE: items} if isinstance(tree, tuple) else items
    if tree is None or isinstance(tree, bool | int | float | str):
        return tree
    raise TypeError(f"cannot save a {type(tree).__name__} at {path!r}: not a tensor or JSON value")


def join_tree(tree: object, tensors: Mapping[str, torch.Tensor]) -> object:
    """Inverse of ``split_tree``: put the tensors back and turn tuple records into tuples."""
    if isinstance(tree, list):
        return [join_tree(value, tensors) for value in tree]
    if not isinstance(tree, dict):
        return tree
    if set(tree) == {TENSOR}:
        return tensors[tree[TENSOR]]
    if set(tree) == {TUPLE}:
        return tuple(join_tree(value, tensors) for value in tree[TUPLE])
    return {key: join_tree(value, tensors) for key, value in tree.items()}


def tensor_keys(tree: object) -> set[str]:
    """The placeholder keys in a ``split_tree`` result."""
    if isinstance(tree, list):
        return set().union(*(tensor_keys(value) for value in tree))
    if not isinstance(tree, dict):
        return set()
    if set(tree) == {TENSOR}:
        return {tree[TENSOR]}
    return set().union(*(tensor_keys(value) for value in tree.values()))


def untied(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Detached tensors, cloning any that share memory with an earlier one (tied weights):
    safetensors refuses to write shared storage. A DTensor (a shard of FSDP's) is compared by
    its local shard."""
    seen: set[tuple[str, int]] = set()
    out: dict[str, torch.Tensor] = {}
    for key, tensor in tensors.items():
        local = local_tensor(tensor)
        storage = (str(local.device), local.untyped_storage().data_ptr())
        out[key] = tensor.detach().clone() if storage in seen else tensor.detach()
        seen.add(storage)
    return out


def write_bytes(path: Path, data: bytes) -> str:
    """Write ``data`` to ``path`` and fsync it; returns the SHA-256 (hex) of what was written,
    hashed while writing (a checkpoint's manifest). Raises OSError when it cannot be written."""
    with path.open("wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    return hashlib.sha256(data).hexdigest()


def write_json(path: Path, value: object) -> str:
    """Write ``value`` as JSON to ``path`` and fsync it; returns the SHA-256 (hex) of the bytes
    written. Raises TypeError for a non-JSON value."""
    return write_bytes(path, json.dumps(value).encode())


def fsync_dir(folder: Path) -> None:
    """fsync the folder itself, so that renames and new entries in it survive a crash."""
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
