"""Exact resume under torchrun: interrupted runs end bit-identical to uninterrupted ones.

Every scenario trains with 2 ranks on the shared C4 sample in the one reference config
(``distributed_harness.reference_args``) and compares with an uninterrupted run: per-step losses
equal, final weights bit-identical. Plain DDP's uninterrupted run is conftest.py's session fixture
``reference_run``, shared with tests/test_faults.py (SIGKILLs at every point, SIGTERM, a full
disk); the variants below each have their own.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from distributed_harness import (
    REFERENCE_STEPS,
    REPO,
    assert_same_run,
    free_port,
    logged_losses,
    reference_args,
    subprocess_env,
    torchrun,
    torchrun_command,
)

pytestmark = pytest.mark.slow  # stops and resumes torchrun runs

SMALL = (
    "--model", str(REPO / "configs" / "tiny-models" / "llama" / "config.json"),
    "--seq-length", "16",
)  # fmt: skip
VARIANTS = {
    "dct-zero1-bf16-mixed-ac": (
        "--compression", "dct", "--compression-selection", "rotating", "--zero1",
        "--precision", "bf16-mixed", "--activation-checkpointing", *SMALL,
    ),
}  # fmt: skip
"""Settings whose resume is checked besides plain DDP (whose stop-and-resume runs are
tests/test_faults.py's SIGKILL and SIGTERM runs), in one run since each start costs seconds:
rotating DCT (its selection follows the step; its error-feedback residuals are per-rank state),
ZeRO-1 (per-rank optimizer shards), autocast and activation checkpointing. They train the
hidden-64 LLaMA on 16-token windows (``SMALL``): they check resume, not speed, and CPUs without
bf16 units (no avx512_bf16/AMX) run bf16 matmuls about 100x slower than fp32."""


def ok(result: subprocess.CompletedProcess) -> str:
    """The run's output, after checking it succeeded."""
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    return output


@pytest.fixture(scope="module")
def straight(sample_data: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Uninterrupted runs, one per variant."""
    runs = {}
    for name, extra in VARIANTS.items():
        output_dir = tmp_path_factory.mktemp(f"straight-{name}")
        ok(torchrun(reference_args(sample_data, output_dir, *extra)))
        assert sorted(logged_losses(output_dir)) == list(range(1, REFERENCE_STEPS + 1))
        runs[name] = output_dir
    return runs


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_stop_and_resume_is_exact(
    sample_data: Path, tmp_path: Path, straight: dict[str, Path], variant: str
) -> None:
    args = reference_args(sample_data, tmp_path, *VARIANTS[variant])
    half = REFERENCE_STEPS // 2
    ok(torchrun([*args, "--max-steps", str(half)]))
    assert max(logged_losses(tmp_path)) == half
    output = ok(torchrun(args))
    assert f"at step {half}" in output and "resumed from" in output
    assert_same_run(tmp_path, straight[variant])


def test_incompatible_checkpoint_is_refused(sample_data: Path, reference_run: Path) -> None:
    """In the reference run's folder, a run with another --compression refuses to start and
    changes nothing there."""
    checkpoints = reference_run / "checkpoints"
    before = {p: p.stat().st_mtime_ns for p in checkpoints.rglob("*")}
    result = torchrun(reference_args(sample_data, reference_run, "--compression", "dct"))
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert errors and "compression" in errors[0] and "--no-resume" in errors[0], result.stderr
    assert {p: p.stat().st_mtime_ns for p in checkpoints.rglob("*")} == before


def test_two_agents_on_loopback_match_one_agent(
    sample_data: Path, tmp_path: Path, reference_run: Path
) -> None:
    """--nnodes 2 with one process each, c10d rendezvous at 127.0.0.1. One thread per process,
    as torchrun gives each of 2 processes on one node (the loss reduction's float sums depend
    on the thread count)."""
    port = free_port()
    args = reference_args(sample_data, tmp_path, "--threads", "1")
    commands = [torchrun_command(args, nproc=1, nnodes=2, port=port) for _ in range(2)]
    procs = [
        subprocess.Popen(c, cwd=REPO, env=subprocess_env(),
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for c in commands
    ]  # fmt: skip
    outputs = [p.communicate(timeout=400)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]
    assert_same_run(tmp_path, reference_run, REFERENCE_STEPS)
