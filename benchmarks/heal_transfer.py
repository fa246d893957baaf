"""The healing transfer of fault-tolerant sites against the wire: ``checkpoint.heal
.HealTransport`` (JSON, a safetensors file streamed piece by piece, its SHA-256 as a trailer,
over a gloo process group) between 2 processes, for states of several sizes, beside a plain gloo
send of the same bytes over the same link.

Links (``--links``): ``loopback`` (both ranks on 127.0.0.1, sharing this machine's cores), or a
tc rate such as ``10gbit`` or ``1gbit``: the two ranks in two network namespaces joined by a
rate-limited veth pair (``bandwidth.TwoNodes``; needs root and iproute2), as two sites joined by
a link of that rate.

Per link and size (MiB of fp32 tensors, 16 tensors of equal size, as a model's parameters and
moments): the receiver's transfer time (``Transfer.seconds``: from its first receive to the
state's tensors), the plain send's time of the same bytes in one message (the wire), their ratio
(the issue's target: within 1.2x), and the SHA-256 of those bytes on one core, which each side
must compute (it overlaps the wire, but on a link faster than it, it bounds the heal). Medians
over ``--repeats``.

Usage: uv run python benchmarks/heal_transfer.py [--links loopback,10gbit] [--sizes-mib 7,64,256]
       [--repeats 5] [--chunk-mib 4]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from common import free_port, markdown_table

from torchrun_ddp.checkpoint.heal import HealTransport
from torchrun_ddp.checkpoint.tensor_stream import layout

TENSORS = 16
TIMEOUT = timedelta(seconds=600)
STEP = 7


def state_of(mib: int) -> dict[str, object]:
    """A heal state of ``mib`` MiB: ``TENSORS`` fp32 tensors and a step, as a site sends."""
    numel = mib * 2**20 // 4 // TENSORS
    generator = torch.Generator().manual_seed(mib)
    tensors = {str(i): torch.randn(numel, generator=generator) for i in range(TENSORS)}
    return {"parameters": tensors, "step": STEP}


def _median_s(action: object, repeats: int) -> float:
    """Median seconds of ``repeats`` calls of ``action`` (a callable, after a barrier each)."""
    seconds = []
    for _ in range(repeats):
        dist.barrier()
        began = time.perf_counter()
        action()  # type: ignore[operator]
        seconds.append(time.perf_counter() - began)
    return statistics.median(seconds)


def _row(rank: int, mib: int, repeats: int, transport: HealTransport) -> dict[str, float]:
    """One size: the plain send of the file's bytes, the heal (rank 0 sends, rank 1 receives
    and records ``Transfer.seconds``) and the SHA-256 of the bytes on one core."""
    state = state_of(mib)
    tensors = state["parameters"]
    assert isinstance(tensors, dict)
    nbytes = layout({f"parameters/{key}": value for key, value in tensors.items()}).size
    wire = torch.ones(nbytes, dtype=torch.uint8)

    def plain() -> None:
        (dist.send if rank == 0 else dist.recv)(wire, 1 - rank)

    def heal() -> None:
        if rank == 0:
            transport.send_checkpoint([1], STEP, state, TIMEOUT)
        else:
            transport.recv_checkpoint(0, transport.metadata(), STEP, TIMEOUT)

    wire_s = _median_s(plain, repeats)
    heal_runs = []
    for _ in range(repeats):
        _median_s(heal, 1)
        heal_runs.append(transport.last.seconds)
    sha_s = _median_s(lambda: hashlib.sha256(wire.numpy()).digest(), repeats)
    return {"mib": mib, "bytes": nbytes, "wire_s": wire_s,
            "heal_s": statistics.median(heal_runs), "sha_s": sha_s}  # fmt: skip


def worker(rank: int, addr: str, port: int, options: dict[str, object]) -> None:
    """One of 2 gloo ranks: each size's row; rank 1 writes them to ``options["out"]``."""
    os.environ.update(MASTER_ADDR=addr, MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=TIMEOUT)
    group = dist.group.WORLD
    assert group is not None
    chunk = int(float(str(options["chunk_mib"])) * 2**20)
    transport = HealTransport(group, TIMEOUT, chunk_bytes=chunk)
    sizes = [int(size) for size in str(options["sizes"]).split(",")]
    rows = [_row(rank, mib, int(str(options["repeats"])), transport) for mib in sizes]
    if rank == 1:
        Path(str(options["out"])).write_text(json.dumps(rows))
    dist.destroy_process_group()


def _spawned(rank: int, port: int, options: dict[str, object]) -> None:
    worker(rank, "127.0.0.1", port, options)


def run_loopback(options: dict[str, object]) -> None:
    """Both ranks on this machine's loopback."""
    mp.spawn(_spawned, args=(free_port(), options), nprocs=2)


def run_link(rate: str, options: dict[str, object]) -> None:
    """The ranks in two namespaces joined by a veth limited to ``rate`` (tc tbf)."""
    from bandwidth import TwoNodes, preflight, rate_bits  # noqa: PLC0415 (root-only path)

    if problem := preflight():
        sys.exit(f"error: --links {rate}: {problem}")
    nodes = TwoNodes(subnet="10.78.0", tag=f"h{os.getpid()}")
    try:
        nodes.create()
        nodes.shape(rate_bits(rate))
        port, blob = free_port(), json.dumps(options)
        places = enumerate(zip(nodes.names, nodes.ifaces, strict=True))
        procs = [
            _start_rank(rank, name, iface, nodes.addrs[0], port, blob)
            for rank, (name, iface) in places
        ]
        if any(proc.wait() for proc in procs):
            sys.exit(f"error: a rank failed on the {rate} link")
    finally:
        nodes.destroy()


def _start_rank(
    rank: int, namespace: str, iface: str, addr: str, port: int, options: str
) -> subprocess.Popen[bytes]:
    """This script's ``--worker`` for ``rank`` in ``namespace``, gloo on its veth ``iface``."""
    command = [sys.executable, __file__, "--worker", str(rank), addr, str(port), options]
    env = {**os.environ, "GLOO_SOCKET_IFNAME": iface}
    return subprocess.Popen(["ip", "netns", "exec", namespace, *command], env=env)


def main(argv: list[str] | None = None) -> None:
    """Run both ranks per link and print the table."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        worker(int(argv[1]), argv[2], int(argv[3]), json.loads(argv[4]))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--links", default="loopback")
    parser.add_argument("--sizes-mib", default="7,64,256")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--chunk-mib", type=float, default=4.0)
    args = parser.parse_args(argv)
    table = []
    for link in args.links.split(","):
        out = Path(os.environ.get("TMPDIR", "/tmp")) / f"heal-transfer-{os.getpid()}.json"
        options = {"sizes": args.sizes_mib, "repeats": args.repeats, "out": str(out),
                   "chunk_mib": args.chunk_mib}  # fmt: skip
        (run_loopback if link == "loopback" else lambda o, r=link: run_link(r, o))(options)
        table += [_table_row(link, row) for row in json.loads(out.read_text())]
    header = ["link", "state (MiB)", "bytes (MB)", "plain send (ms)", "wire (MB/s)",
              "heal transfer (ms)", "heal / wire", "SHA-256, one core (ms)"]  # fmt: skip
    print(markdown_table(header, table))
    print(f"\npieces of {args.chunk_mib:g} MiB; medians of {args.repeats}")


def _table_row(link: str, row: dict[str, float]) -> list[str]:
    return [
        link, str(int(row["mib"])), f"{row['bytes'] / 1e6:.1f}", f"{row['wire_s'] * 1e3:.1f}",
        f"{row['bytes'] / row['wire_s'] / 1e6:,.0f}", f"{row['heal_s'] * 1e3:.1f}",
        f"{row['heal_s'] / row['wire_s']:.2f}x", f"{row['sha_s'] * 1e3:.1f}",
    ]  # fmt: skip


if __name__ == "__main__":
    main()
