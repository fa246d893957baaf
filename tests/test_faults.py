"""Fault injection on real torchrun processes (``TORCHRUN_DDP_FAULT``, see faults.py) and signals.
The torchrun runs go through ``forked_torchrun.py`` (torchrun's agent, its ranks forks of it with
the trainer imported), so that each of the many restarts takes seconds, not an interpreter's
imports.

Every run uses the one reference config (``distributed_harness.reference_args``) and is compared
with its uninterrupted run, conftest.py's session fixture ``reference_run``: the same loss at every
step and bit-identical final weights.

One run goes through four SIGKILLs, one per torchrun attempt, each point once with the ranks
alternating: mid-step (rank 0), mid-checkpoint-write (rank 1), in the middle of a metrics.jsonl line
(rank 0), and between the checkpoint folder's rename and its COMPLETE marker (rank 1). After each,
torchrun --max-restarts restarts the group and it resumes from the newest complete checkpoint. A
SIGTERM saves a checkpoint and stops (alone: status 143; the agent's: the next run resumes; a
worker's: torchrun restarts the group). A full disk during a checkpoint write must leave the
previous checkpoint loadable and end with a one-line error, and a frozen rank must stop the
others after --train-timeout-s: these two run on spawned ranks (the trainer's concern, not the
launcher's).
"""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from distributed_harness import (
    REFERENCE_STEPS,
    REPO,
    TIMEOUT_S,
    Agent,
    assert_logged_once,
    assert_same_run,
    hook_env,
    logged_losses,
    logged_steps,
    reference_args,
    run_agent,
    run_distributed,
    start_agent,
    subprocess_env,
    torchrun_command,
    worker_pids,
)
from tiny_models import LogLines, train_in_group

from torchrun_ddp.checkpoint import save_load
from torchrun_ddp.checkpoint.manifest import Entry
from torchrun_ddp.errors import UserError

pytestmark = pytest.mark.slow  # SIGKILL and SIGTERM of torchrun workers, with restarts

FAULTS = [
    "step:0:3",
    "checkpoint-write:1:4",
    "metrics:0:5",
    "publish:1:6",
]
"""Attempt i of the faulty run kills a rank at FAULTS[i] (point:rank:step)."""


def _run(args: list[str], faults: str = "", restarts: int = 0) -> subprocess.CompletedProcess:
    """torchrun with the fault list in the environment; each attempt may take TIMEOUT_S / 4."""
    env = hook_env(faults=faults) if faults else subprocess_env()
    command = torchrun_command(args, extra=(f"--max-restarts={restarts}",), forked=True)
    return run_agent(command, env, TIMEOUT_S * (1 + restarts) / 4)


@pytest.mark.timeout(1500)
def test_sigkill_at_every_point_on_either_rank_ends_bit_identical(
    sample_data: Path, tmp_path: Path, reference_run: Path
) -> None:
    """The kill in the checkpoint write of step 4 leaves step-4 a temporary folder: the restart
    ignores it and resumes from step-2, the newest complete checkpoint (this also holds what
    test_resume's external SIGKILL during a checkpoint write checked)."""
    faulty = tmp_path / "faulty"
    result = _run(reference_args(sample_data, faulty), ",".join(FAULTS), restarts=len(FAULTS))
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    for fault in FAULTS:
        point, rank, step = fault.split(":")
        assert f"fault injection: SIGKILL rank {rank} at {point} of step {step}" in output, fault
    checkpoints = faulty / "checkpoints"
    resumed = re.findall(r"resumed from (\S+) at step", output)
    assert len(resumed) == len(FAULTS), output[-4000:]
    assert resumed[:2] == [str(checkpoints / "step-2")] * 2, resumed
    assert_same_run(faulty, reference_run, REFERENCE_STEPS)
    assert not list(checkpoints.glob("*.tmp"))
    assert all((path / "COMPLETE").is_file() for path in checkpoints.glob("step-*"))


def _wait_for(condition: Callable[[], bool], proc: Agent) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while not condition():
        assert proc.poll() is None, "the run ended before the event the test waits for"
        assert time.monotonic() < deadline, "timed out waiting for the run"
        time.sleep(0.01)


def _complete(root: Path) -> list[str]:
    return sorted(p.parent.name for p in root.glob("step-*/COMPLETE"))


def _sigint_alone(sample_data: Path, output_dir: Path) -> None:
    """train.py alone (no torchrun) trains as one process (world_size 1); SIGINT (Ctrl-C)
    after its first step stops it as SIGTERM does: status 143, a checkpoint, every step until
    then logged once. (SIGTERM is sent to a worker and to the agent below.)"""
    command = [sys.executable, str(REPO / "train.py"), *reference_args(sample_data, output_dir)]
    proc = subprocess.Popen(
        command, cwd=REPO, env=subprocess_env(), stderr=subprocess.PIPE, text=True
    )
    try:
        _wait_for(lambda: len(logged_losses(output_dir)) >= 1, proc)
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 143, stderr[-3000:]
    assert "world_size 1" in stderr, stderr[-3000:]
    assert list((output_dir / "checkpoints").glob("step-*/COMPLETE"))
    assert_logged_once(output_dir, len(logged_steps(output_dir)))


def _popen(args: list[str], log: Path, restarts: int = 0) -> Agent:
    command = torchrun_command(args, extra=(f"--max-restarts={restarts}",), forked=True)
    return start_agent(command, log, subprocess_env())


def test_sigterm_or_sigint_saves_a_checkpoint_and_the_run_resumes_bit_identical(
    sample_data: Path, tmp_path: Path, reference_run: Path
) -> None:
    """A worker stopped by SIGTERM saves a checkpoint and exits 143 (128 + SIGTERM), not 0.
    Alone (no torchrun) that is the process's status, for SIGINT (Ctrl-C) too. The torchrun
    agent's SIGTERM (a scheduler's preemption) reaches the workers: with --checkpoint-every 0
    they save exactly one checkpoint, at the step they stopped, and the next run resumes from
    it. Under torchrun --max-restarts=1
    a worker's 143 is a failed worker: torchrun restarts the whole group, which resumes and
    finishes (status 0) with the reference run's losses and weights, bit for bit."""
    _sigint_alone(sample_data, tmp_path / "alone")
    out, log = tmp_path / "grouped", tmp_path / "grouped.log"
    args = reference_args(sample_data, out, "--checkpoint-every", "0")
    proc = _popen(args, log)
    try:
        _wait_for(lambda: len(logged_losses(out)) >= 3, proc)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
    finally:
        proc.kill()
    saved = _complete(out / "checkpoints")
    assert len(saved) == 1, log.read_text()[-4000:]
    stopped_at = int(saved[0].removeprefix("step-"))
    assert 3 <= stopped_at < REFERENCE_STEPS - 2, log.read_text()[-4000:]
    proc = _popen(args, log, restarts=1)
    try:
        _wait_for(lambda: max(logged_losses(out), default=0) > stopped_at, proc)
        os.kill(worker_pids(proc.pid)[-1], signal.SIGTERM)
        proc.wait(timeout=TIMEOUT_S)
    finally:
        proc.kill()
    output = log.read_text()
    assert proc.returncode == 0, output[-4000:]
    assert f"at step {stopped_at}" in output and "stopped by a signal" in output, output[-4000:]
    assert output.count("resumed from") == 2, output[-4000:]
    assert_same_run(out, reference_run, REFERENCE_STEPS)


def _mount_tmpfs(folder: Path, size: str, remount: bool = False) -> bool:
    """Mount (or resize) a tmpfs of ``size`` at ``folder``; False where that is not permitted."""
    options = f"remount,size={size}" if remount else f"size={size}"
    command = ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(folder)]
    return os.geteuid() == 0 and subprocess.run(command, check=False).returncode == 0


def _mebibytes(folder: Path) -> int:
    """The size of the files under ``folder``, in MiB (rounded up)."""
    return -(-sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) // 2**20)


def _refusal(rank: int, world_size: int, args: list[str]) -> str:
    """Train ``args`` on this spawned rank, which must stop with a UserError: its message."""
    with pytest.raises(UserError) as caught:
        train_in_group(rank, world_size, args)
    return str(caught.value)


def _resume_worker(rank: int, world_size: int, args: list[str]) -> list[str]:
    """Train ``args`` on this spawned rank (a resume, where its folder has a checkpoint): the
    log lines."""
    with LogLines() as log:
        train_in_group(rank, world_size, args)
    return log.lines


def test_a_full_disk_during_a_checkpoint_write_keeps_the_previous_checkpoint(
    sample_data: Path, tmp_path: Path, reference_run: Path
) -> None:
    """(Needs root to mount a tmpfs: skipped elsewhere; the unprivileged variant is below.)
    --checkpoint-dir on a tmpfs of 1.5 checkpoints (the reference run's, about 48 MiB):
    step-2 fits, step-4 does not. Every rank stops with the same one-line error (train.py
    prints a UserError as one ``error:`` line with status 2: tests/test_cli.py); step-2 stays
    complete; with room again, the next run resumes from it and logs the reference run's
    losses. Spawned ranks: the disk is the trainer's concern, not the launcher's."""
    one = _mebibytes(max((reference_run / "checkpoints").glob("step-*")))
    small = tmp_path / "small"
    small.mkdir()
    if not _mount_tmpfs(small, f"{one * 3 // 2}m"):
        pytest.skip("mounting a size-limited tmpfs needs root and mount permission")
    try:
        args = reference_args(sample_data, tmp_path / "out", "--checkpoint-dir", str(small))
        args += ["--max-steps", "4"]
        errors = run_distributed(_refusal, 2, args)
        assert all(
            error.startswith("no space left on the device of --checkpoint-dir") for error in errors
        ), errors
        assert not any("\n" in error for error in errors)
        assert sorted(p.parent.name for p in small.glob("step-*/COMPLETE")) == ["step-2"]
        assert _mount_tmpfs(small, f"{one * 4}m", remount=True)
        lines = run_distributed(_resume_worker, 2, args)[0]
        assert f"resumed from {small / 'step-2'} at step 2" in lines, lines
        want = {step: loss for step, loss in logged_losses(reference_run).items() if step <= 4}
        assert logged_losses(tmp_path / "out") == want
        assert_logged_once(tmp_path / "out", 4)
    finally:
        subprocess.run(["umount", str(small)], check=False)


def _full_rank_file(rank: int, world_size: int, args: list[str]) -> dict[str, object]:
    """Unprivileged full disk: rank 1's own file of step 4 is written to /dev/full, whose writes
    fail with the kernel's ENOSPC (the path to write is redirected in this rank, the write and
    its error are real); the other ranks write theirs. Then, with the device back, the same
    args resume. The one-line refusal and the resumed run's log lines."""
    write = save_load._write

    def full_at_step_4(folder: Path, name: str, data: bytes, entries: dict[str, Entry]) -> None:
        if folder.name != "step-4.tmp" or rank != 1:
            return write(folder, name, data, entries)
        with open("/dev/full", "wb") as device:
            device.write(data)
            device.flush()
        return None

    save_load._write = full_at_step_4
    try:
        error = _refusal(rank, world_size, args)
    finally:
        save_load._write = write
    return {"error": error, "lines": _resume_worker(rank, world_size, args)}


def test_a_write_that_fails_with_enospc_keeps_the_previous_checkpoint(
    sample_data: Path, tmp_path: Path, reference_run: Path
) -> None:
    """The full-disk test without root or a tmpfs (it runs in CI): one rank's checkpoint file
    of step 4 hits ENOSPC (/dev/full). Every rank stops with the same one-line error, step-2
    stays the newest complete step, and the next start resumes it and logs the reference run's
    losses, each step once."""
    out, folder = tmp_path / "out", tmp_path / "ckpt"
    args = reference_args(sample_data, out, "--checkpoint-dir", str(folder), "--max-steps", "4")
    results = run_distributed(_full_rank_file, 2, args)
    errors = [str(r["error"]) for r in results]
    assert len(set(errors)) == 1 and "\n" not in errors[0], errors
    assert errors[0].startswith(f"no space left on the device of --checkpoint-dir {folder}")
    assert f"resumed from {folder / 'step-2'} at step 2" in results[0]["lines"]
    want = {step: loss for step, loss in logged_losses(reference_run).items() if step <= 4}
    assert logged_losses(out) == want
    assert_logged_once(out, 4)
    assert _complete(folder) == ["step-2", "step-4"]


SOAK_KILLS = 3
READY = re.compile(r"attempt (\d+): ready to train from step (\d+), ([\d.]+) s after")


def _step_lines(log: Path) -> int:
    """Training step records logged since the newest attempt became ready."""
    text = log.read_text(errors="replace")
    return len(re.findall(r"\] step \d+ \| loss", text[text.rfind("ready to train") :]))


def _kill_one(proc: Agent, log: Path, killed: set[int], rng: random.Random) -> str:
    """Wait for a new attempt's workers, then SIGKILL one at random: in start-up (a random delay
    of up to 2 s after they appear; a forked rank is ready in about 2) or after 1 to 4 of its
    training steps."""
    deadline = time.monotonic() + TIMEOUT_S
    while len(workers := [p for p in worker_pids(proc.pid) if p not in killed]) < 2:
        assert proc.poll() is None, "torchrun ended before every fault was injected"
        assert time.monotonic() < deadline, "no new attempt started"
        time.sleep(0.05)
    victim = rng.choice(workers)
    if rng.random() < 0.4:
        delay = rng.uniform(0, 2)
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


@pytest.mark.timeout(1500)
def test_random_sigkills_each_cost_one_restart_and_end_bit_identical(
    sample_data: Path, tmp_path: Path, reference_run: Path
) -> None:
    """SOAK_KILLS SIGKILLs of random ranks at random moments (start-up included) under torchrun
    with its default store (the agent's, shared with the workers) and --max-restarts equal to
    the kills: a restart that fails to reconnect would exhaust them. Every attempt that trains
    is ready within a minute of its start, and the run ends with an uninterrupted run's losses
    and weights, bit for bit."""
    seed = int(os.environ.get("TORCHRUN_DDP_SOAK_SEED", time.time_ns() % 10**6))
    rng, faulty, log = random.Random(seed), tmp_path / "faulty", tmp_path / "faulty.log"
    proc = _popen(reference_args(sample_data, faulty), log, restarts=SOAK_KILLS)
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
    assert_same_run(faulty, reference_run, REFERENCE_STEPS)
    print(f"seed {seed}, kills {moments}, attempts ready after {ready} s")  # shown with -s


def _freeze_after(output_dir: Path, steps: int) -> None:
    """Stop this process (every thread, sockets left open) once rank 0 has logged ``steps``."""
    while len(logged_losses(output_dir)) < steps:
        time.sleep(0.02)
    os.kill(os.getpid(), signal.SIGSTOP)


def _silent_rank_worker(rank: int, world_size: int, args: list[str], output_dir: str) -> None:
    """Train; rank 1 freezes itself after step 3 (a thread of its own sends the SIGSTOP)."""
    if rank == 1:
        threading.Thread(target=_freeze_after, args=(Path(output_dir), 3), daemon=True).start()
    train_in_group(rank, world_size, args)


def test_a_silent_rank_stops_the_others_after_the_training_timeout(
    sample_data: Path, tmp_path: Path
) -> None:
    """Rank 1 frozen by SIGSTOP after step 3 keeps its sockets open, as after a power loss. Past
    the first step collectives wait --train-timeout-s (5 s here), not --timeout-s (600 s): rank
    0's all-reduce fails with gloo's 5000 ms timeout (under torchrun the agent then ends the
    group). Spawned ranks: the timeout is the trainer's; the harness kills the frozen rank."""
    out = tmp_path / "out"
    args = reference_args(
        sample_data, out, "--max-steps", "1000", "--checkpoint-every", "0",
        "--timeout-s", "600", "--train-timeout-s", "5",
    )  # fmt: skip
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 0 failed") as caught:
        run_distributed(_silent_rank_worker, 2, args, str(out), timeout=120)
    assert "Timed out waiting 5000ms" in str(caught.value), str(caught.value)[-3000:]
    assert 3 <= max(logged_losses(out)) < 1000
    assert_logged_once(out, max(logged_losses(out)))
    assert time.monotonic() - started < 110
