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
import random
import re
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


SMALL = ("--model", str(REPO / "configs" / "tiny-models" / "llama" / "config.json"))
"""The hidden-64 LLaMA (48 MiB checkpoints instead of the 19.5M model's 225 MiB) for the
step-driven faults, whose moments do not depend on how long a step takes. The SIGTERM test and
the random-kill soak, whose moments are timed from outside, keep the 19.5M model: its slower
steps leave a signal room to land before the run's end."""


def _straight(sample_data: Path, output_dir: Path, *extra: str) -> Path:
    result = _run(_args(sample_data, output_dir, *extra))
    assert result.returncode == 0, result.stderr[-3000:]
    return output_dir


@pytest.fixture(scope="module")
def straight(sample_data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The uninterrupted reference run of the signal test (19.5M model)."""
    return _straight(sample_data, tmp_path_factory.mktemp("straight"))


@pytest.fixture(scope="module")
def straight_small(sample_data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The uninterrupted reference run of the injected faults (``SMALL``)."""
    return _straight(sample_data, tmp_path_factory.mktemp("straight-small"), *SMALL)


def _assert_same_run(got: Path, expected: Path, steps: int = STEPS) -> None:
    """Same loss at every step and bit-identical final weights."""
    assert _losses(got) == _losses(expected)
    assert sorted(_losses(got)) == list(range(1, steps + 1))
    want = load_file(expected / "final_model" / "model.safetensors")
    have = load_file(got / "final_model" / "model.safetensors")
    assert have.keys() == want.keys()
    assert all(have[name].equal(tensor) for name, tensor in want.items())


@pytest.mark.timeout(1500)
def test_sigkill_at_every_point_on_either_rank_ends_bit_identical(
    sample_data: Path, tmp_path: Path, straight_small: Path
) -> None:
    faulty = tmp_path / "faulty"
    result = _run(_args(sample_data, faulty, *SMALL), ",".join(FAULTS), restarts=len(FAULTS))
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    for fault in FAULTS:
        point, rank, step = fault.split(":")
        assert f"fault injection: SIGKILL rank {rank} at {point} of step {step}" in output, fault
    assert output.count("resumed from") == len(FAULTS), output[-4000:]
    _assert_same_run(faulty, straight_small)
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
    sample_data: Path, tmp_path: Path, straight_small: Path
) -> None:
    """--checkpoint-dir on a 72 MiB tmpfs: step-2 (48 MiB) fits, step-4 does not. The run
    stops with a one-line error; step-2 stays complete; with room again, the next run resumes
    from it and logs the reference run's losses."""
    small = tmp_path / "small"
    small.mkdir()
    if not _mount_tmpfs(small, "72m"):
        pytest.skip("mounting a size-limited tmpfs needs root and mount permission")
    try:
        args = _args(sample_data, tmp_path / "out", *SMALL, "--checkpoint-dir", str(small))
        args += ["--max-steps", "4"]
        result = _run(args)
        errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
        assert result.returncode != 0 and errors, result.stderr[-3000:]
        assert "no space left on the device of --checkpoint-dir" in errors[0]
        assert sorted(p.parent.name for p in small.glob("step-*/COMPLETE")) == ["step-2"]
        assert _mount_tmpfs(small, "160m", remount=True)
        result = _run(args)
        assert result.returncode == 0, result.stderr[-3000:]
        assert f"resumed from {small / 'step-2'}" in result.stderr
        want = {step: loss for step, loss in _losses(straight_small).items() if step <= 4}
        assert _losses(tmp_path / "out") == want
    finally:
        subprocess.run(["umount", str(small)], check=False)


SOAK_KILLS = 3
SOAK_STEPS = 16
READY = re.compile(r"attempt (\d+): ready to train from step (\d+), ([\d.]+) s after")


def _soak_args(sample_data: Path, output_dir: Path) -> list[str]:
    return [*_args(sample_data, output_dir), "--max-steps", str(SOAK_STEPS)]


def _step_lines(log: Path) -> int:
    """Training step records logged since the newest attempt became ready."""
    text = log.read_text(errors="replace")
    return len(re.findall(r"\] step \d+ \| loss", text[text.rfind("ready to train") :]))


def _kill_one(proc: subprocess.Popen, log: Path, killed: set[int], rng: random.Random) -> str:
    """Wait for a new attempt's workers, then SIGKILL one at random: in start-up (a random delay
    of up to 6 s after they appear) or after 1 to 4 of its training steps."""
    deadline = time.monotonic() + TIMEOUT_S
    while len(workers := [p for p in _workers(proc.pid) if p not in killed]) < 2:
        assert proc.poll() is None, "torchrun ended before every fault was injected"
        assert time.monotonic() < deadline, "no new attempt started"
        time.sleep(0.05)
    victim = rng.choice(workers)
    if rng.random() < 0.4:
        delay = rng.uniform(0, 6)
        moment = f"start-up + {delay:.1f} s"
        time.sleep(delay)
    else:
        ready_before, steps = log.read_text().count("ready to train"), rng.randint(1, 4)
        moment = f"after {steps} steps"
        while log.read_text().count("ready to train") == ready_before or _step_lines(log) < steps:
            assert proc.poll() is None and time.monotonic() < deadline, moment
            time.sleep(0.02)
    killed.update(workers)
    os.kill(victim, signal.SIGKILL)
    return moment


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_random_sigkills_each_cost_one_restart_and_end_bit_identical(
    sample_data: Path, tmp_path: Path
) -> None:
    """SOAK_KILLS SIGKILLs of random ranks at random moments (start-up included) under plain
    torchrun (its agent's shared store) with --max-restarts equal to the kills: a restart that
    fails to reconnect would exhaust them. Every attempt that trains is ready within a minute of
    its start, and the run ends with an uninterrupted run's losses and weights, bit for bit."""
    seed = int(os.environ.get("TORCHRUN_DDP_SOAK_SEED", time.time_ns() % 10**6))
    rng, straight, faulty = random.Random(seed), tmp_path / "straight", tmp_path / "faulty"
    result = _run(_soak_args(sample_data, straight))
    assert result.returncode == 0, result.stderr[-3000:]
    log = tmp_path / "faulty.log"
    command = torchrun_command(
        _soak_args(sample_data, faulty), extra=(f"--max-restarts={SOAK_KILLS}",)
    )
    with log.open("w") as sink:
        proc = subprocess.Popen(command, cwd=REPO, env=subprocess_env(), stdout=sink, stderr=sink)
    try:
        killed: set[int] = set()
        moments = [_kill_one(proc, log, killed, rng) for _ in range(SOAK_KILLS)]
        proc.wait(timeout=TIMEOUT_S)
    finally:
        proc.kill()
    output = log.read_text()
    context = f"seed {seed}, kills {moments}:\n{output[-4000:]}"
    assert proc.returncode == 0, context
    ready = [float(m.group(3)) for m in READY.finditer(output)]
    assert ready and max(ready) < 60, context
    assert "connectFullMesh failed" not in output, context
    _assert_same_run(faulty, straight, SOAK_STEPS)
    print(f"seed {seed}, kills {moments}, attempts ready after {ready} s")  # shown with -s


@pytest.mark.slow
def test_a_silent_rank_stops_the_others_after_the_training_timeout(
    sample_data: Path, tmp_path: Path
) -> None:
    """Rank 1 frozen by SIGSTOP after step 3 keeps its sockets open, as after a power loss. Past
    the first step collectives wait --train-timeout-s (5 s here), not --timeout-s (600 s): rank
    0's all-reduce fails with gloo's 5000 ms timeout (torchrun would then end the job, after its
    30 s wait for the frozen rank: not waited for here)."""
    args = [*_args(sample_data, tmp_path / "out"), "--max-steps", "1000", "--checkpoint-every", "0"]
    args += ["--timeout-s", "600", "--train-timeout-s", "5"]
    log = tmp_path / "run.log"
    with log.open("w") as sink:
        proc = subprocess.Popen(
            torchrun_command(args), cwd=REPO, env=subprocess_env(), stdout=sink, stderr=sink
        )
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while _step_lines(log) < 3:
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.05)
        rank_1 = next(p for p in _workers(proc.pid) if b"\0RANK=1\0" in _environ(p))
        os.kill(rank_1, signal.SIGSTOP)
        stopped = time.monotonic()
        while "Timed out waiting" not in log.read_text() and proc.poll() is None:
            assert time.monotonic() - stopped < 120, log.read_text()[-3000:]
            time.sleep(0.1)
    finally:
        for pid in _workers(proc.pid):
            os.kill(pid, signal.SIGKILL)
        proc.kill()
        proc.wait(timeout=60)
    assert "Timed out waiting 5000ms" in log.read_text(), log.read_text()[-3000:]


def _environ(pid: int) -> bytes:
    return b"\0" + (Path("/proc") / str(pid) / "environ").read_bytes()
