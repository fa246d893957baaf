"""GPU tests: NCCL and bf16 on CUDA. Skipped on machines without a GPU (CI has none)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from distributed_harness import REPO, hook_env, subprocess_env, torchrun, torchrun_command
from test_end_to_end import e2e_args

from torchrun_ddp.model import (
    apply_fused_loss,
    autocast_context,
    build_model,
    causal_lm_inputs,
    load_model_config,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.mark.parametrize("data_parallel", ["ddp", "fsdp"])
def test_tiny_config_trains_with_nccl_and_bf16(
    data_parallel: str, sample_data: Path, tmp_path: Path
) -> None:
    """DDP and FSDP2 (``--data-parallel``) train on NCCL in bf16-mixed: finite, falling loss."""
    nproc = min(2, torch.cuda.device_count())
    extra = ("--device", "cuda", "--backend", "nccl", "--precision", "bf16-mixed")
    extra += ("--data-parallel", data_parallel)
    result = torchrun(e2e_args(sample_data, tmp_path, *extra, "--max-steps", "20"), nproc=nproc)
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
    assert "nccl" in result.stdout + result.stderr
    assert "training loss: Liger's fused linear cross-entropy" in result.stdout + result.stderr


def _loss_and_grads(
    fused: bool, precision: str, batch: torch.Tensor, items: torch.Tensor | None
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The tiny LLaMA's training loss on ``batch`` ([B, 3, L]) and its gradients, built on the
    GPU from seed 0, with Liger's fused loss or transformers' own."""
    config = load_model_config(str(REPO / "configs" / "tiny-models" / "llama" / "config.json"))
    model = build_model("tiny", config, "random", precision, 0, torch.device("cuda"))
    if fused:
        apply_fused_loss(model)
    model.train()
    kwargs = {} if items is None else {"num_items_in_batch": items}
    with autocast_context(precision, batch.device):
        loss = model(**causal_lm_inputs(batch), **kwargs).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize(("precision", "tolerance"), [("fp32", 1e-4), ("bf16-mixed", 2e-2)])
@pytest.mark.parametrize("summed", [False, True])
def test_fused_loss_matches_the_plain_loss(precision: str, tolerance: float, summed: bool) -> None:
    """Liger's fused linear cross-entropy gives transformers' loss and the same gradient for
    every weight (relative L2 error under ``tolerance``), on labels with ignored (-100) tokens
    and restarting positions, as a mean or as a sum over ``num_items_in_batch``."""
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 32000, (2, 64), generator=generator)
    labels = ids.clone()
    labels[:, :10] = -100  # a prompt: not trained
    positions = torch.cat([torch.arange(32), torch.arange(32)]).expand(2, 64)
    batch = torch.stack([ids, labels, positions], dim=1).cuda()
    items = torch.tensor(100.0, device="cuda") if summed else None
    plain_loss, plain = _loss_and_grads(False, precision, batch, items)
    fused_loss, fused = _loss_and_grads(True, precision, batch, items)
    assert torch.allclose(fused_loss.float(), plain_loss.float(), rtol=tolerance)
    for name, grad in plain.items():
        error = (fused[name].float() - grad.float()).norm() / grad.float().norm()
        assert error < tolerance, f"{name}: relative error {error:.2e}"


def test_random_init_is_drawn_on_the_gpu() -> None:
    """--init random builds the weights on the GPU itself, the same from the same seed."""
    config = load_model_config(str(REPO / "configs" / "tiny-models" / "llama" / "config.json"))
    first = build_model("tiny", config, "random", "fp32", 7, torch.device("cuda"))
    again = build_model("tiny", config, "random", "fp32", 7, torch.device("cuda"))
    pairs = zip(first.state_dict().items(), again.state_dict().values(), strict=True)
    for (name, weight), other in pairs:
        assert weight.device.type == "cuda", name
        assert torch.equal(weight, other), name


def test_llama2_7b_dry_run_plans_for_the_visible_gpu() -> None:
    gib = torch.cuda.get_device_properties(0).total_memory / 2**30
    command = [sys.executable, str(REPO / "train.py"), "--config", "configs/llama2_7b_ddp_dct.toml"]
    result = subprocess.run(
        [*command, "--dry-run"], cwd=REPO, env=subprocess_env(), capture_output=True, text=True,
        check=False,
        timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "6,738,415,616 parameters" in result.stdout
    assert f"x {gib:g} GiB" in result.stdout


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="an NCCL group of 2 needs 2 GPUs")
def test_nccl_restarts_reconnect_once_per_fault(sample_data: Path, tmp_path: Path) -> None:
    """Two SIGKILLs under torchrun's shared store with --max-restarts 2 (NCCL's unique ids live
    in that store too, pytorch/pytorch#167288): each costs one restart, and the run resumes."""
    faults = "step:1:3,step:0:5"
    extra = ("--device", "cuda", "--backend", "nccl", "--max-steps", "8", "--checkpoint-every", "2")
    args = e2e_args(sample_data, tmp_path, *extra)
    command = torchrun_command(args, nproc=2, extra=("--max-restarts=2",))
    env = hook_env(faults=faults)
    result = subprocess.run(
        command, cwd=REPO, env=env, capture_output=True, text=True, timeout=900, check=False
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert output.count("resumed from") == 2, output[-4000:]
