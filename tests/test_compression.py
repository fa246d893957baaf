"""Gradient-compression DDP hooks, checked on real gloo process groups (CPU, no mocks).

All distributed checks share one two-rank run (a module-scoped fixture): every spawned process
pays for torch's lazy distributed imports on its first DDP construction, so one spawn is much
cheaper than several. The run has three parts:
- exact: a fixed model and no optimizer step, so each test can compare what DDP applied with the
  exact mean of the ranks' local gradients at every step (the first step runs with DDP's initial
  single bucket, later steps with the rebuilt multi-bucket layout);
- train: 20 SGD steps per method on a model that DDP splits into several buckets;
- resume: train, checkpoint the compression state through safetensors and torch.save, restore
  into a fresh DDP model (again starting with the initial bucket layout), continue, and compare
  with an uninterrupted run.
"""

import io
import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from distributed_harness import run_distributed
from safetensors.torch import load_file, save_file
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from torchrun_ddp.compression import (
    METHODS,
    CompressionSettings,
    CompressionState,
    block_layout,
    compression_hook,
    dct_basis,
    dct_payload_bytes,
    index_dtype,
    keeps_residual,
    kept_coefficients,
    register_compression,
    topk_payload_bytes,
    validate_settings,
)

WORLD = 2
BLOCK = 16
BUCKET_MB = 0.004  # about 1000 fp32 values: DDP splits the test model into several buckets
EXACT_STEPS = 4
TRAIN_STEPS = 20
RESUME_AT = 4
RESUME_TOTAL = 9
LR = 0.05

Result = dict[str, object]


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(20, 48), nn.Tanh(), nn.Linear(48, 48), nn.Tanh(), nn.Linear(48, 5)
    )


N_PARAMS = len(list(_model().parameters()))
DENSE_BYTES = sum(p.numel() for p in _model().parameters()) * 4
N_BLOCKS = sum(math.ceil(p.numel() / BLOCK) for p in _model().parameters())


def _loss(model: nn.Module, rank: int, step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * rank + step)
    x, y = torch.randn(8, 20, generator=gen), torch.randn(8, 5, generator=gen)
    return nn.functional.mse_loss(model(x), y)


def _copy(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t.detach().clone() for t in tensors]


def _ddp(settings: CompressionSettings) -> tuple[DistributedDataParallel, CompressionState]:
    ddp = DistributedDataParallel(_model(), bucket_cap_mb=BUCKET_MB)
    return ddp, register_compression(ddp, settings)


def _train_steps(
    ddp: DistributedDataParallel, rank: int, steps: range, state: CompressionState
) -> list[tuple[int, int]]:
    """SGD steps; returns (wire, dense) bytes of every step (at 2 ranks, wire bytes equal the
    bytes handed to collectives; tests/test_compression_scale.py checks 3 and 4 ranks)."""
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    counts = []
    for step in steps:
        opt.zero_grad(set_to_none=True)
        _loss(ddp, rank, step).backward()
        opt.step()
        counts.append(tuple(state.pop_step_bytes())[:2])
    return counts


# -------------------------------------------------------------------------------------------------
# worker side

EXACT_CASES = {
    "dct_full": CompressionSettings("dct", ratio=1.0, block_size=BLOCK, error_feedback=False),
    "dct_half": CompressionSettings("dct", ratio=0.5, block_size=BLOCK, error_feedback=False),
    "dct_low": CompressionSettings("dct", ratio=0.25, block_size=BLOCK, error_feedback=False),
    "dct_bf16": CompressionSettings(
        "dct", ratio=0.25, block_size=BLOCK, error_feedback=False, topk_value_dtype="bfloat16"
    ),
    "topk_full": CompressionSettings(
        "dct-topk", topk=BLOCK, block_size=BLOCK, error_feedback=False
    ),
    "topk_small": CompressionSettings("dct-topk", topk=3, block_size=BLOCK, error_feedback=False),
    "dct_low_ef": CompressionSettings("dct", ratio=0.25, block_size=BLOCK),
    "dct_ef": CompressionSettings("dct", ratio=0.25, block_size=BLOCK, selection="rotating"),
    "dct_ef_bf16": CompressionSettings(
        "dct", ratio=0.25, block_size=BLOCK, topk_value_dtype="bfloat16", selection="rotating"
    ),
    "topk_ef": CompressionSettings("dct-topk", topk=2, block_size=BLOCK),
    "topk_ef_bf16": CompressionSettings(
        "dct-topk", topk=2, block_size=BLOCK, topk_value_dtype="bfloat16"
    ),
    "none": CompressionSettings("none"),
}

TRAIN_CASES = {
    "none": CompressionSettings("none"),
    "dct": CompressionSettings("dct", ratio=0.5, block_size=BLOCK),
    "dct_quarter": CompressionSettings("dct", ratio=0.25, block_size=BLOCK),
    "dct_rotating": CompressionSettings(
        "dct", ratio=0.25, block_size=BLOCK, selection="rotating", topk_value_dtype="bfloat16"
    ),
    "dct-topk": CompressionSettings("dct-topk", topk=4, block_size=BLOCK, start_step=2),
    "fp16": CompressionSettings("fp16"),
    "bf16": CompressionSettings("bf16"),
    "bf16_gather": CompressionSettings("bf16"),
    "powersgd": CompressionSettings("powersgd", powersgd_rank=2),
}

RESUME_CASES = {
    "dct": CompressionSettings("dct", ratio=0.25, block_size=BLOCK),
    "dct-rotating": CompressionSettings("dct", ratio=0.25, block_size=BLOCK, selection="rotating"),
    "dct-rotating-bf16": CompressionSettings(
        "dct", ratio=0.25, block_size=BLOCK, topk_value_dtype="bfloat16", selection="rotating"
    ),
    "dct-topk": CompressionSettings("dct-topk", topk=3, block_size=BLOCK),
    "powersgd": CompressionSettings("powersgd", powersgd_rank=2),
}

SEEN_BUCKETS: set[int] = set()


def _exact_case(settings: CompressionSettings, rank: int) -> Result:
    """Backward only (parameters fixed); record what DDP applied and the final residuals."""
    ddp, state = _ddp(settings)
    grads, counts = [], []
    for step in range(EXACT_STEPS):
        ddp.zero_grad(set_to_none=True)
        _loss(ddp, rank, step).backward()
        grads.append(_copy([p.grad for p in ddp.parameters()]))
        counts.append(tuple(state.pop_step_bytes())[:2])
    saved = state.state_dict()
    residuals = [saved.get(f"residual.{i}", torch.zeros(0)) for i in range(N_PARAMS)]
    return {
        "grads": grads,
        "bytes": counts,
        "residuals": residuals,
        "calls": state.hook_calls,
        "keys": sorted(saved),
    }


def _exact_part(rank: int) -> Result:
    reference = _model()
    params = list(reference.parameters())
    local = [
        _copy(list(torch.autograd.grad(_loss(reference, rank, step), params)))
        for step in range(EXACT_STEPS)
    ]
    out: Result = {"local": local}
    for name, settings in EXACT_CASES.items():
        out[name] = _exact_case(settings, rank)
    return out


def _counting_hook(
    state: CompressionState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    SEEN_BUCKETS.add(bucket.index())
    return compression_hook(state, bucket)


def _train_case(name: str, rank: int) -> Result:
    ddp = DistributedDataParallel(_model(), bucket_cap_mb=BUCKET_MB)
    state = CompressionState(TRAIN_CASES[name], ddp.parameters())
    if name == "bf16_gather":
        state.bf16_transport = "all_gather"
    ddp.register_comm_hook(state, _counting_hook)
    SEEN_BUCKETS.clear()
    counts = _train_steps(ddp, rank, range(TRAIN_STEPS), state)
    with torch.no_grad():
        losses = [float(_loss(ddp.module, rank, step)) for step in range(TRAIN_STEPS)]
        initial = [float(_loss(_model(), rank, step)) for step in range(TRAIN_STEPS)]
    return {
        "params": _copy(list(ddp.parameters())),
        "bytes": counts,
        "loss_drop": sum(initial) - sum(losses),
        "calls": state.hook_calls,
        "buckets": len(SEEN_BUCKETS),
        "step": state.step,
    }


def _train_part(rank: int) -> Result:
    probe = DistributedDataParallel(_model(), bucket_cap_mb=BUCKET_MB)
    bf16 = register_compression(probe, CompressionSettings("bf16"))
    out: Result = {"bf16_transport": bf16.bf16_transport}
    for name in TRAIN_CASES:
        out[name] = _train_case(name, rank)
    return out


def _through_files(saved: dict[str, torch.Tensor], path: Path) -> tuple[dict, dict]:
    save_file(saved, str(path))
    buffer = io.BytesIO()
    torch.save(saved, buffer)
    buffer.seek(0)
    return load_file(str(path)), torch.load(buffer, weights_only=True)


def _resume_case(name: str, rank: int, tmp: Path) -> Result:
    settings = RESUME_CASES[name]
    whole, whole_state = _ddp(settings)
    _train_steps(whole, rank, range(RESUME_TOTAL), whole_state)
    first, state = _ddp(settings)
    _train_steps(first, rank, range(RESUME_AT), state)
    saved = state.state_dict()
    from_safetensors, from_torch = _through_files(saved, tmp / f"{name}-{rank}.safetensors")
    second, restored = _ddp(settings)
    second.module.load_state_dict(first.module.state_dict())
    restored.load_state_dict(from_safetensors)
    reloaded = restored.state_dict()
    _train_steps(second, rank, range(RESUME_AT, RESUME_TOTAL), restored)
    return {
        "keys": sorted(saved),
        "reloaded_equal": sorted(reloaded) == sorted(saved)
        and all(torch.equal(saved[k], reloaded[k]) for k in saved),
        "torch_load_equal": all(torch.equal(saved[k], from_torch[k]) for k in saved),
        "whole": _copy(list(whole.parameters())),
        "resumed": _copy(list(second.parameters())),
        "step": restored.step,
    }


def _worker(rank: int, world_size: int, tmp: str) -> Result:
    return {
        "exact": _exact_part(rank),
        "train": _train_part(rank),
        "resume": {name: _resume_case(name, rank, Path(tmp)) for name in RESUME_CASES},
    }


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[Result]:
    return run_distributed(_worker, WORLD, str(tmp_path_factory.mktemp("compression")))


# -------------------------------------------------------------------------------------------------
# exactness


def _exact(ranks: list[Result], name: str, rank: int = 0) -> Result:
    return ranks[rank]["exact"][name]


def _true_means(ranks: list[Result]) -> list[list[torch.Tensor]]:
    local = [r["exact"]["local"] for r in ranks]
    return [
        [torch.stack([local[r][t][i] for r in range(WORLD)]).mean(0) for i in range(N_PARAMS)]
        for t in range(EXACT_STEPS)
    ]


def _project(mean: torch.Tensor, kept: int) -> torch.Tensor:
    """Reference: per-parameter zero-padded blocks, keep the ``kept`` lowest frequencies."""
    basis = dct_basis(BLOCK, dtype=torch.float64)
    flat = mean.reshape(-1).double()
    padded = torch.zeros(math.ceil(flat.numel() / BLOCK) * BLOCK, dtype=torch.float64)
    padded[: flat.numel()] = flat
    coeffs = padded.view(-1, BLOCK) @ basis.T
    coeffs[:, kept:] = 0.0
    return (coeffs @ basis).reshape(-1)[: flat.numel()].reshape(mean.shape).float()


def _assert_same_on_ranks(ranks: list[Result], name: str) -> None:
    for a, b in zip(_exact(ranks, name, 0)["grads"], _exact(ranks, name, 1)["grads"], strict=True):
        for x, y in zip(a, b, strict=True):
            assert torch.equal(x, y)


@pytest.mark.parametrize("name", ["dct_full", "topk_full", "none"])
def test_full_rank_compression_equals_exact_mean(ranks: list[Result], name: str) -> None:
    means = _true_means(ranks)
    _assert_same_on_ranks(ranks, name)
    for step, grads in enumerate(_exact(ranks, name)["grads"]):
        for got, want in zip(grads, means[step], strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["dct_low", "dct_half"])
def test_dct_equals_projection_of_exact_mean(ranks: list[Result], name: str) -> None:
    kept = kept_coefficients(EXACT_CASES[name])
    means = _true_means(ranks)
    _assert_same_on_ranks(ranks, name)
    for step, grads in enumerate(_exact(ranks, name)["grads"]):
        for got, want in zip(grads, means[step], strict=True):
            torch.testing.assert_close(got, _project(want, kept), rtol=1e-5, atol=1e-6)
            if step == 0:
                assert not torch.allclose(got, want, atol=1e-4), "projection should lose detail"


@pytest.mark.parametrize("name", ["dct_ef", "dct_ef_bf16", "topk_ef", "topk_ef_bf16"])
def test_error_feedback_conserves_the_gradient_sum(ranks: list[Result], name: str) -> None:
    """sum_t applied_t + mean_r e_T^r == sum_t mean_r g_t^r, with e_0 = 0.

    Rank r sends s_t^r and keeps e_t^r = g_t^r + e_{t-1}^r - s_t^r; DDP applies mean_r s_t^r.
    Summing over t and averaging over r gives the identity exactly in real arithmetic. The steps
    span DDP's bucket rebuild after step 0, so residuals must survive the layout change. The
    rotating ``dct`` with bfloat16 values all-reduces in bfloat16: the rounding of the sum itself
    is nobody's residual, so that case holds to bfloat16 precision only.
    """
    bf16_sum = name == "dct_ef_bf16"
    means = _true_means(ranks)
    _assert_same_on_ranks(ranks, name)
    applied = _exact(ranks, name)["grads"]
    for i in range(N_PARAMS):
        true_sum = sum(means[t][i] for t in range(EXACT_STEPS))
        applied_sum = sum(applied[t][i] for t in range(EXACT_STEPS))
        residuals = [_exact(ranks, name, r)["residuals"][i] for r in range(WORLD)]
        residual = torch.stack(residuals).mean(0).reshape(true_sum.shape)
        atol = 8e-3 * float(true_sum.abs().max()) if bf16_sum else 2e-6
        torch.testing.assert_close(applied_sum + residual, true_sum, rtol=0, atol=atol)
        assert residual.abs().max() > 1e-4, "compression too weak for the test to mean anything"


def test_low_pass_dct_keeps_no_residual(ranks: list[Result]) -> None:
    """Low-pass ``dct`` with error feedback on stores nothing and applies exactly what it applies
    with error feedback off: its residual would lie outside the kept set and never be sent."""
    assert _exact(ranks, "dct_low_ef")["keys"] == ["step"]
    assert any(key.startswith("residual.") for key in _exact(ranks, "dct_ef")["keys"])
    for with_ef, without in zip(
        _exact(ranks, "dct_low_ef")["grads"], _exact(ranks, "dct_low")["grads"], strict=True
    ):
        for a, b in zip(with_ef, without, strict=True):
            assert torch.equal(a, b)


def test_dct_bf16_is_the_projection_up_to_rounding(ranks: list[Result]) -> None:
    """16-bit ``dct``: bit-identical on all ranks, the low-pass projection of the exact mean up
    to bfloat16 rounding of each rank's coefficients, and not equal to the fp32 result."""
    kept = kept_coefficients(EXACT_CASES["dct_bf16"])
    means = _true_means(ranks)
    _assert_same_on_ranks(ranks, "dct_bf16")
    fp32 = _exact(ranks, "dct_low")["grads"]
    for step, grads in enumerate(_exact(ranks, "dct_bf16")["grads"]):
        for got, want in zip(grads, means[step], strict=True):
            scale = float(want.abs().max()) + 1e-12
            torch.testing.assert_close(got, _project(want, kept), rtol=0, atol=2e-2 * scale)
        assert any(not torch.equal(a, b) for a, b in zip(grads, fp32[step], strict=True))
    for rank in range(WORLD):
        sent = dct_payload_bytes(N_BLOCKS, kept, torch.bfloat16)
        assert sent == N_BLOCKS * kept * 2
        assert _exact(ranks, "dct_bf16", rank)["bytes"] == [(sent, DENSE_BYTES)] * EXACT_STEPS


def test_byte_counts_match_formulas(ranks: list[Result]) -> None:
    topk = topk_payload_bytes(N_BLOCKS, 3, BLOCK, torch.float32)
    assert topk == N_BLOCKS * 3 * (4 + 1)  # fp32 value + uint8 index per coefficient
    for rank in range(WORLD):
        assert _exact(ranks, "none", rank)["bytes"] == [(DENSE_BYTES, DENSE_BYTES)] * EXACT_STEPS
        for name in ("dct_full", "dct_half", "dct_low"):
            sent = N_BLOCKS * kept_coefficients(EXACT_CASES[name]) * 4
            assert sent == dct_payload_bytes(N_BLOCKS, kept_coefficients(EXACT_CASES[name]))
            assert _exact(ranks, name, rank)["bytes"] == [(sent, DENSE_BYTES)] * EXACT_STEPS
        assert _exact(ranks, "topk_small", rank)["bytes"] == [(topk, DENSE_BYTES)] * EXACT_STEPS
        bf16 = N_BLOCKS * 2 * (2 + 1)  # bf16 value + uint8 index
        assert _exact(ranks, "topk_ef_bf16", rank)["bytes"] == [(bf16, DENSE_BYTES)] * EXACT_STEPS
    sizes = [_exact(ranks, n)["bytes"][-1][0] for n in ("dct_full", "dct_half", "dct_low")]
    assert sizes[0] > sizes[1] > sizes[2]
    hooked = [name for name in EXACT_CASES if name != "none"]
    assert all(_exact(ranks, name)["calls"] > EXACT_STEPS for name in hooked)
    assert _exact(ranks, "none")["calls"] == 0, "none: DDP's built-in all-reduce, no hook"


# -------------------------------------------------------------------------------------------------
# training


@pytest.mark.parametrize("name", list(TRAIN_CASES))
def test_training_keeps_ranks_identical(ranks: list[Result], name: str) -> None:
    first, second = ranks[0]["train"][name], ranks[1]["train"][name]
    assert first["buckets"] >= 2, "the test model must span several DDP buckets"
    assert first["calls"] > TRAIN_STEPS
    assert first["step"] == TRAIN_STEPS
    for a, b in zip(first["params"], second["params"], strict=True):
        assert torch.isfinite(a).all()
        assert torch.equal(a, b)
    assert first["loss_drop"] > 0


def test_training_bytes_per_method(ranks: list[Result]) -> None:
    train = ranks[0]["train"]
    last = {name: train[name]["bytes"][-1] for name in TRAIN_CASES}
    assert all(dense == DENSE_BYTES for _, dense in last.values())
    assert last["none"][0] == DENSE_BYTES
    for name in ("fp16", "bf16", "bf16_gather"):
        assert last[name][0] * 2 == DENSE_BYTES
    assert DENSE_BYTES > last["dct"][0] > last["dct_quarter"][0]
    assert last["dct_rotating"][0] * 2 == last["dct_quarter"][0]  # bf16 values, same ratio
    assert last["dct-topk"][0] < DENSE_BYTES
    assert last["powersgd"][0] < DENSE_BYTES
    assert train["dct-topk"]["bytes"][1] == (DENSE_BYTES, DENSE_BYTES)  # start_step=2 warm-up
    assert train["powersgd"]["bytes"][1] == (DENSE_BYTES, DENSE_BYTES)  # PowerSGD starts at 2


def test_bf16_transports_agree(ranks: list[Result]) -> None:
    """gloo in this torch reduces bfloat16 natively; the all-gather fallback gives the same."""
    train = ranks[0]["train"]
    assert train["bf16_transport"] == "all_reduce"
    pairs = zip(train["bf16"]["params"], train["bf16_gather"]["params"], strict=True)
    for native, gathered in pairs:
        torch.testing.assert_close(native, gathered, rtol=0, atol=1e-3)


# -------------------------------------------------------------------------------------------------
# checkpoints


@pytest.mark.parametrize("name", list(RESUME_CASES))
def test_state_dict_round_trip(ranks: list[Result], name: str) -> None:
    result = ranks[0]["resume"][name]
    assert "step" in result["keys"]
    prefix = "powersgd.error." if name == "powersgd" else "residual."
    has_residual = any(key.startswith(prefix) for key in result["keys"])
    assert has_residual == keeps_residual(RESUME_CASES[name]) or name == "powersgd"
    assert has_residual or name == "dct"
    assert result["reloaded_equal"]
    assert result["torch_load_equal"]
    assert result["step"] == RESUME_TOTAL


@pytest.mark.parametrize("name", list(RESUME_CASES))
def test_resume_matches_uninterrupted_training(ranks: list[Result], name: str) -> None:
    for rank in range(WORLD):
        result = ranks[rank]["resume"][name]
        for whole, resumed in zip(result["whole"], result["resumed"], strict=True):
            torch.testing.assert_close(resumed, whole, rtol=1e-5, atol=1e-6)


# -------------------------------------------------------------------------------------------------
# single process


def test_dct_basis_is_orthonormal_and_cached() -> None:
    for size in (2, 16, 64, 100):
        basis = dct_basis(size)
        assert basis.shape == (size, size)
        assert basis.dtype == torch.float32
        torch.testing.assert_close(basis @ basis.T, torch.eye(size), atol=1e-6, rtol=0)
    assert dct_basis(64) is dct_basis(64, torch.device("cpu"))
    assert dct_basis(64, dtype=torch.float64).dtype == torch.float64


def test_dct_basis_matches_definition() -> None:
    size = 8
    n = torch.arange(size, dtype=torch.float64)
    row3 = math.sqrt(2 / size) * torch.cos(math.pi * (2 * n + 1) * 3 / (2 * size))
    basis = dct_basis(size, dtype=torch.float64)
    torch.testing.assert_close(basis[3], row3)
    torch.testing.assert_close(basis[0], torch.full((size,), size**-0.5, dtype=torch.float64))


def test_dct_round_trip() -> None:
    """Forward then inverse transform in fp32: error within 1e-6 (plus 1e-6 relative)."""
    blocks = torch.randn(300, 64, generator=torch.Generator().manual_seed(0))
    basis = dct_basis(64)
    torch.testing.assert_close((blocks @ basis.T) @ basis, blocks, atol=1e-6, rtol=1e-6)


def test_block_layout_pads_each_parameter_separately() -> None:
    layout = block_layout([0, 5, 21], numel=24, block_size=8)
    assert layout.n_blocks == 1 + 2 + 1
    flat = torch.arange(1.0, 25.0)
    blocks = layout.to_blocks(flat)
    assert blocks[0].tolist() == [1, 2, 3, 4, 5, 0, 0, 0]
    assert blocks[2].tolist() == [14, 15, 16, 17, 18, 19, 20, 21]
    assert blocks[3].tolist() == [22, 23, 24, 0, 0, 0, 0, 0]
    torch.testing.assert_close(layout.from_blocks(blocks), flat)
    aligned = block_layout([0, 8], numel=24, block_size=8)
    assert aligned.positions is None
    assert aligned.n_blocks == 3


def test_index_dtypes() -> None:
    assert index_dtype(256) == torch.uint8
    assert index_dtype(257) == torch.int16
    assert index_dtype(32768) == torch.int16
    assert index_dtype(40000) == torch.int32


def test_every_method_has_valid_defaults() -> None:
    assert METHODS == ("none", "dct", "dct-topk", "fp16", "bf16", "powersgd")
    for method in METHODS:
        validate_settings(CompressionSettings(method))


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"ratio": 0.0}, "ratio"),
        ({"ratio": 1.5}, "ratio"),
        ({"method": "zip"}, "method"),
        ({"block_size": 1}, "block_size"),
        ({"topk": 65}, "topk"),
        ({"topk": 0}, "topk"),
        ({"start_step": -1}, "start_step"),
        ({"powersgd_rank": 0}, "powersgd_rank"),
        ({"topk_value_dtype": "int8"}, "topk_value_dtype"),
    ],
)
def test_bad_settings_raise_one_line(change: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=field) as info:
        validate_settings(CompressionSettings(**change))
    assert "\n" not in str(info.value)


def test_register_validates_first() -> None:
    """register_compression rejects bad settings before it needs a process group or model."""
    model = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="unknown compression method"):
        register_compression(model, CompressionSettings("lz4"))  # type: ignore[arg-type]


def _step_bytes_worker(rank: int, world_size: int) -> list[tuple[int, int, int]]:
    """DDP's built-in all-reduce of a 20-parameter layer counted analytically, plus a counted
    all-reduce of 400 bytes, over two steps."""
    layer = nn.Linear(4, 4)
    state = CompressionState(CompressionSettings(method="none"), layer.parameters())
    state.count_builtin_all_reduce(layer.parameters())
    state.count("all_reduce", 400, None)
    return [tuple(state.pop_step_bytes()), tuple(state.pop_step_bytes())]


def test_a_step_counts_builtin_and_counted_bytes_once() -> None:
    """Across fault-tolerant sites the site's own all-reduce is counted analytically and the
    exchange across sites on top (``pop_step_bytes``): the sum in the step that sent them, and
    only the analytic count in the next (2 ranks: a ring all-reduce sends its input size)."""
    first, second = run_distributed(_step_bytes_worker, WORLD)[0]
    builtin = (80, 80, 80)  # 20 fp32 values
    assert second == builtin
    assert first == (80 + 400, 80, 80 + 400)
