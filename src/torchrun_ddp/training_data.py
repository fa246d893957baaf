"""Stream, order, tokenise and pack text into full windows; train and eval loaders.

Documents come from ``datasets`` streaming (the hub's ``allenai/c4`` or local json/json.gz
files in C4's layout), are tokenised as ``BOS + tokens + EOS`` (without BOS for tokenizers that
have none, such as Qwen2's) and packed back to back into windows of exactly ``seq_length``
tokens, so no padding token is ever trained on.

Training data (``build_train_loader``) follows one global document order that is a pure function
of the seed, the epoch and the position in the stream (``GlobalPackedWindows``): every rank reads
the whole stream, shuffles it in fixed blocks, and takes the positions dealt to it. Its state is
small and can be re-split among another number of ranks (``reshard_positions``), so a run can
continue at another world size with every document trained exactly once. Held-out data is split
per rank with ``datasets.distributed.split_dataset_by_node`` and packed by ``PackedWindows``.

Damaged records. Local files are read line by line (``read_records``), so a damaged record deep
inside a large shard (invalid JSON, bad UTF-8, no ``text``, a damaged gzip stream) becomes a
record that names the file and line instead of an exception from the JSON parser. The training
order skips it: it takes no position, the same on every rank and after every resume. Each
distinct damaged record is logged once (rank 0), kept in the data position (so the count
survives restarts) and counted in the metrics (``bad_records``); past ``--max-bad-records`` the
run stops with a ``DataError``. A damaged gzip stream loses the rest of its file: one record.
"""

from __future__ import annotations

import copy
import glob
import gzip
import json
import logging
import os
import random
import warnings
import zlib
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import torch
from datasets import Features, IterableDataset, Value, load_dataset
from datasets.distributed import split_dataset_by_node
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from torchrun_ddp.errors import DataError, UserError

log = logging.getLogger("torchrun_ddp")


def resolve_files(patterns: list[str], flag: str, max_bad_records: int = 0) -> list[str]:
    """Expand globs into a sorted list of files, each checked by ``check_data_file``; raises
    UserError if a pattern matches nothing, a file has no readable record, or the damaged records
    found exceed ``max_bad_records`` (fewer are logged as a warning and skipped in training)."""
    files: list[str] = []
    for pattern in patterns:
        matched = sorted(glob.glob(pattern)) or ([pattern] if Path(pattern).is_file() else [])
        if not matched:
            raise UserError(f"{flag} {pattern} matches no file; check the path or the glob")
        files.extend(matched)
    damaged = [error for file in files for error in check_data_file(file, flag)]
    if len(damaged) > max_bad_records:
        raise UserError(
            f"{flag} {damaged[0]}; {len(damaged)} damaged records in all, more than "
            f"--max-bad-records {max_bad_records}: repair the file or raise --max-bad-records"
        )
    if damaged:
        log.warning(
            "%s: %d damaged records will be skipped, the first: %s", flag, len(damaged), damaged[0]
        )
    return files


FULL_CHECK_BYTES = 64 * 2**20
"""Files up to this size (64 MiB on disk) are read to the end by ``check_data_file``; larger
ones only to their first record, so a run over many large shards starts quickly (a damaged
record further in is skipped when training reaches it: see the module docstring)."""


def check_data_file(path: str, flag: str) -> list[str]:
    """The damaged records of ``path`` (``read_records`` errors: file and line), read to the end
    for files up to ``FULL_CHECK_BYTES``, else up to the first good record.

    Raises UserError naming ``path`` if the file holds no readable record before that point (an
    empty file, a corrupt gzip stream, a file that is not JSON lines of objects with ``text``).
    """
    full = Path(path).stat().st_size <= FULL_CHECK_BYTES
    damaged: list[str] = []
    good = 0
    for record in _file_records(path):
        if record["error"]:
            damaged.append(str(record["error"]))
            continue
        good += 1
        if not full:
            return damaged
    if good == 0:
        why = f"{damaged[0]}; replace the file" if damaged else f"{path} holds no records"
        raise UserError(f"{flag} {why}; JSON lines with a 'text' string are needed")
    return damaged


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")
"""A local tokenizer folder holds at least one of these (what AutoTokenizer loads from)."""


def load_tokenizer(name: str) -> PreTrainedTokenizerBase:
    """The tokenizer from a hub id or local folder; raises UserError if it cannot be loaded."""
    looks_local = name.startswith((".", "/", "~")) or Path(name).exists()
    if looks_local and not Path(name).expanduser().is_dir():
        raise UserError(f"tokenizer folder {name} does not exist; pass an existing --tokenizer")
    if looks_local and not any((Path(name).expanduser() / f).is_file() for f in TOKENIZER_FILES):
        raise UserError(
            f"tokenizer folder {name} has none of {', '.join(TOKENIZER_FILES)}; pass a folder "
            "saved by save_pretrained as --tokenizer"
        )
    try:
        return AutoTokenizer.from_pretrained(name)
    except OSError as exc:
        raise UserError(f"cannot load tokenizer {name}: {str(exc).splitlines()[0]}") from exc


def open_documents(
    files: list[str], dataset: str, dataset_config: str, split: str
) -> IterableDataset:
    """A streaming dataset of ``{"text": str}`` records, from local files or the hub.

    Local files go through ``read_records`` (one shard per file; damaged records come as
    ``{"text": None, "error": "<file> line <n>: ..."}``). From the hub only the ``text`` column
    is kept (C4's ``timestamp`` is inferred as a datetime, which the default collation cannot
    batch). Raises UserError when the hub cannot be reached or has no ``text`` field.
    """
    if files:
        return IterableDataset.from_generator(
            read_records, features=RECORD_FEATURES, gen_kwargs={"files": files}
        )
    try:
        stream = load_dataset(dataset, dataset_config, split=split, streaming=True)
    except ConnectionError as exc:
        raise UserError(
            f"cannot reach the Hugging Face hub to stream {dataset}; pass local json.gz files "
            "with --data-files (and --eval-files)"
        ) from exc
    try:
        return stream.select_columns(["text"])
    except ValueError as exc:
        raise UserError(f"the data has no 'text' field ({exc}); use files in C4's layout") from exc


RECORD_FEATURES = Features({"text": Value("string"), "error": Value("string")})
"""Columns of ``read_records``: the document text, or None and what is wrong with the record."""


def read_records(files: list[str]) -> Iterator[dict[str, str | None]]:
    """The records of JSON-lines files (``.gz`` or plain), in order, as ``{"text", "error"}``.

    A line that is not UTF-8, not a JSON object or has no ``text`` string yields ``text`` None
    and an ``error`` naming the file and line; a damaged or truncated gzip stream yields one
    such record and ends that file. Blank lines are skipped. Never raises for bad content.
    """
    for path in files:
        yield from _file_records(path)


def _file_records(path: str) -> Iterator[dict[str, str | None]]:
    opener = gzip.open if path.endswith(".gz") else open
    number = 0
    try:
        with opener(path, "rb") as handle:
            for number, line in enumerate(handle, start=1):
                if line.strip():
                    yield _parse_record(line, path, number)
    except (OSError, EOFError, zlib.error) as exc:
        reason = f"cannot be read ({exc}), nor the rest of the file"
        yield {"text": None, "error": f"{path} line {number + 1} {reason}"}


def _parse_record(line: bytes, path: str, number: int) -> dict[str, str | None]:
    try:
        record = json.loads(line.decode("utf-8"))
    except UnicodeDecodeError as exc:
        return {"text": None, "error": f"{path} line {number} cannot be read as UTF-8 ({exc})"}
    except json.JSONDecodeError as exc:
        return {"text": None, "error": f"{path} line {number} is not JSON ({exc})"}
    if not isinstance(record, dict) or not isinstance(record.get("text"), str):
        return {"text": None, "error": f"{path} line {number} has no 'text' string"}
    return {"text": record["text"], "error": None}


def shard_for_rank(documents: IterableDataset, rank: int, world_size: int) -> IterableDataset:
    """This rank's disjoint share of ``documents``, in stream order.

    ``split_dataset_by_node`` gives whole files to ranks when the file count divides by the
    world size, and otherwise every world_size-th document of the stream.
    """
    return split_dataset_by_node(documents, rank=rank, world_size=world_size)


def document_tokens(tokenizer: PreTrainedTokenizerBase, text: str | None) -> list[int]:
    """``[BOS] + ids + [EOS]`` of one document (BOS or EOS left out where the tokenizer has
    none); ``[]`` for a blank document. Raises UserError for a record without text."""
    if text is None:
        raise UserError("a data record has no 'text' field; every JSON line needs one")
    if not text.strip():
        return []
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    return [*([bos] if bos is not None else []), *ids, *([eos] if eos is not None else [])]


class PackedWindows(torch.utils.data.IterableDataset):
    """Windows of ``seq_length`` token ids (int64 tensors of shape [seq_length]), packed.

    Documents pass through a seeded shuffle buffer of ``shuffle_buffer`` documents (reseeded
    each epoch from ``seed`` and the epoch; 0 keeps stream order). Each non-blank document
    becomes ``[BOS] + ids + [EOS]``; the token stream is cut into consecutive windows with no
    padding. ``state_dict`` holds the stream position, the shuffle buffer and its RNG, and the
    tokens carried over to the next window, so iteration resumes exactly. (``datasets``' own
    ``shuffle`` buffer is not part of its state_dict, so resuming through it is not exact.)
    """

    def __init__(
        self,
        documents: IterableDataset,
        tokenizer: PreTrainedTokenizerBase,
        seq_length: int,
        epochs: int = 1,
        shuffle_buffer: int = 0,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.documents = documents
        self.tokenizer = tokenizer
        self.seq_length = seq_length
        self.epochs = epochs
        self.shuffle_buffer = shuffle_buffer
        self.seed = seed
        self.epoch = 0
        self.tokens: list[int] = []
        self.pending: list[str] = []
        self.rng = random.Random(seed)
        self.resumed = False

    def _token_ids(self, text: str | None) -> list[int]:
        return document_tokens(self.tokenizer, text)

    def _shuffled_texts(self) -> Iterator[str | None]:
        """One epoch of documents through the shuffle buffer (``pending``)."""
        for record in self.documents:
            if record.get("error"):  # a damaged held-out record: not part of the set
                continue
            self.pending.append(record["text"])
            if len(self.pending) <= self.shuffle_buffer:
                continue
            index = self.rng.randrange(len(self.pending))
            self.pending[index], self.pending[-1] = self.pending[-1], self.pending[index]
            yield self.pending.pop()
        while self.pending:
            yield self.pending.pop(self.rng.randrange(len(self.pending)))

    def __iter__(self) -> Iterator[torch.Tensor]:
        while self.epoch < self.epochs:
            if not self.resumed:
                self.documents.set_epoch(self.epoch)
                self.rng.seed(self.seed * 1_000_003 + self.epoch)
            self.resumed = False
            for text in self._shuffled_texts():
                self.tokens.extend(self._token_ids(text))
                while len(self.tokens) >= self.seq_length:
                    window = self.tokens[: self.seq_length]
                    del self.tokens[: self.seq_length]
                    yield torch.tensor(window, dtype=torch.long)
            self.epoch += 1

    def state_dict(self) -> dict[str, object]:
        """Position to resume from: stream state, epoch, shuffle buffer and RNG, carried tokens.

        Every value is JSON-serialisable.
        """
        version, internal, gauss = self.rng.getstate()
        return {
            "documents": copy.deepcopy(self.documents.state_dict()),
            "epoch": self.epoch,
            "tokens": list(self.tokens),
            "pending": list(self.pending),
            "rng": [version, list(internal), gauss],
        }

    def load_state_dict(self, state: dict[str, object]) -> None:
        """Resume from a ``state_dict`` taken on the same rank with the same settings."""
        self.epoch = int(state["epoch"])
        self.documents.set_epoch(self.epoch)  # datasets does not restore the epoch itself
        self.documents.load_state_dict(copy.deepcopy(state["documents"]))
        self.tokens = list(state["tokens"])
        self.pending = list(state["pending"])
        version, internal, gauss = state["rng"]
        self.rng.setstate((version, tuple(internal), gauss))
        self.resumed = True


def build_loader(windows: PackedWindows, batch_size: int) -> DataLoader:
    """A DataLoader of micro-batches, int64 [batch_size, seq_length].

    ``num_workers=0``: tokenising is cheap next to a training step, and the loader then never
    reads ahead, so ``windows.state_dict()`` is exactly the position after the last batch.
    Incomplete final batches are dropped.
    """
    return DataLoader(windows, batch_size=batch_size, num_workers=0, drop_last=True)


def eval_batches(windows: PackedWindows, batch_size: int, count: int) -> list[torch.Tensor]:
    """The first ``count`` micro-batches of a (non-shuffled) held-out stream, kept in memory so
    every evaluation sees the same windows. May return fewer if the data runs out."""
    batches: list[torch.Tensor] = []
    for batch in build_loader(windows, batch_size):
        if len(batches) == count:
            break
        batches.append(batch)
    return batches


# ----------------------------------------------------------------------------- training data:
# one global document order, re-splittable among any number of ranks

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
    """This rank's packed windows (int64 tensors of shape [seq_length]) of a global order.

    Every rank reads the whole stream in ``DocumentBlocks`` (blocks of ``shuffle_buffer``
    documents shuffled by (seed, epoch, block); stream order in blocks of ``UNSHUFFLED_BLOCK``
    when it is 0) and takes the positions its state deals it: first its ``queue``, then every
    ``world_size``-th position from ``start + rank``. Each document becomes ``[BOS] + ids + [EOS]``
    and the tokens are cut into full windows (``carry`` holds the rest). ``state_dict`` is small
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
    ) -> None:
        super().__init__()
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
        carry: list[int] = state["carry"]
        while (target := self._target()) is not None:
            text = self.blocks.text(*target)
            self._advance(past_end=text is None)
            if text is None:
                continue
            carry.extend(document_tokens(self.tokenizer, text))
            while len(carry) >= self.seq_length:
                window = carry[: self.seq_length]
                del carry[: self.seq_length]
                yield torch.tensor(window, dtype=torch.long)

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
        positions = [data_position(state) for state in states]
        world = int(self.windows.state["world_size"])
        rank = int(self.windows.state["rank"])
        block = self.windows.blocks.block_size
        self.windows.load_state_dict(reshard_positions(positions, world, block)[rank])
        self.loader = self._new_loader()


def own_process_group(worker_id: int) -> None:
    """DataLoader ``worker_init_fn``: move the worker into a process group of its own.

    torchrun stops a worker with ``killpg`` (SIGTERM, later SIGKILL) and a terminal's Ctrl-C
    reaches its whole process group. The training process turns SIGTERM/SIGINT into a checkpoint
    and a clean exit, so the data worker must not die first (the loader would raise "DataLoader
    worker is killed by signal"); it ends with its loader, or by DataLoader's watchdog within
    seconds after the training process is gone.
    """
    os.setpgid(0, 0)


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
) -> TrainLoader:
    """This rank's training micro-batches (int64 [batch_size, seq_length]): the global document
    order of ``GlobalPackedWindows`` (every rank reads the whole stream of ``documents``), packed
    in a ``StatefulDataLoader`` worker. Incomplete final micro-batches are dropped; damaged
    records are skipped up to ``max_bad_records`` (then DataError)."""
    windows = GlobalPackedWindows(
        documents, tokenizer, seq_length, rank, world_size, epochs, shuffle_buffer, seed,
        max_bad_records,
    )  # fmt: skip
    return TrainLoader(windows, batch_size, seed)


def bad_record_count(state: Mapping[str, object]) -> int:
    """Damaged records skipped so far, from a ``TrainLoader.state_dict()``."""
    return len(data_position(state).get("bad_records", []))
