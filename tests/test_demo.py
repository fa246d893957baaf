"""DeMo (optim/demo.py): its algebra, rank agreement, exact resume and payload bytes.

The distributed checks share one two-rank gloo run (a module-scoped fixture, one spawn): DeMo
with full top-k and no sign against torch's SGD on the mean gradient, the transmitted-plus-kept
identity of the momentum, 20 steps of a small DDP model (gradient accumulation through
``no_sync``, the local-gradient comm hook) with ranks compared bit for bit, and a checkpoint
round trip through ``checkpoint.save_checkpoint`` / ``load_checkpoint`` resumed bit-exactly.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from distributed_harness import run_distributed
from tiny_models import (
    accumulate_local_batches,
    flat_parameters,
    random_gradients,
    random_parameters,
    small_mlp,
)
from torch.nn.parallel import DistributedDataParallel

from torchrun_ddp.checkpoint import ModelAndOptimizer, load_checkpoint, save_checkpoint
from torchrun_ddp.compression import (
    CompressionState,
    demo_payload_bytes,
    register_local_gradients,
    tile_shape,
    wire_bytes,
)
from torchrun_ddp.optim import (
    DeMo,
    DemoSettings,
    LocalMomentum,
    parameter_groups,
)
from torchrun_ddp.optim.demo import tile_codec
from torchrun_ddp.plan.architecture import llama2_7b_config
from torchrun_ddp.plan.settings import PlanSettings
from torchrun_ddp.planning import plan_memory

WORLD = 2
SHAPES = [(24, 40), (130,), (7,)]
"""Parameters of the algebra checks: tiles 24 x 40, a 65-chunked vector, a prime-length one."""
STEPS = 20
RESUME_AT = 10
MODEL_NUMEL = 16 * 96 + 96 + 96 * 4 + 4
"""Parameters of ``small_mlp``."""


def _params(seed: int) -> list[torch.nn.Parameter]:
    return random_parameters(SHAPES, seed)


def _grads(step: int, rank: int) -> list[torch.Tensor]:
    return random_gradients(SHAPES, step, rank)


def _full_topk_equals_sgd(rank: int) -> float:
    """Max |DeMo - SGD| over 3 steps: DeMo at lr 0.1 with every coefficient sent in fp32 and no
    sign step against torch's SGD at lr 0.1 ** 2 fed the mean of the ranks' gradients (the
    momentum holds lr * g, and the step multiplies by lr again)."""
    settings = DemoSettings(beta=0.9, topk=64 * 64, value_dtype="float32", sign=False)
    demo_params, sgd_params = _params(0), _params(0)
    demo = DeMo(demo_params, lr=0.1, settings=settings)
    sgd = torch.optim.SGD(sgd_params, lr=0.1**2)
    for step in range(3):
        for param, grad in zip(demo_params, _grads(step, rank), strict=True):
            param.grad = grad
        every_rank = [_grads(step, r) for r in range(WORLD)]
        for index, param in enumerate(sgd_params):
            param.grad = torch.stack([grads[index] for grads in every_rank]).mean(0)
        demo.step()
        sgd.step()
    pairs = zip(demo_params, sgd_params, strict=True)
    return max(float((a.detach() - b.detach()).abs().max()) for a, b in pairs)


def _transmitted_plus_kept(rank: int) -> dict[str, float]:
    """One DeMo step after a first one: the part sent (momentum before minus momentum kept) is
    exactly the bf16-rounded top-k of every tile's DCT of ``beta * delta + lr * g``."""
    settings = DemoSettings(beta=0.9, topk=5)
    params = _params(1)
    demo = DeMo(params, lr=0.05, settings=settings)
    for step in range(2):
        kept = [demo.state[p]["delta"].clone() for p in params]
        grads = _grads(10 + step, rank)
        for param, grad in zip(params, grads, strict=True):
            param.grad = grad
        demo.step()
    errors = {"sent": 0.0, "sum": 0.0, "zeros": 0.0}
    for param, old, grad in zip(params, kept, grads, strict=True):
        codec = tile_codec(tuple(param.shape), settings)
        before = settings.beta * old + 0.05 * grad
        after = demo.state[param]["delta"]
        coeffs = codec.encode(before)
        positions = coeffs.abs().topk(codec.k, dim=1).indices
        rounded = coeffs.gather(1, positions).bfloat16().float()
        expected = torch.zeros_like(coeffs).scatter_(1, positions, rounded)
        scale = float(coeffs.abs().max())
        sent = codec.encode(before - after)
        errors["sent"] = max(errors["sent"], float((sent - expected).abs().max()) / scale)
        total = codec.decode(expected) + after
        errors["sum"] = max(errors["sum"], float((total - before).abs().max()) / scale)
        left = codec.encode(after).gather(1, positions) - (coeffs.gather(1, positions) - rounded)
        errors["zeros"] = max(errors["zeros"], float(left.abs().max()) / scale)
    return errors


Trained = tuple[DistributedDataParallel, DeMo, CompressionState]


def _train(trained: Trained, rank: int, steps: range) -> list[dict[str, object]]:
    """DeMo steps of 2 accumulated micro-batches (the first under ``no_sync``); this rank's own
    data. Returns the per-step byte counts."""
    ddp, demo, state = trained
    counts = []
    for step in steps:
        accumulate_local_batches(ddp, step, rank)
        demo.step()
        demo.zero_grad(set_to_none=True)
        counts.append(state.pop_step_bytes()._asdict())
    return counts


def _build(seed: int) -> Trained:
    ddp = DistributedDataParallel(small_mlp(seed))
    state = register_local_gradients(ddp)
    groups = parameter_groups(ddp.module, 0.1)
    demo = DeMo(groups, lr=0.01, settings=DemoSettings(topk=8), counter=state.count)
    return ddp, demo, state


def _momentum(demo: DeMo) -> torch.Tensor:
    return torch.cat([demo.state[p]["delta"].reshape(-1) for p in demo.codecs])


def _training(rank: int, root: str) -> dict[str, object]:
    """20 steps, a checkpoint at step 10, and a fresh model and optimizer (another init) that
    load it and redo steps 11-20."""
    trained = _build(seed=5)
    ddp, demo, _ = trained
    start = flat_parameters(ddp.module).clone()
    counts = _train(trained, rank, range(RESUME_AT))
    shared = {"train": ModelAndOptimizer(ddp, None)}
    per_rank = {"optimizer": LocalMomentum(demo).state_dict()}
    path = save_checkpoint(Path(root), RESUME_AT, shared, per_rank, {}, keep=1)
    counts += _train(trained, rank, range(RESUME_AT, STEPS))
    again = _build(seed=6)
    fresh, fresh_demo, _ = again
    saved = load_checkpoint(path, {"train": ModelAndOptimizer(fresh, None)})
    LocalMomentum(fresh_demo).load_state_dict(saved["optimizer"])
    _train(again, rank, range(RESUME_AT, STEPS))
    shapes = [tuple(p.shape) for p in ddp.module.parameters()]
    return {
        "start": start,
        "final": flat_parameters(ddp.module),
        "resumed": flat_parameters(fresh.module),
        "momentum": _momentum(demo),
        "resumed_momentum": _momentum(fresh_demo),
        "counts": counts,
        "payload": demo.payload_bytes(),
        "formula": demo_payload_bytes(shapes, 8, 64, torch.bfloat16),
    }


def _bf16_momentum(rank: int) -> dict[str, object]:
    """bf16 parameters: the momentum stays fp32 and survives a ``LocalMomentum`` round trip."""
    params = [torch.nn.Parameter(p.detach().bfloat16()) for p in _params(2)]
    demo = DeMo(params, lr=0.01, settings=DemoSettings(topk=4))
    for param, grad in zip(params, _grads(20, rank), strict=True):
        param.grad = grad.bfloat16()
    demo.step()
    fresh = DeMo([torch.nn.Parameter(p.detach().clone()) for p in params], lr=0.5)
    LocalMomentum(fresh).load_state_dict(LocalMomentum(demo).state_dict())
    return {
        "dtypes": {str(demo.state[p]["delta"].dtype) for p in params},
        "restored": torch.equal(_momentum(fresh), _momentum(demo)),
        "lr": fresh.param_groups[0]["lr"],
    }


def _worker(rank: int, world_size: int, root: str) -> dict[str, object]:
    assert world_size == WORLD and dist.get_world_size() == WORLD
    return {
        "bf16": _bf16_momentum(rank),
        "sgd_gap": _full_topk_equals_sgd(rank),
        "identity": _transmitted_plus_kept(rank),
        "training": _training(rank, root),
    }


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, object]]:
    return run_distributed(_worker, WORLD, str(tmp_path_factory.mktemp("demo")))


def test_full_topk_without_sign_is_sgd_on_the_mean_gradient(ranks: list[dict]) -> None:
    # Sending every coefficient empties the momentum each step, so beta has nothing to carry:
    # the update is lr * (lr * mean gradient), up to the fp32 round trip through the DCT.
    for result in ranks:
        assert result["sgd_gap"] < 1e-5


def test_transmitted_plus_kept_is_the_momentum(ranks: list[dict]) -> None:
    for result in ranks:
        identity = result["identity"]
        assert identity["sent"] < 1e-5, "the part sent is the rounded top-k of each tile"
        assert identity["sum"] < 1e-5, "sent + kept = beta * delta + lr * g"
        assert identity["zeros"] < 1e-5, "kept holds only the rounding error of what was sent"


def test_ranks_stay_identical_with_local_momentum(ranks: list[dict]) -> None:
    first, second = ranks[0]["training"], ranks[1]["training"]
    assert torch.equal(first["final"], second["final"]), "parameters bit-identical on all ranks"
    assert not torch.equal(first["final"], first["start"]), "training moved the parameters"
    assert not torch.equal(first["momentum"], second["momentum"]), "momentum is per rank"


def test_resume_is_bit_exact(ranks: list[dict]) -> None:
    for result in ranks:
        training = result["training"]
        assert torch.equal(training["resumed"], training["final"])
        assert torch.equal(training["resumed_momentum"], training["momentum"])


def test_momentum_is_fp32_for_bf16_parameters(ranks: list[dict]) -> None:
    for result in ranks:
        assert result["bf16"]["dtypes"] == {"torch.float32"}
        assert result["bf16"]["restored"] and result["bf16"]["lr"] == 0.01


def test_counted_bytes_match_the_payload_formula(ranks: list[dict]) -> None:
    for result in ranks:
        training = result["training"]
        assert training["payload"] == training["formula"]
        for counts in training["counts"]:
            assert counts["collective"] == training["formula"]
            assert counts["wire"] == round(wire_bytes("all_gather", training["formula"], WORLD))
            assert counts["dense"] == round(wire_bytes("all_reduce", 4 * MODEL_NUMEL, WORLD))


# -------------------------------------------------------------------------------------------------
# single process


def test_payload_bytes_formula() -> None:
    bf16 = torch.bfloat16
    # 64 x 64 tiles (4096 elements: int16 positions), 32 values of 2 bytes each per tile
    assert demo_payload_bytes([(4096, 4096)], 32, 64, bf16) == 64 * 64 * 32 * (2 + 2)
    assert demo_payload_bytes([(32000, 64)], 32, 64, bf16) == 500 * 32 * 4
    # 688 = 16 x 43: tiles 43 x 64 (int16); a 64-vector is one chunk with uint8 positions
    assert tile_shape((688, 256), 64) == (43, 64)
    assert demo_payload_bytes([(688, 256), (64,)], 32, 64, bf16) == 64 * 32 * 4 + 32 * 3
    # a prime length is one chunk of itself if short, and k is capped at the chunk
    assert demo_payload_bytes([(7,)], 32, 64, torch.float32) == 7 * (4 + 1)
    assert tile_shape((67,), 64) == (1,), "a prime above the limit: chunks of one"
    wire8 = wire_bytes("all_gather", demo_payload_bytes([(4096, 4096)], 32, 64, bf16), 8)
    dense8 = wire_bytes("all_reduce", 4 * 4096 * 4096, 8)
    assert dense8 / wire8 == pytest.approx(32.0), "k 32 of 4096, bf16 + int16: 32x at W = 8"


def test_tile_codec_round_trip_and_separable_dct() -> None:
    codec = tile_codec((128, 96), DemoSettings())
    assert codec.sides == (64, 48) and codec.n_tiles == 4 and codec.k == 32
    x = torch.randn(128, 96)
    coeffs = codec.encode(x)
    torch.testing.assert_close(codec.decode(coeffs), x, atol=1e-5, rtol=0)
    assert coeffs.shape == (4, 64 * 48)
    tile = x[64:, :48]  # tile (1, 0) in row-major order of the grid
    energy = float(coeffs[2].square().sum())
    assert energy == pytest.approx(float(tile.square().sum()), rel=1e-5), "orthonormal 2-D DCT"


def test_memory_plan_counts_one_momentum() -> None:
    config = llama2_7b_config()
    sizes = [4096 * 32000, 4096 * 4096]
    adamw = plan_memory(config, 6_738_415_616, PlanSettings(8, 4, 512, fused_adamw=True))
    demo = plan_memory(config, 6_738_415_616, PlanSettings(8, 4, 512, optimizer="demo"), sizes)
    assert demo.optimizer_state * 2 == adamw.optimizer_state == 8 * 6_738_415_616
    assert demo.optimizer_step_temporaries == 5 * 4 * 4096 * 32000
    assert "DeMo momentum" in demo.table() and math.isfinite(demo.total)
