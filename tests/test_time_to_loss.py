"""benchmarks/time_to_loss.py's arithmetic: seeds' mean held-out curve, steps to a target."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from time_to_loss import mean_curve, seed_curves, steps_to


def _run(root: Path, name: str, curve: dict[int, float]) -> None:
    folder = root / name
    folder.mkdir()
    records = [{"step": step, "eval_loss": loss} for step, loss in curve.items()]
    records.append({"step": 1, "loss": 9.0, "step_time_s": 0.1})
    (folder / "metrics.jsonl").write_text("\n".join(map(json.dumps, records)) + "\n")


def test_seed_curves_leave_out_the_tuning_seed_and_average(tmp_path: Path) -> None:
    _run(tmp_path, "demo-32-lr0.01-s42-r0", {100: 1.0, 200: 0.0})
    _run(tmp_path, "demo-32-lr0.01-s43-r0", {100: 8.0, 200: 6.0})
    _run(tmp_path, "demo-32-lr0.01-s44-r0", {100: 6.0, 200: 4.0})
    _run(tmp_path, "demo-32-overlap-lr0.01-s43-r0", {100: 0.0})
    curves = seed_curves(tmp_path, "demo-32", tune_seed=42)
    assert len(curves) == 2
    assert mean_curve(curves) == {100: 7.0, 200: 5.0}


def test_steps_to_interpolates_and_says_when_never() -> None:
    curve = {100: 7.0, 200: 6.0, 300: 5.5}
    assert steps_to(curve, 6.5) == pytest.approx(150.0)
    assert steps_to(curve, 6.0) == pytest.approx(200.0)
    assert steps_to(curve, 8.0) == 100.0
    assert math.isinf(steps_to(curve, 5.0))
    assert math.isinf(steps_to({}, 5.0))


def test_seed_curves_refuse_several_learning_rates(tmp_path: Path) -> None:
    _run(tmp_path, "none-lr0.003-s43-r0", {100: 7.0})
    _run(tmp_path, "none-lr0.006-s43-r0", {100: 6.0})
    with pytest.raises(SystemExit, match=r"learning rates 0\.003, 0\.006"):
        seed_curves(tmp_path, "none", tune_seed=42)
    assert len(seed_curves(tmp_path, "none", tune_seed=43)) == 0
