"""benchmarks/time_to_loss.py's arithmetic: seeds' mean held-out curve, steps to a target,
per-folder targets, and the arguments of the end-to-end rerun."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from common import RunSummary, pick_variants, summarise
from time_to_loss import (
    check_args,
    compare_rerun,
    first_limited_link,
    load_curves,
    mean_curve,
    rerun_args,
    seconds_at,
    seed_curves,
    step_seconds,
    steps_to,
    timed_steps,
)


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
    assert sorted(curves) == [43, 44]
    assert mean_curve(list(curves.values())) == {100: 7.0, 200: 5.0}


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


def _args(*folders: Path, target_step: int = 200) -> argparse.Namespace:
    return argparse.Namespace(frontier_dir=list(folders), tune_seed=42, target_step=target_step)


def test_each_method_takes_the_target_of_the_first_folder_with_its_runs(tmp_path: Path) -> None:
    flat, nodes = tmp_path / "flat", tmp_path / "nodes"
    flat.mkdir(), nodes.mkdir()
    _run(flat, "none-lr0.003-s43-r0", {100: 7.0, 200: 6.0})
    _run(flat, "demo-32-lr0.003-s43-r0", {100: 6.5, 200: 5.9})
    _run(nodes, "none-lr0.003-s43-r0", {100: 7.2, 200: 6.2})
    _run(nodes, "demo-32-lr0.003-s43-r0", {100: 0.0, 200: 0.0})  # shadowed by flat's
    _run(nodes, "demo-32-node-lr0.003-s43-r0", {100: 6.6, 200: 6.1})
    _run(flat, "none-lr0.003-s44-r0", {100: 7.0, 200: 6.4})
    _run(flat, "bf16-lr0.003-s44-r0", {100: 7.0, 200: 6.3})
    variants = pick_variants("none,demo-32,demo-32-node,bf16,dct-0.25-bf16", 64)
    curves = load_curves(_args(flat, nodes), variants)
    assert curves.folder == {"none": flat, "demo-32": flat, "demo-32-node": nodes, "bf16": flat}
    assert curves.seeds == {"none": [43, 44], "demo-32": [43], "demo-32-node": [43], "bf16": [44]}
    # each method against dense at its own seeds: bf16 ran only seed 44
    assert curves.targets == pytest.approx(
        {"none": 6.2, "demo-32": 6.0, "demo-32-node": 6.2, "bf16": 6.4}
    )
    assert curves.by_method["demo-32"] == {100: 6.5, 200: 5.9}
    assert steps_to(curves.by_method["demo-32-node"], curves.target("demo-32-node")) < 200
    assert math.isnan(curves.target("dct-0.25-bf16"))


def test_a_folder_without_dense_at_the_target_step_is_refused(tmp_path: Path) -> None:
    _run(tmp_path, "none-lr0.003-s43-r0", {100: 7.0, 200: 6.0})
    _run(tmp_path, "bf16-lr0.003-s43-r0", {100: 7.0, 200: 6.0})
    with pytest.raises(SystemExit, match="no dense \\(none\\) held-out loss at step 300"):
        load_curves(_args(tmp_path, target_step=300), pick_variants("bf16", 64))


def test_seconds_at_sums_step_times_to_a_fractional_step() -> None:
    times = [1.0, 2.0, 3.0]
    assert seconds_at(times, 1.5) == pytest.approx(2.0)
    assert seconds_at(times, 3.0) == pytest.approx(6.0)
    assert math.isinf(seconds_at(times, math.inf))
    assert math.isinf(seconds_at(times, 3.5))
    assert math.isinf(seconds_at(times, math.nan))


def test_end_to_end_needs_a_timed_method_and_a_limited_link() -> None:
    variants = pick_variants("none,demo-32", 64)
    args = argparse.Namespace(end_to_end="demo-32", links="off, 100mbit,1gbit")
    check_args(args, variants)
    assert first_limited_link(args) == "100mbit"
    with pytest.raises(SystemExit, match="needs a limited link"):
        check_args(argparse.Namespace(end_to_end="demo-32", links="off"), variants)
    with pytest.raises(SystemExit, match="must be one of --methods"):
        check_args(argparse.Namespace(end_to_end="bf16", links="100mbit"), variants)


def test_rerun_args_keep_the_frontier_run_and_refuse_one_node(tmp_path: Path) -> None:
    flags = ["--output-dir", "runs/a", "--seed", "43", "--compression", "demo"]
    (tmp_path / "train_args.json").write_text(json.dumps([*flags, "#nodes", "2"]))
    rerun = rerun_args(tmp_path, tmp_path / "again")
    assert rerun[:6] == ["--output-dir", str(tmp_path / "again"), *flags[2:]]
    assert rerun[6:] == ["--threads", "1", "--timeout-s", "600"]
    (tmp_path / "train_args.json").write_text(json.dumps(flags))
    with pytest.raises(SystemExit, match="not laid out as 2 nodes"):
        rerun_args(tmp_path, tmp_path / "again")


def _summary(times: list[float], evals: dict[int, float]) -> RunSummary:
    records = [{"step": i + 1, "loss": 1.0, "step_time_s": t} for i, t in enumerate(times)]
    return summarise(records + [{"step": s, "eval_loss": loss} for s, loss in evals.items()])


def test_compare_rerun_checks_losses_total_time_and_time_to_target() -> None:
    frontier = _summary([0.1] * 4, {2: 6.0, 4: 5.0})
    rerun = _summary([0.2, 0.2, 0.3, 0.3], {2: 6.0, 4: 5.0})
    text = compare_rerun(rerun, frontier, 5.5, 0.25)
    assert "difference from the frontier run: 0.00e+00" in text
    assert "Its 4 steps took 1 s; composed: 4 x 0.250 s = 1 s (+0%)" in text
    # both reach 5.5 at step 3: 0.2 + 0.2 + 0.3 = 0.7 s against 3 x 0.25 = 0.75 s
    assert "at step 3 after 1 s of steps; composed: 3 steps x 0.250 s = 1 s (-7%)" in text
    assert "did not reach" in compare_rerun(rerun, frontier, 4.0, 0.25)


def test_an_overlapped_sync_is_timed_over_the_windows_that_wait() -> None:
    """DiLoCo H 50 overlapped: 2 windows after the warm-up; the mean over the second, whose last
    step (100) waits for the sync started at step 50, not over the first, which never waits."""
    overlapped, waiting = pick_variants("diloco-h50-overlap,diloco-h50", 64)
    args = argparse.Namespace(steps=8)
    assert (timed_steps(args, overlapped), timed_steps(args, waiting)) == (100, 50)
    warmup = 3
    times = [1.0] * (warmup + 100)
    times[50 - 1] = 5.0  # step 50: the first sync starts (compression only)
    times[100 - 1] = 20.0  # step 100: waits for it and starts the next
    assert step_seconds(times, warmup, overlapped) == pytest.approx((49 + 20) / 50)
    assert step_seconds(times[: warmup + 50], warmup, waiting) == pytest.approx((49 + 5) / 50)
