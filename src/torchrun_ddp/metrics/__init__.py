"""Metrics: one logger on rank 0 with pluggable sinks (log line, metrics.jsonl, TensorBoard,
Weights & Biases), the records file across restarts, the device's peaks for MFU, and the logging
window with its one all-reduce per log step. One idea per module:

- ``keys``: what a record holds (keys and units) and the ``Record`` type;
- ``sinks``: ``MetricsLogger``, its sinks and ``build_metrics``;
- ``records``: metrics.jsonl read, another run's records refused, trimmed at a restart;
- ``peaks``: peak FLOP/s of a GPU (data-sheet table) or a CPU (measured), peak memory;
- ``window``: ``LogWindow`` (per-step sums, one all-reduce at a log step) and ``any_rank``;
- ``progress``: the progress bar and the stop on an exploded loss (``check_loss``).

The modules import ``keys`` and ``peaks`` of this package, ``errors`` and ``faults`` (the
tests' fault hook) and nothing else of the project. Every name is importable from here.
"""

from torchrun_ddp.metrics.keys import Record
from torchrun_ddp.metrics.peaks import (
    GPU_PEAK_FLOPS,
    device_peak_flops,
    gpu_peak_flops,
    measure_cpu_peak_flops,
    peak_memory_bytes,
)
from torchrun_ddp.metrics.progress import check_loss, is_log_step, no_step_message, progress_bar
from torchrun_ddp.metrics.records import check_records, read_records, restart_records
from torchrun_ddp.metrics.sinks import (
    WANDB_PROJECT,
    JsonlSink,
    LogSink,
    MetricsLogger,
    Sink,
    TensorBoardSink,
    WandbSink,
    build_metrics,
    check_wandb_installed,
)
from torchrun_ddp.metrics.window import LogWindow, any_rank

__all__ = [
    "GPU_PEAK_FLOPS",
    "WANDB_PROJECT",
    "JsonlSink",
    "LogSink",
    "LogWindow",
    "MetricsLogger",
    "Record",
    "Sink",
    "TensorBoardSink",
    "WandbSink",
    "any_rank",
    "build_metrics",
    "check_loss",
    "check_records",
    "check_wandb_installed",
    "device_peak_flops",
    "gpu_peak_flops",
    "is_log_step",
    "measure_cpu_peak_flops",
    "no_step_message",
    "peak_memory_bytes",
    "progress_bar",
    "read_records",
    "restart_records",
]
