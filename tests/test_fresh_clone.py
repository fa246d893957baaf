"""A copy of the repository with nothing beside it trains and tests offline.

The copy holds exactly what git would commit (tracked files plus untracked files that are not
ignored), in a temporary folder with no shared data folder next to it (conftest.py's ``clone``).
There a data-using test module passes, and nothing committed points outside the copy. The quick
start's command trains in the same copy, from an unrelated working directory:
tests/test_end_to_end.py.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from distributed_harness import clone_env

pytestmark = pytest.mark.slow  # copies the repository and runs a test module in it

# What a path that leaves the repository for the developers' shared data would contain.
OUTSIDE = ("/".join(("..", "shared")), "/".join(("shared", "data")))


def test_a_data_test_module_passes_in_the_copy(clone: Path) -> None:
    module = "tests/test_training_data.py"
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", module],
        cwd=clone, env=clone_env(clone), capture_output=True, text=True, timeout=420, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert " passed" in result.stdout and "failed" not in result.stdout


def test_nothing_committed_points_outside_the_repository(clone: Path) -> None:
    for folder in ("configs", "src", "tests", "examples", "train.py", "run.sh"):
        for path in [clone / folder, *(clone / folder).rglob("*")]:
            if path.is_file():
                text = path.read_text(errors="replace")
                assert not any(outside in text for outside in OUTSIDE), path
