"""Launch real gloo process groups for tests: no mocks of torch.distributed.

``run_distributed(fn, world_size, *args)`` starts ``world_size`` fresh processes (forked from a
fork server that has imported torch once), sets up a gloo process group on a free loopback port in
each, calls ``fn(rank, world_size, *args)`` and returns the per-rank results as a list ordered by
rank. A worker that raises fails the test with its traceback; a group that hangs is killed after
``timeout`` seconds.

``torchrun_command(args)`` / ``torchrun(args)`` run ``train.py`` under the real torchrun launcher
(c10d rendezvous on a free loopback port), always with a timeout; with ``forked=True`` through
``forked_torchrun.py``, whose ranks are forks of an agent that has imported the trainer, and
which ``start_agent`` / ``run_agent`` fork from the fork server (no fresh interpreter's imports:
8.5 s of CPU for ``import torchrun_ddp.main``, docs/benchmarks.md#test-suite).

``reference_args`` is the fault and resume tests' one training config (its uninterrupted run is
conftest.py's session fixture ``reference_run``); ``logged_losses``, ``metrics_records``,
``final_weights`` and ``assert_same_run`` read and compare runs' outputs; ``worker_pids`` finds a
torchrun agent's workers.
"""

from __future__ import annotations

import io
import json
import multiprocessing
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from datetime import timedelta
from pathlib import Path
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file

from torchrun_ddp import faults as faults_module

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
TIMEOUT_S = 420.0


def torchrun_command(
    args: list[str],
    nproc: int = 2,
    nnodes: int = 1,
    port: int | None = None,
    extra: tuple = (),
    script: Path = REPO / "train.py",
    forked: bool = False,
) -> list[str]:
    """The command line of ``torchrun ... script args`` with c10d rendezvous on loopback
    (``script``: this checkout's train.py unless another copy's is given). ``forked``: torchrun
    through ``forked_torchrun.py``, whose ranks are forks of an agent that imported the trainer
    (``script`` is then ignored: the ranks run this checkout's ``train.main``)."""
    launcher = [sys.executable, "-m", "torch.distributed.run"]
    if forked:
        launcher = [sys.executable, str(HERE / "forked_torchrun.py"), "--run-path"]
        extra, script = ("--start-method=fork", *extra), HERE / "forked_rank.py"
    return [
        *launcher, f"--nproc_per_node={nproc}", f"--nnodes={nnodes}", "--rdzv_backend=c10d",
        f"--rdzv_endpoint=127.0.0.1:{port or free_port()}", *extra, str(script), *args,
    ]  # fmt: skip


def subprocess_env(shared_store: bool = True) -> dict[str, str]:
    """The environment for training subprocesses: offline hub, unbuffered output; torchrun's
    agent store shared with the workers across restarts (its default) unless ``shared_store``
    is False, which gives a store per rendezvous round as run.sh does for elastic jobs."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    return env if shared_store else {**env, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def hook_env(faults: str = "", perturb: str = "") -> dict[str, str]:
    """``subprocess_env`` with the test hooks of faults.py set (``TORCHRUN_DDP_FAULT`` to
    ``faults``, ``TORCHRUN_DDP_PERTURB`` to ``perturb``, where given) and armed: only the
    harness arms them, a production run refuses a hook variable set without it."""
    hooks = {faults_module.ENV: faults, faults_module.PERTURB_ENV: perturb}
    return {
        **subprocess_env(),
        **{name: value for name, value in hooks.items() if value},
        faults_module.ARM_ENV: faults_module.ARMED,
    }


@contextmanager
def armed_hooks(faults: str = "", perturb: str = "") -> Iterator[None]:
    """In this process (a spawned rank): the test hooks of faults.py set and armed, as
    ``hook_env``, while the block runs; the variables as they were afterwards."""
    hooks = {faults_module.ENV: faults, faults_module.PERTURB_ENV: perturb}
    armed = {name: value for name, value in hooks.items() if value}
    with mock.patch.dict(os.environ, {**armed, faults_module.ARM_ENV: faults_module.ARMED}):
        yield


def clone_env(clone: Path) -> dict[str, str]:
    """``subprocess_env`` for a process in conftest.py's ``clone`` (a copy of the repository):
    also datasets offline, and importing the copy's package rather than this checkout's."""
    return {**subprocess_env(), "HF_DATASETS_OFFLINE": "1", "PYTHONPATH": str(clone / "src")}


def torchrun(args: list[str], nproc: int = 2, **options: object) -> subprocess.CompletedProcess:
    """Run ``train.py`` under torchrun to completion (or the timeout); output captured (with
    ``forked=True`` stdout and stderr together in ``stderr``, ``run_agent``)."""
    if options.get("forked"):
        return run_agent(torchrun_command(args, nproc, **options), subprocess_env())
    return subprocess.run(
        torchrun_command(args, nproc, **options),
        cwd=REPO,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
    )


class ForkedAgent:
    """A torchrun agent forked from this test worker's fork server (``start_agent``), with the
    part of ``subprocess.Popen``'s interface that the tests use."""

    def __init__(self, process: multiprocessing.process.BaseProcess) -> None:
        self.process = process

    @property
    def pid(self) -> int:
        """The agent's process id."""
        assert self.process.pid is not None
        return self.process.pid

    @property
    def returncode(self) -> int | None:
        """Its exit status (minus the signal that ended it), None while it runs."""
        return self.process.exitcode

    def poll(self) -> int | None:
        """``returncode``, without waiting."""
        return self.process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the agent to end; its status. Raises subprocess.TimeoutExpired."""
        self.process.join(timeout)
        if self.process.exitcode is None:
            raise subprocess.TimeoutExpired(str(self.pid), timeout or 0.0)
        return self.process.exitcode

    def send_signal(self, signum: int) -> None:
        """Send ``signum`` to the agent (nothing once it has ended)."""
        with suppress(ProcessLookupError):
            os.kill(self.pid, signum)

    def kill(self) -> None:
        """SIGKILL the agent."""
        self.send_signal(signal.SIGKILL)


Agent = subprocess.Popen | ForkedAgent
"""A launched torchrun agent."""


def start_agent(
    command: list[str], log: Path, env: dict[str, str], append: bool = False, cwd: Path = REPO
) -> Agent:
    """Start ``command`` (``torchrun_command``'s) with stdout and stderr into ``log``, in a
    session of its own. A forked command's agent (``forked=True``) is a fork of this worker's
    fork server, which has the trainer imported (a fresh interpreter's imports skipped,
    docs/benchmarks.md#test-suite); any other command a subprocess."""
    if len(command) < 2 or Path(command[1]).name != "forked_torchrun.py":
        with log.open("a" if append else "w") as sink:
            return subprocess.Popen(
                command, cwd=cwd, env=env, stdout=sink, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
    from forked_torchrun import serve_agent  # noqa: PLC0415

    log.open("a" if append else "w").close()  # there when this returns, as with Popen
    process = _context().Process(target=serve_agent, args=(command[1:], str(cwd), env, str(log)))
    process.start()
    return ForkedAgent(process)


def run_agent(
    command: list[str], env: dict[str, str], timeout: float = TIMEOUT_S, cwd: Path = REPO
) -> subprocess.CompletedProcess:
    """``command`` to its end through ``start_agent``: its status, and its stdout and stderr
    together in ``stderr`` (``stdout`` empty). Raises subprocess.TimeoutExpired (the agent
    and its workers killed)."""
    with tempfile.TemporaryDirectory() as folder:
        log = Path(folder) / "agent.log"
        agent = start_agent(command, log, env, cwd=cwd)
        try:
            status = agent.wait(timeout)
        finally:
            if agent.poll() is None:
                kill_agent(agent)
        output = log.read_text(errors="replace")
    return subprocess.CompletedProcess(command, status, "", output)


def kill_agent(agent: Agent) -> None:
    """SIGKILL the agent and every process below it (its workers), then reap it."""
    for pid in [*descendants(agent.pid), agent.pid]:
        with suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    agent.wait(timeout=30)


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (from /proc), children first."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(parent, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


PEAK = ("--peak-tflops", "1")
"""A given peak for MFU: each start then skips the CPU's matmul measurement (about 1 to 2 s per
rank with 2 ranks on 2 cores). test_end_to_end's run measures it (``--peak-tflops 0``)."""


SMALL_LLAMA = REPO / "configs" / "tiny-models" / "llama-v4096" / "config.json"
"""The hidden-64 LLaMA of configs/tiny-models with a 4,096-token vocabulary, for the multi-rank
tests of distributed mechanics (sharding, method exchanges, node-local checkpoints): with the
bundled Mistral tokenizer's 32,000 tokens its embedding and LM head are 98% of its 4.2M
parameters, so most of each step's compute and of each checkpoint's bytes; here they are 0.52M
of 0.60M."""
SMALL_TOKENIZER = REPO / "configs" / "llama-8m"
"""Its tokenizer: the 4,096-token byte-level BPE of configs/llama-8m (built from C4 by
benchmarks/train_tokenizer.py)."""


def tiny_args(
    sample_data: Path, output_dir: Path, *extra: str, tokenizer: Path | None = None
) -> list[str]:
    """The tiny config on the shared C4 sample, with the output folder given (and ``tokenizer``,
    by default the bundled Mistral tokenizer)."""
    tokenizer = tokenizer or sample_data / "tokenizer" / "mistral-7b-v0.1"
    return [
        "--config", str(REPO / "configs" / "tiny.toml"),
        "--tokenizer", str(tokenizer),
        "--data-files", str(sample_data / "c4" / "*train*.json.gz"),
        "--eval-files", str(sample_data / "c4" / "*validation*.json.gz"),
        "--output-dir", str(output_dir), *PEAK,
        *extra,
    ]  # fmt: skip


def accumulating_args(
    sample_data: Path, output_dir: Path, steps: int, checkpoint_every: int, *extra: str
) -> list[str]:
    """The sharded tests' config: SMALL_LLAMA, ``steps`` steps of 2 micro-batches of 2 x 16
    tokens per rank, a record every step, no evaluation but the last's one batch."""
    return tiny_args(
        sample_data, output_dir,
        "--model", str(SMALL_LLAMA),
        "--seq-length", "16",
        "--batch-size", "2", "--accumulation-steps", "2", "--warmup-steps", "2",
        "--log-every", "1", "--eval-every", "0", "--eval-batches", "1",
        "--checkpoint-every", str(checkpoint_every), "--learning-rate", "3e-3",
        "--max-steps", str(steps), *extra, tokenizer=SMALL_TOKENIZER,
    )  # fmt: skip


def folder_args(base: Path, folder: str, steps: int, *extra: str) -> list[str]:
    """The checkpoint-storage tests' config: SMALL_LLAMA on the bundled sample, ``steps`` steps
    of 1 x 32 tokens per rank, a checkpoint every 2 into ``base/<folder>`` (a node's folder, or
    a shared one), the output in ``base/out``, one torch thread per rank."""
    return tiny_args(
        REPO / "data", base / "out",
        "--model", str(SMALL_LLAMA), "--checkpoint-dir", str(base / folder),
        "--seq-length", "32", "--batch-size", "1", "--max-steps", str(steps),
        "--checkpoint-every", "2", "--log-every", "1", "--eval-every", "0",
        "--eval-batches", "1", "--warmup-steps", "2", "--threads", "1", *extra,
        tokenizer=SMALL_TOKENIZER,
    )  # fmt: skip


REFERENCE_STEPS = 16


def reference_args(sample_data: Path, output_dir: Path, *extra: str) -> list[str]:
    """The fault and resume tests' one config: the hidden-64 LLaMA of configs/tiny-models,
    REFERENCE_STEPS short steps (1 x 32 tokens per rank), a record every step, a checkpoint
    every 2, no held-out evaluation but the last. The tests that signal a run from outside
    (SIGTERM, the random SIGKILLs) need each step to take long enough for the signal to land
    before the run ends: the checkpoint every 2 steps (about 0.3 s on 2 cores) gives that, and
    its 48 MiB cost a fifth of the 19.5M model's 224 MiB at every save and load; 16 steps leave
    the random kills room for three restarts.
    """
    return tiny_args(
        sample_data, output_dir,
        "--model", str(REPO / "configs" / "tiny-models" / "llama" / "config.json"),
        "--seq-length", "32", "--batch-size", "1", "--max-steps", str(REFERENCE_STEPS),
        "--warmup-steps", "2", "--log-every", "1", "--eval-every", "0", "--eval-batches", "1",
        "--checkpoint-every", "2", *extra,
    )  # fmt: skip


def metrics_records(output_dir: Path) -> list[dict[str, Any]]:
    """Every record of a run's metrics.jsonl, in order ([] while the file does not exist); JSON
    values, hence ``Any``."""
    path = output_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def logged_steps(output_dir: Path) -> list[int]:
    """The step of every training record of a run's metrics.jsonl, in the file's order, as
    written: a step logged twice (a restart that did not trim the records) appears twice."""
    return [r["step"] for r in metrics_records(output_dir) if "loss" in r]


def logged_losses(output_dir: Path) -> dict[int, float]:
    """Step -> logged training loss of a run's metrics.jsonl ({} while it does not exist); a
    step logged twice keeps its last record (``logged_steps`` sees both)."""
    return {r["step"]: r["loss"] for r in metrics_records(output_dir) if "loss" in r}


def assert_logged_once(output_dir: Path, steps: int) -> None:
    """Steps 1 to ``steps`` each have exactly one training record, in order."""
    assert logged_steps(output_dir) == list(range(1, steps + 1)), logged_steps(output_dir)


def final_weights(output_dir: Path) -> dict[str, torch.Tensor]:
    """The tensors of a run's exported final model (final_model/model.safetensors)."""
    return load_file(output_dir / "final_model" / "model.safetensors")


def assert_same_run(got: Path, expected: Path, steps: int | None = None) -> None:
    """The same loss at every step (steps 1 to ``steps`` each logged exactly once, in order,
    where given) and bit-identical final weights."""
    assert logged_losses(got) == logged_losses(expected)
    if steps is not None:
        assert_logged_once(got, steps)
    want, have = final_weights(expected), final_weights(got)
    assert have.keys() == want.keys()
    for name, tensor in want.items():
        assert torch.equal(have[name], tensor), name


def worker_pids(agent_pid: int) -> list[int]:
    """PIDs of the worker processes (ranks) started by a torchrun agent: train.py's, or the
    forks of a ``forked_torchrun.py`` agent (whose command line they share; torchrun's other
    children, such as multiprocessing's resource tracker, have their own)."""
    try:
        agent = (Path("/proc") / str(agent_pid) / "cmdline").read_bytes()
    except OSError:
        return []
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if int(stat[1]) == agent_pid and (b"train.py" in cmdline or cmdline == agent):
            found.append(int(entry.name))
    return found


_HANDED_OUT: set[int] = set()
"""The ports ``free_port`` returned in this process."""
PORTS_PER_WORKER = 2500
"""Each pytest-xdist worker's own block of ports, from port 10000 (gw0's) up."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago and that this process has not handed
    out before, from this pytest-xdist worker's own block (``PORTS_PER_WORKER``), below the
    kernel's ephemeral range (ip_local_port_range). So neither the other worker's tests nor a
    port the kernel picks for a connection or a bind to port 0 (gloo's, torchft's) can take it
    before the test's process binds it: a rendezvous store that could not bind its port, and a
    lighthouse whose port another process held, were seen in full-suite runs. Where the block
    does not fit below that range, the kernel picks."""
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
    low = 10000 + worker * PORTS_PER_WORKER
    high = min(low + PORTS_PER_WORKER, _ephemeral_low())
    candidates = [port for port in range(low, high) if port not in _HANDED_OUT]
    random.SystemRandom().shuffle(candidates)
    for port in candidates:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _ephemeral_low() -> int:
    """The lowest port of the kernel's ephemeral range (0 where it cannot be read)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def _to_bytes(value: object) -> bytes:
    """Serialise with torch.save: tensors sent through a queue would share memory with a
    process that is about to exit."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _worker(
    rank: int,
    world_size: int,
    port: int,
    fn: Callable[..., object],
    args: tuple[object, ...],
    results: mp.SimpleQueue,
    backend: str = "gloo",
) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    # A child of the fork server inherits its start method; a data-loader worker of this rank
    # is forked, as under torchrun (through the fork server it would pickle the whole dataset
    # and tokenizer: about 5 s per loader on 4 ranks).
    multiprocessing.set_start_method("fork", force=True)
    # As train.py under torchrun: the cores shared by the ranks (OMP_NUM_THREADS above comes too
    # late for torch, which the fork server imported; 2 threads per rank oversubscribed 2 cores).
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(
            backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=60)
        )
        results.put((rank, True, _to_bytes(fn(rank, world_size, *args))))
    except BaseException:  # the parent re-raises it with the traceback
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


PRELOAD = [
    "torch",
    "torch.distributed",
    "torchrun_ddp.main",
    "transformers.models.llama.modeling_llama",
    "transformers.models.llama.tokenization_llama",
    "tiny_models",
]
"""Imported once by the fork server, so that ranks do not import torch and transformers again
(tests/test_start_agreement.py's one spawn: 7.4 s -> 0.8 s; tests/test_checkpoint.py's fixture:
8.3 s -> 2.0 s; `pytest --durations=8` on both, one setting after the other, quiet machine).
The LLaMA modules are what the tests build and transformers imports lazily, on each fresh
rank's first run otherwise."""


def _context() -> mp.context.BaseContext:
    """A forkserver context that preloads ``PRELOAD``. The server is a fresh single-threaded
    process (not a fork of pytest, whose threads make plain fork unsafe), so forking it is safe."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def run_distributed(
    fn: Callable[..., object],
    world_size: int,
    *args: object,
    timeout: float = 180.0,
    backend: str = "gloo",
) -> list[object]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks (``backend="nccl"``:
    NCCL, rank r on GPU r) and return their results.

    ``fn`` must be a module-level function (it is pickled by name); its return value must be
    picklable (tensors are fine). Raises ``RuntimeError`` with the worker's traceback if any rank
    fails, or if the group does not finish within ``timeout`` seconds.
    """
    ctx = _context()
    results = ctx.SimpleQueue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(rank, world_size, port, fn, args, results, backend))
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    collected = _collect(results, procs, world_size, timeout)
    for proc in procs:
        proc.join(timeout=10)
    return [collected[rank] for rank in range(world_size)]


def _collect(
    results: mp.SimpleQueue, procs: list[mp.Process], world_size: int, timeout: float
) -> dict[int, object]:
    deadline = time.monotonic() + timeout
    collected: dict[int, object] = {}
    while len(collected) < world_size:
        if time.monotonic() > deadline:
            _kill(procs)
            raise RuntimeError(f"distributed test timed out after {timeout:.0f} s")
        if results.empty():
            if any(p.exitcode not in (None, 0) for p in procs):
                _kill(procs)
                raise RuntimeError("a worker process died without reporting a result")
            time.sleep(0.05)
            continue
        rank, ok, value = results.get()
        if not ok:
            _kill(procs)
            raise RuntimeError(f"rank {rank} failed:\n{value}")
        try:
            collected[rank] = torch.load(io.BytesIO(value), weights_only=True)
        except Exception:
            _kill(procs)
            raise
    return collected


def _kill(procs: list[mp.Process]) -> None:
    for proc in procs:
        if proc.is_alive():
            proc.kill()
        proc.join(timeout=5)


__all__ = [
    "PEAK",
    "REFERENCE_STEPS",
    "assert_same_run",
    "clone_env",
    "final_weights",
    "free_port",
    "logged_losses",
    "metrics_records",
    "reference_args",
    "run_distributed",
    "tiny_args",
    "torchrun",
    "torchrun_command",
    "worker_pids",
]
