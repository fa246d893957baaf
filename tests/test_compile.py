"""--compile under DDP through the real trainer on 2 gloo ranks: dynamo compiles graphs (its
counters, read in the ranks) and the run logs eager DDP's losses with the fp16 comm hook running
under compile (its bytes counted in the hook); the ranks end identical; checkpoints and
final_model load into an uncompiled model. A compile that fails is one line, never a silent
eager run (dynamo's ``suppress_errors`` stays off). FSDP's compiled blocks: tests/test_sharded.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from distributed_harness import accumulating_args, final_weights, logged_losses, run_distributed
from safetensors.torch import load_file
from tiny_models import comm_bytes, digest, train_in_group

from torchrun_ddp.errors import UserError
from torchrun_ddp.model import compile_failure

pytestmark = pytest.mark.slow  # torch.compile on 2 spawned ranks

STEPS = 4
RUNS = {"eager": (), "compiled": ("--compile",)}


def _graphs() -> int:
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


def _worker(rank: int, world_size: int, data: str, root: str) -> dict[str, object]:
    """Each of RUNS, STEPS steps with the fp16 comm hook and a checkpoint at the end: the graphs
    dynamo compiled during it, suppress_errors after it, the rank's final parameters' digest."""
    out: dict[str, object] = {}
    for name, extra in RUNS.items():
        before = _graphs()
        args = accumulating_args(
            Path(data), Path(root) / name, STEPS, STEPS, "--compression", "fp16", *extra
        )
        trainer = train_in_group(rank, world_size, args)
        out[name] = {
            "graphs": _graphs() - before,
            "suppress_errors": torch._dynamo.config.suppress_errors,
            "digest": digest(dict(trainer.model.module.named_parameters())),
        }
    return out


@pytest.fixture(scope="module")
def ranks(sample_data: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list]:
    root = tmp_path_factory.mktemp("compiled")
    return root, run_distributed(_worker, 2, str(sample_data), str(root), timeout=900)


def test_compiled_ddp_runs_its_graphs_and_trains_like_eager_with_identical_ranks(
    ranks: tuple[Path, list],
) -> None:
    """Compiled graphs ran (dynamo's count of unique graphs grew in the compiled run only), no
    eager fallback was allowed, the hook sent fp16 (half the dense bytes, counted where it
    runs), the ranks hold the same weights, and the losses are eager's (fused kernels round
    differently: 1e-3)."""
    root, results = ranks
    for rank in results:
        assert rank["eager"]["graphs"] == 0 < rank["compiled"]["graphs"], rank
        assert rank["compiled"]["suppress_errors"] is False
    assert results[0]["compiled"]["digest"] == results[1]["compiled"]["digest"]
    for wire, dense in comm_bytes(root / "compiled"):
        assert wire > 0 and wire * 2 == pytest.approx(dense, rel=0.01), (wire, dense)
    eager, compiled = logged_losses(root / "eager"), logged_losses(root / "compiled")
    assert sorted(compiled) == sorted(eager) == list(range(1, STEPS + 1))
    for step, loss in eager.items():
        assert compiled[step] == pytest.approx(loss, abs=1e-3), step


def test_compiled_checkpoint_and_final_model_load_uncompiled(ranks: tuple[Path, list]) -> None:
    """The checkpoint's and the final model's keys are the uncompiled module's (no _orig_mod),
    and the final model equals the eager run's within the compiled kernels' rounding."""
    root, _ = ranks
    shards = list((root / "compiled" / "checkpoints" / f"step-{STEPS}" / "dcp").glob("*"))
    keys = {key for shard in shards if shard.suffix == ".safetensors" for key in load_file(shard)}
    assert keys and not any("_orig_mod" in key for key in keys)
    want, have = final_weights(root / "eager"), final_weights(root / "compiled")
    assert have.keys() == want.keys() and not any("_orig_mod" in key for key in have)
    for key, tensor in want.items():
        torch.testing.assert_close(have[key], tensor, atol=1e-3, rtol=1e-3, msg=key)


def test_a_compile_failure_is_one_line_naming_dynamos_reason() -> None:
    """main.run turns dynamo's exception (here as inductor raises it) into this UserError."""
    cause = torch._dynamo.exc.BackendCompilerFailed(
        "inductor", RuntimeError("C++ compile error\nlong log"), None
    )
    error = compile_failure(cause)
    assert isinstance(error, UserError) and "\n" not in str(error)
    assert str(error).startswith(
        "--compile: torch.compile failed (BackendCompilerFailed: RuntimeError: C++ compile error)"
    )
    assert "run without --compile" in str(error)
