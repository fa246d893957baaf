"""metrics.py units that need no process group: the CPU matmul peak used for MFU."""

from __future__ import annotations

import math

import torch

from torchrun_ddp.metrics import measure_cpu_peak_flops


def test_cpu_peak_leaves_the_global_rng_alone_and_is_finite() -> None:
    """The peak is measured before training starts on a seeded (or, at resume, restored) global
    RNG: drawing from it would shift dropout masks by an amount that depends on timing."""
    torch.manual_seed(7)
    expected = torch.rand(4)
    torch.manual_seed(7)
    for dtype in (torch.float32, torch.bfloat16):
        peak = measure_cpu_peak_flops(size=256, trials=1, dtype=dtype, budget_s=0.5)
        assert math.isfinite(peak) and peak > 0
    assert torch.equal(torch.rand(4), expected)
