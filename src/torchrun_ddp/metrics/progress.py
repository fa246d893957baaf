"""The loop's progress at a log step besides its record: the progress bar of optimizer steps
(main rank, on a terminal only) and the stop on a loss that exploded (``check_loss``). Imports
``errors``.
"""

from __future__ import annotations

import math
import sys

from tqdm import tqdm

from torchrun_ddp.errors import UserError
from torchrun_ddp.faults import perturbed_note


def progress_bar(initial: int, total: float, main_rank: bool) -> tqdm:
    """A tqdm bar of optimizer steps from ``initial`` to ``total`` (math.inf: no end known) on
    the main rank when stderr is a terminal; disabled (silent) otherwise."""
    return tqdm(
        initial=initial,
        total=None if total == float("inf") else int(total),
        disable=not (main_rank and sys.stderr.isatty()),
        unit="step",
        dynamic_ncols=True,
    )


def check_loss(loss: float, step: int, max_loss: float) -> None:
    """Stop a run whose loss exploded: the log step's loss (averaged over ranks, the same on
    every rank) is NaN or infinite, or above ``max_loss`` (> 0). Called before that step's
    checkpoint, so none is saved over the last good one, and no final model is exported.

    Raises UserError (every rank alike) with one line, which names an armed test perturbation
    (``faults.perturbed_note``)."""
    if math.isfinite(loss) and not 0 < max_loss < loss:
        return
    bound = "not finite" if not math.isfinite(loss) else f"above --max-loss {max_loss:g}"
    raise UserError(
        f"the training loss is {loss:g} at step {step} ({bound}): stopped without a checkpoint "
        "or final_model; resume the last good checkpoint with a lower --learning-rate or more "
        f"--warmup-steps{perturbed_note()}"
    )


def is_log_step(step: int, log_every: int, max_steps: float) -> bool:
    """Whether ``step`` ends a logging window: every ``log_every`` steps and the last step."""
    return step % log_every == 0 or step >= max_steps


def no_step_message(log_every: int, max_steps: float, tokens_per_step: int) -> str:
    """The one line of a fresh run whose data ends before its first log step (ranks agree on
    the end of data there), so it would train no step: nothing is exported or checkpointed."""
    first_log_step = int(min(log_every, max_steps))
    return (
        f"the training data ended before step {first_log_step}, the first log step (ranks "
        f"agree on the end of data there), so no optimizer step was trained; a step takes "
        f"{tokens_per_step} tokens over all ranks: add documents, raise "
        "--epochs, or lower --log-every, --batch-size or --seq-length"
    )
