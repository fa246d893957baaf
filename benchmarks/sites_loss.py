"""Final held-out loss of fault-tolerant sites after a site is killed, against the spread of
seeds of uninterrupted runs.

For each seed, two runs of 2 sites x 1 rank (each its own torchrun job, a torchft lighthouse on
loopback, DiLoCo, the hidden-64 LLaMA of tests/distributed_harness.py on real C4 documents;
the launch of ``sites_goodput.py``), ``--steps`` steps each:

The site that starts first holds its join until the other is in its quorum (the sites' start
wait, ``--site-start-wait-s``), so that they begin together and the two runs of a seed are one
run until the kill.

- **uninterrupted**: nothing killed;
- **killed**: site 1's whole torchrun tree SIGKILLed once site 0 has logged a step drawn from
  the seed between 1/4 and 1/2 of the run, its checkpoint and output folders deleted (a new
  machine; ``--keep-disk`` keeps them), and started again ``--down-s`` later; site 0 trains on.

Both runs evaluate on held-out data (``--eval-batches`` batches) every ``--eval-every`` steps
(by default 1,000: the bottoms of tiny.toml's 1,000-step cosine cycles) and at the end. Prints,
per seed, the uninterrupted and the killed run's final held-out loss (site 0's; site 1's is
compared), the kill step, the steps site 1 missed (from the kill to its first step after it
healed) and the share of the uninterrupted run's windows the killed run trained, the
uninterrupted run's held-out loss after that share of its windows (interpolated linearly between
its evaluations: the loss at equal tokens), whether the two sites' final weights are
bit-identical, and whether each killed run's loss lies within the uninterrupted seeds' [min, max]
and within their mean +- 2 standard deviations.

Usage: uv run python benchmarks/sites_loss.py [--seeds 3] [--steps 2000] [--down-s 10]
    [--keep-disk] [--eval-batches 40] [--eval-every 1000] [--out DIR]
"""

from __future__ import annotations

import argparse
import itertools
import random
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # common, sites_goodput

from common import free_port, markdown_table
from safetensors.torch import load_file
from sites_goodput import env as train_env
from sites_goodput import kill_tree, launch, lighthouse_command, site_command, wait_listening
from sites_goodput import parse_args as goodput_args

from torchrun_ddp.metrics.records import read_records

Starter = Callable[[], subprocess.Popen[bytes]]


@dataclass
class Outcome:
    """One run's result: the final held-out loss of each site, whether their final weights
    are bit-identical, the step at which site 1 was killed (0: not killed), the steps it missed
    before it trained again, the run's steps, and site 0's held-out losses (step, loss)."""

    seed: int
    losses: tuple[float, float]
    equal: bool
    killed_at: int
    away: int = 0
    steps: int = 0
    curve: tuple[tuple[int, float], ...] = ()

    @property
    def windows(self) -> float:
        """The share of an uninterrupted run's windows (2 sites x its steps) this run trained."""
        return 1.0 - self.away / (2 * self.steps) if self.steps else 1.0


def eval_curve(out: Path) -> tuple[tuple[int, float], ...]:
    """The (step, eval_loss) records in ``out``'s metrics.jsonl, sorted by step (a step logged
    twice, before and after a restart, keeps its last loss)."""
    curve: dict[int, float] = {}
    for record in read_records(out / "metrics.jsonl"):
        step, loss = record.get("step"), record.get("eval_loss")
        if isinstance(step, int) and isinstance(loss, float):
            curve[step] = loss
    return tuple(sorted(curve.items()))


def final_loss(out: Path) -> float:
    """The last ``eval_loss`` in ``out``'s metrics.jsonl; ValueError where there is none."""
    curve = eval_curve(out)
    if not curve:
        raise ValueError(f"no eval_loss in {out / 'metrics.jsonl'}")
    return curve[-1][1]


def loss_at(curve: tuple[tuple[int, float], ...], step: float) -> float | None:
    """The held-out loss at ``step``, interpolated linearly between the evaluations of
    ``curve`` around it; None outside them."""
    for (left, low), (right, high) in itertools.pairwise(curve):
        if left <= step <= right:
            return low + (high - low) * (step - left) / (right - left)
    return curve[-1][1] if curve and curve[-1][0] == step else None


def newest_step(out: Path) -> int:
    """The newest training step in ``out``'s metrics.jsonl (0 before the first)."""
    steps = [r["step"] for r in read_records(out / "metrics.jsonl") if "loss" in r]
    return max((int(step) for step in steps if isinstance(step, int)), default=0)


def first_step_after(out: Path, step: int) -> int:
    """The first training step after ``step`` in ``out``'s metrics.jsonl (0 if none)."""
    steps = [r["step"] for r in read_records(out / "metrics.jsonl") if "loss" in r]
    return min((int(s) for s in steps if isinstance(s, int) and s > step), default=0)


def same_weights(base: Path) -> bool:
    """Whether the two sites' final models are bit-identical."""
    want = load_file(base / "out-0" / "final_model" / "model.safetensors")
    have = load_file(base / "out-1" / "final_model" / "model.safetensors")
    return want.keys() == have.keys() and all(have[k].equal(v) for k, v in want.items())


def within(value: float, spread: list[float]) -> tuple[bool, bool]:
    """Whether ``value`` lies in [min, max] of ``spread``, and within its mean +- 2 standard
    deviations (sample; 0 for one value)."""
    mean = statistics.fmean(spread)
    std = statistics.stdev(spread) if len(spread) > 1 else 0.0
    return min(spread) <= value <= max(spread), abs(value - mean) <= 2 * std


def run(args: argparse.Namespace, base: Path, seed: int, kill_at: int) -> Outcome:
    """Two sites for ``args.steps`` steps with ``seed``, beginning together (the start wait);
    site 1 killed once site 0 has logged ``kill_at`` (0: never) and started again
    ``args.down_s`` later."""
    flags = ["--seed", str(seed), "--max-steps", str(args.steps)]
    flags += ["--eval-batches", str(args.eval_batches), "--eval-every", str(args.eval_every)]
    port, logs = free_port(), [base / f"site-{site}.log" for site in (0, 1)]
    house = launch(lighthouse_command(args, port), base / "lighthouse.log", train_env())
    procs: list[subprocess.Popen[bytes]] = []
    try:
        wait_listening(port, house, "the lighthouse")
        procs = [_starter(args, base, site, port, flags, train_env())() for site in (0, 1)]
        if kill_at:
            restart = _starter(args, base, 1, port, flags, train_env())  # behind: joins at once
            _kill_and_return(args, base, procs, restart, kill_at)
        for proc, log in zip(procs, logs, strict=True):
            if proc.wait(timeout=args.timeout_s) != 0:
                raise RuntimeError(f"{log} ended with status {proc.returncode}")
    finally:
        for proc in [*procs, house]:
            if proc.poll() is None:
                kill_tree(proc)
    losses = (final_loss(base / "out-0"), final_loss(base / "out-1"))
    away = first_step_after(base / "out-1", kill_at) - kill_at - 1 if kill_at else 0
    curve = eval_curve(base / "out-0")
    return Outcome(seed, losses, same_weights(base), kill_at, away, args.steps, curve)


def _starter(
    args: argparse.Namespace,
    base: Path,
    site: int,
    port: int,
    flags: list[str],
    env: dict[str, str],
) -> Starter:
    """Starts site ``site``'s torchrun job (``sites_goodput.site_command`` with ``flags``) with
    ``env``."""
    command = site_command(args, base, site, port) + flags
    return lambda: launch(command, base / f"site-{site}.log", env)


def _kill_and_return(
    args: argparse.Namespace,
    base: Path,
    procs: list[subprocess.Popen[bytes]],
    start: Starter,
    kill_at: int,
) -> None:
    """Kill site 1 once site 0 has logged ``kill_at``, wipe its disk (unless --keep-disk),
    start it again ``--down-s`` later (``start``)."""
    deadline = time.monotonic() + args.timeout_s
    while newest_step(base / "out-0") < kill_at:
        if time.monotonic() > deadline or procs[0].poll() is not None:
            raise RuntimeError(f"site 0 did not reach step {kill_at}")
        time.sleep(0.05)
    kill_tree(procs[1])
    for folder in () if args.keep_disk else ("site-1", "out-1"):
        shutil.rmtree(base / folder, ignore_errors=True)
    time.sleep(args.down_s)
    procs[1] = start()


def rows(clean: list[Outcome], killed: list[Outcome]) -> list[list[str]]:
    """The table's rows, a seed each."""
    spread = [outcome.losses[0] for outcome in clean]
    table = []
    for plain, hit in zip(clean, killed, strict=True):
        span, sigma = within(hit.losses[0], spread)
        equal = loss_at(plain.curve, hit.windows * plain.steps)
        table.append([
            str(plain.seed), f"{plain.losses[0]:.4f}", f"{hit.losses[0]:.4f}",
            f"{hit.losses[1]:.4f}", str(hit.killed_at), str(hit.away), f"{hit.windows:.1%}",
            "-" if equal is None else f"{equal:.4f}",
            "yes" if hit.equal else "NO", "yes" if span else "no", "yes" if sigma else "no",
        ])  # fmt: skip
    return table


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """This benchmark's options, on top of ``sites_goodput.py``'s launch settings."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3, help="seeds 1 .. N")
    parser.add_argument(
        "--steps",
        type=int,
        default=2000,
        help="optimizer steps per run (long enough for site 1 "
        "to return and heal before site 0 ends: at about 25 steps/s, 80 s)",
    )
    parser.add_argument("--down-s", type=float, default=10.0, help="seconds site 1 stays down")
    parser.add_argument("--keep-disk", action="store_true", help="do not wipe site 1's folders")
    parser.add_argument("--eval-batches", type=int, default=40, help="held-out batches")
    parser.add_argument(
        "--eval-every",
        type=int,
        default=1000,
        help="steps between held-out evaluations (1000: the bottoms of tiny.toml's cosine cycles)",
    )
    parser.add_argument("--timeout-s", type=float, default=900.0, help="per run")
    parser.add_argument("--out", default="", help="a folder kept for inspection")
    own, rest = parser.parse_known_args(argv)
    launch_args = goodput_args(rest)
    for name, value in vars(own).items():
        setattr(launch_args, name, value)
    return launch_args


def main(argv: list[str] | None = None) -> None:
    """Run the seeds (each: uninterrupted, then killed) and print the table."""
    args = parse_args(argv)
    root = Path(args.out or tempfile.mkdtemp(prefix="sites-loss-"))
    clean, killed = [], []
    for seed in range(1, args.seeds + 1):
        kill_at = random.Random(seed).randint(args.steps // 4, args.steps // 2)
        for name, at, into in (("clean", 0, clean), ("killed", kill_at, killed)):
            base = root / f"seed-{seed}-{name}"
            base.mkdir(parents=True, exist_ok=True)
            into.append(run(args, base, seed, at))
            print(f"seed {seed} {name}: {into[-1]}", flush=True)
    header = [
        "seed", "uninterrupted", "killed: site 0", "killed: site 1", "kill at step",
        "site 1 away (steps)", "windows trained", "uninterrupted at equal windows",
        "sites bit-identical", "within [min, max]",
        "within mean +- 2 sd",
    ]  # fmt: skip
    print(markdown_table(header, rows(clean, killed)))
    spread = [outcome.losses[0] for outcome in clean]
    print(
        f"\nuninterrupted: {statistics.fmean(spread):.4f} +- "
        f"{statistics.stdev(spread) if len(spread) > 1 else 0.0:.4f} over seeds 1-{args.seeds}; "
        f"{args.steps} steps, site 1 {'kept' if args.keep_disk else 'wiped'} its disk and was "
        f"down {args.down_s:g} s; `uv run python benchmarks/sites_loss.py "
        f"{shlex.join(sys.argv[1:])}`; folders in {root}"
    )


if __name__ == "__main__":
    main()
