"""--report-to wandb, offline (WANDB_MODE=offline): the run's records and resolved config go to a
wandb run under <output-dir>/wandb whose id is the checkpoint's run id, a resumed run continues
that id, and no secret is written. Skipped where wandb is not installed (the wandb extra)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from distributed_harness import run_distributed, tiny_args
from tiny_models import tiny_model_path, train_in_group

pytest.importorskip("wandb")
pytestmark = pytest.mark.slow

SECRET = "hf_notarealtoken0123456789"


def _train_twice(rank: int, world_size: int, argv: list[str]) -> list[float]:
    """4 steps, then the same run started again (it resumes at step 4 and has nothing left to
    train, but opens its wandb run), with a token in the environment; returns the losses."""
    os.environ["WANDB_MODE"] = "offline"
    os.environ["HF_TOKEN"] = SECRET
    os.environ.pop("WANDB_PROJECT", None)
    train_in_group(rank, world_size, [*argv, "--max-steps", "4"], export=False)
    train_in_group(rank, world_size, [*argv, "--max-steps", "4"], export=False)
    lines = (Path(argv[argv.index("--output-dir") + 1]) / "metrics.jsonl").read_text()
    return [record["loss"] for record in map(json.loads, lines.splitlines()) if "loss" in record]


def test_wandb_offline_run_holds_the_losses_and_config_and_resumes_its_id(
    sample_data: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    argv = tiny_args(
        sample_data, out,
        "--model", str(tiny_model_path("llama")), "--seq-length", "32", "--batch-size", "1",
        "--log-every", "1", "--eval-every", "0", "--eval-batches", "1",
        "--checkpoint-every", "2", "--warmup-steps", "1", "--report-to", "wandb",
    )  # fmt: skip
    [losses] = run_distributed(_train_twice, 1, argv, timeout=300)
    run_id = json.loads((out / "checkpoints" / "run.json").read_text())["run_id"]
    runs = sorted((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 2, runs
    assert all(run.name.endswith(f"-{run_id}") for run in runs), "the resumed run kept its id"
    data = b"".join(file.read_bytes() for run in runs for file in run.rglob("*") if file.is_file())
    assert SECRET.encode() not in data
    assert b"learning_rate" in data and b"report_to" in data, "the resolved config"
    for loss in losses:
        assert json.dumps(loss).encode() in data, loss
    assert len(losses) == 4
