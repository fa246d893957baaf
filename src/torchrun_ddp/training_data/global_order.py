"""One global document order, a pure function of (seed, epoch, position), dealt round robin
to the ranks and re-split among another number of ranks (``reshard_positions``).
"""

from __future__ import annotations

import copy
import logging
import random
import sys
from collections.abc import Iterator, Mapping, Sequence

import torch
from datasets import IterableDataset
from transformers import PreTrainedTokenizerBase

from torchrun_ddp.errors import DataError, UserError
from torchrun_ddp.training_data.formats import ExampleFormat
from torchrun_ddp.training_data.packing import Packer

log = logging.getLogger("torchrun_ddp")


DATA_ORDER = "global-blocks-1"
"""Names the document order and data-position format; a checkpoint of another one is refused
(the per-rank shuffle buffers of earlier versions cannot be re-split)."""

UNSHUFFLED_BLOCK = 1024
"""Documents per block of the global stream when ``shuffle_buffer`` is 0 (no shuffle)."""


class DocumentBlocks:
    """The whole document stream (every rank reads all of it), one block at a time.

    Block ``b`` of epoch ``e`` holds stream documents ``[b S, (b + 1) S)`` (``S`` =
    ``block_size``), permuted by ``random.Random(f"{seed}:{e}:{b}")`` when ``shuffle`` is set, so
    the document at a global position is a pure function of (seed, epoch, position). Blocks are
    read forward; a block behind the cursor or in another epoch restarts the stream (or resumes
    it from a saved ``datasets`` state at a block start). ``length`` is the number of documents
    per epoch once the end of the stream has been seen, else None.
    """

    def __init__(
        self,
        documents: IterableDataset,
        block_size: int,
        seed: int,
        shuffle: bool,
        max_bad_records: int = 0,
    ) -> None:
        self.documents = documents
        self.start_state = copy.deepcopy(documents.state_dict())
        self.max_bad_records = max_bad_records
        self.bad_records: set[str] = set()
        self.report_bad = False
        self.block_size = block_size
        self.seed = seed
        self.shuffle = shuffle
        self.length: int | None = None
        self.loaded: tuple[int, int] | None = None
        self.read_from: tuple[int, int] = (0, 0)
        self.read_state: object = None
        self.texts: list[str] = []
        self.cursor: tuple[int, int] | None = None
        self.cursor_state: object = None
        self.iterator: Iterator[Mapping[str, object]] | None = None

    def text(self, epoch: int, position: int) -> str | None:
        """The document at ``position`` of ``epoch``'s order, or None past the end of the data."""
        block, offset = divmod(position, self.block_size)
        self._load(epoch, block)
        return self.texts[offset] if offset < len(self.texts) else None

    def position(self) -> dict[str, object] | None:
        """Where to start reading again (JSON): the loaded block and the ``datasets`` state at its
        start (None: the stream's start), or None before anything was read."""
        if self.loaded is None:
            return None
        return {"epoch": self.read_from[0], "block": self.read_from[1], "state": self.read_state}

    def restore(self, position: Mapping[str, object] | None) -> None:
        """Read from ``position`` (a ``position()`` result) on; None: from the stream's start."""
        self.loaded = None
        self.texts = []
        if position is None:
            self.cursor = None
            return
        epoch, block = int(position["epoch"]), int(position["block"])
        if not _same_reader(position["state"], self.start_state):
            self.cursor = None  # saved by another reader (before read_records): read up to it
            return
        self._seek(epoch, block, position["state"])

    def _seek(self, epoch: int, block: int, state: object) -> None:
        self.documents.load_state_dict(copy.deepcopy(state or self.start_state))
        self.iterator = None
        self.cursor, self.cursor_state = (epoch, block), state

    def _load(self, epoch: int, block: int) -> None:
        if self.loaded == (epoch, block):
            return
        if self.cursor is None or self.cursor[0] != epoch or self.cursor[1] > block:
            self._seek(epoch, 0, None)
        while True:
            here, state = self.cursor, self.cursor_state
            texts = self._read_block()
            if here[1] == block or len(texts) < self.block_size:
                break
        self.loaded = (epoch, block)
        self.read_from, self.read_state = here, state  # an earlier block if past the end
        self.texts = texts if here[1] == block else []
        if self.shuffle and self.texts:
            random.Random(f"{self.seed}:{epoch}:{block}").shuffle(self.texts)

    def _read_block(self) -> list[str]:
        """The next ``block_size`` documents from the cursor (fewer at the end of the data)."""
        if self.iterator is None:
            self.iterator = iter(self.documents)
        epoch, block = self.cursor
        texts: list[str] = []
        for record in self.iterator:
            if record.get("error"):
                self._skip(str(record["error"]))
                continue
            text = record.get("text")
            if not isinstance(text, str):
                raise UserError("a data record has no 'text' field; every JSON line needs one")
            texts.append(text)
            if len(texts) == self.block_size:
                break
        if len(texts) < self.block_size:
            self.length = block * self.block_size + len(texts)
            self.cursor, self.cursor_state, self.iterator = None, None, None
            return texts
        self.cursor = (epoch, block + 1)
        self.cursor_state = copy.deepcopy(self.documents.state_dict())
        return texts

    def _skip(self, error: str) -> None:
        """Count a damaged record once; raise DataError past ``max_bad_records``."""
        if error in self.bad_records:
            return
        self.bad_records.add(error)
        count = len(self.bad_records)
        if count > self.max_bad_records:
            raise DataError(
                f"{count} damaged training records, more than --max-bad-records "
                f"{self.max_bad_records}; the last: {error}; repair or remove the file, or raise "
                "--max-bad-records"
            )
        if self.report_bad:
            log.warning("skipped damaged training record %d: %s", count, error)


def _same_reader(state: object, start_state: Mapping[str, object]) -> bool:
    """Whether a saved ``datasets`` state comes from the same kind of reader as this one."""
    if state is None:
        return True
    kind = state.get("examples_iterable", {}).get("type") if isinstance(state, dict) else None
    return kind == start_state.get("examples_iterable", {}).get("type")


def fresh_position(rank: int, world_size: int) -> dict[str, object]:
    """The data position of ``rank`` of ``world_size`` at the start of training (JSON).

    Keys: ``rank``, ``world_size``; ``epoch``, ``start``, ``next``: the round robin (this rank
    takes positions ``next, next + world_size, ...`` of ``epoch``, which began at ``start``);
    ``queue``: ``[epoch, position]`` pairs taken first (left over by a change of world size);
    ``carry``: token ids read but not yet in a window; ``length``: documents per epoch once known;
    ``reader``: where to read the stream again (``DocumentBlocks.position``); ``bad_records``:
    the damaged records skipped so far (file and line, sorted).
    """
    return {
        "rank": rank,
        "world_size": world_size,
        "epoch": 0,
        "start": 0,
        "next": rank,
        "queue": [],
        "carry": [],
        "length": None,
        "reader": None,
        "bad_records": [],
    }


class GlobalPackedWindows(torch.utils.data.IterableDataset):
    """This rank's packed windows of a global order: int64 [seq_length] token ids packed back to
    back, or int64 [3, seq_length] (ids, labels, positions) with examples kept apart
    (``packing.Packer``, as ``fmt`` says).

    Every rank reads the whole stream in ``DocumentBlocks`` (blocks of ``shuffle_buffer``
    documents shuffled by (seed, epoch, block); stream order in blocks of ``UNSHUFFLED_BLOCK``
    when it is 0) and takes the positions its state deals it: first its ``queue``, then every
    ``world_size``-th position from ``start + rank``. Each document becomes ``[BOS] + ids + [EOS]``
    and the tokens are cut into full windows (``carry`` holds the rest), or each example is
    packed whole (``carry`` holds the examples not yet in a window). ``state_dict`` is small
    JSON (see ``fresh_position``) and exact after the last window yielded; ``reshard_positions``
    re-splits the states of all ranks among another number of ranks.
    """

    def __init__(
        self,
        documents: IterableDataset,
        tokenizer: PreTrainedTokenizerBase,
        seq_length: int,
        rank: int,
        world_size: int,
        epochs: int = 1,
        shuffle_buffer: int = 0,
        seed: int = 0,
        max_bad_records: int = 0,
        fmt: ExampleFormat | None = None,
    ) -> None:
        super().__init__()
        self.settings = (documents, tokenizer, seq_length, epochs, shuffle_buffer, seed)
        self.max_bad_records = max_bad_records
        self.fmt = fmt or ExampleFormat()
        block = shuffle_buffer or UNSHUFFLED_BLOCK
        shuffle = shuffle_buffer > 0
        self.blocks = DocumentBlocks(documents, block, seed, shuffle, max_bad_records)
        self.blocks.report_bad = rank == 0
        self.tokenizer = tokenizer
        self.seq_length = seq_length
        self.epochs = epochs
        self.state = fresh_position(rank, world_size)

    def __iter__(self) -> Iterator[torch.Tensor]:
        state = self.state
        self.blocks.restore(state["reader"])
        self.blocks.length = state["length"]
        self.blocks.bad_records = set(state.get("bad_records", []))
        packer = Packer(self.tokenizer, self.fmt, self.seq_length, state["carry"])
        if self.fmt.labelled:  # examples merged from several ranks' carries
            yield from packer.flush(final=False)
        while (target := self._target()) is not None:
            text = self.blocks.text(*target)
            self._advance(past_end=text is None)
            if text is not None:
                yield from packer.add(text)

    def _target(self) -> tuple[int, int] | None:
        """The next (epoch, position) to read, or None when every epoch is done."""
        state = self.state
        if state["queue"]:
            epoch, position = state["queue"][0]
            return int(epoch), int(position)
        if state["epoch"] >= self.epochs:
            return None
        return int(state["epoch"]), int(state["next"])

    def _advance(self, past_end: bool) -> None:
        """Mark the target taken; a round robin past the end of the data starts the next epoch."""
        state = self.state
        if state["queue"]:
            state["queue"].pop(0)
        elif past_end:
            state.update(epoch=state["epoch"] + 1, start=0, next=state["rank"])
        else:
            state["next"] += state["world_size"]

    def state_dict(self) -> dict[str, object]:
        """This rank's data position after the last window yielded (JSON values only)."""
        state = self.state
        return {
            **state,
            "queue": [list(pair) for pair in state["queue"]],
            "carry": list(state["carry"]),
            "length": self.blocks.length if self.blocks.length is not None else state["length"],
            "reader": self.blocks.position() or state["reader"],
            "bad_records": sorted(self.blocks.bad_records | set(state.get("bad_records", []))),
        }

    def load_state_dict(self, state: Mapping[str, object]) -> None:
        """Continue from a ``state_dict`` (or ``reshard_positions``) result."""
        self.state = copy.deepcopy(dict(state))

    def replayed(self, rank: int, world_size: int, windows: int) -> dict[str, object]:
        """The position (``state_dict``) of ``rank`` of ``world_size`` after its first
        ``windows`` windows of this order, read again from the start (the order is a pure
        function of the seed and the position): the data position of a rank whose own saved
        state is lost, exact where the world size never changed. Costs reading and tokenising
        that rank's share of the stream up to there."""
        twin = self.twin(rank, world_size)
        for _ in zip(range(windows), twin, strict=False):
            pass
        return twin.state_dict()

    def twin(self, rank: int, world_size: int) -> GlobalPackedWindows:
        """The same order's windows of ``rank`` of ``world_size``, from the start, quiet about
        bad records (this rank's own reader reports them)."""
        documents, tokenizer, seq_length, epochs, shuffle_buffer, seed = self.settings
        twin = GlobalPackedWindows(
            documents, tokenizer, seq_length, rank, world_size, epochs, shuffle_buffer, seed,
            self.max_bad_records, self.fmt,
        )  # fmt: skip
        twin.blocks.report_bad = False
        return twin


def reshard_positions(
    states: Sequence[Mapping[str, object]], world_size: int, block_size: int
) -> list[dict[str, object]]:
    """Re-split the data positions of all ranks of one run among ``world_size`` new ranks.

    ``states``: every old rank's ``GlobalPackedWindows.state_dict()``, in rank order. What no old
    rank has taken yet is dealt out: the old queues, every position below the frontier (the
    furthest position any rank has taken, plus one) that its owner has not taken, and the
    remainder of epochs that a rank has not finished while another has. These go round robin
    into the new ranks' queues in global order; old rank ``j``'s carried tokens go to new rank
    ``j % world_size``; the new round robin starts at the frontier. Nothing is taken twice or
    skipped. ``block_size``: documents per block of the stream (to pick each new rank's reader).

    Raises ValueError if ``states`` are not the ranks 0..W-1 of one world size W.
    """
    old_world = int(states[0]["world_size"])
    if [int(s["rank"]) for s in states] != list(range(old_world)) or any(
        int(s["world_size"]) != old_world for s in states
    ):
        raise ValueError(f"need the data positions of ranks 0..{old_world - 1}, in order")
    epoch = max(int(s["epoch"]) for s in states)
    length = next((s["length"] for s in states if s["length"] is not None), None)
    holes = [(int(e), int(p)) for s in states for e, p in s["queue"]]
    behind = [s for s in states if int(s["epoch"]) < epoch]
    if behind and length is None:
        raise ValueError("ranks are in different epochs but the epoch length is unknown")
    for s in behind:
        holes += [(int(s["epoch"]), p) for p in range(int(s["next"]), length, old_world)]
    ahead = [s for s in states if int(s["epoch"]) == epoch]
    start = max([int(ahead[0]["start"])] + [int(s["next"]) - old_world + 1 for s in ahead])
    for s in ahead:
        holes += [(epoch, p) for p in range(int(s["next"]), start, old_world)]
    holes.sort()
    readers = [s["reader"] for s in states if s["reader"] is not None]
    new = []
    for rank in range(world_size):
        queue = holes[rank::world_size]
        first = queue[0] if queue else (epoch, start + rank)
        new.append({
            **fresh_position(rank, world_size),
            "epoch": epoch,
            "start": start,
            "next": start + rank,
            "queue": [list(pair) for pair in queue],
            "carry": [t for s in states[rank::world_size] for t in s["carry"]],
            "length": length,
            "reader": _reader_before(readers, first, block_size),
            "bad_records": sorted({b for s in states for b in s.get("bad_records", [])}),
        })  # fmt: skip
    return new


def _reader_before(
    readers: Sequence[Mapping[str, object]], target: tuple[int, int], block_size: int
) -> Mapping[str, object] | None:
    """The saved reader position furthest along that is not past ``target``'s block."""
    limit = (target[0], target[1] // block_size)
    fitting = [r for r in readers if (int(r["epoch"]), int(r["block"])) <= limit]
    return max(fitting, key=lambda r: (int(r["epoch"]), int(r["block"])), default=None)


def windows_per_rank(
    windows: GlobalPackedWindows, world_size: int, limit: int = sys.maxsize
) -> list[int]:
    """The windows each of ``world_size`` ranks packs from ``windows``' documents over its
    epochs, as training reads them (the same global order and round robin, each rank its own
    ``GlobalPackedWindows.twin``): what the plan's run length ends on. Each rank stops
    counting at ``limit``. Reads the stream once per rank and tokenises each document once in
    all."""
    twins = [windows.twin(rank, world_size) for rank in range(world_size)]  # each from the start
    return [sum(1 for _ in zip(range(limit), twin, strict=False)) for twin in twins]
