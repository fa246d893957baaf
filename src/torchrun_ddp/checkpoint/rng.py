"""The global random number generators as per-rank checkpoint state: capture, restore, seed.

Covered: Python's ``random``, numpy's global generator (only if numpy is installed), torch's CPU
generator and the current CUDA device's (only with CUDA). The captured state is tensors and JSON
values, so it goes into ``rank-<r>.safetensors`` / ``rank-<r>.json`` without pickling.
"""

from __future__ import annotations

import importlib
import random
from collections.abc import Mapping
from types import ModuleType

import torch


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


def _numpy() -> ModuleType | None:
    """The numpy module if installed (optional: only its global RNG is checkpointed)."""
    try:
        return importlib.import_module("numpy")
    except ImportError:
        return None
