"""The training loader: ``GlobalPackedWindows`` packed in one ``StatefulDataLoader`` worker
process, off the training thread, with its position in every checkpoint.
"""

from __future__ import annotations

import copy
import ctypes
import multiprocessing
import os
import signal
import sys
import warnings
from collections.abc import Iterator, Mapping, Sequence

import torch
from datasets import IterableDataset
from torchdata.stateful_dataloader import StatefulDataLoader
from transformers import PreTrainedTokenizerBase

from torchrun_ddp.errors import DataError
from torchrun_ddp.training_data.formats import ExampleFormat
from torchrun_ddp.training_data.global_order import GlobalPackedWindows, reshard_positions

PR_SET_PDEATHSIG = 1
"""prctl(2)'s option number (linux/prctl.h): the signal a process gets when its parent dies."""


class TrainLoader:
    """Micro-batches (int64 tensors [batch_size, seq_length]) of ``GlobalPackedWindows``, read
    and packed in one worker process by torchdata's ``StatefulDataLoader``, off the training
    thread.

    ``state_dict()`` is the position after the last micro-batch yielded (the worker sends the
    dataset's state with every batch; ``snapshot_every_n_steps=1``), JSON values only.
    ``load_state_dict`` resumes it bit-exactly at the same world size; ``load_resharded`` resumes
    from the states of all ranks of a run at another world size. The worker's seed comes from
    its own generator, so the global torch RNG is never drawn from.
    """

    WORKERS = 1
    """One worker: the data position is then a single dataset state per rank."""

    def __init__(self, windows: GlobalPackedWindows, batch_size: int, seed: int = 0) -> None:
        self.windows = windows
        self.batch_size = batch_size
        self.seed = seed
        self.loader = self._new_loader()

    def _new_loader(self) -> StatefulDataLoader:
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # the worker is a fork
        with warnings.catch_warnings():  # torchdata 0.11 calls torch.set_vital, deprecated
            warnings.filterwarnings("ignore", "'set_vital' is deprecated", UserWarning)
            return StatefulDataLoader(
                self.windows,
                batch_size=self.batch_size,
                num_workers=self.WORKERS,
                drop_last=True,
                snapshot_every_n_steps=1,
                generator=torch.Generator().manual_seed(self.seed),
                worker_init_fn=own_process_group,
            )

    def __iter__(self) -> Iterator[torch.Tensor]:
        """Micro-batches; raises DataError (one line) when the worker stopped on damaged data."""
        try:
            yield from self.loader
        except DataError as exc:  # re-raised by DataLoader with the worker's traceback as text
            raise DataError(str(exc).strip().splitlines()[-1].split("DataError: ", 1)[-1]) from None

    def state_dict(self) -> dict[str, object]:
        """``{"loader": StatefulDataLoader state}``: the position after the last batch."""
        return {"loader": self.loader.state_dict()}

    def load_state_dict(self, state: Mapping[str, object]) -> None:
        """Resume from this rank's own ``state_dict`` (same world size): bit-exact."""
        self.loader = self._new_loader()
        self.loader.load_state_dict(copy.deepcopy(dict(state["loader"])))

    def load_resharded(self, states: Sequence[Mapping[str, object]]) -> None:
        """Resume from ``state_dict()`` of every rank of a run at another world size (in rank
        order): their positions are re-split by ``reshard_positions``."""
        self.load_resharded_positions([data_position(state) for state in states])

    def load_resharded_positions(self, positions: Sequence[Mapping[str, object]]) -> None:
        """Resume from the data positions (``GlobalPackedWindows.state_dict``) of every rank of
        a run at another world size, in rank order, re-split by ``reshard_positions``."""
        world = int(self.windows.state["world_size"])
        rank = int(self.windows.state["rank"])
        block = self.windows.blocks.block_size
        self.load_position(reshard_positions(positions, world, block)[rank])

    def load_position(self, position: Mapping[str, object]) -> None:
        """Resume at a data position (``GlobalPackedWindows.state_dict``), e.g. one replayed
        for a rank whose own saved state is lost (``GlobalPackedWindows.replayed``)."""
        self.windows.load_state_dict(position)
        self.loader = self._new_loader()


def own_process_group(worker_id: int) -> None:
    """DataLoader ``worker_init_fn``: move the worker into a process group of its own, and make
    it die with the training process that forked it.

    torchrun stops a worker with ``killpg`` (SIGTERM, later SIGKILL) and a terminal's Ctrl-C
    reaches its whole process group. The training process turns SIGTERM/SIGINT into a checkpoint
    and a clean exit, so the data worker must not die first (the loader would raise "DataLoader
    worker is killed by signal"); it ends with its loader. When the training process itself is
    killed (SIGKILL, the OOM killer), Linux's parent-death signal (``prctl(PR_SET_PDEATHSIG)``,
    prctl(2)) kills the worker at once. Without it the worker lives until DataLoader's watchdog
    notices (it looks every ``MP_STATUS_CHECK_INTERVAL``, 5 s) and meanwhile holds its forked
    copies of the rank's gloo sockets open, so the other ranks' collectives fail only then
    instead of at once, and torchrun restarts the group seconds later. Elsewhere than Linux only
    the process group changes.
    """
    os.setpgid(0, 0)
    if not sys.platform.startswith("linux"):
        return
    parent = multiprocessing.parent_process()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL) != 0:
        return  # the watchdog still ends the worker, only later
    if parent is not None and os.getppid() != parent.pid:
        os._exit(1)  # the training process died before the signal was armed


def data_position(state: Mapping[str, object]) -> Mapping[str, object]:
    """The ``GlobalPackedWindows`` state inside a ``TrainLoader.state_dict()``.

    Raises ValueError if the loader state is not one worker's snapshot after its last batch.
    """
    loader = state["loader"]
    snapshot = loader.get("_snapshot") or {}
    workers = snapshot.get("_worker_snapshots") or {}
    if loader.get("_steps_since_snapshot", 0) != 0 or list(workers) != ["worker_0"]:
        raise ValueError("the data loader state is not a one-worker snapshot after a batch")
    return workers["worker_0"]["dataset_state"]


def build_train_loader(
    documents: IterableDataset,
    tokenizer: PreTrainedTokenizerBase,
    seq_length: int,
    batch_size: int,
    rank: int,
    world_size: int,
    epochs: int = 1,
    shuffle_buffer: int = 0,
    seed: int = 0,
    max_bad_records: int = 0,
    fmt: ExampleFormat | None = None,
) -> TrainLoader:
    """This rank's training micro-batches (int64 [batch_size, seq_length], or [batch_size, 3,
    seq_length] with examples kept apart, as ``fmt`` says): the global document
    order of ``GlobalPackedWindows`` (every rank reads the whole stream of ``documents``), packed
    in a ``StatefulDataLoader`` worker. Incomplete final micro-batches are dropped; damaged
    records are skipped up to ``max_bad_records`` (then DataError)."""
    windows = GlobalPackedWindows(
        documents, tokenizer, seq_length, rank, world_size, epochs, shuffle_buffer, seed,
        max_bad_records, fmt,
    )  # fmt: skip
    return TrainLoader(windows, batch_size, seed)


def bad_record_count(state: Mapping[str, object]) -> int:
    """Damaged records skipped so far, from a ``TrainLoader.state_dict()``."""
    return len(data_position(state).get("bad_records", []))
