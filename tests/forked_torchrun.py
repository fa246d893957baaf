"""torchrun with the trainer imported once: ``python tests/forked_torchrun.py [torchrun flags]
--run-path --start-method=fork tests/forked_rank.py [train.py flags]`` (``torchrun_command(...,
forked=True)`` builds it).

The tests start the agent itself as a fork of their worker's fork server
(``distributed_harness.start_agent`` runs ``serve_agent``), which has imported torch,
transformers and this package once per test worker; run as a script, the agent imports them
before it starts. Every rank, the first and each restarted one, is a fork of the agent that
runs ``train.main`` (``forked_rank.py``) instead of a fresh interpreter that imports them again
(a rank of the reference config was ready in 2.1 s against 17.9 s,
docs/benchmarks.md#test-suite). Everything else is torchrun's own
code: c10d rendezvous, the restart policy, the signals it forwards. The fault tests and the
refusals under torchrun, the sites and test_multisite's agents use it; the reference run,
test_end_to_end and test_elastic keep the plain ``python -m torch.distributed.run train.py`` that
users run (test_elastic's third agent must join while the survivor trains alone, a phase that
forked ranks, which start in a second, get through before it joins)."""

from __future__ import annotations

import gc
import importlib
import io
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


def serve_agent(argv: list[str], cwd: str, env: dict[str, str], log: str) -> None:
    """The body of an agent forked from a test worker's fork server, which imported the trainer
    already (``distributed_harness.start_agent``): a session of its own, stdout and stderr
    unbuffered, appended to ``log`` (which the caller created), ``env`` as its whole environment,
    ``cwd``, then torchrun's ``main`` on ``argv``; exits with its status."""
    os.setsid()
    sink = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    for descriptor in (1, 2):
        os.dup2(sink, descriptor)
    os.close(sink)
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    sys.argv = argv
    preload()
    status = launch()
    os._exit(status)


if __name__ == "__main__":
    preload()
    status = launch()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)  # skip the teardown of the preloaded modules (seconds, and nanobind noise)
