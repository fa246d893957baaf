"""``python -m torchrun_ddp.plot OUTPUT_DIR [OUTPUT_DIR ...] [--out FILE]``: compare runs.

Reads each run's ``metrics.jsonl``, prints a one-line summary of each (steps, last losses, median
tokens/s and MFU) and writes one PNG with four panels against step: train loss,
held-out loss, learning rate and tokens/s, one line per run (e.g. one per compression method).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import matplotlib as mpl

mpl.use("Agg")
import matplotlib.pyplot as plt

PANELS = (
    ("loss", "train loss", "cross-entropy (nats/token)"),
    ("eval_loss", "held-out loss", "cross-entropy (nats/token)"),
    ("lr", "learning rate", "learning rate"),
    ("tokens_per_s", "throughput", "tokens/s (all ranks)"),
)
"""Each panel's metrics.jsonl key, title and y-axis label with its unit."""


def read_metrics(run_dir: Path) -> list[dict[str, float]]:
    """The records of ``run_dir/metrics.jsonl``; raises FileNotFoundError if it is missing."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def plot_runs(run_dirs: list[Path], out: Path) -> Path:
    """Draw the four panels for every run into ``out`` (PNG) and return its path."""
    figure, axes = plt.subplots(2, 2, figsize=(11, 7), constrained_layout=True)
    for run_dir in run_dirs:
        records = read_metrics(run_dir)
        for axis, (key, title, unit) in zip(axes.flat, PANELS, strict=True):
            points = [(r["step"], r[key]) for r in records if key in r]
            if points:
                steps, values = zip(*points, strict=True)
                axis.plot(
                    steps, values, marker="." if len(points) < 20 else None, label=run_dir.name
                )
            axis.set(title=title, xlabel="optimizer step", ylabel=unit)
    for axis in axes.flat:
        if axis.has_data():
            axis.legend(fontsize="small")
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=110)
    plt.close(figure)
    return out


def summary(run_dir: Path) -> str:
    """One line per run: steps, last train loss, last held-out loss, median tokens/s and MFU."""
    records = read_metrics(run_dir)
    train = [r for r in records if "loss" in r]
    evals = [r for r in records if "eval_loss" in r]
    if not train:
        return f"{run_dir}: no training records"
    speed = statistics.median(r["tokens_per_s"] for r in train)
    mfu = statistics.median(r.get("mfu", 0.0) for r in train)
    last_eval = f"{evals[-1]['eval_loss']:.4f}" if evals else "n/a"
    return (
        f"{run_dir}: {train[-1]['step']} steps, train loss {train[-1]['loss']:.4f}, "
        f"eval loss {last_eval}, median {speed:.0f} tokens/s, median MFU {mfu:.2f}"
    )


def main(argv: list[str] | None = None) -> int:
    """Command-line entry; prints the PNG's path. Exit status 2 on a missing metrics file."""
    parser = argparse.ArgumentParser(prog="python -m torchrun_ddp.plot", description=__doc__)
    parser.add_argument("runs", nargs="+", type=Path, help="output folders with metrics.jsonl")
    parser.add_argument("--out", type=Path, default=None, help="PNG path (default: first run)")
    args = parser.parse_args(argv)
    missing = [str(run) for run in args.runs if not (run / "metrics.jsonl").is_file()]
    if missing:
        print(
            f"error: no metrics.jsonl in {missing[0]}; pass a run's --output-dir", file=sys.stderr
        )
        return 2
    out = args.out or args.runs[0] / "metrics.png"
    for run in args.runs:
        print(summary(run))
    print(plot_runs(args.runs, out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
