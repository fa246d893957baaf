"""The torchrun environment, process-group set-up and tear-down, the device, rank-aware logging.

torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT and
TORCHELASTIC_RESTART_COUNT for every worker (https://pytorch.org/docs/stable/elastic/run.html).
Without torchrun the same code runs as a single process (world_size 1) on a free loopback port.

Restarts. By default torchrun's workers share the elastic agent's TCPStore, which lives as long as
the job, so after a restart the store still holds the previous attempt's keys: the dead ranks'
gloo addresses (``connectFullMesh ... Connection refused``), NCCL unique ids and barrier counters
(hangs until the timeout); torch's ``rendezvous.py`` assumes a new store per retry, and
pytorch/pytorch#167288 reports the NCCL case. Every process group of this project therefore lives
under a key prefix that only the current attempt uses (``attempt_store``): the ranks agree on a
fresh random token with rank 0 through the store itself, so the prefix is the same on every node
even where the nodes' TORCHELASTIC_RESTART_COUNT differ (an agent whose workers were healthy
restarts them for a re-rendezvous without counting a restart), and after membership changes.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import time
import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from types import FrameType

import datasets
import torch
import torch.distributed as dist
import transformers

log = logging.getLogger("torchrun_ddp")


@dataclass(frozen=True)
class DistEnv:
    """What torchrun tells a worker about its place in the job."""

    rank: int = 0
    """Global rank of this process, 0 .. world_size - 1."""
    world_size: int = 1
    """Number of processes in the job (all nodes)."""
    local_rank: int = 0
    """Rank of this process on its node; picks the GPU cuda:local_rank."""
    local_world_size: int = 1
    """Number of processes on this node."""
    master_addr: str = "127.0.0.1"
    """Host of the rendezvous store (c10d)."""
    master_port: int = 0
    """Port of the rendezvous store; 0 means pick a free one (single process only)."""
    restart_count: int = 0
    """How many times torchrun has restarted the worker group (TORCHELASTIC_RESTART_COUNT)."""

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> DistEnv:
        """Read the torchrun variables; absent ones give a single-process job."""
        env = os.environ if environ is None else environ
        return cls(
            rank=int(env.get("RANK", 0)),
            world_size=int(env.get("WORLD_SIZE", 1)),
            local_rank=int(env.get("LOCAL_RANK", 0)),
            local_world_size=int(env.get("LOCAL_WORLD_SIZE", 1)),
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=int(env.get("MASTER_PORT", 0)),
            restart_count=int(env.get("TORCHELASTIC_RESTART_COUNT", 0)),
        )

    @property
    def is_main(self) -> bool:
        """True on global rank 0, the process that logs and writes shared files."""
        return self.rank == 0


def pick_device(env: DistEnv, preference: str) -> torch.device:
    """``cuda:local_rank`` when CUDA is wanted and present, else CPU.

    Raises ValueError if ``preference`` is "cuda" and no GPU is visible.
    """
    if preference == "cpu" or (preference == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for but no GPU is visible; use --device cpu")
    torch.cuda.set_device(env.local_rank)
    return torch.device("cuda", env.local_rank)


def backend_for(device: torch.device, backend: str) -> str:
    """The process-group backend: NCCL for CUDA tensors (gloo kept for CPU tensors), else gloo."""
    if backend != "auto":
        return backend
    return "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


_OWN_PORTS: set[str] = set()
"""The MASTER_PORTs this process chose for its own single-process runs."""


def init_distributed(env: DistEnv, device: torch.device, backend: str, timeout_s: int) -> int:
    """Start the default process group (env:// rendezvous, as torchrun sets it up) on a store
    prefix of this attempt's own (``attempt_store``); every later group (``new_group``) inherits
    the prefix. Returns the attempt number (``attempt_store``).

    A single process without torchrun gets a store on a free port of 127.0.0.1, a new one for
    each run in the process (``main.run`` called again: an earlier run's store, still held by
    an object of that run, would otherwise count this run as its restart and resume it).
    Raises TimeoutError if the ranks do not all reach the store within ``timeout_s`` seconds.
    """
    if env.master_port == 0 or os.environ.get("MASTER_PORT") in _OWN_PORTS:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")  # a new port for every run: a store
        os.environ["MASTER_PORT"] = str(_free_port())  # left alive would count a restart
        _OWN_PORTS.add(os.environ["MASTER_PORT"])
    timeout = timedelta(seconds=timeout_s)
    store, attempt = attempt_store(env, timeout)
    dist.init_process_group(
        backend=backend_for(device, backend),
        store=store,
        rank=env.rank,
        world_size=env.world_size,
        timeout=timeout,
        device_id=device if device.type == "cuda" else None,
    )
    return attempt


ATTEMPT_KEYS = "torchrun_ddp/attempts"
"""Store keys of the attempt agreement; each attempt's process groups live under
``<ATTEMPT_KEYS>/<token>/``."""


def attempt_store(env: DistEnv, timeout: timedelta) -> tuple[dist.Store, int]:
    """The torchrun store (``torch.distributed.rendezvous("env://")``: the agent's, or one that
    rank 0 hosts) under a prefix that no earlier attempt of the job used, and the attempt number
    (1, 2, ... as counted in that store; it restarts at 1 where the store is new per attempt, as
    with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``).

    The agreement cannot trust any key it finds, since a key may be a dead attempt's. Rank 0 draws
    a fresh token; every other rank posts a fresh nonce and waits for the answer filed under its
    nonce; it then confirms under the token, and rank 0 answers until every rank has confirmed.
    Stale asks get answers nobody reads. Costs a few store round trips per rank.

    Raises TimeoutError when a rank does not arrive within ``timeout``.
    """
    store, _, _ = next(
        dist.rendezvous("env://", rank=env.rank, world_size=env.world_size, timeout=timeout)
    )
    if env.rank == 0:
        number = store.add(f"{ATTEMPT_KEYS}/count", 1)
        token = f"{number}-{uuid.uuid4().hex}"
        _answer_until_confirmed(store, token, env.world_size, timeout)
    else:
        token = _ask_for_token(store, env.rank, timeout)
    return dist.PrefixStore(f"{ATTEMPT_KEYS}/{token}", store), int(token.split("-")[0])


def _ask_for_token(store: dist.Store, rank: int, timeout: timedelta) -> str:
    nonce = uuid.uuid4().hex
    store.set(f"{ATTEMPT_KEYS}/ask/{rank}", nonce)
    answer = f"{ATTEMPT_KEYS}/answer/{nonce}"
    store.wait([answer], timeout)
    token = store.get(answer).decode()
    store.set(f"{ATTEMPT_KEYS}/{token}/joined/{rank}", "1")
    return token


def _answer_until_confirmed(
    store: dist.Store, token: str, world_size: int, timeout: timedelta
) -> None:
    deadline = time.monotonic() + timeout.total_seconds()
    answered: dict[int, bytes] = {}
    pending = set(range(1, world_size))
    while True:
        for rank in sorted(pending):
            if store.check([f"{ATTEMPT_KEYS}/{token}/joined/{rank}"]):
                pending.discard(rank)
                continue
            ask = f"{ATTEMPT_KEYS}/ask/{rank}"
            if store.check([ask]) and answered.get(rank) != (nonce := store.get(ask)):
                store.set(f"{ATTEMPT_KEYS}/answer/{nonce.decode()}", token)
                answered[rank] = nonce
        if not pending:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"ranks {sorted(pending)} did not join this attempt within "
                f"{timeout.total_seconds():.0f} s (--timeout-s)"
            )
        time.sleep(0.005)


@dataclass(frozen=True)
class NodeGroups:
    """Process groups of a job of ``nodes`` nodes with ``local_world_size`` ranks each.

    ``intra``: the ranks of this rank's node (fast links: NVLink, shared memory). ``inter``: the
    ranks on other nodes with this rank's local rank, one per node (the slow links). torchrun
    numbers ranks node by node, ``rank = node * local_world_size + local_rank``.
    """

    intra: dist.ProcessGroup
    inter: dist.ProcessGroup
    local_world_size: int
    nodes: int


def new_node_groups(env: DistEnv) -> NodeGroups:
    """Create the intra-node and inter-node groups (a collective: call on every rank).

    Raises ValueError if the ranks do not form ``world_size / local_world_size`` equal nodes
    numbered node by node (heterogeneous nodes cannot use node-aware compression).
    """
    per_node = env.local_world_size
    if per_node < 1 or env.world_size % per_node:
        raise ValueError(
            f"world_size {env.world_size} is not a multiple of local_world_size {per_node}; "
            "node-aware compression needs the same number of ranks on every node"
        )
    if env.rank != env.rank // per_node * per_node + env.local_rank:
        raise ValueError(
            f"rank {env.rank} with local_rank {env.local_rank} is not numbered node by node; "
            "use --compression-scope global"
        )
    nodes = env.world_size // per_node
    intra, _ = dist.new_subgroups_by_enumeration(
        [list(range(n * per_node, (n + 1) * per_node)) for n in range(nodes)]
    )
    inter, _ = dist.new_subgroups_by_enumeration(
        [list(range(local, env.world_size, per_node)) for local in range(per_node)]
    )
    _GROUPS.extend((intra, inter))
    return NodeGroups(intra=intra, inter=inter, local_world_size=per_node, nodes=nodes)


_GROUPS: list[dist.ProcessGroup] = []
"""Process groups created besides the default one (``set_collective_timeout`` reaches them)."""


def track_group(group: dist.ProcessGroup) -> None:
    """Let ``set_collective_timeout`` reach ``group`` too (a group created elsewhere, such as a
    storage domain's)."""
    _GROUPS.append(group)


def set_collective_timeout(seconds: int) -> None:
    """Timeout of every later collective on the default group and this project's other groups
    (``torch.distributed.set_timeout``; gloo and NCCL). A rank that is gone without closing its
    connections is noticed after this long."""
    for group in [None, *_GROUPS]:
        dist.set_timeout(timedelta(seconds=seconds), group)


@contextmanager
def collective_timeout(seconds: int, then: int) -> Iterator[None]:
    """Collectives inside the block time out after ``seconds``, those after it after ``then``
    (for work whose length varies by rank, such as checkpoint writes to a shared file system)."""
    set_collective_timeout(seconds)
    try:
        yield
    finally:
        set_collective_timeout(then)


def seconds_since_process_start() -> float:
    """Wall-clock seconds since this process started (Linux ``/proc``; elsewhere since this
    module was imported), for the start-up time that the log reports after each (re)start."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, IndexError, ValueError):
        return time.monotonic() - _IMPORTED
    return uptime - ticks / os.sysconf("SC_CLK_TCK")


_IMPORTED = time.monotonic()


def shutdown_distributed() -> None:
    """Destroy the process group if one exists; safe to call on every exit path."""
    _GROUPS.clear()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


class _RankFilter(logging.Filter):
    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank = rank

    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = self.rank
        return self.rank == 0 or record.levelno >= logging.WARNING


def setup_logging(rank: int, verbose: bool = False) -> None:
    """Log as ``[rank N]``: info from rank 0 only, warnings and errors from every rank.

    Library loggers (transformers, datasets, torch.distributed) stay at WARNING unless verbose.
    """
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s [rank %(rank)s] %(message)s", "%H:%M:%S"))
    handler.addFilter(_RankFilter(rank))
    log.handlers[:] = [handler]
    log.setLevel(logging.DEBUG if verbose else logging.INFO)
    log.propagate = False
    quiet = logging.INFO if verbose else logging.WARNING
    for name in ("transformers", "datasets", "torch.distributed", "httpx", "huggingface_hub"):
        logging.getLogger(name).setLevel(quiet)
    if not verbose:
        transformers.utils.logging.disable_progress_bar()
        datasets.disable_progress_bars()


class StopRequest:
    """Turns SIGTERM and SIGINT into a flag the loop checks on log steps (preemption).

    The handlers are installed on entering the ``with`` block and the previous ones restored on
    leaving it.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.requested = False
        self.previous: dict[int, object] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.requested = True

    def __enter__(self) -> StopRequest:
        for signum in self.SIGNALS:
            self.previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)
