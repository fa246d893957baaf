"""Tokens/s, step time, MFU and scaling of the tiny LLaMA on this CPU, per training setting.

Trains ``configs/tiny.toml`` on the offline C4 sample (``../shared/data``) once per setting, the
settings interleaved round by round (``--repeats``) so slow drifts of the machine hit all of them
alike, and prints a Markdown table: median tokens/s and step time after the warm-up steps, MFU,
the 2-process scaling efficiency and the training loss at the last step.

MFU is the model's training FLOPs per token (6N plus attention, ``architecture``) times tokens/s,
over the matmul peak of the compute dtype (fp32 for fp32, bf16 for bf16-mixed) that this script
measures at start with one thread on 2048 x 2048 matrices, times the threads in use (processes x
threads). Scaling efficiency is a 2-process setting's tokens/s over twice the tokens/s of the
same setting on 1 process with 1 thread. Loss parity compares each setting's loss at the last
step with the eager fp32 run of as many processes (same data, seed, steps and tokens per step).

Usage (from the repository root)::

    uv run python benchmarks/throughput.py                  # the full table
    uv run python benchmarks/throughput.py --settings 2x1-fp32,2x1-bf16-compile --steps 20
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (
    REPO,
    SHARED_DATA,
    check_data,
    data_args,
    free_port,
    markdown_table,
    read_metrics,
    start,
    train_env,
    wait_all,
)

from torchrun_ddp.config_io import parse_config
from torchrun_ddp.dry_run import visible_device_gib
from torchrun_ddp.metrics import measure_cpu_peak_flops
from torchrun_ddp.model import load_model_config
from torchrun_ddp.plan.architecture import matmul_parameter_count, meta_model, model_flops_per_token
from torchrun_ddp.planning import plan_run

LOSS_LABELS = {"none": "plain loss", "liger": "fused loss"}
"""Table labels of ``--fused-loss`` none and liger (auto: no label)."""


@dataclass(frozen=True)
class Setting:
    """One row: processes x threads per process, and the train.py flags."""

    name: str
    processes: int
    threads: int
    precision: str
    compile: bool
    compression: str
    static_graph: bool = False
    minimal: bool = False
    """The hand-written loop of ``benchmarks/minimal_ddp.py`` instead of ``train.py``."""
    data_parallel: str = "ddp"
    """``--data-parallel`` (``fsdp``: FSDP2 over every rank; ``hsdp``: 2 replicas, each sharded
    over half the processes)."""
    fused_loss: str = "auto"
    """``--fused-loss``: auto (liger on CUDA for LLaMA), liger (``-liger``) or none (``-plain``)."""
    micro_batch: int = 0
    """Windows per micro-batch per rank (``-mbN``); 0: ``--batch-size`` / processes."""
    checkpointing: bool = False
    """``--activation-checkpointing`` (``-ac``)."""

    def flags(self) -> list[str]:
        """``train.py`` flags of this setting (besides the shared ones)."""
        flags = ["--precision", self.precision, "--threads", str(self.threads)]
        flags += ["--compression", self.compression, "--fused-loss", self.fused_loss]
        flags += ["--ddp-static-graph"] if self.static_graph else []
        flags += ["--activation-checkpointing"] if self.checkpointing else []
        flags += ["--data-parallel", self.data_parallel]
        if self.data_parallel == "hsdp":  # 2 replicas (the CPU stand-in for 2 nodes)
            flags += ["--shard-degree", str(max(1, self.processes // 2))]
        return [*flags, "--compile"] if self.compile else flags

    @property
    def label(self) -> str:
        """Human-readable description for the table."""
        parts = [self.precision, *(["compile"] if self.compile else [])]
        parts += [self.compression] if self.compression != "none" else []
        parts += ["static graph"] if self.static_graph else []
        parts += [self.data_parallel] if self.data_parallel != "ddp" else []
        parts += [LOSS_LABELS[self.fused_loss]] if self.fused_loss in LOSS_LABELS else []
        parts += ["checkpointing"] if self.checkpointing else []
        parts += [f"micro-batch {self.micro_batch}"] if self.micro_batch else []
        shape = f"{' + '.join(parts)}, {self.processes} proc x {self.threads} thr"
        return f"minimal DDP loop, {shape}" if self.minimal else shape


def _micro_batch(parts: list[str]) -> int:
    """N of a ``mbN`` part, else 0."""
    return next((int(part[2:]) for part in parts if part.startswith("mb")), 0)


def _setting(name: str) -> Setting:
    """Parse ``PxT-precision[-compile][-dct][-static][-fsdp|-hsdp][-liger|-plain][-ac][-mbN]``
    or ``PxT-fp32-minimal`` (the hand-written loop), e.g. ``2x1-bf16-compile-dct``,
    ``1x1-bf16-fsdp-compile-liger-mb16``."""
    shape, *rest = name.split("-")
    processes, threads = (int(part) for part in shape.split("x"))
    precision = {"fp32": "fp32", "bf16": "bf16-mixed"}[rest[0]]
    compression = "dct" if "dct" in rest else "none"
    minimal = "minimal" in rest
    if minimal and (precision != "fp32" or len(rest) > 2):
        raise SystemExit(f"error: {name}: the minimal loop runs fp32 only; use PxT-fp32-minimal")
    loss = "liger" if "liger" in rest else "none" if "plain" in rest else "auto"
    return Setting(
        name, processes, threads, precision, "compile" in rest, compression, "static" in rest,
        minimal, next((mode for mode in ("fsdp", "hsdp") if mode in rest), "ddp"), loss,
        _micro_batch(rest), "ac" in rest,
    )  # fmt: skip


TINY_MODEL = REPO / "configs" / "llama-tiny" / "config.json"

DEFAULT_SETTINGS = (
    "2x1-fp32-minimal,2x1-fp32,1x2-fp32,1x1-fp32,2x1-bf16,2x1-fp32-compile,1x1-fp32-compile,"
    "2x1-fp32-compile-dct"
)
"""bf16-mixed is measured once without compile: on CPUs without avx512_bf16/AMX, bf16 matmuls
are emulated and slower than fp32 (the peaks printed at start show it); add
``2x1-bf16-compile`` etc. where the CPU has them."""


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add = parser.add_argument
    shapes = "PxT-fp32|bf16[-compile][-dct][-static][-fsdp|-hsdp]"
    add("--settings", default=DEFAULT_SETTINGS, help=f"comma list of {shapes}")
    add("--steps", type=int, default=40, help="optimizer steps per run")
    add("--warmup", type=int, default=10, help="first steps left out of the medians")
    add("--seq-length", type=int, default=256, help="tokens per window")
    add("--batch-size", type=int, default=4, help="windows per step over all ranks (per rank: /P)")
    add("--repeats", type=int, default=1, help="rounds; every setting runs once per round")
    add("--data-dir", type=Path, default=SHARED_DATA, help="the offline C4 sample and tokenizer")
    add("--model", type=Path, default=TINY_MODEL, help="config.json of the model (random init)")
    add("--device", choices=("cpu", "cuda"), default="cpu", help="cuda: NCCL, one GPU per process")
    add(
        "--epochs",
        type=int,
        default=1,
        help="passes over the data (the bundled sample is 328k tokens)",
    )
    add("--keep", type=Path, default=None, help="keep the run folders here")
    add("--timeout-s", type=float, default=1800, help="seconds one run may take")
    add(
        "--skip-failed",
        action="store_true",
        help="a run that fails or times out leaves its row out (printed) instead of stopping",
    )
    return parser.parse_args(argv)


def measure_peak(dtype: torch.dtype) -> float:
    """One thread's matmul rate in FLOP/s in ``dtype`` (the trainer's own measurement, best of 5
    timings on 2048 x 2048 matrices)."""
    torch.set_num_threads(1)
    return measure_cpu_peak_flops(size=2048, trials=5, dtype=dtype)


def train_argv(args: argparse.Namespace, setting: Setting, run_dir: Path) -> list[str]:
    """``train.py``'s flags for one run of ``setting`` (the minimal loop ignores the ones it
    does not know)."""
    per_rank = setting.micro_batch or max(1, args.batch_size // setting.processes)
    argv = ["--config", str(REPO / "configs" / "tiny.toml"), *data_args(args.data_dir, args.model)]
    argv += ["--model", str(args.model), "--learning-rate", "1e-3"]
    argv += ["--device", "cuda", "--backend", "nccl"] if args.device == "cuda" else []
    argv += ["--output-dir", str(run_dir), "--no-resume", "--checkpoint-every", "0"]
    argv += ["--overwrite-output-dir"]  # reruns replace the old run
    argv += [] if setting.minimal else ["--no-save-at-end"]
    argv += ["--max-steps", str(args.steps), "--epochs", str(args.epochs)]
    argv += ["--log-every", "1", "--eval-every", "0"]
    argv += ["--eval-batches", "1", "--seq-length", str(args.seq_length)]
    return [*argv, "--batch-size", str(per_rank), *setting.flags()]


def run_setting(args: argparse.Namespace, setting: Setting, run_dir: Path) -> list[dict]:
    """Train ``setting`` once under torchrun; returns rank 0's metric records."""
    command = [sys.executable, "-m", "torch.distributed.run"]
    command += [f"--nproc_per_node={setting.processes}", "--nnodes=1", "--rdzv_backend=c10d"]
    script = REPO / ("benchmarks/minimal_ddp.py" if setting.minimal else "train.py")
    command += [f"--rdzv_endpoint=127.0.0.1:{free_port()}", str(script)]
    command += train_argv(args, setting, run_dir)
    env = train_env({"OMP_NUM_THREADS": str(setting.threads)})
    proc = start(command, run_dir / "train.log", env)
    if wait_all([proc], timeout_s=args.timeout_s)[0] != 0:
        tail = (run_dir / "train.log").read_text()[-3000:]
        raise RuntimeError(f"{setting.name} failed:\n{tail}")
    return [r for r in read_metrics(run_dir / "metrics.jsonl") if "tokens_per_s" in r]


def planned_gib(args: argparse.Namespace, setting: Setting) -> float:
    """The memory plan's peak per rank for ``setting`` in GiB, as ``--dry-run`` prints it (the
    1 GiB overhead row included), on the visible GPU (``--device cuda``)."""
    config = parse_config(train_argv(args, setting, Path(tempfile.gettempdir())))
    memory = visible_device_gib() or 80.0
    plan, _ = plan_run(config, load_model_config(config.model), setting.processes, memory)
    return plan.total / 2**30


@dataclass
class Row:
    """Medians over repeats of one setting."""

    setting: Setting
    tokens_per_s: float
    step_time_s: float
    data_time_s: float
    loss: float
    mfu: float
    """The trainer's logged MFU (median), used on CUDA."""
    peak_gib: float = 0.0
    """The largest ``peak_mem_bytes`` over the run's records, GiB (CUDA: max allocated)."""
    first_step_s: float = 0.0
    """The first step's time (compilation included under --compile), seconds."""


def summarise(args: argparse.Namespace, setting: Setting, runs: list[list[dict]]) -> Row:
    """Median tokens/s, step and data time after warm-up over all runs; mean last loss."""
    kept = [r for records in runs for r in records[args.warmup :]]
    return Row(
        setting,
        statistics.median(r["tokens_per_s"] for r in kept),
        statistics.median(r["step_time_s"] for r in kept),
        statistics.median(r["data_time_s"] for r in kept),
        statistics.mean(records[-1]["loss"] for records in runs),
        statistics.median(r.get("mfu", 0.0) for r in kept),
        max(r.get("peak_mem_bytes", 0) for records in runs for r in records) / 2**30,
        statistics.median(records[0]["step_time_s"] for records in runs),
    )


def render_gpu(rows: list[Row], args: argparse.Namespace) -> str:
    """The CUDA table: the trainer's MFU, the peak against the plan (``planned_gib``), the
    first step's time, the loss at the last step."""
    header = ["setting", "tokens/s", "step s", "MFU", "peak GiB", "planned GiB", "first step s"]
    table = []
    for row in rows:
        table.append([
            row.setting.label, f"{row.tokens_per_s:,.0f}", f"{row.step_time_s:.3f}",
            f"{row.mfu:.1%}", f"{row.peak_gib:.1f}", f"{planned_gib(args, row.setting):.1f}",
            f"{row.first_step_s:.1f}", f"{row.loss:.4f}",
        ])  # fmt: skip
    return markdown_table([*header, "loss"], table)


def _relative(loss: float, reference: float | None) -> str:
    """``+0.12%`` against the fp32 run with as many processes (same data), or ``-``."""
    return "-" if reference is None else f"{(loss - reference) / reference:+.2%}"


def flops_per_token(model: Path, seq_length: int) -> float:
    """Training FLOPs per token of the model config at ``seq_length`` (meta device; matmul
    parameters, PaLM appendix B, as the trainer counts them)."""
    config = AutoConfig.from_pretrained(model)
    parameters = matmul_parameter_count(meta_model(config), config)
    return model_flops_per_token(
        parameters, config.num_hidden_layers, config.hidden_size, seq_length
    )


def render(rows: list[Row], peaks: dict[str, float], args: argparse.Namespace) -> str:
    """The Markdown table; on CUDA the MFU is the trainer's (the GPU's data-sheet peak)."""
    flops = flops_per_token(args.model, args.seq_length)
    single = {
        (r.setting.precision, r.setting.compile, r.setting.compression): r
        for r in rows
        if r.setting.processes == 1 and r.setting.threads == 1
    }
    fp32 = {r.setting.processes: r.loss for r in rows if r.setting.label.startswith("fp32,")}
    loops = {(r.setting.processes, r.setting.threads): r for r in rows if r.setting.minimal}
    header = ["setting", "tokens/s", "vs loop", "step s", "data s", "MFU", "scaling", "loss"]
    header.append("vs fp32")
    table = []
    for row in rows:
        s = row.setting
        peak = peaks["bf16" if s.precision == "bf16-mixed" else "fp32"] * s.processes * s.threads
        one = single.get((s.precision, s.compile, s.compression))
        ok = s.processes == 2 and one is not None
        scaling = f"{row.tokens_per_s / (2 * one.tokens_per_s):.2f}" if ok else "-"
        loop = loops.get((s.processes, s.threads))
        versus = f"{row.tokens_per_s / loop.tokens_per_s:.2f}" if loop else "-"
        table.append([
            s.label, f"{row.tokens_per_s:,.0f}", versus, f"{row.step_time_s:.3f}",
            f"{row.data_time_s:.4f}",
            f"{row.mfu if args.device == 'cuda' else flops * row.tokens_per_s / peak:.1%}", scaling,
            f"{row.loss:.4f}", "-" if s.minimal else _relative(row.loss, fp32.get(s.processes)),
        ])  # fmt: skip
    return markdown_table(header, table)


def run_all(
    args: argparse.Namespace, settings: list[Setting], work: Path
) -> dict[str, list[list[dict]]]:
    """Every setting once per round, interleaved; each run's median printed as it ends (so a
    stopped benchmark still leaves its finished rows). Under ``--skip-failed`` a failed run is
    printed and its setting dropped."""
    runs: dict[str, list[list[dict]]] = {s.name: [] for s in settings}
    for repeat in range(args.repeats):
        for setting in [s for s in settings if s.name in runs]:
            try:
                records = run_setting(args, setting, work / f"{setting.name}-{repeat}")
            except RuntimeError as exc:
                if not args.skip_failed:
                    raise
                print(f"{setting.name}: FAILED, left out\n{exc}", flush=True)
                del runs[setting.name]
                continue
            runs[setting.name].append(records)
            row = summarise(args, setting, [records])
            print(
                f"{setting.name}: {row.tokens_per_s:,.0f} tokens/s, MFU {row.mfu:.1%}, "
                f"peak {row.peak_gib:.1f} GiB, first step {row.first_step_s:.1f} s",
                flush=True,
            )
    return runs


def main(argv: list[str]) -> int:
    """Measure the peaks (CPU), run every setting, print the table."""
    args = parse_args(argv)
    check_data(args.data_dir)
    settings = [_setting(name.strip()) for name in args.settings.split(",") if name.strip()]
    peaks: dict[str, float] = {}
    if args.device == "cpu":
        peaks = {"fp32": measure_peak(torch.float32), "bf16": measure_peak(torch.bfloat16)}
        print(f"matmul peak, 1 thread: fp32 {peaks['fp32'] / 1e9:.1f} GFLOP/s, "
              f"bf16 {peaks['bf16'] / 1e9:.1f} GFLOP/s", flush=True)  # fmt: skip
    work = Path(args.keep or tempfile.mkdtemp(prefix="throughput-"))
    try:
        runs = run_all(args, settings, work)
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)
    rows = [summarise(args, s, runs[s.name]) for s in settings if s.name in runs]
    print(render_gpu(rows, args) if args.device == "cuda" else render(rows, peaks, args))
    peak = "the trainer's MFU (the GPU's data-sheet peak)"
    if args.device == "cpu":
        peak = "MFU against the 1-thread peaks above times the threads in use"
    print(
        f"\n{args.steps} steps of {args.batch_size} x {args.seq_length} tokens (or the "
        f"setting's micro-batch), medians after step {args.warmup}, {args.repeats} round(s); "
        f"{peak}."
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
