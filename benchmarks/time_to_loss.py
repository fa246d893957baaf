"""Wall-clock time to dense AdamW's held-out loss, per method, over a rate-limited link.

The question of a user with a few nodes on a slow link: how much sooner does a method reach the
loss I need? Two measurements answer it, each where it can be made:

1. **Steps to the target** come from the seeded frontier runs of ``benchmarks/compression.py``
   (``--frontier-dir``: its ``--work-dir``). The target is dense AdamW's (``none``) mean held-out
   loss over the measured seeds at ``--target-step``; a method's steps to it are where its mean
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
``--end-to-end METHOD`` also trains METHOD on the limited link to ``--target-step`` and reports
its measured wall clock next to the composed estimate, which checks the composition.

Needs root (CAP_NET_ADMIN) and iproute2, as ``bandwidth.py``. Usage (repository root)::

    uv run python benchmarks/time_to_loss.py --frontier-dir runs/frontier-1000 \\
        --methods none,demo-32,diloco-h50,sparseloco-h25 --links 100mbit,1gbit --rtt-ms 0 \\
        --out runs/time-to-loss.md --png runs/time-to-loss.png
"""

from __future__ import annotations

import argparse
import atexit
import itertools
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
    REPO,
    SHARED_DATA,
    Variant,
    data_args,
    markdown_table,
    median_after,
    pick_variants,
    read_metrics,
    start,
    summarise,
    train_env,
    wait_all,
)

from torchrun_ddp.compression.plan import Topology, predicted_step_seconds
from torchrun_ddp.config_io import parse_config
from torchrun_ddp.dry_run import run_estimate, trained_shapes
from torchrun_ddp.model import load_model_config

Curve = dict[int, float]
"""Held-out loss by optimizer step (mean over seeds)."""


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add = parser.add_argument
    add("--frontier-dir", type=Path, required=True, help="compression.py --work-dir")
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
    add("--end-to-end", default="", help="also train this method on the first link to target")
    add("--data-dir", type=Path, default=SHARED_DATA, help="offline C4 sample and tokenizer")
    add("--subnet", default="10.77.0", help="first three octets of the two veth addresses")
    add("--out", type=Path, default=None, help="also write the table to this file")
    add("--png", type=Path, default=None, help="draw loss against wall-clock seconds here")
    return parser.parse_args(argv)


def seed_curves(frontier: Path, method: str, tune_seed: int) -> list[Curve]:
    """Held-out curves of ``method``'s frontier runs at every seed but ``tune_seed`` (the
    measured seeds, run at the method's best learning rate only). Exits with a one-line error
    when those runs have several learning rates (pass the tuning seed, or clean the folder)."""
    curves, rates = [], set()
    for run in sorted(frontier.glob(f"{method}-lr*-s*-r0")):
        rate, seed = run.name.removeprefix(f"{method}-lr").rsplit("-s", 1)
        metrics = run / "metrics.jsonl"
        if int(seed.split("-")[0]) == tune_seed or not metrics.is_file():
            continue
        rates.add(rate)
        curves.append(dict(summarise(read_metrics(metrics)).eval_losses))
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


def steps_to(curve: Curve, target: float) -> float:
    """First step at which ``curve`` reaches ``target``, linear between evaluations; inf if it
    never does."""
    points = sorted(curve.items())
    if points and points[0][1] <= target:
        return float(points[0][0])
    for (step0, loss0), (step1, loss1) in itertools.pairwise(points):
        if loss1 <= target:  # loss0 > target: checked one pair earlier
            return step0 + (loss0 - target) / (loss0 - loss1) * (step1 - step0)
    return math.inf


def timing_args(args: argparse.Namespace, variant: Variant, output: Path, steps: int) -> list[str]:
    """``train.py`` arguments of a run on the limited link (no evaluation unless end to end)."""
    flags = ["--config", str(REPO / "configs" / "tiny.toml"), *data_args(args.data_dir)]
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


def timed_steps(args: argparse.Namespace, variant: Variant) -> int:
    """``--steps``, rounded up to whole sync periods for DiLoCo/SparseLoCo (every ``H``
    consecutive steps hold one sync)."""
    return math.ceil(args.steps / variant.period) * variant.period


def step_seconds(times: list[float], warmup: int, variant: Variant) -> float:
    """Median step time after ``warmup``; for DiLoCo/SparseLoCo the mean over whole periods,
    so that the sync step counts once per ``H`` steps."""
    if variant.period == 1:
        return median_after(times, warmup)
    timed = times[warmup:]
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


def time_steps(
    args: argparse.Namespace, nodes: TwoNodes, variants: list[Variant], work: Path
) -> Timing:
    """A short run of every method on every link, links and methods interleaved."""
    timing, port = Timing({}, {}), RDZV_PORT
    for spec in [s.strip() for s in args.links.split(",") if s.strip()]:
        nodes.shape(rate_bits(spec), args.rtt_ms)
        timing.measured[spec] = probe_link(nodes, rate_bits(spec))
        for variant in variants:
            port += 1
            run_dir = work / f"{spec}-{variant.name}"
            train = timing_args(args, variant, run_dir, args.warmup + timed_steps(args, variant))
            run_on_link(nodes, train, run_dir, port)
            times = summarise(read_metrics(run_dir / "metrics.jsonl")).step_times
            timing.seconds[(spec, variant.name)] = step_seconds(times, args.warmup, variant)
            print(f"# {spec} {variant.name}: {timing.seconds[(spec, variant.name)]:.3f} s/step",
                  file=sys.stderr, flush=True)  # fmt: skip
    return timing


def table(variants: list[Variant], curves: dict[str, Curve], target: float, timing: Timing) -> str:
    """Markdown: steps to the target, and per link step time, time to target and speed-up."""
    header = ["method", "steps to target"]
    for spec in timing.measured:
        header += [f"step s @ {spec}", f"time to target s @ {spec}", f"vs dense @ {spec}"]
        header += [f"predicted step s @ {spec}"] if timing.predicted and spec != "off" else []
    dense_steps = steps_to(curves.get("none", {}), target)
    rows = []
    for variant in variants:
        steps = steps_to(curves[variant.name], target) if curves.get(variant.name) else math.nan
        row = [variant.label, "no frontier runs" if math.isnan(steps) else _steps(steps)]
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


def _steps(steps: float) -> str:
    return "not reached" if math.isinf(steps) else f"{steps:.0f}"


def _seconds(total: float) -> str:
    return "-" if math.isnan(total) or math.isinf(total) else f"{total:.0f}"


def _speedup(dense: float, total: float) -> str:
    if any(math.isnan(x) or math.isinf(x) for x in (dense, total)):
        return "-"
    return f"{dense / total:.2f}x"


def draw(
    path: Path, variants: list[Variant], curves: dict[str, Curve], timing: Timing, target: float
) -> None:
    """Held-out loss against wall-clock seconds, one line per method, one panel per link."""
    links = list(timing.measured)
    figure, axes = plt.subplots(1, len(links), figsize=(6 * len(links), 4.5), squeeze=False)
    for axis, spec in zip(axes[0], links, strict=True):
        for variant in variants:
            curve = curves.get(variant.name)
            if not curve:
                continue
            seconds = timing.seconds[(spec, variant.name)]
            points = [(step * seconds, loss) for step, loss in curve.items() if step > 0]
            axis.plot(*zip(*points, strict=True), marker=".", label=variant.label)
        axis.axhline(target, color="grey", linestyle="--", linewidth=0.8)
        axis.set(title=f"link {spec}", xlabel="wall-clock seconds", ylabel="held-out loss")
        axis.set_xscale("log")
        axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def end_to_end(args: argparse.Namespace, nodes: TwoNodes, variant: Variant, work: Path) -> str:
    """Train ``variant`` on the first link to ``--target-step``; its wall clock and step time."""
    spec = next(s.strip() for s in args.links.split(",") if s.strip())
    nodes.shape(rate_bits(spec), args.rtt_ms)
    run_dir = work / f"end-to-end-{variant.name}"
    wall = run_on_link(
        nodes, timing_args(args, variant, run_dir, args.target_step), run_dir, RDZV_PORT + 500
    )
    times = summarise(read_metrics(run_dir / "metrics.jsonl")).step_times
    return (
        f"End to end: {variant.label}, {args.target_step} steps on {spec}: {wall:.0f} s wall "
        f"clock (start-up included), {sum(times):.0f} s in steps, median step "
        f"{median_after(times, args.warmup):.3f} s."
    )


def dense_target(args: argparse.Namespace, curves: dict[str, Curve]) -> float:
    """Dense AdamW's mean held-out loss at ``--target-step``; exits with a one-line error when
    the frontier has no such evaluation."""
    dense = curves.get("none") or {}
    if args.target_step in dense:
        return dense[args.target_step]
    sys.exit(
        f"error: no dense (none) held-out loss at step {args.target_step} in "
        f"{args.frontier_dir}; run benchmarks/compression.py with none and an --eval-every "
        "that divides it"
    )


def measure(args: argparse.Namespace, variants: list[Variant], work: Path) -> tuple[Timing, str]:
    """Create the namespaces, time every method (and the end-to-end run), remove them."""
    nodes = TwoNodes(args.subnet, args.procs_per_node)
    atexit.register(nodes.destroy)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        nodes.create()
        timing = time_steps(args, nodes, variants, work)
        if not args.end_to_end:
            return timing, ""
        return timing, end_to_end(args, nodes, pick_variants(args.end_to_end, 64)[0], work)
    finally:
        nodes.destroy()


def main(argv: list[str]) -> int:
    """Read the frontier curves, time every method on every link, print the table."""
    args = parse_args(argv)
    variants = pick_variants(args.methods, 64)
    curves = {
        v.name: mean_curve(seed_curves(args.frontier_dir, v.name, args.tune_seed)) for v in variants
    }
    target = dense_target(args, curves)
    try:
        timing, extra = measure(args, variants, args.frontier_dir / "time-to-loss")
    except (SetupError, RuntimeError) as exc:
        print(f"time-to-loss benchmark: {exc}", file=sys.stderr)
        return 1
    predict(args, variants, timing)
    text = table(variants, curves, target, timing)
    text += f"\n\nTarget: dense AdamW's mean held-out loss at step {args.target_step}: "
    text += f"{target:.4f}.\n" + (f"{extra}\n" if extra else "")
    print(text)
    if args.out:
        args.out.write_text(text)
    if args.png:
        draw(args.png, variants, curves, timing, target)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
