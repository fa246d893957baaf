"""benchmarks/sites_loss.py's judgement on hand-made outcomes: a killed run's final held-out
loss inside or outside the spread of the uninterrupted seeds, the uninterrupted run's loss at
equal windows, and sites that differ flagged."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from sites_loss import Outcome, eval_curve, final_loss, loss_at, rows, within


def test_a_loss_is_judged_against_the_seeds_range_and_two_deviations() -> None:
    spread = [4.0, 4.2, 4.1]  # mean 4.1, sample deviation 0.1
    assert within(4.15, spread) == (True, True)
    assert within(4.25, spread) == (False, True)  # past the range, inside 2 deviations
    assert within(4.31, spread) == (False, False)
    assert within(4.0, [4.0]) == (True, True)  # one seed: the value itself


def test_the_rows_flag_a_loss_out_of_spread_and_sites_that_differ() -> None:
    curve = ((500, 5.0), (1000, 4.0))
    clean = [
        Outcome(seed, (loss, loss), True, 0, steps=1000, curve=curve)
        for seed, loss in ((1, 4.0), (2, 4.2))
    ]
    killed = [Outcome(1, (4.1, 4.1), True, 300, 200, 1000), Outcome(2, (5.0, 4.9), False, 250)]
    first, second = rows(clean, killed)
    # 90% of the windows: step 900 of the uninterrupted run, 5.0 - 0.8 * 1.0
    assert first == [
        "1", "4.0000", "4.1000", "4.1000", "300", "200", "90.0%", "4.2000", "yes", "yes", "yes",
    ]  # fmt: skip
    assert second[2:] == ["5.0000", "4.9000", "250", "0", "100.0%", "4.0000", "NO", "no", "no"]


def test_the_loss_at_equal_windows_is_interpolated_between_evaluations_and_none_outside() -> None:
    curve = ((1000, 6.0), (2000, 5.0), (3000, 4.5))
    assert loss_at(curve, 1500) == 5.5
    assert loss_at(curve, 3000) == 4.5
    assert loss_at(curve, 999) is None
    assert loss_at(curve, 3001) is None
    assert loss_at(((1000, 6.0),), 1000) == 6.0
    assert loss_at((), 10) is None


def test_the_curve_keeps_a_steps_last_evaluation_and_a_run_without_one_is_an_error(
    tmp_path: Path,
) -> None:
    records = [
        {"step": 1, "loss": 8.0},
        {"step": 1000, "eval_loss": 6.5},
        {"step": 1000, "eval_loss": 6.25},  # logged again after a restart
        {"step": 2000, "eval_loss": 6.0, "eval_ppl": 403.4},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert eval_curve(tmp_path) == ((1000, 6.25), (2000, 6.0))
    assert final_loss(tmp_path) == 6.0
    (tmp_path / "metrics.jsonl").write_text(json.dumps(records[0]) + "\n")
    with pytest.raises(ValueError, match="no eval_loss"):
        final_loss(tmp_path)
