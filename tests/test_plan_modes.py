"""The --dry-run plan under each --data-parallel mode tells one story: the communication table
has rows only for what the mode runs, each once; the run's cross-node figure is the table's;
fsdp over nodes gives the bytes its collectives send through the node link per micro-batch and
per step, and their time; fsdp plans no checkpoint folder per node; the compute time is at the
device's peak. LLaMA-2-7B on the meta device, planned for 2 nodes of 8 ranks (fast: no rank
starts)."""

from __future__ import annotations

import pytest
import torch

from torchrun_ddp.config_io import parse_config
from torchrun_ddp.distributed import DistEnv
from torchrun_ddp.dry_run import DataCount, dry_run, plan_peak, planned_steps, run_length

PARAMETERS = 6_738_415_616
BASE = ("--config", "configs/llama2_7b.toml", "--zero1", "false", "--compression", "none")
BASE += ("--device-memory-gib", "80", "--plan-tflops", "100")
ENV = DistEnv(rank=0, world_size=16, local_rank=0, local_world_size=8)


def _plan(*flags: str) -> str:
    """The dry run's text of the 7B config with ``flags``, on 2 nodes x 8 ranks."""
    return dry_run(parse_config([*BASE, *flags]), ENV)


def _rows(text: str) -> dict[str, list[str]]:
    """The communication table's rows: name -> its cells (wire MB, uplink MB, ...)."""
    table = text.split("| method | wire MB/rank/step")[1].split("\n|---|---:|---:|---:|")[1]
    lines = table.split("\n| checkpoints")[0].strip().splitlines()[1:]
    cells = [line.strip("| ").split(" | ") for line in lines if line.startswith("| ")]
    names = [row[0] for row in cells]
    assert len(names) == len(set(names)), names  # each row once
    return {row[0]: row[1:] for row in cells}


def _line(text: str, start: str) -> str:
    return next(line for line in text.splitlines() if line.startswith(start))


def _mb(line: str, before: str) -> float:
    """The number right before ``before`` in ``line``."""
    return float(line.split(before, maxsplit=1)[0].rsplit(maxsplit=1)[-1])


def test_ddp_prints_the_runs_hook_once_and_its_figure_is_its_row() -> None:
    """ddp with --compression none: the none row once (it is both the run's and a reference),
    and the run's line gives that row's uplink bytes."""
    text = _plan()
    rows = _rows(text)
    assert next(iter(rows)) == "none" and "bf16" in rows
    run = _line(text, "this run, per optimizer step:")
    assert _mb(run, "MB through each node's uplink") == float(rows["none"][1]), run
    assert "(the none row)" in run


def test_fsdp_over_two_nodes_plans_its_collectives_on_the_node_link() -> None:
    """fsdp over 2 nodes: one row (FSDP's collectives; no DDP comm hook, which fsdp refuses),
    its all-gathers per micro-batch and its step through the uplink (2 micro-batches plus one
    reduce-scatter), their time at --plan-inter-node-gbit (half at twice the bandwidth), and
    the checkpoint plan's one shared folder (fsdp refuses a folder per node)."""
    text = _plan("--data-parallel", "fsdp", "--accumulation-steps", "2")
    rows = _rows(text)
    assert list(rows) == ["fsdp: FSDP within shard groups"], rows
    line = _line(text, "its shard group spans 2 nodes")
    micro, step = _mb(line, "MB per micro-batch"), _mb(line, "MB per step through")
    head = _line(text, "--data-parallel fsdp (1 x 16 ranks)")
    reduce = _mb(head, "MB) within its shard group")
    assert step == pytest.approx(2 * micro + reduce, rel=1e-3), (line, head)
    gathered = (2 * PARAMETERS - 32000 * 4096) * 2  # bf16 gathers; the embedding once
    assert micro * 1e6 == pytest.approx(15 / 16 * gathered, rel=0.01)
    seconds = _mb(line, "s per step at")
    assert seconds == pytest.approx(step * 1e6 * 8 / 100e9, rel=1e-3)
    assert float(rows["fsdp: FSDP within shard groups"][1]) == pytest.approx(step, rel=1e-3)
    faster = _line(_plan("--data-parallel", "fsdp", "--accumulation-steps", "2",
                         "--plan-inter-node-gbit", "200"), "its shard group spans")  # fmt: skip
    assert _mb(faster, "s per step at") == pytest.approx(seconds / 2, rel=1e-3)
    assert "folder per node:" not in text and "refuses a folder per node" in text


def test_hsdp_diloco_headline_and_row_are_one_quantity() -> None:
    """hsdp (2 replicas of 8) with DiLoCo H=500: the run's cross-node figure is the per-step
    row's uplink column (a sync's share: one sync's / 500), each rank sends its 1/8 shard and
    the node's 8 rings carry 8 times that; FSDP within the node crosses nothing; no
    node-aware row (hsdp refuses --compression-scope inter-node)."""
    text = _plan("--data-parallel", "hsdp", "--optimizer", "diloco", "--local-steps", "500")
    rows = _rows(text)
    name = next(row for row in rows if row.endswith("per step (sync / 500)"))
    sync = next(row for row in rows if row.endswith("one sync"))
    run = _line(text, "this run, per optimizer step:")
    assert _mb(run, "MB through each node's uplink") == float(rows[name][1]), (run, rows[name])
    assert float(rows[sync][1]) == pytest.approx(500 * float(rows[name][1]), rel=1e-3)
    shard_bytes = PARAMETERS * 4 / 8  # fp32 pseudo-gradient shard, all-reduced over 2 replicas
    assert float(rows[sync][0]) * 1e6 == pytest.approx(shard_bytes, rel=0.01)
    assert float(rows[sync][1]) == pytest.approx(8 * float(rows[sync][0]), rel=1e-3)
    assert rows["hsdp: FSDP within shard groups"][1] == "0"
    assert not any("inter-node" in row for row in rows), list(rows)


def test_hsdp_hook_halves_the_native_all_reduce_across_replicas() -> None:
    """hsdp with a dct 0.5 hook (fp32 values): its row across the replicas sends half of
    FSDP's native all-reduce of the shards, and the run's figure is that row's."""
    text = _plan("--data-parallel", "hsdp", "--compression", "dct")
    rows = _rows(text)
    native = float(rows["replicas: FSDP all-reduce (native hsdp)"][0])
    assert native * 1e6 == pytest.approx(PARAMETERS * 4 / 8, rel=0.01)
    assert float(rows["replicas: dct 0.5"][0]) == pytest.approx(native / 2, rel=0.01)
    run = _line(text, "this run, per optimizer step:")
    assert _mb(run, "MB through each node's uplink") == float(rows["replicas: dct 0.5"][1])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU's measured peak")
def test_compute_time_is_at_the_peak_the_device_gives() -> None:
    """Without --plan-tflops the plan's compute is at --peak-tflops, else (here, on a CPU) the
    measured matmul rate in the compute dtype, named; the run length's time halves at twice
    the peak, and the line names where its rate comes from."""
    fp32 = ["--precision", "fp32"]
    assert plan_peak(parse_config([*fp32, "--peak-tflops", "2"])) == (2e12, "--peak-tflops")
    assert plan_peak(parse_config([*fp32, "--peak-tflops", "2", "--plan-tflops", "3"]))[0] == 3e12
    measured, source = plan_peak(parse_config(fp32))
    assert 0 < measured < 50e12 and source.startswith("measured float32 matmul on this CPU")
    config = parse_config(["--max-steps", "10"])
    slow, fast = (
        run_length(config, 1, DataCount(), 1e9, (peak, "--peak-tflops")) for peak in (1e12, 2e12)
    )
    assert "at 1 TFLOP/s per rank (--peak-tflops" in slow, slow
    seconds = [float(line.split("compute ")[1].split()[0]) for line in (slow, fast)]
    assert seconds[0] == pytest.approx(2 * seconds[1], rel=0.01)


def test_steps_end_where_the_loop_finds_the_data_ended() -> None:
    """The run length counts each planned rank's windows (``windows_per_rank``): the rank with
    the fewest ends the run, on whole steps, at the last log step before its end (ranks agree
    there); --max-steps first when it comes first; no step at all is said to be refused. The
    loop itself is checked against this in test_end_to_end (uneven data, 2 ranks)."""
    args = ["--batch-size", "4", "--max-steps", "1000", "--log-every", "10"]
    config = parse_config(args)
    counted = DataCount(10**6, (594, 687))
    assert planned_steps(config, 2, counted) == 140  # 594 // 4 = 148 steps, cut to 140
    assert planned_steps(parse_config([*args, "--log-every", "1"]), 2, counted) == 148
    assert planned_steps(parse_config([*args, "--max-steps", "100"]), 2, counted) == 100
    assert planned_steps(config, 2, DataCount(10**6)) == 10**6 // (2 * 4 * 512)  # tokens only
    line = run_length(config, 2, DataCount(10**6, (30, 100)), 1e9, (1e12, "--plan-tflops"))
    assert line.startswith("run length: 0 optimizer steps") and "a real start refuses" in line
    line = run_length(config, 2, counted, 1e9, (1e12, "--plan-tflops"))
    assert "140 optimizer steps (the data ends" in line and "fewest 594 windows" in line
