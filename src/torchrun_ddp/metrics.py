"""One metrics logger on rank 0 with pluggable sinks (log line, metrics.jsonl, TensorBoard).

Keys and units: ``step`` (optimizer steps done), ``loss`` (mean cross-entropy over ranks, nats
per token), ``lr``, ``tokens_per_s`` (trained tokens per second over all ranks), ``mfu`` (model
FLOPs utilisation, 0..1), ``step_time_s`` and ``data_time_s`` (seconds per step, and the part
spent waiting for data), ``grad_norm`` (global L2 norm before clipping), ``peak_mem_bytes``
(CUDA max allocated, or peak resident set size of the process on CPU), ``comm_bytes`` /
``comm_bytes_dense`` (gradient bytes a rank sends on the wire per step under the ring model, and
what a dense fp32 ring all-reduce at the same world size would send), ``comm_bytes_collective``
(bytes handed to collectives), ``compression_ratio`` (dense / sent); evaluation records carry
``eval_loss`` and ``eval_ppl``.
"""

from __future__ import annotations

import json
import logging
import resource
import sys
import time
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


def build_metrics(output_dir: Path, is_main: bool, tensorboard: bool = False) -> MetricsLogger:
    """Log lines and ``<output_dir>/metrics.jsonl`` on rank 0, plus TensorBoard event files in
    ``<output_dir>/tensorboard`` if asked; nothing on other ranks."""
    if not is_main:
        return MetricsLogger([])
    sinks: list[Sink] = [LogSink(), JsonlSink(output_dir / "metrics.jsonl")]
    if tensorboard:
        sinks.append(TensorBoardSink(output_dir / "tensorboard"))
    return MetricsLogger(sinks)


def drop_records_after(path: Path, step: int) -> None:
    """Remove records past ``step`` from a metrics.jsonl (a resumed run logs those steps again)."""
    if not path.is_file():
        return
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    kept = [line for line in lines if line.strip() and json.loads(line)["step"] <= step]
    path.write_text("".join(kept), encoding="utf-8")


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory of this process in bytes: CUDA max allocated, or peak RSS on CPU (Linux)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


class TensorBoardSink:
    """Scalars for TensorBoard under ``log_dir``: ``train/<key>`` and ``eval/<key>`` by step."""

    def __init__(self, log_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter  # noqa: PLC0415 - optional sink

        self.writer = SummaryWriter(log_dir=str(log_dir))

    def write(self, record: Record) -> None:
        step = int(record["step"])
        group = "eval" if "eval_loss" in record else "train"
        for key, value in record.items():
            if key != "step":
                self.writer.add_scalar(f"{group}/{key}", value, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


GPU_PEAK_FLOPS = {
    "H200": 989e12,
    "H100": 989e12,
    "A100": 312e12,
    "L40S": 362e12,
    "A10G": 125e12,
    "RTX 4090": 165e12,
    "V100": 125e12,
}
"""Dense bf16/fp16 tensor-core peak FLOP/s per GPU, from the vendors' data sheets (SXM parts)."""


def measure_cpu_peak_flops(
    size: int = 2048, trials: int = 4, dtype: torch.dtype = torch.float32
) -> float:
    """This process's matmul rate in FLOP/s on ``size`` x ``size`` matrices of ``dtype``, with
    the current ``torch.get_num_threads()``: the CPU's practical peak for MFU. The best of
    ``trials`` timings of two products each, so a moment of contention (the other ranks starting
    up on the same cores) does not lower the peak and push MFU above 1."""
    a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
    a @ b  # warm-up
    best = 0.0
    for _ in range(trials):
        start = time.perf_counter()
        a @ b
        a @ b
        best = max(best, 4.0 * size**3 / (time.perf_counter() - start))
    return best


def device_peak_flops(
    device: torch.device, dtype: torch.dtype = torch.float32
) -> tuple[float, str]:
    """Peak FLOP/s of one rank's device for matmuls in ``dtype``, and where the figure comes from.

    CUDA: the bf16 data-sheet table above by device name (0 if unknown, so MFU is not reported);
    CPU: a short matmul measurement in ``dtype`` (bf16 for bf16-mixed and bf16 runs).
    """
    if device.type != "cuda":
        name = str(dtype).removeprefix("torch.")
        return measure_cpu_peak_flops(dtype=dtype), f"measured {name} matmul on this CPU"
    name = torch.cuda.get_device_name(device)
    for key, peak in GPU_PEAK_FLOPS.items():
        if key in name:
            return peak, f"data-sheet bf16 peak of {key}"
    return 0.0, f"unknown GPU {name}: MFU not reported"
