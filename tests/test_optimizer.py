"""AdamW groups and the learning-rate schedules: cosine with restarts at its landmarks, and each
of transformers' schedules against its formula, resumed mid-run through JSON as a checkpoint
keeps it."""

from __future__ import annotations

import json
import math

import pytest
import torch

from torchrun_ddp.optim import ScheduleSettings, build_optimizer, build_scheduler, parameter_groups

LR, MIN_LR, WARMUP, CYCLE = 1e-3, 1e-5, 10, 20


def _lrs(steps: int, cycle_mult: int = 1) -> list[float]:
    model = torch.nn.Linear(4, 4)
    optimizer = build_optimizer(model, LR, 0.1)
    settings = ScheduleSettings("cosine-restarts", LR, WARMUP, -1, CYCLE, cycle_mult, MIN_LR)
    scheduler = build_scheduler(optimizer, settings)
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


TOTAL, DECAY = 60, 12


def _reference(name: str, step: int) -> float:
    """The rate at ``step`` from each schedule's formula (``build_scheduler``'s docstring)."""
    m = MIN_LR / LR
    if name == "wsd":
        if step < WARMUP:
            return LR * (m + (1 - m) * step / WARMUP)
        decayed = max(0.0, (step - (TOTAL - DECAY)) / DECAY)
        return LR * (m + (1 - m) * (1 - min(decayed, 1.0)))
    if step < WARMUP:
        return LR * step / WARMUP
    progress = (step - WARMUP) / (TOTAL - WARMUP)
    if name == "cosine":
        return LR * (m + (1 - m) * (1 + math.cos(math.pi * progress)) / 2)
    if name == "linear":
        return LR * max(0.0, 1 - progress)
    return LR


def _schedule(name: str, model: torch.nn.Module) -> tuple[torch.optim.Optimizer, object]:
    optimizer = build_optimizer(model, LR, 0.1)
    settings = ScheduleSettings(name, LR, WARMUP, TOTAL, min_lr=MIN_LR, decay_steps=DECAY)
    return optimizer, build_scheduler(optimizer, settings)


@pytest.mark.parametrize("name", ["cosine", "linear", "constant", "wsd"])
def test_each_schedule_follows_its_formula_and_resumes_exactly(name: str) -> None:
    """Every step's rate equals the formula; a scheduler rebuilt at step 25 from the state a
    checkpoint keeps (``state_dict`` through JSON) gives the same rates to the end."""
    model = torch.nn.Linear(4, 4)
    optimizer, scheduler = _schedule(name, model)
    rates, saved = [], {}
    for step in range(TOTAL + 2):
        rates.append(optimizer.param_groups[0]["lr"])
        assert rates[-1] == pytest.approx(_reference(name, step), abs=1e-12), step
        if step == 25:
            saved = json.loads(json.dumps(scheduler.state_dict()))
        optimizer.step()
        scheduler.step()
    resumed_optimizer, resumed = _schedule(name, model)
    resumed.load_state_dict(saved)
    resumed_optimizer.param_groups[0]["lr"] = resumed.get_last_lr()[0]  # as the optimizer's
    for step in range(26, TOTAL + 2):  # state restores it
        resumed_optimizer.step()
        resumed.step()
        assert resumed_optimizer.param_groups[0]["lr"] == rates[step], step
