"""One metrics logger on rank 0 with pluggable sinks (stdout, metrics.jsonl).

Keys and units: ``step`` (optimizer steps done), ``loss`` (mean cross-entropy over ranks, nats per
token), ``lr``, ``tokens_per_s`` (trained tokens per second over all ranks), ``grad_norm`` (global
L2 norm before clipping), ``peak_mem_bytes`` (CUDA max allocated, or peak resident set size of
the process on CPU), ``comm_bytes`` / ``comm_bytes_dense`` (gradient bytes sent per step per rank,
and what a dense fp32 all-reduce would send), ``compression_ratio`` (dense / sent); evaluation
records carry ``eval_loss`` and ``eval_ppl``.
"""

from __future__ import annotations

import json
import logging
import resource
import sys
from pathlib import Path
from typing import Protocol

import torch

log = logging.getLogger("torchrun_ddp")

Record = dict[str, float | int]


class Sink(Protocol):
    """Where metric records go; ``write`` takes one record, ``close`` flushes and releases."""

    def write(self, record: Record) -> None: ...

    def close(self) -> None: ...


class LogSink:
    """One human-readable log line per record through the ``torchrun_ddp`` logger."""

    def write(self, record: Record) -> None:
        parts = [f"{key} {_format(value)}" for key, value in record.items()]
        log.info(" | ".join(parts))

    def close(self) -> None:
        sys.stdout.flush()


class JsonlSink:
    """One JSON object per line, appended to ``path`` and flushed after every record."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.file = path.open("a", encoding="utf-8")

    def write(self, record: Record) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


def _format(value: float | int) -> str:
    if isinstance(value, int):
        return str(value)
    return f"{value:.4g}"


class MetricsLogger:
    """Fan each record out to every sink; a logger with no sinks (other ranks) does nothing."""

    def __init__(self, sinks: list[Sink]) -> None:
        self.sinks = sinks

    def log(self, record: Record) -> None:
        """Send one record to all sinks."""
        for sink in self.sinks:
            sink.write(record)

    def close(self) -> None:
        """Close all sinks."""
        for sink in self.sinks:
            sink.close()


def build_metrics(output_dir: Path, is_main: bool) -> MetricsLogger:
    """Stdout and ``<output_dir>/metrics.jsonl`` on rank 0; nothing on other ranks."""
    if not is_main:
        return MetricsLogger([])
    return MetricsLogger([LogSink(), JsonlSink(output_dir / "metrics.jsonl")])


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory of this process in bytes: CUDA max allocated, or peak RSS on CPU (Linux)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
