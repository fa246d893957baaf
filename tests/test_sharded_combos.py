"""hsdp with what it used to refuse, on 2 gloo ranks (2 replicas of 1 shard, or 1 of 2):
DiLoCo and DeMo with --overlap-exchange (the exchange in flight across steps, in a group of the
replicas' own), and SparseLoCo resumed on another mesh at the same world size (its inner
AdamW state re-split to the new shards)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import cast

import pytest
import torch
from distributed_harness import accumulating_args, logged_losses, logged_steps, run_distributed
from tiny_models import comm_bytes, digest, train_in_group

from torchrun_ddp.checkpoint import load_rank_states
from torchrun_ddp.compression.replicas import local_shard

pytestmark = pytest.mark.slow  # trains on 2 spawned ranks

STEPS, STOP = 6, 4
OVERLAP = ("--optimizer", "diloco", "--local-steps", "3", "--zero1", "false", "--overlap-exchange")
"""DiLoCo syncing every 3 steps, each sync applied a window later (step 4, the checkpoint,
falls inside the second window with the first sync in flight)."""
SPARSE = ("--optimizer", "sparseloco", "--local-steps", "3", "--zero1", "false")
"""SparseLoCo syncing every 3 steps (step 4, the checkpoint, falls inside a window)."""

InnerState = dict[int, dict[str, torch.Tensor]]
"""Parameter position -> the inner AdamW's state tensors (this rank's shards)."""


def _args(data: Path, output: Path, *extra: str) -> list[str]:
    """The hidden-64 LLaMA, STEPS steps of 2 micro-batches of 2 x 16 tokens per rank."""
    return accumulating_args(data, output, STEPS, STOP, *extra)


def _hsdp(degree: int) -> tuple[str, ...]:
    return ("--data-parallel", "hsdp", "--shard-degree", str(degree))


def _inner_state(trainer: object) -> InnerState:
    """This rank's inner AdamW state, as local shards."""
    inner = trainer.method.local_updates.inner.state_dict()["state"]  # type: ignore[attr-defined]
    return {
        int(index): {key: local_shard(value).clone() for key, value in values.items()}
        for index, values in inner.items()
    }


def _overlap_worker(rank: int, world_size: int, data: str, root: Path) -> dict[str, str]:
    """DiLoCo --overlap-exchange under hsdp (2 x 1): uninterrupted, and resumed from its
    checkpoint of step STOP (a sync in flight; stopping at --max-steps would apply it, as the
    end of training does); under ddp for the reference losses. The shards' digests."""
    out = {}
    modes = {"hsdp": _hsdp(1), "ddp": ("--data-parallel", "ddp")}
    for name, extra in modes.items():
        trainer = train_in_group(rank, world_size, _args(Path(data), root / name, *OVERLAP, *extra))
        out[name] = digest({n: local_shard(p) for n, p in trainer.model.named_parameters()})
        demo = ("--optimizer", "demo", "--zero1", "false", "--overlap-exchange", *extra)
        train_in_group(rank, world_size, _args(Path(data), root / f"demo-{name}", *demo))
    step = root / "hsdp" / "checkpoints" / f"step-{STOP}"
    argv = _args(Path(data), root / "resumed", *OVERLAP, *_hsdp(1), "--resume-from", str(step))
    trainer = train_in_group(rank, world_size, argv)
    out["resumed"] = digest({n: local_shard(p) for n, p in trainer.model.named_parameters()})
    return out


def _mesh_worker(rank: int, world_size: int, data: str, root: Path) -> dict[str, InnerState]:
    """SparseLoCo on 2 x 1 stopped at STOP; its checkpoint resumed on 1 x 2 without training
    (the inner state as loaded) and then on to STEPS; that run's last checkpoint resumed on
    2 x 1 without training."""
    out = {}
    argv = _args(Path(data), root / "2x1", *SPARSE, *_hsdp(1), "--max-steps", str(STOP))
    train_in_group(rank, world_size, argv)
    step = root / "2x1" / "checkpoints" / f"step-{STOP}"
    resumed = _args(Path(data), root / "1x2", *SPARSE, *_hsdp(2), "--resume-from", str(step))
    trainer = train_in_group(rank, world_size, [*resumed, "--max-steps", str(STOP)], export=False)
    out["1x2"] = _inner_state(trainer)
    train_in_group(rank, world_size, resumed)
    step = root / "1x2" / "checkpoints" / f"step-{STEPS}"
    back = _args(Path(data), root / "back", *SPARSE, *_hsdp(1), "--resume-from", str(step))
    trainer = train_in_group(rank, world_size, [*back, "--max-steps", str(STEPS)], export=False)
    out["2x1"] = _inner_state(trainer)
    return out


def _saved_inner(step: Path, rank: int) -> InnerState:
    """Old rank ``rank``'s inner AdamW state as its checkpoint files hold it."""
    state = cast(Mapping[str, Mapping[str, object]], load_rank_states(step, "optimizer", [rank])[0])
    inner = cast(Mapping[str, Mapping[str, torch.Tensor]], state["inner"]["state"])
    return {int(index): dict(values) for index, values in inner.items()}


def test_overlapped_diloco_under_hsdp_is_ddps_and_resumes_exactly(
    sample_data: Path, tmp_path: Path
) -> None:
    """DiLoCo with --overlap-exchange under hsdp, one rank per replica, is DDP's with the same
    flags (each replica a worker): the same losses to fp32 tolerance, the exchange sent in the
    sync steps only. Its checkpoint of step 4, a sync in flight, resumes bit for bit. DeMo
    overlapped under hsdp logs the overlapped DDP run's losses too."""
    results = run_distributed(_overlap_worker, 2, str(sample_data), tmp_path, timeout=600)
    ddp, sharded = logged_losses(tmp_path / "ddp"), logged_losses(tmp_path / "hsdp")
    assert sorted(ddp) == sorted(sharded) == list(range(1, STEPS + 1))
    for step in ddp:
        assert sharded[step] == pytest.approx(ddp[step], rel=1e-4), step
    resumed = logged_losses(tmp_path / "resumed")
    assert resumed == {step: sharded[step] for step in range(STOP + 1, STEPS + 1)}
    assert [r["resumed"] for r in results] == [r["hsdp"] for r in results]
    wire = [wire for wire, _ in comm_bytes(tmp_path / "hsdp")]
    assert [step for step, sent in enumerate(wire, 1) if sent] == [3, 6], wire
    demo_ddp, demo = logged_losses(tmp_path / "demo-ddp"), logged_losses(tmp_path / "demo-hsdp")
    assert sorted(demo) == list(range(1, STEPS + 1))
    for step in demo_ddp:  # DeMo overlapped too: each update lands a step late, as under ddp
        assert demo[step] == pytest.approx(demo_ddp[step], rel=1e-4), step


def test_sparseloco_under_hsdp_resumes_on_another_mesh(sample_data: Path, tmp_path: Path) -> None:
    """A SparseLoCo checkpoint of 2 replicas of 1 shard resumed as 1 replica of 2 shards: each
    rank's inner AdamW state is its half (``torch.chunk`` rows, as FSDP2 splits) of replica
    0's; trained on to step 6 and resumed back as 2 x 1, each rank's is the whole of the
    shards, joined. Both runs train on (losses logged at every step)."""
    results = cast(
        list[dict[str, InnerState]],
        run_distributed(_mesh_worker, 2, str(sample_data), tmp_path, timeout=600),
    )
    old = _saved_inner(tmp_path / "2x1" / "checkpoints" / f"step-{STOP}", 0)
    for rank, result in enumerate(results):
        assert result["1x2"].keys() == old.keys()
        for index, values in old.items():
            for key, value in values.items():
                got = result["1x2"][index][key]
                want = value if value.dim() == 0 else torch.chunk(value, 2)[rank]
                assert torch.equal(got, want), (rank, index, key)
    halves = [_saved_inner(tmp_path / "1x2" / "checkpoints" / f"step-{STEPS}", r) for r in (0, 1)]
    for result in results:
        for index, values in halves[0].items():
            for key, value in values.items():
                want = value if value.dim() == 0 else torch.cat([h[index][key] for h in halves])
                assert torch.equal(result["2x1"][index][key], want), (index, key)
    assert logged_steps(tmp_path / "1x2") == list(range(STOP + 1, STEPS + 1))
    assert logged_steps(tmp_path / "2x1") == list(range(1, STOP + 1))
