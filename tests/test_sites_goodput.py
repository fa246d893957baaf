"""benchmarks/sites_goodput.py's counting on hand-made step records: goodput (replayed steps
count once), steps lost, the stall and the recovery after a kill, the heal lines, the kill
schedule and the per-fault rows."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from sites_goodput import (
    ArmResult,
    fault_rows,
    footnote,
    goodput,
    goodput_rows,
    heal_rows,
    heals,
    kill_offsets,
    longest_gap,
    newest_step,
    normal_step_s,
    parse_args,
    recovery_s,
    steady_rows,
    step_records,
    steps_lost,
    train_args,
)

RESTARTED = [(1.0, 1), (2.0, 2), (3.0, 3), (4.0, 4), (9.0, 3), (10.0, 4), (11.0, 5)]
"""Today's path: steps 1-4, a kill at 4.5, the group back at 9 s from step 2's checkpoint."""


def _line(step: int, rank: int = 0) -> str:
    return f"04:28:13 [rank {rank}] step {step} | loss 7.1 | lr 0.0007 | step_time_s 0.06"


def test_step_records_read_rank_0s_step_lines_in_time_order() -> None:
    lines = [
        (2.0, _line(2)),
        (1.0, _line(1)),
        (1.5, _line(9, rank=1)),  # another rank's line (a warning) is not a step record
        (1.7, "04:28:13 [rank 0] sites: healed, training on from step 20"),
        (3.0, "04:28:14 [rank 0] step 3 | loss 7.0"),
    ]
    assert step_records(lines) == [(1.0, 1), (2.0, 2), (3.0, 3)]


def test_goodput_counts_a_replayed_step_once_and_stops_at_the_end() -> None:
    assert newest_step(RESTARTED, 10.0) == 4
    assert goodput(RESTARTED, 0.0, 10.0) == pytest.approx(4 / 10)  # not 6 records
    assert goodput(RESTARTED, 0.0, 20.0) == pytest.approx(5 / 20)
    assert goodput([], 0.0, 5.0) == 0.0


def test_steps_lost_are_the_replayed_and_the_skipped_steps() -> None:
    assert steps_lost(RESTARTED, 4.5) == 2  # steps 3 and 4 again
    skipped = [(1.0, 1), (2.0, 2), (3.0, 3), (7.0, 6), (8.0, 7)]
    assert steps_lost(skipped, 3.5) == 2  # steps 4 and 5 never logged
    steady = [(float(step), step) for step in range(1, 10)]
    assert steps_lost(steady, 4.5) == 0


def test_the_stall_is_the_longest_gap_overlapping_the_window() -> None:
    records = [(0.0, 1), (1.0, 2), (2.0, 3), (8.0, 4), (9.0, 5), (9.5, 6)]
    assert longest_gap(records, 2.5, 9.5) == pytest.approx(6.0)  # 2 -> 8
    assert longest_gap(records, 2.5, 5.0) == pytest.approx(6.0)  # in full, past the window
    assert longest_gap(records, 0.5, 1.5) == pytest.approx(1.0)
    assert longest_gap(records, 8.5, 20.0) == pytest.approx(10.5)  # still open at 20
    assert longest_gap([], 0.0, 5.0) == 0.0
    assert normal_step_s(records) == pytest.approx(1.0)


def test_recovery_runs_from_the_kill_to_a_step_beyond_the_newest_before_it() -> None:
    assert recovery_s(RESTARTED, 4.5) == pytest.approx(11.0 - 4.5)  # step 5, not the replays
    assert math.isinf(recovery_s(RESTARTED[:5], 4.5))


def test_heal_lines_give_mib_and_seconds() -> None:
    lines = [
        (1.0, "04:30:01 [rank 0] sites: healed from a live site at sync 41: 4.57 MiB in 0.052 s"),
        (2.0, "04:30:02 [rank 0] sites: healed, training on from step 82"),
    ]
    assert heals(lines) == [(1.0, (4.57, 0.052))]


def test_kills_fall_every_period_while_the_return_is_before_the_end() -> None:
    assert kill_offsets(480, 120, 20) == [120, 240, 360]
    assert kill_offsets(150, 60, 20) == [60, 120]
    assert kill_offsets(130, 60, 20) == [60]  # 120 + 20 is past the end
    assert kill_offsets(100, 0, 20) == []


def _arm(arm: str, steps: list[tuple[float, int]], kill: float, start: float = 0.0) -> ArmResult:
    result = ArmResult(arm, start, end=start + 20.0, kills=[kill], restarts=[kill + 2.0])
    result.lines = [(stamp, _line(step)) for stamp, step in steps]
    return result


def test_the_rows_compare_with_the_rounds_no_failure_arm() -> None:
    steady = [(float(step), step) for step in range(1, 21)]  # 1 step/s
    times = [1, 2, 3, 4, 5, 9, 10, 11, 14, 15, 16, 17, 18, 19, 20]  # stalls 5 -> 9, 11 -> 14
    stalled = [(float(stamp), step) for step, stamp in enumerate(times, start=1)]
    none, sites = _arm("none", steady, 10.0), _arm("sites", stalled, 5.5)
    sites.workers = [[41], [41]]
    sites.returning = [(12.0, _line(8)), (13.0, _line(9))]
    rows = goodput_rows([none, sites], 1)
    assert rows[0][5:7] == ["1.00", "100%"]
    assert rows[1][4:7] == ["15", "0.75", "75%"]
    assert rows[1][7] == "-"  # no today's arm in this round
    assert rows[1][8:10] == ["0.85", "85%"]  # 15 + 2 step records in 20 s against 40
    assert rows[1][10] == "no (same pids)"
    [fault] = fault_rows(sites, 1)
    assert fault[3:5] == ["6", "0"]  # killed at 5.5 s; no step logged twice or skipped
    assert fault[5] == "3.0"  # the gap 5 -> 9 around the kill, less the 1 s step
    assert fault[6] == "2.0"  # after the restart at 7.5: 11 -> 14, less 1 s
    assert fault[8] == "4.5"  # site 1's first step after its restart
    sites.workers = [[41], [57]]
    assert goodput_rows([none, sites], 1)[1][10] == "yes"


def test_a_heal_is_compared_with_its_bytes_over_the_measured_bandwidth() -> None:
    sites = _arm("sites", [(1.0, 1)], 5.5, start=100.0)
    sites.returning = [
        (130.0, "[rank 0] sites: healed from a live site at sync 9: 4.00 MiB in 0.063 s")
    ]
    [row] = heal_rows(sites, 2, {4 * 2**20: 100.0, 64 * 2**20: 200.0})  # MB/s
    assert row[1:5] == ["2", "30", "4.00", "0.063"]
    assert row[5:7] == ["0.021", "3.00"]  # 4 MiB at 200 MB/s: 0.021 s, taken 3x that
    assert row[7:9] == ["0.042", "1.50"]  # at the 4 MiB send's own 100 MB/s


def test_every_arm_trains_the_chosen_method() -> None:
    """DiLoCo with its --local-steps by default; --optimizer adamw without them."""
    out = Path("out")
    diloco = train_args(parse_args(["--local-steps", "4"]), out, out)
    assert diloco[diloco.index("--optimizer") :][:4] == [
        "--optimizer",
        "diloco",
        "--local-steps",
        "4",
    ]
    adamw = train_args(parse_args(["--optimizer", "adamw"]), out, out)
    assert adamw[adamw.index("--optimizer") + 1] == "adamw" and "--local-steps" not in adamw


def test_train_flags_reach_every_arm_last() -> None:
    """``--train-flags``: one string of train.py flags (AdamW's comm hook across sites and in
    today's DDP alike), split as a shell does, after the shared flags."""
    hook = "--compression dct --compression-ratio 0.25 --compression-value-dtype bfloat16"
    flags = train_args(
        parse_args(["--optimizer", "adamw", "--train-flags", hook]), *[Path("o")] * 2
    )
    assert flags[-6:] == hook.split()


def test_the_footnote_gives_a_command_that_reruns_as_printed() -> None:
    """A --train-flags string is quoted in the footnote's command, as a shell needs it."""
    argv = ["--optimizer", "adamw", "--train-flags", "--compression dct"]
    text = footnote(parse_args(argv), argv, Path("o"))
    assert "sites_goodput.py --optimizer adamw --train-flags '--compression dct'`" in text


def test_the_steady_rate_counts_from_the_start_up_to_the_first_kill() -> None:
    """From STEADY_FROM_S (40 s) after launch to the first kill: start-up and faults left out."""
    fast = [(float(t), 2 * t) for t in range(1, 101)]  # 2 steps/s
    slow = [(float(t), t) for t in range(1, 40)] + [(40.0 + t, 40 + 3 * t) for t in range(61)]
    today, sites = _arm("today", fast, 80.0), _arm("sites", slow, 90.0)
    today.end = sites.end = 100.0
    rows = steady_rows([sites, today], 1)
    assert rows[0][2:] == ["3.00", "150%"]  # 3 steps/s from 40 s to the kill at 90 s
    assert rows[1][2:] == ["2.00", "100%"]
    none = _arm("none", fast[:30], 0.0)
    none.kills = []
    assert steady_rows([none], 1)[0][2:] == ["nan", "-"]  # no record past 40 s
