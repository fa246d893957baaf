"""Exact resume: interrupted runs end bit-identical to uninterrupted ones.

Every scenario trains with 2 ranks on the shared C4 sample in the one reference config
(``distributed_harness.reference_args``) and compares with an uninterrupted run: per-step losses
equal, final weights bit-identical. Plain DDP's uninterrupted run under torchrun is conftest.py's
session fixture ``reference_run``, shared with tests/test_faults.py (SIGKILLs at every point,
SIGTERM, a full disk); the variants below run on spawned ranks, their uninterrupted run in the
same spawn.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from distributed_harness import (
    REFERENCE_STEPS,
    SMALL_LLAMA,
    SMALL_TOKENIZER,
    assert_same_run,
    logged_steps,
    reference_args,
    run_distributed,
)
from tiny_models import LogLines, train_in_group

from torchrun_ddp.errors import UserError

pytestmark = pytest.mark.slow  # stops and resumes torchrun runs

SMALL = (
    "--model", str(SMALL_LLAMA), "--tokenizer", str(SMALL_TOKENIZER), "--seq-length", "16",
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
ZeRO-1 (per-rank optimizer shards), autocast and activation checkpointing. They train
SMALL_LLAMA (4,096 tokens) on 16-token windows (``SMALL``): they check resume, not speed, and
CPUs without bf16 units (no avx512_bf16/AMX) run bf16 matmuls about 100x slower than fp32."""


def _variant_worker(
    rank: int, world_size: int, data: str, root: str, extra: tuple[str, ...]
) -> dict[str, object]:
    """One spawn: the variant uninterrupted (``straight``), then stopped at half of its steps
    and started again in the same folder (``stopped``): the steps the stopped run logged, and
    the log lines of the run that resumed."""
    args = reference_args(Path(data), Path(root) / "stopped", *extra)
    train_in_group(rank, world_size, reference_args(Path(data), Path(root) / "straight", *extra))
    train_in_group(rank, world_size, [*args, "--max-steps", str(REFERENCE_STEPS // 2)])
    logged = logged_steps(Path(root) / "stopped")  # as written: a step twice shows twice
    with LogLines() as log:
        train_in_group(rank, world_size, args)
    return {"logged": logged, "lines": log.lines}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_stop_and_resume_is_exact(sample_data: Path, tmp_path: Path, variant: str) -> None:
    """The ranks are spawned in-process (``run_distributed``), not under torchrun: what is
    checked is the variant's state across a stop, not the launcher, whose restarts
    tests/test_faults.py checks with plain DDP."""
    extra = VARIANTS[variant]
    result = run_distributed(
        _variant_worker, 2, str(sample_data), str(tmp_path), extra, timeout=600
    )[0]
    half = REFERENCE_STEPS // 2
    assert result["logged"] == list(range(1, half + 1))
    resumed = [line for line in result["lines"] if line.startswith("resumed from")]
    assert resumed and resumed[0].endswith(f"at step {half}"), result["lines"]
    assert_same_run(tmp_path / "stopped", tmp_path / "straight", REFERENCE_STEPS)


def _refusal_worker(rank: int, world_size: int, data: str, folder: str) -> str:
    """Start in ``folder`` with another --compression: the one-line refusal, or "" if none."""
    try:
        train_in_group(rank, world_size, reference_args(Path(data), Path(folder), *DCT))
    except UserError as exc:
        return str(exc)
    return ""


DCT = ("--compression", "dct")


def test_incompatible_checkpoint_is_refused(sample_data: Path, reference_run: Path) -> None:
    """In the reference run's folder, a run with another --compression refuses to start on
    every rank and changes nothing there (train.py prints the refusal as one ``error:`` line
    with status 2: tests/test_cli.py)."""
    checkpoints = reference_run / "checkpoints"
    before = {p: p.stat().st_mtime_ns for p in checkpoints.rglob("*")}
    errors = run_distributed(_refusal_worker, 2, str(sample_data), str(reference_run))
    assert all("compression" in e and "--no-resume" in e for e in errors), errors
    assert {p: p.stat().st_mtime_ns for p in checkpoints.rglob("*")} == before
