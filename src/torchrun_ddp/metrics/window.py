"""The logging window: per-step sums between log steps, turned into one record with one
all-reduce that also carries the ranks' flags (``LogWindow.flush``), and the same agreement
before the first step (``any_rank``). Imports ``keys`` (the record) and ``peaks`` (peak memory).
"""

from __future__ import annotations

import time

import torch

from torchrun_ddp.metrics.keys import Record
from torchrun_ddp.metrics.peaks import peak_memory_bytes


class LogWindow:
    """Sums over the optimizer steps since the last log line; :meth:`flush` turns them into one
    record with a single all-reduce (the loss reduction of a log step).

    ``tokens_per_step``: tokens trained per optimizer step over all ranks; ``flops_per_token``:
    training FLOPs per token (PaLM appendix B); ``peak_flops_total``: peak FLOP/s of all ranks
    (inf when unknown: MFU then reads 0). Times count the steps, data reading and the log step's
    all-reduce (which waits for the device's queued work and for a delayed exchange still on the
    links, so a window's seconds are wall-clock), not evaluation or saving, so tokens/s and MFU
    describe training.
    """

    def __init__(
        self,
        device: torch.device,
        tokens_per_step: int,
        flops_per_token: float,
        peak_flops_total: float,
    ) -> None:
        self.device = device
        self.tokens_per_step = tokens_per_step
        self.flops_per_token = flops_per_token
        self.peak_flops_total = peak_flops_total
        self.reset()

    def reset(self) -> None:
        """Start a new window."""
        self.loss = torch.zeros((), device=self.device)
        self.grad_norm = torch.zeros((), device=self.device)
        self.steps = 0
        self.comm = [0, 0, 0]
        self.step_time = 0.0
        self.data_time = 0.0

    def add(
        self, loss: torch.Tensor, grad_norm: torch.Tensor, step_time: float, comm: tuple[int, ...]
    ) -> None:
        """Record one optimizer step: mean loss and gradient norm (0-dim device tensors, not
        read here, so no host sync), its seconds, and its (wire, dense, collective) bytes."""
        self.loss += loss
        self.grad_norm = grad_norm.detach()
        self.steps += 1
        self.step_time += step_time
        self.comm = [total + added for total, added in zip(self.comm, comm, strict=True)]

    def add_data_time(self, seconds: float) -> None:
        """Seconds spent reading data for this window's steps (also counted as step time)."""
        self.data_time += seconds
        self.step_time += seconds

    def flush(
        self, step: int, lr: float, flags: list[bool], extra: torch.Tensor | None = None
    ) -> tuple[Record, list[bool]]:
        """Collective: the window's record (loss averaged over ranks) and ``flags`` OR-ed over
        ranks, in one all-reduce (SUM) of ``[loss, *flags]``; then reset. Needs >= 1 step.
        ``extra`` (float64, 1-D, on the device) rides in the same all-reduce in float64 and is
        summed over ranks in place."""
        began = time.perf_counter()
        summed = torch.stack([self.loss / self.steps, *(self.loss.new_tensor(f) for f in flags)])
        if extra is not None:
            summed = torch.cat([summed.double(), extra])
        torch.distributed.all_reduce(summed)
        if extra is not None:
            extra.copy_(summed[len(summed) - len(extra) :])
            summed = summed[: len(summed) - len(extra)]
        values = summed.tolist()
        self.step_time += time.perf_counter() - began
        tokens_per_s = self.tokens_per_step * self.steps / self.step_time
        wire, dense, collective = (total // self.steps for total in self.comm)
        record: Record = {
            "step": step,
            "loss": values[0] / torch.distributed.get_world_size(),
            "lr": lr,
            "tokens_per_s": tokens_per_s,
            "mfu": self.flops_per_token * tokens_per_s / self.peak_flops_total,
            "step_time_s": self.step_time / self.steps,
            "data_time_s": self.data_time / self.steps,
            "grad_norm": float(self.grad_norm),
            "peak_mem_bytes": peak_memory_bytes(self.device),
            "comm_bytes": wire,
            "comm_bytes_dense": dense,
            "comm_bytes_collective": collective,
        }
        if wire:  # a window that sent nothing (between two syncs of DiLoCo) has no ratio
            record["compression_ratio"] = dense / wire
        self.reset()
        return record, [value > 0 for value in values[1:]]


def any_rank(
    flags: list[bool], device: torch.device, extra: torch.Tensor | None = None
) -> list[bool]:
    """Collective: each flag OR-ed over all ranks (one all-reduce, MAX); ``extra`` (float64,
    1-D, on ``device``) rides in the same all-reduce (then SUM) and is summed in place."""
    if extra is not None:
        values = torch.cat([torch.tensor(flags, dtype=torch.float64, device=device), extra])
        torch.distributed.all_reduce(values)
        extra.copy_(values[len(flags) :])
        return [value > 0 for value in values[: len(flags)].tolist()]
    values = torch.tensor([int(flag) for flag in flags], device=device)
    torch.distributed.all_reduce(values, op=torch.distributed.ReduceOp.MAX)
    return [bool(value) for value in values.tolist()]
