"""Stream, shard per rank, tokenise and pack text into full windows; train and eval loaders.

Documents come from ``datasets`` streaming (the hub's ``allenai/c4`` or local json/json.gz
files in C4's layout), are split across ranks with ``datasets.distributed.split_dataset_by_node``,
shuffled with a seeded buffer of documents, tokenised as ``BOS + tokens + EOS`` (without BOS for
tokenizers that have none, such as Qwen2's) and packed back to back into windows of exactly
``seq_length`` tokens, so no padding token is ever trained on.
"""

from __future__ import annotations

import copy
import glob
import gzip
import json
import random
import zlib
from collections.abc import Iterator
from pathlib import Path

import torch
from datasets import IterableDataset, load_dataset
from datasets.distributed import split_dataset_by_node
from torch.utils.data import DataLoader
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from torchrun_ddp.errors import UserError


def resolve_files(patterns: list[str], flag: str) -> list[str]:
    """Expand globs into a sorted list of files, each checked by ``check_data_file``; raises
    UserError if a pattern matches nothing or a file is unreadable."""
    files: list[str] = []
    for pattern in patterns:
        matched = sorted(glob.glob(pattern)) or ([pattern] if Path(pattern).is_file() else [])
        if not matched:
            raise UserError(f"{flag} {pattern} matches no file; check the path or the glob")
        files.extend(matched)
    for file in files:
        check_data_file(file, flag)
    return files


FULL_CHECK_BYTES = 64 * 2**20
"""Files up to this size (64 MiB on disk) are read to the end by ``check_data_file``; larger
ones only to their first record, so a run over many large shards starts quickly."""


def check_data_file(path: str, flag: str) -> None:
    """Raise UserError naming ``path`` if it is not JSON lines of objects with a string ``text``:
    a corrupt or truncated gzip stream, an empty file, a line that is not a JSON object, or a
    record without ``text``. Checks every line of files up to ``FULL_CHECK_BYTES``, else the first.
    """
    full = Path(path).stat().st_size <= FULL_CHECK_BYTES
    opener = gzip.open if path.endswith(".gz") else open
    records = 0
    try:
        with opener(path, "rt", encoding="utf-8") as handle:
            for number, line in enumerate(handle, start=1):
                if not line.strip():
                    continue
                _check_record(line, path, number, flag)
                records += 1
                if not full:
                    break
    except (OSError, EOFError, zlib.error, UnicodeDecodeError) as exc:
        raise UserError(f"{flag} {path} cannot be read ({exc}); replace the file") from exc
    if records == 0:
        raise UserError(f"{flag} {path} holds no records; remove it or pass another file")


def _check_record(line: str, path: str, number: int, flag: str) -> None:
    """Raise UserError unless ``line`` is a JSON object with a string ``text``."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise UserError(f"{flag} {path} line {number} is not JSON ({exc}); use JSON lines") from exc
    if not isinstance(record, dict) or not isinstance(record.get("text"), str):
        raise UserError(
            f"{flag} {path} line {number} has no 'text' string; use files in C4's layout"
        )


def load_tokenizer(name: str) -> PreTrainedTokenizerBase:
    """The tokenizer from a hub id or local folder; raises UserError if it cannot be loaded."""
    looks_local = name.startswith((".", "/", "~")) or Path(name).exists()
    if looks_local and not Path(name).expanduser().is_dir():
        raise UserError(f"tokenizer folder {name} does not exist; pass an existing --tokenizer")
    try:
        return AutoTokenizer.from_pretrained(name)
    except OSError as exc:
        raise UserError(f"cannot load tokenizer {name}: {str(exc).splitlines()[0]}") from exc


def open_documents(
    files: list[str], dataset: str, dataset_config: str, split: str
) -> IterableDataset:
    """A streaming dataset of ``{"text": str}`` records, from local files or the hub.

    Only the ``text`` column is kept (C4's ``timestamp`` is inferred as a datetime, which the
    default collation cannot batch). Raises UserError when the hub cannot be reached or the
    files have no ``text`` field.
    """
    try:
        if files:
            stream = load_dataset("json", data_files=files, split="train", streaming=True)
        else:
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


def shard_for_rank(documents: IterableDataset, rank: int, world_size: int) -> IterableDataset:
    """This rank's disjoint share of ``documents``, in stream order.

    ``split_dataset_by_node`` gives whole files to ranks when the file count divides by the
    world size, and otherwise every world_size-th document of the stream.
    """
    return split_dataset_by_node(documents, rank=rank, world_size=world_size)


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
        if text is None:
            raise UserError("a data record has no 'text' field; every JSON line needs one")
        if not text.strip():
            return []
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        bos, eos = self.tokenizer.bos_token_id, self.tokenizer.eos_token_id
        return [*([bos] if bos is not None else []), *ids, *([eos] if eos is not None else [])]

    def _shuffled_texts(self) -> Iterator[str | None]:
        """One epoch of documents through the shuffle buffer (``pending``)."""
        for record in self.documents:
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
