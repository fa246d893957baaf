"""One metrics logger on rank 0 with pluggable sinks (log line, metrics.jsonl, TensorBoard,
Weights & Biases).

Keys and units: ``step`` (optimizer steps done), ``loss`` (mean cross-entropy over ranks, nats
per token), ``lr``, ``tokens_per_s`` (trained tokens per second over all ranks), ``mfu`` (model
FLOPs utilisation, 0..1), ``step_time_s`` and ``data_time_s`` (seconds per step, and the part
spent waiting for data), ``grad_norm`` (global L2 norm before clipping), ``peak_mem_bytes``
(CUDA max allocated, or peak resident set size of the process on CPU), ``comm_bytes`` /
``comm_bytes_dense`` (gradient bytes a rank sends on the wire per step under the ring model, and
what a dense fp32 ring all-reduce at the same world size would send), ``comm_bytes_collective``
(bytes handed to collectives), ``compression_ratio`` (dense / sent; left out of a window that sent
nothing). The byte counts are averages per step over the logging window of what was counted in
the steps that sent it: an optimizer that syncs every H steps (DiLoCo, SparseLoCo) counts its
whole message in the sync step, so at ``--log-every 1`` the other steps read 0, and at a
``--log-every`` that is a multiple of H each record gives the average per step. Evaluation
records carry ``eval_loss`` and ``eval_ppl``, and with --eval-multiple-choice ``mc_accuracy`` and
``mc_accuracy_per_char`` (fractions of questions, each with its ``_stderr``) and
``mc_questions``. Every line of ``metrics.jsonl`` also carries the
``run_id`` of the run that wrote it (the id in the checkpoint folder's ``run.json``).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
import resource
import sys
import time
from pathlib import Path
from typing import Protocol, TextIO

import torch
from tqdm import tqdm

from torchrun_ddp.errors import UserError
from torchrun_ddp.faults import fault_armed, fault_point

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


def read_records(path: Path) -> list[dict[str, object]]:
    """The records of a metrics.jsonl; a torn last line (a crash mid-write) is left out.

    Raises UserError naming the file and line for any other line that is not a JSON object.
    """
    if not path.is_file():
        return []
    lines = path.read_text(encoding="utf-8").splitlines()
    records = []
    for number, line in enumerate(lines, start=1):
        try:
            record = json.loads(line) if line.strip() else None
        except json.JSONDecodeError as exc:
            if number == len(lines):
                log.warning("%s: dropping the torn last line %d (%s)", path, number, exc)
                continue
            raise UserError(
                f"{path} line {number} is not JSON ({exc}); move the file away or fix the line"
            ) from exc
        if isinstance(record, dict):
            records.append(record)
    return records


def check_records(path: Path, run_id: str, overwrite: bool = False) -> None:
    """Raise UserError if a metrics.jsonl holds another run's records (no ``run_id`` or a
    different one) and ``overwrite`` is not set, or a line before the last is not JSON."""
    others = {str(r.get("run_id")) for r in read_records(path) if r.get("run_id") != run_id}
    if others and not overwrite:
        raise UserError(
            f"{path} holds the metrics of another run ({sorted(others)[0]}); pass a new "
            "--output-dir, or add --no-resume --overwrite-output-dir to replace them"
        )


def restart_records(path: Path, run_id: str, step: int) -> None:
    """Keep only the records of run ``run_id`` up to ``step`` in a metrics.jsonl (a resumed run
    logs the later steps again; a fresh run passes ``step=-1``), rewritten atomically (temporary
    file, fsync, rename), so a crash leaves either the old or the new file. A torn last line is
    dropped; other runs' records too (``check_records`` first refuses them unless asked)."""
    if not path.is_file():
        return
    kept = [r for r in read_records(path) if r.get("run_id") == run_id and int(r["step"]) <= step]
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", encoding="utf-8") as handle:
        handle.writelines(json.dumps(record) + "\n" for record in kept)
        handle.flush()
        os.fsync(handle.fileno())
    tmp.replace(path)


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


GPU_PEAK_FLOPS = {
    "NVIDIA H100 80GB HBM3": 989e12,
    "NVIDIA H100 PCIe": 756e12,
    "NVIDIA H100 NVL": 835e12,
    "NVIDIA H200": 989e12,
    "NVIDIA H200 NVL": 835e12,
    "NVIDIA A100-SXM4-80GB": 312e12,
    "NVIDIA A100-SXM4-40GB": 312e12,
    "NVIDIA A100 80GB PCIe": 312e12,
    "NVIDIA A100-PCIE-40GB": 312e12,
    "NVIDIA L40S": 362e12,
    "NVIDIA L4": 121e12,
    "NVIDIA A10": 125e12,
    "NVIDIA GeForce RTX 4090": 165e12,
}
"""Dense (no sparsity) bf16 tensor-core peak FLOP/s per GPU, keyed by the exact name
``torch.cuda.get_device_name`` reports: NVIDIA's data sheets for H100 (SXM 989, PCIe 756, NVL 835
TFLOP/s), H200 (SXM 989, NVL 835), A100 (312, SXM and PCIe), L40S, L4 and A10, and the Ada
Lovelace architecture whitepaper for the RTX 4090 (with fp32 accumulation). The sheets print the
2:4-sparse figure first; the dense one is half of it. A name not listed reports no MFU rather than
a guess (an "H100" substring would match PCIe and NVL parts to the SXM peak)."""


def gpu_peak_flops(name: str) -> tuple[float, str]:
    """The dense bf16 peak FLOP/s of the GPU called ``name`` (``GPU_PEAK_FLOPS``) and where the
    figure comes from; (0.0, reason) for a name not in the table."""
    peak = GPU_PEAK_FLOPS.get(name.strip())
    if peak is None:
        return 0.0, f"unknown GPU {name!r}: MFU not reported (no data-sheet peak for this name)"
    return peak, f"data-sheet dense bf16 peak of {name}"


def measure_cpu_peak_flops(
    size: int = 1024, trials: int = 12, dtype: torch.dtype = torch.float32, budget_s: float = 1.0
) -> float:
    """This process's matmul rate in FLOP/s on square matrices of ``dtype``, with the current
    ``torch.get_num_threads()``: the CPU's practical peak for MFU.

    Side 1024 with 12 trials reads within about 3% of side 2048 with 4 trials (about 0.6 s
    instead of 1.8 s per rank at start-up on one thread of this project's CPU, 2 ranks
    measuring at once; docs/benchmarks.md, "Test suite", has the command);
    ``benchmarks/throughput.py`` still times 2048.

    The matrices grow from 128 by doubling up to ``size`` while one product stays under
    ``budget_s`` seconds, so a CPU without native support for ``dtype`` (bf16 without
    avx512_bf16/AMX runs about 1,000x slower than fp32) measures in seconds, not minutes. The
    rate is the best of ``trials`` timings of two products each (fewer, but at least two, once
    they have taken ``2 * budget_s``), so a moment of contention (the other ranks starting up on
    the same cores) does not lower the peak and push MFU above 1.
    The matrices come from a private generator: the global RNG, which a resumed run restores,
    is not touched, whatever size the timing picks.
    """
    generator = torch.Generator().manual_seed(0)
    side = 128
    a, b = torch.randn(2, side, side, generator=generator).to(dtype)
    while side < size:
        start = time.perf_counter()
        a @ b  # also the warm-up of the size finally timed
        if (time.perf_counter() - start) * 8 > budget_s:  # the next size costs 8x
            break
        side *= 2
        a, b = torch.randn(2, side, side, generator=generator).to(dtype)
    a @ b  # warm-up
    best, spent = 0.0, 0.0
    for trial in range(trials):
        start = time.perf_counter()
        a @ b
        a @ b
        elapsed = time.perf_counter() - start
        best, spent = max(best, 4.0 * side**3 / elapsed), spent + elapsed
        if trial >= 1 and spent > 2 * budget_s:  # a slow dtype: two trials are enough
            break
    return best


def device_peak_flops(
    device: torch.device, dtype: torch.dtype = torch.float32
) -> tuple[float, str]:
    """Peak FLOP/s of one rank's device for matmuls in ``dtype``, and where the figure comes from.

    CUDA: the dense bf16 data-sheet table above by exact device name (``gpu_peak_flops``; 0 if
    unknown, so MFU is not reported); CPU: a short matmul measurement in ``dtype`` (bf16 for
    bf16-mixed and bf16 runs).
    """
    if device.type != "cuda":
        name = str(dtype).removeprefix("torch.")
        return measure_cpu_peak_flops(dtype=dtype), f"measured {name} matmul on this CPU"
    return gpu_peak_flops(torch.cuda.get_device_name(device))


class LogWindow:
    """Sums over the optimizer steps since the last log line; :meth:`flush` turns them into one
    record with a single all-reduce (the loss reduction of a log step).

    ``tokens_per_step``: tokens trained per optimizer step over all ranks; ``flops_per_token``:
    training FLOPs per token (PaLM appendix B); ``peak_flops_total``: peak FLOP/s of all ranks
    (inf when unknown: MFU then reads 0). Times count the steps, data reading and the log step's
    all-reduce (which waits for the device's queued work and for a delayed exchange still on the
    links, so a window's seconds are wall-clock), not evaluation or saving, so tokens/s and MFU
    describe training.
    """

    def __init__(
        self,
        device: torch.device,
        tokens_per_step: int,
        flops_per_token: float,
        peak_flops_total: float,
    ) -> None:
        self.device = device
        self.tokens_per_step = tokens_per_step
        self.flops_per_token = flops_per_token
        self.peak_flops_total = peak_flops_total
        self.reset()

    def reset(self) -> None:
        """Start a new window."""
        self.loss = torch.zeros((), device=self.device)
        self.grad_norm = torch.zeros((), device=self.device)
        self.steps = 0
        self.comm = [0, 0, 0]
        self.step_time = 0.0
        self.data_time = 0.0

    def add(
        self, loss: torch.Tensor, grad_norm: torch.Tensor, step_time: float, comm: tuple[int, ...]
    ) -> None:
        """Record one optimizer step: mean loss and gradient norm (0-dim device tensors, not
        read here, so no host sync), its seconds, and its (wire, dense, collective) bytes."""
        self.loss += loss
        self.grad_norm = grad_norm.detach()
        self.steps += 1
        self.step_time += step_time
        self.comm = [total + added for total, added in zip(self.comm, comm, strict=True)]

    def add_data_time(self, seconds: float) -> None:
        """Seconds spent reading data for this window's steps (also counted as step time)."""
        self.data_time += seconds
        self.step_time += seconds

    def flush(
        self, step: int, lr: float, flags: list[bool], extra: torch.Tensor | None = None
    ) -> tuple[Record, list[bool]]:
        """Collective: the window's record (loss averaged over ranks) and ``flags`` OR-ed over
        ranks, in one all-reduce (SUM) of ``[loss, *flags]``; then reset. Needs >= 1 step.
        ``extra`` (float64, 1-D, on the device) rides in the same all-reduce in float64 and is
        summed over ranks in place."""
        began = time.perf_counter()
        summed = torch.stack([self.loss / self.steps, *(self.loss.new_tensor(f) for f in flags)])
        if extra is not None:
            summed = torch.cat([summed.double(), extra])
        torch.distributed.all_reduce(summed)
        if extra is not None:
            extra.copy_(summed[len(summed) - len(extra) :])
            summed = summed[: len(summed) - len(extra)]
        values = summed.tolist()
        self.step_time += time.perf_counter() - began
        tokens_per_s = self.tokens_per_step * self.steps / self.step_time
        wire, dense, collective = (total // self.steps for total in self.comm)
        record: Record = {
            "step": step,
            "loss": values[0] / torch.distributed.get_world_size(),
            "lr": lr,
            "tokens_per_s": tokens_per_s,
            "mfu": self.flops_per_token * tokens_per_s / self.peak_flops_total,
            "step_time_s": self.step_time / self.steps,
            "data_time_s": self.data_time / self.steps,
            "grad_norm": float(self.grad_norm),
            "peak_mem_bytes": peak_memory_bytes(self.device),
            "comm_bytes": wire,
            "comm_bytes_dense": dense,
            "comm_bytes_collective": collective,
        }
        if wire:  # a window that sent nothing (between two syncs of DiLoCo) has no ratio
            record["compression_ratio"] = dense / wire
        self.reset()
        return record, [value > 0 for value in values[1:]]


def any_rank(
    flags: list[bool], device: torch.device, extra: torch.Tensor | None = None
) -> list[bool]:
    """Collective: each flag OR-ed over all ranks (one all-reduce, MAX); ``extra`` (float64,
    1-D, on ``device``) rides in the same all-reduce (then SUM) and is summed in place."""
    if extra is not None:
        values = torch.cat([torch.tensor(flags, dtype=torch.float64, device=device), extra])
        torch.distributed.all_reduce(values)
        extra.copy_(values[len(flags) :])
        return [value > 0 for value in values[: len(flags)].tolist()]
    values = torch.tensor([int(flag) for flag in flags], device=device)
    torch.distributed.all_reduce(values, op=torch.distributed.ReduceOp.MAX)
    return [bool(value) for value in values.tolist()]


def progress_bar(initial: int, total: float, main_rank: bool) -> tqdm:
    """A tqdm bar of optimizer steps from ``initial`` to ``total`` (math.inf: no end known) on
    the main rank when stderr is a terminal; disabled (silent) otherwise."""
    return tqdm(
        initial=initial,
        total=None if total == float("inf") else int(total),
        disable=not (main_rank and sys.stderr.isatty()),
        unit="step",
        dynamic_ncols=True,
    )


def check_loss(loss: float, step: int, max_loss: float) -> None:
    """Stop a run whose loss exploded: the log step's loss (averaged over ranks, the same on
    every rank) is NaN or infinite, or above ``max_loss`` (> 0). Called before that step's
    checkpoint, so none is saved over the last good one, and no final model is exported.

    Raises UserError (every rank alike) with one line."""
    if math.isfinite(loss) and not 0 < max_loss < loss:
        return
    bound = "not finite" if not math.isfinite(loss) else f"above --max-loss {max_loss:g}"
    raise UserError(
        f"the training loss is {loss:g} at step {step} ({bound}): stopped without a checkpoint "
        "or final_model; resume the last good checkpoint with a lower --learning-rate or more "
        "--warmup-steps"
    )
