"""Examples into fixed windows: back to back (``text``, today's default), or kept apart.

Kept apart (``ExampleFormat.labelled``), a window is an int64 tensor [3, seq_length]: token ids,
labels (-100 where nothing is trained: prompts, each example's first token, padding) and
position ids that restart at 0 with each example. transformers reads restarting position ids as
packed sequences (``masking_utils.find_packed_sequence_indices``): with no attention mask given,
sdpa and eager attention get a block-diagonal causal mask, and flash attention its varlen
kernel, so no token attends to another example. Whole examples are packed in arrival order into
the current window while they fit (first fit, no reordering: the order stays a pure function of
the global document order); the rest of a window is padding (its own segment, labels -100). An
example longer than a window is cut: a ``text`` document into pieces of ``seq_length`` tokens,
each its own example, a ``prompt-completion`` or ``messages`` example to its first
``seq_length`` tokens (what TRL's ``max_length`` does). ``packing`` False puts each example in a
window of its own.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from transformers import PreTrainedTokenizerBase

from torchrun_ddp.training_data.formats import (
    IGNORE_INDEX,
    ExampleFormat,
    example_tokens,
    text_tokens,
)

Example = list[list[int]]
"""One tokenised example as JSON: ``[ids, labels]``, two lists of equal length."""


class Packer:
    """Turns documents (``formats.check_record`` strings) into windows.

    ``carry`` is the state between windows, JSON and changed in place, so a caller that saves
    it after each window yielded resumes exactly: token ids not yet in a window (back to back),
    or the examples not yet in a window (kept apart; it may hold more than one window's worth
    after the positions of several ranks were merged, and is then emptied window by window).
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        fmt: ExampleFormat,
        seq_length: int,
        carry: list,
    ) -> None:
        self.tokenizer = tokenizer
        self.fmt = fmt
        self.seq_length = seq_length
        self.carry = carry
        pad = getattr(tokenizer, "pad_token_id", None)
        self.pad_id = pad if pad is not None else (getattr(tokenizer, "eos_token_id", 0) or 0)

    def add(self, document: str) -> Iterator[torch.Tensor]:
        """The windows completed by ``document``: int64 [seq_length] back to back, int64
        [3, seq_length] (ids, labels, positions) kept apart."""
        if not self.fmt.labelled:
            self.carry.extend(text_tokens(self.tokenizer, document))
            while len(self.carry) >= self.seq_length:
                window = self.carry[: self.seq_length]
                del self.carry[: self.seq_length]
                yield torch.tensor(window, dtype=torch.long)
            return
        for example in self.examples(document):
            self.carry.append(example)
            yield from self.flush(final=False)

    def examples(self, document: str) -> list[Example]:
        """One document's examples: ``[ids, labels]``, each at most ``seq_length`` long."""
        ids, labels = example_tokens(self.tokenizer, document, self.fmt)
        length = self.seq_length
        if self.fmt.name != "text":
            return [[ids[:length], labels[:length]]] if ids else []
        pieces = []
        for start in range(0, len(ids), length):
            piece = labels[start : start + length]
            pieces.append([ids[start : start + length], [IGNORE_INDEX, *piece[1:]]])
        return pieces

    def flush(self, final: bool) -> Iterator[torch.Tensor]:
        """The windows ``carry`` fills (``final``: also a last, partly filled one)."""
        while self.carry and (final or not self.fmt.packing or self._used() >= self.seq_length):
            taken = 1
            used = len(self.carry[0][0])
            while self.fmt.packing and taken < len(self.carry):
                if used + len(self.carry[taken][0]) > self.seq_length:
                    break
                used += len(self.carry[taken][0])
                taken += 1
            window = self.window(self.carry[:taken])
            del self.carry[:taken]
            yield window

    def _used(self) -> int:
        return sum(len(ids) for ids, _ in self.carry)

    def window(self, examples: list[Example]) -> torch.Tensor:
        """Examples (``seq_length`` tokens at most in all) as one padded [3, seq_length] window."""
        ids = [token for example in examples for token in example[0]]
        labels = [label for example in examples for label in example[1]]
        positions = [index for example in examples for index in range(len(example[0]))]
        pad = self.seq_length - len(ids)
        ids += [self.pad_id] * pad
        labels += [IGNORE_INDEX] * pad
        positions += range(pad)
        return torch.tensor([ids, labels, positions], dtype=torch.long)
