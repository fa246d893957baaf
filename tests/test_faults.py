"""Fault injection on real torchrun processes (``TORCHRUN_DDP_FAULT``, see faults.py).

One run goes through eight SIGKILLs, one per torchrun attempt: rank 0 and rank 1 each killed
mid-step, mid-checkpoint-write, between the checkpoint folder's rename and its COMPLETE marker,
and in the middle of a metrics.jsonl line. After each, torchrun --max-restarts restarts the group
and it resumes; the run must end with the losses and final weights of an uninterrupted run, bit
for bit. A full disk during a checkpoint write must leave the previous checkpoint loadable and
end with a one-line error.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from distributed_harness import REPO, TIMEOUT_S, subprocess_env, tiny_args, torchrun_command
from safetensors.torch import load_file

STEPS = 8
FAULTS = [
    "step:0:3",
    "checkpoint-write:1:4",
    "publish:0:4",
    "step:1:5",
    "metrics:0:5",
    "checkpoint-write:0:6",
    "publish:1:6",
    "metrics:1:7",
]
"""Attempt i of the faulty run kills a rank at FAULTS[i] (point:rank:step)."""


def _args(sample_data: Path, output_dir: Path, *extra: str) -> list[str]:
    """8 short steps (1 x 32 tokens per rank), a record every step, a checkpoint every 2."""
    return tiny_args(
        sample_data, output_dir,
        "--seq-length", "32", "--batch-size", "1", "--max-steps", str(STEPS),
        "--warmup-steps", "2", "--log-every", "1", "--eval-every", "0", "--eval-batches", "1",
        "--checkpoint-every", "2", *extra,
    )  # fmt: skip


def _run(args: list[str], faults: str = "", restarts: int = 0) -> subprocess.CompletedProcess:
    """torchrun with the fault list in the environment; each attempt may take TIMEOUT_S / 4."""
    env = {**subprocess_env(), "TORCHRUN_DDP_FAULT": faults} if faults else subprocess_env()
    command = torchrun_command(args, extra=(f"--max-restarts={restarts}",))
    timeout = TIMEOUT_S * (1 + restarts) / 4
    return subprocess.run(
        command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )


def _losses(output_dir: Path) -> dict[int, float]:
    lines = (output_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines) if "loss" in r}


@pytest.mark.timeout(1500)
def test_sigkill_at_every_point_on_either_rank_ends_bit_identical(
    sample_data: Path, tmp_path: Path
) -> None:
    straight, faulty = tmp_path / "straight", tmp_path / "faulty"
    result = _run(_args(sample_data, straight))
    assert result.returncode == 0, result.stderr[-3000:]
    result = _run(_args(sample_data, faulty), ",".join(FAULTS), restarts=len(FAULTS))
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    for fault in FAULTS:
        point, rank, step = fault.split(":")
        assert f"fault injection: SIGKILL rank {rank} at {point} of step {step}" in output, fault
    assert output.count("resumed from") == len(FAULTS), output[-4000:]
    assert _losses(faulty) == _losses(straight)
    assert sorted(_losses(faulty)) == list(range(1, STEPS + 1))
    want = load_file(straight / "final_model" / "model.safetensors")
    have = load_file(faulty / "final_model" / "model.safetensors")
    assert have.keys() == want.keys()
    assert all(have[name].equal(tensor) for name, tensor in want.items())
    checkpoints = faulty / "checkpoints"
    assert not list(checkpoints.glob("*.tmp"))
    assert all((path / "COMPLETE").is_file() for path in checkpoints.glob("step-*"))
