"""The benchmark variants (benchmarks/common.py) are train.py settings: each variant's flags parse
into a valid TrainConfig, so a misspelt flag fails here, not when a benchmark command reaches
that variant after the runs before it."""

from __future__ import annotations

import math
import statistics
import sys
from pathlib import Path

import pytest

from torchrun_ddp.config_io import parse_config

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import first_steps
import memory
import throughput
from common import Variant, all_variants, optimizer_of
from compression import learning_rates, method_lrs, parse_args, sd_cell, seeds_needed

VARIANTS = all_variants()


@pytest.mark.parametrize("variant", VARIANTS.values(), ids=list(VARIANTS))
def test_every_variant_is_a_valid_train_config(variant: Variant) -> None:
    config = parse_config(list(variant.flags))
    assert config.optimizer == optimizer_of(variant)


def test_the_lever_variants_change_only_their_own_setting() -> None:
    base = parse_config(list(VARIANTS["sparseloco-h25"].flags))
    outer = parse_config(list(VARIANTS["sparseloco-h25-outer1.5"].flags))
    decay = parse_config(list(VARIANTS["sparseloco-h25-beta0.999"].flags))
    wide = parse_config(list(VARIANTS["sparseloco-h100-k256"].flags))
    assert (base.local_steps, base.sparseloco_topk, base.outer_lr) == (25, 64, 0.0)
    assert (outer.outer_lr, outer.sparseloco_beta) == (1.5, base.sparseloco_beta)
    assert (decay.sparseloco_beta, decay.outer_lr) == (0.999, base.outer_lr)
    assert (wide.local_steps, wide.sparseloco_topk) == (100, 256)


def test_seeds_needed_follows_mean_plus_two_standard_errors() -> None:
    changes = [2.0, 0.16, 0.5, -0.2]  # mean 0.615, sd about 0.97 (issue 46's kind of spread)
    needed = int(seeds_needed(changes, 1.0))
    mean, sd = 0.615, statistics.stdev(changes)
    assert mean + 2 * sd / math.sqrt(needed) <= 1.0 < mean + 2 * sd / math.sqrt(needed - 1)
    assert sd_cell(changes) == f"{sd:.2f}"
    assert seeds_needed([1.2, 1.5], 1.0) == "none (mean above)"
    assert seeds_needed([0.1], 1.0) == "-"


def test_method_lrs_fix_one_rate_per_method() -> None:
    args = parse_args(["--adamw-lrs", "1e-3,3e-3", "--method-lrs", "dct-0.25-bf16=1.5e-3"])
    assert learning_rates(args, VARIANTS["dct-0.25-bf16"]) == [1.5e-3]
    assert learning_rates(args, VARIANTS["none"]) == [1e-3, 3e-3]
    with pytest.raises(SystemExit, match="not METHOD=LR"):
        method_lrs("none:7.5e-4")


def test_the_memory_benchmark_plans_hsdp_at_its_shard_degree(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """benchmarks/memory.py's hsdp row is planned with its replicas of ``--shard-degree``
    ranks: 2 x 2 on 4 ranks holds what fsdp holds on 2 (half of every state), and a shard
    degree that does not divide the ranks is refused in one line before any rank starts."""
    tiny = memory.TINY_MODEL
    hsdp = memory.planned(memory.SETTINGS["hsdp-fp32"], memory.Run(tiny, 4, shard_degree=2))
    fsdp_2 = memory.planned(memory.SETTINGS["fsdp-fp32"], memory.Run(tiny, 2))
    fsdp_4 = memory.planned(memory.SETTINGS["fsdp-fp32"], memory.Run(tiny, 4))
    assert hsdp.weights == fsdp_2.weights and hsdp.optimizer_state == fsdp_2.optimizer_state
    assert fsdp_4.weights < hsdp.weights
    argv = ["--settings", "hsdp-fp32", "--world-size", "4", "--shard-degree", "3"]
    assert memory.main(argv) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "--shard-degree" in error, error


def test_throughput_settings_name_the_loss_micro_batch_and_checkpointing() -> None:
    """``benchmarks/throughput.py`` setting names: -liger and -plain pick --fused-loss, -mbN the
    micro-batch per rank, -ac activation checkpointing; the flags parse as a train config."""
    setting = throughput._setting("1x1-bf16-fsdp-compile-liger-mb32-ac")
    args = throughput.parse_args(["--device", "cuda", "--data-dir", "data"])
    config = parse_config(throughput.train_argv(args, setting, Path("/tmp/out")))
    assert (config.fused_loss, config.batch_size, config.data_parallel) == ("liger", 32, "fsdp")
    assert config.compile and config.activation_checkpointing and not config.save_at_end
    assert config.precision == "bf16-mixed" and config.device == "cuda"
    plain = parse_config(throughput.train_argv(args, throughput._setting("2x1-fp32-plain"), Path()))
    assert (plain.fused_loss, plain.batch_size, plain.data_parallel) == ("none", 2, "ddp")


@pytest.mark.parametrize("run", ["lora", "fsdp"])
def test_first_steps_runs_are_7b_train_configs_saved_nowhere(run: str) -> None:
    """``benchmarks/first_steps.py``'s runs: LLaMA-2-7B's shape with random weights, on CUDA,
    logged every step, no checkpoint or final model at the end."""
    args = first_steps.parse_args([])
    config = parse_config(first_steps.train_argv(args, run, Path("/tmp/out")))
    assert (config.init, config.device, config.log_every) == ("random", "cuda", 1)
    assert config.model.endswith("configs/llama2-7b/config.json") and not config.save_at_end
    assert config.peft == ("lora" if run == "lora" else "none")
    assert config.data_parallel == ("ddp" if run == "lora" else "fsdp")
