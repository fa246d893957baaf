"""The test hooks of faults.py (``TORCHRUN_DDP_FAULT``, ``TORCHRUN_DDP_PERTURB``) fire only when
the test harness arms them: a hook variable set without it (a stale export that sbatch passes on)
is refused at start in one line, status 2, before anything is written; an armed hook with a
malformed value is refused the same way; an unarmed hook never fires. Through the real entry
point (train.py's ``main``), in this process: each refusal comes before the process group."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest
from distributed_harness import REPO, armed_hooks, tiny_args

sys.path.insert(0, str(REPO))

import train
from torchrun_ddp import faults


def _refused(capsys: pytest.CaptureFixture[str], sample_data: Path, out: Path) -> str:
    assert train.main(tiny_args(sample_data, out)) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err, err
    assert not out.exists(), "refused before anything is written"
    return err


@pytest.mark.parametrize("name", [faults.ENV, faults.PERTURB_ENV])
def test_a_hook_set_without_the_harness_arming_it_is_refused_at_start(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    sample_data: Path,
    tmp_path: Path,
    name: str,
) -> None:
    monkeypatch.delenv(faults.ARM_ENV, raising=False)
    monkeypatch.setenv(name, "step:0:3" if name == faults.ENV else "nan-loss:3")
    err = _refused(capsys, sample_data, tmp_path / "out")
    assert f"{name} is set in the environment but test hooks are not armed" in err
    assert f"unset {name}" in err
    monkeypatch.setenv(faults.ARM_ENV, "1")  # only the harness's exact value arms them
    assert "are not armed" in _refused(capsys, sample_data, tmp_path / "out")


@pytest.mark.parametrize(
    ("faults_spec", "perturb", "words"),
    [
        ("step:0", "", "TORCHRUN_DDP_FAULT=step:0 is malformed: 'step:0' is not POINT:RANK:STEP"),
        ("kill:0:3", "", "'kill:0:3' is not POINT:RANK:STEP with POINT one of step, "),
        ("step:0:3,publish:x:4", "", "'publish:x:4' is not POINT:RANK:STEP"),
        ("", "nan-loss", "TORCHRUN_DDP_PERTURB=nan-loss is malformed: 'nan-loss' is not KIND:N"),
        ("", "nan-los:3", "'nan-los:3' is not KIND:N with KIND one of nan-loss, inf-loss, "),
    ],
)
def test_an_armed_hook_with_a_malformed_value_is_one_line_at_start(
    capsys: pytest.CaptureFixture[str],
    sample_data: Path,
    tmp_path: Path,
    faults_spec: str,
    perturb: str,
    words: str,
) -> None:
    with armed_hooks(faults=faults_spec, perturb=perturb):
        err = _refused(capsys, sample_data, tmp_path / "out")
    assert words in err, err


def test_armed_hooks_are_described_and_unarmed_ones_never_fire(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``check_hooks`` names what the harness armed (logged and written to config.toml: see
    test_damaged_checkpoints' divergence test); without the arming, ``perturbation`` and
    ``fault_point`` do nothing even where the variable names this very step."""
    with armed_hooks(faults="step:0:3", perturb="nan-loss:3,replica:1"):
        assert faults.check_hooks() == (
            "TORCHRUN_DDP_FAULT=step:0:3; TORCHRUN_DDP_PERTURB=nan-loss:3,replica:1"
        )
        assert faults.perturbation("replica") == 1 and faults.fault_armed()
        assert "nan-loss:3,replica:1 perturbed this run" in faults.perturbed_note()
    monkeypatch.delenv(faults.ARM_ENV, raising=False)
    monkeypatch.setenv(faults.ENV, "step:0:3")
    monkeypatch.setenv(faults.PERTURB_ENV, "nan-loss:3")
    monkeypatch.setenv("RANK", "0")
    assert faults.perturbation("nan-loss") is None and not faults.fault_armed()
    assert faults.perturbed_note() == ""
    faults.fault_point("step", 3)  # would SIGKILL this test process if it fired
    monkeypatch.delenv(faults.ENV)
    monkeypatch.delenv(faults.PERTURB_ENV)
    assert faults.check_hooks() == ""


def test_each_hold_waits_for_its_own_step_file(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """``hold:2,hold:20``: step 2 waits for ``<file>.2`` only, step 20 for ``<file>.20``, an
    unnamed step never waits, and nothing waits when the hooks are not armed."""
    hold = tmp_path / "hold"
    monkeypatch.setenv(faults.HOLD_ENV, str(hold))
    with armed_hooks(perturb="hold:2,hold:20"):
        waiter = threading.Thread(target=faults.hold_point, args=(2,))
        waiter.start()
        faults.hold_point(3)  # not named: returns at once
        (tmp_path / "hold.20").touch()  # another step's file releases nothing
        waiter.join(timeout=0.5)
        assert waiter.is_alive()
        (tmp_path / "hold.2").touch()
        waiter.join(timeout=10)
        assert not waiter.is_alive()
        faults.hold_point(20)  # its file exists
    (tmp_path / "hold.2").unlink()
    faults.hold_point(2)  # not armed: no wait
