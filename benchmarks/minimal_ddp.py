"""A minimal hand-written DDP training loop: the baseline row of ``benchmarks/throughput.py``.

The least a DDP trainer must do, written the way a tutorial would, with nothing of this package:
each rank tokenises its share of the documents (every world_size-th), packs them into windows,
and runs forward, backward (DDP's built-in all-reduce) and ``torch.optim.AdamW`` for each
micro-batch. It writes one ``metrics.jsonl`` record per step (tokens/s over all ranks, step
time), so the benchmark reads it as it reads ``train.py``'s. Run it under torchrun::

    uv run torchrun --nproc_per_node=2 benchmarks/minimal_ddp.py \\
        --model configs/llama-tiny/config.json --tokenizer data/tokenizer/mistral-7b-v0.1 \\
        --data-files 'data/c4/*train*.json.gz' --output-dir /tmp/minimal
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer


def parse_args() -> argparse.Namespace:
    """The flags ``benchmarks/throughput.py`` passes (train.py's names; others are ignored)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--model", required=True, help="config.json of the model (random init)")
    add("--tokenizer", required=True, help="tokenizer folder")
    add("--data-files", nargs="+", required=True, help="json.gz globs of C4 documents")
    add("--seq-length", type=int, default=256, help="tokens per window")
    add("--batch-size", type=int, default=4, help="windows per micro-batch per rank")
    add("--max-steps", type=int, default=40, help="optimizer steps")
    add("--learning-rate", type=float, default=1e-3, help="AdamW learning rate")
    add("--seed", type=int, default=42, help="model initialisation seed")
    add("--threads", type=int, default=1, help="torch threads per process")
    add("--output-dir", type=Path, required=True, help="where metrics.jsonl goes")
    return parser.parse_known_args()[0]


def windows(args: argparse.Namespace, rank: int, world_size: int) -> Iterator[torch.Tensor]:
    """This rank's windows of ``seq_length`` token ids: BOS + ids + EOS, packed."""
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    files = sorted(path for pattern in args.data_files for path in glob.glob(pattern))
    tokens: list[int] = []
    index = 0
    for path in files:
        with gzip.open(path, "rt", encoding="utf-8") as handle:
            for line in handle:
                index += 1
                if (index - 1) % world_size != rank:
                    continue
                ids = tokenizer(json.loads(line)["text"], add_special_tokens=False)["input_ids"]
                tokens += [tokenizer.bos_token_id, *ids, tokenizer.eos_token_id]
                while len(tokens) >= args.seq_length:
                    yield torch.tensor(tokens[: args.seq_length])
                    del tokens[: args.seq_length]


def main() -> None:
    """Train ``--max-steps`` steps and write rank 0's per-step records."""
    args = parse_args()
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(args.model))
    model = DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate)
    stream = windows(args, rank, world_size)
    records = []
    for step in range(1, args.max_steps + 1):
        started = time.perf_counter()
        batch = torch.stack([next(stream) for _ in range(args.batch_size)])
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        seconds = time.perf_counter() - started
        tokens = batch.numel() * world_size
        records.append({"step": step, "loss": loss.detach(), "tokens_per_s": tokens / seconds,
                        "step_time_s": seconds, "data_time_s": 0.0})  # fmt: skip
    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)
        lines = "".join(json.dumps({**r, "loss": float(r["loss"])}) + "\n" for r in records)
        (args.output_dir / "metrics.jsonl").write_text(lines)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
