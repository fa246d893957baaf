"""benchmarks/sites_loss.py's judgement on hand-made outcomes: a killed run's final held-out
loss inside or outside the spread of the uninterrupted seeds, and sites that differ flagged."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from sites_loss import Outcome, rows, within


def test_a_loss_is_judged_against_the_seeds_range_and_two_deviations() -> None:
    spread = [4.0, 4.2, 4.1]  # mean 4.1, sample deviation 0.1
    assert within(4.15, spread) == (True, True)
    assert within(4.25, spread) == (False, True)  # past the range, inside 2 deviations
    assert within(4.31, spread) == (False, False)
    assert within(4.0, [4.0]) == (True, True)  # one seed: the value itself


def test_the_rows_flag_a_loss_out_of_spread_and_sites_that_differ() -> None:
    clean = [Outcome(seed, (loss, loss), True, 0) for seed, loss in ((1, 4.0), (2, 4.2))]
    killed = [Outcome(1, (4.1, 4.1), True, 300, 200, 1000), Outcome(2, (5.0, 4.9), False, 250)]
    first, second = rows(clean, killed)
    assert first == ["1", "4.0000", "4.1000", "4.1000", "300", "200", "90.0%", "yes", "yes", "yes"]
    assert second[2:] == ["5.0000", "4.9000", "250", "0", "100.0%", "NO", "no", "no"]
