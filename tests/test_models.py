"""Any AutoModelForCausalLM trains: tiny GPT-2, Qwen2, Mistral and Mixtral (mixture of experts)
configs each train a few steps through the real trainer (data, DDP, AdamW, checkpoint, final
model) on 2 gloo ranks, and a Mixtral step in which most experts receive no token keeps DDP
working. One spawn for the module."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from distributed_harness import logged_losses, run_distributed, tiny_args
from tiny_models import TINY_MODELS, digest, tiny_model_path, train_in_group
from transformers import AutoConfig, AutoModelForCausalLM

from torchrun_ddp.compression import CompressionSettings, register_compression
from torchrun_ddp.main import forward_backward
from torchrun_ddp.model import LoraSettings, apply_lora, build_model
from torchrun_ddp.optim import build_optimizer
from torchrun_ddp.parallel.ddp import wrap_ddp

pytestmark = pytest.mark.slow  # trains five architectures on 2 spawned ranks

STEPS = 3
CPU = torch.device("cpu")


def _train_args(data: Path, output_dir: Path, name: str) -> list[str]:
    """3 steps of 2 x 2 x 32 tokens from a seeded random init, a log line every step."""
    return tiny_args(
        data, output_dir,
        "--model", str(tiny_model_path(name)), "--init", "random", "--seq-length", "32",
        "--batch-size", "2", "--max-steps", str(STEPS), "--warmup-steps", "1",
        "--learning-rate", "3e-3", "--log-every", "1", "--eval-every", "0", "--eval-batches", "1",
        "--checkpoint-every", "0", "--threads", "1", "--shuffle-buffer", "4",
    )  # fmt: skip


def _unused_experts_step(rank: int, peft: str) -> dict[str, object]:
    """One DDP step of tiny Mixtral on a window of one repeated token (a different token per
    rank): every position of layer 0 then routes to the same 2 of the 4 experts, so 2 experts
    receive no token on this rank. Returns the experts layer 0 used and the trained parameters'
    digest after an AdamW step."""
    config = AutoConfig.from_pretrained(tiny_model_path("mixtral"))
    model: torch.nn.Module = build_model("mixtral", config, "random", "bf16-mixed", 0, CPU, peft)
    if peft == "lora":  # all-linear adapts the 3-D expert parameters, which needs dropout 0
        model = apply_lora(model, LoraSettings(dropout=0.0))
    ddp = wrap_ddp(model, CPU)
    register_compression(ddp, CompressionSettings(method="none"))
    chosen: list[torch.Tensor] = []
    router = next(m for n, m in model.named_modules() if n.endswith("layers.0.mlp.gate"))
    router.register_forward_hook(lambda module, args, out: chosen.append(out[2]))
    optimizer = build_optimizer(model, 1e-2, 0.0)
    batch = torch.full((2, 16), 100 + 37 * rank, dtype=torch.long)
    loss = forward_backward(ddp, [batch], "bf16-mixed")
    optimizer.step()
    trained = {n: p for n, p in model.named_parameters() if p.requires_grad}
    return {
        "experts_used": sorted(set(chosen[0].flatten().tolist())),
        "loss": loss,
        "trained": digest(trained),
        "trained_tensors": len(trained),
    }


def _worker(rank: int, world_size: int, data: str, root: str) -> dict[str, object]:
    """Every tiny architecture through the trainer, then the unused-experts steps."""
    results: dict[str, object] = {}
    for name in TINY_MODELS:
        trainer = train_in_group(rank, world_size, _train_args(Path(data), Path(root) / name, name))
        model = trainer.model.module
        results[name] = {
            "params": digest(dict(model.named_parameters())),
            "type": type(model).__name__,
            "flops_per_token": trainer.window.flops_per_token,
        }
    for peft in ("none", "lora"):
        results[f"unused-experts-{peft}"] = _unused_experts_step(rank, peft)
    return results


@pytest.fixture(scope="module")
def runs(sample_data: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict], Path]:
    """Per rank: model name -> parameter digest, class, FLOPs per token; the output root."""
    root = tmp_path_factory.mktemp("models")
    return run_distributed(_worker, 2, str(sample_data), str(root), timeout=600), root


@pytest.mark.parametrize("name", TINY_MODELS)
def test_architecture_trains_under_ddp(runs: tuple[list[dict], Path], name: str) -> None:
    ranks, root = runs
    expected = AutoConfig.from_pretrained(tiny_model_path(name)).architectures[0]
    assert ranks[0][name]["type"] == expected
    assert ranks[0][name]["params"] == ranks[1][name]["params"], "ranks diverged"
    losses = logged_losses(root / name)
    assert sorted(losses) == list(range(1, STEPS + 1))
    assert all(math.isfinite(value) for value in losses.values())
    assert losses[1] == pytest.approx(math.log(32000), abs=0.5), "untrained: about ln(vocab)"
    assert losses[STEPS] < losses[1], losses
    assert ranks[0][name]["flops_per_token"] > 0


@pytest.mark.parametrize("name", TINY_MODELS)
def test_final_model_loads_and_generates(runs: tuple[list[dict], Path], name: str) -> None:
    _, root = runs
    model = AutoModelForCausalLM.from_pretrained(root / name / "final_model")
    prompt = torch.tensor([[1, 450, 1900, 982]])
    out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=4,
                         do_sample=False)  # fmt: skip
    assert out.shape == (1, 8)


def test_moe_flops_count_only_the_experts_a_token_uses(runs: tuple[list[dict], Path]) -> None:
    ranks, _ = runs
    config = AutoConfig.from_pretrained(tiny_model_path("mixtral"))
    dense = ranks[0]["mistral"]["flops_per_token"]  # same sizes as mixtral with one dense MLP
    expert = 3 * config.hidden_size * config.intermediate_size * config.num_hidden_layers
    router = config.num_local_experts * config.hidden_size * config.num_hidden_layers
    # 2 of 4 experts per token: one expert more than the dense model, plus the router
    assert ranks[0]["mixtral"]["flops_per_token"] == dense + 6 * (expert + router)


@pytest.mark.parametrize("peft", ["none", "lora"])
def test_experts_without_tokens_do_not_break_ddp(runs: tuple[list[dict], Path], peft: str) -> None:
    """transformers 5 keeps a layer's experts in 3-D parameters (gate_up_proj [E, 2I, H]), so an
    expert without tokens gets a zero slice of a gradient that exists: DDP sees every parameter
    used and needs no find_unused_parameters."""
    ranks, _ = runs
    steps = [rank[f"unused-experts-{peft}"] for rank in ranks]
    for step in steps:
        assert len(step["experts_used"]) == 2, "top-2 routing of one repeated token"
        assert torch.isfinite(step["loss"])
    assert steps[0]["trained"] == steps[1]["trained"], "ranks diverged after the step"
    assert steps[0]["trained_tensors"] > 0
