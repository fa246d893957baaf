"""The healing transfer of fault-tolerant sites against the wire: ``checkpoint.heal
.HealTransport`` (safetensors + JSON + SHA-256 over a gloo process group) between 2 processes on
loopback, for states of several sizes, beside a plain gloo send of the same payload bytes.

Per size (MiB of fp32 tensors, 16 tensors of equal size, as a model's parameters and moments):
the receiver's transfer time (``Transfer.seconds``: from its first receive to the decoded
state), the plain send's time of the same payload bytes (the wire), their ratio (the issue's
target: within 1.2x), and the parts measured apart on one process: ``encode`` (the sender's
safetensors blob and SHA-256) and ``decode`` (the receiver's SHA-256 and safetensors load).
Medians over ``--repeats``.

Usage: uv run python benchmarks/heal_transfer.py [--sizes-mib 7,64,256] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from common import free_port, markdown_table

from torchrun_ddp.checkpoint.heal import FORMAT, HealTransport, decode, encode

TENSORS = 16
TIMEOUT = timedelta(seconds=300)


def state_of(mib: int) -> dict[str, object]:
    """A heal state of ``mib`` MiB: ``TENSORS`` fp32 tensors and a step, as a site sends."""
    numel = mib * 2**20 // 4 // TENSORS
    generator = torch.Generator().manual_seed(mib)
    tensors = {str(i): torch.randn(numel, generator=generator) for i in range(TENSORS)}
    return {"parameters": tensors, "step": 7}


def _median_s(action: object, repeats: int) -> float:
    """Median seconds of ``repeats`` calls of ``action`` (a callable, after a barrier each)."""
    seconds = []
    for _ in range(repeats):
        dist.barrier()
        began = time.perf_counter()
        action()  # type: ignore[operator]
        seconds.append(time.perf_counter() - began)
    return statistics.median(seconds)


def worker(rank: int, port: int, sizes: list[int], repeats: int, out: str) -> None:
    """One of 2 gloo ranks: for each size, the plain send, the heal transfer (rank 0 sends,
    rank 1 receives and records ``Transfer.seconds``), and encode / decode apart."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=TIMEOUT)
    group = dist.group.WORLD
    assert group is not None
    transport, rows = HealTransport(group, TIMEOUT), []
    for mib in sizes:
        state = state_of(mib)
        header, payload = encode(state, 7)
        wire = torch.frombuffer(bytearray(payload), dtype=torch.uint8)

        def plain(wire: torch.Tensor = wire) -> None:
            (dist.send if rank == 0 else dist.recv)(wire, 1 - rank)

        def heal(state: dict[str, object] = state) -> None:
            if rank == 0:
                transport.send_checkpoint([1], 7, state, TIMEOUT)
            else:
                transport.recv_checkpoint(0, FORMAT, 7, TIMEOUT)

        wire_s = _median_s(plain, repeats)
        heal_runs = []
        for _ in range(repeats):
            _median_s(heal, 1)
            heal_runs.append(transport.last.seconds)
        parsed = json.loads(header)
        encode_s = _median_s(lambda state=state: encode(state, 7), repeats)
        decode_s = _median_s(lambda p=payload, h=parsed: decode(h, p, 7), repeats)
        rows.append(
            {"mib": mib, "bytes": len(header) + len(payload), "wire_s": wire_s,
             "heal_s": statistics.median(heal_runs), "encode_s": encode_s, "decode_s": decode_s}
        )  # fmt: skip
    if rank == 1:
        Path(out).write_text(json.dumps(rows))
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    """Run both ranks and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mib", default="7,64,256")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    sizes = [int(size) for size in args.sizes_mib.split(",")]
    out = Path(os.environ.get("TMPDIR", "/tmp")) / f"heal-transfer-{os.getpid()}.json"
    mp.spawn(worker, args=(free_port(), sizes, args.repeats, str(out)), nprocs=2)
    rows = json.loads(out.read_text())
    table = [
        [
            str(row["mib"]), f"{row['bytes'] / 1e6:.1f}", f"{row['wire_s'] * 1e3:.1f}",
            f"{row['bytes'] / row['wire_s'] / 1e6:,.0f}", f"{row['heal_s'] * 1e3:.1f}",
            f"{row['heal_s'] / row['wire_s']:.1f}x", f"{row['encode_s'] * 1e3:.1f}",
            f"{row['decode_s'] * 1e3:.1f}",
        ]
        for row in rows
    ]  # fmt: skip
    header = [
        "state (MiB)", "bytes (MB)", "plain send (ms)", "wire (MB/s)", "heal transfer (ms)",
        "heal / wire", "encode (ms)", "decode (ms)",
    ]  # fmt: skip
    print(markdown_table(header, table))


if __name__ == "__main__":
    main()
