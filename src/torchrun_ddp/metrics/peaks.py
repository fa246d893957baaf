"""The device's peaks: the FLOP/s it can reach (a data-sheet table for GPUs, a short matmul
measurement on CPUs), which MFU divides by, and the memory this process has reached. Imports
torch only.
"""

from __future__ import annotations

import resource
import time

import torch

GPU_PEAK_FLOPS = {
    "NVIDIA H100 80GB HBM3": 989e12,
    "NVIDIA H100 PCIe": 756e12,
    "NVIDIA H100 NVL": 835e12,
    "NVIDIA H200": 989e12,
    "NVIDIA H200 NVL": 835e12,
    "NVIDIA A100-SXM4-80GB": 312e12,
    "NVIDIA A100-SXM4-40GB": 312e12,
    "NVIDIA A100 80GB PCIe": 312e12,
    "NVIDIA A100-PCIE-40GB": 312e12,
    "NVIDIA L40S": 362e12,
    "NVIDIA L4": 121e12,
    "NVIDIA A10": 125e12,
    "NVIDIA GeForce RTX 4090": 165e12,
}
"""Dense (no sparsity) bf16 tensor-core peak FLOP/s per GPU, keyed by the exact name
``torch.cuda.get_device_name`` reports: NVIDIA's data sheets for H100 (SXM 989, PCIe 756, NVL 835
TFLOP/s), H200 (SXM 989, NVL 835), A100 (312, SXM and PCIe), L40S, L4 and A10, and the Ada
Lovelace architecture whitepaper for the RTX 4090 (with fp32 accumulation). The sheets print the
2:4-sparse figure first; the dense one is half of it. A name not listed reports no MFU rather than
a guess (an "H100" substring would match PCIe and NVL parts to the SXM peak)."""


def gpu_peak_flops(name: str) -> tuple[float, str]:
    """The dense bf16 peak FLOP/s of the GPU called ``name`` (``GPU_PEAK_FLOPS``) and where the
    figure comes from; (0.0, reason) for a name not in the table."""
    peak = GPU_PEAK_FLOPS.get(name.strip())
    if peak is None:
        return 0.0, f"unknown GPU {name!r}: MFU not reported (no data-sheet peak for this name)"
    return peak, f"data-sheet dense bf16 peak of {name}"


def measure_cpu_peak_flops(
    size: int = 1024, trials: int = 12, dtype: torch.dtype = torch.float32, budget_s: float = 1.0
) -> float:
    """This process's matmul rate in FLOP/s on square matrices of ``dtype``, with the current
    ``torch.get_num_threads()``: the CPU's practical peak for MFU.

    Side 1024 with 12 trials reads within about 3% of side 2048 with 4 trials (about 0.6 s
    instead of 1.8 s per rank at start-up on one thread of this project's CPU, 2 ranks
    measuring at once; docs/benchmarks.md, "Test suite", has the command);
    ``benchmarks/throughput.py`` still times 2048.

    The matrices grow from 128 by doubling up to ``size`` while one product stays under
    ``budget_s`` seconds, so a CPU without native support for ``dtype`` (bf16 without
    avx512_bf16/AMX runs about 1,000x slower than fp32) measures in seconds, not minutes. The
    rate is the best of ``trials`` timings of two products each (fewer, but at least two, once
    they have taken ``2 * budget_s``), so a moment of contention (the other ranks starting up on
    the same cores) does not lower the peak and push MFU above 1.
    The matrices come from a private generator: the global RNG, which a resumed run restores,
    is not touched, whatever size the timing picks.
    """
    generator = torch.Generator().manual_seed(0)
    side = 128
    a, b = torch.randn(2, side, side, generator=generator).to(dtype)
    while side < size:
        start = time.perf_counter()
        a @ b  # also the warm-up of the size finally timed
        if (time.perf_counter() - start) * 8 > budget_s:  # the next size costs 8x
            break
        side *= 2
        a, b = torch.randn(2, side, side, generator=generator).to(dtype)
    a @ b  # warm-up
    best, spent = 0.0, 0.0
    for trial in range(trials):
        start = time.perf_counter()
        a @ b
        a @ b
        elapsed = time.perf_counter() - start
        best, spent = max(best, 4.0 * side**3 / elapsed), spent + elapsed
        if trial >= 1 and spent > 2 * budget_s:  # a slow dtype: two trials are enough
            break
    return best


def device_peak_flops(
    device: torch.device, dtype: torch.dtype = torch.float32
) -> tuple[float, str]:
    """Peak FLOP/s of one rank's device for matmuls in ``dtype``, and where the figure comes from.

    CUDA: the dense bf16 data-sheet table above by exact device name (``gpu_peak_flops``; 0 if
    unknown, so MFU is not reported); CPU: a short matmul measurement in ``dtype`` (bf16 for
    bf16-mixed and bf16 runs).
    """
    if device.type != "cuda":
        name = str(dtype).removeprefix("torch.")
        return measure_cpu_peak_flops(dtype=dtype), f"measured {name} matmul on this CPU"
    return gpu_peak_flops(torch.cuda.get_device_name(device))


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory of this process in bytes: CUDA max allocated, or peak RSS on CPU (Linux)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
