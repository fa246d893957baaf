"""MuLoCo (``methods.muloco``): its inner optimizer is Muon on the hidden matrices and AdamW on
the rest, stepped and checkpointed as one; its plan keeps one moment on the matrices; under ddp
and hsdp (2 gloo ranks) it trains the same, sends SparseLoCo's message in its sync steps only,
and resumes inside a window bit for bit."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch
from distributed_harness import (
    SMALL_LLAMA,
    accumulating_args,
    logged_losses,
    run_distributed,
)
from tiny_models import comm_bytes, digest, train_in_group
from torch.optim import AdamW, Muon
from torch.optim._muon import _zeropower_via_newtonschulz
from transformers import AutoConfig, AutoModelForCausalLM

from torchrun_ddp.compression import sparseloco_payload_bytes, wire_bytes
from torchrun_ddp.compression.replicas import local_shard
from torchrun_ddp.config_io import parse_config
from torchrun_ddp.errors import UserError
from torchrun_ddp.methods.muloco import (
    MUON_LR_ADJUSTMENT,
    DeviceMuon,
    muloco_inner_optimizer,
    newton_schulz,
)
from torchrun_ddp.model import hidden_matrices

STEPS, STOP = 6, 4
MULOCO = ("--optimizer", "muloco", "--local-steps", "3", "--zero1", "false")
"""MuLoCo syncing every 3 steps (step 4, the checkpoint, falls inside a window)."""
N_7B, MATRICES_7B = 6_738_415_616, 32 * (4 * 4096 * 4096 + 3 * 4096 * 11008)
"""LLaMA-2-7B's parameters and those in its layers' 7 linear weights."""


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(SMALL_LLAMA))


def _backward(model: torch.nn.Module, seed: int) -> None:
    torch.manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (2, 16))
    model.zero_grad()
    model(input_ids=ids, labels=ids).loss.backward()


def test_the_inner_optimizer_is_muon_on_the_matrices_and_adamw_on_the_rest() -> None:
    """Muon holds exactly the hidden matrices (not the embedding, head or norms), AdamW the
    rest; stepping the one optimizer equals stepping its Muon and torch's AdamW side by side,
    bit for bit, and its state_dict resumes a copy that then steps identically."""
    model, twin = _model(), _model()
    inner = muloco_inner_optimizer(model, 1e-3, 0.1, "for-loop")
    muon, adamw = inner.parts
    matrices = {id(p) for p in hidden_matrices(model)}
    assert {id(p) for group in muon.param_groups for p in group["params"]} == matrices
    rest = {id(p) for group in adamw.param_groups for p in group["params"]}
    assert not rest & matrices and len(rest | matrices) == len(list(model.parameters()))
    assert id(model.get_input_embeddings().weight) in rest
    twin_matrices = hidden_matrices(twin)
    chosen = {id(p) for p in twin_matrices}
    reference = (
        DeviceMuon(twin_matrices, lr=1e-3, weight_decay=0.1, adjust_lr_fn=MUON_LR_ADJUSTMENT),
        AdamW(
            [
                {"params": [p for p in twin.parameters() if id(p) not in chosen and p.dim() == 2],
                 "weight_decay": 0.1},
                {"params": [p for p in twin.parameters() if p.dim() < 2], "weight_decay": 0.0},
            ],
            lr=1e-3, fused=False, foreach=False,
        ),
    )  # fmt: skip
    for seed in range(2):
        for net, steps in ((model, [inner]), (twin, reference)):
            _backward(net, seed)
            for optimizer in steps:
                optimizer.step()
    assert digest(dict(model.named_parameters())) == digest(dict(twin.named_parameters()))
    resumed_model = copy.deepcopy(model)
    resumed = muloco_inner_optimizer(resumed_model, 1e-3, 0.1, "for-loop")
    resumed.load_state_dict(copy.deepcopy(inner.state_dict()))  # as read from a file
    for net, optimizer in ((model, inner), (resumed_model, resumed)):
        _backward(net, 7)
        optimizer.step()
    assert digest(dict(model.named_parameters())) == digest(dict(resumed_model.named_parameters()))
    assert len(inner.state_dict()["state"]) == len(list(model.parameters()))


def test_device_muon_is_torchs_muon_with_fp32_iterates_on_a_cpu() -> None:
    """In bf16 the Newton-Schulz iteration is torch's, bit for bit; on a CPU ``DeviceMuon``
    iterates in fp32, and its step is torch.optim.Muon's to bf16 precision (3 steps, a tall and
    a wide matrix, each adjust_lr_fn): the same momentum, scale and weight decay."""
    generator = torch.Generator().manual_seed(0)
    coefficients = (3.4445, -4.7750, 2.0315)
    for shape in ((48, 20), (20, 48)):
        grad = torch.randn(shape, generator=generator)
        torchs = _zeropower_via_newtonschulz(grad, coefficients, 5, 1e-7)
        assert torch.equal(newton_schulz(grad, coefficients, 5, 1e-7, torch.bfloat16), torchs)
    for adjust in ("original", "match_rms_adamw", "spectral_unclamped"):
        for shape in ((48, 20), (20, 48)):
            start = torch.randn(shape, generator=generator)
            ours, theirs = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone())
            pair = [DeviceMuon([ours], lr=0.02, weight_decay=0.1, adjust_lr_fn=adjust),
                    Muon([theirs], lr=0.02, weight_decay=0.1, adjust_lr_fn=adjust)]  # fmt: skip
            for _ in range(3):
                grad = torch.randn(shape, generator=generator)
                for param, optimizer in zip((ours, theirs), pair, strict=True):
                    param.grad = grad.clone()
                    optimizer.step()
            moved = (theirs - start).abs().max()
            gap = (ours - theirs).abs().max()
            assert 0 < gap < 0.02 * moved, (adjust, shape, gap, moved)  # bf16 rounding only


def test_the_plan_keeps_one_moment_on_the_matrices(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """--dry-run for LLaMA-2-7B in fp32: DiLoCo's inner AdamW holds 2 moments per parameter,
    MuLoCo 1 on the 32 x 7 layer matrices and 2 on the embedding, head and norms; MuLoCo adds
    SparseLoCo's error feedback and DiLoCo's outer momentum (25.10 GiB each)."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1]))
    train = pytest.importorskip("train")  # the repository's entry point
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr(train, "load_dotenv", lambda: None)
    gib = 2**30
    for name, moments in (("diloco", 8 * N_7B), ("muloco", 4 * (2 * N_7B - MATRICES_7B))):
        argv = ["--dry-run", "--device-memory-gib", "80", "--optimizer", name, "--zero1", "false"]
        assert train.main(argv) == 0
        out = capsys.readouterr().out
        assert f" moments) | {moments / gib:.2f} |" in out, name
    assert "| outer Nesterov momentum (fp32) (kept) | 25.10 |" in out
    assert "| error feedback (fp32, per rank) (kept) | 25.10 |" in out
    assert "muloco H=30 k=64/4096 2-bit beta 0.95 lr 0.7 Nesterov 0.9" in out


def test_sparseloco_presets_are_refused_with_muloco() -> None:
    with pytest.raises(UserError, match="use it with --optimizer sparseloco") as caught:
        parse_config(["--optimizer", "muloco", "--sparseloco-preset", "templar"])
    assert "\n" not in str(caught.value)


def _worker(rank: int, world_size: int, data: str, root: Path) -> dict[str, str]:
    """MuLoCo under ddp and hsdp (2 x 1): uninterrupted, and resumed from its checkpoint of
    step STOP. The shards' digests."""
    out = {}
    modes = {"ddp": ("--data-parallel", "ddp"),
             "hsdp": ("--data-parallel", "hsdp", "--shard-degree", "1")}  # fmt: skip
    for name, mode in modes.items():
        argv = accumulating_args(Path(data), root / name, STEPS, STOP, *MULOCO, *mode)
        trainer = train_in_group(rank, world_size, argv)
        out[name] = digest({n: local_shard(p) for n, p in trainer.model.named_parameters()})
        step = root / name / "checkpoints" / f"step-{STOP}"
        again = accumulating_args(Path(data), root / f"{name}-resumed", STEPS, STOP, *MULOCO,
                                  *mode, "--resume-from", str(step))  # fmt: skip
        trainer = train_in_group(rank, world_size, again)
        out[f"{name}-resumed"] = digest(
            {n: local_shard(p) for n, p in trainer.model.named_parameters()}
        )
    return out


@pytest.mark.slow  # trains on 2 spawned ranks
def test_muloco_trains_alike_under_ddp_and_hsdp_and_resumes_exactly(
    sample_data: Path, tmp_path: Path
) -> None:
    """Under hsdp with one rank per replica MuLoCo is DDP's (each replica a worker): the same
    losses to fp32 tolerance. A rank sends only in the sync steps (3 and 6), exactly
    SparseLoCo's all-gather of its message; the checkpoint of step 4 (inside a window) resumes
    bit for bit under both modes."""
    results = run_distributed(_worker, 2, str(sample_data), tmp_path, timeout=600)
    ddp, sharded = logged_losses(tmp_path / "ddp"), logged_losses(tmp_path / "hsdp")
    assert sorted(ddp) == sorted(sharded) == list(range(1, STEPS + 1))
    for step in ddp:
        assert sharded[step] == pytest.approx(ddp[step], rel=1e-4), step
    assert ddp[STEPS] < ddp[1]
    for name in ("ddp", "hsdp"):
        resumed = logged_losses(tmp_path / f"{name}-resumed")
        assert resumed == {step: logged_losses(tmp_path / name)[step] for step in (5, 6)}
        assert [r[f"{name}-resumed"] for r in results] == [r[name] for r in results]
    shapes = [tuple(p.shape) for p in _model().parameters()]
    payload = sparseloco_payload_bytes(shapes, 64, 64, 2)
    wire = [sent for sent, _ in comm_bytes(tmp_path / "ddp")]
    assert wire == [0, 0, round(wire_bytes("all_gather", payload, 2)), 0, 0, wire[5]], wire
    assert wire[5] == wire[2] > 0
    assert math.isclose(wire[2], payload, rel_tol=0.01)  # 2 ranks: one message each way
