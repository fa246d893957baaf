"""Entry point: ``torchrun --nproc_per_node=N train.py [--config FILE] [--flag value ...]``.

Loads ``.env`` (HF_TOKEN), reads the torchrun environment, parses the config and calls
``torchrun_ddp.main.run``. Without torchrun it trains as a single process (world_size 1).
Exit statuses: 0 finished; 2 bad input (one line, ``error: ...``); 143 (128 + SIGTERM) stopped by
SIGTERM or SIGINT after saving a checkpoint, so schedulers and scripts can tell a preempted run
from a finished one (torchrun with --max-restarts then restarts the group, which resumes).
"""

from __future__ import annotations

import gc
import logging
import multiprocessing
import os
import sys
import traceback

if __name__ == "__main__":
    # Torch, transformers and this package create millions of objects on import, next to no
    # garbage; the cyclic collector's passes over them are about a tenth of a rank's import
    # time (7 to 10 s here), paid again at every torchrun restart. main() turns it back on.
    gc.disable()

from dotenv import load_dotenv  # imported with the collector paused (above)

from torchrun_ddp.config_io import parse_config, to_toml
from torchrun_ddp.distributed import DistEnv
from torchrun_ddp.errors import UserError

STOPPED = 143
"""Exit status of a run stopped by SIGTERM/SIGINT after its checkpoint: 128 + SIGTERM (15)."""


def main(argv: list[str]) -> int:
    """Parse ``argv`` and train; returns the process exit status."""
    load_dotenv()
    env = DistEnv.from_environ()
    try:
        config = parse_config(argv)
        if "--print-config" in argv:
            print(to_toml(config), end="")
            return 0
        from torchrun_ddp.main import run  # noqa: PLC0415 - heavy imports after --help is handled

        collect_from_here()
        finished = run(config, env)
    except UserError as exc:
        # One write of the whole line: ranks share torchrun's stderr, and print() writes the
        # text and the newline apart, so two ranks' lines could run into one.
        sys.stderr.write(f"error: {exc}\n")
        sys.stderr.flush()
        return 2
    return 0 if finished else STOPPED


def collect_from_here() -> None:
    """Turn the garbage collector back on (paused while ``__main__`` imported), first moving
    every object that exists now, the imported modules' included, to a generation it never
    scans again (``gc.freeze``): training's own collections then skip them."""
    if gc.isenabled():
        return
    gc.freeze()
    gc.enable()


def exit_now(status: int) -> None:
    """End the process with ``status`` without the interpreter's teardown. By now every output is
    closed (checkpoints fsynced, metrics and TensorBoard closed, the process group destroyed),
    and tearing down torch's and transformers' modules one by one takes seconds per process
    (about 1 s on 2 quiet cores, 8 s under load), which every torchrun restart and every test
    waits for. Log handlers are flushed and any child left (a data-loader worker) is stopped as
    the interpreter's own exit would."""
    logging.shutdown()
    for child in multiprocessing.active_children():
        child.terminate()
        child.join()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def run_and_exit(argv: list[str]) -> None:
    """``main``, then ``exit_now`` with its status, also after an uncaught exception (a peer's
    death seen in a collective, say): its traceback is printed as the interpreter would and the
    status is 1, as the interpreter's, but the survivor exits at once instead of after seconds
    of teardown, which torchrun waits for before each restart. ``SystemExit`` (``--help``, an
    unknown flag) keeps its status."""
    try:
        status = main(argv)
    except Exception:
        traceback.print_exc()
        status = 1
    exit_now(status)


if __name__ == "__main__":
    run_and_exit(sys.argv[1:])
