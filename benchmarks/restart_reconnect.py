"""Does a torchrun restart reconnect? Plain ``init_process_group`` against the project's
per-attempt store prefix (``distributed.attempt_store``), on torchrun's default shared store.

Each try runs ``torchrun --standalone --nproc_per_node 2 --max-restarts 1`` on this file in worker
mode: both ranks start a gloo group and all-reduce; in the first attempt rank 1 SIGKILLs itself
after 10 all-reduces. A try "recovered" when the restarted attempt finished (exit 0), "failed"
when torchrun gave up, "hung" when it ran past --timeout-s. Prints a Markdown table.

Usage: uv run python benchmarks/restart_reconnect.py [--tries 3] [--timeout-s 60]
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta

MODES = ("plain", "attempt-prefix")


def worker(mode: str) -> None:
    """One rank: a gloo group (plain, or on ``attempt_store``), then 30 all-reduces."""
    import torch  # noqa: PLC0415 - only the workers need torch
    import torch.distributed as dist  # noqa: PLC0415

    from torchrun_ddp.distributed import DistEnv, attempt_store  # noqa: PLC0415

    env, timeout = DistEnv.from_environ(), timedelta(seconds=30)
    if mode == "plain":
        dist.init_process_group("gloo", timeout=timeout)
    else:
        store, _ = attempt_store(env, timeout)
        dist.init_process_group(
            "gloo", store=store, rank=env.rank, world_size=env.world_size, timeout=timeout
        )
    for step in range(30):
        dist.all_reduce(torch.ones(8))
        if env.restart_count == 0 and env.rank == 1 and step == 10:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(0.05)
    dist.destroy_process_group()


def one_try(mode: str, timeout_s: float) -> tuple[str, float]:
    """Run one torchrun job; returns (outcome, seconds)."""
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
        "--max-restarts=1", __file__, "--worker", mode,
    ]  # fmt: skip
    started = time.monotonic()
    proc = subprocess.Popen(
        command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    try:
        status = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return "hung", time.monotonic() - started
    return ("recovered" if status == 0 else "failed"), time.monotonic() - started


def main() -> None:
    """Interleave the two modes over --tries and print one row per mode."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tries", type=int, default=3, help="jobs per mode")
    parser.add_argument("--timeout-s", type=float, default=60.0, help="a job past this is hung")
    parser.add_argument("--worker", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker)
        return
    results: dict[str, list[tuple[str, float]]] = {mode: [] for mode in MODES}
    for _ in range(args.tries):
        for mode in MODES:
            results[mode].append(one_try(mode, args.timeout_s))
    print("| process group | tries | recovered at the first restart | failed | hung | seconds |")
    print("|---|---:|---:|---:|---:|---|")
    for mode, rows in results.items():
        counts = [
            sum(outcome == name for outcome, _ in rows) for name in ("recovered", "failed", "hung")
        ]
        seconds = ", ".join(f"{s:.0f}" for _, s in rows)
        print(f"| {mode} | {len(rows)} | {counts[0]} | {counts[1]} | {counts[2]} | {seconds} |")


if __name__ == "__main__":
    main()
