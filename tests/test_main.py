"""Gradient averaging through the project's DDP set-up, against one process on the union batch."""

from __future__ import annotations

import copy

import pytest
import torch
from distributed_harness import run_distributed
from tiny_models import tiny_llama_config

from torchrun_ddp.compression import CompressionSettings, register_compression
from torchrun_ddp.distributed import DistEnv
from torchrun_ddp.errors import UserError
from torchrun_ddp.inputs import check_node_layout
from torchrun_ddp.main import forward_backward
from torchrun_ddp.model import build_model
from torchrun_ddp.optim import build_optimizer
from torchrun_ddp.parallel.ddp import wrap_ddp

CPU = torch.device("cpu")
BATCH, SEQ, VOCAB = 4, 16, 128


def _batches(world_size: int, steps: int) -> torch.Tensor:
    """Distinct data per rank and step: [steps, world_size, BATCH, SEQ] token ids."""
    generator = torch.Generator().manual_seed(1234)
    return torch.randint(0, VOCAB, (steps, world_size, BATCH, SEQ), generator=generator)


def _ddp_worker(rank: int, world_size: int, steps: int, accumulation: int) -> dict[str, object]:
    model = build_model("tiny", tiny_llama_config(VOCAB), "random", "fp32", 0, CPU)
    ddp = wrap_ddp(model, CPU)
    register_compression(ddp, CompressionSettings(method="none"))
    optimizer = build_optimizer(model, 1e-2, 0.1)
    data = _batches(world_size, steps)
    first_grads: dict[str, torch.Tensor] = {}
    for step in range(steps):
        micro = list(data[step, rank].chunk(accumulation))
        forward_backward(ddp, micro)
        if step == 0:
            first_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"grads": first_grads, "params": params}


def _single_process(world_size: int, steps: int) -> dict[str, object]:
    torch.manual_seed(0)
    model = build_model("tiny", tiny_llama_config(VOCAB), "random", "fp32", 0, CPU)
    reference = copy.deepcopy(model)
    optimizer = build_optimizer(reference, 1e-2, 0.1)
    data = _batches(world_size, steps)
    first_grads: dict[str, torch.Tensor] = {}
    for step in range(steps):
        union = data[step].reshape(world_size * BATCH, SEQ)
        reference(input_ids=union, labels=union).loss.backward()
        if step == 0:
            first_grads = {n: p.grad.clone() for n, p in reference.named_parameters()}
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    params = {n: p.detach().clone() for n, p in reference.named_parameters()}
    return {"grads": first_grads, "params": params}


def _assert_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float) -> None:
    assert a.keys() == b.keys()
    for name, value in a.items():
        torch.testing.assert_close(value, b[name], atol=atol, rtol=1e-4, msg=name)


@pytest.mark.slow  # trains 4 steps on 2 spawned ranks and in one process
def test_ddp_gradients_equal_single_process_on_union_batch() -> None:
    steps = 4
    ranks = run_distributed(_ddp_worker, 2, steps, 2)
    reference = _single_process(2, steps)
    _assert_close(ranks[0]["grads"], ranks[1]["grads"], atol=0.0)
    _assert_close(ranks[0]["grads"], reference["grads"], atol=1e-6)
    _assert_close(ranks[0]["params"], ranks[1]["params"], atol=0.0)
    _assert_close(ranks[0]["params"], reference["params"], atol=1e-5)
    changed = any(
        not torch.equal(ranks[0]["params"][n], p)
        for n, p in build_model(
            "tiny", tiny_llama_config(VOCAB), "random", "fp32", 0, CPU
        ).named_parameters()
    )
    assert changed, "the optimizer steps did not change the parameters"


def test_node_aware_scope_needs_equal_nodes_numbered_node_by_node() -> None:
    check_node_layout(DistEnv(rank=3, world_size=4, local_rank=1, local_world_size=2))
    with pytest.raises(UserError, match="not a multiple of LOCAL_WORLD_SIZE 2"):
        check_node_layout(DistEnv(rank=0, world_size=3, local_rank=0, local_world_size=2))
    with pytest.raises(UserError, match="numbered node by node"):
        check_node_layout(DistEnv(rank=1, world_size=4, local_rank=0, local_world_size=2))
