"""AdamW groups and the warmup + cosine-with-restarts schedule at its landmarks."""

from __future__ import annotations

import math

import pytest
import torch

from torchrun_ddp.optim import build_optimizer, build_scheduler, parameter_groups

LR, MIN_LR, WARMUP, CYCLE = 1e-3, 1e-5, 10, 20


def _lrs(steps: int, cycle_mult: int = 1) -> list[float]:
    model = torch.nn.Linear(4, 4)
    optimizer = build_optimizer(model, LR, 0.1)
    scheduler = build_scheduler(optimizer, WARMUP, CYCLE, cycle_mult, MIN_LR)
    rates = []
    for _ in range(steps):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return rates


def test_schedule_landmarks() -> None:
    rates = _lrs(WARMUP + 2 * CYCLE + 1)
    assert rates[0] == pytest.approx(LR / WARMUP)
    assert rates[WARMUP - 1] == pytest.approx(LR)
    assert rates[WARMUP] == pytest.approx(LR)
    assert rates[WARMUP + CYCLE // 2] == pytest.approx((LR + MIN_LR) / 2)
    quarter = MIN_LR + (LR - MIN_LR) * (1 + math.cos(math.pi / 4)) / 2
    assert rates[WARMUP + CYCLE // 4] == pytest.approx(quarter)
    assert rates[WARMUP + CYCLE - 1] < 0.01 * LR + MIN_LR
    assert rates[WARMUP + CYCLE] == pytest.approx(LR), "warm restart at the cycle boundary"
    assert rates[WARMUP + 2 * CYCLE] == pytest.approx(LR)


def test_schedule_cycles_grow_with_mult() -> None:
    rates = _lrs(WARMUP + CYCLE + 2 * CYCLE + 1, cycle_mult=2)
    assert rates[WARMUP + CYCLE] == pytest.approx(LR)
    midway = rates[WARMUP + 2 * CYCLE]
    assert midway == pytest.approx((LR + MIN_LR) / 2), "second cycle twice as long: halfway"
    assert rates[WARMUP + 3 * CYCLE] == pytest.approx(LR)


def test_weight_decay_skips_norms_and_biases() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    decay, no_decay = parameter_groups(model, 0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert [p.ndim for p in decay["params"]] == [2]
    assert sorted(p.ndim for p in no_decay["params"]) == [1, 1, 1]
