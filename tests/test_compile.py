"""torch.compile under DDP on real gloo ranks: same training as eager, identical ranks, the comm
hook still runs, and checkpoints and final_model load into an uncompiled model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from distributed_harness import run_distributed
from tiny_models import tiny_llama_config
from transformers import LlamaForCausalLM

from torchrun_ddp.checkpoint import ModelAndOptimizer, load_checkpoint, save_checkpoint
from torchrun_ddp.compression import CompressionSettings, register_compression
from torchrun_ddp.main import forward_backward
from torchrun_ddp.model import build_model, compile_model
from torchrun_ddp.optim import build_optimizer
from torchrun_ddp.parallel.ddp import wrap_ddp

pytestmark = pytest.mark.slow  # torch.compile on 2 spawned ranks

CPU = torch.device("cpu")
STEPS, BATCH, SEQ, VOCAB = 3, 4, 16, 128
Params = dict[str, torch.Tensor]


def _params(model: torch.nn.Module) -> Params:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _train(rank: int, world_size: int, compile_it: bool, seed: int = 0) -> dict[str, object]:
    """Train STEPS steps in DDP with the 'none' hook; return the pieces and the bytes sent."""
    model = build_model("tiny", tiny_llama_config(VOCAB), "random", "fp32", seed, CPU)
    ddp = wrap_ddp(model, CPU)
    hook = register_compression(ddp, CompressionSettings(method="none"))
    compiled = compile_model(ddp) if compile_it else False
    optimizer = build_optimizer(model, 1e-2, 0.1)
    data = torch.randint(0, VOCAB, (STEPS, world_size, BATCH, SEQ), generator=torch.Generator())
    sent = 0
    for step in range(STEPS):
        forward_backward(ddp, list(data[step, rank].chunk(2)))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sent += hook.pop_step_bytes()[0]
    return {"ddp": ddp, "model": model, "optimizer": optimizer, "compiled": compiled, "sent": sent}


def _worker(rank: int, world_size: int, root: str) -> dict[str, object]:
    torch.manual_seed(7)  # same data on every run of _train below
    compiled = _train(rank, world_size, compile_it=True)
    torch.manual_seed(7)
    eager = _train(rank, world_size, compile_it=False)
    path = save_checkpoint(
        Path(root), STEPS, {"train": ModelAndOptimizer(compiled["ddp"], compiled["optimizer"])},
        {}, {}, keep=1,
    )  # fmt: skip
    if rank == 0:
        compiled["model"].save_pretrained(Path(root) / "final_model")
    dist.barrier()
    fresh = _train(rank, world_size, compile_it=False, seed=1)  # other weights, then load
    load_checkpoint(path, {"train": ModelAndOptimizer(fresh["ddp"], fresh["optimizer"])})
    return {
        "compiled": compiled["compiled"],
        "sent": compiled["sent"],
        "keys": sorted(compiled["model"].state_dict()),
        "params": _params(compiled["model"]),
        "eager": _params(eager["model"]),
        "loaded": _params(fresh["model"]),
    }


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, object]]]:
    root = tmp_path_factory.mktemp("compiled")
    return root, run_distributed(_worker, 2, str(root), timeout=900)


def _assert_close(a: Params, b: Params, atol: float) -> None:
    assert a.keys() == b.keys()
    for name, value in a.items():
        torch.testing.assert_close(value, b[name], atol=atol, rtol=0.0, msg=name)


def test_compiled_ddp_trains_like_eager_with_identical_ranks(ranks: tuple) -> None:
    _, results = ranks
    assert all(r["compiled"] for r in results)
    assert all(r["sent"] > 0 for r in results), "the comm hook ran under compile"
    _assert_close(results[0]["params"], results[1]["params"], atol=0.0)
    _assert_close(results[0]["params"], results[0]["eager"], atol=1e-4)


def test_compiled_checkpoint_and_final_model_load_uncompiled(ranks: tuple) -> None:
    root, results = ranks
    assert not any("_orig_mod" in key for key in results[0]["keys"])
    _assert_close(results[0]["loaded"], results[0]["params"], atol=0.0)
    final = LlamaForCausalLM.from_pretrained(root / "final_model")
    _assert_close(_params(final), results[0]["params"], atol=0.0)
