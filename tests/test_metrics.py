"""metrics/peaks.py units that need no process group: the CPU matmul peak used for MFU."""

from __future__ import annotations

import math

import torch

from torchrun_ddp.metrics.peaks import gpu_peak_flops, measure_cpu_peak_flops


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


def test_gpu_peaks_are_looked_up_by_exact_device_name() -> None:
    assert gpu_peak_flops("NVIDIA H100 80GB HBM3") == (
        989e12,
        "data-sheet dense bf16 peak of NVIDIA H100 80GB HBM3",
    )
    assert gpu_peak_flops("NVIDIA H100 PCIe")[0] == 756e12, "not the SXM figure"
    assert gpu_peak_flops("NVIDIA H100 NVL")[0] == 835e12
    assert gpu_peak_flops("NVIDIA A100-SXM4-40GB")[0] == gpu_peak_flops("NVIDIA A100 80GB PCIe")[0]
    peak, why = gpu_peak_flops("NVIDIA H100 prototype")
    assert peak == 0.0 and "MFU not reported" in why
