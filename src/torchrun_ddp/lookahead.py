"""Micro-batches grouped by optimizer step and read ahead, so ranks agree on the end of data
without a collective every step.

The loop asks every rank, at each log step, whether it holds the micro-batches of every step up
to the next log step; the answer rides on the loss reduction that the log step makes anyway.
Between log steps no rank ever needs to ask another: each already holds its batches. The data
position saved in a checkpoint is the one after the last step *trained*, not after the last
step read, so resume stays exact.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from typing import Protocol

import torch


class DataSource(Protocol):
    """A resumable loader of micro-batches (int64 token ids [micro_batch, seq_length]):
    ``state_dict`` is the position after the last micro-batch it yielded (JSON values and
    tensors), ``load_state_dict`` resumes there (e.g. ``training_data.TrainLoader``)."""

    def __iter__(self) -> Iterator[torch.Tensor]: ...

    def state_dict(self) -> Mapping[str, object]: ...

    def load_state_dict(self, state: Mapping[str, object], /) -> None: ...


class LookaheadBatches:
    """This rank's micro-batches, ``accumulation_steps`` per optimizer step, read ahead.

    The source's iterator is created on the first read, after a resume has restored the
    position, under ``torch.random.fork_rng`` (so creating it cannot draw from the CPU RNG that
    resume restored).

    ``state_dict`` is the position after the last step handed out by :meth:`next_step`.
    ``data_time_s`` accumulates the seconds spent reading (host wall clock).

    ``count_tokens`` (labelled batches, examples kept apart): the trained tokens of one
    micro-batch (a 0-d tensor on the device). :meth:`local_tokens` gives each held step's count,
    the loop sums them over ranks in the log step's all-reduce and hands them back with
    :meth:`set_global_tokens`; :meth:`next_step` then sets ``step_tokens``, the step's trained
    tokens over all ranks (None without ``count_tokens``).
    """

    def __init__(
        self,
        source: DataSource,
        accumulation_steps: int,
        device: torch.device,
        count_tokens: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        self.source = source
        self.accumulation_steps = accumulation_steps
        self.device = device
        self.count_tokens = count_tokens
        self.global_tokens: deque[torch.Tensor] = deque()
        self.step_tokens: torch.Tensor | None = None
        self.ready: deque[tuple[list[torch.Tensor], Mapping[str, object]]] = deque()
        self.trained_position: Mapping[str, object] = source.state_dict()
        self.data_time_s = 0.0
        self._iterator: Iterator[torch.Tensor] | None = None

    def read_ahead(self, steps: int) -> bool:
        """Hold the micro-batches of the next ``steps`` optimizer steps; False if the data ends
        first (the steps read so far stay held). Micro-batches go to the device non-blocking."""
        started = time.perf_counter()
        try:
            while len(self.ready) < steps:
                batches = self._read_step()
                if batches is None:
                    return False
                self.ready.append((batches, self.source.state_dict()))
            return True
        finally:
            self.data_time_s += time.perf_counter() - started

    def _read_step(self) -> list[torch.Tensor] | None:
        if self._iterator is None:
            with torch.random.fork_rng(devices=[]):
                self._iterator = iter(self.source)
        batches: list[torch.Tensor] = []
        for batch in self._iterator:
            batches.append(batch.to(self.device, non_blocking=True))
            if len(batches) == self.accumulation_steps:
                return batches
        return None

    def next_step(self) -> list[torch.Tensor]:
        """The next step's micro-batches; raises IndexError if :meth:`read_ahead` did not hold
        them (a bug in the caller, never a data condition)."""
        batches, position = self.ready.popleft()
        self.trained_position = position
        self.step_tokens = self.global_tokens.popleft() if self.global_tokens else None
        return batches

    def local_tokens(self, steps: int) -> torch.Tensor | None:
        """This rank's trained tokens in each of the next ``steps`` held steps (float64
        [steps] on the device, 0 past the steps held), or None without ``count_tokens``."""
        if self.count_tokens is None:
            return None
        counts = torch.zeros(steps, dtype=torch.float64, device=self.device)
        for index, (batches, _) in zip(range(steps), self.ready, strict=False):
            counts[index] = sum(self.count_tokens(batch) for batch in batches)
        return counts

    def set_global_tokens(self, counts: torch.Tensor | None) -> None:
        """The trained tokens over all ranks of the next held steps (``local_tokens`` summed
        over ranks), handed out one per :meth:`next_step` as ``step_tokens``; None (no
        ``count_tokens``) changes nothing."""
        if counts is not None:
            self.global_tokens = deque(counts.unbind())

    def pop_data_time(self) -> float:
        """Seconds spent reading since the last call."""
        spent, self.data_time_s = self.data_time_s, 0.0
        return spent

    def state_dict(self) -> Mapping[str, object]:
        """The data position after the last step trained (JSON values and tensors)."""
        return self.trained_position

    def load_state_dict(self, state: Mapping[str, object]) -> None:
        """Resume at ``state`` (from :meth:`state_dict`); call before the first read."""
        self.source.load_state_dict(state)
        self.trained_position = state

    def restored(self) -> None:
        """Take the source's position as the trained one after the source was restored another
        way (``TrainLoader.load_resharded``); call before the first read."""
        self.trained_position = self.source.state_dict()
