"""Run identity in one process (world_size 1, through train.main): run ids in the checkpoint
folder and metrics.jsonl, --no-resume refused in another run's folder, --overwrite-output-dir,
the data stream's settings checked at resume, a torn metrics line, the last partial log window.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
from distributed_harness import REPO, metrics_records, tiny_args

sys.path.insert(0, str(REPO))

import train

pytestmark = pytest.mark.slow  # runs train.py under torchrun, several times


def _args(sample_data: Path, out: Path, *extra: str) -> list[str]:
    """3 tiny steps; a record every 2 steps (the last window is partial); checkpoints at 2, 3."""
    return tiny_args(
        sample_data, out, "--seq-length", "32", "--batch-size", "2",
        "--max-steps", "3", "--log-every", "2", "--eval-every", "0", "--eval-batches", "1",
        "--checkpoint-every", "2", "--threads", "1", *extra,
    )  # fmt: skip


def _snapshot(root: Path) -> dict[str, int]:
    return {str(p): p.stat().st_mtime_ns for p in root.rglob("*")}


def _run_id(out: Path) -> str:
    return json.loads((out / "checkpoints" / "run.json").read_text())["run_id"]


@pytest.fixture(scope="module")
def first_run(sample_data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("first")
    assert train.main(_args(sample_data, out)) == 0
    return out


def test_run_id_is_in_the_folder_every_checkpoint_and_every_record(first_run: Path) -> None:
    run_id = _run_id(first_run)
    assert len(run_id) == 32
    for step in (2, 3):
        meta = json.loads((first_run / "checkpoints" / f"step-{step}" / "meta.json").read_text())
        assert meta["run_id"] == run_id
    records = metrics_records(first_run)
    assert records and {r["run_id"] for r in records} == {run_id}


def test_the_last_partial_log_window_is_written(first_run: Path) -> None:
    """max_steps 3 with log_every 2: the train loss of step 3 is logged at the end."""
    assert [r["step"] for r in metrics_records(first_run) if "loss" in r] == [2, 3]


def test_no_resume_in_another_runs_folder_is_refused_and_deletes_nothing(
    capsys: pytest.CaptureFixture[str], sample_data: Path, first_run: Path
) -> None:
    before = _snapshot(first_run)
    assert train.main([*_args(sample_data, first_run), "--no-resume", "--max-steps", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    errors = [line for line in err if line.startswith("error: ")]
    assert errors and "--checkpoint-dir" in errors[0] and "--overwrite-output-dir" in errors[0]
    assert _snapshot(first_run) == before


@pytest.mark.parametrize(
    ("flags", "key"),
    [
        (("--seed", "7"), "seed"),
        (("--shuffle-buffer", "3"), "shuffle_buffer"),
        (("--epochs", "2"), "epochs"),
        (("--data-files", "data/c4/*validation*.json.gz"), "data_files"),
        (("--seq-length", "16"), "seq_length"),
        (("--optimizer", "demo"), "optimizer"),
        (("--lr-scheduler", "cosine"), "lr_scheduler"),
        (("--compression", "fp16"), "compression"),
        (("--zero1",), "zero1"),
        (("--data-parallel", "fsdp"), "data_parallel"),
        (
            ("--model", "{vocab}"),
            "model differs at 'lm_head.weight': \"float32[32000, 256]\" in the checkpoint, "
            '"float32[32768, 256]" here',
        ),
        (("--model", str(REPO / "configs" / "tiny-models" / "llama" / "config.json")), "model"),
        (("--peft", "lora"), "model"),
    ],
)
def test_a_different_run_is_not_resumed(
    capsys: pytest.CaptureFixture[str],
    sample_data: Path,
    first_run: Path,
    tmp_path: Path,
    flags: tuple[str, ...],
    key: str,
) -> None:
    """Every key a resume compares (``training_state.run_identity``, checked by
    ``check_compatible``), through the trainer: the data stream, the shape (the sequence
    length, the model: a vocabulary of another size changes the embedding's shape, LoRA adds
    adapters), the method, schedule, comm hook, ZeRO-1 and the data-parallel mode. Each is a
    start that stops at the check, one line, nothing written."""
    vocab = tmp_path / "vocab" / "config.json"  # llama-tiny with 32,768 tokens, not 32,000
    vocab.parent.mkdir()
    config = json.loads((REPO / "configs" / "llama-tiny" / "config.json").read_text())
    vocab.write_text(json.dumps({**config, "vocab_size": 32768}))
    flags = tuple(flag.replace("{vocab}", str(vocab)) for flag in flags)
    before = _snapshot(first_run)
    assert train.main([*_args(sample_data, first_run), "--max-steps", "4", *flags]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert errors and f"does not match this run: {key}" in errors[0], errors
    assert _snapshot(first_run) == before


def test_torn_metrics_line_resume_and_overwrite(
    sample_data: Path, tmp_path: Path, first_run: Path
) -> None:
    """A crash mid-write leaves half a line: the resumed run drops it and goes on; then
    --no-resume --overwrite-output-dir replaces the whole run with a new run id. (In a copy of
    the first run's folder: a run resumes wherever its folder is.)"""
    out = tmp_path / "run"
    shutil.copytree(first_run, out)
    run_id = _run_id(out)
    with (out / "metrics.jsonl").open("a") as handle:
        handle.write('{"run_id": "' + run_id + '", "step": 4, "lo')
    assert train.main([*_args(sample_data, out), "--max-steps", "4"]) == 0
    records = metrics_records(out)
    assert [r["step"] for r in records if "loss" in r] == [2, 3, 4]
    assert {r["run_id"] for r in records} == {run_id}
    assert train.main([*_args(sample_data, out), "--no-resume", "--overwrite-output-dir"]) == 0
    new_id = _run_id(out)
    assert new_id != run_id
    assert {r["run_id"] for r in metrics_records(out)} == {new_id}
    assert sorted(p.name for p in (out / "checkpoints").glob("step-*")) == ["step-2", "step-3"]
    meta = json.loads((out / "checkpoints" / "step-3" / "meta.json").read_text())
    assert meta["run_id"] == new_id
