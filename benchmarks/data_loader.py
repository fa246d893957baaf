"""Cost of the training data path: the global document stream, the loader worker, state_dict.

Prints one Markdown table (from the repository root)::

    uv run python benchmarks/data_loader.py                          # the bundled C4 sample
    uv run python benchmarks/data_loader.py --data-dir ../shared/data --world-size 64

Rows: (1) documents/s that one rank parses when it reads the whole stream through
``DocumentBlocks`` (every rank does, see docs/elastic.md); (2) micro-batches/s that one
rank of ``--world-size`` gets from ``build_train_loader`` (its worker tokenises only its own
documents, and reads all of them); (3) the mean time of ``TrainLoader.state_dict()``, which the
training loop calls after every step; (4) the JSON size of that state; (5) the time to re-split
the positions of ``--world-size`` ranks for ``--world-size // 2`` ranks (``reshard_positions``).
One process; times are wall clock on whatever else the machine is doing.
"""

from __future__ import annotations

import argparse
import glob
import json
import time
from pathlib import Path

from torchrun_ddp.training_data import (
    DocumentBlocks,
    build_train_loader,
    data_position,
    load_tokenizer,
    open_documents,
    reshard_positions,
)

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    """Measure and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", default=str(REPO / "data"), help="holds c4/*train*.json.gz")
    parser.add_argument("--world-size", type=int, default=8, help="ranks the stream is dealt to")
    parser.add_argument("--seq-length", type=int, default=512, help="tokens per window")
    parser.add_argument("--batch-size", type=int, default=4, help="windows per micro-batch")
    parser.add_argument("--batches", type=int, default=20, help="micro-batches timed")
    args = parser.parse_args()
    files = sorted(glob.glob(f"{args.data_dir}/c4/*train*.json.gz"))
    tokenizer = load_tokenizer(str(REPO / "data" / "tokenizer" / "mistral-7b-v0.1"))

    blocks = DocumentBlocks(open_documents(files, "", "", "train"), 1000, 0, shuffle=True)
    start = time.perf_counter()
    position = 0
    while blocks.text(0, position) is not None:
        position += 1
    parse_rate = position / (time.perf_counter() - start)

    documents = open_documents(files, "", "", "train")
    loader = build_train_loader(
        documents, tokenizer, args.seq_length, args.batch_size, 0, args.world_size,
        epochs=1000, shuffle_buffer=1000, seed=0,
    )  # fmt: skip
    iterator = iter(loader)
    next(iterator)  # the worker's start-up
    start = time.perf_counter()
    for _ in range(args.batches):
        next(iterator)
    batch_rate = args.batches / (time.perf_counter() - start)
    calls = 1000
    start = time.perf_counter()
    for _ in range(calls):
        state = loader.state_dict()
    state_us = (time.perf_counter() - start) / calls * 1e6
    state_bytes = len(json.dumps(state))

    own = data_position(state)
    positions = [
        {**own, "rank": rank, "next": own["next"] + rank} for rank in range(args.world_size)
    ]
    start = time.perf_counter()
    reshard_positions(positions, max(1, args.world_size // 2), 1000)
    reshard_ms = (time.perf_counter() - start) * 1e3

    half = max(1, args.world_size // 2)
    rows = [
        ("whole stream parsed by one rank, documents/s", f"{parse_rate:,.0f}"),
        (f"micro-batches/s of {args.batch_size} x {args.seq_length} tokens", f"{batch_rate:,.1f}"),
        ("TrainLoader.state_dict(), microseconds per call", f"{state_us:,.1f}"),
        ("data state in the checkpoint, JSON bytes", f"{state_bytes:,}"),
        (f"reshard_positions {args.world_size} -> {half} ranks, ms", f"{reshard_ms:,.2f}"),
    ]
    print(f"| {len(files)} file(s), {position} documents; rank 0 of {args.world_size} | value |")
    print("|---|---:|")
    for name, value in rows:
        print(f"| {name} | {value} |")


if __name__ == "__main__":
    main()
