"""--data-parallel fsdp and hsdp (``parallelize``): the real trainer on 2 spawned gloo ranks
gives DDP's losses, averages the gradients, resumes exactly and exports a Hugging Face model; the
settings it does not support are refused in one line; the plan shards the state."""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from distributed_harness import (
    SMALL_LLAMA,
    accumulating_args,
    final_weights,
    logged_losses,
    run_distributed,
)
from tiny_models import comm_bytes, digest, tiny_llama_config, train_in_group
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM

from torchrun_ddp.config_io import parse_config
from torchrun_ddp.distributed import DistEnv
from torchrun_ddp.dry_run import dry_run
from torchrun_ddp.errors import UserError
from torchrun_ddp.main import forward_backward
from torchrun_ddp.model import build_model, enable_activation_checkpointing, load_model_config
from torchrun_ddp.parallel.base import MeshShape
from torchrun_ddp.parallel.modes import clip_grad_norm, mesh_shape
from torchrun_ddp.parallel.sharding import (
    build_mesh,
    decoder_layers,
    holds_whole_replicas,
    load_from_rank0,
    rank0_weights,
    shard_model,
)
from torchrun_ddp.plan.architecture import llama2_7b_config, meta_model
from torchrun_ddp.plan.settings import PlanSettings
from torchrun_ddp.planning import plan_memory, plan_run

STEPS, STOP = 8, 4
CPU = torch.device("cpu")


def _args(data: Path, output: Path, *extra: str) -> list[str]:
    """The hidden-64 LLaMA, 8 steps of 2 micro-batches of 2 x 16 tokens per rank."""
    return accumulating_args(data, output, STEPS, STOP, *extra)


def _sharded_tiny(rank: int, world_size: int, precision: str) -> torch.nn.Module:
    """The tiny LLaMA with tied embeddings and an odd vocabulary (uneven shards), sharded over
    ``world_size`` ranks from rank 0's seeded weights (activation checkpointing under
    bf16-mixed)."""
    config = tiny_llama_config(vocab_size=131)
    config.tie_word_embeddings = True
    host = CPU if rank == 0 else torch.device("meta")
    model = build_model("tiny", config, "random", precision, 7, host)
    if precision == "bf16-mixed":
        enable_activation_checkpointing(model)
    state = rank0_weights(model)
    shard_model(model, build_mesh(CPU, MeshShape(1, world_size), hybrid=False), precision)
    load_from_rank0(model, CPU, state)
    return model


def _gradients_worker(rank: int, world_size: int) -> dict[str, object]:
    """One backward of this rank's own batch (2 micro-batches) through the fsdp model in fp32
    and in bf16-mixed with activation checkpointing; the full gradients, the gradient norm,
    and the full weights and buffers as initialised."""
    out: dict[str, object] = {}
    batch = torch.randint(0, 131, (2, 12), generator=torch.Generator().manual_seed(rank))
    for precision in ("fp32", "bf16-mixed"):
        model = _sharded_tiny(rank, world_size, precision)
        if precision == "fp32":
            out["weights"] = {n: p.full_tensor() for n, p in model.named_parameters()}
            out["buffers"] = dict(model.named_buffers())
            out["tied"] = model.lm_head.weight is model.model.embed_tokens.weight
        forward_backward(model, list(batch.chunk(2)), precision)
        out[f"norm {precision}"] = clip_grad_norm(model, 1e9)
        out[f"grads {precision}"] = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    return out


def _runs_worker(rank: int, world_size: int, data: str, root: Path) -> dict[str, object]:
    """ddp, fsdp and hsdp (2 replicas of 1 shard) for STEPS steps, and fsdp stopped at STOP then
    resumed: one spawn for the module."""
    out: dict[str, object] = {"gradients": _gradients_worker(rank, world_size)}
    for name, extra in RUNS.items():
        trainer = train_in_group(rank, world_size, _args(Path(data), root / name, *extra))
        out[name] = isinstance(trainer.model.lm_head.weight, DTensor) if name != "ddp" else None
        blocks = decoder_layers(trainer.model)
        out[f"{name} compiled"] = [b._compiled_call_impl is not None for b in blocks]
        out[f"{name} graphs"] = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    resumed = ("--data-parallel", "fsdp", "--max-steps", str(STOP))
    train_in_group(rank, world_size, _args(Path(data), root / "stopped", *resumed))
    if rank == 0:  # the step-STOP export, before the resumed run writes its own
        shutil.copytree(root / "stopped" / "final_model", root / "at-stop" / "final_model")
    train_in_group(rank, world_size, _args(Path(data), root / "stopped", "--data-parallel", "fsdp"))
    return out


def _one_rank_worker(rank: int, world_size: int, data: str, root: Path) -> None:
    """fsdp on 1 rank: resume the 2-rank checkpoint of step STOP, train nothing, export."""
    step = root / "stopped" / "checkpoints" / f"step-{STOP}"
    extra = ("--data-parallel", "fsdp", "--resume-from", str(step), "--max-steps", str(STOP))
    train_in_group(rank, world_size, _args(Path(data), root / "one-rank", *extra))


RUNS = {
    "ddp": (),
    "fsdp": ("--data-parallel", "fsdp"),
    "hsdp": ("--data-parallel", "hsdp", "--shard-degree", "1"),
    "fsdp-compiled": ("--data-parallel", "fsdp", "--compile"),
}


@pytest.fixture(scope="module")
def runs(sample_data: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list]:
    root = tmp_path_factory.mktemp("sharded")
    return root, run_distributed(_runs_worker, 2, str(sample_data), root, timeout=600)


@pytest.mark.slow
def test_fsdp_checkpoint_resumes_at_another_world_size(
    runs: tuple[Path, list], sample_data: Path
) -> None:
    """The 2-rank shards of step STOP, loaded by 1 rank (DCP reshards them), give the same
    weights bit for bit."""
    root, _ = runs
    run_distributed(_one_rank_worker, 1, str(sample_data), root, timeout=300)
    assert digest(final_weights(root / "one-rank")) == digest(final_weights(root / "at-stop"))


@pytest.mark.slow
def test_fsdp_and_hsdp_give_ddp_losses(runs: tuple[Path, list]) -> None:
    root, results = runs
    ddp = logged_losses(root / "ddp")
    assert sorted(ddp) == list(range(1, STEPS + 1))
    assert ddp[STEPS] < ddp[1] - 0.1, ddp  # it trains
    for name in ("fsdp", "hsdp"):
        assert results[0][name], f"{name}: the trainer's model is not sharded"
        losses = logged_losses(root / name)
        assert sorted(losses) == sorted(ddp)
        for step, loss in ddp.items():
            assert losses[step] == pytest.approx(loss, abs=2e-5), (name, step)
        want, have = final_weights(root / "ddp"), final_weights(root / name)
        assert have.keys() == want.keys()
        for key, tensor in want.items():
            torch.testing.assert_close(have[key], tensor, atol=1e-4, rtol=1e-4, msg=key)


@pytest.mark.slow
def test_compiled_fsdp_compiles_each_block_and_trains_like_eager(
    runs: tuple[Path, list],
) -> None:
    """--compile under fsdp: every decoder layer compiled in place (inductor on CPU), only
    there, and the run logs eager FSDP's losses (fused kernels round differently: 1e-3)."""
    root, results = runs
    for rank in results:
        assert rank["fsdp-compiled"], "not sharded"
        assert rank["fsdp-compiled compiled"] == [True, True], rank["fsdp-compiled compiled"]
        assert not any(rank["fsdp compiled"]), "eager fsdp compiled something"
        assert rank["hsdp graphs"] == 0 < rank["fsdp-compiled graphs"], "no graph compiled"
    eager, compiled = logged_losses(root / "fsdp"), logged_losses(root / "fsdp-compiled")
    assert sorted(compiled) == sorted(eager)
    for step, loss in eager.items():
        assert compiled[step] == pytest.approx(loss, abs=1e-3), step


@pytest.mark.slow
def test_fsdp_traffic_is_counted_per_step(runs: tuple[Path, list]) -> None:
    """hsdp over 2 replicas of 1 shard sends what DDP's all-reduce sends (4 B x P parameters
    at 2 ranks); fsdp over 2 ranks gathers every unit per micro-batch (layers twice, the root
    once; 4 B, half from the peer) and reduce-scatters the gradients once (half of 4 B x P)."""
    root, _ = runs
    ddp, fsdp, hsdp = (comm_bytes(root / name) for name in ("ddp", "fsdp", "hsdp"))
    model = meta_model(load_model_config(str(SMALL_LLAMA)))
    parameters = sum(p.numel() for p in model.parameters())
    outside = sum(p.numel() for n, p in model.named_parameters() if ".layers." not in n)
    gathered = 2 * (2 * parameters - outside) * 4 // 2  # 2 micro-batches, this rank's half
    assert ddp[0][0] == 4 * parameters
    assert set(hsdp) == {(4 * parameters, 4 * parameters)}
    assert set(fsdp) == {(gathered + 2 * parameters, 4 * parameters)}


@pytest.mark.slow
def test_fsdp_resume_is_exact(runs: tuple[Path, list]) -> None:
    root, _ = runs
    assert logged_losses(root / "stopped") == logged_losses(root / "fsdp")
    assert digest(final_weights(root / "stopped")) == digest(final_weights(root / "fsdp"))


@pytest.mark.slow
def test_fsdp_averages_gradients_from_rank0_weights(runs: tuple[Path, list]) -> None:
    _, results = runs
    got = [result["gradients"] for result in results]
    assert got[0]["tied"] and got[1]["tied"]
    config = tiny_llama_config(vocab_size=131)
    config.tie_word_embeddings = True
    torch.manual_seed(7)
    model = AutoModelForCausalLM.from_config(config)
    for name, weight in model.named_parameters():
        assert torch.equal(got[1]["weights"][name], weight.detach()), name
    for name, buffer in model.named_buffers():
        assert torch.equal(got[1]["buffers"][name], buffer), name
    for rank in range(2):
        batch = torch.randint(0, 131, (2, 12), generator=torch.Generator().manual_seed(rank))
        forward_backward(model, list(batch.chunk(2)), "fp32")
    for name, param in model.named_parameters():  # the sum of both ranks' means, halved
        want = param.grad / 2
        for rank in range(2):
            torch.testing.assert_close(got[rank]["grads fp32"][name], want, atol=1e-6, rtol=1e-5)
    norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() / 2 for p in model.parameters()]))
    torch.testing.assert_close(got[0]["norm fp32"], norm, atol=1e-6, rtol=1e-5)


@pytest.mark.slow
def test_fsdp_bf16_mixed_computes_in_bf16_into_fp32_gradients(runs: tuple[Path, list]) -> None:
    got = [result["gradients"] for result in runs[1]]
    fp32, mixed = got[0]["grads fp32"], got[0]["grads bf16-mixed"]
    assert all(grad.dtype == torch.float32 for grad in mixed.values())
    for name, grad in fp32.items():
        error = (mixed[name] - grad).norm() / grad.norm()
        assert 0 < error < 0.05, (name, error)  # bf16 rounding: close, not equal
    for name, grad in mixed.items():  # one reduce-scatter: the same average on both ranks
        assert torch.equal(got[1]["grads bf16-mixed"][name], grad), name


REFUSED = {
    ("--zero1",): "--zero1",
    ("--compression", "dct"): "--compression dct",
    ("--optimizer", "demo"): "--optimizer demo",
    ("--optimizer", "diloco"): "--optimizer diloco",
    ("--optimizer", "sparseloco"): "--optimizer sparseloco",
    ("--ddp-static-graph", "--accumulation-steps", "1"): "--ddp-static-graph",
    ("--compression-scope", "inter-node"): "--compression-scope inter-node",
    ("--checkpoint-storage", "node-local"): "--checkpoint-storage node-local",
    ("--eval-multiple-choice", "questions.jsonl"): "--eval-multiple-choice",
}


@pytest.mark.parametrize("flags", list(REFUSED), ids=" ".join)
def test_unsupported_settings_are_refused_in_one_line(
    flags: tuple[str, ...], sample_data: Path, tmp_path: Path
) -> None:
    args = _args(sample_data, tmp_path, "--data-parallel", "fsdp", *flags)
    with pytest.raises(UserError) as refused:
        parse_config(args)
    message = str(refused.value)
    assert REFUSED[flags] in message and "\n" not in message, message
    parse_config(_args(sample_data, tmp_path, *flags))  # fine under ddp


def test_shard_degree_needs_hsdp_and_must_divide_the_ranks(sample_data: Path) -> None:
    with pytest.raises(UserError, match="--shard-degree applies to --data-parallel hsdp"):
        parse_config(_args(sample_data, Path("out"), "--shard-degree", "2"))
    assert mesh_shape("hsdp", 8, 4) == MeshShape(2, 4)
    assert mesh_shape("hsdp", 8, 4, 2) == MeshShape(4, 2)
    assert mesh_shape("fsdp", 8, 4) == MeshShape(1, 8)
    with pytest.raises(UserError, match="does not divide WORLD_SIZE 6"):
        mesh_shape("hsdp", 6, 4)


def test_7b_plan_fits_8_x_24_gib_only_sharded() -> None:
    base = (
        "--config", "configs/llama2_7b.toml", "--zero1", "false", "--compression", "none",
        "--device-memory-gib", "24",
    )  # fmt: skip
    ddp = parse_config(list(base))
    fsdp = parse_config([*base, "--data-parallel", "fsdp"])
    model = llama2_7b_config()
    replicated, _ = plan_run(ddp, model, 8, 24.0)
    sharded, _ = plan_run(fsdp, model, 8, 24.0)
    assert not replicated.fits and sharded.fits, (replicated.total, sharded.total)
    state = sharded.weights + sharded.optimizer_state
    whole = replicated.weights + replicated.optimizer_state
    assert state == pytest.approx(whole / 8, rel=0.01)
    text = dry_run(fsdp, DistEnv(rank=0, world_size=8, local_rank=0, local_world_size=8))
    assert "fsdp" in text and "verdict | fits" in text, text


def test_fsdp_plan_on_one_rank_is_sharded_and_saves_bf16_activations() -> None:
    """Measured on one H100 (docs/benchmarks.md): FSDP2 at 1 GPU peaked 12.7 GiB below DDP,
    with no DDP buckets or autocast copies and a bf16 residual stream; the plan must say so."""
    model = llama2_7b_config()
    settings = PlanSettings(world_size=1, micro_batch=2, seq_length=512, precision="bf16-mixed")
    ddp = plan_memory(model, 6_738_415_616, settings)
    fsdp = plan_memory(model, 6_738_415_616, replace(settings, data_parallel="fsdp"))
    assert fsdp.ddp_buckets == fsdp.autocast_weight_copies == 0 and fsdp.gathered_units > 0
    assert ddp.autocast_weight_copies > 0
    assert fsdp.weights + fsdp.optimizer_state == ddp.weights + ddp.optimizer_state
    assert fsdp.activations < ddp.activations


def test_a_folder_per_node_must_hold_whole_replicas() -> None:
    """Under hsdp every storage domain must hold whole shard groups (ranks shard-fastest), so
    that DCP in the domain's group writes every shard into its folder."""
    nodes = [(0, 1), (2, 3)]
    assert holds_whole_replicas(nodes, MeshShape(2, 2))
    assert holds_whole_replicas(nodes, MeshShape(4, 1))
    assert not holds_whole_replicas(nodes, MeshShape(1, 4))
    assert not holds_whole_replicas([(0, 2), (1, 3)], MeshShape(2, 2))
