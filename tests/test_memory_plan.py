"""The dry-run memory plan: parameter count on the meta device, byte arithmetic by hand,
activations against what autograd saves, suggestions and FLOPs. No process group, no training."""

from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from tiny_models import TINY_MODELS, tiny_model_path
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _should_compress
from torch.nn.parallel.distributed import _BucketCapacityConfig
from torch.utils.flop_counter import FlopCounterMode
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, PretrainedConfig

from torchrun_ddp.compression import CompressionSettings
from torchrun_ddp.compression.settings import POWERSGD_MIN_RATE
from torchrun_ddp.compression.state import powersgd_slices
from torchrun_ddp.compression.wire import demo_payload_bytes, wire_bytes
from torchrun_ddp.config import TrainConfig
from torchrun_ddp.config_io import parse_config
from torchrun_ddp.distributed import DistEnv
from torchrun_ddp.dry_run import check_fits, communication_plan
from torchrun_ddp.errors import UserError
from torchrun_ddp.model import (
    LoraSettings,
    apply_lora,
    hidden_matrices,
    load_model_config,
    trainable_parameter_sizes,
)
from torchrun_ddp.plan.activations import activation_estimate, fused_loss_bytes
from torchrun_ddp.plan.architecture import (
    active_parameter_count,
    architecture,
    llama2_7b_config,
    matmul_parameter_count,
    meta_model,
    missing_sizes,
    model_flops_per_token,
    parameter_count,
    parameter_sizes,
)
from torchrun_ddp.plan.communication import (
    Topology,
    communication_table,
    estimate,
    hook_rows,
    last_bucket_share,
    powersgd_numel,
    predicted_step_seconds,
    state_bytes,
)
from torchrun_ddp.plan.memory import PlanRequest, zero_shard
from torchrun_ddp.plan.settings import GIB, Footprint, PlanSettings
from torchrun_ddp.planning import (
    comparison_table,
    plan_memory,
    plan_run,
    planned_mode,
    suggestions,
    trained_shapes,
)

REPO = Path(__file__).resolve().parents[1]
N = 6_738_415_616
"""LLaMA-2-7B's parameters."""
L, H, FF, V, A = 32, 4096, 11008, 32000, 32
"""Its layers, hidden size, intermediate size, vocabulary and heads."""
TOKENS = 4 * 512
"""One micro-batch of 4 sequences of 512 tokens."""
ONE_GPU = PlanSettings(world_size=1, micro_batch=4, seq_length=512)
"""fp32 on one 80 GiB GPU with 1 GiB overhead, DDP defaults."""


@pytest.fixture(scope="module")
def config() -> LlamaConfig:
    return llama2_7b_config()


def test_meta_llama2_7b_has_exact_parameter_count_and_no_storage(config: LlamaConfig) -> None:
    model = meta_model(config)
    assert parameter_count(model) == N
    assert all(p.is_meta for p in model.parameters())
    assert parameter_sizes(model) == architecture(config).parameter_sizes()


def test_hidden_matrices_are_the_layers_linear_weights(config: LlamaConfig) -> None:
    """What an optimizer treating the hidden matrices apart steps (Muon): the 7 linear weights
    of each of the 32 layers, not the embedding, the head or the norms; a footprint of 1 moment
    on those and 2 on the rest holds that many moments in the plan."""
    matrices = L * (4 * H * H + 3 * H * FF)
    assert sum(p.numel() for p in hidden_matrices(meta_model(config))) == matrices
    assert N - matrices == 2 * V * H + (2 * L + 1) * H
    footprint = Footprint(moments=2.0, matrix_moments=1.0)
    plan = plan_memory(config, N, ONE_GPU)
    request = PlanRequest(architecture(config), N, ONE_GPU, footprint)
    muon = planned_mode(ONE_GPU).plan_memory(request)
    assert muon.optimizer_state == 4 * (matrices + 2 * (N - matrices))
    assert muon.optimizer_state == plan.optimizer_state - 4 * matrices


def test_fp32_one_gpu_equals_hand_arithmetic(config: LlamaConfig) -> None:
    plan = plan_memory(config, N, ONE_GPU)
    assert plan.weights == 4 * N
    assert plan.gradients == 4 * N
    assert plan.ddp_buckets == 4 * N
    assert plan.optimizer_state == 8 * N
    assert plan.optimizer_step_temporaries == 4 * N
    before_activations = plan.weights + plan.gradients + plan.ddp_buckets + plan.optimizer_state
    assert before_activations == 20 * N
    assert 125 * GIB < before_activations < 126 * GIB
    layer = TOKENS * (40 * H + 16 * FF + 4 * A + 8)
    assert plan.activations == L * layer + TOKENS * (12 * H + 4) + 12 * TOKENS * V
    assert plan.total == 24 * N + GIB, "optimizer step: weights, grads, buckets, moments, sqrt"
    assert plan.peak_phase == "optimizer step"
    assert not plan.fits
    assert plan.headroom == 80 * GIB - plan.total


def test_zero1_over_eight_ranks_divides_optimizer_state(config: LlamaConfig) -> None:
    plan = plan_memory(config, N, replace(ONE_GPU, world_size=8, zero1=True))
    assert plan.optimizer_state == 8 * N // 8
    assert plan.optimizer_step_temporaries == 4 * N // 8
    assert (plan.weights, plan.gradients, plan.ddp_buckets) == (4 * N, 4 * N, 4 * N)


def test_zero1_greedy_partition_follows_the_largest_tensors() -> None:
    assert zero_shard(10, 4) == 3, "even split rounds up"
    assert zero_shard(16, 2, [8, 3, 3, 2]) == 8, "8 | 3 + 3 + 2"
    assert zero_shard(20, 4, [8, 6, 2, 2, 2]) == 8, "the largest tensor is not split"


def test_bf16_halves_weights_gradients_buckets_and_moments(config: LlamaConfig) -> None:
    plan = plan_memory(config, N, replace(ONE_GPU, precision="bf16"))
    assert (plan.weights, plan.gradients, plan.ddp_buckets) == (2 * N, 2 * N, 2 * N)
    assert plan.optimizer_state == 2 * 2 * N, "torch AdamW keeps moments in the param dtype"
    layer = TOKENS * (24 * H + 8 * FF + 4 * A + 8)
    assert plan.activations == L * layer + TOKENS * (8 * H + 4) + 12 * TOKENS * V
    assert plan.autocast_weight_copies == 0


def test_bf16_mixed_keeps_fp32_state_and_caches_bf16_weight_copies(config: LlamaConfig) -> None:
    plan = plan_memory(config, N, replace(ONE_GPU, precision="bf16-mixed"))
    assert (plan.weights, plan.gradients, plan.optimizer_state) == (4 * N, 4 * N, 8 * N)
    linear = L * (4 * H * H + 3 * H * FF) + V * H
    assert plan.autocast_weight_copies == 2 * linear
    layer = TOKENS * (34 * H + 8 * FF + 4 * A + 8)
    assert plan.activations == L * layer + TOKENS * (10 * H + 4) + 12 * TOKENS * V


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed", "bf16"])
def test_activation_checkpointing_keeps_only_layer_inputs(
    config: LlamaConfig, precision: str
) -> None:
    full = plan_memory(config, N, replace(ONE_GPU, precision=precision))
    checkpointed = replace(ONE_GPU, precision=precision, activation_checkpointing=True)
    plan = plan_memory(config, N, checkpointed)
    assert plan.activations < full.activations / 5
    residual = 2 if precision == "bf16" else 4
    head = {"fp32": 12, "bf16-mixed": 10, "bf16": 8}[precision] * H + 4
    assert plan.activations == TOKENS * (L * residual * H + head + 12 * V)


def test_accumulation_and_bucket_views_keep_gradients_through_forward(
    config: LlamaConfig,
) -> None:
    plain = plan_memory(config, N, ONE_GPU)
    accumulating = plan_memory(config, N, replace(ONE_GPU, accumulation_steps=4))
    gained = accumulating.phases["start of backward"] - plain.phases["start of backward"]
    assert gained == 4 * N
    views = plan_memory(config, N, replace(ONE_GPU, gradient_as_bucket_view=True))
    assert views.ddp_buckets == 0
    assert views.phases["optimizer step"] == plain.phases["optimizer step"] - 4 * N


def _saved_bytes_of_one_layer(config: LlamaConfig, precision: str, batch: int, seq: int) -> int:
    """Bytes of the distinct non-parameter tensors autograd saves in decoder layer 1 of a small
    real model (tensors whose size is a multiple of the token count: not the weight copies)."""
    torch.manual_seed(0)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in weights and tensor.numel() % (batch * seq) == 0:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    hidden = torch.randn(batch, seq, config.hidden_size, dtype=dtype, requires_grad=True)
    positions = model.model.rotary_emb(hidden, torch.arange(seq)[None])
    autocast = torch.autocast("cpu", dtype=torch.bfloat16)
    with (
        torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor),
        autocast if precision == "bf16-mixed" else nullcontext(),
    ):
        model.model.layers[1](hidden, position_embeddings=positions)
    return sum(saved.values())


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed", "bf16"])
def test_layer_estimate_equals_what_autograd_saves(precision: str) -> None:
    small = LlamaConfig(
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=96,
        max_position_embeddings=64,
        use_cache=False,
    )
    settings = PlanSettings(world_size=1, micro_batch=3, seq_length=40, precision=precision)
    estimate = activation_estimate(architecture(small), settings)
    assert estimate.layer == _saved_bytes_of_one_layer(small, precision, 3, 40)


def test_fp32_7b_on_one_gpu_does_not_fit_and_suggestions_do(config: LlamaConfig) -> None:
    assert not plan_memory(config, N, ONE_GPU).fits
    advice = suggestions(config, N, ONE_GPU)
    assert advice[0].startswith("--precision bf16: "), advice
    assert any(line.startswith("--zero1 + 32 GPUs: ") for line in advice), advice
    assert plan_memory(config, N, replace(ONE_GPU, precision="bf16")).fits
    assert plan_memory(config, N, replace(ONE_GPU, zero1=True, world_size=32)).fits
    assert not plan_memory(config, N, replace(ONE_GPU, zero1=True, world_size=16)).fits
    assert not plan_memory(config, N, replace(ONE_GPU, precision="bf16-mixed")).fits


@pytest.mark.parametrize("micro_batch", [1, 2, 4])
def test_sharded_bf16_with_checkpointing_fits_on_eight_80gb_gpus(
    config: LlamaConfig, micro_batch: int
) -> None:
    eight = PlanSettings(world_size=8, micro_batch=micro_batch, seq_length=512, zero1=True)
    eight = replace(eight, activation_checkpointing=True)
    pure = plan_memory(config, N, replace(eight, precision="bf16"))
    assert pure.fits and pure.headroom > 30 * GIB
    mixed = replace(eight, precision="bf16-mixed")
    assert not plan_memory(config, N, mixed).fits, "fp32 weights, grads and buckets: 75 GiB"
    views = plan_memory(config, N, replace(mixed, gradient_as_bucket_view=True))
    assert views.fits and views.headroom > 5 * GIB
    assert suggestions(config, N, replace(eight, precision="bf16")) == []


def test_nothing_fits_7b_on_24gb_cards_under_ddp(config: LlamaConfig) -> None:
    cards = PlanSettings(world_size=8, micro_batch=1, seq_length=512, device_memory_gib=24)
    advice = suggestions(config, N, cards)
    assert len(advice) == 1
    assert advice[0].startswith("no combination fits in 24 GiB")


def test_flops_per_token_of_7b_at_512(config: LlamaConfig) -> None:
    expected = 6 * N + 12 * 32 * 4096 * 512
    assert model_flops_per_token(N, 32, 4096, 512) == expected
    assert plan_memory(config, N, ONE_GPU).flops_per_token == expected


def test_tables_name_every_row(config: LlamaConfig) -> None:
    plan = plan_memory(config, N, ONE_GPU)
    table = plan.table()
    for row in ("weights", "gradients", "DDP buckets", "optimizer state", "activations"):
        assert f"| {row}" in table
    assert "overhead" in table and "total (peak, at optimizer step)" in table
    assert "does not fit, 71.6 GiB short" in table
    assert comparison_table([plan]).count("\n") == 2


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"precision": "fp16"}, "precision 'fp16'"),
        ({"micro_batch": 0}, "micro_batch must be at least 1"),
        ({"device_memory_gib": 0.0}, "device_memory_gib"),
    ],
)
def test_bad_settings_raise_user_error(change: dict[str, object], message: str) -> None:
    with pytest.raises(UserError, match=message):
        replace(ONE_GPU, **change)


def test_sequence_longer_than_positions_raises(config: LlamaConfig) -> None:
    with pytest.raises(UserError, match="exceeds the model's 4096 positions"):
        plan_memory(config, N, replace(ONE_GPU, seq_length=8192))
    with pytest.raises(UserError, match="decoder-only transformer config"):
        plan_memory(LlamaConfig(hidden_size=0), N, ONE_GPU)


# -------------------------------------------------------------------------------------------------
# compression state and the communication plan

BUCKET = 25 * 2**20
DCT_8X = CompressionSettings("dct", ratio=0.25, block_size=64, topk_value_dtype="bfloat16")


@pytest.fixture(scope="module")
def sizes(config: LlamaConfig) -> list[int]:
    return parameter_sizes(meta_model(config))


def test_compression_state_per_method(sizes: list[int]) -> None:
    """Residuals only where error feedback can work; payloads of every bucket in flight."""
    blocks = sum(math.ceil(size / 64) for size in sizes)
    assert state_bytes(CompressionSettings("none"), sizes, 8, BUCKET) == (0, 0)
    low = state_bytes(DCT_8X, sizes, 8, BUCKET)
    assert low == (0, blocks * 16 * 2 + 2 * BUCKET), "low-pass dct keeps no residual"
    rotating = replace(DCT_8X, selection="rotating")
    assert state_bytes(rotating, sizes, 8, BUCKET)[0] == 4 * N  # 25.1 GiB of fp32 residuals
    assert state_bytes(replace(rotating, error_feedback=False), sizes, 8, BUCKET)[0] == 0
    topk = CompressionSettings("dct-topk", topk=8, block_size=64, topk_value_dtype="bfloat16")
    pairs = blocks * 8 * 3
    assert state_bytes(topk, sizes, 8, BUCKET) == (4 * N, 9 * pairs + 2 * BUCKET)
    assert state_bytes(topk, sizes, 64, BUCKET)[1] == 65 * pairs + 2 * BUCKET
    scoped = state_bytes(replace(DCT_8X, scope="inter-node"), sizes, 8, BUCKET)
    assert scoped[1] < low[1], "node-aware scope waits per bucket: one bucket's buffers"


def test_plan_counts_compression_rows(config: LlamaConfig) -> None:
    base = PlanSettings(world_size=8, micro_batch=1, seq_length=512, zero1=True)
    base = replace(base, precision="bf16", activation_checkpointing=True)
    plain = plan_memory(config, N, base)
    more = plan_memory(config, N, replace(base, compression_state_bytes=4 * N))
    assert more.phases["optimizer step"] - plain.phases["optimizer step"] == 4 * N
    buffers = plan_memory(config, N, replace(base, compression_buffer_bytes=GIB))
    assert buffers.phases["end of backward"] - plain.phases["end of backward"] == GIB
    assert buffers.phases["end of forward"] == plain.phases["end of forward"]
    assert "compression state" in more.table() and "compression buffers" in more.table()


def test_llama2_7b_ddp_config_fits_with_its_compression_counted(config: LlamaConfig) -> None:
    """configs/llama2_7b_ddp_dct.toml ships low-pass dct: no residual, its buffers counted, it
    fits; a rotating dct (25.1 GiB of residuals) would not."""
    run = parse_config(["--config", str(REPO / "configs" / "llama2_7b_ddp_dct.toml")])
    plan, hints = plan_run(run, config, 8, 80.0)
    assert plan.fits and hints == []
    assert plan.compression_state == 0 and plan.compression_buffers > GIB
    rotating, _ = plan_run(replace(run, compression_selection="rotating"), config, 8, 80.0)
    assert rotating.compression_state == 4 * N
    assert not rotating.fits


def test_wire_ratio_of_all_reduce_methods_holds_at_64_ranks(sizes: list[int]) -> None:
    ratios = {}
    for world in (2, 8, 64):
        topo = Topology(world, 8, 2.4e12, 1e11)
        dense = estimate(CompressionSettings("none"), sizes, topo).wire_bytes
        assert dense == pytest.approx(2 * (world - 1) / world * 4 * N)
        for method in (DCT_8X, CompressionSettings("bf16")):
            ratios.setdefault(method.method, set()).add(
                round(dense / estimate(method, sizes, topo).wire_bytes, 6)
            )
        topk = CompressionSettings("dct-topk", topk=8, block_size=64, topk_value_dtype="bfloat16")
        ratios.setdefault(f"topk{world}", set()).add(dense / estimate(topk, sizes, topo).wire_bytes)
    assert ratios["dct"] == {8.0} and ratios["bf16"] == {2.0}
    assert ratios["topk64"].pop() < 1 < ratios["topk8"].pop()


def test_node_aware_scope_moves_fewer_bytes_over_the_uplink(sizes: list[int]) -> None:
    """2 nodes x 8: the uplink carries 2 (W - 1) / W * S globally, 2 (N - 1) / N * S node-aware."""
    topo = Topology(16, 8, 2.4e12, 1e11)
    payload = sum(math.ceil(size / 64) for size in sizes) * 16 * 2
    flat = estimate(DCT_8X, sizes, topo)
    aware = estimate(replace(DCT_8X, scope="inter-node"), sizes, topo)
    assert flat.uplink_bytes == pytest.approx(2 * 15 / 16 * payload)
    assert aware.uplink_bytes == pytest.approx(payload)
    assert aware.seconds < flat.seconds
    assert not aware.overlaps and flat.overlaps
    hideable = flat.seconds - flat.exposed_s  # the last DDP bucket waits for backward's end
    assert 0 < flat.exposed_s < flat.seconds
    assert predicted_step_seconds(flat, 3.0) == pytest.approx(
        1.0 + max(2.0, hideable) + flat.exposed_s
    )
    assert predicted_step_seconds(aware, 3.0) == pytest.approx(3.0 + aware.seconds)
    dense = estimate(CompressionSettings("none"), sizes, topo)
    table = communication_table(hook_rows([DCT_8X, DCT_8X], sizes, topo), dense, 3.0)
    assert "| dct 0.25 bf16 |" in table and "8x" in table
    assert table.count("| dct 0.25 bf16 |") == 1, table  # each hook once


def test_dry_run_plans_demo_all_gather_as_the_first_row(config: LlamaConfig) -> None:
    """--optimizer demo: the plan's first row is DeMo's all-gather of (index, bf16 value) pairs,
    (W - 1) x the payload at W = 8; on LLaMA-2-7B's 64 x 64 tiles with k = 32 that is about 32x
    fewer wire bytes than the dense fp32 all-reduce (vectors, in 64-element chunks, send half)."""
    run = parse_config(["--optimizer", "demo", "--plan-world-size", "8"])
    shapes = trained_shapes(run, config)
    assert sum(math.prod(shape) for shape in shapes) == N
    table = communication_plan(run, DistEnv(), shapes, 1e9)
    first = table.splitlines()[4].split(" | ")  # after the header, the run's line, the head
    wire = 7 * demo_payload_bytes(shapes, 32, 64, torch.bfloat16)
    assert first[0] == "| demo k=32 tile 64" and first[1] == f"{wire / 1e6:.4g}"
    ratio = float(first[3].rstrip("x"))
    assert ratio == pytest.approx(2 * 7 / 8 * 4 * N / wire, rel=1e-2)
    assert 31 < ratio <= 32 and "waits in the optimizer step" in first[6]
    adamw = communication_plan(replace(run, optimizer="adamw"), DistEnv(), shapes, 1e9)
    assert adamw.splitlines()[4].startswith("| none | ")
    assert adamw.count("| none | ") == 1, adamw  # the run's hook is not repeated among the others


# -------------------------------------------------------------------------------------------------
# LoRA and other architectures


@pytest.fixture(scope="module")
def adapters_7b(config: LlamaConfig) -> tuple[int, ...]:
    """Element counts of LoRA rank-8 adapters on every linear layer of LLaMA-2-7B (meta)."""
    peft_model = apply_lora(meta_model(config), LoraSettings())
    return tuple(trainable_parameter_sizes(peft_model))


def test_lora_7b_rows_and_fit_on_one_24gb_gpu(
    config: LlamaConfig, adapters_7b: tuple[int, ...]
) -> None:
    per_layer = 4 * 8 * (H + H) + 2 * 8 * (H + FF) + 8 * (FF + H)
    adapters = sum(adapters_7b)
    assert adapters == L * per_layer == 19_988_480
    settings = PlanSettings(
        world_size=1,
        micro_batch=4,
        seq_length=512,
        precision="bf16-mixed",
        activation_checkpointing=True,
        gradient_as_bucket_view=True,
        fused_adamw=True,
        device_memory_gib=24,
        adapter_sizes=adapters_7b,
    )
    plan = plan_memory(config, N, settings)
    assert plan.weights == 2 * N + 4 * adapters, "frozen bf16 base, fp32 adapters"
    assert (plan.gradients, plan.ddp_buckets) == (4 * adapters, 0)
    assert plan.optimizer_state == 8 * adapters
    assert plan.optimizer_step_temporaries == 0
    assert plan.autocast_weight_copies == 2 * adapters, "only the adapters are cast"
    checkpointed = TOKENS * (L * 2 * H + 8 * H + 4 + 12 * V)
    assert plan.activations == checkpointed, "bf16 residual stream per layer, the loss"
    assert plan.approximate == ("activations",)
    assert plan.fits and plan.total < 16 * GIB
    assert plan_memory(config, N, replace(settings, device_memory_gib=24e9 / GIB)).fits, "24 GB"
    assert "| weights (frozen bf16 base + fp32 LoRA adapters) | 12.63 |" in plan.table()
    assert "| activations (per micro-batch, with the loss) (approximate) |" in plan.table()
    full = plan_memory(config, N, replace(settings, adapter_sizes=()))
    assert not full.fits and suggestions(config, N, settings) == []


def test_lora_zero1_partitions_only_the_adapters(
    config: LlamaConfig, adapters_7b: tuple[int, ...]
) -> None:
    settings = replace(ONE_GPU, world_size=4, zero1=True, adapter_sizes=adapters_7b)
    plan = plan_memory(config, N, settings)
    assert plan.optimizer_state == 8 * zero_shard(sum(adapters_7b), 4, adapters_7b)
    assert plan.optimizer_state < 8 * sum(adapters_7b) / 3
    assert plan.weights == 4 * N + 4 * sum(adapters_7b), "fp32 LoRA keeps an fp32 base"


@pytest.mark.parametrize("name", TINY_MODELS)
def test_other_architectures_are_planned_from_their_own_sizes(name: str) -> None:
    model_config = AutoConfig.from_pretrained(tiny_model_path(name))
    model = meta_model(model_config)
    sizes = parameter_sizes(model)
    plan = plan_memory(model_config, sum(sizes), replace(ONE_GPU, seq_length=64), sizes)
    arch = architecture(model_config)
    expected_ffn = {"gpt2": 4 * 64, "qwen2": 128, "mistral": 128, "mixtral": 128}[name]
    assert arch.intermediate == expected_ffn
    assert arch.ffn_matrices == (2 if name == "gpt2" else 3)
    assert arch.tied_embeddings == (name in ("gpt2", "qwen2"))
    assert plan.weights == 4 * sum(sizes), "weights are counted on the meta model"
    assert (plan.approximate == ()) == (name in ("qwen2", "mistral"))
    if name == "mixtral":
        assert (arch.experts, arch.experts_per_token, arch.active_intermediate) == (4, 2, 256)
    embeddings = 32000 * 64 * (1 if arch.tied_embeddings else 2) + (
        128 * 64 if name == "gpt2" else 0
    )
    matrices = sum(p.numel() for p in model.parameters() if p.ndim >= 2) - embeddings
    assert arch.layers * arch.layer_linear_parameters() == matrices, "what autocast casts"


def test_active_parameters_of_a_mixture_of_experts() -> None:
    model_config = AutoConfig.from_pretrained(tiny_model_path("mixtral"))
    model = meta_model(model_config)
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    total = parameter_count(model)
    assert active_parameter_count(model, model_config) == total - experts // 2
    dense = meta_model(AutoConfig.from_pretrained(tiny_model_path("mistral")))
    assert active_parameter_count(dense, dense.config) == parameter_count(dense)


def test_fit_check_never_refuses_a_config_without_decoder_sizes(
    caplog: pytest.LogCaptureFixture,
) -> None:
    odd = PretrainedConfig(vocab_size=100)
    assert missing_sizes(odd) == ["num_hidden_layers", "hidden_size", "num_attention_heads"]
    run = TrainConfig(device_memory_gib=1.0)
    with caplog.at_level("WARNING", logger="torchrun_ddp"):
        check_fits(run, odd, DistEnv())
    assert "no memory plan: the model config lacks num_hidden_layers" in caplog.text


# -------------------------------------------------------------------------------------------------
# FLOPs per token against torch's FLOP counter


@pytest.mark.parametrize(
    ("path", "seq_length"),
    [
        (REPO / "configs" / "llama-tiny" / "config.json", 256),
        *((tiny_model_path(name), 64) for name in ("gpt2", "qwen2", "mixtral")),
    ],
)
def test_flops_per_token_match_torchs_flop_counter(path: Path, seq_length: int) -> None:
    """6 N (matmul parameters: no looked-up embedding tables) + 12 L H T is within 5% of what
    FlopCounterMode counts for one forward and backward (untied LLaMA, tied GPT-2 with learned
    positions, tied Qwen2, Mixtral's 2-of-4 experts)."""
    model_config = AutoConfig.from_pretrained(path)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(model_config, attn_implementation="sdpa")
    ids = torch.randint(0, model_config.vocab_size, (1, seq_length))
    with FlopCounterMode(display=False) as counter:
        model(input_ids=ids, labels=ids).loss.backward()
    counted = counter.get_total_flops() / seq_length
    n = matmul_parameter_count(model, model_config)
    layers, hidden = model_config.num_hidden_layers, model_config.hidden_size
    assert model_flops_per_token(n, layers, hidden, seq_length) == pytest.approx(counted, rel=0.05)
    assert n < parameter_count(model) or model_config.tie_word_embeddings


def test_lora_flops_per_token_match_torchs_flop_counter() -> None:
    """Under LoRA the frozen base costs 4 FLOPs per parameter per token (forward and input
    gradient, no weight gradient) and the adapters 6: 4 F + 6 N_adapters + 12 L H T is within 5%
    of FlopCounterMode's count for one forward and backward of the hidden-64 LLaMA."""
    model_config = AutoConfig.from_pretrained(tiny_model_path("llama"))
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(model_config, attn_implementation="sdpa")
    frozen = matmul_parameter_count(base, model_config)
    model = apply_lora(
        base, LoraSettings(rank=8, alpha=16, dropout=0.0, target_modules=("q_proj", "v_proj"))
    )
    adapters = sum(trainable_parameter_sizes(model))
    ids = torch.randint(0, model_config.vocab_size, (1, 64))
    with FlopCounterMode(display=False) as counter:
        model(input_ids=ids, labels=ids).loss.backward()
    counted = counter.get_total_flops() / 64
    layers, hidden = model_config.num_hidden_layers, model_config.hidden_size
    predicted = model_flops_per_token(adapters, layers, hidden, 64, frozen=frozen)
    assert predicted == pytest.approx(counted, rel=0.05)
    full = model_flops_per_token(frozen, layers, hidden, 64)
    assert predicted < 0.8 * full


def _tiny_llama_shapes() -> list[tuple[int, ...]]:
    config = parse_config(["--model", str(REPO / "configs/tiny-models/llama/config.json")])
    return trained_shapes(config, load_model_config(config.model))


@pytest.mark.parametrize("cap_mb", [25.0, 1.0])
def test_last_bucket_share_matches_ddps_bucket_assignment(cap_mb: float) -> None:
    """DDP's own rules: with ``bucket_cap_mb`` given (as ``wrap_ddp`` always does) its first
    bucket has the same cap as the others, and its assignment (reverse parameter order, the
    limits the reducer rebuilds with) puts the same share in the last bucket as the plan."""
    caps = _BucketCapacityConfig.create(cap_mb, None, False)
    assert caps.first_bucket_bytes_cap == caps.bucket_bytes_cap == int(cap_mb * 2**20)
    sizes = [math.prod(shape) for shape in _tiny_llama_shapes()]
    order = list(reversed(range(len(sizes))))
    buckets, _ = dist._compute_bucket_assignment_by_size(
        [torch.empty(sizes[i]) for i in order],
        [caps.first_bucket_bytes_cap, caps.bucket_bytes_cap],
        [False] * len(sizes),
        order,
    )
    assert (len(buckets) == 1) == (cap_mb == 25.0)  # 16.7 MB of gradients: one 25 MiB bucket
    last = sum(sizes[i] for i in buckets[-1]) / sum(sizes)
    assert last_bucket_share(sizes, cap_mb * 2**20) == pytest.approx(last)


def test_an_overlapping_hook_cannot_hide_its_last_bucket() -> None:
    """Tiny LLaMA (16.7 MB of gradients, one 25 MiB bucket), 2 nodes x 2 at 100 Mbit/s: none
    of the dct exchange hides behind backward; LLaMA-2-7B's last bucket (its embedding) holds
    about 2% of the bytes."""
    shapes = _tiny_llama_shapes()
    sizes = [math.prod(shape) for shape in shapes]
    comm = estimate(DCT_8X, sizes, Topology(4, 2, 1e10, 1e8), shapes)
    assert comm.overlaps and comm.exposed_s == pytest.approx(comm.seconds)
    assert predicted_step_seconds(comm, 0.3) == pytest.approx(0.3 + comm.seconds)
    small = estimate(DCT_8X, sizes, Topology(4, 2, 1e10, 1e8), shapes, bucket_bytes=2**20)
    assert 0 < small.exposed_s < small.seconds
    expected = 0.1 + max(0.2, small.seconds - small.exposed_s) + small.exposed_s
    assert predicted_step_seconds(small, 0.3) == pytest.approx(expected)
    llama = parameter_sizes(meta_model(llama2_7b_config()))
    assert last_bucket_share(llama) == pytest.approx(32000 * 4096 / sum(llama))


def test_powersgd_plan_counts_the_hooks_factors_exactly() -> None:
    """The plan's PowerSGD values follow torch's own ``_should_compress`` per tensor (viewed as
    ``[shape[0], -1]``; 1-D tensors are never compressed), and agree with the P and Q slices of
    this package's per-bucket memories (``powersgd_slices``)."""
    shapes = [*_tiny_llama_shapes(), (8, 4, 3, 3), (3, 2)]
    expected = 0
    for shape in shapes:
        n, m = shape[0], math.prod(shape) // shape[0]
        squeeze, whole, factors = _should_compress(n, m, min(n, m, 4), POWERSGD_MIN_RATE)
        expected += factors if len(shape) > 1 and squeeze else whole
    assert powersgd_numel(shapes, 4) == expected
    slices = powersgd_slices(shapes, list(range(len(shapes))), 4, POWERSGD_MIN_RATE)
    compressed = {index for index, _, _ in slices[0]}
    whole = sum(math.prod(s) for i, s in enumerate(shapes) if i not in compressed)
    factors = sum(length for part in slices for _, _, length in part)
    assert expected == factors + whole
    assert 32000 * 4 in {length for _, _, length in slices[0]}  # the embedding's P [32000, 4]
    sizes = [math.prod(shape) for shape in shapes]
    settings = CompressionSettings("powersgd", powersgd_rank=4)
    exact = estimate(settings, sizes, Topology(4, 2, 1e10, 1e8), shapes)
    assert exact.wire_bytes == pytest.approx(wire_bytes("all_reduce", (factors + whole) * 4, 4))


ONE_B = REPO / "configs" / "llama-1b" / "config.json"


def test_fused_loss_replaces_the_logits_by_its_gradients_and_one_chunk() -> None:
    """Liger's fused loss holds no [B, T, V] logits: during forward the hidden states' gradient
    [B T, H] and lm_head's [V, H] (fp32 under DDP's bf16-mixed) and one [C, V] chunk of bf16
    logits, C = 1024 for 16,384 tokens at H 2048, V 32,000; at backward the two gradients."""
    config = load_model_config(str(ONE_B))
    plain = PlanSettings(world_size=1, micro_batch=8, seq_length=2048, precision="bf16-mixed")
    fused = replace(plain, fused_loss=True)
    tokens, hidden, vocab = 8 * 2048, 2048, 32000
    arch = architecture(config)
    grads = 4 * tokens * hidden + 4 * vocab * hidden
    assert fused_loss_bytes(arch, fused, "bf16-mixed") == (grads + 2 * 1024 * vocab, grads)
    plain_plan = plan_memory(config, 1_100_048_384, plain)
    fused_plan = plan_memory(config, 1_100_048_384, fused)
    assert plain_plan.activations - fused_plan.activations == 12 * tokens * vocab - grads
    forward = "end of forward"
    saved = 10 * tokens * vocab - grads - 2 * 1024 * vocab
    assert plain_plan.phases[forward] - fused_plan.phases[forward] == saved
    assert "fused loss" in fused_plan.describe()


def test_fused_loss_under_fsdp_and_lora_holds_bf16_and_no_head_gradient() -> None:
    """FSDP2's bf16-mixed computes with bf16 hidden states and a bf16 gathered head; LoRA's
    frozen head gets no gradient."""
    config = load_model_config(str(ONE_B))
    arch = architecture(config)
    tokens, hidden, vocab = 8 * 2048, 2048, 32000
    fsdp = PlanSettings(1, 8, 2048, precision="bf16-mixed", data_parallel="fsdp", fused_loss=True)
    assert fused_loss_bytes(arch, fsdp, "bf16")[1] == 2 * tokens * hidden + 2 * vocab * hidden
    lora = replace(fsdp, data_parallel="ddp", adapter_sizes=(8,))
    assert fused_loss_bytes(arch, lora, "bf16")[1] == 2 * tokens * hidden


@pytest.mark.parametrize(
    ("flags", "fused"),
    [
        ((), True),
        (("--device", "cpu"), False),
        (("--fused-loss", "none"), False),
        (("--model", str(REPO / "configs" / "tiny-models" / "gpt2" / "config.json")), False),
    ],
)
def test_a_plan_for_a_gpu_counts_the_fused_loss_that_auto_picks(
    flags: tuple[str, ...], fused: bool
) -> None:
    """--fused-loss auto plans Liger's loss for LLaMA on a GPU (any --device but cpu), and the
    logits for --device cpu, --fused-loss none and model types auto leaves alone."""
    run = parse_config(["--model", str(ONE_B), "--init", "random", "--seq-length", "64", *flags])
    plan, _ = plan_run(run, load_model_config(run.model), 1, 80.0)
    assert plan.settings.fused_loss is fused


def test_the_7b_config_file_is_the_packaged_llama2_7b(config: LlamaConfig) -> None:
    """configs/llama2-7b/config.json (random-init runs without the hub) has LLaMA-2-7B's
    shape and parameter count."""
    local = load_model_config(str(REPO / "configs" / "llama2-7b" / "config.json"))
    assert architecture(local) == architecture(config)
    expected = {**config.to_dict(), "architectures": ["LlamaForCausalLM"]}
    assert {**local.to_dict(), "_name_or_path": ""} == expected
    assert parameter_count(meta_model(local)) == N
