"""--peft lora under --data-parallel fsdp and hsdp, the real trainer on 2 spawned gloo ranks (one
spawn for the module): the adapters and the frozen base are sharded, only the adapters train,
the losses and the exported adapter are DDP's, a stopped and resumed run ends bit-identical with
checkpoints that hold the adapters' shards and no base weight, the merged export loads, and the
plan counts a shard of the base and of the adapters.

SMALL_LLAMA (hidden 64, 2 layers, 4,096 tokens) in fp32 with rank-8 adapters on every linear
layer; steps of 2 micro-batches of 2 x 16 tokens per rank."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from distributed_harness import accumulating_args, logged_losses, run_distributed
from safetensors import safe_open
from safetensors.torch import load_file
from tiny_models import digest, train_in_group
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM

from torchrun_ddp.config_io import parse_config
from torchrun_ddp.parallel.shards import full_tensor
from torchrun_ddp.plan.architecture import llama2_7b_config
from torchrun_ddp.planning import plan_run, trained_shapes
from torchrun_ddp.training_state import save_final_model

pytestmark = pytest.mark.slow  # trains LoRA under ddp, fsdp and hsdp on 2 spawned ranks

STEPS, STOP = 6, 3
LORA = ("--peft", "lora", "--lora-dropout", "0", "--learning-rate", "3e-2")
RUNS = {
    "ddp": (),
    "fsdp": ("--data-parallel", "fsdp"),
    "hsdp": ("--data-parallel", "hsdp", "--shard-degree", "1"),
}


def _args(data: Path, output: Path, *extra: str) -> list[str]:
    return accumulating_args(data, output, STEPS, STOP, *LORA, *extra)


def _facts(trainer: object) -> dict[str, object]:
    """Which parameters are DTensors and train, and a digest of the frozen ones (full)."""
    model = trainer.model  # type: ignore[attr-defined]
    if hasattr(model, "reshard"):  # FSDP: the root's weights stay gathered after evaluation
        model.reshard()
    params = {n.removeprefix("module."): p for n, p in model.named_parameters()}
    frozen = {n: p for n, p in params.items() if not p.requires_grad}
    full = {n: full_tensor(p).detach().clone() for n, p in frozen.items()}
    return {
        "sharded": all(isinstance(p, DTensor) for p in params.values()),
        "trained": sorted(n for n, p in params.items() if p.requires_grad),
        "frozen": digest(full),
    }


def _worker(rank: int, world_size: int, data: str, root: Path) -> dict[str, object]:
    """ddp, fsdp and hsdp LoRA runs, and fsdp stopped at STOP then resumed: one spawn."""
    out: dict[str, object] = {}
    for name, extra in RUNS.items():
        args = _args(Path(data), root / name, *extra)
        trainer = train_in_group(rank, world_size, args, export=False)
        out[name] = _facts(trainer)  # before the export merges DDP's adapters in place
        save_final_model(trainer)
    stopped = ("--data-parallel", "fsdp", "--max-steps", str(STOP))
    train_in_group(rank, world_size, _args(Path(data), root / "stopped", *stopped))
    train_in_group(rank, world_size, _args(Path(data), root / "stopped", *RUNS["fsdp"]))
    return out


@pytest.fixture(scope="module")
def runs(sample_data: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list]:
    root = tmp_path_factory.mktemp("sharded-lora")
    return root, run_distributed(_worker, 2, str(sample_data), root, timeout=600)


def _adapter(run: Path) -> dict[str, torch.Tensor]:
    return load_file(run / "adapter" / "adapter_model.safetensors")


def test_the_adapters_and_the_frozen_base_are_sharded_and_only_the_adapters_train(
    runs: tuple[Path, list],
) -> None:
    _, results = runs
    for rank in results:
        for name in ("fsdp", "hsdp"):
            assert rank[name]["sharded"], name
            assert rank[name]["trained"] == rank["ddp"]["trained"], name
            assert rank[name]["trained"] and all("lora_" in n for n in rank[name]["trained"])
            assert rank[name]["frozen"] == rank["ddp"]["frozen"], f"{name}: the base changed"


def test_fsdp_and_hsdp_lora_give_ddp_losses_and_adapter(runs: tuple[Path, list]) -> None:
    root, _ = runs
    ddp = logged_losses(root / "ddp")
    assert sorted(ddp) == list(range(1, STEPS + 1)) and ddp[STEPS] < ddp[1], ddp
    want = _adapter(root / "ddp")
    for name in ("fsdp", "hsdp"):
        losses = logged_losses(root / name)
        for step, loss in ddp.items():
            assert losses[step] == pytest.approx(loss, abs=2e-5), (name, step)
        have = _adapter(root / name)
        assert have.keys() == want.keys()
        for key, tensor in want.items():
            torch.testing.assert_close(have[key], tensor, atol=1e-4, rtol=1e-4, msg=key)


def test_fsdp_lora_resume_is_exact_and_checkpoints_hold_no_base(runs: tuple[Path, list]) -> None:
    root, _ = runs
    assert logged_losses(root / "stopped") == logged_losses(root / "fsdp")
    assert digest(_adapter(root / "stopped")) == digest(_adapter(root / "fsdp"))
    keys: list[str] = []
    for shard in (root / "stopped" / "checkpoints" / f"step-{STOP}" / "dcp").glob("*.safetensors"):
        with safe_open(shard, "pt") as handle:
            keys += list(handle.keys())
    assert any("lora_A" in key for key in keys) and any("lora_B" in key for key in keys)
    assert not [key for key in keys if "base_layer" in key or "embed_tokens" in key]


def test_the_merged_export_loads_and_equals_ddps(runs: tuple[Path, list]) -> None:
    root, _ = runs
    models = {
        name: AutoModelForCausalLM.from_pretrained(root / name / "final_model")
        for name in ("ddp", "fsdp")
    }
    want, have = models["ddp"].state_dict(), models["fsdp"].state_dict()
    assert have.keys() == want.keys() and not any("lora" in key for key in have)
    for key, tensor in want.items():
        torch.testing.assert_close(have[key], tensor, atol=1e-4, rtol=1e-4, msg=key)


def test_the_plan_shards_the_frozen_base_and_the_adapters() -> None:
    """LLaMA-2-7B LoRA on 8 ranks: fsdp holds 1/8 of the bf16 base and of the fp32 adapters,
    their gradients and AdamW moments; ddp the whole base."""
    flags = ["--model", "meta-llama/Llama-2-7b-hf", "--peft", "lora", "--precision", "bf16-mixed"]
    config = llama2_7b_config()
    ddp, _ = plan_run(parse_config(flags), config, 8, 80.0)
    fsdp, _ = plan_run(parse_config([*flags, "--data-parallel", "fsdp"]), config, 8, 80.0)
    adapters = sum(
        torch.Size(shape).numel() for shape in trained_shapes(parse_config(flags), config)
    )
    assert ddp.weights == 2 * 6_738_415_616 + 4 * adapters
    assert fsdp.weights == 2 * -(-6_738_415_616 // 8) + 4 * -(-adapters // 8)
    assert fsdp.optimizer_state == 8 * -(-adapters // 8)
    assert "fsdp over 8" in fsdp.describe() and "LoRA" in fsdp.describe()
