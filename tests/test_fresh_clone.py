"""A copy of the repository with nothing beside it trains and tests offline.

The copy holds exactly what git would commit (tracked files plus untracked files that are not
ignored), in a temporary folder with no shared data folder next to it. There, the quick start's
command runs from an unrelated working directory, and a data-using test module passes.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from distributed_harness import REPO, free_port
from transformers import AutoModelForCausalLM

pytestmark = pytest.mark.slow  # copies the repository and trains the quick start in it

# What a path that leaves the repository for the developers' shared data would contain.
OUTSIDE = ("/".join(("..", "shared")), "/".join(("shared", "data")))
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}


@pytest.fixture(scope="module")
def clone(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The committable tree of this checkout, copied into an otherwise empty folder."""
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


def _env(clone: Path) -> dict[str, str]:
    """Offline, and importing the copy's package rather than this checkout's."""
    return {**os.environ, **OFFLINE, "PYTHONPATH": str(clone / "src")}


def test_quick_start_trains_from_any_working_directory(clone: Path, tmp_path: Path) -> None:
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
        "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{free_port()}",
        str(clone / "train.py"), "--config", str(clone / "configs" / "tiny.toml"),
        "--max-steps", "6", "--log-every", "2", "--eval-every", "6", "--eval-batches", "2",
        "--seq-length", "64", "--warmup-steps", "2", "--checkpoint-every", "100",
    ]  # fmt: skip
    result = subprocess.run(
        command, cwd=tmp_path, env=_env(clone), capture_output=True, text=True, timeout=420,
        check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    run_dir = tmp_path / "outputs" / "tiny"  # output_dir is relative to the working directory
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    assert len(losses) == 3 and losses[-1] < losses[0], losses
    assert str(clone / "data") in (run_dir / "config.toml").read_text(), "the bundled sample"
    model = AutoModelForCausalLM.from_pretrained(run_dir / "final_model")
    assert model.config.hidden_size == 256


def test_a_data_test_module_passes_in_the_copy(clone: Path) -> None:
    module = "tests/test_training_data.py"
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", module],
        cwd=clone, env=_env(clone), capture_output=True, text=True, timeout=420, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert " passed" in result.stdout and "failed" not in result.stdout


def test_nothing_committed_points_outside_the_repository(clone: Path) -> None:
    for folder in ("configs", "src", "tests", "examples", "train.py", "run.sh"):
        for path in [clone / folder, *(clone / folder).rglob("*")]:
            if path.is_file():
                text = path.read_text(errors="replace")
                assert not any(outside in text for outside in OUTSIDE), path
