"""Fault injection on real torchrun processes (``TORCHRUN_DDP_FAULT``, see faults.py).

One run goes through four SIGKILLs, one per torchrun attempt, each point once with the ranks
alternating: mid-step (rank 0), mid-checkpoint-write (rank 1), in the middle of a metrics.jsonl line
(rank 0), and between the checkpoint folder's rename and its COMPLETE marker (rank 1). After each,
torchrun --max-restarts restarts the group and it resumes; the run must end with the losses and
final weights of an uninterrupted run, bit for bit. A full disk during a checkpoint write must leave
the previous checkpoint loadable and end with a one-line error.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from distributed_harness import REPO, TIMEOUT_S, subprocess_env, tiny_args, torchrun_command
from safetensors.torch import load_file
from test_resume import _workers

pytestmark = pytest.mark.slow  # SIGKILL and SIGTERM of torchrun workers, with restarts

STEPS = 8
FAULTS = [
    "step:0:3",
    "checkpoint-write:1:4",
    "metrics:0:5",
    "publish:1:6",
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


@pytest.fixture(scope="module")
def straight(sample_data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The uninterrupted reference run, shared by the fault cases."""
    output_dir = tmp_path_factory.mktemp("straight")
    result = _run(_args(sample_data, output_dir))
    assert result.returncode == 0, result.stderr[-3000:]
    return output_dir


def _assert_same_run(got: Path, expected: Path) -> None:
    """Same loss at every step and bit-identical final weights."""
    assert _losses(got) == _losses(expected)
    assert sorted(_losses(got)) == list(range(1, STEPS + 1))
    want = load_file(expected / "final_model" / "model.safetensors")
    have = load_file(got / "final_model" / "model.safetensors")
    assert have.keys() == want.keys()
    assert all(have[name].equal(tensor) for name, tensor in want.items())


@pytest.mark.timeout(1500)
def test_sigkill_at_every_point_on_either_rank_ends_bit_identical(
    sample_data: Path, tmp_path: Path, straight: Path
) -> None:
    faulty = tmp_path / "faulty"
    result = _run(_args(sample_data, faulty), ",".join(FAULTS), restarts=len(FAULTS))
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    for fault in FAULTS:
        point, rank, step = fault.split(":")
        assert f"fault injection: SIGKILL rank {rank} at {point} of step {step}" in output, fault
    assert output.count("resumed from") == len(FAULTS), output[-4000:]
    _assert_same_run(faulty, straight)
    checkpoints = faulty / "checkpoints"
    assert not list(checkpoints.glob("*.tmp"))
    assert all((path / "COMPLETE").is_file() for path in checkpoints.glob("step-*"))


def _wait_for_losses(output_dir: Path, count: int, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while not (output_dir / "metrics.jsonl").is_file() or len(_losses(output_dir)) < count:
        assert proc.poll() is None, "the run ended before the signal was sent"
        assert time.monotonic() < deadline, "timed out waiting for the run"
        time.sleep(0.01)


def test_sigterm_exits_143_and_torchrun_restarts_the_group_which_resumes(
    sample_data: Path, tmp_path: Path, straight: Path
) -> None:
    """A worker stopped by SIGTERM saves a checkpoint and exits 143 (128 + SIGTERM), not 0.
    Alone (no torchrun) that is the process's status. Under torchrun --max-restarts=1 a 143 is a
    failed worker: torchrun restarts the whole group, which resumes and finishes (status 0)."""
    alone = tmp_path / "alone"
    command = [sys.executable, str(REPO / "train.py"), *_args(sample_data, alone)]
    proc = subprocess.Popen(command, cwd=REPO, env=subprocess_env(), stderr=subprocess.PIPE)
    try:
        _wait_for_losses(alone, 1, proc)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 143
    finally:
        proc.kill()
    assert list((alone / "checkpoints").glob("step-*/COMPLETE"))
    grouped = tmp_path / "grouped"
    command = torchrun_command(_args(sample_data, grouped), extra=("--max-restarts=1",))
    proc = subprocess.Popen(
        command, cwd=REPO, env=subprocess_env(), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        _wait_for_losses(grouped, 2, proc)
        os.kill(_workers(proc.pid)[-1], signal.SIGTERM)
        output = proc.communicate(timeout=TIMEOUT_S)[0]
    finally:
        proc.kill()
    assert proc.returncode == 0, output[-4000:]
    assert "stopped by a signal" in output and "resumed from" in output, output[-4000:]
    _assert_same_run(grouped, straight)


def _mount_tmpfs(folder: Path, size: str, remount: bool = False) -> bool:
    """Mount (or resize) a tmpfs of ``size`` at ``folder``; False where that is not permitted."""
    options = f"remount,size={size}" if remount else f"size={size}"
    command = ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(folder)]
    return os.geteuid() == 0 and subprocess.run(command, check=False).returncode == 0


def test_a_full_disk_during_a_checkpoint_write_keeps_the_previous_checkpoint(
    sample_data: Path, tmp_path: Path, straight: Path
) -> None:
    """--checkpoint-dir on a 340 MiB tmpfs: step-2 (225 MiB) fits, step-4 does not. The run
    stops with a one-line error; step-2 stays complete; with room again, the next run resumes
    from it and logs the reference run's losses."""
    small = tmp_path / "small"
    small.mkdir()
    if not _mount_tmpfs(small, "340m"):
        pytest.skip("mounting a size-limited tmpfs needs root and mount permission")
    try:
        args = _args(sample_data, tmp_path / "out", "--checkpoint-dir", str(small))
        args += ["--max-steps", "4"]
        result = _run(args)
        errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
        assert result.returncode != 0 and errors, result.stderr[-3000:]
        assert "no space left on the device of --checkpoint-dir" in errors[0]
        assert sorted(p.parent.name for p in small.glob("step-*/COMPLETE")) == ["step-2"]
        assert _mount_tmpfs(small, "800m", remount=True)
        result = _run(args)
        assert result.returncode == 0, result.stderr[-3000:]
        assert f"resumed from {small / 'step-2'}" in result.stderr
        want = {step: loss for step, loss in _losses(straight).items() if step <= 4}
        assert _losses(tmp_path / "out") == want
    finally:
        subprocess.run(["umount", str(small)], check=False)
