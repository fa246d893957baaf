"""DiLoCo and SparseLoCo (optim/local_updates.py): their algebra, rank agreement, exact
resume in the middle of a window, payload bytes and the one-line refusals.

The distributed checks share two spawns of real gloo processes: two ranks run the algebra
(DiLoCo at H = 1 against a hand-written loop that averages the parameters after every AdamW
step; SparseLoCo that sends everything against DiLoCo with plain outer SGD), 9 steps of a small
DDP model with gradient accumulation (3 windows), a checkpoint round trip in the middle of a
window through ``checkpoint.save_checkpoint`` / ``load_checkpoint``, and the real trainer
(stop-and-resume in a window, LoRA, bf16, the comm_bytes metric); then one rank resumes the
trainer's mid-window checkpoint at another world size.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from distributed_harness import (
    SMALL_LLAMA,
    SMALL_TOKENIZER,
    logged_losses,
    run_distributed,
    tiny_args,
)
from local_update_helpers import LocalUpdates, build_local_updates, memory_rows
from tiny_models import (
    accumulate_local_batches,
    digest,
    flat_parameters,
    random_gradients,
    random_parameters,
    small_mlp,
    train_in_group,
)
from torch.nn.parallel import DistributedDataParallel

from torchrun_ddp.build import Trainer
from torchrun_ddp.checkpoint import ModelAndOptimizer, load_checkpoint, save_checkpoint
from torchrun_ddp.compression import (
    CompressionState,
    register_local_gradients,
    sparseloco_payload_bytes,
    wire_bytes,
)
from torchrun_ddp.compression.wire import diloco_payload_bytes
from torchrun_ddp.config_io import parse_config
from torchrun_ddp.distributed import DistEnv
from torchrun_ddp.dry_run import dry_run
from torchrun_ddp.inputs import prepare_inputs
from torchrun_ddp.main import start
from torchrun_ddp.optim import (
    LocalUpdateSettings,
    RankState,
    SyncedState,
    parameter_groups,
)
from torchrun_ddp.optim.sparseloco_codec import (
    dequantize,
    pack_bits,
    quantize,
    unpack_bits,
)

WORLD = 2
SHAPES = [(24, 40), (130,), (7,)]
"""Parameters of the algebra checks: one 24 x 40 chunk, a vector in chunks of 26, a prime."""
H = 3
STEPS = 3 * H
RESUME_AT = H + 1
"""A checkpoint one step into the second window: local parameters differ between ranks."""
SPARSE = LocalUpdateSettings("sparseloco", H, outer_lr=1.0, outer_momentum=0.0, topk=4, chunk=8)
DILOCO = LocalUpdateSettings("diloco", H, outer_lr=0.7, outer_momentum=0.9)


def _params(seed: int) -> list[torch.nn.Parameter]:
    return random_parameters(SHAPES, seed)


def _set_grads(params: list[torch.nn.Parameter], step: int, rank: int) -> None:
    for param, grad in zip(params, random_gradients(SHAPES, step, rank), strict=True):
        param.grad = grad


def _adamw(params: list[torch.nn.Parameter]) -> torch.optim.AdamW:
    return torch.optim.AdamW(params, lr=0.05, weight_decay=0.1)


def _gap(first: list[torch.Tensor], second: list[torch.Tensor]) -> float:
    pairs = zip(first, second, strict=True)
    return max(float((a.detach() - b.detach()).abs().max()) for a, b in pairs)


def _h1_is_averaging(rank: int) -> dict[str, float]:
    """DiLoCo at H = 1, outer lr 1, no momentum, against AdamW followed by an all-reduce mean of
    the parameters (hand-written); and against AdamW without any averaging (must differ)."""
    settings = LocalUpdateSettings("diloco", 1, outer_lr=1.0, outer_momentum=0.0)
    ours, theirs, alone = _params(0), _params(0), _params(0)
    wrapped, adamw, lonely = LocalUpdates(_adamw(ours), settings), _adamw(theirs), _adamw(alone)
    for step in range(5):
        for params in (ours, theirs, alone):
            _set_grads(params, step, rank)
        wrapped.step()
        adamw.step()
        lonely.step()
        for param in theirs:  # the hand-written loop: average the parameters after each step
            dist.all_reduce(param.detach())
            param.detach().div_(WORLD)
    return {"gap": _gap(ours, theirs), "without_averaging": _gap(ours, alone)}


def _sparse_sends_all_is_diloco(rank: int) -> dict[str, object]:
    """SparseLoCo with k = chunk size, fp32 values and beta 0 against DiLoCo with plain outer SGD
    at the same outer lr, over 3 windows of 2 steps."""
    common = {"outer_lr": 0.5, "outer_momentum": 0.0}
    sparse = LocalUpdateSettings(
        "sparseloco", 2, topk=64 * 64, chunk=64, beta=0.0, quant_bits=0, **common
    )
    dense = LocalUpdateSettings("diloco", 2, **common)
    first, second, start = _params(1), _params(1), _params(1)
    one, two = LocalUpdates(_adamw(first), sparse), LocalUpdates(_adamw(second), dense)
    for step in range(6):
        _set_grads(first, step, rank)
        _set_grads(second, step, rank)
        one.step()
        two.step()
    return {
        "equal": all(torch.equal(a, b) for a, b in zip(first, second, strict=True)),
        "gap": _gap(first, second),
        "moved": _gap(first, start),
        "error_left": max(float(e.abs().max()) for e in one.error),
    }


Trained = tuple[DistributedDataParallel, LocalUpdates, CompressionState]


def _build(seed: int, settings: LocalUpdateSettings) -> Trained:
    ddp = DistributedDataParallel(small_mlp(seed))
    state = register_local_gradients(ddp)
    inner = torch.optim.AdamW(parameter_groups(ddp.module, 0.1), lr=0.01)
    return ddp, build_local_updates(inner, settings, state), state


def _train(trained: Trained, rank: int, steps: range) -> list[dict[str, object]]:
    """Steps of 2 accumulated micro-batches (the first under ``no_sync``) of this rank's own
    data; per step the byte counts and the parameters after it."""
    ddp, optimizer, state = trained
    out = []
    for step in steps:
        accumulate_local_batches(ddp, step, rank)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        out.append(
            {"bytes": state.pop_step_bytes()._asdict(), "params": flat_parameters(ddp.module)}
        )
    return out


def _kept(optimizer: LocalUpdates) -> dict[str, torch.Tensor]:
    """Every tensor of the optimizer's state, named, for bit-for-bit comparisons."""
    tensors = {f"synced.{i}": t for i, t in enumerate(optimizer.synced)}
    tensors.update({f"error.{i}": t for i, t in enumerate(optimizer.error)})
    for index, param in enumerate(optimizer.trained):
        for key, value in optimizer.inner.state[param].items():
            tensors[f"inner.{index}.{key}"] = value
        momentum = optimizer.outer.state.get(optimizer.synced[index], {})
        tensors.update({f"outer.{index}.{k}": v for k, v in momentum.items()})
    return {name: tensor.detach().reshape(-1).clone() for name, tensor in tensors.items()}


def _windows_and_resume(rank: int, root: str, settings: LocalUpdateSettings) -> dict[str, object]:
    """3 windows with a checkpoint at step H + 1; a fresh model and optimizer (another init)
    load it and redo the remaining steps."""
    trained = _build(seed=5, settings=settings)
    ddp, optimizer, _ = trained
    steps = _train(trained, rank, range(RESUME_AT))
    shared = {"train": ModelAndOptimizer(ddp, None), "outer": SyncedState(optimizer)}
    per_rank = {"optimizer": RankState(optimizer).state_dict()}
    folder = Path(root) / settings.method
    path = save_checkpoint(folder, RESUME_AT, shared, per_rank, {}, keep=1)
    steps += _train(trained, rank, range(RESUME_AT, STEPS + 1))
    again = _build(seed=6, settings=settings)
    fresh, fresh_optimizer, _ = again
    loaded = {"train": ModelAndOptimizer(fresh, None), "outer": SyncedState(fresh_optimizer)}
    saved = load_checkpoint(path, loaded)
    assert saved is not None
    RankState(fresh_optimizer).load_state_dict(saved["optimizer"])
    _train(again, rank, range(RESUME_AT, STEPS + 1))
    return {
        "steps": steps,
        "final": flat_parameters(ddp.module),
        "resumed": flat_parameters(fresh.module),
        "state": digest(_kept(optimizer)),
        "resumed_state": digest(_kept(fresh_optimizer)),
        "payload": optimizer.payload_bytes(),
        "shapes": [tuple(p.shape) for p in optimizer.trained],
    }


def _trainer_args(data: str, output: Path, *extra: str) -> list[str]:
    """The tiny LLaMA (hidden 64) on 2 x 16-token micro-batches, accumulation 2, a log line per
    step and a checkpoint every 4 steps."""
    return tiny_args(
        Path(data), output,
        "--model", str(SMALL_LLAMA), "--seq-length", "16", "--batch-size", "2",
        "--accumulation-steps", "2", "--warmup-steps", "2", "--log-every", "1",
        "--eval-every", "0", "--eval-batches", "1", "--checkpoint-every", "4",
        *extra, tokenizer=SMALL_TOKENIZER,
    )  # fmt: skip


SPARSE_FLAGS = (
    "--optimizer", "sparseloco", "--local-steps", str(H), "--sparseloco-topk", "8",
    "--precision", "bf16",
)  # fmt: skip
END = 2 * H + 1
"""The trainer runs end one step into their third window."""


def _trainer_state(trainer: Trainer) -> dict[str, object]:
    optimizer = trainer.optimizer
    assert isinstance(optimizer, LocalUpdates)
    return {
        "model": digest(dict(trainer.model.module.named_parameters())),
        "optimizer": digest(_kept(optimizer)),
        "synced": digest({str(i): t for i, t in enumerate(optimizer.synced)}),
        "position": optimizer.position,
        "payload": optimizer.payload_bytes(),
        "shapes": [tuple(p.shape) for p in optimizer.trained],
    }


def _trainer_runs(rank: int, data: str, root: Path) -> dict[str, object]:
    """The real trainer, SparseLoCo on bf16 parameters: 7 steps straight; 4 steps, stop, resume
    to 7 (a checkpoint at step 4, one step into the second window); and one window of DiLoCo
    under LoRA."""
    runs: dict[str, object] = {}
    straight = _trainer_args(data, root / "straight", *SPARSE_FLAGS, "--max-steps", str(END))
    runs["straight"] = _trainer_state(train_in_group(rank, WORLD, straight, export=False))
    resumed = _trainer_args(data, root / "resumed", *SPARSE_FLAGS)
    train_in_group(rank, WORLD, [*resumed, "--max-steps", str(RESUME_AT)], export=False)
    trainer = train_in_group(rank, WORLD, [*resumed, "--max-steps", str(END)], export=False)
    runs["resumed"] = _trainer_state(trainer)
    lora = ("--optimizer", "diloco", "--local-steps", str(H), "--peft", "lora")
    lora_args = _trainer_args(data, root / "lora", *lora, "--max-steps", str(H))
    runs["lora"] = _trainer_state(train_in_group(rank, WORLD, lora_args, export=False))
    return runs


def _worker(rank: int, world_size: int, root: str, data: str) -> dict[str, object]:
    assert world_size == WORLD and dist.get_world_size() == WORLD
    return {
        "h1": _h1_is_averaging(rank),
        "sparse_is_diloco": _sparse_sends_all_is_diloco(rank),
        "sparse": _windows_and_resume(rank, root, SPARSE),
        "diloco": _windows_and_resume(rank, root, DILOCO),
        "trainer": _trainer_runs(rank, data, Path(root)),
    }


def _elastic_worker(rank: int, world_size: int, root: str, data: str) -> dict[str, object]:
    """One rank resumes the 2-rank trainer's step-4 checkpoint (one step into a window)."""
    checkpoint = Path(root) / "straight" / "checkpoints" / f"step-{RESUME_AT}"
    argv = [*_trainer_args(data, Path(root) / "elastic", *SPARSE_FLAGS), "--max-steps", "6"]
    config = parse_config([*argv, "--resume-from", str(checkpoint)])
    env = DistEnv(rank=rank, world_size=world_size, local_rank=rank, local_world_size=world_size)
    trainer = start(config, env, torch.device("cpu"), prepare_inputs(config, env))
    optimizer = trainer.optimizer
    assert isinstance(optimizer, LocalUpdates)
    pairs = zip(optimizer.trained, optimizer.synced, strict=True)
    return {
        "step": trainer.step,
        "position": optimizer.position,
        "from_synced": all(torch.equal(p.detach(), s.to(p.dtype)) for p, s in pairs),
        "error_zero": all(not e.any() for e in optimizer.error),
        "inner_steps": {float(s["step"]) for s in optimizer.inner.state.values()},
    }


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("local-updates")


@pytest.fixture(scope="module")
def ranks(root: Path, sample_data: Path) -> list[dict]:
    return run_distributed(_worker, WORLD, str(root), str(sample_data), timeout=400)


@pytest.fixture(scope="module")
def elastic(ranks: list[dict], root: Path, sample_data: Path) -> dict:
    return run_distributed(_elastic_worker, 1, str(root), str(sample_data), timeout=200)[0]


def test_diloco_h1_without_momentum_is_parameter_averaging(ranks: list[dict]) -> None:
    for result in ranks:
        assert result["h1"]["gap"] < 1e-6, "synced - mean(synced - local) = mean(local)"
        assert result["h1"]["without_averaging"] > 1e-3, "the ranks' data differ: averaging shows"


def test_sparseloco_sending_everything_is_diloco_with_plain_sgd(ranks: list[dict]) -> None:
    for result in ranks:
        check = result["sparse_is_diloco"]
        assert check["equal"], f"max gap {check['gap']}"
        assert check["moved"] > 1e-3 and check["error_left"] == 0.0


@pytest.mark.parametrize("method", ["sparse", "diloco"])
def test_ranks_are_bit_identical_after_every_sync(ranks: list[dict], method: str) -> None:
    first, second = ranks[0][method]["steps"], ranks[1][method]["steps"]
    for step in range(STEPS):
        same = torch.equal(first[step]["params"], second[step]["params"])
        assert same == ((step + 1) % H == 0), f"step {step + 1}: synced iff a window ended"
    assert not torch.equal(first[0]["params"], first[STEPS - 1]["params"]), "training moved"


@pytest.mark.parametrize("method", ["sparse", "diloco"])
def test_resume_in_the_middle_of_a_window_is_bit_exact(ranks: list[dict], method: str) -> None:
    for result in ranks:
        run = result[method]
        assert torch.equal(run["resumed"], run["final"])
        assert run["resumed_state"] == run["state"]


@pytest.mark.parametrize("method", ["sparse", "diloco"])
def test_bytes_are_counted_in_the_sync_steps_and_match_the_formula(
    ranks: list[dict], method: str
) -> None:
    run = ranks[0][method]
    numel = sum(math.prod(shape) for shape in run["shapes"])
    if method == "sparse":
        formula = sparseloco_payload_bytes(run["shapes"], 4, 8, 2)
        wire = wire_bytes("all_gather", formula, WORLD)
    else:
        formula = diloco_payload_bytes(numel, torch.float32)
        wire = wire_bytes("all_reduce", formula, WORLD)
    assert run["payload"] == formula
    for step, counted in enumerate(run["steps"]):
        sync = (step + 1) % H == 0
        assert counted["bytes"]["collective"] == (formula if sync else 0)
        assert counted["bytes"]["wire"] == (round(wire) if sync else 0)
        assert counted["bytes"]["dense"] == round(wire_bytes("all_reduce", 4 * numel, WORLD))


def test_trainer_stop_and_resume_in_a_window_is_bit_exact(ranks: list[dict], root: Path) -> None:
    for result in ranks:
        straight, resumed = result["trainer"]["straight"], result["trainer"]["resumed"]
        assert straight["position"] == END % H != 0, "the run ends inside a window"
        assert resumed == straight
    assert logged_losses(root / "resumed") == logged_losses(root / "straight")
    first, second = (result["trainer"]["straight"] for result in ranks)
    assert first["model"] != second["model"], "inside a window the ranks' parameters differ"
    assert first["synced"] == second["synced"]


def test_lora_trains_and_syncs_only_the_adapters(ranks: list[dict]) -> None:
    first, second = (result["trainer"]["lora"] for result in ranks)
    assert first["position"] == 0 and first["model"] == second["model"]
    assert all(len(shape) == 2 and min(shape) == 8 for shape in first["shapes"]), "rank-8 A, B"


def test_comm_bytes_metric_counts_the_payload_in_sync_steps(ranks: list[dict], root: Path) -> None:
    trained = ranks[0]["trainer"]["straight"]
    payload = sparseloco_payload_bytes(trained["shapes"], 8, 64, 2)
    assert trained["payload"] == payload
    lines = (root / "straight" / "metrics.jsonl").read_text().splitlines()
    records = [r for r in map(json.loads, lines) if "loss" in r]
    assert [r["step"] for r in records] == list(range(1, END + 1))
    for record in records:
        sync = record["step"] % H == 0
        assert record["comm_bytes_collective"] == (payload if sync else 0)
        assert record["comm_bytes"] == (payload if sync else 0), "W = 2: (W - 1) x payload"
        assert ("compression_ratio" in record) == sync


def test_resume_at_another_world_size_restarts_the_window_from_synced(elastic: dict) -> None:
    assert elastic["step"] == RESUME_AT and elastic["position"] == RESUME_AT % H
    assert elastic["from_synced"] and elastic["error_zero"]
    assert elastic["inner_steps"] == {float(RESUME_AT)}, "old rank 0's AdamW state"


# -------------------------------------------------------------------------------------------------
# single process


def test_sparseloco_payload_formula() -> None:
    # 4096 x 4096 in 64 x 64 chunks: 64 positions of 12 bits, 64 codes of 2 bits, a 4-byte scale
    assert sparseloco_payload_bytes([(4096, 4096)], 64, 64, 2) == 4096 * (96 + 16 + 4)
    # no quantization: fp32 values; a 64-vector is one chunk with 6-bit positions
    assert sparseloco_payload_bytes([(64,)], 8, 64, 0) == 6 + 8 * 4
    # k is capped at the chunk (a prime length is one chunk of itself), 3-bit positions
    assert sparseloco_payload_bytes([(7,)], 64, 64, 2) == 3 + 2 + 4
    dense8 = wire_bytes("all_reduce", 4 * 4096 * 4096, 8)
    sync8 = wire_bytes("all_gather", sparseloco_payload_bytes([(4096, 4096)], 64, 64, 2), 8)
    assert dense8 / sync8 == pytest.approx(2 * 4 * 4096 / (8 * 116)), "35.3x per sync at W = 8"


def test_bit_packing_round_trip() -> None:
    generator = torch.Generator().manual_seed(0)
    for bits in (1, 2, 3, 7, 12):
        values = torch.randint(0, 2**bits, (37,), generator=generator)
        packed = pack_bits(values, bits)
        assert packed.dtype == torch.uint8 and packed.numel() == (37 * bits + 7) // 8
        assert torch.equal(unpack_bits(packed, bits, 37), values)


def test_two_bit_levels_keep_the_largest_value() -> None:
    values = torch.tensor([[-3.0, -0.9, 0.4, 2.0], [0.0, 0.0, 0.0, 0.0]])
    codes, scale = quantize(values, 2)
    sent = dequantize(codes, scale, 2)
    assert torch.equal(scale, torch.tensor([3.0, 0.0]))
    assert torch.allclose(sent[0], torch.tensor([-3.0, -1.0, 1.0, 1.0]))
    assert not sent[1].any(), "an all-zero chunk sends zeros"


def test_memory_rows_count_the_extra_copies() -> None:
    shapes = [(4096, 4096), (4096,)]
    numel = 4096 * 4096 + 4096
    diloco = memory_rows(DILOCO, shapes, 8)
    assert [row.nbytes for row in diloco if row.persistent] == [4 * numel, 4 * numel]
    plain = memory_rows(LocalUpdateSettings("diloco", outer_momentum=0.0), shapes, 8)
    assert [row.nbytes for row in plain if row.persistent] == [4 * numel]
    sparse = memory_rows(SPARSE, shapes, 8)
    assert sum(row.nbytes for row in sparse if row.persistent) == 8 * numel


@pytest.mark.parametrize("world", [8, 64])
def test_dry_run_prints_sync_and_per_step_rows(world: int) -> None:
    run = parse_config(
        ["--optimizer", "sparseloco", "--local-steps", "30", "--plan-world-size", str(world)]
    )
    env = DistEnv(rank=0, world_size=1, local_rank=0, local_world_size=1)
    text = dry_run(run, env)  # LLaMA-2-7B, the default --model
    rows = [line.split(" | ") for line in text.splitlines() if line.startswith("| sparseloco")]
    sync, per_step = rows[-2], rows[-1]
    assert "one sync" in sync[0] and "per step (sync / 30)" in per_step[0]
    assert float(sync[1]) == pytest.approx(30 * float(per_step[1]), rel=1e-3)
    assert "| demo k=32 tile 64" in text and "| none |" in text
    assert "error feedback (fp32, per rank) (kept) | 25.10" in text, "7B: 6.74e9 x 4 B"
