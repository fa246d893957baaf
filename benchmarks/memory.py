"""Peak memory per rank of the tiny LLaMA under each memory setting, measured next to the plan.

Two modes, both printing Markdown (from the repository root)::

    uv run python benchmarks/memory.py                      # measure every setting (2 CPU ranks)
    uv run python benchmarks/memory.py --settings fp32 bf16 --steps 3
    uv run python benchmarks/memory.py --model configs/llama-8m/config.json --world-size 4 \
        --settings fp32 fsdp-fp32 hsdp-fp32        # another model, 4 ranks (hsdp: 2 x 2)
    uv run python benchmarks/memory.py --plans              # LLaMA-2-7B plan tables, no training

Measuring (default mode). ``--world-size`` ranks (default 2) are spawned once (``multiprocessing``
spawn, gloo on loopback, one thread each) and measure the settings in turn, each in its own
profiler window that starts from nothing of the previous setting (its tensors are all freed; the
method checks line shows it). For each setting each rank builds the pieces as
``main.build_trainer`` does (``build_model`` from ``--model``, by default
``configs/llama-tiny/config.json``, with a random init, ``enable_activation_checkpointing``, then
``wrap_ddp`` with ``register_compression`` of method ``none``, or for ``fsdp``/``hsdp``
``parallel.fsdp.shard_from_rank0``, as the fsdp and hsdp modes use it: rank 0 builds the weights,
the others the shapes on the meta device, ``shard_model`` over the mesh (hsdp: ``--shard-degree``
ranks per replica, FSDP's own replicate all-reduce), ``load_from_rank0``; then ``build_optimizer``)
and runs ``--steps`` optimizer steps the way ``main.optimizer_step`` does: forward under
``autocast_context``, backward, ``clip_grad_norm_``, ``step()``, ``zero_grad(set_to_none=True)``.
The inputs are random token ids of shape ``[--micro-batch, --seq-length]`` (int64) instead of C4
windows: memory depends on shapes only.

What "memory" means here: the bytes of live tensors, the CPU counterpart of
``torch.cuda.max_memory_allocated``, which is what ``plan_memory(..., overhead_gib=0)``
predicts. It is read from ``torch.profiler`` with ``profile_memory=True``: while it is on, c10's
CPU allocator (``ProfiledCPUMemoryReporter`` in ``c10/core/CPUAllocator.cpp``) reports the size
of every tensor storage allocated and freed. The profiled window starts before the model is
built, so the running sum of those sizes is every tensor the run created and still holds
(weights, gradients, DDP buckets, AdamW state, activations, temporaries, inputs), and its
maximum over the steps is the peak. ``record_function`` markers split each step into forward,
backward and optimizer (clip + step) for the per-phase table; the phase columns are the peaks
inside each phase of the last step (AdamW creates its state in step 1, so later steps are the
steady state).

Limits, honestly: (1) only storage allocated through c10's CPU allocator on threads the profiler
follows (the calling thread, which also runs CPU autograd) is seen; buffers that oneDNN, gloo or
OpenMP allocate themselves are not (the plan does not model them either). (2) Bytes are the sizes
requested; CPU has no caching allocator, so there is no reserved-versus-allocated gap, but glibc
heap fragmentation is invisible. The "RSS growth" column (peak resident set, VmHWM, minus the
resident set just before the model is built, after resetting the peak through
``/proc/self/clear_refs``) shows all process memory for context: it includes those buffers,
fragmentation, the profiler's own event records and lazily loaded kernels, and misses pages
allocated but never touched (and freed heap glibc kept from an earlier setting, though
``malloc_trim`` runs first), so it is context, not the quantity the plan predicts; note that the
trainer's CPU ``peak_memory`` metric is this process-wide ru_maxrss. (3) Tensors freed during the
window that were allocated before it are ignored (the reporter does not know their size);
nothing of the run's own is allocated before the window. (4) Agreement on CPU checks the byte
accounting of weights, gradients, buckets, optimizer state and saved activations; CUDA kernels
(flash attention, cuBLAS workspaces) and the caching allocator differ, so on a GPU compare with
``torch.cuda.max_memory_allocated`` and add the plan's overhead. (5) AdamW runs with
``implementation="foreach"`` by default here because the plan models foreach AdamW's step
temporary; the ``fused`` row (the trainer's default) and the ``for-loop`` row show what changes
with the other implementations.

Planning (``--plans``): ``planning.comparison_table`` for LLaMA-2-7B with the settings of
``configs/llama2_7b_ddp_dct.toml`` on 1, 2, 4 and 8 GPUs of 80 GiB and of 24 GiB, plus plain
fp32 DDP on 8 x 80 GiB for contrast, and the first of ``planning.suggestions`` for each row that
does not fit. Arithmetic only; nothing is allocated.
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import ctypes
import gc
import os
import queue
import socket
import sys
import time
import tomllib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from multiprocessing.context import SpawnProcess
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function
from transformers import PretrainedConfig

from torchrun_ddp.compression import CompressionSettings, register_compression
from torchrun_ddp.errors import UserError
from torchrun_ddp.model import (
    ModelSpec,
    autocast_context,
    build_model,
    enable_activation_checkpointing,
    load_model_config,
)
from torchrun_ddp.optim import build_optimizer
from torchrun_ddp.parallel.base import MeshShape
from torchrun_ddp.parallel.ddp import wrap_ddp
from torchrun_ddp.parallel.modes import clip_grad_norm, mesh_shape
from torchrun_ddp.parallel.sharding import build_mesh, shard_from_rank0
from torchrun_ddp.plan.architecture import llama2_7b_config, meta_model, parameter_sizes
from torchrun_ddp.plan.memory import MemoryPlan
from torchrun_ddp.plan.settings import MIB, PlanSettings
from torchrun_ddp.planning import comparison_table, plan_memory, suggestions

REPO = Path(__file__).resolve().parents[1]
TINY_MODEL = REPO / "configs" / "llama-tiny" / "config.json"
LLAMA2_7B_TOML = REPO / "configs" / "llama2_7b_ddp_dct.toml"
TOLERANCE = 0.15
"""The issue's bound on |plan - measured| / measured."""
MARK = "memory-benchmark:"
"""Prefix of the ``record_function`` markers that delimit the phases of a step."""
PHASES = ("forward", "backward", "optimizer")


@dataclass(frozen=True)
class Run:
    """What every setting of one measurement shares: the model config, the ranks, and the
    micro-batch of random token ids (int64 ``[micro_batch, seq_length]`` per rank). The
    defaults are configs/tiny.toml's tiny LLaMA on 2 ranks, 4 x 256 tokens."""

    model: Path = TINY_MODEL
    world_size: int = 2
    micro_batch: int = 4
    seq_length: int = 256
    shard_degree: int = 2
    """hsdp: the ranks one replica is sharded over (a simulated node)."""

    def mesh(self, data_parallel: str) -> MeshShape:
        """The mesh of ``fsdp`` or ``hsdp``, as ``parallel.modes.mesh_shape`` gives the trainer.

        Raises UserError when ``shard_degree`` does not divide ``world_size`` under hsdp."""
        return mesh_shape(data_parallel, self.world_size, self.shard_degree, self.shard_degree)

    def describe(self) -> str:
        """``configs/llama-8m/config.json, 4 CPU ranks, ...`` for the table's heading."""
        model = self.model.resolve()
        name = model.relative_to(REPO) if model.is_relative_to(REPO) else model
        return (
            f"{name}, {self.world_size} CPU ranks (gloo; hsdp: replicas of {self.shard_degree} "
            f"shards), micro-batch {self.micro_batch} x {self.seq_length} tokens"
        )


@dataclass(frozen=True)
class Setting:
    """One row of the measured table: the trainer flags it stands for."""

    name: str
    precision: str
    zero1: bool = False
    checkpointing: bool = False
    bucket_view: bool = True
    adamw: str = "foreach"
    data_parallel: str = "ddp"
    """ddp; fsdp: the model sharded over every rank; hsdp: sharded within ``Run.shard_degree``
    ranks and replicated across them (``parallelize.shard_model`` on the 2-D mesh)."""

    def label(self) -> str:
        """``bf16-mixed + zero1 + AC``, plus what differs from the defaults of this table."""
        parts = [self.precision] + [self.data_parallel] * (self.data_parallel != "ddp")
        parts += ["zero1"] * self.zero1 + ["AC"] * self.checkpointing
        extras = [] if self.bucket_view else ["no bucket view"]
        extras += [] if self.adamw == "foreach" else [f"{self.adamw} AdamW"]
        return " + ".join(parts) + (f" ({', '.join(extras)})" if extras else "")

    def plan_settings(self, run: Run) -> PlanSettings:
        """The plan's view of this setting on ``run``'s ranks and micro-batch, no fixed
        overhead."""
        return PlanSettings(
            world_size=run.world_size,
            micro_batch=run.micro_batch,
            seq_length=run.seq_length,
            precision=self.precision,
            zero1=self.zero1,
            activation_checkpointing=self.checkpointing,
            gradient_as_bucket_view=self.bucket_view and self.data_parallel == "ddp",
            overhead_gib=0.0,
            fused_adamw=self.adamw == "fused",
            data_parallel=self.data_parallel,
            shard_degree=run.shard_degree if self.data_parallel == "hsdp" else 0,
        )


SETTINGS = {
    s.name: s
    for s in (
        Setting("fp32", "fp32"),
        Setting("bf16-mixed", "bf16-mixed"),
        Setting("bf16", "bf16"),
        Setting("fp32-ac", "fp32", checkpointing=True),
        Setting("bf16-mixed-ac", "bf16-mixed", checkpointing=True),
        Setting("fp32-zero1", "fp32", zero1=True),
        Setting("bf16-mixed-zero1-ac", "bf16-mixed", zero1=True, checkpointing=True),
        Setting("fp32-no-view", "fp32", bucket_view=False),
        Setting("bf16-mixed-zero1-ac-no-view", "bf16-mixed", True, True, bucket_view=False),
        Setting("fp32-fused", "fp32", adamw="fused"),
        Setting("fp32-for-loop", "fp32", adamw="for-loop"),
        Setting("fsdp-fp32", "fp32", data_parallel="fsdp"),
        Setting("fsdp-bf16-mixed-ac", "bf16-mixed", checkpointing=True, data_parallel="fsdp"),
        Setting("hsdp-fp32", "fp32", data_parallel="hsdp"),
    )
}
"""Every measured setting by name (``--settings``), in table order."""


@dataclass(frozen=True)
class RankMemory:
    """What one rank measured, bytes.

    ``peak``: live tensors at their maximum over all steps. ``phases``: the maximum inside each
    of ``PHASES`` of the last step, and ``start`` (live bytes when the last step begins: weights,
    buckets, AdamW state). ``rss_growth``: peak resident set minus the resident set before the
    model was built (-1 when it cannot be read). ``residual`` and ``floor``: live bytes when the
    window ends and the lowest running sum, both about 0 when the window saw every allocation
    and free of its own tensors (checks of the method).
    """

    rank: int
    peak: int
    phases: dict[str, int]
    rss_growth: int
    residual: int
    floor: int

    def to_message(self) -> tuple[int, int, dict[str, int], int, int, int]:
        """Plain values for the result queue (classes of a spawned ``__main__`` do not
        unpickle in the parent)."""
        return self.rank, self.peak, self.phases, self.rss_growth, self.residual, self.floor


def _status_kib(field: str) -> int:
    """A ``/proc/self/status`` field in KiB (VmRSS, VmHWM); -1 when unavailable (not Linux)."""
    with contextlib.suppress(OSError), open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return -1


def _reset_peak_rss() -> bool:
    """Give freed heap back to the OS (glibc ``malloc_trim``, so an earlier setting's freed
    memory does not hide this one's growth), then reset VmHWM to the current resident set
    (Linux: write 5 to /proc/self/clear_refs). False when the peak cannot be reset."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


@contextlib.contextmanager
def _phase(name: str, step: int) -> Iterator[None]:
    """Mark ``name`` of step ``step`` in the profiler trace."""
    with record_function(f"{MARK}{name}:{step}"):
        yield


def _train(setting: Setting, config: PretrainedConfig, steps: int, run: Run) -> None:
    """Build the model and optimizer as ``main.build_trainer`` does, then run ``steps``
    optimizer steps on random ``[run.micro_batch, run.seq_length]`` int64 token ids."""
    device = torch.device("cpu")
    model, wrapped = _parallel(setting, config, run)
    optimizer = build_optimizer(model, 1e-3, 0.1, setting.adamw, setting.zero1)
    generator = torch.Generator().manual_seed(dist.get_rank())
    shape = (run.micro_batch, run.seq_length)
    for step in range(steps):
        with _phase("step", step):
            input_ids = torch.randint(0, config.vocab_size, shape, generator=generator)
            with _phase("forward", step), autocast_context(setting.precision, device):
                loss = wrapped(input_ids=input_ids, labels=input_ids).loss
            with _phase("backward", step):
                loss.backward()
            with _phase("optimizer", step):
                clip_grad_norm(wrapped, 1.0)
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            del loss, input_ids


def _parallel(
    setting: Setting, config: PretrainedConfig, run: Run
) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(the model, what the loop runs): DDP with the ``none`` comm hook around a model every
    rank built, or the model sharded by FSDP2 from rank 0's seeded weights by
    ``parallel.fsdp.shard_from_rank0``, as the fsdp and hsdp modes build it."""
    device = torch.device("cpu")
    spec = ModelSpec(str(run.model), config, "random", setting.precision, 0, setting.checkpointing)
    if setting.data_parallel != "ddp":
        hybrid = setting.data_parallel == "hsdp"
        mesh = build_mesh(device, run.mesh(setting.data_parallel), hybrid)
        model, _ = shard_from_rank0(spec, device, mesh)
        return model, model
    model = build_model(spec.name, config, spec.init, spec.precision, spec.seed, device)
    if setting.checkpointing:
        enable_activation_checkpointing(model)
    ddp = wrap_ddp(model, device, 25.0, setting.bucket_view)
    register_compression(ddp, CompressionSettings(method="none"))
    return model, ddp


def _analyse(prof: profile, rank: int, rss_growth: int) -> RankMemory:
    """Live bytes over time from the profiler's CPU memory events; peaks per window."""
    events = prof.profiler.kineto_results.events()
    memory = [
        (e.start_ns(), e.nbytes())
        for e in events
        if e.name() == "[memory]" and e.device_type() == DeviceType.CPU
    ]
    memory.sort(key=lambda item: item[0])  # stable: same-time events keep their order
    times, live, total = [], [], 0
    for when, nbytes in memory:
        total += nbytes
        times.append(when)
        live.append(total)
    marks = {
        e.name().removeprefix(MARK): (e.start_ns(), e.end_ns())
        for e in events
        if e.name().startswith(MARK)
    }
    steps = sorted(int(name.split(":")[1]) for name in marks if name.startswith("step:"))
    first, last = marks[f"step:{steps[0]}"], marks[f"step:{steps[-1]}"]

    def peak(window: tuple[int, int]) -> int:
        low = bisect.bisect_left(times, window[0])
        high = bisect.bisect_right(times, window[1])
        return max([live[low - 1] if low else 0, *live[low:high]])  # low - 1: before window

    phases = {name: peak(marks[f"{name}:{steps[-1]}"]) for name in PHASES}
    phases["start"] = peak((last[0], last[0]))
    overall = peak((first[0], last[1]))
    return RankMemory(rank, overall, phases, rss_growth, total, min(live, default=0))


def _measure_one(setting: Setting, config: PretrainedConfig, steps: int, run: Run) -> RankMemory:
    """Train ``setting`` under the profiler in this rank; its memory. Everything the run
    allocated is freed before the profiler stops, so the next setting starts from nothing."""
    reset = _reset_peak_rss()
    rss_before = _status_kib("VmRSS")
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        _train(setting, config, steps, run)
        gc.collect()
    rss_growth = (_status_kib("VmHWM") - rss_before) * 1024 if reset else -1
    return _analyse(prof, dist.get_rank(), rss_growth)


def _rank_main(
    rank: int, port: int, run: Run, settings: Sequence[Setting], steps: int, results: mp.Queue
) -> None:
    """One spawned rank: join the gloo group, measure each setting in turn, report each to
    ``results`` as ``(setting name, RankMemory.to_message())``."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=run.world_size)
    try:
        config = load_model_config(str(run.model))
        for setting in settings:
            start = time.perf_counter()
            memory = _measure_one(setting, config, steps, run)
            results.put((setting.name, memory.to_message()))
            if rank == 0:
                took = time.perf_counter() - start
                print(f"measured {setting.name} in {took:.0f} s", file=sys.stderr, flush=True)
            dist.barrier()
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


Message = tuple[str, tuple[int, int, dict[str, int], int, int, int]]


def _collect(
    procs: Sequence[SpawnProcess], results: mp.Queue, count: int, timeout_s: float
) -> list[Message]:
    """``count`` messages from the ranks; raises RuntimeError when a rank dies or ``timeout_s``
    seconds pass."""
    deadline = time.monotonic() + timeout_s
    messages: list[Message] = []
    while len(messages) < count:
        if time.monotonic() > deadline:
            raise RuntimeError(f"ranks did not report within {timeout_s:g} s")
        with contextlib.suppress(queue.Empty):
            messages.append(results.get(timeout=1.0))
            continue
        failed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
        if failed:
            raise RuntimeError(f"a rank exited with status {failed[0]} (traceback above)")
    return messages


def measure(
    run: Run, settings: Sequence[Setting], steps: int, timeout_s: float
) -> dict[str, list[RankMemory]]:
    """Train each setting in turn on ``run.world_size`` spawned CPU ranks (one set of processes
    for all, to pay the imports once); each setting's memory per rank, by setting name.

    Raises RuntimeError when a rank fails or the ranks take longer than ``timeout_s`` seconds
    in all; the ranks are killed then.
    """
    context = mp.get_context("spawn")
    results = context.Queue()
    args = (_free_port(), run, list(settings), steps, results)
    ranks = range(run.world_size)
    procs = [context.Process(target=_rank_main, args=(rank, *args)) for rank in ranks]
    for proc in procs:
        proc.start()
    try:
        messages = _collect(procs, results, run.world_size * len(settings), timeout_s)
        for proc in procs:
            proc.join(timeout=60)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join()
    measured: dict[str, list[RankMemory]] = {s.name: [] for s in settings}
    for name, message in messages:
        measured[name].append(RankMemory(*message))
    return {name: sorted(ranks, key=lambda r: r.rank) for name, ranks in measured.items()}


def planned(setting: Setting, run: Run) -> MemoryPlan:
    """``plan_memory`` for ``run``'s model under ``setting`` (busiest rank under zero1)."""
    config = load_model_config(str(run.model))
    sizes = parameter_sizes(meta_model(config))
    return plan_memory(config, sum(sizes), setting.plan_settings(run), parameter_sizes=sizes)


def _plan_phases(plan: MemoryPlan) -> dict[str, int]:
    """The plan's phases mapped onto the measured ones, bytes: ``start`` is the persistent state
    (weights, buckets, AdamW state, and the gradients when the plan keeps them as bucket views),
    backward the larger of the plan's start and end of backward."""
    phases = plan.phases
    kept = plan.settings.gradient_as_bucket_view or plan.settings.accumulation_steps > 1
    return {
        "start": plan.weights + plan.ddp_buckets + plan.optimizer_state + plan.gradients * kept,
        "forward": phases["end of forward"],
        "backward": max(phases["start of backward"], phases["end of backward"]),
        "optimizer": phases["optimizer step"],
    }


def _mib(size: float) -> str:
    """Bytes as MiB with one decimal."""
    return f"{size / MIB:.1f}"


def measured_tables(rows: Sequence[tuple[Setting, list[RankMemory]]], run: Run) -> str:
    """The summary table (peak per rank against the plan), the per-phase table and the method
    checks, Markdown. Measured values are the maximum over ranks (the plan is the busiest)."""
    summary = [
        "| setting | measured peak MiB per rank | plan MiB | (plan - measured) / measured "
        "| within 15%? | plan peak at | RSS growth MiB |",
        "|---|---:|---:|---:|---|---|---:|",
    ]
    phases = [
        "| setting | start of step | forward | backward | optimizer step |",
        "|---|---:|---:|---:|---:|",
    ]
    for setting, ranks in rows:
        plan = planned(setting, run)
        measured = max(rank.peak for rank in ranks)
        error = (plan.total - measured) / measured
        verdict = "yes" if abs(error) <= TOLERANCE else "**no**"
        rss = max(rank.rss_growth for rank in ranks)
        summary.append(
            f"| {setting.label()} | {_mib(measured)} | {_mib(plan.total)} | {error:+.1%} "
            f"| {verdict} | {plan.peak_phase} | {_mib(rss) if rss >= 0 else 'n/a'} |"
        )
        plan_phases = _plan_phases(plan)
        cells = [
            f"{_mib(max(rank.phases[name] for rank in ranks))} / {_mib(plan_phases[name])}"
            for name in ("start", *PHASES)
        ]
        phases.append(f"| {setting.label()} | {' | '.join(cells)} |")
    every = [rank for _, ranks in rows for rank in ranks]
    residual = max(abs(rank.residual) for rank in every)
    floor = min(rank.floor for rank in every)
    checks = (
        f"Method checks: live bytes left when a window ends, at most {_mib(residual)} MiB; "
        f"lowest running sum {_mib(floor)} MiB (both about 0 when each window saw all of its "
        "own allocations and frees)."
    )
    note = "Per phase, MiB per rank, measured / plan (last step; backward: plan's larger phase):"
    return "\n\n".join(["\n".join(summary), note, "\n".join(phases), checks])


def seven_b_base() -> PlanSettings:
    """The plan settings of configs/llama2_7b_ddp_dct.toml (trainer defaults where it is
    silent: fp32, no zero1 or checkpointing, gradient_as_bucket_view on, 25 MiB buckets),
    1 x 80 GiB."""
    toml = tomllib.loads(LLAMA2_7B_TOML.read_text())
    return PlanSettings(
        world_size=1,
        micro_batch=int(toml.get("batch_size", 4)),
        seq_length=int(toml.get("seq_length", 512)),
        precision=str(toml.get("precision", "fp32")),
        zero1=bool(toml.get("zero1", False)),
        activation_checkpointing=bool(toml.get("activation_checkpointing", False)),
        device_memory_gib=80.0,
        ddp_bucket_cap_mb=float(toml.get("ddp_bucket_cap_mb", 25.0)),
        gradient_as_bucket_view=bool(toml.get("gradient_as_bucket_view", True)),
        accumulation_steps=int(toml.get("accumulation_steps", 1)),
        fused_adamw=str(toml.get("adamw_implementation", "fused")) == "fused",
    )


def seven_b_plans() -> str:
    """LLaMA-2-7B: the configured settings on 1, 2, 4 and 8 GPUs of 80 and of 24 GiB, plain fp32
    DDP (torch's defaults: no bucket view) on 8 x 80 GiB, and the first suggestion for each row
    that does not fit; Markdown. Overhead is the plan's default (1 GiB per GPU)."""
    config = llama2_7b_config()
    sizes = parameter_sizes(meta_model(config))
    base = seven_b_base()
    settings = [
        replace(base, world_size=world, device_memory_gib=memory)
        for memory in (80.0, 24.0)
        for world in (1, 2, 4, 8)
    ]
    plain = replace(base, world_size=8, precision="fp32", zero1=False)
    settings.append(replace(plain, activation_checkpointing=False, gradient_as_bucket_view=False))
    plans = [plan_memory(config, sum(sizes), s, parameter_sizes=sizes) for s in settings]
    lines = [comparison_table(plans), "", "First suggestion for each row that does not fit:", ""]
    for plan in plans:
        if plan.fits:
            continue
        hint = suggestions(config, sum(sizes), plan.settings, parameter_sizes=sizes)[0]
        lines.append(f"- {plan.describe()}: {hint}")
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Command-line flags (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plans", action="store_true", help="print the LLaMA-2-7B plans only")
    parser.add_argument(
        "--settings", nargs="+", choices=list(SETTINGS), default=list(SETTINGS),
        help="settings to measure (default: all)",
    )  # fmt: skip
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps per setting")
    parser.add_argument(
        "--model", type=Path, default=TINY_MODEL, help="model config.json (default: tiny LLaMA)"
    )
    parser.add_argument("--world-size", type=int, default=2, help="CPU ranks (default 2)")
    parser.add_argument("--micro-batch", type=int, default=4, help="sequences per rank")
    parser.add_argument("--seq-length", type=int, default=256, help="tokens per sequence")
    parser.add_argument(
        "--shard-degree", type=int, default=2, help="hsdp: ranks per replica (default 2)"
    )
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds for all settings")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Print the 7B plan tables (``--plans``) or measure the chosen settings; exit status."""
    args = parse_args(argv)
    if args.plans:
        print(seven_b_plans())
        return 0
    if args.steps < 2:
        print("--steps must be at least 2 (step 1 creates the AdamW state)", file=sys.stderr)
        return 2
    run = Run(args.model, args.world_size, args.micro_batch, args.seq_length, args.shard_degree)
    settings = [SETTINGS[name] for name in args.settings]
    if any(s.data_parallel == "hsdp" for s in settings):
        try:
            run.mesh("hsdp")
        except UserError as exc:
            print(f"memory.py: {exc}", file=sys.stderr)
            return 2
    measured = measure(run, settings, args.steps, args.timeout)
    rows = [(setting, measured[setting.name]) for setting in settings]
    print(
        f"{run.describe()}, {args.steps} optimizer steps; measured = peak live tensor bytes "
        "(profiler, max over ranks), plan = plan_memory(overhead_gib=0).\n"
    )
    print(measured_tables(rows, run))
    return 0


if __name__ == "__main__":
    sys.exit(main())
