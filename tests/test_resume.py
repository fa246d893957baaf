"""Exact resume under torchrun: interrupted runs end bit-identical to uninterrupted ones.

Every scenario trains the tiny LLaMA on the shared C4 sample for STEPS steps with 2 ranks and
compares with a straight run: per-step losses equal, final weights bit-identical.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from distributed_harness import (
    REPO,
    free_port,
    subprocess_env,
    tiny_args,
    torchrun,
    torchrun_command,
)
from safetensors.torch import load_file

pytestmark = pytest.mark.slow  # stops, kills and resumes torchrun runs

STEPS = 16


def run_args(sample_data: Path, output_dir: Path, *extra: str) -> list[str]:
    """Short steps (2 x 2 x 64 tokens), a log line and a checkpoint every 4 steps."""
    return tiny_args(
        sample_data, output_dir,
        "--seq-length", "64", "--batch-size", "2", "--max-steps", str(STEPS),
        "--warmup-steps", "4", "--log-every", "1", "--eval-every", "0", "--eval-batches", "1",
        "--checkpoint-every", "4", *extra,
    )  # fmt: skip


def losses(output_dir: Path) -> dict[int, float]:
    """Step -> logged training loss."""
    lines = (output_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines) if "loss" in r}


def weights(output_dir: Path) -> dict[str, torch.Tensor]:
    """The final model's tensors."""
    return load_file(output_dir / "final_model" / "model.safetensors")


def assert_same_run(got: Path, expected: Path) -> None:
    """Same losses at every step and bit-identical final weights."""
    assert losses(got) == losses(expected)
    want = weights(expected)
    have = weights(got)
    assert have.keys() == want.keys()
    for name, tensor in want.items():
        assert torch.equal(have[name], tensor), name


def ok(result: subprocess.CompletedProcess) -> str:
    """The run's output, after checking it succeeded."""
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    return output


SMALL = (
    "--model", str(REPO / "configs" / "tiny-models" / "llama" / "config.json"),
    "--seq-length", "16", "--batch-size", "1",
)  # fmt: skip
VARIANTS = {
    "none": ("--compression", "none"),
    "dct": ("--compression", "dct", "--compression-selection", "rotating", *SMALL),
    "zero1-bf16-mixed-ac": (
        "--zero1", "--precision", "bf16-mixed", "--activation-checkpointing", *SMALL,
    ),
}  # fmt: skip
"""Settings whose resume is checked: plain DDP (its uninterrupted run is the reference of the
SIGTERM and kill tests below; its stop-and-resume is tests/test_faults.py's SIGKILL run), rotating
DCT (its selection follows the step; its error-feedback residuals are per-rank state), and ZeRO-1
(per-rank optimizer shards) with autocast and activation checkpointing. These two train the
hidden-64 LLaMA on 16-token windows (``SMALL``): they check resume, not speed, and CPUs without
bf16 units (no avx512_bf16/AMX) run bf16 matmuls about 100x slower than fp32. The plain variant
keeps the 19.5M model, whose 225 MiB checkpoint write is long enough for the kill test to land
in it."""


@pytest.fixture(scope="module")
def straight(sample_data: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Uninterrupted runs, one per variant."""
    runs = {}
    for name, extra in VARIANTS.items():
        output_dir = tmp_path_factory.mktemp(f"straight-{name}")
        ok(torchrun(run_args(sample_data, output_dir, *extra)))
        assert sorted(losses(output_dir)) == list(range(1, STEPS + 1))
        runs[name] = output_dir
    return runs


@pytest.mark.parametrize("variant", [name for name in VARIANTS if name != "none"])
def test_stop_and_resume_is_exact(
    sample_data: Path, tmp_path: Path, straight: dict[str, Path], variant: str
) -> None:
    args = run_args(sample_data, tmp_path, *VARIANTS[variant])
    ok(torchrun([*args, "--max-steps", str(STEPS // 2)]))
    assert max(losses(tmp_path)) == STEPS // 2
    output = ok(torchrun(args))
    assert f"at step {STEPS // 2}" in output and "resumed from" in output
    assert_same_run(tmp_path, straight[variant])


def test_incompatible_checkpoint_is_refused(sample_data: Path, straight: dict[str, Path]) -> None:
    checkpoints = straight["none"] / "checkpoints"
    before = {p: p.stat().st_mtime_ns for p in checkpoints.rglob("*")}
    args = run_args(sample_data, straight["none"], "--compression", "dct")
    result = torchrun(args)
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert errors and "compression" in errors[0] and "--no-resume" in errors[0], result.stderr
    assert {p: p.stat().st_mtime_ns for p in checkpoints.rglob("*")} == before


def _workers(agent_pid: int) -> list[int]:
    """PIDs of the train.py worker processes started by a torchrun agent."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if int(stat[1]) == agent_pid and b"train.py" in cmdline:
            found.append(int(entry.name))
    return found


def _wait_for(condition: object, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert proc.poll() is None, "the run ended before the event the test waits for"
        assert time.monotonic() < deadline, "timed out waiting for the run"
        time.sleep(0.005)


def _complete(root: Path) -> list[str]:
    return sorted(p.parent.name for p in root.glob("step-*/COMPLETE"))


def _start(args: list[str], log: Path, extra: tuple = ()) -> subprocess.Popen:
    handle = log.open("w")
    return subprocess.Popen(
        torchrun_command(args, extra=extra), cwd=REPO, env=subprocess_env(),
        stdout=handle, stderr=subprocess.STDOUT,
    )  # fmt: skip


def test_worker_killed_during_a_checkpoint_write_is_restarted_and_resumes(
    sample_data: Path, tmp_path: Path, straight: dict[str, Path]
) -> None:
    """torchrun --max-restarts 1 restarts the group after the one SIGKILL; the checkpoint being
    written (its temporary folder) is ignored and the previous complete one is resumed from."""
    root = tmp_path / "checkpoints"
    proc = _start(run_args(sample_data, tmp_path), tmp_path / "log.txt", ("--max-restarts=1",))
    try:
        _wait_for(lambda: _complete(root) and any(root.glob("step-*.tmp")), proc)
        complete_at_kill = _complete(root)
        os.kill(_workers(proc.pid)[0], signal.SIGKILL)
        assert proc.wait(timeout=400) == 0, (tmp_path / "log.txt").read_text()[-4000:]
    finally:
        proc.kill()
    log = (tmp_path / "log.txt").read_text()
    assert f"resumed from {root / complete_at_kill[-1]}" in log
    assert not list(root.glob("*.tmp"))
    assert_same_run(tmp_path, straight["none"])


def test_sigterm_saves_a_checkpoint_and_the_next_run_resumes(
    sample_data: Path, tmp_path: Path, straight: dict[str, Path]
) -> None:
    args = run_args(sample_data, tmp_path, "--checkpoint-every", "0")
    root = tmp_path / "checkpoints"
    proc = _start(args, tmp_path / "log.txt")
    try:
        _wait_for(lambda: len(losses_or_empty(tmp_path)) >= 3, proc)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
    finally:
        proc.kill()
    saved = _complete(root)
    assert len(saved) == 1, (tmp_path / "log.txt").read_text()[-4000:]
    stopped_at = int(saved[0].removeprefix("step-"))
    assert 3 <= stopped_at < STEPS
    output = ok(torchrun(args))
    assert f"at step {stopped_at}" in output
    assert_same_run(tmp_path, straight["none"])


def losses_or_empty(output_dir: Path) -> dict[int, float]:
    """losses(), or nothing while metrics.jsonl does not exist yet."""
    if not (output_dir / "metrics.jsonl").is_file():
        return {}
    return losses(output_dir)


def test_two_agents_on_loopback_match_one_agent(
    sample_data: Path, tmp_path: Path, straight: dict[str, Path]
) -> None:
    """--nnodes 2 with one process each, c10d rendezvous at 127.0.0.1. One thread per process,
    as torchrun gives each of 2 processes on one node (the loss reduction's float sums depend
    on the thread count)."""
    port = free_port()
    args = run_args(sample_data, tmp_path, "--threads", "1")
    commands = [torchrun_command(args, nproc=1, nnodes=2, port=port) for _ in range(2)]
    procs = [
        subprocess.Popen(c, cwd=REPO, env=subprocess_env(),
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for c in commands
    ]  # fmt: skip
    outputs = [p.communicate(timeout=400)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]
    assert_same_run(tmp_path, straight["none"])
