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
from collections.abc import Callable, Iterable, Iterator, Mapping

import torch


class LookaheadBatches:
    """This rank's micro-batches, ``accumulation_steps`` per optimizer step, read ahead.

    ``loader`` yields micro-batches (int64 token ids [micro_batch, seq_length]); ``position``
    returns the data position after the last micro-batch the loader yielded (JSON values and
    tensors, e.g. ``PackedWindows.state_dict``), and ``restore`` loads one. The loader's iterator
    is created on the first read, after a resume has restored the position, under
    ``torch.random.fork_rng`` (creating it draws from the CPU RNG that resume restored).

    ``state_dict`` is the position after the last step handed out by :meth:`next_step`.
    ``data_time_s`` accumulates the seconds spent reading (host wall clock).
    """

    def __init__(
        self,
        loader: Iterable[torch.Tensor],
        position: Callable[[], Mapping[str, object]],
        restore: Callable[[Mapping[str, object]], None],
        accumulation_steps: int,
        device: torch.device,
    ) -> None:
        self.loader = loader
        self.position = position
        self.restore = restore
        self.accumulation_steps = accumulation_steps
        self.device = device
        self.ready: deque[tuple[list[torch.Tensor], Mapping[str, object]]] = deque()
        self.trained_position: Mapping[str, object] = position()
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
                self.ready.append((batches, self.position()))
            return True
        finally:
            self.data_time_s += time.perf_counter() - started

    def _read_step(self) -> list[torch.Tensor] | None:
        if self._iterator is None:
            with torch.random.fork_rng(devices=[]):
                self._iterator = iter(self.loader)
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
        return batches

    def pop_data_time(self) -> float:
        """Seconds spent reading since the last call."""
        spent, self.data_time_s = self.data_time_s, 0.0
        return spent

    def state_dict(self) -> Mapping[str, object]:
        """The data position after the last step trained (JSON values and tensors)."""
        return self.trained_position

    def load_state_dict(self, state: Mapping[str, object]) -> None:
        """Resume at ``state`` (from :meth:`state_dict`); call before the first read."""
        self.restore(state)
        self.trained_position = state
