"""The quick start, end to end: torchrun with 2 processes trains configs/quickstart.toml (as
README.md's quick start runs it, plus --tensorboard) on the bundled C4 sample, in a copy of the
repository with nothing beside it (conftest.py's ``clone``), from an unrelated working
directory. The stop at the end of uneven data runs on spawned ranks; train.py without torchrun
(one process) is tests/test_faults.py's SIGTERM test."""

from __future__ import annotations

import gzip
import json
import math
import subprocess
import tomllib
from pathlib import Path

import pytest
import torch
from distributed_harness import (
    REPO,
    clone_env,
    metrics_records,
    run_distributed,
    tiny_args,
    torchrun_command,
)
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tiny_models import LogLines, train_in_group
from transformers import AutoModelForCausalLM, AutoTokenizer

from torchrun_ddp import plot
from torchrun_ddp.config_io import parse_config
from torchrun_ddp.distributed import DistEnv
from torchrun_ddp.dry_run import plan_model_config, planned_steps
from torchrun_ddp.inputs import check_inputs, planned_data

pytestmark = pytest.mark.slow  # trains the quick start under torchrun

QUICKSTART = tomllib.loads((REPO / "configs" / "quickstart.toml").read_text())
STEPS, LOG_EVERY, EVAL_EVERY = (QUICKSTART[k] for k in ("max_steps", "log_every", "eval_every"))
VOCAB = 4096
"""configs/llama-8m's tokenizer, the quick start's: an untrained model's loss is ln 4096."""

E2E = (
    "--peak-tflops", "0", "--seq-length", "64", "--batch-size", "4", "--max-steps", "20",
    "--warmup-steps", "5", "--learning-rate", "3e-3", "--log-every", "5", "--eval-every", "10",
    "--eval-batches", "4", "--tensorboard",
)  # fmt: skip
"""configs/tiny.toml shortened for the GPU tests (tests/test_gpu.py): 20 steps of 2 x 4 x 64
tokens (at 128 tokens the end-to-end run took 48.7 s against 34.8 s, one after the other on 2
cores, 2026-11-27); the MFU peak measured (or looked up on a GPU) as in a user's run. The data,
tokenizer and output folder are the config's own (the bundled sample, ``outputs/tiny`` under the
working directory)."""


def e2e_args(sample_data: Path, output_dir: Path, *extra: str) -> list[str]:
    """``E2E`` on the bundled sample of this checkout, with the output folder given (the GPU
    tests' runs, tests/test_gpu.py)."""
    return tiny_args(sample_data, output_dir, *E2E, *extra)


@pytest.fixture(scope="module")
def tiny_run(clone: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The output folder of the quick start's command, run from an empty working directory."""
    cwd = tmp_path_factory.mktemp("elsewhere")
    args = ["--config", str(clone / "configs" / "quickstart.toml"), "--tensorboard"]
    command = torchrun_command(args, script=clone / "train.py")
    result = subprocess.run(
        command, cwd=cwd, env=clone_env(clone), capture_output=True, text=True, timeout=420,
        check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    output_dir = cwd / "outputs" / "quickstart"  # output_dir is relative to the working directory
    (output_dir / "log.txt").write_text(result.stdout + result.stderr)
    return output_dir


def test_the_config_reads_the_bundled_sample_of_the_copy(clone: Path, tiny_run: Path) -> None:
    """configs/tiny.toml's relative paths are read from the config's folder, not from the
    working directory: the copy's own data folder."""
    saved = (tiny_run / "config.toml").read_text()
    assert str(clone / "data") in saved and str(REPO / "data") not in saved


def test_metrics_have_the_documented_keys(tiny_run: Path) -> None:
    train = [r for r in metrics_records(tiny_run) if "loss" in r]
    assert [r["step"] for r in train] == list(range(LOG_EVERY, STEPS + 1, LOG_EVERY))
    for record in train:
        for key in ("step", "loss", "lr", "tokens_per_s", "grad_norm", "peak_mem_bytes"):
            assert key in record, key
        assert record["tokens_per_s"] > 0 and record["peak_mem_bytes"] > 0
        # MFU is over an fp32 matmul peak measured at start-up; a shared CPU's speed drifts by
        # about 30% during a run; with matmul FLOPs (PaLM appendix B) it reads about 0.6 here.
        assert 0 < record["mfu"] < 1, "MFU against the measured fp32 matmul peak"
        assert record["comm_bytes"] == record["comm_bytes_dense"] > 0, "no compression: dense"
        assert 0 <= record["data_time_s"] < record["step_time_s"]


def test_loss_falls_and_eval_is_finite(tiny_run: Path) -> None:
    records = metrics_records(tiny_run)
    losses = [r["loss"] for r in records if "loss" in r]
    assert losses[0] > 7.5, "an untrained model starts near ln(4096) = 8.3"
    assert losses[-1] < losses[0] - 0.8, losses  # about 1.1 nats from steps 1-10 to 51-60
    evals = [r for r in records if "eval_loss" in r]
    assert [r["step"] for r in evals] == list(range(0, STEPS + 1, EVAL_EVERY))
    assert evals[0]["eval_loss"] == pytest.approx(math.log(VOCAB), abs=0.3), "untrained model"
    assert all(torch.isfinite(torch.tensor(r["eval_loss"])) for r in evals)
    assert evals[-1]["eval_loss"] < evals[0]["eval_loss"] - 1.0, "the held-out loss falls"
    assert evals[-1]["eval_ppl"] == pytest.approx(2.718281828 ** evals[-1]["eval_loss"], rel=1e-6)


def test_only_rank_zero_logs(tiny_run: Path) -> None:
    log = (tiny_run / "log.txt").read_text()
    assert "[rank 0]" in log and "[rank 1]" not in log
    assert log.count("| loss ") == STEPS // LOG_EVERY


def test_final_model_loads_and_generates(tiny_run: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_run / "final_model")
    tokenizer = AutoTokenizer.from_pretrained(tiny_run / "final_model")
    prompt = tokenizer("The best way to", return_tensors="pt")
    out = model.generate(**prompt, max_new_tokens=8, do_sample=False)
    assert out.shape[1] == prompt["input_ids"].shape[1] + 8
    assert isinstance(tokenizer.decode(out[0]), str)
    assert (tiny_run / "final_model" / "model.safetensors").is_file()
    assert f"max_steps = {STEPS}" in (tiny_run / "config.toml").read_text()
    assert model.config.hidden_size == 128, "configs/quickstart.toml's model"
    assert model.config.vocab_size == len(tokenizer) == VOCAB


def test_tensorboard_events_hold_the_logged_scalars(tiny_run: Path) -> None:
    events = EventAccumulator(str(tiny_run / "tensorboard"))
    events.Reload()
    tags = events.Tags()["scalars"]
    assert {"train/loss", "train/tokens_per_s", "train/mfu", "eval/eval_loss"} <= set(tags)
    logged = {r["step"]: r["loss"] for r in metrics_records(tiny_run) if "loss" in r}
    scalars = {e.step: e.value for e in events.Scalars("train/loss")}
    assert scalars == pytest.approx(logged)


def test_plot_writes_a_png(tiny_run: Path, tmp_path: Path) -> None:
    out = tmp_path / "runs.png"
    assert plot.main([str(tiny_run), str(tiny_run), "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    assert plot.main([str(tmp_path / "missing")]) == 2


def _uneven_args(sample_data: Path, data: Path, output: Path, log_every: int) -> list[str]:
    """The hidden-64 LLaMA on ``data`` (both splits) until the data ends, 1 x 16 tokens a rank."""
    return tiny_args(
        sample_data, output,
        "--data-files", str(data), "--eval-files", str(data), "--max-steps", "-1",
        "--model", str(REPO / "configs" / "tiny-models" / "llama" / "config.json"),
        "--seq-length", "16", "--batch-size", "1", "--shuffle-buffer", "0",
        "--log-every", str(log_every), "--eval-batches", "1",
    )  # fmt: skip


def _uneven_worker(rank: int, world_size: int, sample: str, data: str, root: str) -> dict[str, str]:
    """Logging every step and every 3 steps, then the second run started again: each run's
    log lines (one spawn)."""
    out = {}
    for name, log_every in (("1", 1), ("3", 3), ("again", 3)):
        output = Path(root) / f"log-every-{log_every}"
        with LogLines() as log:
            train_in_group(
                rank, world_size, _uneven_args(Path(sample), Path(data), output, log_every)
            )
        out[name] = "\n".join(log.lines)
    return out


def test_ranks_stop_together_at_the_end_of_uneven_data(sample_data: Path, tmp_path: Path) -> None:
    """Rank 0 gets 4 documents and rank 1 gets 3 (every other line): with --max-steps -1 both
    stop together, instead of waiting forever. Logging every step, they stop on the step where
    the first of them runs out; logging every 3 steps (ranks agree on log steps only, having
    read ahead to the next one), on the last log step before it. Started again, the second run
    resumes at the end of its data and returns: nothing left to train is success (train.py's
    status for it is 0: tests/test_faults.py's resumed runs end the same way). Spawned ranks,
    not torchrun: the stop is the loop's, not the launcher's."""
    texts = [" ".join(["word"] * (40 + 10 * i)) for i in range(7)]
    data = tmp_path / "uneven.json.gz"
    with gzip.open(data, "wt", encoding="utf-8") as handle:
        handle.writelines(json.dumps({"text": t}) + "\n" for t in texts)
    logs = run_distributed(_uneven_worker, 2, str(sample_data), str(data), str(tmp_path))[0]
    last_steps = {}
    for log_every in (1, 3):
        steps = [
            r["step"] for r in metrics_records(tmp_path / f"log-every-{log_every}") if "loss" in r
        ]
        assert "end of training data after" in logs[str(log_every)]
        assert steps == list(range(log_every, steps[-1] + 1, log_every))
        last_steps[log_every] = steps[-1]
    assert last_steps[3] == last_steps[1] // 3 * 3 > 0
    for log_every, steps in last_steps.items():  # the dry run's plan says where the data ends
        args = _uneven_args(sample_data, data, tmp_path / "plan", log_every)
        config = parse_config([*args, "--dry-run", "--plan-world-size", "2"])
        checked = check_inputs(config, DistEnv(), plan_model_config(config))  # as a dry run
        counted = planned_data(config, DistEnv(), checked)
        assert planned_steps(config, 2, counted) == steps, (log_every, counted)
    again = logs["again"]
    assert f"end of training data after {last_steps[3]} steps" in again, again
    assert (
        f"at step {last_steps[3]}" in again and (tmp_path / "log-every-3" / "final_model").is_dir()
    )
