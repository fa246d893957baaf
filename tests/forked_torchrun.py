"""torchrun with the trainer imported once: ``python tests/forked_torchrun.py [torchrun flags]
--run-path --start-method=fork tests/forked_rank.py [train.py flags]`` (``torchrun_command(...,
forked=True)`` builds it).

The agent imports torch, transformers and this package before it starts, and every rank, the
first and each restarted one, is a fork of it that runs ``train.main`` (``forked_rank.py``)
instead of a fresh interpreter that imports them again (a rank of the reference config was
ready in 2.1 s against 17.9 s, docs/benchmarks.md#test-suite). Everything else is torchrun's own
code: c10d rendezvous, the restart policy, the signals it forwards. The fault tests and the
refusals under torchrun, the sites and test_multisite's agents use it; the reference run,
test_end_to_end and test_elastic keep the plain ``python -m torch.distributed.run train.py`` that
users run (test_elastic's third agent must join while the survivor trains: forked ranks train
through that phase before a new agent, which imports everything first, can join)."""

from __future__ import annotations

import gc
import importlib
import os
import sys
import traceback
from pathlib import Path


def preload() -> None:
    """Import what a rank imports (the fork server's ``PRELOAD`` and train.py) with the collector
    paused, then freeze it, as train.py's ``collect_from_here`` does for a rank."""
    gc.disable()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from distributed_harness import PRELOAD  # noqa: PLC0415

    import train  # noqa: PLC0415

    for name in PRELOAD:
        importlib.import_module(name)
    train.collect_from_here()


def launch() -> int:
    """torchrun's ``main`` on ``sys.argv``; its exit status (1 with the traceback on a failed
    group, as torchrun's)."""
    from torch.distributed.run import main  # noqa: PLC0415

    try:
        main()
    except SystemExit as stop:
        return stop.code if isinstance(stop.code, int) else 1
    except BaseException:  # torchrun's ChildFailedError and the like: status 1, as torchrun's
        traceback.print_exc()
        return 1
    return 0


if __name__ == "__main__":
    preload()
    status = launch()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)  # skip the teardown of the preloaded modules (seconds, and nanobind noise)
