"""Shared pytest fixtures: the C4 sample and tokenizer bundled in the repository's data/, the
uninterrupted reference run that the fault and resume tests compare with, and a copy of the
repository with nothing beside it."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from distributed_harness import REFERENCE_STEPS, logged_losses, reference_args, torchrun  # noqa: E402

SAMPLE_DATA = REPO / "data"


@pytest.fixture(scope="session")
def sample_data() -> Path:
    """The bundled offline data (``data/README.md``): ``c4/*train*.json.gz``,
    ``c4/*validation*.json.gz`` and ``tokenizer/mistral-7b-v0.1``."""
    if not (SAMPLE_DATA / "c4").is_dir():
        pytest.fail(f"bundled data not found at {SAMPLE_DATA}; is this a complete checkout?")
    return SAMPLE_DATA


@pytest.fixture(scope="session")
def reference_run(sample_data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The output folder of one uninterrupted torchrun run of ``reference_args`` (2 ranks),
    made once per session: tests/test_faults.py and tests/test_resume.py compare every
    interrupted run with it (losses and final weights, bit for bit). Tests may read it and may
    start a run in it that must refuse to start, but must not change it."""
    output_dir = tmp_path_factory.mktemp("reference")
    result = torchrun(reference_args(sample_data, output_dir))
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(logged_losses(output_dir)) == list(range(1, REFERENCE_STEPS + 1))
    return output_dir


@pytest.fixture(scope="session")
def clone(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The committable tree of this checkout (tracked files plus untracked files that are not
    ignored), copied into an otherwise empty folder: no shared data folder beside it.
    tests/test_end_to_end.py trains the quick start in it, tests/test_fresh_clone.py runs a
    data test module in it."""
    if not (REPO / ".git").exists():
        pytest.skip("not a git checkout: nothing to clone")
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO, capture_output=True, check=True,
    ).stdout.decode()  # fmt: skip
    target = tmp_path_factory.mktemp("alone") / "torchrun-ddp"
    for name in filter(None, listed.split("\0")):
        if (REPO / name).is_file():
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, target / name)
    assert list(target.parent.iterdir()) == [target], "nothing beside the copy"
    return target


SHARED_REFERENCE = {"test_faults", "test_resume"}
"""Modules that compare with ``reference_run``: pytest-xdist runs them on one worker, so the
session's reference run is made once."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """For ``pytest -n 2 --dist loadgroup`` (pytest-xdist, opt-in): a module's tests run on one
    worker, so its module-scoped fixture (most modules' one spawn of ranks) is built once, and
    the modules that share ``reference_run`` run on the same worker. Not the default: on 2 quiet
    cores a fresh clone's full suite took 21:35 with two workers against 19:32 with one
    (2026-11-26, 739 tests): two multi-rank tests at once only share the cores, and the
    timing-sensitive fault tests get twice the load."""
    for item in items:
        name = item.module.__name__ if item.module else ""
        group = "reference_run" if name in SHARED_REFERENCE else name
        item.add_marker(pytest.mark.xdist_group(group))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """At the end of every run, each skipped test on a line of its own with its reason (pytest's
    ``-ra`` folds equal reasons into one line with a count): a check that did not run here, a
    GPU test without CUDA, the tmpfs variant of the full-disk test without root, the ``clone``
    tests outside a git checkout, is named, not silent."""
    skipped = terminalreporter.stats.get("skipped", [])
    if not skipped:
        return
    terminalreporter.section(f"{len(skipped)} tests not run here, each with its reason")
    for report in skipped:
        longrepr = report.longrepr
        reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
        terminalreporter.line(f"{report.nodeid}: {reason.removeprefix('Skipped: ')}")
