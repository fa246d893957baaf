"""--data-parallel hsdp with a --compression comm hook across the replicas (``compression
.replicas``): the real trainer on spawned gloo ranks. A lossless hook gives FSDP's own replicate
all-reduce's losses, each hook trains with the replicas' shards bit-identical, only the hook's
payload crosses the replicate group (bytes counted), also with --compile, and the error feedback
resumes exactly."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import torch
from distributed_harness import (
    SMALL_LLAMA,
    accumulating_args,
    final_weights,
    logged_losses,
    logged_steps,
    run_distributed,
)
from tiny_models import comm_bytes, digest, train_in_group

from torchrun_ddp.compression import dct_payload_bytes, wire_bytes
from torchrun_ddp.compression.replicas import local_shard
from torchrun_ddp.config_io import parse_config
from torchrun_ddp.errors import UserError
from torchrun_ddp.model import load_model_config
from torchrun_ddp.parallel.sharding import decoder_layers
from torchrun_ddp.plan.architecture import meta_model

pytestmark = pytest.mark.slow  # trains on 2 and 4 spawned ranks

STEPS, STOP = 6, 4
HOOKS = {
    "none": (),
    "dct-lossless": ("--compression", "dct", "--compression-ratio", "1.0",
                     "--compression-value-dtype", "float32", "--compression-block-size", "32"),
    "bf16": ("--compression", "bf16"),
    "dct": ("--compression", "dct", "--compression-ratio", "0.25",
            "--compression-value-dtype", "bfloat16", "--compression-selection", "rotating",
            "--compression-block-size", "32"),
    "dct-topk": ("--compression", "dct-topk", "--compression-topk", "4",
                 "--compression-block-size", "32"),
    "powersgd": ("--compression", "powersgd", "--powersgd-rank", "2"),
}  # fmt: skip
"""The hooks under test (``none``: FSDP's own all-reduce of the shards across replicas)."""
LOCAL = {
    name: ("--optimizer", name, "--local-steps", "3", "--zero1", "false", "--shard-degree", "1")
    for name in ("diloco", "sparseloco")
} | {"demo": ("--optimizer", "demo", "--zero1", "false", "--shard-degree", "1")}
"""The methods that exchange themselves, one rank per replica: DiLoCo and SparseLoCo syncing
every 3 steps (step 4, the checkpoint, falls inside a window), DeMo every step."""
SYNCS = {"diloco": [3, 6], "sparseloco": [3, 6], "demo": list(range(1, STEPS + 1))}
"""The steps in which each sends."""


def _args(data: Path, output: Path, *extra: str) -> list[str]:
    """The hidden-64 LLaMA under hsdp, STEPS steps of 2 micro-batches of 2 x 16 tokens per rank."""
    return accumulating_args(data, output, STEPS, STOP, "--data-parallel", "hsdp", *extra)


def _shard_digest(model: torch.nn.Module) -> str:
    """``digest`` of this rank's weight shards (equal on the ranks that hold the same shards)."""
    return digest({name: local_shard(p) for name, p in model.named_parameters()})


def _hooks_worker(rank: int, world_size: int, data: str, root: Path) -> dict[str, object]:
    """2 replicas of 1 shard: every hook for STEPS steps, dct also with --compile (and which
    decoder layers it compiled); dct stopped at STOP, then resumed."""
    out: dict[str, object] = {}
    for name, extra in HOOKS.items():
        trainer = train_in_group(
            rank, world_size, _args(Path(data), root / name, "--shard-degree", "1", *extra)
        )
        out[name] = _shard_digest(trainer.model)
    compiled = (*HOOKS["dct"], "--shard-degree", "1", "--compile")
    trainer = train_in_group(rank, world_size, _args(Path(data), root / "dct-compiled", *compiled))
    out["dct-compiled"] = _shard_digest(trainer.model)
    out["compiled blocks"] = [
        b._compiled_call_impl is not None for b in decoder_layers(trainer.model)
    ]
    for name, extra in {"dct": (*HOOKS["dct"], "--shard-degree", "1"), **LOCAL}.items():
        folder = root / f"stopped-{name}"
        train_in_group(rank, world_size, _args(Path(data), folder, *extra, "--max-steps", "4"))
        trainer = train_in_group(rank, world_size, _args(Path(data), folder, *extra))
        out[f"resumed-{name}"] = _shard_digest(trainer.model)
    for name, extra in LOCAL.items():
        trainer = train_in_group(rank, world_size, _args(Path(data), root / name, *extra))
        out[name] = _shard_digest(trainer.model)
        ddp = (*extra[:-2], "--data-parallel", "ddp")
        train_in_group(rank, world_size, _args(Path(data), root / f"{name}-ddp", *ddp))
    return out


def _two_by_two_worker(rank: int, world_size: int, data: str, root: Path) -> list[tuple]:
    """2 nodes of 2 ranks (shard within a node): dct 0.25 bf16 across the nodes, then DiLoCo,
    SparseLoCo and DeMo for STEPS steps (ending on a sync). Per run, the shards' digest and
    the ranks of every parameter's FSDP mesh."""
    runs = {"2x2": HOOKS["dct"], "2x2-none": ("--max-steps", str(STOP))}
    runs |= {f"2x2-{name}": extra[:-2] for name, extra in LOCAL.items()}
    out = []
    for name, extra in runs.items():
        argv = _args(Path(data), root / name, *extra)
        model = train_in_group(rank, world_size, argv, per_node=2).model
        meshes = {tuple(p.device_mesh.mesh.flatten().tolist()) for p in model.parameters()}
        out.append((_shard_digest(model), meshes))
    ddp = ("--data-parallel", "ddp", "--max-steps", str(STOP))
    train_in_group(rank, world_size, _args(Path(data), root / "2x2-ddp", *ddp), per_node=2)
    return out


def _reshaped_worker(rank: int, world_size: int, data: str, root: Path) -> str:
    """Resume the 2 x 2 checkpoint of step STOP on 2 ranks with --shard-degree 2 (1 replica of
    2 shards) and then 1 (2 replicas of 1), train nothing, export; resume the 2 x 2 dct run's
    as 2 x 1 with dct (its error feedback dropped) and train on to STEPS: its shards' digest."""
    step = root / "2x2-none" / "checkpoints" / f"step-{STOP}"
    for degree in ("2", "1"):
        extra = ("--resume-from", str(step), "--max-steps", str(STOP), "--shard-degree", degree)
        train_in_group(rank, world_size, _args(Path(data), root / f"resumed-{degree}", *extra))
    step = root / "2x2" / "checkpoints" / f"step-{STOP}"
    extra = (*HOOKS["dct"], "--resume-from", str(step), "--shard-degree", "1")
    return _shard_digest(
        train_in_group(rank, world_size, _args(Path(data), root / "dct-2", *extra)).model
    )


@pytest.fixture(scope="module")
def runs(sample_data: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list]:
    root = tmp_path_factory.mktemp("replicas")
    return root, run_distributed(_hooks_worker, 2, str(sample_data), root, timeout=900)


def test_a_lossless_hook_gives_fsdps_own_replica_average(runs: tuple[Path, list]) -> None:
    """dct keeping every coefficient in fp32 is the exact mean up to rounding: the losses of
    FSDP's native replicate all-reduce (``none``), to fp32 tolerance."""
    root, _ = runs
    native, hooked = logged_losses(root / "none"), logged_losses(root / "dct-lossless")
    assert sorted(native) == sorted(hooked) == list(range(1, STEPS + 1))
    for step in native:
        assert hooked[step] == pytest.approx(native[step], rel=1e-4), step


def test_every_hook_trains_and_keeps_the_replicas_identical(runs: tuple[Path, list]) -> None:
    root, results = runs
    for name in HOOKS:
        losses = logged_losses(root / name)
        assert losses[STEPS] < losses[1], (name, losses)
        assert results[0][name] == results[1][name], f"{name}: the replicas' shards differ"
    lossy = {name: logged_losses(root / name)[STEPS] for name in ("bf16", "dct", "powersgd")}
    assert len({round(v, 6) for v in lossy.values()}) == len(lossy), "a hook did not run"


def test_only_the_hooks_payload_crosses_the_replicas(runs: tuple[Path, list]) -> None:
    """With one shard per replica FSDP sends nothing within a group, so a rank's wire bytes are
    the hook's: dct 0.25 in bf16 sends the kept coefficients of every parameter (blocks of 32)
    through one all-reduce over the 2 replicas, an eighth of the fp32 shards ``none`` sends."""
    root, _ = runs
    native = comm_bytes(root / "none")
    dct = comm_bytes(root / "dct")
    blocks = sum(math.ceil(math.prod(shape) / 32) for shape in _parameter_shapes())
    payload = dct_payload_bytes(blocks, 8, torch.bfloat16)
    expected = round(wire_bytes("all_reduce", payload, 2))
    assert {wire for wire, _ in dct} == {expected}, (dct[:2], expected)
    assert {dense for _, dense in dct} == {dense for _, dense in native}
    assert 0.12 < expected / native[0][0] < 0.14, (expected, native[0])


def test_compiled_blocks_send_the_same_payload(runs: tuple[Path, list]) -> None:
    """--compile under hsdp with dct across the replicas: every decoder layer compiled, the
    replicas' shards bit-identical, eager dct's losses (fused kernels round differently: 1e-3)
    and the same wire bytes in every step."""
    root, results = runs
    assert [r["compiled blocks"] for r in results] == [[True, True]] * 2
    assert results[0]["dct-compiled"] == results[1]["dct-compiled"], "the replicas differ"
    eager, compiled = logged_losses(root / "dct"), logged_losses(root / "dct-compiled")
    assert sorted(compiled) == sorted(eager) == list(range(1, STEPS + 1))
    for step, loss in eager.items():
        assert compiled[step] == pytest.approx(loss, abs=1e-3), step
    assert comm_bytes(root / "dct-compiled") == comm_bytes(root / "dct")


def _parameter_shapes() -> list[tuple[int, ...]]:
    model = meta_model(load_model_config(str(SMALL_LLAMA)))
    return [tuple(p.shape) for p in model.parameters()]


def test_error_feedback_resumes_exactly(runs: tuple[Path, list]) -> None:
    """dct 0.25 bf16 with rotating selection keeps a residual per rank: stopped at STOP and
    resumed, it ends on the uninterrupted run's shards, bit for bit."""
    root, results = runs
    assert [r["resumed-dct"] for r in results] == [r["dct"] for r in results]
    assert logged_losses(root / "stopped-dct") == logged_losses(root / "dct")


def test_two_nodes_of_two_ranks_compress_across_the_nodes(
    sample_data: Path, tmp_path: Path
) -> None:
    """hsdp on 2 nodes x 2 ranks, with dct, DiLoCo, SparseLoCo and DeMo: FSDP's collectives stay
    within each node (its mesh is the node's ranks), the ranks holding the same shard on the two
    nodes end bit-identical, and the final export loads. Plain hsdp on 2 x 2 logs DDP's losses
    on 4 ranks (gradient accumulation 2), and its checkpoint resumes as 1 x 2 and as 2 x 1 with
    the same weights, bit for bit (DCP reshards); the dct run's resumes as 2 x 1 with its error
    feedback dropped, the 2 replicas equal."""
    results = run_distributed(_two_by_two_worker, 4, str(sample_data), tmp_path, timeout=600)
    native, ddp = logged_losses(tmp_path / "2x2-none"), logged_losses(tmp_path / "2x2-ddp")
    assert sorted(native) == sorted(ddp) == list(range(1, STOP + 1))
    for step in ddp:  # 2 x 2 hsdp is DDP on 4 ranks, to fp32 tolerance
        assert native[step] == pytest.approx(ddp[step], rel=1e-4), step
    dct = run_distributed(_reshaped_worker, 2, str(sample_data), tmp_path, timeout=300)
    for degree in ("2", "1"):  # the 2 x 2 checkpoint of step STOP resumed as 1 x 2 and 2 x 1
        resumed = final_weights(tmp_path / f"resumed-{degree}")
        assert digest(resumed) == digest(final_weights(tmp_path / "2x2-none")), degree
    assert dct[0] == dct[1]  # dct from 4 ranks' checkpoint on 2 replicas: they stay equal
    assert logged_steps(tmp_path / "dct-2") == list(range(STOP + 1, STEPS + 1))
    for run in (0, 2, 3, 4):  # dct, DiLoCo, SparseLoCo after their sync, DeMo (1: plain)
        digests = [result[run][0] for result in results]
        assert [result[run][1] for result in results] == [{(0, 1)}, {(0, 1)}, {(2, 3)}, {(2, 3)}]
        assert digests[0] == digests[2] and digests[1] == digests[3], (run, digests)
        assert digests[0] != digests[1]
    assert final_weights(tmp_path / "2x2"), "no final model"
    losses = logged_losses(tmp_path / "2x2")
    assert losses[STEPS] < losses[1]
    shutil.rmtree(tmp_path / "2x2" / "checkpoints", ignore_errors=True)


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (("--data-parallel", "fsdp", "--compression", "dct"), "use --data-parallel hsdp"),
        (("--data-parallel", "hsdp", "--compression-scope", "inter-node", "--compression", "bf16"),
         "--compression-scope global"),
        (("--data-parallel", "fsdp", "--optimizer", "diloco", "--zero1", "false"),
         "use --data-parallel hsdp"),
    ],
)  # fmt: skip
def test_compression_without_replicas_is_refused(extra: tuple[str, ...], needle: str) -> None:
    with pytest.raises(UserError, match=needle.replace("-", r"\-")) as caught:
        parse_config(list(extra))
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize("name", list(LOCAL))
def test_local_updates_on_shards_are_ddps_and_resume_exactly(
    runs: tuple[Path, list], name: str
) -> None:
    """DiLoCo, SparseLoCo and DeMo under hsdp with one rank per replica are DDP's (each replica
    one worker): the same losses to fp32 tolerance. Stopped at step 4 (inside a window of 3),
    each resumes bit for bit, and a rank sends only in its sync steps."""
    root, results = runs
    ddp, sharded = logged_losses(root / f"{name}-ddp"), logged_losses(root / name)
    assert sorted(ddp) == sorted(sharded) == list(range(1, STEPS + 1))
    for step in ddp:
        assert sharded[step] == pytest.approx(ddp[step], rel=1e-4), step
    assert logged_losses(root / f"stopped-{name}") == sharded
    assert [r[f"resumed-{name}"] for r in results] == [r[name] for r in results]
    wire = [wire for wire, _ in comm_bytes(root / name)]
    assert [step for step, sent in enumerate(wire, 1) if sent] == SYNCS[name], wire
    if name == "diloco":  # the fp32 pseudo-gradient's all-reduce over the 2 replicas
        numel = sum(math.prod(shape) for shape in _parameter_shapes())
        assert wire[2] == round(wire_bytes("all_reduce", numel * 4, 2))
