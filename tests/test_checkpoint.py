"""Exact-resume checkpoints on a real 2-rank gloo group (CPU, no mocks).

One multi-process run (module-scoped fixture) trains a tiny LLaMA in DDP with AdamW and the
project's warmup + cosine-restarts schedule, saves, trains on, then rebuilds everything from other
seeds, loads, trains the same steps and compares; it also saves a series into a second root to
check pruning, replacement of an existing step and the clean-up of crash leftovers. The other
tests read the checkpoint folders it leaves behind.
"""

from __future__ import annotations

import copy
import hashlib
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from distributed_harness import run_distributed
from torch.nn.parallel import DistributedDataParallel
from torch.optim import AdamW
from torch.optim.lr_scheduler import CosineAnnealingWarmRestarts, LinearLR, SequentialLR
from transformers import LlamaConfig, LlamaForCausalLM

from torchrun_ddp.checkpoint import (
    MARKER,
    ModelAndOptimizer,
    capture_rng_state,
    check_compatible,
    find_latest,
    load_checkpoint,
    model_fingerprint,
    read_meta,
    restore_rng_state,
    save_checkpoint,
)
from torchrun_ddp.errors import UserError

WORLD = 2
VOCAB = 64
SAVED_AT = 3  # optimizer steps before the checkpoint
MORE = 3  # steps trained after it, once straight on and once after loading


def _build(seed: int) -> tuple[DistributedDataParallel, AdamW, SequentialLR]:
    """Tiny LLaMA (tied embeddings) in DDP, AdamW with two groups, warmup + SGDR."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=32,
        tie_word_embeddings=True,
        use_cache=False,
    )
    model = DistributedDataParallel(LlamaForCausalLM(config))
    params = list(model.parameters())
    optimizer = AdamW(
        [
            {"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.1},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
        ],
        lr=1e-2,
        foreach=True,
    )
    warmup = LinearLR(optimizer, start_factor=0.25, end_factor=1.0, total_iters=1)
    cosine = CosineAnnealingWarmRestarts(optimizer, T_0=2, T_mult=2, eta_min=1e-4)
    return model, optimizer, SequentialLR(optimizer, [warmup, cosine], milestones=[2])


def _seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _train_step(model: DistributedDataParallel, optimizer: AdamW, scheduler: SequentialLR) -> None:
    """One step whose batch shape and tokens come from the python, numpy and torch RNGs."""
    length = random.randint(4, 8)
    batch = int(np.random.randint(1, 3))
    input_ids = torch.randint(0, VOCAB, (batch, length))
    model(input_ids=input_ids, labels=input_ids).loss.backward()
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)


def _draws() -> list[float]:
    return [random.random(), float(np.random.rand()), float(torch.rand(()))]


def _same(a: object, b: object) -> bool:
    """Bitwise equality of nested containers; tuples and lists are told apart."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[key], b[key]) for key in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def _per_rank(rank: int) -> dict[str, object]:
    """Per-rank state shaped like the trainer's: data position (JSON), residuals, RNG (captured
    last: drawing the residuals moves the torch RNG)."""
    compression = {
        "step": torch.tensor(SAVED_AT, dtype=torch.int64),
        "residual.0": torch.randn(7) * (rank + 1),
        "residual.1": torch.randn(2, 3, dtype=torch.bfloat16),
    }
    return {
        "data": {"epoch": 0, "tokens": [5, 6, rank], "pending": [], "rng": [3, (1, 2), None]},
        "compression": compression,
        "rng": capture_rng_state(),
    }


def _round_trip_worker(rank: int, world_size: int, root: str) -> dict[str, object]:
    checkpoints = Path(root) / "run"
    model, optimizer, scheduler = _build(seed=0)
    _seed_all(100 + rank)
    for _ in range(SAVED_AT):
        _train_step(model, optimizer, scheduler)
    per_rank = _per_rank(rank)
    shared = {"train": ModelAndOptimizer(model, optimizer), "scheduler": scheduler}
    meta = {"model": model_fingerprint(model), "vocab_size": VOCAB, "compression": "dct"}
    save_checkpoint(checkpoints, SAVED_AT, shared, per_rank, meta, keep=2)
    saved_optimizer = copy.deepcopy(optimizer.state_dict())
    saved_scheduler = copy.deepcopy(scheduler.state_dict())
    for _ in range(MORE):
        _train_step(model, optimizer, scheduler)
    straight = [p.detach().clone() for p in model.parameters()], _draws()

    model, optimizer, scheduler = _build(seed=1)
    _seed_all(999)
    shared = {"train": ModelAndOptimizer(model, optimizer), "scheduler": scheduler}
    latest = find_latest(checkpoints)
    assert latest is not None
    loaded = load_checkpoint(latest, shared)
    checks = {
        "optimizer": _same(optimizer.state_dict(), saved_optimizer),
        "scheduler": _same(scheduler.state_dict(), saved_scheduler),
        "per_rank": _same(loaded, per_rank),
    }
    restore_rng_state(loaded["rng"])
    checks["rng"] = _same(capture_rng_state(), per_rank["rng"])
    for _ in range(MORE):
        _train_step(model, optimizer, scheduler)
    resumed = [p.detach().clone() for p in model.parameters()], _draws()
    checks["params"] = _same(resumed[0], straight[0])
    checks["draws"] = resumed[1] == straight[1]
    return {"checks": checks, "pruned": _prune_series(rank, Path(root) / "series", shared)}


def _prune_series(rank: int, root: Path, shared: dict[str, object]) -> list[str]:
    """Crash leftovers, then steps 1, 2, 3 and 3 again with keep=2: what is left."""
    if rank == 0:
        (root / "step-9.tmp").mkdir(parents=True)
        (root / "step-8").mkdir()
    dist.barrier()
    for step in (1, 2, 3, 3):
        save_checkpoint(root, step, shared, {"rank": rank, "step": step}, {}, keep=2)
    return sorted(path.name for path in root.iterdir())


@pytest.fixture(scope="module")
def checkpoint_root(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[object]]:
    root = tmp_path_factory.mktemp("checkpoint")
    return root, run_distributed(_round_trip_worker, WORLD, str(root))


def test_resume_is_bit_identical(checkpoint_root: tuple[Path, list[object]]) -> None:
    for rank, result in enumerate(checkpoint_root[1]):
        failed = [name for name, ok in result["checks"].items() if not ok]
        assert not failed, f"rank {rank}: {failed} differ after resume"


def test_pruning_keeps_newest_and_replaces_same_step(
    checkpoint_root: tuple[Path, list[object]],
) -> None:
    root, results = checkpoint_root
    for result in results:
        assert result["pruned"] == ["step-2", "step-3"]
    assert (root / "series" / "step-3" / MARKER).is_file()


def test_checkpoint_holds_safetensors_and_json_only(
    checkpoint_root: tuple[Path, list[object]],
) -> None:
    step = checkpoint_root[0] / "run" / f"step-{SAVED_AT}"
    files = [path for path in step.rglob("*") if path.is_file()]
    names = {path.relative_to(step).as_posix() for path in files}
    expected = {"meta.json", "shared.json", MARKER}
    expected |= {f"rank-{r}.{suffix}" for r in range(WORLD) for suffix in ("json", "safetensors")}
    assert expected <= names
    assert any(name.startswith("dcp/") and name.endswith(".safetensors") for name in names)
    suffixes = (".json", ".safetensors")
    odd = [name for name in names if name != MARKER and not name.endswith(suffixes)]
    assert not odd, f"files that are neither safetensors nor JSON: {odd}"
    assert read_meta(step)["step"] == SAVED_AT
    assert read_meta(step)["world_size"] == WORLD


def test_find_latest_skips_incomplete_folders(
    checkpoint_root: tuple[Path, list[object]], tmp_path: Path
) -> None:
    root = tmp_path / "copy"
    shutil.copytree(checkpoint_root[0] / "run", root)
    complete = root / f"step-{SAVED_AT}"
    shutil.copytree(complete, root / "step-7")
    (root / "step-7" / MARKER).unlink()
    shutil.copytree(complete, root / "step-9.tmp")
    assert find_latest(root) == complete
    assert find_latest(tmp_path / "missing") is None
    with pytest.raises(UserError, match="no COMPLETE marker"):
        read_meta(root / "step-7")


def _digests(folder: Path) -> dict[str, str]:
    return {
        str(path): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(folder.rglob("*"))
        if path.is_file()
    }


def test_incompatible_checkpoint_is_refused_and_untouched(
    checkpoint_root: tuple[Path, list[object]],
) -> None:
    step = checkpoint_root[0] / "run" / f"step-{SAVED_AT}"
    before = _digests(step)
    saved = read_meta(step)
    fingerprint = dict(saved["model"])
    fingerprint["model.norm.weight"] = "float32[32]"
    current = {"world_size": WORLD, "model": saved["model"], "compression": "dct"}
    check_compatible(saved, current)
    cases = {
        "model": (fingerprint, "'model.norm.weight'"),
        "world_size": (4, "is 2 in the checkpoint, 4 here"),
        "compression": ("powersgd", '"dct" in the checkpoint, "powersgd" here'),
    }
    for key, (value, detail) in cases.items():
        with pytest.raises(UserError) as info:
            check_compatible(saved, {**current, key: value})
        message = str(info.value)
        assert "\n" not in message
        assert key in message and detail in message and "--no-resume" in message
    with pytest.raises(UserError, match="world_size is 2 in the checkpoint, 1 here"):
        load_checkpoint(step, {})  # this process is one rank without a process group
    assert _digests(step) == before


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_single_process_without_group_round_trips(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    optimizer = AdamW(model.parameters(), lr=0.1)
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    path = save_checkpoint(tmp_path, 1, {"train": ModelAndOptimizer(model, optimizer)}, {}, {}, 1)
    fresh = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    fresh_optimizer = AdamW(fresh.parameters(), lr=0.1)
    assert load_checkpoint(path, {"train": ModelAndOptimizer(fresh, fresh_optimizer)}) == {}
    assert _same(fresh.state_dict(), model.state_dict())
    assert _same(fresh_optimizer.state_dict(), optimizer.state_dict())
