"""Shared pieces of the benchmark scripts: compression variants, torchrun runs, metrics, tables.

Every subprocess here runs in its own session with a timeout; on timeout (or Ctrl-C) the whole
process group (torchrun agent and its workers) is killed, so nothing is left running.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"
"""The offline C4 sample and tokenizer (``../shared/data`` from the repository root)."""
KILL_GRACE_S = 10.0
DCT_HOOKS = ("dct", "dct-topk")
"""The comm hooks that read --compression-block-size and --compression-error-feedback."""
HOOKS = (*DCT_HOOKS, "fp16", "bf16", "powersgd")
"""The comm hooks that read --compression-start-step (every one but none)."""
SHORT_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
"""``--compression-value-dtype`` values and their short names in variant names and labels."""


@dataclass(frozen=True)
class Variant:
    """One row of a benchmark table: a compression method and its flags for ``train.py``."""

    name: str
    """Short id used by ``--methods`` (e.g. ``dct-0.125``)."""
    label: str
    """Method and settings as printed in the table."""
    flags: tuple[str, ...]
    """Extra ``train.py`` flags selecting the method."""
    collective: str = "all_reduce"
    """How the payload travels in the global scope: ``all_reduce`` or ``all_gather`` (top-k)."""
    scope: str = "global"
    """``--compression-scope``: ``global`` or ``inter-node``."""
    period: int = 1
    """Optimizer steps per exchange: 1, or H for DiLoCo and SparseLoCo (``--local-steps``)."""


def _dct(ratio: float, block: int, values: str = "float32", rotating: bool = False) -> Variant:
    """``dct`` sending ``ratio`` of every ``block``'s coefficients as ``values``: low-pass, or
    ``rotating`` (name suffix ``-rot``; error feedback as the run sets it)."""
    flags = ("--compression", "dct", "--compression-ratio", str(ratio))
    flags += ("--compression-block-size", str(block))
    name, label = f"dct-{ratio:g}", f"dct ratio {ratio:g}, block {block}"
    if values != "float32":
        flags += ("--compression-value-dtype", values)
        name, label = f"{name}-{SHORT_DTYPES[values]}", f"{label}, {SHORT_DTYPES[values]}"
    if rotating:
        flags += ("--compression-selection", "rotating")
        name, label = f"{name}-rot", f"{label}, rotating"
    return Variant(name, label, flags)


def _extended(variant: Variant, suffix: str, label: str, *flags: str, scope: str = "") -> Variant:
    """``variant`` with more ``train.py`` ``flags``: name suffix ``-<suffix>``, ``, <label>`` added
    to its label, and its scope replaced where ``scope`` is given; the rest is kept."""
    return replace(
        variant,
        name=f"{variant.name}-{suffix}",
        label=f"{variant.label}, {label}",
        flags=(*variant.flags, *flags),
        scope=scope or variant.scope,
    )


def _node_aware(variant: Variant) -> Variant:
    """``variant`` with ``--compression-scope inter-node`` (name suffix ``-node``)."""
    flags = ("--compression-scope", "inter-node")
    return _extended(variant, "node", "node-aware", *flags, scope="inter-node")


def _outer_lr(variant: Variant, lr: float) -> Variant:
    """DiLoCo or SparseLoCo ``variant`` with ``--outer-lr lr`` (name suffix ``-outer<lr>``)."""
    return _extended(variant, f"outer{lr:g}", f"outer lr {lr:g}", "--outer-lr", f"{lr:g}")


def _error_feedback(variant: Variant, decay: float) -> Variant:
    """SparseLoCo ``variant`` with error-feedback decay ``--sparseloco-beta decay`` (name suffix
    ``-beta<decay>``)."""
    flags = ("--sparseloco-beta", f"{decay:g}")
    return _extended(variant, f"beta{decay:g}", f"error feedback {decay:g}", *flags)


def _overlapped(variant: Variant) -> Variant:
    """DeMo, DiLoCo or SparseLoCo ``variant`` with ``--overlap-exchange`` (name suffix
    ``-overlap``; DiLoCo and SparseLoCo: the outer update one whole window late)."""
    return _extended(variant, "overlap", "overlapped", "--overlap-exchange")


def _eager(variant: Variant) -> Variant:
    """DiLoCo or SparseLoCo ``variant`` overlapped with eager updates (``--overlap-exchange
    --eager-updates``; name suffix ``-eager``)."""
    flags = ("--overlap-exchange", "--eager-updates")
    return _extended(variant, "eager", "overlapped, eager", *flags)


def _delayed(variant: Variant, steps: int) -> Variant:
    """Overlapped DiLoCo or SparseLoCo ``variant`` whose outer update lands ``steps`` inner steps
    after the sync instead of one whole window (``--sync-delay``; name suffix ``-delay<steps>``)."""
    flags = ("--sync-delay", str(steps))
    return _extended(variant, f"delay{steps}", f"{steps} step late", *flags)


def _templar() -> Variant:
    """SparseLoCo as Templar runs it (``--sparseloco-preset templar``: H 30, k 64 of 64 x 64,
    2-bit statistical values, error feedback 0.95, sender mean, median clipping, outer lr 1)."""
    flags = ("--optimizer", "sparseloco", "--sparseloco-preset", "templar")
    label = "SparseLoCo, Templar's settings (H 30, k 64/4096, 2-bit statistical)"
    return Variant("sparseloco-templar", label, flags, "all_gather", period=30)


def _topk(k: int, block: int, values: str = "float32") -> Variant:
    """``dct-topk`` sending the ``k`` largest coefficients of every ``block``.

    ``values``: the wire dtype of the coefficients (``--compression-value-dtype``); the name gets
    a ``-bf16`` / ``-fp16`` suffix for the 16-bit ones.
    """
    flags = ("--compression", "dct-topk", "--compression-topk", str(k))
    flags += ("--compression-block-size", str(block), "--compression-value-dtype", values)
    short = SHORT_DTYPES[values]
    name = f"dct-topk-{k}" + ("" if values == "float32" else f"-{short}")
    return Variant(name, f"dct-topk k {k}, block {block}, {short} values", flags, "all_gather")


def _demo(k: int) -> Variant:
    """DeMo (``--optimizer demo``) sending the ``k`` largest DCT coefficients of every tile of
    its momentum (tiles up to 64 x 64, bf16 values, int16/uint8 positions)."""
    flags = ("--optimizer", "demo", "--demo-topk", str(k))
    return Variant(f"demo-{k}", f"DeMo k {k}, tiles <= 64 x 64, bf16", flags, "all_gather")


def _local(method: str, steps: int, values: str = "float32", topk: int = 64) -> Variant:
    """DiLoCo, SparseLoCo or MuLoCo (``--optimizer diloco|sparseloco|muloco``) syncing every
    ``steps`` steps at the papers' defaults (DiLoCo: outer Nesterov SGD lr 0.7, momentum 0.9,
    pseudo-gradient in ``values``; SparseLoCo: ``topk`` (64) of 64 x 64 chunks, 2-bit values,
    error feedback 0.95, outer lr 1, the name getting ``-k<topk>`` for another k; MuLoCo: Muon
    inner, SparseLoCo's exchange at its defaults, DiLoCo's outer step)."""
    flags = ("--optimizer", method, "--local-steps", str(steps))
    if method == "muloco":
        label = f"MuLoCo H {steps}, Muon inner, k 64/4096, 2-bit"
        return Variant(f"muloco-h{steps}", label, flags, "all_gather", period=steps)
    if method == "sparseloco":
        name, label = f"sparseloco-h{steps}", f"SparseLoCo H {steps}, k {topk}/4096, 2-bit"
        if topk != 64:
            flags += ("--sparseloco-topk", str(topk))
            name = f"{name}-k{topk}"
        return Variant(name, label, flags, "all_gather", period=steps)
    name, label = f"diloco-h{steps}", f"DiLoCo H {steps}, fp32 all-reduce"
    if values != "float32":
        flags += ("--pseudo-gradient-dtype", values)
        name, label = f"{name}-{SHORT_DTYPES[values]}", f"DiLoCo H {steps}, bf16 all-reduce"
    return Variant(name, label, flags, period=steps)


OPTIMIZERS = ("demo", "diloco", "sparseloco", "muloco")
"""The ``--optimizer`` values other than ``adamw`` a variant may name."""


def compression_of(variant: Variant) -> str:
    """The ``--compression`` of a variant (``none`` where its flags name none)."""
    flags = list(variant.flags)
    if "--compression" not in flags:
        return "none"
    return flags[flags.index("--compression") + 1]


def hook_flags(variant: Variant, flag: str, value: str, hooks: tuple[str, ...]) -> list[str]:
    """``flag value`` when the variant's ``--compression`` is one of ``hooks`` (train.py refuses
    a comm hook's flag under a hook that does not read it), else nothing."""
    return [flag, value] if compression_of(variant) in hooks else []


def optimizer_of(variant: Variant) -> str:
    """``adamw`` or one of ``OPTIMIZERS``: the ``--optimizer`` of a variant."""
    named = [flag for flag in variant.flags if flag in OPTIMIZERS]
    return named[0] if named else "adamw"


def _powersgd(rank: int) -> Variant:
    """torch's PowerSGD at approximation rank ``rank``."""
    flags = ("--compression", "powersgd", "--powersgd-rank", str(rank))
    return Variant(f"powersgd-{rank}", f"powersgd rank {rank}", flags)


def all_variants(block: int = 64) -> dict[str, Variant]:
    """Every variant the benchmarks know, by name, in table order (``block``: DCT block)."""
    none = Variant("none", "none (dense fp32 all-reduce)", ("--compression", "none"))
    bf16 = Variant("bf16", "bf16", ("--compression", "bf16"))
    dct_8x = _dct(0.25, block, "bfloat16")
    variants = [
        none,
        Variant("fp16", "fp16", ("--compression", "fp16")),
        bf16,
        _powersgd(4),
        _powersgd(16),
        _dct(0.5, block),
        _dct(0.125, block),
        _dct(0.03, block),
        dct_8x,
        _dct(0.5, block, "bfloat16"),
        _dct(0.125, block, rotating=True),
        _dct(0.25, block, "bfloat16", rotating=True),
        _node_aware(none),
        _node_aware(bf16),
        _node_aware(dct_8x),
        _node_aware(_dct(0.125, block)),
        _topk(8, block),
        _topk(4, block),
        _topk(2, block),
        _topk(8, block, "bfloat16"),
        _topk(4, block, "bfloat16"),
        _demo(32),
        _node_aware(_demo(32)),
        _overlapped(_demo(32)),
        _overlapped(_node_aware(_demo(32))),
        _demo(16),
        _demo(8),
        _demo(4),
        *(_local("diloco", steps) for steps in (25, 50, 125)),
        _local("diloco", 125, "bfloat16"),
        *(_local("sparseloco", steps) for steps in (25, 50, 125)),
        *(_local("muloco", steps) for steps in (30, 50)),
        _node_aware(_local("sparseloco", 25)),
        _overlapped(_local("diloco", 50)),
        _overlapped(_local("sparseloco", 25)),
        _overlapped(_node_aware(_local("sparseloco", 25))),
        _local("sparseloco", 125, topk=256),
        _local("sparseloco", 100, topk=256),
        _local("sparseloco", 10, topk=25),
        *(_outer_lr(_local("sparseloco", 25), lr) for lr in (0.7, 1.5)),
        _error_feedback(_local("sparseloco", 25), 0.999),
        _eager(_local("diloco", 50)),
        _eager(_local("sparseloco", 25)),
        _delayed(_overlapped(_local("sparseloco", 25)), 1),
        _delayed(_eager(_local("sparseloco", 25)), 1),
        _templar(),
        _overlapped(_templar()),
        _eager(_templar()),
    ]
    return {variant.name: variant for variant in variants}


def pick_variants(names: str, block: int) -> list[Variant]:
    """The variants named in the comma-separated ``names``; raises SystemExit on an unknown one."""
    known = all_variants(block)
    picked = [name.strip() for name in names.split(",") if name.strip()]
    unknown = [name for name in picked if name not in known]
    if unknown:
        sys.exit(f"error: unknown method {unknown[0]!r}; choose from {', '.join(known)}")
    return [known[name] for name in picked]


def tokenizer_path(data_dir: Path, model: str = "") -> Path:
    """The tokenizer beside ``model``'s config.json where there is one (``configs/llama-8m``),
    else the sample's 32,000-token LLaMA-style one."""
    beside = (REPO / model).parent if model else None
    if beside is not None and (beside / "tokenizer.json").is_file():
        return beside
    return data_dir / "tokenizer" / "mistral-7b-v0.1"


def steps_to(curve: dict[int, float], target: float) -> float:
    """First step at which ``curve`` (step -> held-out loss) reaches ``target``, linear between
    evaluations; inf if it never does."""
    points = sorted(curve.items())
    if points and points[0][1] <= target:
        return float(points[0][0])
    for (step0, loss0), (step1, loss1) in itertools.pairwise(points):
        if loss1 <= target:  # loss0 > target: checked one pair earlier
            return step0 + (loss0 - target) / (loss0 - loss1) * (step1 - step0)
    return math.inf


def data_args(data_dir: Path, model: str = "") -> list[str]:
    """``train.py`` flags for the tokenizer (``tokenizer_path``), training and held-out files
    of the C4 sample."""
    return [
        "--tokenizer", str(tokenizer_path(data_dir, model)),
        "--data-files", str(data_dir / "c4" / "*train*.json.gz"),
        "--eval-files", str(data_dir / "c4" / "*validation*.json.gz"),
    ]  # fmt: skip


def check_data(data_dir: Path) -> None:
    """Exit with a one-line message if the offline data is not where it should be."""
    if not (data_dir / "tokenizer" / "mistral-7b-v0.1").is_dir():
        sys.exit(f"error: no tokenizer under {data_dir}; pass --data-dir (see ../shared/data)")


def train_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for ``train.py`` under torchrun: offline hub, unbuffered output."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    return {**env, **(extra or {})}


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start(command: list[str], log_path: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    """Start ``command`` in a new session (its own process group), output to ``log_path``."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("wb") as log:
        return subprocess.Popen(
            command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )


def kill_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM the process group of ``proc``, then SIGKILL it if still alive after a grace."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=KILL_GRACE_S)
            return
        except subprocess.TimeoutExpired:
            continue


def wait_all(procs: list[subprocess.Popen[bytes]], timeout_s: float) -> list[int | None]:
    """Wait for every process until ``timeout_s`` from now; kill all groups if one fails or time
    runs out. Returns the exit codes (None for a process that had to be killed)."""
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            codes = [proc.poll() for proc in procs]
            if all(code is not None for code in codes) or any(code for code in codes):
                break
            time.sleep(0.5)
    finally:
        codes = [proc.poll() for proc in procs]
        for proc, code in zip(procs, codes, strict=True):
            if code is None:
                kill_group(proc)
    return codes


ARGS_FILE = "train_args.json"
"""A benchmark run folder records its ``train.py`` arguments here (checked by ``--reuse``)."""


def made_with(run_dir: Path, flags: list[str]) -> bool:
    """Whether ``run_dir`` records ``flags`` as its ``train.py`` arguments (``ARGS_FILE``)."""
    saved = run_dir / ARGS_FILE
    return saved.is_file() and json.loads(saved.read_text()) == flags


def read_metrics(path: Path) -> list[dict[str, float]]:
    """The records of a ``metrics.jsonl`` (empty if the file is missing)."""
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@dataclass(frozen=True)
class RunSummary:
    """What one training run measured (rank 0's view)."""

    step_times: list[float]
    """Per-step wall time in seconds (one record per step with ``--log-every 1``)."""
    comm_bytes: int
    """Gradient bytes this rank sent on the wire in the last logged step (ring model)."""
    comm_bytes_dense: int
    """What a dense fp32 ring all-reduce would have sent in that step, at the same world size."""
    comm_bytes_collective: int
    """Bytes this rank handed to collectives in that step (all-gather: its own part)."""
    losses: list[float]
    """Per-record training loss (mean over ranks), in step order."""
    eval_loss: float
    """The last held-out loss (nan if none was logged)."""
    collective_bytes: tuple[int, ...] = ()
    """Bytes handed to collectives in every logged step, in step order (one step per record
    with ``--log-every 1``): what :func:`per_step_collective` averages."""
    eval_losses: tuple[tuple[int, float], ...] = ()
    """(step, held-out loss) of every evaluation, in step order."""


def summarise(records: list[dict[str, float]]) -> RunSummary:
    """Collect step times, bytes, losses and the last eval loss from metrics records."""
    train = [record for record in records if "loss" in record]
    evals = [record for record in records if "eval_loss" in record]
    last = train[-1] if train else {}
    return RunSummary(
        step_times=[float(record["step_time_s"]) for record in train],
        comm_bytes=int(last.get("comm_bytes", 0)),
        comm_bytes_dense=int(last.get("comm_bytes_dense", 0)),
        comm_bytes_collective=int(last.get("comm_bytes_collective", 0)),
        losses=[float(record["loss"]) for record in train],
        eval_loss=float(evals[-1]["eval_loss"]) if evals else float("nan"),
        collective_bytes=tuple(int(record.get("comm_bytes_collective", 0)) for record in train),
        eval_losses=tuple((int(r["step"]), float(r["eval_loss"])) for r in evals),
    )


def per_step_collective(run: RunSummary, variant: Variant) -> float:
    """Bytes handed to collectives per step: the mean over the last ``variant.period`` steps
    (one exchange: a DiLoCo or SparseLoCo sync falls in every H consecutive steps), so methods
    that exchange every step keep their last step's count."""
    recent = run.collective_bytes[-variant.period :] or (run.comm_bytes_collective,)
    return sum(recent) / len(recent)


def ring_ratio(run: RunSummary, variant: Variant, measured: int, world: int) -> float:
    """Dense fp32 ring all-reduce bytes / the variant's wire bytes at ``world`` ranks, from a run
    at ``measured`` ranks (nan for the node-aware scope, whose ratio depends on the layout).

    The dense all-reduce of S bytes sends 2 (W - 1) / W * S per rank. An all-reduce payload of
    c bytes sends 2 (W - 1) / W * c, so its ratio S / c holds at every W; an all-gather of p bytes
    per rank sends (W - 1) * p, so its ratio is 2 S / (W p) and falls with W.
    """
    collective = per_step_collective(run, variant)
    if variant.scope != "global" or measured < 2 or not collective:
        return float("nan")
    dense = run.comm_bytes_dense * measured / (2 * (measured - 1))
    if variant.collective == "all_gather":
        return 2 * dense / (world * collective)
    return dense / collective


def wire_at(run: RunSummary, variant: Variant, world: int) -> float:
    """Wire bytes per rank per step at ``world`` ranks (ring model) from a run's payload: an
    all-reduce of c bytes sends 2 (W - 1) / W * c, an all-gather of p bytes per rank (W - 1) * p
    (nan for the node-aware scope). Per step means averaged over one exchange
    (:func:`per_step_collective`)."""
    collective = per_step_collective(run, variant)
    if variant.scope != "global" or not collective:
        return float("nan")
    if variant.collective == "all_gather":
        return (world - 1) * collective
    return 2 * (world - 1) / world * collective


def median_after(values: list[float], skip: int) -> float:
    """Median of ``values`` without the first ``skip`` (warm-up); nan when nothing is left."""
    kept = values[skip:]
    return statistics.median(kept) if kept else float("nan")


def human_bytes(count: float) -> str:
    """Bytes in MB (10^6) with three significant digits, or kB below 1 MB."""
    if count >= 1e6:
        return f"{count / 1e6:.3g} MB"
    return f"{count / 1e3:.3g} kB"


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    """A GitHub Markdown table; numeric-looking columns are right-aligned."""
    align = ["---:" if _numeric(rows, column) else "---" for column in range(len(header))]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(align) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def _numeric(rows: list[list[str]], column: int) -> bool:
    """Whether every cell of ``column`` starts with a number (``-`` cells are ignored)."""
    cells = [row[column].split(" ")[0].lstrip("+-").rstrip("%x") for row in rows]
    return bool(cells) and all(cell.replace(".", "", 1).isdigit() for cell in cells if cell != "-")
