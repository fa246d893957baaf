"""The metrics logger of rank 0 and its sinks: one log line per record, ``metrics.jsonl`` (each
line stamped with the run id), TensorBoard event files, and a Weights & Biases run under
--report-to wandb; ``build_metrics`` picks them. Imports ``keys`` (the record), ``errors`` and
``faults`` (the tests' fault hook); tensorboard and wandb only when their sink is built.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import sys
from pathlib import Path
from typing import Protocol, TextIO

from torchrun_ddp.errors import UserError
from torchrun_ddp.faults import fault_armed, fault_point
from torchrun_ddp.metrics.keys import Record

log = logging.getLogger("torchrun_ddp")


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
    """One JSON object per line, ``{"run_id": ..., **record}``, appended to ``path`` and flushed
    after every record (one ``write`` call per line). The file is opened at the first record, so
    ``restart_records`` may rewrite it between building the sink and training."""

    def __init__(self, path: Path, run_id: str = "") -> None:
        self.path = path
        self.run_id = run_id
        self.file: TextIO | None = None

    def write(self, record: Record) -> None:
        if self.file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.file = self.path.open("a", encoding="utf-8")
        text = json.dumps({"run_id": self.run_id, **record}) + "\n"
        if fault_armed():  # tests only: write half a line, then maybe die mid-line
            half = len(text) // 2
            self.file.write(text[:half])
            self.file.flush()
            fault_point("metrics", int(record["step"]))
            text = text[half:]
        self.file.write(text)
        self.file.flush()

    def close(self) -> None:
        if self.file is not None:
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
        if not self.sinks:
            fault_point("metrics", int(record["step"]))  # tests only: other ranks
        for sink in self.sinks:
            sink.write(record)

    def close(self) -> None:
        """Close all sinks."""
        for sink in self.sinks:
            sink.close()


def build_metrics(
    output_dir: Path,
    is_main: bool,
    tensorboard: bool = False,
    run_id: str = "",
    wandb_config: dict[str, object] | None = None,
) -> MetricsLogger:
    """Log lines and ``<output_dir>/metrics.jsonl`` (lines stamped with ``run_id``) on rank 0,
    plus TensorBoard event files in ``<output_dir>/tensorboard`` if asked, and a Weights & Biases
    run given ``wandb_config`` (the resolved config it records); nothing on other ranks."""
    if not is_main:
        return MetricsLogger([])
    sinks: list[Sink] = [LogSink(), JsonlSink(output_dir / "metrics.jsonl", run_id)]
    if tensorboard:
        sinks.append(TensorBoardSink(output_dir / "tensorboard"))
    if wandb_config is not None:
        sinks.append(WandbSink(output_dir, run_id, wandb_config))
    return MetricsLogger(sinks)


class TensorBoardSink:
    """Scalars for TensorBoard under ``log_dir``: ``train/<key>`` and ``eval/<key>`` by step."""

    def __init__(self, log_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter  # noqa: PLC0415 - optional sink

        self.writer = SummaryWriter(log_dir=str(log_dir))

    def write(self, record: Record) -> None:
        step = int(record["step"])
        group = "eval" if "eval_loss" in record or "mc_accuracy" in record else "train"
        for key, value in record.items():
            if key != "step":
                self.writer.add_scalar(f"{group}/{key}", value, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


WANDB_PROJECT = "torchrun-ddp"
"""The Weights & Biases project where WANDB_PROJECT is not set."""


def check_wandb_installed() -> None:
    """Raise UserError when --report-to wandb is asked for but wandb is not installed."""
    if importlib.util.find_spec("wandb") is None:
        raise UserError(
            "--report-to wandb needs the wandb package; install it with uv sync --extra wandb "
            "(or pip install wandb), or drop --report-to"
        )


class WandbSink:
    """Every record as one ``wandb.log`` call, keyed by the record's own ``step`` (a
    ``define_metric`` step, so the steps a resumed run logs again do not break wandb's
    increasing step counter); the run's ``config`` recorded once.

    The wandb run id is ``run_id`` (the checkpoint's run id, 32 hex digits) with
    ``resume="allow"``: a resumed run, on another attempt or machine, continues the same wandb
    run. Files go under ``<output_dir>/wandb``; WANDB_MODE (online, offline, disabled) and
    WANDB_PROJECT are read from the environment by wandb. The config holds no secrets: HF_TOKEN
    is never a config field.
    """

    def __init__(self, output_dir: Path, run_id: str, config: dict[str, object]) -> None:
        import wandb  # noqa: PLC0415 - optional dependency (the wandb extra)

        output_dir.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT") or WANDB_PROJECT,
            id=run_id or None,
            resume="allow",
            dir=str(output_dir),
            config=config,
        )
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    def write(self, record: Record) -> None:
        self.run.log(dict(record))

    def close(self) -> None:
        self.run.finish()
