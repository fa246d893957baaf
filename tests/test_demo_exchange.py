"""Node-aware DeMo (``--compression-scope inter-node``) and the overlapped exchange
(``--overlap-exchange``) on 4 real gloo ranks laid out as 2 nodes x 2 ranks.

- node-aware: ranks bit-identical, uplink bytes as the formula, equal to flat DeMo where the
  algorithm is unchanged (everything sent in fp32 without the sign: within float rounding; one
  rank per node: bit for bit);
- overlap: with gradients that do not depend on the parameters it is flat DeMo one step late, so
  after :meth:`DeMo.flush` the parameters are flat DeMo's bit for bit (nothing is lost at the
  end); a checkpoint taken with an update in flight resumes bit-exactly, in the optimizer and in
  the real trainer.
"""

from __future__ import annotations

import gzip
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
from local_update_helpers import build_local_updates
from safetensors import safe_open
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
    register_local_gradients,
)
from torchrun_ddp.compression.settings import CompressionSettings
from torchrun_ddp.compression.wire import demo_payload_bytes, sparseloco_payload_bytes, wire_bytes
from torchrun_ddp.config_io import parse_config
from torchrun_ddp.distributed import DistEnv, NodeGroups, new_node_groups
from torchrun_ddp.errors import UserError
from torchrun_ddp.optim import (
    DeMo,
    DemoSettings,
    LocalMomentum,
    LocalUpdateSettings,
    parameter_groups,
)
from torchrun_ddp.optim.exchange import MessageExchange, assign_owners
from torchrun_ddp.plan.architecture import llama2_7b_config
from torchrun_ddp.plan.communication import (
    Topology,
    demo_estimate,
    estimate,
    predicted_step_seconds,
)
from torchrun_ddp.planning import trained_shapes

WORLD, PER_NODE = 4, 2
NODES = WORLD // PER_NODE
STEPS, SAVE_AT = 6, 3
SHAPES = [(24, 40), (130,), (7,)]
TOPK8 = DemoSettings(topk=8)
SEND_ALL = DemoSettings(beta=0.9, topk=64 * 64, value_dtype="float32", sign=False)


def _groups(rank: int, per_node: int) -> NodeGroups:
    env = DistEnv(
        rank=rank, world_size=WORLD, local_rank=rank % per_node, local_world_size=per_node
    )
    return new_node_groups(env)


def _build(
    seed: int, settings: DemoSettings, groups: NodeGroups | None, overlap: bool = False
) -> tuple[DistributedDataParallel, DeMo]:
    ddp = DistributedDataParallel(small_mlp(seed))
    state = register_local_gradients(ddp, node_groups=groups)
    params = parameter_groups(ddp.module, 0.1)
    demo = DeMo(params, 0.01, settings, counter=state.count, node_groups=groups, overlap=overlap)
    return ddp, demo


def _train(ddp: DistributedDataParallel, demo: DeMo, rank: int, steps: range) -> None:
    for step in steps:
        accumulate_local_batches(ddp, step, rank)
        demo.step()
        demo.zero_grad(set_to_none=True)


def _run(rank: int, settings: DemoSettings, groups: NodeGroups | None) -> dict[str, object]:
    """``STEPS`` DeMo steps of small_mlp from seed 5 on this rank's own data."""
    ddp, demo = _build(5, settings, groups)
    _train(ddp, demo, rank, range(STEPS))
    shapes = [tuple(p.shape) for p in ddp.module.parameters()]
    formula = demo_payload_bytes(shapes, settings.topk, settings.tile, torch.bfloat16)
    owned = sum(1 for p in demo.codecs if "delta" in demo.state[p])
    return {**_outcome(ddp, demo.exchange, formula), "owned": owned}


def _outcome(ddp: DistributedDataParallel, exchange: MessageExchange, formula: int) -> dict:
    """Parameters after the run, the exchange's bytes and share lengths, the payload formula."""
    return {
        "params": flat_parameters(ddp.module),
        "uplink": exchange.inter_node_bytes,
        "lengths": exchange.lengths,
        "padded": exchange.padded,
        "formula": formula,
    }


SPARSE = LocalUpdateSettings("sparseloco", 2, outer_lr=1.0, outer_momentum=0.0, topk=4, chunk=8)


def _sparseloco(rank: int, groups: NodeGroups | None) -> dict[str, object]:
    """SparseLoCo (H 2) on small_mlp: ``STEPS`` steps (3 syncs) of this rank's own data."""
    ddp = DistributedDataParallel(small_mlp(5))
    state = register_local_gradients(ddp, node_groups=groups)
    inner = torch.optim.AdamW(parameter_groups(ddp.module, 0.1), lr=0.01)
    optimizer = build_local_updates(inner, SPARSE, state)
    for step in range(STEPS):
        accumulate_local_batches(ddp, step, rank)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    shapes = [tuple(p.shape) for p in ddp.module.parameters()]
    formula = sparseloco_payload_bytes(shapes, SPARSE.topk, SPARSE.chunk, SPARSE.quant_bits)
    return _outcome(ddp, optimizer.exchange, formula)


def _overlap_is_flat_one_step_late(rank: int) -> bool:
    """Parameter-independent gradients and a learning rate that changes every step: overlapped
    DeMo + flush equals flat DeMo bit for bit."""
    runs = []
    for overlap in (False, True):
        params = random_parameters(SHAPES, 0)
        demo = DeMo(params, lr=0.05, settings=TOPK8, weight_decay=0.1, overlap=overlap)
        for step in range(STEPS):
            for param, grad in zip(params, random_gradients(SHAPES, step, rank), strict=True):
                param.grad = grad
            demo.param_groups[0]["lr"] = 0.05 / (1 + step)  # a delayed update keeps its own
            demo.step()
        assert demo.flush() == overlap
        runs.append(torch.cat([p.detach().reshape(-1) for p in params]))
    return torch.equal(runs[0], runs[1])


def _overlap_resume(rank: int, root: str, groups: NodeGroups) -> dict[str, torch.Tensor]:
    """Node-aware and overlapped: a checkpoint at step 3 (an update in flight), steps 4-6 on,
    and a fresh model (another init) that loads it and redoes steps 4-6."""
    ddp, demo = _build(5, TOPK8, groups, overlap=True)
    _train(ddp, demo, rank, range(SAVE_AT))
    per_rank = {"optimizer": LocalMomentum(demo).state_dict()}
    path = save_checkpoint(
        Path(root), SAVE_AT, {"train": ModelAndOptimizer(ddp, None)}, per_rank, {}, keep=1
    )
    _train(ddp, demo, rank, range(SAVE_AT, STEPS))
    demo.flush()
    fresh, fresh_demo = _build(6, TOPK8, groups, overlap=True)
    saved = load_checkpoint(path, {"train": ModelAndOptimizer(fresh, None)})
    LocalMomentum(fresh_demo).load_state_dict(saved["optimizer"])
    _train(fresh, fresh_demo, rank, range(SAVE_AT, STEPS))
    fresh_demo.flush()
    return {"straight": flat_parameters(ddp.module), "resumed": flat_parameters(fresh.module)}


def _trainer_args(data: str, output: Path, *extra: str) -> list[str]:
    return tiny_args(
        Path(data), output,
        "--model", str(SMALL_LLAMA), "--seq-length", "16", "--batch-size", "2",
        "--accumulation-steps", "2", "--warmup-steps", "2", "--log-every", "1",
        "--eval-every", "0", "--eval-batches", "1", "--checkpoint-every", str(SAVE_AT),
        "--optimizer", "demo", "--demo-topk", "8", "--compression-scope", "inter-node",
        "--overlap-exchange", "--max-steps", str(STEPS), *extra, tokenizer=SMALL_TOKENIZER,
    )  # fmt: skip


def _trainer_state(trainer: Trainer) -> dict[str, object]:
    optimizer = trainer.optimizer
    assert isinstance(optimizer, DeMo)
    return {
        "model": digest(dict(trainer.model.module.named_parameters())),
        "pending": optimizer.pending is not None,
        "step": trainer.step,
        "applied": optimizer.updates_applied,
    }


def _trainer_runs(rank: int, data: str, root: Path) -> dict[str, object]:
    """The real trainer: 6 steps straight (checkpoints at 3 and 6), and a run resumed from the
    step-3 checkpoint, which holds an update in flight, to step 6."""
    straight = train_in_group(rank, WORLD, _trainer_args(data, root / "straight"), False, PER_NODE)
    checkpoint = root / "straight" / "checkpoints" / f"step-{SAVE_AT}"
    resumed_args = _trainer_args(data, root / "resumed", "--resume-from", str(checkpoint))
    resumed = train_in_group(rank, WORLD, resumed_args, False, PER_NODE)
    flat_args = ["--resume-from", str(checkpoint), "--compression-scope", "global"]
    try:
        train_in_group(rank, WORLD, _trainer_args(data, root / "flat", *flat_args), False, 2)
        refused = ""
    except UserError as exc:
        refused = str(exc)
    few = str(root / "few.json.gz")
    data_end = [
        "--data-files", few, "--eval-files", few, "--max-steps", "-1", "--batch-size", "1",
        "--accumulation-steps", "1", "--shuffle-buffer", "0", "--checkpoint-every", "0",
    ]  # fmt: skip
    ends = train_in_group(rank, WORLD, _trainer_args(data, root / "ends", *data_end), True, 2)
    with safe_open(checkpoint / f"rank-{rank}.safetensors", "pt") as saved:
        in_flight = sorted(key for key in saved.keys() if "pending" in key)  # noqa: SIM118
    return {
        "straight": _trainer_state(straight),
        "resumed": _trainer_state(resumed),
        "in_flight": in_flight,
        "data_end": _trainer_state(ends),
        "refused": refused,
    }


def _worker(rank: int, world_size: int, root: str, data: str) -> dict[str, object]:
    assert world_size == WORLD and dist.get_world_size() == WORLD
    torch.set_num_threads(1)
    aware, one_per_node = _groups(rank, PER_NODE), _groups(rank, 1)
    return {
        "aware": _run(rank, TOPK8, aware),
        "flat": _run(rank, TOPK8, None),
        "one_per_node": _run(rank, TOPK8, one_per_node),
        "aware_all": _run(rank, SEND_ALL, aware),
        "flat_all": _run(rank, SEND_ALL, None),
        "overlap_late": _overlap_is_flat_one_step_late(rank),
        "sparse_aware": _sparseloco(rank, aware),
        "sparse_flat": _sparseloco(rank, None),
        "sparse_one_per_node": _sparseloco(rank, one_per_node),
        "overlap_resume": _overlap_resume(rank, str(Path(root) / "optimizer"), aware),
        "trainer": _trainer_runs(rank, data, Path(root)),
    }


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("demo_exchange")


@pytest.fixture(scope="module")
def ranks(root: Path, sample_data: Path) -> list[dict[str, object]]:
    texts = [" ".join(["word"] * (40 + 5 * i)) for i in range(8)]
    with gzip.open(root / "few.json.gz", "wt", encoding="utf-8") as handle:
        handle.writelines(json.dumps({"text": text}) + "\n" for text in texts)
    return run_distributed(_worker, WORLD, str(root), str(sample_data), timeout=400)


@pytest.mark.slow  # 4 spawned ranks and real trainer runs
def test_node_aware_ranks_are_bit_identical(ranks: list[dict]) -> None:
    first = ranks[0]["aware"]["params"]
    assert all(torch.equal(r["aware"]["params"], first) for r in ranks[1:])
    start = flat_parameters(small_mlp(5))
    assert not torch.equal(first, start), "the steps moved the parameters"


@pytest.mark.slow  # 4 spawned ranks and real trainer runs
def test_each_local_rank_owns_a_share_of_the_momentum(ranks: list[dict]) -> None:
    owned = [r["aware"]["owned"] for r in ranks]
    assert owned[0] + owned[1] == 4 and owned[0] > 0 and owned[1] > 0, "4 tensors, 2 shares"
    assert owned[:2] == owned[2:], "local rank j owns the same share on every node"
    assert all(r["flat"]["owned"] == 4 for r in ranks)


@pytest.mark.slow  # 4 spawned ranks and real trainer runs
def test_uplink_bytes_match_the_formula(ranks: list[dict]) -> None:
    """Per step the node's uplink carries (N - 1) x the padded share per local rank; the shares
    add up to the flat message, of which a flat ring all-gather passes W - 1 through every
    link, the uplink included."""
    aware, flat = ranks[0]["aware"], ranks[0]["flat"]
    assert sum(aware["lengths"]) == aware["formula"] == flat["padded"]
    assert aware["padded"] == max(aware["lengths"])
    node_uplink = sum(r["aware"]["uplink"] for r in ranks[:PER_NODE]) / STEPS
    assert node_uplink == PER_NODE * (NODES - 1) * aware["padded"]
    flat_uplink = wire_bytes("all_gather", flat["padded"], WORLD)
    assert flat_uplink == (WORLD - 1) * flat["padded"] > node_uplink


@pytest.mark.slow  # 4 spawned ranks and real trainer runs
@pytest.mark.parametrize(
    ("aware", "flat"), [("one_per_node", "flat"), ("sparse_one_per_node", "sparse_flat")]
)
def test_one_rank_per_node_is_flat_bit_for_bit(ranks: list[dict], aware: str, flat: str) -> None:
    """DeMo and SparseLoCo: with one rank per node the node-aware exchange is the flat one."""
    for result in ranks:
        assert torch.equal(result[aware]["params"], result[flat]["params"])


@pytest.mark.slow  # 4 spawned ranks and real trainer runs
def test_sending_everything_node_aware_equals_flat(ranks: list[dict]) -> None:
    """Top-k = tile, fp32 values, no sign: both step along the mean momentum of all 4 ranks."""
    for result in ranks:
        aware, flat = result["aware_all"]["params"], result["flat_all"]["params"]
        torch.testing.assert_close(aware, flat, rtol=0, atol=1e-6)
    start = flat_parameters(small_mlp(5))
    assert float((ranks[0]["flat_all"]["params"] - start).abs().max()) > 1e-5


@pytest.mark.slow  # 4 spawned ranks and real trainer runs
def test_node_aware_with_top_k_is_another_algorithm(ranks: list[dict]) -> None:
    assert not torch.equal(ranks[0]["aware"]["params"], ranks[0]["flat"]["params"])


@pytest.mark.slow  # 4 spawned ranks and real trainer runs
def test_node_aware_sparseloco_ranks_identical_and_uplink_as_formula(ranks: list[dict]) -> None:
    """After the third sync every rank holds the same parameters; per sync the node's uplink
    carries (N - 1) x the padded share per local rank, the shares adding up to the flat
    message."""
    first = ranks[0]["sparse_aware"]
    assert all(torch.equal(r["sparse_aware"]["params"], first["params"]) for r in ranks[1:])
    assert sum(first["lengths"]) == first["formula"] == ranks[0]["sparse_flat"]["padded"]
    syncs = STEPS // SPARSE.local_steps
    node_uplink = sum(r["sparse_aware"]["uplink"] for r in ranks[:PER_NODE]) / syncs
    assert node_uplink == PER_NODE * (NODES - 1) * first["padded"]
    assert not torch.equal(first["params"], ranks[0]["sparse_flat"]["params"]), "per-node replicas"


@pytest.mark.slow  # 4 spawned ranks and real trainer runs
def test_overlap_is_flat_demo_one_step_late_and_flush_loses_nothing(ranks: list[dict]) -> None:
    assert all(result["overlap_late"] for result in ranks)


@pytest.mark.slow  # 4 spawned ranks and real trainer runs
def test_overlap_resume_with_an_update_in_flight_is_bit_exact(ranks: list[dict]) -> None:
    for result in ranks:
        assert torch.equal(
            result["overlap_resume"]["resumed"], result["overlap_resume"]["straight"]
        )
    assert all(
        torch.equal(r["overlap_resume"]["straight"], ranks[0]["overlap_resume"]["straight"])
        for r in ranks
    )


@pytest.mark.slow  # 4 spawned ranks and real trainer runs
def test_trainer_resumes_an_update_in_flight_bit_exactly(ranks: list[dict], root: Path) -> None:
    states = [result["trainer"] for result in ranks]
    assert any("rows" in key for key in states[0]["in_flight"]), "step 3 saved an update in flight"
    for state in states:
        resumed, straight = dict(state["resumed"]), dict(state["straight"])
        assert resumed.pop("applied") == STEPS - SAVE_AT + 1, "the saved one, then one per step"
        straight.pop("applied")
        assert resumed == straight
        assert state["straight"]["step"] == STEPS and not state["straight"]["pending"]
    assert len({state["straight"]["model"] for state in states}) == 1, "ranks identical"
    assert all(state["straight"]["applied"] == STEPS for state in states), "the last one too"
    straight, resumed = logged_losses(root / "straight"), logged_losses(root / "resumed")
    assert list(resumed) == list(range(SAVE_AT + 1, STEPS + 1))
    assert all(resumed[step] == straight[step] for step in resumed)


@pytest.mark.slow  # 4 spawned ranks and real trainer runs
def test_resume_with_another_scope_is_refused_in_one_line(ranks: list[dict]) -> None:
    for result in ranks:
        refused = result["trainer"]["refused"]
        assert "does not match this run: exchange" in refused and "\n" not in refused


@pytest.mark.slow  # 4 spawned ranks and real trainer runs
def test_end_of_data_inside_the_delay_applies_the_last_update(ranks: list[dict]) -> None:
    """The data runs out (max steps -1): the update in flight is applied before the final
    checkpoint and export, so every step's update is in the model."""
    states = [result["trainer"]["data_end"] for result in ranks]
    assert states[0]["step"] > 1
    for state in states:
        assert state["applied"] == state["step"] and not state["pending"]
    assert len({state["model"] for state in states}) == 1


def test_assign_owners_balances_and_is_deterministic() -> None:
    assert assign_owners([10, 40, 30, 20], 2) == [0, 0, 1, 1]
    assert assign_owners([5], 3) == [0]
    with pytest.raises(ValueError, match="at least 1"):
        assign_owners([1], 0)


def test_plan_node_aware_demo_uplink_is_30x_below_dense_at_8_by_8() -> None:
    """LLaMA-2-7B, 8 nodes x 8 ranks: the uplink carries (N - 1) messages, not W - 1."""
    shapes = trained_shapes(parse_config([]), llama2_7b_config())
    topo = Topology(64, 8, 2400e9, 100e9)
    dense = estimate(CompressionSettings("none"), [math.prod(s) for s in shapes], topo)
    flat = demo_estimate(shapes, 32, 64, torch.bfloat16, topo)
    aware = demo_estimate(shapes, 32, 64, torch.bfloat16, topo, node_aware=True)
    payload = demo_payload_bytes(shapes, 32, 64, torch.bfloat16)
    assert flat.uplink_bytes == pytest.approx(63 * payload)
    assert aware.uplink_bytes == pytest.approx(7 * payload)
    assert dense.uplink_bytes / aware.uplink_bytes >= 30
    overlapped = demo_estimate(shapes, 32, 64, torch.bfloat16, topo, True, overlap=True)
    compute, uplink_s = 0.2, aware.uplink_bytes * 8 / 100e9
    inside_s = aware.seconds - uplink_s  # in the step: only the uplink's all-gather is delayed
    expected = max(compute, uplink_s) + inside_s
    assert predicted_step_seconds(overlapped, compute) == pytest.approx(expected)
    assert predicted_step_seconds(aware, compute) == pytest.approx(compute + aware.seconds)
