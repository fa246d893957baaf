"""Convergence and cost of gradient compression, DeMo, DiLoCo and SparseLoCo on a tiny LLaMA: a
frontier over seeds.

Trains ``configs/tiny.toml`` (optionally another ``--model`` config) on the offline C4 sample
(``../shared/data``) once per method, learning rate and seed, with 2 processes under torchrun on
loopback (gloo, CPU), every run from the same step count and data order for a given seed, and
prints Markdown tables:

1. the grid: every method at every learning rate of its optimizer's grid (``--adamw-lrs``,
   ``--demo-lrs``: sign descent needs another scale than AdamW; ``--local-lrs``: the inner AdamW
   of DiLoCo and SparseLoCo), held-out loss as mean +- standard error over the seeds, and its
   change against dense AdamW (``none``) paired by seed: per seed ``100 (L_method / L_none -
   1)``, then mean +- standard error of those;
2. the frontier: each method at its best learning rate (lowest mean held-out loss over the
   seeds; dense AdamW at its own best), wire bytes each rank sends per token it trains under the
   ring model at ``W = 8`` and ``W = 64`` (DiLoCo and SparseLoCo: one sync's bytes spread over
   its H steps), the ratios against a dense fp32 ring all-reduce there, median step time, and the
   paired change against dense AdamW;
3. the held-out loss by step of every frontier point, dense AdamW's among them (with
   ``--eval-every``), so a reader sees which phase of training the comparison covers;
4. the targets: within 1% of dense AdamW at 32x or more fewer wire bytes at ``W = 8`` (and the
   earlier 2x / 8x targets), and at 1,000x at ``W = 8`` and 100x at ``W = 64`` (local updates),
   with the standard error, so "met" means mean + 2 SE <= the limit.

``--png`` draws the frontier: held-out loss change against wire bytes per token at ``W = 8`` and
at ``W = 64`` (log scale), one point per method with standard-error bars, dense AdamW as the 0
line.

The learning rate warms up and then follows one cosine cycle that ends at ``--min-lr-ratio`` of
the peak on the last step, so the final eval is taken at a small learning rate. Choose
``--steps`` and ``--eval-every`` as multiples of every H benchmarked, so that DiLoCo and
SparseLoCo are evaluated right after a sync (on the synchronised model).

Usage (from the repository root)::

    uv run python benchmarks/compression.py                    # the single-seed table
    uv run python benchmarks/compression.py --methods none,dct-0.125 --steps 50
    uv run python benchmarks/compression.py --work-dir runs --reuse   # continue after a stop
    uv run python benchmarks/compression.py --model configs/tiny-models/llama/config.json \
        --methods none,demo-32,diloco-h50,sparseloco-h25,sparseloco-h125 --steps 1000 \
        --epochs 4 --eval-every 250 --tune-seed 42 --seed 43 --seeds 3 \
        --adamw-lrs 1e-3,3e-3,1e-2 --demo-lrs 3e-3,1e-2 --eval-batches 64 \
        --work-dir runs --reuse --png docs/compression_frontier.png
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path

import matplotlib as mpl

mpl.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.lines import Line2D

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (
    ARGS_FILE,
    DCT_HOOKS,
    HOOKS,
    REPO,
    SHARED_DATA,
    RunSummary,
    Variant,
    all_variants,
    check_data,
    data_args,
    free_port,
    hook_flags,
    human_bytes,
    made_with,
    markdown_table,
    median_after,
    optimizer_of,
    pick_variants,
    read_metrics,
    ring_ratio,
    start,
    steps_to,
    summarise,
    tokenizer_path,
    train_env,
    wait_all,
    wire_at,
)

from torchrun_ddp.training_data import document_tokens, load_tokenizer

DEFAULT_METHODS = "none,fp16,bf16,powersgd-4,powersgd-16,dct-0.5,dct-0.25-bf16,dct-0.125"
DEFAULT_METHODS += ",dct-0.03,dct-topk-8-bf16,dct-topk-2,demo-32,demo-8,diloco-h50,sparseloco-h50"
WARMUP_SKIP = 3
"""Steps left out of the median step time (first step, DDP bucket rebuild, PowerSGD start)."""
LOSS_TAIL = 10
"""The final training loss is the mean over this many last steps."""
FRONTIER_WORLD = 8
"""The world size at which the frontier states wire bytes and ratios."""
FRONTIER_WORLDS = (FRONTIER_WORLD, 64)
"""The world sizes of the frontier's wire bytes per token and ratios."""
TARGET_RATIO = 32.0
"""The issue's target: within 1% of dense AdamW at this ratio or more at ``FRONTIER_WORLD``."""
LOCAL_TARGETS = {8: 1000.0, 64: 100.0}
"""Local updates' target: within 1% of dense AdamW at these ratios or more, per world size."""


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Command-line options (the defaults make the single-seed table)."""
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add = parser.add_argument
    add("--methods", default=DEFAULT_METHODS, help=f"comma list of: {', '.join(all_variants())}")
    add("--model", default="", help="model config.json (default: tiny.toml's 19.5M LLaMA)")
    add("--steps", type=int, default=400, help="optimizer steps per run")
    add("--seq-length", type=int, default=128, help="tokens per window")
    add("--batch-size", type=int, default=4, help="windows per rank per step")
    add("--learning-rate", type=float, default=3e-3, help="AdamW lr when --adamw-lrs is empty")
    add("--adamw-lrs", default="", help="comma list: AdamW learning-rate grid")
    add("--demo-lrs", default="1e-3", help="comma list: DeMo (sign step) learning-rate grid")
    add(
        "--local-lrs",
        default="",
        help="comma list: DiLoCo/SparseLoCo inner AdamW lr grid (default: the AdamW grid)",
    )
    add(
        "--method-lrs",
        type=method_lrs,
        default="",
        help="comma list of METHOD=LR: run METHOD at this one peak lr instead of its grid "
        "(e.g. none=7.5e-4,dct-0.25-bf16=1.5e-3 to add seeds at rates tuned earlier)",
    )
    add(
        "--bound",
        type=float,
        default=1.0,
        help="the claim checked for the 'seeds needed' column: paired change <= +BOUND%%",
    )
    add("--epochs", type=int, default=1, help="passes over the training data a run may make")
    add("--eval-every", type=int, default=0, help="held-out loss every N steps (0: at the end)")
    add("--min-lr-ratio", type=float, default=1 / 30, help="final lr as a fraction of the peak")
    add("--warmup-steps", type=int, default=20, help="linear warmup steps")
    add("--eval-batches", type=int, default=16, help="held-out micro-batches per rank")
    add("--seed", type=int, default=42, help="first seed of init, data order and dropout")
    add("--seeds", type=int, default=1, help="seeds per setting: --seed, --seed + 1, ...")
    add(
        "--tune-seed",
        type=int,
        default=-1,
        help="if >= 0: run the lr grids at this seed only, then each method at its best lr "
        "there at the --seeds (the frontier then uses those seeds alone)",
    )
    add("--block-size", type=int, default=64, help="DCT block length for dct and dct-topk")
    add("--compression-start-step", type=int, default=0, help="dense steps before compressing")
    add("--no-error-feedback", action="store_true", help="turn dct/dct-topk error feedback off")
    add("--nproc", type=int, default=2, help="processes (ranks) on this machine")
    add(
        "--nodes",
        type=int,
        default=1,
        help="simulated nodes: that many torchrun agents on loopback sharing --nproc ranks "
        "(2 with --nproc 4: 2 nodes x 2, for the -node methods)",
    )
    add("--repeats", type=int, default=1, help="runs per setting and seed (medians of times)")
    add("--data-dir", type=Path, default=SHARED_DATA, help="offline C4 sample and tokenizer")
    add("--work-dir", type=Path, default=None, help="run folders (default: a temporary folder)")
    add("--timeout-s", type=float, default=0.0, help="per-run limit; 0: 300 s + 20 s per step")
    add("--out", type=Path, default=None, help="also write the tables to this file")
    add("--png", type=Path, default=None, help="draw the frontier into this PNG")
    add(
        "--reuse",
        action="store_true",
        help="reuse finished runs in --work-dir made with identical train.py arguments "
        "(continue an interrupted benchmark)",
    )
    return parser.parse_args(argv)


def method_lrs(text: str) -> dict[str, float]:
    """``--method-lrs``: ``"none=7.5e-4,dct-0.25-bf16=1.5e-3"`` -> method name -> peak lr.

    Raises SystemExit with a one-line message on an entry that is not ``METHOD=LR``."""
    rates = {}
    for entry in filter(None, (part.strip() for part in text.split(","))):
        name, _, value = entry.partition("=")
        try:
            rates[name.strip()] = float(value)
        except ValueError:
            sys.exit(f"error: --method-lrs entry {entry!r} is not METHOD=LR (e.g. none=7.5e-4)")
    return rates


def learning_rates(args: argparse.Namespace, variant: Variant) -> list[float]:
    """The learning-rate grid of the variant's optimizer, or the one rate ``--method-lrs``
    gives the variant."""
    if variant.name in args.method_lrs:
        return [args.method_lrs[variant.name]]
    optimizer = optimizer_of(variant)
    text = args.adamw_lrs or str(args.learning_rate)
    if optimizer == "demo":
        text = args.demo_lrs
    elif optimizer != "adamw":
        text = args.local_lrs or text
    return [float(value) for value in text.split(",") if value.strip()]


def train_args(
    args: argparse.Namespace, variant: Variant, lr: float, seed: int, output_dir: Path
) -> list[str]:
    """``train.py`` arguments for one run of ``variant`` at peak learning rate ``lr``."""
    cycle = max(1, args.steps - args.warmup_steps)
    flags = ["--config", str(REPO / "configs" / "tiny.toml"), *data_args(args.data_dir, args.model)]
    flags += ["--model", args.model] if args.model else []
    flags += ["--output-dir", str(output_dir), "--no-resume", "--max-steps", str(args.steps)]
    flags += ["--overwrite-output-dir"]  # reruns replace the old run
    flags += ["--seq-length", str(args.seq_length), "--batch-size", str(args.batch_size)]
    flags += ["--learning-rate", f"{lr:g}", "--min-lr", f"{lr * args.min_lr_ratio:g}"]
    flags += ["--warmup-steps", str(args.warmup_steps), "--restart-every", str(cycle)]
    flags += ["--seed", str(seed), "--eval-batches", str(args.eval_batches)]
    flags += ["--log-every", "1", "--eval-every", str(args.eval_every), "--checkpoint-every", "0"]
    flags += ["--epochs", str(args.epochs)]
    start = str(args.compression_start_step)
    flags += hook_flags(variant, "--compression-start-step", start, HOOKS)
    if args.no_error_feedback:
        flags += hook_flags(variant, "--compression-error-feedback", "false", DCT_HOOKS)
    return [*flags, *variant.flags]


def recorded_args(args: argparse.Namespace, flags: list[str]) -> list[str]:
    """What a run folder records of its launch: the ``train.py`` flags, and the node layout
    when there are several simulated nodes."""
    return flags if args.nodes == 1 else [*flags, "#nodes", str(args.nodes)]


def reusable(args: argparse.Namespace, flags: list[str], run_dir: Path) -> RunSummary | None:
    """With ``--reuse``: the summary of a finished run in ``run_dir`` made with ``flags``."""
    if not args.reuse or not made_with(run_dir, recorded_args(args, flags)):
        return None
    summary = summarise(read_metrics(run_dir / "metrics.jsonl"))
    finished = len(summary.losses) == args.steps and math.isfinite(summary.eval_loss)
    return summary if finished else None


def run_once(args: argparse.Namespace, flags: list[str], run_dir: Path) -> RunSummary:
    """Train once under torchrun with ``flags`` (or reuse); raises RuntimeError on failure."""
    reused = reusable(args, flags, run_dir)
    if reused is not None:
        return reused
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    (run_dir / ARGS_FILE).write_text(json.dumps(recorded_args(args, flags)))
    per_node, port = args.nproc // args.nodes, free_port()
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={per_node}"]
    command += [f"--nnodes={args.nodes}", "--rdzv_backend=c10d"]
    command += [f"--rdzv_endpoint=127.0.0.1:{port}", f"--rdzv_id=frontier-{port}"]
    command += [str(REPO / "train.py"), *flags]
    timeout = args.timeout_s or 300.0 + 20.0 * args.steps
    logs = [
        run_dir / ("train.log" if node == 0 else f"train-node{node}.log")
        for node in range(args.nodes)
    ]
    procs = [start(command, log, train_env()) for log in logs]
    codes = wait_all(procs, timeout)
    if any(code != 0 for code in codes):
        reason = "timed out" if None in codes else f"exit status {codes}"
        raise RuntimeError(f"{run_dir.name}: {reason}; see {run_dir / 'train.log'}")
    return summarise(read_metrics(run_dir / "metrics.jsonl"))


@dataclass
class Setting:
    """One method at one peak learning rate, and its runs by seed."""

    variant: Variant
    lr: float
    runs: dict[int, list[RunSummary]] = field(default_factory=dict)

    @property
    def name(self) -> str:
        """Folder-safe id, e.g. ``demo-32-lr0.001``."""
        return f"{self.variant.name}-lr{self.lr:g}"

    def seed_losses(self) -> dict[int, float]:
        """Held-out loss per seed (mean over repeats)."""
        runs = self.runs.items()
        return {seed: statistics.fmean(r.eval_loss for r in done) for seed, done in runs}

    def all_runs(self) -> list[RunSummary]:
        """Every run, all seeds."""
        return [run for runs in self.runs.values() for run in runs]

    def at(self, seeds: Iterable[int]) -> Setting:
        """A copy holding only the runs of ``seeds``."""
        keep = set(seeds)
        return replace(self, runs={s: r for s, r in self.runs.items() if s in keep})


def run_all(args: argparse.Namespace, settings: list[Setting], work: Path) -> None:
    """Every setting at every seed; with ``--tune-seed``, the whole grid at that seed first,
    then each method's best setting there at the ``--seeds``."""
    if args.tune_seed < 0:
        run_seeds(args, settings, range(args.seed, args.seed + args.seeds), work)
        return
    run_seeds(args, settings, [args.tune_seed], work)
    chosen = best_settings(settings)
    run_seeds(args, chosen, range(args.seed, args.seed + args.seeds), work)


def run_seeds(
    args: argparse.Namespace, settings: list[Setting], seeds: Iterable[int], work: Path
) -> None:
    """Every setting at every seed ``--repeats`` times; seeds outermost, so a stop leaves whole
    seeds done, and settings interleaved, so slow spells of the machine hit all alike."""
    for repeat in range(args.repeats):
        for seed in seeds:
            for setting in settings:
                began = time.monotonic()
                run_dir = work / f"{setting.name}-s{seed}-r{repeat}"
                flags = train_args(args, setting.variant, setting.lr, seed, run_dir)
                summary = run_once(args, flags, run_dir)
                setting.runs.setdefault(seed, []).append(summary)
                print(
                    f"# {setting.name} seed {seed} (repeat {repeat + 1}): eval loss "
                    f"{summary.eval_loss:.4f}, {time.monotonic() - began:.0f} s",
                    file=sys.stderr,
                    flush=True,
                )


def mean_se(values: list[float]) -> tuple[float, float]:
    """Mean and standard error of the mean (nan for fewer than 2 values)."""
    if not values:
        return math.nan, math.nan
    if len(values) < 2:
        return values[0], math.nan
    return statistics.fmean(values), statistics.stdev(values) / math.sqrt(len(values))


def seeds_needed(changes: list[float], bound: float) -> str:
    """How many seeds the claim "paired change <= ``bound`` %" needs to be resolved (mean + 2 SE
    <= bound), if the per-seed changes keep the mean and standard deviation of ``changes``:
    the smallest n with ``mean + 2 sd / sqrt(n) <= bound``. "-" with fewer than 2 seeds, "none"
    when the mean itself is above the bound (no number of seeds resolves it)."""
    if len(changes) < 2:
        return "-"
    mean, sd = statistics.fmean(changes), statistics.stdev(changes)
    if mean >= bound:
        return "none (mean above)"
    return str(max(2, math.ceil((2.0 * sd / (bound - mean)) ** 2)))


def sd_cell(changes: list[float]) -> str:
    """Seed-to-seed standard deviation of the paired change, in percentage points."""
    return f"{statistics.stdev(changes):.2f}" if len(changes) > 1 else "-"


def paired_change(setting: Setting, reference: Setting | None) -> list[float]:
    """Per seed both have: ``100 (L / L_reference - 1)``, in percent."""
    if reference is None:
        return []
    mine, theirs = setting.seed_losses(), reference.seed_losses()
    return [100.0 * (mine[seed] / theirs[seed] - 1.0) for seed in sorted(mine) if seed in theirs]


def best_settings(settings: list[Setting]) -> list[Setting]:
    """Per method (in order of first appearance) the setting with the lowest mean held-out loss."""
    best: dict[str, Setting] = {}
    for setting in settings:
        mean = statistics.fmean(setting.seed_losses().values())
        current = best.get(setting.variant.name)
        if current is None or mean < statistics.fmean(current.seed_losses().values()):
            best[setting.variant.name] = setting
    return list(best.values())


def pm(mean: float, se: float, digits: int, unit: str = "") -> str:
    """``mean +- se`` (``se`` left out when nan)."""
    if math.isnan(mean):
        return "-"
    sign = "+" if unit == "%" else ""
    text = f"{mean:{sign}.{digits}f}{unit}"
    return text if math.isnan(se) else f"{text} +- {se:.{digits}f}{unit}"


def grid_table(settings: list[Setting], reference: Setting | None, bound: float) -> str:
    """Every method x learning rate: held-out loss and paired change, mean +- SE, its standard
    deviation over seeds and the seeds a claim of <= ``bound`` % would need."""
    rows = []
    for setting in settings:
        loss = mean_se(list(setting.seed_losses().values()))
        paired = paired_change(setting, reference)
        changes = [] if setting is reference else paired
        change = mean_se(paired)
        tails = [statistics.fmean(run.losses[-LOSS_TAIL:]) for run in setting.all_runs()]
        rows.append(
            [
                setting.variant.label,
                f"{setting.lr:g}",
                str(len(setting.runs)),
                f"{statistics.fmean(tails):.4f}",
                pm(*loss, 4),
                pm(*change, 2, "%"),
                sd_cell(changes),
                seeds_needed(changes, bound),
            ]
        )
    header = ["method", "peak lr", "seeds", "train loss", "eval loss (mean +- SE)"]
    header += ["vs dense AdamW, paired (mean +- SE)", "SD of paired change (points)"]
    header += [f"seeds to resolve <= +{bound:g}%"]
    return markdown_table(header, rows)


@dataclass(frozen=True)
class Point:
    """One method of the frontier, at its best learning rate."""

    setting: Setting
    per_token: dict[int, float]
    """Wire bytes a rank sends per token it trains, by world size (ring model)."""
    ratio: dict[int, float]
    """Dense fp32 ring all-reduce bytes / the method's, by world size."""
    step_time: float
    change: tuple[float, float]
    changes: tuple[float, ...] = ()
    """Paired change per seed, in percent (the seeds both this method and dense AdamW have)."""
    to_target: float = math.nan
    """Steps until the mean held-out curve reaches dense AdamW's final held-out loss (linear
    between evaluations; inf: never in the run)."""

    @property
    def ratio8(self) -> float:
        """The ratio at ``FRONTIER_WORLD``."""
        return self.ratio[FRONTIER_WORLD]


def frontier(
    args: argparse.Namespace, chosen: list[Setting], reference: Setting | None
) -> list[Point]:
    """Each chosen setting (one per method) with its bytes, step time and paired change."""
    tokens = args.batch_size * args.seq_length  # per rank per step (no accumulation)
    target = statistics.fmean(reference.seed_losses().values()) if reference else math.nan
    points = []
    for setting in chosen:
        last = setting.all_runs()[-1]
        times = [t for run in setting.all_runs() for t in run.step_times[WARMUP_SKIP:]]
        variant, paired = setting.variant, paired_change(setting, reference)
        points.append(
            Point(
                setting=setting,
                per_token={w: wire_at(last, variant, w) / tokens for w in FRONTIER_WORLDS},
                ratio={w: ring_ratio(last, variant, args.nproc, w) for w in FRONTIER_WORLDS},
                step_time=median_after(times, 0),
                change=mean_se(paired),
                changes=() if setting is reference else tuple(paired),
                to_target=steps_to(mean_curve(setting), target),
            )
        )
    return points


def mean_curve(setting: Setting) -> dict[int, float]:
    """Held-out loss by step, mean over the setting's runs."""
    by_step: dict[int, list[float]] = {}
    for run in setting.all_runs():
        for step, loss in run.eval_losses:
            by_step.setdefault(step, []).append(loss)
    return {step: statistics.fmean(losses) for step, losses in by_step.items()}


def _bytes_cell(value: float) -> str:
    if math.isnan(value):
        return "-"
    if math.isinf(value):
        return "not reached"
    return f"{value:.3g} B" if value < 1000 else human_bytes(value)


def frontier_table(points: list[Point], tokens: int, bound: float) -> str:
    """The frontier as a Markdown table (``tokens``: trained per rank per step; ``bound``: the
    claim, in percent, whose seeds needed are shown next to the paired change)."""
    rows = []
    for point in points:
        losses = list(point.setting.seed_losses().values())
        row = [point.setting.variant.label, f"{point.setting.lr:g}"]
        for world in FRONTIER_WORLDS:
            ratio = point.ratio[world]
            row += [_bytes_cell(point.per_token[world])]
            row += ["-" if math.isnan(ratio) else f"{ratio:.3g}x"]
        row += [f"{point.step_time:.2f}", pm(*mean_se(losses), 4), pm(*point.change, 2, "%")]
        row += [sd_cell(list(point.changes)), seeds_needed(list(point.changes), bound)]
        row += [_steps_cell(point.to_target)]
        row += [_bytes_cell(point.per_token[w] * tokens * point.to_target) for w in FRONTIER_WORLDS]
        rows.append(row)
    header = ["method (best lr)", "peak lr"]
    for world in FRONTIER_WORLDS:
        header += [f"wire bytes/token W={world}", f"ratio W={world}"]
    header += ["step s (median)", "eval loss (mean +- SE)", "vs dense AdamW, paired"]
    header += ["SD (points)", f"seeds to resolve <= +{bound:g}%"]
    header += ["steps to dense's loss"]
    header += [f"bytes a rank sends until then, W={world}" for world in FRONTIER_WORLDS]
    return markdown_table(header, rows)


def _steps_cell(steps: float) -> str:
    if math.isnan(steps):
        return "-"
    return "not reached" if math.isinf(steps) else f"{steps:,.0f}"


def curve_table(points: list[Point]) -> str:
    """Held-out loss by step (mean over seeds) of every frontier point; "" with one eval."""
    steps = sorted(
        {step for p in points for run in p.setting.all_runs() for step, _ in run.eval_losses}
    )
    if len(steps) < 2:
        return ""
    rows = []
    for point in points:
        by_step: dict[int, list[float]] = {}
        for run in point.setting.all_runs():
            for step, loss in run.eval_losses:
                by_step.setdefault(step, []).append(loss)
        cells = [f"{statistics.fmean(by_step[s]):.3f}" if s in by_step else "-" for s in steps]
        rows.append([point.setting.variant.label, f"{point.setting.lr:g}", *cells])
    header = ["method (best lr)", "peak lr", *(f"step {step:,}" for step in steps)]
    return markdown_table(header, rows)


def verdict(change: tuple[float, float], limit: float) -> str:
    """Met (mean + 2 SE within the limit), within but unresolved, or missed, with the numbers."""
    mean, se = change
    bound = mean + 2 * se if not math.isnan(se) else math.nan
    numbers = f"{pm(mean, se, 2, '%')} vs dense AdamW, target <= +{limit:g}%"
    if mean > limit:
        return f"{numbers}: MISSED by {mean - limit:.2f} points"
    if math.isnan(bound) or bound > limit:
        return f"{numbers}: mean within, not resolved (mean + 2 SE = {bound:+.2f}%)"
    return f"{numbers}: met (mean + 2 SE = {bound:+.2f}%)"


def check_targets(points: list[Point]) -> list[str]:
    """One line per frontier point the issues set a target for."""
    lines = []
    for point in points:
        if optimizer_of(point.setting.variant) in ("diloco", "sparseloco", "muloco"):
            lines.append(local_target(point))
            continue
        if math.isnan(point.change[0]) or point.setting.variant.name == "none":
            continue
        if point.setting.variant.name == "dct-0.5":
            limit = 0.2
        elif point.ratio8 >= 8.0:
            limit = 1.0
        else:
            continue
        lines.append(
            f"- {point.setting.variant.label} ({point.ratio8:.1f}x at W = {FRONTIER_WORLD}): "
            + verdict(point.change, limit)
        )
    return lines


def local_target(point: Point) -> str:
    """DiLoCo/SparseLoCo against the local-updates target: within 1% of dense AdamW at 1,000x
    fewer wire bytes per token at W = 8 and 100x at W = 64; says by how much a ratio falls
    short."""
    ratios = []
    for world, target in LOCAL_TARGETS.items():
        ratio = point.ratio[world]
        short = "" if ratio >= target else f", short by {target / ratio:.2g}x"
        ratios.append(f"{ratio:.3g}x at W = {world} (target {target:g}x{short})")
    label = f"- {point.setting.variant.label}: {'; '.join(ratios)}: "
    if math.isnan(point.change[0]):
        return label + "no paired loss"
    return label + verdict(point.change, 1.0)


def training_tokens(data_dir: Path, model: str = "") -> int:
    """Tokens in one epoch of the training files, counted as the trainer reads them (BOS, the
    document, EOS: ``training_data.document_tokens``)."""
    tokenizer = load_tokenizer(str(tokenizer_path(data_dir, model)))
    total = 0
    for file in sorted((data_dir / "c4").glob("*train*.json.gz")):
        with gzip.open(file, "rt", encoding="utf-8") as handle:
            for line in handle:
                total += len(document_tokens(tokenizer, json.loads(line).get("text")))
    return total


def epochs_line(args: argparse.Namespace) -> str:
    """How much of the training data a run saw."""
    trained = args.steps * args.nproc * args.batch_size * args.seq_length
    epoch = training_tokens(args.data_dir, args.model)
    return (
        f"Each run trains {trained:,} tokens ({args.steps} steps x {args.nproc} ranks x "
        f"{args.batch_size} x {args.seq_length}): {trained / epoch:.2f} epochs of the training "
        f"file's {epoch:,} tokens (--epochs {args.epochs})."
    )


def footnote(args: argparse.Namespace) -> str:
    """How the numbers were made, under the tables."""
    feedback = "off" if args.no_error_feedback else "on"
    model = args.model or "configs/llama-tiny/config.json (19.5M parameters)"
    seeds = ", ".join(str(seed) for seed in range(args.seed, args.seed + args.seeds))
    if args.tune_seed >= 0:
        seeds += f" (learning rates tuned at seed {args.tune_seed}, which the frontier leaves out)"
    eval_tokens = args.nproc * args.eval_batches * args.batch_size * args.seq_length
    rates = ",".join(f"{name}={lr:g}" for name, lr in args.method_lrs.items())
    fixed = f", fixed rates {rates}" if rates else ""
    return (
        f"Model {model}, {args.nproc} ranks (gloo, loopback, CPU), {args.steps} steps of "
        f"{args.nproc} x {args.batch_size} x {args.seq_length} tokens, seeds {seeds} (model "
        f"init and data order), peak lr grids AdamW {args.adamw_lrs or args.learning_rate}, "
        f"DeMo {args.demo_lrs}, DiLoCo/SparseLoCo inner AdamW "
        f"{args.local_lrs or args.adamw_lrs or args.learning_rate} (outer steps at the papers' "
        f"defaults){fixed}, up to {args.epochs} epoch(s) of the training file "
        f"(warmup {args.warmup_steps}, cosine to {args.min_lr_ratio:.3g} x "
        f"peak at the last step), weight decay 0.1 (decoupled, matrices only), error feedback "
        f"{feedback}, compression from step {args.compression_start_step}, {args.repeats} "
        "run(s) per setting and seed.\n"
        f"Eval loss: mean over {eval_tokens:,} held-out tokens ({args.nproc} x "
        f"{args.eval_batches} x {args.batch_size} windows of {args.seq_length}) of the C4 "
        "validation sample after the last step; the same windows for every run. Paired change: "
        "per seed 100 (L / L_dense - 1) against dense AdamW (`none`) at its best lr, then mean "
        "+- standard error over seeds; SD: the standard deviation of the per-seed changes; "
        f"seeds to resolve <= +{args.bound:g}%: the smallest n with mean + 2 SD / sqrt(n) <= "
        "the bound at this mean and SD (none: the mean is above it). Best lr: lowest mean eval "
        "loss over the same seeds, "
        "or at the tuning seed with --tune-seed (every optimizer gets the same number of grid "
        "points). Wire bytes per token: what a rank sends per step under the ring model "
        "(all-reduce of S bytes: 2 (W - 1) / W x S; all-gather of p bytes: (W - 1) x p), from "
        f"the payload measured at W = {args.nproc} (DiLoCo and SparseLoCo: averaged over the "
        f"last H steps, one sync), divided by the {args.batch_size * args.seq_length} tokens a "
        "rank trains per step; ratio: dense fp32 ring all-reduce / method at that W. Step time: "
        "median over steps after the first "
        f"{WARMUP_SKIP}, all runs; this shared 2-core machine varies by about +-30% run to run."
    )


MARKERS = {
    "adamw": ("o", "tab:blue", "AdamW on compressed gradients"),
    "demo": ("s", "tab:red", "DeMo"),
    "diloco": ("^", "tab:green", "DiLoCo"),
    "sparseloco": ("v", "tab:purple", "SparseLoCo"),
    "muloco": ("D", "tab:orange", "MuLoCo"),
}
"""Marker, colour and legend label per optimizer in the PNG."""


def draw(points: list[Point], reference: Setting | None, path: Path) -> None:
    """The frontier PNG: paired change against wire bytes per token at each of
    ``FRONTIER_WORLDS`` (one panel each, log x); the legend names only the optimizers drawn."""
    figure, axes = plt.subplots(1, len(FRONTIER_WORLDS), figsize=(13, 5), constrained_layout=True)
    for axis, world in zip(axes, FRONTIER_WORLDS, strict=True):
        _panel(axis, points, reference, world)
    drawn = {optimizer_of(p.setting.variant) for p in points if p.setting is not reference}
    handles = [
        Line2D([], [], marker=marker, color=colour, linestyle="none", label=label)
        for name, (marker, colour, label) in MARKERS.items()
        if name in drawn
    ]
    figure.legend(handles=handles, loc="outside lower center", ncol=len(handles) or 1)
    figure.suptitle("compression frontier: held-out loss change against wire bytes per token")
    figure.savefig(path, dpi=120)
    plt.close(figure)


def _panel(axis: plt.Axes, points: list[Point], reference: Setting | None, world: int) -> None:
    """One world size's panel of :func:`draw`."""
    axis.axhline(0.0, color="black", linewidth=1, label="dense AdamW (none)")
    axis.axhline(1.0, color="grey", linestyle="--", linewidth=1, label="+1%")
    for point in points:
        x = point.per_token[world]
        if point.setting is reference or math.isnan(x):
            continue
        mean, se = point.change
        marker, colour, _ = MARKERS[optimizer_of(point.setting.variant)]
        axis.errorbar(
            x, mean, yerr=0.0 if math.isnan(se) else se, fmt=marker, color=colour, capsize=4
        )
        axis.annotate(
            f"{point.setting.variant.name} (lr {point.setting.lr:g})",
            (x, mean),
            textcoords="offset points",
            xytext=(6, 6),
            fontsize=7,
        )
    dense = next((p for p in points if p.setting is reference), None)
    if dense is not None:
        axis.axvline(
            dense.per_token[world], color="black", linestyle=":", linewidth=1,
            label="dense AdamW wire bytes",
        )  # fmt: skip
    axis.set_xscale("log")
    axis.set_xlabel(f"wire bytes per rank per trained token at W = {world} (ring model, log)")
    axis.set_ylabel("held-out loss vs dense AdamW (%, paired by seed, +- SE)")
    axis.legend(loc="best", fontsize=8)


def dense_reference(settings: list[Setting]) -> Setting | None:
    """Dense AdamW (``none``) at its best learning rate among ``settings``."""
    dense = [s for s in settings if s.variant.name == "none" and s.runs]
    return best_settings(dense)[0] if dense else None


def report(args: argparse.Namespace, settings: list[Setting]) -> tuple[str, list[Point]]:
    """The grid and frontier tables, the footnote and the target checks."""
    grid = [s for s in settings if s.runs]
    chosen = best_settings(grid)
    title = "Grid (every method at every learning rate):"
    if args.tune_seed >= 0:
        grid = [s.at([args.tune_seed]) for s in settings if args.tune_seed in s.runs]
        picked = {(s.variant.name, s.lr) for s in best_settings(grid)}
        seeds = range(args.seed, args.seed + args.seeds)
        chosen = [s.at(seeds) for s in settings if (s.variant.name, s.lr) in picked]
        chosen = [s for s in chosen if s.runs]
        title = f"Grid at the tuning seed {args.tune_seed} (every method at every learning rate):"
    reference = dense_reference(chosen)
    points = frontier(args, chosen, reference)
    text = f"{title}\n\n" + grid_table(grid, dense_reference(grid), args.bound)
    text += "\n\nFrontier (each method at its best learning rate):\n\n"
    tokens = args.batch_size * args.seq_length
    text += (
        frontier_table(points, tokens, args.bound)
        + "\n\n"
        + footnote(args)
        + "\n"
        + epochs_line(args)
        + "\n"
    )
    curves = curve_table(points)
    if curves:
        text += "\nHeld-out loss by step (mean over seeds), each method at its best lr:\n\n"
        text += curves + "\n"
    targets = check_targets(points)
    if targets:
        text += "\nTargets:\n" + "\n".join(targets) + "\n"
    return text, points


def check_nodes(args: argparse.Namespace) -> None:
    """Exit with a one-line error unless --nodes divides --nproc."""
    if args.nodes < 1 or args.nproc % args.nodes:
        sys.exit(f"error: --nodes {args.nodes} must divide --nproc {args.nproc}")


def main(argv: list[str]) -> int:
    """Run the benchmark and print (and optionally write) the tables; returns the exit status."""
    args = parse_args(argv)
    check_data(args.data_dir)
    check_nodes(args)
    variants = pick_variants(args.methods, args.block_size)
    settings = [Setting(v, lr) for v in variants for lr in learning_rates(args, v)]
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="bench-compression-"))
    began = time.monotonic()
    try:
        run_all(args, settings, work)
    except RuntimeError as exc:
        print(f"error: {exc} (run folders kept in {work})", file=sys.stderr)
        return 1
    if args.work_dir is None:
        shutil.rmtree(work, ignore_errors=True)
    text, points = report(args, settings)
    text += f"\nWall time: {(time.monotonic() - began) / 60:.1f} min.\n"
    print(text)
    if args.out:
        args.out.write_text(text)
    if args.png:
        dense = [p.setting for p in points if p.setting.variant.name == "none"]
        draw(points, dense[0] if dense else None, args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
