"""Wall-clock time to dense AdamW's held-out loss, per method, over a rate-limited link.

The question of a user with a few nodes on a slow link: how much sooner does a method reach the
loss I need? Two measurements answer it, each where it can be made:

1. **Steps to the target** come from the seeded frontier runs of ``benchmarks/compression.py``
   (``--frontier-dir``: its ``--work-dir``; give it again for another folder, such as runs laid
   out as 2 nodes x 2 ranks for the node-aware methods, whose held-out set differs). The target
   is dense AdamW's (``none``) mean held-out loss over the measured seeds at ``--target-step`` in
   the method's folder (the first that has runs of it); a method's steps to it are where its mean
   held-out curve over the same seeds first reaches it (linear between evaluations), or
   "not reached" within its run.
2. **Step time** on the link comes from short runs of every method in the two network
   namespaces of ``benchmarks/bandwidth.py`` (2 "nodes" x ``--procs-per-node`` ranks, tc tbf on
   the veth between them; ``--rtt-ms`` adds netem delay where the kernel has netem). The step
   time is the median after the warm-up steps, at the frontier's global batch (``--batch-size``
   per rank x all ranks of the timing runs = the frontier's 2 ranks x 4 windows by default).

Time to target = steps to target x step time. The table gives it per link with the speed-up over
dense, and, when ``off`` (no limit) is one of the ``--links``, the step time the ``--dry-run``
communication plan predicts on each limited link (its bandwidth model at the measured link rate,
with the method's own step time on the unlimited link as its compute time). DiLoCo's and
SparseLoCo's step time is the mean over whole sync periods (``--steps`` rounded up to them), so
that the sync counts once per ``H`` steps. ``--png`` draws held-out loss against wall-clock
seconds (each evaluation's step x the step time), one line per method, one panel per link.
``--end-to-end METHOD`` also runs METHOD's frontier run of ``--end-to-end-seed`` again, with its
recorded ``train.py`` arguments, on the first limited link; that run must have been laid out as
2 nodes (``compression.py --nodes 2``) like the namespaces, with as many ranks per node. It
reports the seconds of steps the run needed to reach the target on the link (every step, the
warm-up included) next to the composed estimate (that seed's steps to the target x the median
step time of the short run), and how far its held-out losses moved from the frontier run's (a
run laid out otherwise would not match), which checks the composition. ``--reuse`` keeps
timing runs already in the work folder that were made with identical arguments (the link is
probed again), so that the table can be composed again when more frontier runs have finished.

Needs root (CAP_NET_ADMIN) and iproute2, as ``bandwidth.py``. Usage (repository root)::

    uv run python benchmarks/time_to_loss.py --frontier-dir runs/frontier-1000 \\
        --methods none,demo-32,diloco-h50,sparseloco-h25 --links 100mbit,1gbit --rtt-ms 0 \\
        --out runs/time-to-loss.md --png runs/time-to-loss.png
"""

from __future__ import annotations

import argparse
import atexit
import json
import math
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from bandwidth import (
    INTRA_NODE_BITS,
    RDZV_PORT,
    SetupError,
    TwoNodes,
    node_command,
    probe_link,
    rate_bits,
)
from common import (
    ARGS_FILE,
    REPO,
    SHARED_DATA,
    RunSummary,
    Variant,
    data_args,
    made_with,
    markdown_table,
    median_after,
    pick_variants,
    read_metrics,
    start,
    steps_to,
    summarise,
    train_env,
    wait_all,
)
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

from torchrun_ddp.config_io import parse_config
from torchrun_ddp.dry_run import run_estimate
from torchrun_ddp.model import load_model_config
from torchrun_ddp.plan.communication import Topology, predicted_step_seconds
from torchrun_ddp.planning import trained_shapes

WALL_FILE = "wall_s.txt"
"""Each timing run's wall-clock seconds (start-up included), next to its ``ARGS_FILE``."""
Curve = dict[int, float]
"""Held-out loss by optimizer step (mean over seeds)."""


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add = parser.add_argument
    add(
        "--frontier-dir",
        type=Path,
        action="append",
        required=True,
        help="compression.py --work-dir (repeat: each method from the first with its runs)",
    )
    add("--tune-seed", type=int, default=42, help="the frontier's tuning seed (left out)")
    add("--target-step", type=int, default=1000, help="dense AdamW's loss at this step: target")
    add("--methods", default="none,demo-32,diloco-h50,sparseloco-h25", help="comma list")
    add("--links", default="100mbit,1gbit", help="comma list of tc rates (kbit/mbit/gbit)")
    add("--rtt-ms", type=float, default=0.0, help="added round-trip delay (netem), ms")
    add("--procs-per-node", type=int, default=2, help="ranks per namespace")
    add("--batch-size", type=int, default=2, help="windows per rank per step when timing")
    add("--seq-length", type=int, default=128, help="tokens per window (the frontier's)")
    add("--model", default="configs/tiny-models/llama/config.json", help="the frontier's model")
    add("--steps", type=int, default=8, help="timed steps per timing run, after the warm-up")
    add("--warmup", type=int, default=3, help="untimed first steps of every timing run")
    add("--end-to-end", default="", help="rerun this method's frontier run on the 1st limited link")
    add("--end-to-end-seed", type=int, default=43, help="the seed of that frontier run")
    add("--reuse", action="store_true", help="keep timing runs made with identical arguments")
    add("--data-dir", type=Path, default=SHARED_DATA, help="offline C4 sample and tokenizer")
    add("--subnet", default="10.77.0", help="first three octets of the two veth addresses")
    add("--out", type=Path, default=None, help="also write the table to this file")
    add("--png", type=Path, default=None, help="draw loss against wall-clock seconds here")
    return parser.parse_args(argv)


def seed_curves(frontier: Path, method: str, tune_seed: int) -> dict[int, Curve]:
    """Held-out curves of ``method``'s frontier runs by seed, every seed but ``tune_seed`` (the
    measured seeds, run at the method's best learning rate only). Exits with a one-line error
    when those runs have several learning rates (pass the tuning seed, or clean the folder)."""
    curves, rates = {}, set()
    for run in sorted(frontier.glob(f"{method}-lr*-s*-r0")):
        rate, seed = run.name.removeprefix(f"{method}-lr").rsplit("-s", 1)
        metrics = run / "metrics.jsonl"
        if int(seed.split("-")[0]) == tune_seed or not metrics.is_file():
            continue
        rates.add(rate)
        curves[int(seed.split("-")[0])] = dict(summarise(read_metrics(metrics)).eval_losses)
    if len(rates) > 1:
        sys.exit(
            f"error: {method}'s runs in {frontier} besides seed {tune_seed} have learning rates "
            f"{', '.join(sorted(rates))}; pass the frontier's --tune-seed"
        )
    return curves


def mean_curve(curves: list[Curve]) -> Curve:
    """The mean over seeds at the steps every curve has (empty without curves)."""
    if not curves:
        return {}
    steps = sorted(set.intersection(*(set(curve) for curve in curves)))
    return {step: sum(curve[step] for curve in curves) / len(curves) for step in steps}


@dataclass(frozen=True)
class Curves:
    """Each method's mean held-out curve over its seeds, the frontier folder it came from, its
    seeds, and its target: dense AdamW's mean held-out loss at ``--target-step`` in that folder
    over the same seeds (a method run at fewer seeds is compared with dense at those)."""

    by_method: dict[str, Curve]
    folder: dict[str, Path]
    seeds: dict[str, list[int]]
    targets: dict[str, float]

    def target(self, method: str) -> float:
        """``method``'s target (nan for a method without frontier runs)."""
        return self.targets.get(method, math.nan)


def load_curves(args: argparse.Namespace, variants: list[Variant]) -> Curves:
    """Every method's curves from the first ``--frontier-dir`` with its runs, at the seeds
    dense also has there; exits with a one-line error when that folder has no dense held-out
    loss at ``--target-step`` at those seeds."""
    curves = Curves({}, {}, {}, {})
    dense_by_folder: dict[Path, dict[int, Curve]] = {}
    for variant in variants:
        for path in args.frontier_dir:
            runs = seed_curves(path, variant.name, args.tune_seed)
            if not runs:
                continue
            if path not in dense_by_folder:
                dense_by_folder[path] = seed_curves(path, "none", args.tune_seed)
            dense = dense_by_folder[path]
            seeds = sorted(set(runs) & set(dense))
            curves.folder[variant.name], curves.seeds[variant.name] = path, seeds
            curves.by_method[variant.name] = mean_curve([runs[seed] for seed in seeds])
            curves.targets[variant.name] = dense_target(args, path, [dense[s] for s in seeds])
            break
    return curves


def timing_args(args: argparse.Namespace, variant: Variant, output: Path, steps: int) -> list[str]:
    """``train.py`` arguments of a run on the limited link (no evaluation unless end to end)."""
    flags = ["--config", str(REPO / "configs" / "tiny.toml"), *data_args(args.data_dir, args.model)]
    flags += ["--model", str(REPO / args.model), "--output-dir", str(output), "--no-resume"]
    flags += ["--overwrite-output-dir", "--threads", "1", "--max-steps", str(steps)]
    flags += ["--seq-length", str(args.seq_length), "--batch-size", str(args.batch_size)]
    flags += ["--log-every", "1", "--eval-every", "0", "--eval-batches", "1"]
    flags += ["--checkpoint-every", "0", "--timeout-s", "600", *variant.flags]
    return flags


def run_on_link(nodes: TwoNodes, train: list[str], run_dir: Path, port: int) -> float:
    """Run ``train`` as a 2-node job in the namespaces; returns its wall-clock seconds."""
    run_dir.mkdir(parents=True, exist_ok=True)
    began = time.monotonic()
    for node in (0, 1):
        env = train_env({"GLOO_SOCKET_IFNAME": nodes.ifaces[node], "OMP_NUM_THREADS": "1"})
        nodes.procs.append(
            start(node_command(nodes, node, port, train), run_dir / f"n{node}.log", env)
        )
    codes = wait_all(nodes.procs, 3600.0)
    nodes.procs.clear()
    if any(code != 0 for code in codes):
        raise RuntimeError(f"exit codes {codes}; see the logs in {run_dir}")
    return time.monotonic() - began


def overlapped_sync(variant: Variant) -> bool:
    """Whether ``variant`` is DiLoCo or SparseLoCo with ``--overlap-exchange``: its sync is
    waited for one window later, so the first window never waits."""
    return variant.period > 1 and "--overlap-exchange" in variant.flags


def timed_steps(args: argparse.Namespace, variant: Variant) -> int:
    """``--steps``, rounded up to whole sync periods for DiLoCo/SparseLoCo (every ``H``
    consecutive steps hold one sync), plus one more period for an overlapped sync."""
    periods = math.ceil(args.steps / variant.period) + overlapped_sync(variant)
    return periods * variant.period


def step_seconds(times: list[float], warmup: int, variant: Variant) -> float:
    """Median step time after ``warmup``; for DiLoCo/SparseLoCo the mean over whole periods,
    so that the sync step counts once per ``H`` steps (overlapped: over the periods after the
    first, whose last step waits for the previous sync, as every window's after it does)."""
    if variant.period == 1:
        return median_after(times, warmup)
    timed = times[variant.period + warmup :] if overlapped_sync(variant) else times[warmup:]
    return sum(timed) / len(timed)


@dataclass
class Timing:
    """Median step seconds by (link, method), each link's measured rate in bit/s, and the
    ``--dry-run`` plan's predicted step seconds by (link, method) (see :func:`predict`)."""

    seconds: dict[tuple[str, str], float]
    measured: dict[str, float]
    predicted: dict[tuple[str, str], float] = field(default_factory=dict)


def predict(args: argparse.Namespace, variants: list[Variant], timing: Timing) -> None:
    """Fill ``timing.predicted``: the communication plan (``dry_run.run_estimate``) at each
    link's measured rate, composed with the method's own step time on the unlimited link
    (``off`` in ``--links``) as its compute time; nothing without an ``off`` link."""
    if "off" not in timing.measured:
        return
    for variant in variants:
        flags = ["--model", str(REPO / args.model), "--seq-length", str(args.seq_length)]
        config = parse_config([*flags, "--batch-size", str(args.batch_size), *variant.flags])
        shapes = trained_shapes(config, load_model_config(config.model))
        compute_s = timing.seconds[("off", variant.name)]
        for spec, bits in timing.measured.items():
            if spec == "off":
                continue
            topo = Topology(2 * args.procs_per_node, args.procs_per_node, INTRA_NODE_BITS, bits)
            comm = run_estimate(config, shapes, topo)
            timing.predicted[(spec, variant.name)] = predicted_step_seconds(comm, compute_s)


def recorded(run_dir: Path, train: list[str]) -> bool:
    """Whether ``run_dir`` holds a finished run made with the ``train.py`` arguments ``train``
    (its arguments are saved only after it finished, and removed before a run starts)."""
    return (run_dir / "metrics.jsonl").is_file() and made_with(run_dir, train)


def run_recorded(nodes: TwoNodes, train: list[str], run_dir: Path, port: int) -> float:
    """:func:`run_on_link`, then save ``train`` and the wall clock in ``run_dir`` (for
    ``--reuse``); returns the wall-clock seconds."""
    (run_dir / ARGS_FILE).unlink(missing_ok=True)
    wall = run_on_link(nodes, train, run_dir, port)
    (run_dir / WALL_FILE).write_text(f"{wall}\n")
    (run_dir / ARGS_FILE).write_text(json.dumps(train))
    return wall


def timed_run(
    args: argparse.Namespace, nodes: TwoNodes, variant: Variant, run_dir: Path, port: int
) -> float:
    """Median step seconds of a short run of ``variant`` on the link as shaped now (with
    ``--reuse``, of the run already in ``run_dir`` when it was made with identical arguments)."""
    train = timing_args(args, variant, run_dir, args.warmup + timed_steps(args, variant))
    if not (args.reuse and recorded(run_dir, train)):
        run_recorded(nodes, train, run_dir, port)
    times = summarise(read_metrics(run_dir / "metrics.jsonl")).step_times
    return step_seconds(times, args.warmup, variant)


def time_steps(
    args: argparse.Namespace, nodes: TwoNodes, variants: list[Variant], work: Path
) -> Timing:
    """A short run of every method on every link, links and methods interleaved."""
    timing, port = Timing({}, {}), RDZV_PORT
    for spec in links(args):
        nodes.shape(rate_bits(spec), args.rtt_ms)
        timing.measured[spec] = probe_link(nodes, rate_bits(spec))
        for variant in variants:
            port += 1
            seconds = timed_run(args, nodes, variant, work / f"{spec}-{variant.name}", port)
            timing.seconds[(spec, variant.name)] = seconds
            print(f"# {spec} {variant.name}: {seconds:.3f} s/step", file=sys.stderr, flush=True)
    return timing


def table(variants: list[Variant], curves: Curves, timing: Timing, target_step: int) -> str:
    """Markdown: steps to the target, the compute-bound limit (those steps at dense AdamW's
    step time on the unlimited link, ``off``), and per link step time, time to target and the
    speed-up over dense, whose time to its own loss at ``target_step`` is ``target_step`` steps
    (at any method's seeds)."""
    header = ["method", "target (seeds)", "steps to target"]
    unlimited = timing.seconds.get(("off", "none"), math.nan)
    header += (
        ["compute-bound s (steps x dense's unlimited step)"] if "off" in timing.measured else []
    )
    for spec in timing.measured:
        header += [f"step s @ {spec}", f"time to target s @ {spec}", f"vs dense @ {spec}"]
        header += [f"predicted step s @ {spec}"] if timing.predicted and spec != "off" else []
    dense_steps = float(target_step)
    rows = []
    for variant in variants:
        curve = curves.by_method.get(variant.name)
        steps = steps_to(curve, curves.target(variant.name)) if curve else math.nan
        row = [variant.label, _target(curves, variant.name)]
        row += ["no frontier runs" if math.isnan(steps) else _steps(steps)]
        row += [_seconds(steps * unlimited)] if "off" in timing.measured else []
        for spec in timing.measured:
            seconds = timing.seconds[(spec, variant.name)]
            total = steps * seconds
            dense = dense_steps * timing.seconds.get((spec, "none"), math.nan)
            row += [f"{seconds:.3f}", _seconds(total), _speedup(dense, total)]
            if timing.predicted and spec != "off":
                predicted = timing.predicted[(spec, variant.name)]
                row.append(f"{predicted:.3f} ({100 * (predicted / seconds - 1):+.0f}%)")
        rows.append(row)
    return markdown_table(header, rows)


def targets_line(args: argparse.Namespace, curves: Curves) -> str:
    """Each method's target, seeds and frontier folder."""
    parts = []
    for name, target in curves.targets.items():
        parts.append(f"{name} {target:.4f} (seeds {_seeds(curves, name)}; {curves.folder[name]})")
    return (
        f"Targets, dense AdamW's mean held-out loss at step {args.target_step} over each "
        "method's seeds in its folder: " + "; ".join(parts) + "."
    )


def _target(curves: Curves, method: str) -> str:
    if method not in curves.targets:
        return "-"
    return f"{curves.targets[method]:.4f} ({_seeds(curves, method)})"


def _seeds(curves: Curves, method: str) -> str:
    return ", ".join(map(str, curves.seeds[method]))


def _steps(steps: float) -> str:
    return "not reached" if math.isinf(steps) else f"{steps:.0f}"


def _seconds(total: float) -> str:
    return "-" if math.isnan(total) or math.isinf(total) else f"{total:.0f}"


def _speedup(dense: float, total: float) -> str:
    if any(math.isnan(x) or math.isinf(x) for x in (dense, total)):
        return "-"
    return f"{dense / total:.2f}x"


MARKERS = "osv^D<>phX*P"
"""Line markers: with ``tab10``'s colours, twelve methods each get a colour-and-marker pair of
their own."""


def draw(path: Path, variants: list[Variant], curves: Curves, timing: Timing, step: int) -> None:
    """Held-out loss minus the method's target (dense AdamW's at ``step``, same seeds and
    held-out set) against wall-clock seconds, one line per method, one panel per link: a line
    crosses 0 where the method reaches dense's loss. Each method has its own colour (``tab10``)
    and marker; overlapped methods dashed; one legend for all panels, below them."""
    links = list(timing.measured)
    figure, axes = plt.subplots(
        1, len(links), figsize=(6 * len(links), 6), squeeze=False, constrained_layout=True
    )
    colours = plt.get_cmap("tab10").colors
    for axis, spec in zip(axes[0], links, strict=True):
        for index, variant in enumerate(variants):
            curve, target = curves.by_method.get(variant.name), curves.target(variant.name)
            if not curve:
                continue
            seconds = timing.seconds[(spec, variant.name)]
            points = [(n * seconds, loss - target) for n, loss in curve.items() if n > 0]
            style = "--" if "--overlap-exchange" in variant.flags else "-"
            axis.plot(
                *zip(*points, strict=True), style, color=colours[index % len(colours)],
                marker=MARKERS[index % len(MARKERS)], markersize=4, label=variant.label,
            )  # fmt: skip
        axis.axhline(0.0, color="grey", linestyle="--", linewidth=0.8)
        axis.set(title=f"link {spec}", xlabel="wall-clock seconds (log scale)")
        axis.set(ylabel=f"held-out loss - dense AdamW's at step {step} (nats/token)")
        _plain_log_ticks(axis)
    handles, labels = axes[0][0].get_legend_handles_labels()
    figure.legend(handles, labels, loc="outside lower center", ncol=3, fontsize=8)
    figure.savefig(path, dpi=120)
    plt.close(figure)


def _plain_log_ticks(axis: plt.Axes) -> None:
    """A log x axis labelled at 1, 2 and 5 of each decade in plain numbers (30, 50, 100, 200),
    minor ticks unlabelled, so no two labels overlap."""
    axis.set_xscale("log")
    axis.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    axis.xaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    axis.xaxis.set_minor_formatter(NullFormatter())


def frontier_run(curves: Curves, method: str, seed: int) -> Path:
    """The folder of ``method``'s frontier run at ``seed``; exits with a one-line error when
    there is none (or several)."""
    folder = curves.folder.get(method)
    runs = sorted(folder.glob(f"{method}-lr*-s{seed}-r0")) if folder else []
    if len(runs) != 1 or not (runs[0] / ARGS_FILE).is_file():
        sys.exit(
            f"error: --end-to-end {method} needs exactly one frontier run of it at seed {seed} "
            f"with recorded arguments; found {len(runs)} (set --end-to-end-seed)"
        )
    return runs[0]


def rerun_args(source: Path, output: Path) -> list[str]:
    """The recorded ``train.py`` arguments of the frontier run in ``source``, writing to
    ``output``, one thread per rank; exits with a one-line error unless it ran as 2 nodes."""
    flags = json.loads((source / ARGS_FILE).read_text())
    if flags[-2:] != ["#nodes", "2"]:
        sys.exit(
            f"error: the frontier run {source} was not laid out as 2 nodes; run "
            "benchmarks/compression.py with --nodes 2 and --nproc 2 x --procs-per-node"
        )
    flags = flags[:-2]
    flags[flags.index("--output-dir") + 1] = str(output)
    return [*flags, "--threads", "1", "--timeout-s", "600"]


def seconds_at(times: list[float], step: float) -> float:
    """Seconds of steps until fractional ``step`` (``times[i]``: step i + 1); inf if never."""
    if not step <= len(times):  # also nan and inf
        return math.inf
    whole = int(step)
    if whole == len(times):
        return sum(times)
    return sum(times[:whole]) + (step - whole) * times[whole]


def end_to_end(
    args: argparse.Namespace,
    nodes: TwoNodes,
    variant: Variant,
    work: Path,
    curves: Curves,
    step_s: float,
) -> str:
    """Run ``variant``'s frontier run of ``--end-to-end-seed`` again on the first limited link;
    compare its seconds to the target with the composed estimate (that seed's steps x
    ``step_s``)."""
    spec = first_limited_link(args)
    source = frontier_run(curves, variant.name, args.end_to_end_seed)
    run_dir = work / f"end-to-end-{source.name}"
    train = rerun_args(source, run_dir)
    nodes.shape(rate_bits(spec), args.rtt_ms)
    if not (args.reuse and recorded(run_dir, train)):
        run_recorded(nodes, train, run_dir, RDZV_PORT + 500)
    wall = float((run_dir / WALL_FILE).read_text())
    own, theirs = (summarise(read_metrics(d / "metrics.jsonl")) for d in (run_dir, source))
    line = (
        f"End to end: {variant.label}, seed {args.end_to_end_seed}, on {spec}: "
        f"{wall:.0f} s of wall clock (start-up and evaluations included). "
    )
    return line + compare_rerun(own, theirs, curves.target(variant.name), step_s)


def compare_rerun(own: RunSummary, theirs: RunSummary, target: float, step_s: float) -> str:
    """How the rerun ``own`` of the frontier run ``theirs`` on the link matches the
    composition: its held-out losses against the frontier run's, the seconds of all its steps
    against ``len(steps) x step_s``, and its seconds to ``target`` against the frontier run's
    steps to it x ``step_s``."""
    reference = dict(theirs.eval_losses)
    drift = max(
        (abs(loss - reference[s]) for s, loss in own.eval_losses if s in reference),
        default=math.nan,
    )
    count, spent = len(own.step_times), sum(own.step_times)
    text = (
        f"Largest held-out loss difference from the frontier run: {drift:.2e}. Its {count} "
        f"steps took {spent:.0f} s; composed: {count} x {step_s:.3f} s = {count * step_s:.0f} s "
        f"({100 * (spent / (count * step_s) - 1):+.0f}%). "
    )
    step = steps_to(dict(own.eval_losses), target)
    composed = steps_to(reference, target) * step_s
    if math.isinf(step) or math.isinf(composed):
        return text + f"It did not reach the target ({target:.4f})."
    measured = seconds_at(own.step_times, step)
    return text + (
        f"It reached the target ({target:.4f}) at step {step:.0f} after {measured:.0f} s of "
        f"steps; composed: {steps_to(reference, target):.0f} steps x {step_s:.3f} s = "
        f"{composed:.0f} s ({100 * (measured / composed - 1):+.0f}%)."
    )


def dense_target(args: argparse.Namespace, folder: Path, dense: list[Curve]) -> float:
    """Dense AdamW's mean held-out loss at ``--target-step`` over the curves ``dense`` (of
    ``folder``); exits with a one-line error when they have no such evaluation."""
    mean = mean_curve(dense)
    if args.target_step in mean:
        return mean[args.target_step]
    sys.exit(
        f"error: no dense (none) held-out loss at step {args.target_step} in {folder} at the "
        "seeds of the other method; run benchmarks/compression.py there with none at those "
        "seeds and an --eval-every that divides it"
    )


def measure(
    args: argparse.Namespace, variants: list[Variant], work: Path, curves: Curves
) -> tuple[Timing, str]:
    """Create the namespaces, time every method (and the end-to-end run), remove them."""
    nodes = TwoNodes(args.subnet, args.procs_per_node)
    atexit.register(nodes.destroy)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        nodes.create()
        timing = time_steps(args, nodes, variants, work)
        if not args.end_to_end:
            return timing, ""
        step_s = timing.seconds[(first_limited_link(args), args.end_to_end)]
        variant = next(v for v in variants if v.name == args.end_to_end)
        return timing, end_to_end(args, nodes, variant, work, curves, step_s)
    finally:
        nodes.destroy()


def first_limited_link(args: argparse.Namespace) -> str:
    """The first of ``--links`` that is not ``off``."""
    return next(spec for spec in links(args) if spec != "off")


def links(args: argparse.Namespace) -> list[str]:
    """``--links`` as a list."""
    return [spec.strip() for spec in args.links.split(",") if spec.strip()]


def check_args(args: argparse.Namespace, variants: list[Variant]) -> None:
    """Exit with a one-line error for an end-to-end method that is not timed, or without a
    limited link to run it on."""
    if not args.end_to_end:
        return
    if args.end_to_end not in {v.name for v in variants}:
        sys.exit(f"error: --end-to-end {args.end_to_end} must be one of --methods")
    if all(spec == "off" for spec in links(args)):
        sys.exit("error: --end-to-end needs a limited link in --links, such as 100mbit")


def main(argv: list[str]) -> int:
    """Read the frontier curves, time every method on every link, print the table."""
    args = parse_args(argv)
    variants = pick_variants(args.methods, 64)
    check_args(args, variants)
    curves = load_curves(args, variants)
    try:
        timing, extra = measure(args, variants, args.frontier_dir[0] / "time-to-loss", curves)
    except (SetupError, RuntimeError) as exc:
        print(f"time-to-loss benchmark: {exc}", file=sys.stderr)
        return 1
    predict(args, variants, timing)
    text = (
        table(variants, curves, timing, args.target_step)
        + "\n\n"
        + targets_line(args, curves)
        + "\n"
    )
    text += f"{extra}\n" if extra else ""
    print(text)
    if args.out:
        args.out.write_text(text)
    if args.png:
        draw(args.png, variants, curves, timing, args.target_step)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
