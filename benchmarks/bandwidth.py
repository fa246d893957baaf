"""Step time per compression method on a bandwidth-limited link between two "nodes".

Two network namespaces on this machine stand in for two nodes, joined by a veth pair whose two
ends are rate-limited with ``tc`` (token bucket filter, each direction). One torchrun agent runs
in each namespace (``--nnodes 2 --nproc_per_node 1``, c10d rendezvous on namespace A's veth
address), with ``GLOO_SOCKET_IFNAME`` set to the veth, so every gradient byte crosses the limited
link. All addresses (10.77.0.1, 10.77.0.2 by default) exist only inside the two namespaces; the
veth pair is created directly inside them, so the host's own network is never touched. The
namespaces are deleted on exit, including Ctrl-C, SIGTERM and exceptions.

The default per-step compute is small (2 windows of 128 tokens per rank, one thread per rank),
so that the step is dominated by communication, the regime gradient compression is for; the
table's footnote prints the setting. With tiny.toml's 4 x 256 tokens the forward and backward
pass alone takes seconds on this 2-core machine and hides most of the difference.

``--procs-per-node 2`` runs 2 ranks in each namespace (2 nodes x 2: loopback inside a node, the
limited veth between nodes), for the node-aware scope (``-node`` methods). ``--plan-tflops``
adds the step time the ``--dry-run`` communication plan predicts for each run.

Needs root (CAP_NET_ADMIN) and iproute2 (``ip``, ``tc``: ``apt-get install iproute2``).

Usage (from the repository root)::

    uv run python benchmarks/bandwidth.py
    uv run python benchmarks/bandwidth.py --links 100mbit --methods none,dct-0.125 --steps 10
    uv run python benchmarks/bandwidth.py --links 100mbit --procs-per-node 2 --steps 4 --warmup 2 \
        --methods none,dct-0.25-bf16,dct-0.25-bf16-node --plan-tflops 0.01365
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (
    DCT_HOOKS,
    REPO,
    SHARED_DATA,
    RunSummary,
    Variant,
    all_variants,
    check_data,
    data_args,
    hook_flags,
    human_bytes,
    kill_group,
    markdown_table,
    median_after,
    pick_variants,
    read_metrics,
    ring_ratio,
    start,
    summarise,
    train_env,
    wait_all,
)

from torchrun_ddp.compression import CompressionSettings, compression_settings
from torchrun_ddp.config_io import parse_config
from torchrun_ddp.model import load_model_config
from torchrun_ddp.plan.architecture import meta_model, model_flops_per_token, parameter_sizes
from torchrun_ddp.plan.communication import Topology, estimate, predicted_step_seconds

DEFAULT_METHODS = "none,fp16,powersgd-4,dct-0.125,dct-0.25-bf16,dct-0.03,dct-topk-2"
IP_TIMEOUT_S = 30.0
RDZV_PORT = 29400
PROBE_PORT = 5999
RATE_UNITS = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}


class SetupError(Exception):
    """The namespaces or the link could not be set up (message: one line, with the fix)."""


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add = parser.add_argument
    add("--methods", default=DEFAULT_METHODS, help=f"comma list of: {', '.join(all_variants())}")
    add("--links", default="100mbit,1gbit", help="comma list of tc rates (kbit/mbit/gbit), or off")
    add("--steps", type=int, default=12, help="timed optimizer steps per run, after the warm-up")
    add("--warmup", type=int, default=3, help="untimed first steps of every run")
    add("--seq-length", type=int, default=128, help="tokens per window (tiny.toml: 256)")
    add("--batch-size", type=int, default=2, help="windows per rank per step (tiny.toml: 4)")
    add("--block-size", type=int, default=64, help="DCT block length for dct and dct-topk")
    add("--repeats", type=int, default=1, help="runs per (link, method), interleaved")
    add("--procs-per-node", type=int, default=1, help="ranks per namespace (2: 2 nodes x 2)")
    add(
        "--plan-tflops",
        type=float,
        default=0.0,
        help="sustained training TFLOP/s per rank for the predicted step time (the --dry-run "
        "communication plan); 0: no prediction column",
    )
    add("--subnet", default="10.77.0", help="first three octets of the two veth addresses")
    add("--data-dir", type=Path, default=SHARED_DATA, help="offline C4 sample and tokenizer")
    add("--timeout-s", type=float, default=0.0, help="per-run limit; 0: 240 s + 60 s per step")
    add("--out", type=Path, default=None, help="also write the table to this file")
    return parser.parse_args(argv)


def rate_bits(spec: str) -> float:
    """``100mbit`` -> 1e8 bit/s; ``off`` -> 0 (no limit). Raises SystemExit on a bad spec."""
    if spec == "off":
        return 0.0
    match = re.fullmatch(r"(\d+(?:\.\d+)?)(kbit|mbit|gbit)", spec.lower())
    if match is None:
        sys.exit(f"error: bad link rate {spec!r}; use e.g. 100mbit, 1gbit or off")
    return float(match.group(1)) * RATE_UNITS[match.group(2)]


def ip(*args: str) -> None:
    """Run one ``ip``/``tc`` command (first arg); raises SetupError with its stderr on failure."""
    try:
        done = subprocess.run(
            args, capture_output=True, text=True, timeout=IP_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise SetupError(f"{' '.join(args)} failed: {exc}") from exc
    if done.returncode != 0:
        message = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "no message"
        raise SetupError(f"{' '.join(args)} failed: {message}")


def _quiet(*args: str) -> None:
    """Run a clean-up command, ignoring failure (the thing may already be gone)."""
    with contextlib.suppress(OSError, subprocess.TimeoutExpired):
        subprocess.run(args, capture_output=True, timeout=IP_TIMEOUT_S, check=False)


@dataclass
class TwoNodes:
    """Two namespaces joined by a veth pair; ``create`` builds them, ``destroy`` removes them."""

    subnet: str
    procs_per_node: int = 1
    tag: str = field(default_factory=lambda: str(os.getpid()))
    created: list[str] = field(default_factory=list)
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def names(self) -> tuple[str, str]:
        """Namespace names, unique per benchmark process."""
        return f"tddp-bw-a-{self.tag}", f"tddp-bw-b-{self.tag}"

    @property
    def ifaces(self) -> tuple[str, str]:
        """veth interface names in namespace A and B (at most 15 characters)."""
        return f"bwa{self.tag}"[:15], f"bwb{self.tag}"[:15]

    @property
    def addrs(self) -> tuple[str, str]:
        """The veth addresses of namespace A and B."""
        return f"{self.subnet}.1", f"{self.subnet}.2"

    def create(self) -> None:
        """Namespaces, the veth pair created inside them, addresses, links up.

        Raises SetupError (after which ``destroy`` removes whatever was made).
        """
        for name in self.names:
            ip("ip", "netns", "add", name)
            self.created.append(name)
        (ns_a, ns_b), (if_a, if_b) = self.names, self.ifaces
        veth = ["type", "veth", "peer", "name", if_b, "netns", ns_b]
        ip("ip", "link", "add", "name", if_a, "netns", ns_a, *veth)
        for ns, iface, addr in zip(self.names, self.ifaces, self.addrs, strict=True):
            ip("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", iface)
            ip("ip", "-n", ns, "link", "set", "lo", "up")
            ip("ip", "-n", ns, "link", "set", iface, "up")

    def shape(self, bits_per_s: float, rtt_ms: float = 0.0) -> None:
        """Limit each direction to ``bits_per_s`` with tbf on both veth ends (0: no limit) and,
        with ``rtt_ms``, delay each direction by half of it with netem in front of the tbf."""
        for ns, iface in zip(self.names, self.ifaces, strict=True):
            _quiet("tc", "-n", ns, "qdisc", "del", "dev", iface, "root")
            parent = ["root"]
            if rtt_ms > 0:
                delay = f"{rtt_ms / 2:g}ms"
                netem = ["qdisc", "add", "dev", iface, "root", "handle", "1:", "netem"]
                ip("tc", "-n", ns, *netem, "delay", delay, "limit", "100000")
                parent = ["parent", "1:1", "handle", "2:"]
            if bits_per_s <= 0:
                continue
            burst = str(max(65536, int(bits_per_s / 8 * 0.004)))
            rate = f"{int(bits_per_s)}bit"
            qdisc = ["qdisc", "add", "dev", iface, *parent, "tbf"]
            ip("tc", "-n", ns, *qdisc, "rate", rate, "burst", burst, "latency", "50ms")

    def destroy(self) -> None:
        """Kill what runs in the namespaces (all started here), delete them; idempotent."""
        for proc in self.procs:
            if proc.poll() is None:
                kill_group(proc)
        self.procs.clear()
        for name in reversed(self.created):
            _kill_namespace_pids(name)
            _quiet("ip", "netns", "del", name)
        self.created.clear()


def _kill_namespace_pids(name: str) -> None:
    """SIGKILL every process still inside namespace ``name`` (only this script starts any)."""
    try:
        command = ["ip", "netns", "pids", name]
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=IP_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return
    for pid in done.stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            continue


def preflight() -> str | None:
    """Why namespaces cannot be made here (one line), or None when they probably can."""
    if sys.platform != "linux":
        return "network namespaces need Linux"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` not found; install iproute2 (apt-get install iproute2)"
    if os.geteuid() != 0:
        return "creating network namespaces needs root (CAP_NET_ADMIN); run as root"
    return None


PROBE = """
import socket, sys, time
addr, port, nbytes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
if sys.argv[4] == "recv":
    srv = socket.create_server((addr, port))
    srv.settimeout(30)
    conn, _ = srv.accept()
    got, began = 0, None
    while chunk := conn.recv(1 << 20):
        began = began or time.monotonic()
        got += len(chunk)
    print(got * 8 / (time.monotonic() - began))
else:
    for _ in range(100):
        try:
            conn = socket.create_connection((addr, port), timeout=30)
            break
        except OSError:
            time.sleep(0.1)
    conn.sendall(bytes(nbytes))
    conn.close()
"""


def probe_link(nodes: TwoNodes, bits_per_s: float) -> float:
    """Measured TCP throughput B -> A in bit/s (about 2 s of data at the nominal rate)."""
    nbytes = int(min(max(bits_per_s, 1e8), 2e9) / 8 * 2)
    args = [nodes.addrs[0], str(PROBE_PORT), str(nbytes)]
    (ns_a, ns_b), python = nodes.names, [sys.executable, "-c", PROBE]
    recv = subprocess.Popen(
        ["ip", "netns", "exec", ns_a, *python, *args, "recv"],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        subprocess.run(
            ["ip", "netns", "exec", ns_b, *python, *args, "send"], timeout=60, check=True
        )
        out, _ = recv.communicate(timeout=60)
    finally:
        if recv.poll() is None:
            os.killpg(recv.pid, signal.SIGKILL)
    return float(out.strip() or "nan")


def train_args(args: argparse.Namespace, variant: Variant, output_dir: Path) -> list[str]:
    """``train.py`` arguments: tiny config, one thread, per-step records, minimal eval."""
    flags = ["--config", str(REPO / "configs" / "tiny.toml"), *data_args(args.data_dir)]
    flags += ["--output-dir", str(output_dir), "--no-resume", "--threads", "1"]
    flags += ["--overwrite-output-dir"]  # reruns replace the old run
    flags += ["--max-steps", str(args.warmup + args.steps), "--seq-length", str(args.seq_length)]
    flags += ["--batch-size", str(args.batch_size), "--log-every", "1", "--eval-every", "0"]
    flags += ["--eval-batches", "1", "--checkpoint-every", "0", "--timeout-s", "300"]
    flags += hook_flags(variant, "--compression-block-size", str(args.block_size), DCT_HOOKS)
    return [*flags, *variant.flags]


def node_command(nodes: TwoNodes, node: int, port: int, train: list[str]) -> list[str]:
    """``ip netns exec`` + torchrun agent ``node`` (0: namespace A, which hosts the rendezvous)."""
    return [
        "ip", "netns", "exec", nodes.names[node],
        sys.executable, "-m", "torch.distributed.run", "--nnodes=2",
        f"--nproc_per_node={nodes.procs_per_node}",
        "--rdzv_backend=c10d", f"--rdzv_endpoint={nodes.addrs[0]}:{port}",
        f"--rdzv_id=bw-{nodes.tag}-{port}", f"--rdzv_conf=is_host={int(node == 0)}",
        f"--local_addr={nodes.addrs[node]}",
        "--max_restarts=0", str(REPO / "train.py"), *train,
    ]  # fmt: skip


def run_once(
    args: argparse.Namespace, nodes: TwoNodes, variant: Variant, run_dir: Path, port: int
) -> RunSummary:
    """One two-node training run of ``variant``; raises RuntimeError if it fails."""
    train = train_args(args, variant, run_dir)
    for node in (0, 1):
        env = train_env({"GLOO_SOCKET_IFNAME": nodes.ifaces[node], "OMP_NUM_THREADS": "1"})
        log = run_dir / f"node{node}.log"
        nodes.procs.append(start(node_command(nodes, node, port, train), log, env))
    timeout = args.timeout_s or 240.0 + 60.0 * (args.warmup + args.steps)
    codes = wait_all(nodes.procs, timeout)
    nodes.procs.clear()
    if any(code != 0 for code in codes):
        raise RuntimeError(f"{variant.name}: exit codes {codes}; see the logs in {run_dir}")
    return summarise(read_metrics(run_dir / "metrics.jsonl"))


@dataclass
class Cell:
    """The runs of one (link, method) pair."""

    runs: list[RunSummary] = field(default_factory=list)

    def step_time(self, warmup: int) -> float:
        """Median step time over the timed steps of all runs, seconds."""
        times = [t for run in self.runs for t in run.step_times[warmup:]]
        return median_after(times, 0)


@dataclass
class Results:
    """Every cell by (link spec, method name), and the measured throughput of every link."""

    cells: dict[tuple[str, str], Cell] = field(default_factory=dict)
    measured: dict[str, float] = field(default_factory=dict)


def run_matrix(
    args: argparse.Namespace, nodes: TwoNodes, variants: list[Variant], work: Path
) -> Results:
    """All (link, method) runs, ``--repeats`` rounds, links and methods interleaved."""
    results, port = Results(), RDZV_PORT
    links = [spec.strip() for spec in args.links.split(",") if spec.strip()]
    for repeat in range(args.repeats):
        for spec in links:
            nodes.shape(rate_bits(spec))
            if spec not in results.measured:
                results.measured[spec] = probe_link(nodes, rate_bits(spec))
            for variant in variants:
                port += 1
                began = time.monotonic()
                run_dir = work / f"{spec}-{variant.name}-r{repeat}"
                cell = results.cells.setdefault((spec, variant.name), Cell())
                cell.runs.append(run_once(args, nodes, variant, run_dir, port))
                print(
                    f"# {spec} {variant.name} (repeat {repeat + 1}): median step "
                    f"{median_after(cell.runs[-1].step_times, args.warmup):.2f} s, "
                    f"{time.monotonic() - began:.0f} s",
                    file=sys.stderr,
                    flush=True,
                )
    return results


def table(args: argparse.Namespace, variants: list[Variant], results: Results) -> str:
    """Markdown: wire bytes, ratio at the measured W and the ring ratio at W = 8 and 64, and per
    link the median step time, the speed-up over none and (``--plan-tflops``) the prediction."""
    links = list(results.measured)
    world = 2 * args.procs_per_node
    header = ["method", "wire bytes/step/rank", f"ratio W={world}", "ring W=8", "ring W=64"]
    for spec in links:
        header += [f"step s @ {spec}", f"vs none @ {spec}"]
        header += [f"predicted s @ {spec}"] if args.plan_tflops else []
    rows = []
    for variant in variants:
        first = results.cells[(links[0], variant.name)].runs[-1]
        ratio = first.comm_bytes_dense / first.comm_bytes if first.comm_bytes else float("nan")
        row = [variant.label, human_bytes(first.comm_bytes), f"{ratio:.1f}x"]
        for target in (8, 64):
            ring = ring_ratio(first, variant, world, target)
            row.append("-" if math.isnan(ring) else f"{ring:.2f}x")
        for spec in links:
            seconds = results.cells[(spec, variant.name)].step_time(args.warmup)
            row += [f"{seconds:.2f}", _speedup(args, results, spec, seconds)]
            if args.plan_tflops:
                predicted = predicted_step(args, variant, results.measured[spec])
                row.append(f"{predicted:.2f} ({100 * (predicted / seconds - 1):+.0f}%)")
        rows.append(row)
    return markdown_table(header, rows)


INTRA_NODE_BITS = 2e10
"""Loopback inside one namespace, bit/s: far above the veth rates, so hardly matters."""


def predicted_step(args: argparse.Namespace, variant: Variant, link_bits: float) -> float:
    """The step time ``train.py --dry-run`` predicts for ``variant`` on this setup: the
    communication plan (``torchrun_ddp.plan.communication``) with the measured link rate and
    ``--plan-tflops`` per rank for forward and backward of the tiny LLaMA."""
    config = load_model_config(str(REPO / "configs" / "llama-tiny" / "config.json"))
    sizes = parameter_sizes(meta_model(config))
    flops = model_flops_per_token(
        sum(sizes), config.num_hidden_layers, config.hidden_size, args.seq_length
    )
    compute_s = flops * args.batch_size * args.seq_length / (args.plan_tflops * 1e12)
    world = 2 * args.procs_per_node
    topo = Topology(world, args.procs_per_node, INTRA_NODE_BITS, link_bits or INTRA_NODE_BITS)
    settings = variant_settings(variant, args.block_size)
    return predicted_step_seconds(estimate(settings, sizes, topo), compute_s)


def variant_settings(variant: Variant, block_size: int) -> CompressionSettings:
    """The CompressionSettings a variant's ``train.py`` flags select (through the trainer's
    own parser, so the two cannot disagree)."""
    block = hook_flags(variant, "--compression-block-size", str(block_size), DCT_HOOKS)
    config = parse_config([*block, *variant.flags])
    return compression_settings(config)


def _speedup(args: argparse.Namespace, results: Results, spec: str, seconds: float) -> str:
    """``none``'s step time / this step time at link ``spec``, as ``3.1x`` (``-`` without none)."""
    reference = results.cells.get((spec, "none"))
    if reference is None:
        return "-"
    return f"{reference.step_time(args.warmup) / seconds:.2f}x"


def footnote(args: argparse.Namespace, results: Results) -> str:
    """How the numbers were made, and the measured link rates."""
    measured = ", ".join(
        f"{spec}: {bits / 1e6:.0f} Mbit/s" for spec, bits in results.measured.items()
    )
    return (
        f"Two network namespaces on one 2-core machine, {args.procs_per_node} rank(s) each "
        f"(torchrun --nnodes 2 --nproc_per_node {args.procs_per_node}, gloo over a veth pair "
        "between the namespaces, loopback inside one, --threads 1), tiny LLaMA (19.5M "
        f"parameters), {args.batch_size} x {args.seq_length} tokens per rank per step. Link: tc "
        "tbf on both veth ends (each direction); measured TCP throughput before the runs: "
        f"{measured}. Step time: median over {args.steps} steps after {args.warmup} warm-up "
        f"steps, {args.repeats} run(s) per cell; wire bytes: what rank 0 sends per step under "
        "the ring model (all links; node-aware rows include the loopback reduce-scatter and "
        "all-gather inside the namespace); ring W=8/64: the ratio the same payload gives at 8 "
        "and 64 ranks (all-gather methods fall as 2/W; node-aware: -). All ranks share 2 cores "
        "with whatever else runs here, so step times vary by about +-30% from run to run."
        + _prediction_note(args)
    )


def _prediction_note(args: argparse.Namespace) -> str:
    """The footnote's sentence on the predicted column (empty without --plan-tflops)."""
    if not args.plan_tflops:
        return ""
    return (
        " Predicted: the --dry-run communication plan (plan.communication) at the measured link "
        f"rate, compute at --plan-tflops {args.plan_tflops:g} TFLOP/s per rank; in brackets "
        "its difference from the measured step."
    )


def check_target(args: argparse.Namespace, variants: list[Variant], results: Results) -> list[str]:
    """The issue's target: dct at >= 8x is >= 3x faster per step than none at 100 Mbit/s."""
    spec = next((s for s in results.measured if rate_bits(s) == 1e8), None)
    if spec is None or (spec, "none") not in results.cells:
        return []
    lines = []
    none_time = results.cells[(spec, "none")].step_time(args.warmup)
    for variant in variants:
        run = results.cells[(spec, variant.name)].runs[-1]
        ratio = run.comm_bytes_dense / max(1, run.comm_bytes)
        if not variant.name.startswith("dct-0") or ratio < 8.0:
            continue
        speedup = none_time / results.cells[(spec, variant.name)].step_time(args.warmup)
        verdict = "met" if speedup >= 3.0 else f"MISSED ({speedup:.2f}x < 3x)"
        lines.append(f"- {variant.label} ({ratio:.1f}x) at {spec}: {speedup:.2f}x: {verdict}")
    return lines


def _raise_exit(signum: int, frame: FrameType | None) -> None:
    """SIGTERM -> SystemExit, so ``finally`` blocks remove the namespaces."""
    raise SystemExit(128 + signum)


def benchmark(args: argparse.Namespace, variants: list[Variant], work: Path) -> int:
    """Create the namespaces, run everything, print the table; always remove the namespaces."""
    nodes = TwoNodes(args.subnet, args.procs_per_node)
    atexit.register(nodes.destroy)
    previous = signal.signal(signal.SIGTERM, _raise_exit)
    try:
        nodes.create()
        results = run_matrix(args, nodes, variants, work)
    except SetupError as exc:
        print(f"bandwidth benchmark: cannot set up the two namespaces: {exc}", file=sys.stderr)
        return 1
    except RuntimeError as exc:
        print(f"bandwidth benchmark: a run failed: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("bandwidth benchmark: interrupted; namespaces removed", file=sys.stderr)
        return 130
    finally:
        nodes.destroy()
        signal.signal(signal.SIGTERM, previous)
    text = table(args, variants, results) + "\n\n" + footnote(args, results) + "\n"
    targets = check_target(args, variants, results)
    if targets:
        text += "\nTarget (dct >= 8x at least 3x faster than none at 100 Mbit/s):\n"
        text += "\n".join(targets) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0


def main(argv: list[str]) -> int:
    """Parse options, check the prerequisites, run; returns the exit status."""
    args = parse_args(argv)
    check_data(args.data_dir)
    variants = pick_variants(args.methods, args.block_size)
    for spec in args.links.split(","):
        rate_bits(spec.strip())
    reason = preflight()
    if reason is not None:
        print(f"bandwidth benchmark cannot run: {reason}", file=sys.stderr)
        return 1
    work = Path(tempfile.mkdtemp(prefix="bench-bandwidth-"))
    began = time.monotonic()
    status = benchmark(args, variants, work)
    if status == 0:
        shutil.rmtree(work, ignore_errors=True)
        print(f"Wall time: {(time.monotonic() - began) / 60:.1f} min.")
    else:
        print(f"run folders kept in {work}", file=sys.stderr)
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
