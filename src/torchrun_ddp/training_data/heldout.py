"""Held-out data: each rank's share of the documents, packed into fixed windows that every
evaluation reuses (``PackedWindows``, ``eval_batches``).
"""

from __future__ import annotations

import copy
import random
from collections.abc import Iterator

import torch
from datasets import IterableDataset
from torch.utils.data import DataLoader
from transformers import PreTrainedTokenizerBase

from torchrun_ddp.errors import UserError
from torchrun_ddp.training_data.formats import ExampleFormat
from torchrun_ddp.training_data.packing import Packer


class PackedWindows(torch.utils.data.IterableDataset):
    """Windows of ``seq_length`` token ids (int64 tensors of shape [seq_length]), packed; or
    [3, seq_length] (ids, labels, positions) with examples kept apart (``packing.Packer``, as
    ``fmt`` says; the last examples of an epoch then fill a padded window of their own).

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
        fmt: ExampleFormat | None = None,
    ) -> None:
        super().__init__()
        self.fmt = fmt or ExampleFormat()
        self.documents = documents
        self.tokenizer = tokenizer
        self.seq_length = seq_length
        self.epochs = epochs
        self.shuffle_buffer = shuffle_buffer
        self.seed = seed
        self.epoch = 0
        self.tokens: list = []
        self.pending: list[str] = []
        self.rng = random.Random(seed)
        self.resumed = False

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
            packer = Packer(self.tokenizer, self.fmt, self.seq_length, self.tokens)
            for text in self._shuffled_texts():
                if text is None:
                    raise UserError("a data record has no 'text' field; every JSON line needs one")
                yield from packer.add(text)
            if self.fmt.labelled:  # the last examples, in a window of their own
                yield from packer.flush(final=True)
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
