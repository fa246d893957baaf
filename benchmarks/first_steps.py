"""The first LLaMA-2-7B steps on one GPU: time from launch to the first step, step time, MFU and
the peak memory against the plan, for LoRA and for full fine-tuning under FSDP2.

Each run is ``torchrun --nproc_per_node=1 train.py`` with random weights (LLaMA-2-7B's shapes
from ``configs/llama2-7b/config.json``: the hub is not needed), built on the GPU itself, on the
bundled C4 sample, for ``--steps`` steps, logged every step and saved nowhere
(``--no-save-at-end``). Runs (``--runs``):

- ``lora``: ``configs/llama2_7b_lora.toml`` (rank-8 adapters on every linear layer, frozen bf16
  base, bf16-mixed, activation checkpointing, 4 x 512 tokens x 4 accumulated);
- ``fsdp``: ``configs/llama2_7b.toml`` under ``--data-parallel fsdp`` on one rank (fp32 shards,
  AdamW moments and gradients: 100 GiB before activations, so a 141 GB H200), without its
  comm hook and ZeRO-1 (``--compression none --zero1 false``), micro-batch ``--fsdp-batch`` x
  ``--fsdp-seq-length``.

"launch to step 1" is wall-clock seconds from starting torchrun to the first record in
``metrics.jsonl`` (imports, model build, data, the first step); "process to step 1" is the
trainer's own log line (``step 1 done ... s after the process started``). The peak is the
largest ``peak_mem_bytes`` of the run (``torch.cuda.max_memory_allocated``); "planned" is what
``--dry-run`` prints for the same flags on the visible GPU (its 1 GiB overhead row included).

Usage (from the repository root; ``--model`` and ``--device cpu`` check the script on a CPU)::

    uv run python benchmarks/first_steps.py --runs lora,fsdp
    uv run python benchmarks/first_steps.py --device cpu \\
        --model configs/tiny-models/llama/config.json --lora-seq-length 128 --fsdp-seq-length 128
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import REPO, data_args, free_port, kill_group, markdown_table, start, train_env

from torchrun_ddp.config_io import parse_config
from torchrun_ddp.dry_run import visible_device_gib
from torchrun_ddp.model import load_model_config
from torchrun_ddp.planning import plan_run

SEVEN_B = REPO / "configs" / "llama2-7b" / "config.json"


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add = parser.add_argument
    add("--runs", default="lora,fsdp", help="comma list of lora, fsdp")
    add("--steps", type=int, default=6, help="optimizer steps per run")
    add("--model", type=Path, default=SEVEN_B, help="config.json of the model (random init)")
    add("--data-dir", type=Path, default=REPO / "data", help="C4 sample and tokenizer")
    add("--device", choices=("cuda", "cpu"), default="cuda")
    add("--lora-seq-length", type=int, default=0, help="lora: tokens per window (0: the config's)")
    add("--fsdp-batch", type=int, default=4, help="fsdp: windows per micro-batch")
    add("--fsdp-seq-length", type=int, default=2048, help="fsdp: tokens per window")
    add("--timeout-s", type=float, default=600, help="seconds one run may take")
    add("--keep", type=Path, default=None, help="keep the run folders here")
    return parser.parse_args(argv)


def run_flags(args: argparse.Namespace, name: str) -> list[str]:
    """``train.py`` flags of run ``name`` besides the shared ones."""
    if name == "lora":
        flags = ["--config", str(REPO / "configs" / "llama2_7b_lora.toml")]
        return flags + (["--seq-length", str(args.lora_seq_length)] if args.lora_seq_length else [])
    if name == "fsdp":
        flags = ["--config", str(REPO / "configs" / "llama2_7b.toml"), "--data-parallel", "fsdp"]
        flags += ["--compression", "none", "--zero1", "false"]
        flags += ["--batch-size", str(args.fsdp_batch)]
        return [*flags, "--seq-length", str(args.fsdp_seq_length)]
    raise SystemExit(f"error: unknown run {name!r}; pick from lora, fsdp")


def train_argv(args: argparse.Namespace, name: str, run_dir: Path) -> list[str]:
    """Every ``train.py`` flag of run ``name``."""
    argv = [*run_flags(args, name), *data_args(args.data_dir)]
    argv += ["--model", str(args.model), "--init", "random", "--epochs", "4"]
    argv += ["--max-steps", str(args.steps), "--log-every", "1", "--eval-every", "0"]
    argv += ["--eval-batches", "1", "--output-dir", str(run_dir), "--overwrite-output-dir"]
    argv += ["--no-resume", "--checkpoint-every", "0", "--no-save-at-end", "--warmup-steps", "1"]
    argv += ["--device", args.device]
    return argv + (["--backend", "nccl"] if args.device == "cuda" else [])


@dataclass
class Result:
    """One run's figures."""

    name: str
    launch_to_first_s: float
    process_to_first_s: float
    step_s: float
    tokens_per_s: float
    mfu: float
    peak_gib: float
    planned_gib: float
    loss: float


def wait_for_first_record(metrics: Path, proc: subprocess.Popen[bytes], deadline: float) -> float:
    """Seconds until ``metrics`` holds a training record (polled every 0.1 s), from now."""
    began = time.monotonic()
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.is_file() and '"loss"' in metrics.read_text():
            return time.monotonic() - began
        time.sleep(0.1)
    return float("nan")


def run_one(args: argparse.Namespace, name: str, run_dir: Path) -> Result:
    """Launch run ``name``, time its first step, wait for its end, read its records."""
    argv = train_argv(args, name, run_dir)
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=1"]
    command += ["--nnodes=1", "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{free_port()}"]
    deadline = time.monotonic() + args.timeout_s
    proc = start([*command, str(REPO / "train.py"), *argv], run_dir / "train.log", train_env())
    first = wait_for_first_record(run_dir / "metrics.jsonl", proc, deadline)
    while proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    if proc.poll() is None:
        kill_group(proc)
    log = (run_dir / "train.log").read_text()
    if proc.returncode != 0:
        raise RuntimeError(f"{name} failed (status {proc.returncode}):\n{log[-4000:]}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "tokens_per_s" in r]
    later = steps[1:] or steps
    found = re.search(r"step 1 done ([0-9.]+) s after the process started", log)
    config = parse_config(argv)
    plan, _ = plan_run(config, load_model_config(config.model), 1, visible_device_gib() or 80.0)
    return Result(
        name, first, float(found.group(1)) if found else float("nan"),
        statistics.median(r["step_time_s"] for r in later),
        statistics.median(r["tokens_per_s"] for r in later),
        statistics.median(r["mfu"] for r in later),
        max(r["peak_mem_bytes"] for r in steps) / 2**30, plan.total / 2**30, steps[-1]["loss"],
    )  # fmt: skip


def render(results: list[Result]) -> str:
    """The Markdown table."""
    header = ["run", "launch to step 1 s", "process to step 1 s", "step s", "tokens/s", "MFU"]
    header += ["peak GiB", "planned GiB", "peak / plan", "loss"]
    rows = []
    for r in results:
        rows.append([
            r.name, f"{r.launch_to_first_s:.1f}", f"{r.process_to_first_s:.1f}",
            f"{r.step_s:.3f}", f"{r.tokens_per_s:,.0f}", f"{r.mfu:.1%}", f"{r.peak_gib:.2f}",
            f"{r.planned_gib:.2f}", f"{r.peak_gib / r.planned_gib:.1%}", f"{r.loss:.4f}",
        ])  # fmt: skip
    return markdown_table(header, rows)


def main(argv: list[str]) -> int:
    """Run each of ``--runs`` in turn, print each as it ends, then the table."""
    args = parse_args(argv)
    work = Path(args.keep or tempfile.mkdtemp(prefix="first-steps-"))
    results = []
    for name in [n.strip() for n in args.runs.split(",") if n.strip()]:
        try:
            results.append(run_one(args, name, work / name))
        except RuntimeError as exc:
            print(f"{name}: FAILED\n{exc}", flush=True)
            continue
        print(f"{name}: {results[-1]}", flush=True)
    print(render(results))
    print(f"\n{args.steps} steps each, medians after step 1; {args.device}, model {args.model}.")
    return 0 if results else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
