"""Goodput under failures: fault-tolerant sites (``--fault-tolerance sites``) against today's
restart path (one torchrun job over the sites), a site killed every N seconds.

Three arms, interleaved within each round (``--rounds``), each ``--duration-s`` long, all on
loopback, all training the hidden-64 LLaMA of tests/distributed_harness.py (4,096 tokens; or
``--model``) with DiLoCo (``--local-steps``; or ``--optimizer adamw``: the gradients exchanged
every step), one rank per site and one torch thread:

- ``none``: a torchft lighthouse and 2 sites (each its own torchrun job), nothing killed;
- ``sites``: the same, site 1's whole torchrun tree SIGKILLed every ``--kill-every-s`` and started
  again ``--down-s`` later on the same folders (``--wipe``: its checkpoint and output folders
  deleted first); site 0's worker pids are checked unchanged;
- ``today``: one torchrun job over 2 agents ("nodes", ``--nnodes 2``, c10d rendezvous hosted by
  node 0's agent, ``--max-restarts`` the number of kills), plain DiLoCo (or DDP's AdamW) across
  the 2 ranks, the same kill schedule on node 1's agent tree: torchrun restarts the group, which
  resumes from the newest checkpoint.

Step records are stamped here, as they arrive: a thread tails the logs every 50 ms and stamps
each rank-0 ``step N | loss`` line with the monotonic clock (metrics.jsonl carries no time).
Goodput: the newest step logged by the end over the arm's duration (launch to end; a step
replayed after a restart counts once); for the sites, site 0's steps. Per fault: the steps site 0
(today: the job) logged again or skipped, and its stall; the sites' heals ("healed from a live
site ... X MiB in Y s") against the loopback bandwidth measured in the same round (a gloo
send/recv between 2 processes on 127.0.0.1).

Usage: uv run python benchmarks/sites_goodput.py [--duration-s 480] [--kill-every-s 120]
    [--down-s 20] [--rounds 1] [--arms none,sites,today] [--wipe] [--model PATH]
    [--optimizer diloco|adamw] [--train-flags "--compression dct ..."] [--out DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import json
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # common, when run by runpy

from common import REPO, SHARED_DATA, free_port, markdown_table

SMALL_LLAMA = "configs/tiny-models/llama-v4096/config.json"
"""tests/distributed_harness.py's SMALL_LLAMA (0.6M parameters), relative to the repository."""
SMALL_TOKENIZER = "configs/llama-8m"
"""Its 4,096-token tokenizer (also configs/llama-8m's own)."""
LIGHTHOUSE = Path(sys.executable).parent / "torchft_lighthouse"
ARMS = ("none", "sites", "today")
ARM_LABELS = {
    "none": "no failure (2 sites)",
    "sites": "fault-tolerant sites",
    "today": "today's restart path (1 job, 2 nodes)",
}
STEP_LINE = re.compile(r"\[rank 0\] step (\d+) \| loss")
HEAL_LINE = re.compile(r"sites: healed from a live site at sync (\d+): ([\d.]+) MiB in ([\d.]+) s")
NOT_COMMITTED = "not committed"
POLL_S = 0.05

Record = tuple[float, int]
"""(monotonic seconds when the line was read, step) of one logged training step."""
Stamped = tuple[float, str]
"""(monotonic seconds when the line was read, the line)."""


# -- counting (pure; tests/test_sites_goodput.py) ----------------------------------------------


def step_records(lines: Iterable[Stamped]) -> list[Record]:
    """The training steps of rank 0's log lines, in time order."""
    found = [(stamp, int(m.group(1))) for stamp, line in lines if (m := STEP_LINE.search(line))]
    return sorted(found)


def newest_step(records: list[Record], end: float) -> int:
    """The highest step logged at or before ``end`` (0 if none): replays count once."""
    return max((step for stamp, step in records if stamp <= end), default=0)


def goodput(records: list[Record], start: float, end: float) -> float:
    """Steps per second from ``start`` to ``end``: the newest step logged by ``end`` over the
    duration (a restart's replayed steps add nothing)."""
    return newest_step(records, end) / (end - start)


STEADY_FROM_S = 40.0
"""Seconds after an arm's launch before its steady rate is counted (imports, the sites' join)."""


def steady_rate(records: list[Record], begin: float, until: float) -> float:
    """Steps per second between the first and the last step record in ``[begin, until]``: the
    rate without faults or start-up (nan with fewer than 2 records there)."""
    inside = [record for record in records if begin <= record[0] <= until]
    if len(inside) < 2 or inside[-1][0] == inside[0][0]:
        return float("nan")
    (first, step_a), (last, step_b) = inside[0], inside[-1]
    return (step_b - step_a) / (last - first)


def normal_step_s(records: list[Record]) -> float:
    """The median gap in seconds between consecutive step records (nan with fewer than 2)."""
    gaps = [b[0] - a[0] for a, b in itertools.pairwise(records)]
    return statistics.median(gaps) if gaps else float("nan")


def longest_gap(records: list[Record], begin: float, until: float) -> float:
    """The longest gap in seconds between consecutive step records that overlaps ``[begin,
    until]``, in full (it may start before ``begin`` or end after ``until``); a gap still open
    after the last record counts to ``until``. 0 without records."""
    stamps = [stamp for stamp, _ in records]
    ends = [*stamps[1:], max(until, stamps[-1])] if stamps else []
    gaps = [b - a for a, b in zip(stamps, ends, strict=True) if b > begin and a < until]
    return max(gaps, default=0.0)


def steps_lost(records: list[Record], kill: float) -> int:
    """Steps a fault at ``kill`` cost: steps logged again after it (at or below the newest step
    logged before it) plus steps skipped (the first step beyond that newest one, less one)."""
    before = newest_step(records, kill)
    after = [step for stamp, step in records if stamp > kill]
    replayed = {step for step in after if step <= before}
    beyond = [step for step in after if step > before]
    skipped = max(0, beyond[0] - before - 1) if beyond else 0
    return len(replayed) + skipped


def recovery_s(records: list[Record], kill: float) -> float:
    """Seconds from ``kill`` until a step beyond the newest one logged before it is logged (inf
    if none is)."""
    before = newest_step(records, kill)
    later = [stamp for stamp, step in records if stamp > kill and step > before]
    return later[0] - kill if later else float("inf")


def heals(lines: Iterable[Stamped]) -> list[tuple[float, tuple[float, float]]]:
    """(when read, (MiB, seconds)) of every "healed from a live site" line."""
    found = ((stamp, HEAL_LINE.search(line)) for stamp, line in lines)
    return [(stamp, (float(m.group(2)), float(m.group(3)))) for stamp, m in found if m]


def kill_offsets(duration_s: float, every_s: float, down_s: float) -> list[float]:
    """Seconds after the start of each kill: every ``every_s``, as long as the restart
    ``down_s`` later falls before the end."""
    count = int((duration_s - down_s) // every_s) if every_s > 0 else 0
    offsets = [every_s * k for k in range(1, count + 1)]
    return [offset for offset in offsets if offset + down_s < duration_s]


def between(lines: list[Stamped], begin: float, until: float) -> list[Stamped]:
    """The lines read in ``(begin, until]``."""
    return [(stamp, line) for stamp, line in lines if begin < stamp <= until]


# -- processes ---------------------------------------------------------------------------------


class Tail:
    """A thread reading every watched log file every ``POLL_S`` and stamping each complete line
    with the monotonic clock as it arrives (``lines[path]``)."""

    def __init__(self) -> None:
        self.lines: dict[Path, list[Stamped]] = {}
        self._offsets: dict[Path, int] = {}
        self._partial: dict[Path, bytes] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def watch(self, path: Path) -> None:
        """Start reading ``path`` (from its current end, or its start if it does not exist)."""
        with self._lock:
            self.lines.setdefault(path, [])
            self._offsets.setdefault(path, path.stat().st_size if path.exists() else 0)
            self._partial.setdefault(path, b"")

    def read(self, path: Path) -> list[Stamped]:
        """The stamped lines of ``path`` so far (a copy)."""
        with self._lock:
            return list(self.lines.get(path, []))

    def stop(self) -> None:
        """Read once more, then stop the thread."""
        self._stop.set()
        self._thread.join(timeout=10)
        self._poll()

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            self._poll()

    def _poll(self) -> None:
        with self._lock:
            for path, offset in list(self._offsets.items()):
                data = b""
                with contextlib.suppress(FileNotFoundError), path.open("rb") as handle:
                    handle.seek(offset)
                    data = handle.read()
                if not data:
                    continue
                now = time.monotonic()
                self._offsets[path] = offset + len(data)
                *complete, self._partial[path] = (self._partial[path] + data).split(b"\n")
                text = (line.decode("utf-8", "replace") for line in complete)
                self.lines[path].extend((now, line) for line in text)


def descendants(pid: int) -> list[int]:
    """Every process below ``pid``, parents before their children, from Linux's
    ``/proc/<pid>/task/<tid>/children`` (a process that ends meanwhile is skipped)."""
    found: list[int] = []
    todo = [pid]
    while todo:
        for listing in Path(f"/proc/{todo.pop()}/task").glob("*/children"):
            with contextlib.suppress(OSError):
                children = [int(child) for child in listing.read_text().split()]
                found += children
                todo += children
    return found


def kill_tree(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL ``proc``, its process group and every process below it (the real fault: no
    process gets to close anything), then reap it."""
    below = descendants(proc.pid)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    for pid in [*below, proc.pid]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.wait(timeout=30)


def worker_pids(agent: int) -> list[int]:
    """The pids of a torchrun agent's workers (its children running train.py)."""
    found = []
    for pid in descendants(agent):
        with contextlib.suppress(OSError):
            if b"train.py" in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(pid)
    return sorted(found)


def launch(command: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    """Start ``command`` in its own session, its output appended to ``log``."""
    with log.open("ab") as handle:
        return subprocess.Popen(
            command, cwd=REPO, env=env, stdout=handle, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip


def listening(port: int) -> bool:
    """Whether something accepts connections on 127.0.0.1:``port``."""
    import socket  # noqa: PLC0415 - only here

    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def wait_until(deadline: float, alive: list[subprocess.Popen[bytes]]) -> None:
    """Sleep until the monotonic ``deadline``; raises RuntimeError if a process of ``alive``
    exits meanwhile (a run that should go on has failed)."""
    while time.monotonic() < deadline:
        for proc in alive:
            if proc.poll() is not None:
                raise RuntimeError(f"{proc.args[:4]} exited early with status {proc.returncode}")
        time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))


# -- the arms ----------------------------------------------------------------------------------


@dataclass
class ArmResult:
    """What one arm of one round measured (times: the monotonic clock)."""

    arm: str
    start: float
    end: float = 0.0
    kills: list[float] = field(default_factory=list)
    restarts: list[float] = field(default_factory=list)
    lines: list[Stamped] = field(default_factory=list)
    """Site 0's log lines (today: both nodes', merged)."""
    returning: list[Stamped] = field(default_factory=list)
    """Site 1's log lines (sites only)."""
    workers: list[list[int]] = field(default_factory=list)
    """Site 0's (today: node 0's) worker pids at each kill and at the end."""

    @property
    def records(self) -> list[Record]:
        """Site 0's step records (today: the job's)."""
        return step_records(self.lines)


def env() -> dict[str, str]:
    """The training processes' environment: offline, unbuffered, a rendezvous store per round
    (as run.sh sets it)."""
    extra = {"HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    return {**os.environ, **extra, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def train_args(args: argparse.Namespace, out: Path, checkpoints: Path) -> list[str]:
    """The train.py flags every arm shares, with its output and checkpoint folders
    (``--train-flags`` last: a comm hook, say, for AdamW's exchange in every arm)."""
    data = Path(args.data_dir)
    return [
        "--config", str(REPO / "configs" / "tiny.toml"), "--model", str(REPO / args.model),
        "--tokenizer", str(REPO / args.tokenizer),
        "--data-files", str(data / "c4" / "*train*.json.gz"),
        "--eval-files", str(data / "c4" / "*validation*.json.gz"),
        "--output-dir", str(out), "--checkpoint-dir", str(checkpoints),
        "--seq-length", str(args.seq_length), "--batch-size", str(args.batch_size),
        "--max-steps", "1000000",
        "--epochs", "1000",
        "--checkpoint-every", str(args.checkpoint_every), "--log-every", "1",
        "--eval-every", "0", "--eval-batches", "1", "--warmup-steps", "2", "--threads", "1",
        "--peak-tflops", "1", *method_flags(args), "--train-timeout-s", str(args.train_timeout_s),
        *shlex.split(args.train_flags),
    ]  # fmt: skip


def method_flags(args: argparse.Namespace) -> list[str]:
    """``--optimizer`` and, for DiLoCo, ``--local-steps``."""
    if args.optimizer == "adamw":
        return ["--optimizer", "adamw"]
    return ["--optimizer", "diloco", "--local-steps", str(args.local_steps)]


def torchrun(nnodes: int, port: int, extra: list[str], train: list[str]) -> list[str]:
    """``torchrun --nproc_per_node 1 --nnodes N`` (c10d rendezvous on 127.0.0.1:``port``)
    running this checkout's train.py."""
    return [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=1", f"--nnodes={nnodes}",
        "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}", "--monitor-interval=0.5",
        *extra, str(REPO / "train.py"), *train,
    ]  # fmt: skip


def pinned(args: argparse.Namespace, place: int, command: list[str]) -> list[str]:
    """``command`` under ``taskset`` on one core of this process's, core ``place`` (modulo
    their count), so that each site or node has a core of its own as on separate machines (a
    site alone does not speed up on its peer's core); unchanged with ``--no-pin`` or one core."""
    cores = sorted(os.sched_getaffinity(0))
    if not args.pin or len(cores) < 2:
        return command
    return ["taskset", "-c", str(cores[place % len(cores)]), *command]


def site_command(args: argparse.Namespace, base: Path, site: int, lighthouse: int) -> list[str]:
    """Site ``site``'s own torchrun job (folders ``base/site-<n>``, ``base/out-<n>``)."""
    train = train_args(args, base / f"out-{site}", base / f"site-{site}")
    train += [
        "--fault-tolerance", "sites", "--sites", "2", "--site-id", str(site),
        "--lighthouse", f"127.0.0.1:{lighthouse}", "--site-address", "127.0.0.1",
    ]  # fmt: skip
    return pinned(args, site, torchrun(1, free_port(), ["--max-restarts=0"], train))


def lighthouse_command(args: argparse.Namespace, port: int) -> list[str]:
    """The torchft lighthouse as run.sh starts it (one site is a quorum), on loopback."""
    return [
        str(LIGHTHOUSE), "--bind", f"127.0.0.1:{port}", "--min_replicas", "1",
        "--heartbeat_timeout_ms", str(args.heartbeat_timeout_ms),
        "--join_timeout_ms", str(args.join_timeout_ms),
    ]  # fmt: skip


def node_command(
    args: argparse.Namespace, base: Path, node: int, port: int, kills: int
) -> list[str]:
    """Node ``node`` of today's one job: a torchrun agent of one rank, its own checkpoint
    folder ``base/node-<n>``, the job's output in ``base/out``."""
    rdzv = [
        f"--max-restarts={kills}", "--rdzv-id=goodput",
        "--rdzv-conf=join_timeout=300,keep_alive_interval=1,keep_alive_max_attempt=3",
    ]  # fmt: skip
    command = torchrun(2, port, rdzv, train_args(args, base / "out", base / f"node-{node}"))
    return pinned(args, node, command)


def wait_listening(port: int, proc: subprocess.Popen[bytes], what: str) -> None:
    """Wait (up to 60 s) for ``proc`` to listen on ``port``; RuntimeError otherwise."""
    deadline = time.monotonic() + 60
    while not listening(port):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not start listening on port {port}")
        time.sleep(0.1)


@dataclass
class Killable:
    """The process of one site or node that the schedule kills and starts again."""

    start: Callable[[], subprocess.Popen[bytes]]
    wipe: list[Path]
    proc: subprocess.Popen[bytes] | None = None


def run_schedule(
    args: argparse.Namespace,
    result: ArmResult,
    victim: Killable,
    keep: list[subprocess.Popen[bytes]],
) -> None:
    """Kill ``victim`` every ``--kill-every-s`` (no kill in the ``none`` arm), start it again
    ``--down-s`` later, sampling ``keep[0]``'s worker pids at each kill; until the end."""
    offsets = kill_offsets(args.duration_s, args.kill_every_s, args.down_s)
    for offset in offsets if result.arm != "none" else []:
        wait_until(result.start + offset, keep)
        result.workers.append(worker_pids(keep[0].pid))
        assert victim.proc is not None
        kill_tree(victim.proc)
        result.kills.append(time.monotonic())
        for folder in victim.wipe if args.wipe else []:
            shutil.rmtree(folder, ignore_errors=True)
        wait_until(result.start + offset + args.down_s, keep)
        victim.proc = victim.start()
        result.restarts.append(time.monotonic())
    wait_until(result.start + args.duration_s, keep)
    result.workers.append(worker_pids(keep[0].pid))
    result.end = time.monotonic()


def run_sites(args: argparse.Namespace, base: Path, arm: str, tail: Tail) -> ArmResult:
    """The ``none`` or ``sites`` arm in ``base``: a lighthouse and 2 sites."""
    port, logs = free_port(), [base / f"site-{site}.log" for site in (0, 1)]
    for log in logs:
        tail.watch(log)
    house = launch(lighthouse_command(args, port), base / "lighthouse.log", env())
    procs: list[subprocess.Popen[bytes]] = [house]
    victim = Killable(
        lambda: launch(site_command(args, base, 1, port), logs[1], env()),
        [base / "site-1", base / "out-1"],
    )
    result = ArmResult(arm, 0.0)
    try:
        wait_listening(port, house, "the lighthouse")
        result.start = time.monotonic()
        procs.append(launch(site_command(args, base, 0, port), logs[0], env()))
        victim.proc = victim.start()
        run_schedule(args, result, victim, [procs[1], house])
    finally:
        for proc in [*procs[1:], victim.proc, house]:
            if proc is not None and proc.poll() is None:
                kill_tree(proc)
    result.lines, result.returning = tail.read(logs[0]), tail.read(logs[1])
    return result


def run_today(args: argparse.Namespace, base: Path, tail: Tail) -> ArmResult:
    """Today's arm in ``base``: one torchrun job over 2 agents, node 1 killed on schedule."""
    port, logs = free_port(), [base / f"node-{node}.log" for node in (0, 1)]
    for log in logs:
        tail.watch(log)
    kills = len(kill_offsets(args.duration_s, args.kill_every_s, args.down_s))
    result = ArmResult("today", time.monotonic())
    first = launch(node_command(args, base, 0, port, kills), logs[0], env())
    victim = Killable(
        lambda: launch(node_command(args, base, 1, port, kills), logs[1], env()),
        [base / "node-1"],
    )
    try:
        wait_listening(port, first, "node 0's rendezvous store")
        victim.proc = victim.start()
        run_schedule(args, result, victim, [first])
    finally:
        for proc in (victim.proc, first):
            if proc is not None and proc.poll() is None:
                kill_tree(proc)
    result.lines = sorted(tail.read(logs[0]) + tail.read(logs[1]))
    return result


# -- loopback bandwidth ------------------------------------------------------------------------


def bandwidth_worker(sizes: list[int], repeats: int) -> None:
    """One of 2 gloo ranks (torchrun-style environment): rank 0 sends rank 1 a uint8 tensor of
    each size ``repeats`` times after a barrier; rank 1 prints one JSON line per size with its
    receive times in seconds."""
    import torch  # noqa: PLC0415 - only the workers need torch
    import torch.distributed as dist  # noqa: PLC0415

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    for size in sizes:
        tensor = torch.ones(size, dtype=torch.uint8)
        seconds = []
        for _ in range(repeats):
            dist.barrier()
            began = time.perf_counter()
            if rank == 0:
                dist.send(tensor, 1)
            else:
                dist.recv(tensor, 0)
            seconds.append(time.perf_counter() - began)
        if rank == 1:
            print(json.dumps({"bytes": size, "seconds": seconds}), flush=True)
    dist.destroy_process_group()


def measure_bandwidth(args: argparse.Namespace, sizes: list[int]) -> dict[int, float]:
    """Bytes -> the median loopback bandwidth in MB/s (10^6 bytes) of a gloo send/recv between
    2 processes on 127.0.0.1 (on the sites' cores, see ``pinned``), ``--repeats`` times per
    size. Raises RuntimeError if a worker fails."""
    port = free_port()
    command = [sys.executable, __file__, "--bandwidth-worker", ",".join(map(str, sizes))]
    command += ["--repeats", str(args.repeats)]
    procs = []
    for rank in (0, 1):
        rank_env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank)}
        procs.append(
            subprocess.Popen(
                pinned(args, rank, command),
                env={**env(), **rank_env, "WORLD_SIZE": "2"},
                stdout=subprocess.PIPE,
                text=True,
                start_new_session=True,
            )
        )
    outputs = [proc.communicate(timeout=300)[0] for proc in procs]
    if any(proc.returncode for proc in procs):
        raise RuntimeError("the loopback bandwidth workers failed")
    found = [json.loads(line) for line in outputs[1].splitlines() if line.startswith("{")]
    return {int(f["bytes"]): f["bytes"] / statistics.median(f["seconds"]) / 1e6 for f in found}


# -- tables ------------------------------------------------------------------------------------


def goodput_rows(results: list[ArmResult], round_: int) -> list[list[str]]:
    """One row per arm of a round: duration, kills, newest step, site 0's steps/s and its ratio
    to the round's ``none`` and ``today`` arms, both sites' step records per second and their
    ratio to the ``none`` arm's, whether site 0 restarted."""
    rates = {r.arm: goodput(r.records, r.start, r.end) for r in results}
    both = {r.arm: _both_rate(r) for r in results}
    rows = []
    for result in results:
        rate = rates[result.arm]
        restarted = "-" if result.arm != "sites" else _restarted(result)
        rows.append([
            ARM_LABELS[result.arm], str(round_), f"{result.end - result.start:.0f}",
            str(len(result.kills)), str(newest_step(result.records, result.end)),
            f"{rate:.2f}", _ratio(rate, rates.get("none")), _ratio(rate, rates.get("today")),
            f"{both[result.arm]:.2f}", _ratio(both[result.arm], both.get("none")), restarted,
        ])  # fmt: skip
    return rows


def steady_rows(results: list[ArmResult], round_: int) -> list[list[str]]:
    """One row per arm of a round: site 0's (today: the job's) ``steady_rate`` from
    ``STEADY_FROM_S`` after launch to the first kill (or the end), and its ratio to the round's
    ``today`` arm's: the cost of a step across sites with no fault in the window."""
    rates = {
        r.arm: steady_rate(r.records, r.start + STEADY_FROM_S, min(r.kills, default=r.end))
        for r in results
    }
    return [
        [
            ARM_LABELS[r.arm],
            str(round_),
            f"{rates[r.arm]:.2f}",
            _ratio(rates[r.arm], rates.get("today")),
        ]
        for r in results
    ]


def _ratio(value: float, reference: float | None) -> str:
    """``value`` as a percentage of ``reference``; "-" where the round has no such arm."""
    return "-" if not reference else f"{value / reference:.0%}"


def _both_rate(result: ArmResult) -> float:
    """Step records of both sites per second (today: each step trains both ranks: twice the
    newest step); the tokens the sites trained, failed windows included."""
    if result.arm == "today":
        return 2 * goodput(result.records, result.start, result.end)
    both = len(result.records) + len(step_records(result.returning))
    return both / (result.end - result.start)


def _restarted(result: ArmResult) -> str:
    """Whether site 0's worker pids stayed the same at every kill and at the end."""
    samples = result.workers
    same = bool(samples) and bool(samples[0]) and all(s == samples[0] for s in samples)
    attempts = any("attempt 2" in line for _, line in result.lines)
    return "no (same pids)" if same and not attempts else "yes"


def fault_rows(result: ArmResult, round_: int) -> list[list[str]]:
    """One row per fault of an arm: when, site 0's (today: the job's) steps lost, seconds lost
    (sites: the longest gap between site 0's step records that overlaps the time from the kill
    to the restart, less its median gap; today: from the kill to a step beyond the newest
    before it), the sites' stall while site 1 comes back (the longest gap between site 0's
    step records after the restart, until the next kill, less the median gap), syncs not
    committed, and when site 1 logged a step again after its restart."""
    records, normal = result.records, normal_step_s(result.records)
    ends = [*result.kills[1:], result.end][: len(result.kills)]
    rows, faults = [], zip(result.kills, result.restarts, ends, strict=True)
    for number, (kill, restart, until) in enumerate(faults):
        seen = [record for record in records if record[0] <= until]
        row = [ARM_LABELS[result.arm], str(round_), str(number + 1), f"{kill - result.start:.0f}"]
        row.append(str(steps_lost(seen, kill)))
        if result.arm == "today":
            rows.append([*row, f"{recovery_s(seen, kill):.1f}", "-", "-", "-"])
            continue
        returned = [record for record in seen if record[0] >= restart]
        stalls = (longest_gap(records, kill, restart), longest_gap(returned, restart, until))
        failed = sum(NOT_COMMITTED in line for _, line in between(result.lines, kill, until))
        back = [stamp for stamp, _ in step_records(result.returning) if restart < stamp <= until]
        again = f"{back[0] - restart:.1f}" if back else "not by the next kill or the end"
        cells = [f"{max(0.0, stall - normal):.1f}" for stall in stalls]
        rows.append([*row, *cells, str(failed), again])
    return rows


def heal_rows(result: ArmResult, round_: int, bandwidth: dict[int, float]) -> list[list[str]]:
    """One row per heal of site 1 (its start's join included): when, MiB and seconds from its
    log line, the seconds its bytes take at the largest measured size's bandwidth and at the
    nearest size's, and the ratios."""
    largest = bandwidth[max(bandwidth)]
    rows = []
    for stamp, (mib, seconds) in heals(result.returning):
        size = mib * 2**20
        nearest = bandwidth[min(bandwidth, key=lambda b: abs(b - size))]
        expected = [size / (rate * 1e6) for rate in (largest, nearest)]
        rows.append([
            ARM_LABELS[result.arm], str(round_), f"{stamp - result.start:.0f}", f"{mib:.2f}",
            f"{seconds:.3f}", f"{expected[0]:.3f}", f"{seconds / expected[0]:.2f}",
            f"{expected[1]:.3f}", f"{seconds / expected[1]:.2f}",
        ])  # fmt: skip
    return rows


GOODPUT_HEADER = [
    "arm", "round", "seconds", "kills", "newest step", "steps/s (site 0; today: the job)",
    "vs no failure", "vs today's path", "both sites' step records/s", "vs no failure",
    "site 0 restarted",
]  # fmt: skip
STEADY_HEADER = [
    "arm", "round", f"steps/s from {STEADY_FROM_S:.0f} s to the first kill", "vs today's path"
]  # fmt: skip
FAULT_HEADER = [
    "arm", "round", "fault", "kill at s", "steps lost", "seconds lost",
    "stall while site 1 returns (s)", "syncs not committed", "site 1 steps again after s",
]  # fmt: skip
HEAL_HEADER = [
    "arm", "round", "at s", "MiB", "seconds", "bytes / largest bandwidth (s)", "ratio",
    "bytes / nearest size's bandwidth (s)", "ratio",
]  # fmt: skip


def print_tables(
    rounds: list[list[ArmResult]], bandwidths: list[dict[int, float]], footnote: str
) -> None:
    """The goodput, per-fault, healing and bandwidth tables of every round, then ``footnote``."""
    goodputs = [row for n, results in enumerate(rounds, 1) for row in goodput_rows(results, n)]
    faults = [row for n, rs in enumerate(rounds, 1) for r in rs for row in fault_rows(r, n)]
    healed = [
        row
        for n, (results, bandwidth) in enumerate(zip(rounds, bandwidths, strict=True), 1)
        for result in results
        for row in heal_rows(result, n, bandwidth)
    ]
    speeds = [
        [str(n), f"{size / 2**20:.0f}", f"{rate:.0f}"]
        for n, bandwidth in enumerate(bandwidths, 1)
        for size, rate in sorted(bandwidth.items())
    ]
    steady = [row for n, results in enumerate(rounds, 1) for row in steady_rows(results, n)]
    print("\n" + markdown_table(GOODPUT_HEADER, goodputs))
    print("\n" + markdown_table(STEADY_HEADER, steady))
    print("\n" + markdown_table(FAULT_HEADER, faults or [["-"] * len(FAULT_HEADER)]))
    print("\n" + markdown_table(HEAL_HEADER, healed or [["-"] * len(HEAL_HEADER)]))
    print("\n" + markdown_table(["round", "MiB sent", "MB/s (median)"], speeds))
    print(f"\n{footnote}")


# -- main --------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The benchmark's options (``--help``)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--duration-s", type=float, default=480.0, help="seconds per arm")
    add("--kill-every-s", type=float, default=120.0, help="a kill every this many seconds")
    add("--down-s", type=float, default=20.0, help="seconds a killed site stays down")
    add("--rounds", type=int, default=1, help="rounds of the arms, interleaved")
    add("--arms", default=",".join(ARMS), help=f"comma-separated subset of {','.join(ARMS)}")
    add("--wipe", action="store_true", help="delete the killed site's folders before its return")
    add("--model", default=SMALL_LLAMA, help="model config.json, relative to the repository")
    add("--tokenizer", default=SMALL_TOKENIZER, help="tokenizer folder, relative to the repository")
    add("--data-dir", default=str(SHARED_DATA), help="the offline data (c4/ under it)")
    add("--seq-length", type=int, default=32, help="tokens per window")
    add("--batch-size", type=int, default=1, help="windows per rank per step (micro-batch)")
    add("--optimizer", choices=("diloco", "adamw"), default="diloco", help="the method")
    add("--local-steps", type=int, default=2, help="DiLoCo's steps between syncs")
    add(
        "--train-flags",
        default="",
        help='more train.py flags for every arm, one string ("--compression dct ...")',
    )
    add("--checkpoint-every", type=int, default=200, help="steps between checkpoints (all arms)")
    add("--train-timeout-s", type=int, default=90, help="train.py's --train-timeout-s")
    add("--heartbeat-timeout-ms", type=int, default=5000, help="the lighthouse's (run.sh's)")
    add("--join-timeout-ms", type=int, default=60000, help="the lighthouse's (run.sh's)")
    add("--bandwidth-sizes", default="4194304,16777216,67108864", help="bytes, comma-separated")
    add("--repeats", type=int, default=5, help="send/recv repeats per size")
    add("--out", default="", help="a folder kept for inspection (default: a temporary one)")
    add("--no-pin", dest="pin", action="store_false", help="do not give each site a core")
    add("--report", default="", help="only print the tables of an earlier run's --out folder")
    add("--bandwidth-worker", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    unknown = set(args.arms.split(",")) - set(ARMS)
    if unknown:
        parser.error(f"--arms: unknown {sorted(unknown)[0]!r}; choose from {','.join(ARMS)}")
    return args


def run_round(args: argparse.Namespace, folder: Path, tail: Tail) -> list[ArmResult]:
    """Every chosen arm once, in ``folder/<arm>``, in ARMS order; each arm's result is also
    saved as ``folder/<arm>/result.json`` (``--report`` reads it)."""
    results = []
    for arm in (a for a in ARMS if a in args.arms.split(",")):
        base = folder / arm
        base.mkdir(parents=True, exist_ok=True)
        print(f"{time.strftime('%H:%M:%S')} {folder.name}: {arm}", file=sys.stderr, flush=True)
        runner = run_today if arm == "today" else lambda a, b, t, arm=arm: run_sites(a, b, arm, t)
        results.append(runner(args, base, tail))
        (base / RESULT).write_text(json.dumps(dataclasses.asdict(results[-1])))
    return results


RESULT = "result.json"
BANDWIDTH = "bandwidth.json"
FOOTNOTE = "footnote.md"


def load_result(path: Path) -> ArmResult:
    """An arm's result saved by ``run_round``."""
    saved = json.loads(path.read_text())
    for name in ("lines", "returning"):
        saved[name] = [(float(stamp), str(line)) for stamp, line in saved[name]]
    return ArmResult(**saved)


def report(folder: Path) -> None:
    """Print the tables of an earlier run's folder (its rounds' saved results)."""
    rounds, bandwidths = [], []
    for round_folder in sorted(folder.glob("round-*"), key=lambda p: int(p.name.split("-")[1])):
        saved = json.loads((round_folder / BANDWIDTH).read_text())
        bandwidths.append({int(size): float(rate) for size, rate in saved.items()})
        found = [round_folder / arm / RESULT for arm in ARMS]
        rounds.append([load_result(path) for path in found if path.is_file()])
    print_tables(rounds, bandwidths, (folder / FOOTNOTE).read_text())


def footnote(args: argparse.Namespace, argv: list[str], out: Path) -> str:
    """The command line and settings under the tables."""
    return (
        f"{time.strftime('%Y-%m-%d')}, `uv run python benchmarks/sites_goodput.py "
        f"{shlex.join(argv)}`; {args.duration_s:.0f} s per arm, a kill every "
        f"{args.kill_every_s:.0f} s, down {args.down_s:.0f} s{', wiped' if args.wipe else ''}, "
        f"{' '.join(method_flags(args)[1:])}, --checkpoint-every {args.checkpoint_every}, "
        f"{args.model}, seq {args.seq_length}, lighthouse heartbeat timeout "
        f"{args.heartbeat_timeout_ms} ms, join timeout {args.join_timeout_ms} ms, "
        f"{'each site (node) on a core of its own' if args.pin else 'cores shared'}; "
        f"folders in {out}"
    )


def main(argv: list[str] | None = None) -> None:
    """Run the rounds and print the tables (``--report``: only print an earlier run's)."""
    args = parse_args(argv)
    if args.bandwidth_worker:
        bandwidth_worker([int(s) for s in args.bandwidth_worker.split(",")], args.repeats)
        return
    if args.report:
        report(Path(args.report))
        return
    if not (Path(args.data_dir) / "c4").is_dir():
        sys.exit(f"error: no c4/ under {args.data_dir}; pass --data-dir (see ../shared/data)")
    out = Path(args.out or tempfile.mkdtemp(prefix="sites-goodput-")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    (out / FOOTNOTE).write_text(footnote(args, sys.argv[1:] if argv is None else argv, out))
    sizes = [int(size) for size in args.bandwidth_sizes.split(",")]
    tail = Tail()
    try:
        for number in range(1, args.rounds + 1):
            folder = out / f"round-{number}"
            folder.mkdir(parents=True, exist_ok=True)
            bandwidth = measure_bandwidth(args, sizes)
            (folder / BANDWIDTH).write_text(json.dumps(bandwidth))
            run_round(args, folder, tail)
    finally:
        tail.stop()
    report(out)


if __name__ == "__main__":
    main()
