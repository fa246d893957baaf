"""The training loop's collectives, counted with torch.profiler on real gloo processes.

Between log steps a step runs no collective but DDP's gradient all-reduce (one per bucket) and
no buffer broadcast; a log step adds exactly one all-reduce (the loss, carrying the end-of-data
and stop flags). Counted as differences between runs, so the start-up, evaluation and
checkpoint collectives (the same in every run) cancel out.
"""

from __future__ import annotations

import warnings
from collections import Counter
from pathlib import Path

import pytest
import torch
from distributed_harness import SMALL_LLAMA, SMALL_TOKENIZER, run_distributed, tiny_args
from torch.profiler import ProfilerActivity, profile

from torchrun_ddp.config_io import parse_config
from torchrun_ddp.distributed import DistEnv
from torchrun_ddp.inputs import checkpoint_root, prepare_inputs
from torchrun_ddp.main import start, train

pytestmark = pytest.mark.slow  # profiles training steps on 2 spawned ranks


def _collectives(events: list[str]) -> Counter[str]:
    return Counter(name for name in events if name.startswith("gloo:"))


def _counted_run(
    rank: int, world_size: int, argv: list[str], device: str = "cpu"
) -> dict[str, object]:
    """Train as ``main.run`` does after ``init_distributed``, the loop (start-up agreement to
    the final checkpoint) under the profiler; then profile one more backward alone."""
    config = parse_config(argv)
    env = DistEnv(rank=rank, world_size=world_size, local_rank=rank, local_world_size=world_size)
    trainer = start(config, env, torch.device(device), prepare_inputs(config, env))
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        assert train(trainer)
    trainer.metrics.close()
    loop = _collectives([event.name for event in prof.events()])
    ids = torch.randint(0, 512, (2, 16), device=device)  # within SMALL_LLAMA's vocabulary
    with profile(activities=[ProfilerActivity.CPU]) as prof:  # one backward: DDP's buckets
        trainer.model(input_ids=ids, labels=ids).loss.backward()
    buckets = _collectives([event.name for event in prof.events()])
    steps = sorted(p.name for p in checkpoint_root(config).glob("step-*"))
    saved = {"steps": steps, "final_model": (Path(config.output_dir) / "final_model").exists()}
    return {"loop": dict(loop), "backward": dict(buckets), "saved": saved}


def _args(root: Path, data: str, steps: int, log_every: int, *extra: str) -> list[str]:
    return tiny_args(
        Path(data), root,
        "--model", str(SMALL_LLAMA), "--seq-length", "16", "--batch-size", "2",
        "--accumulation-steps", "2", "--max-steps", str(steps), "--log-every", str(log_every),
        "--eval-every", "0", "--eval-batches", "1", "--checkpoint-every", "0",
        "--no-save-at-end", *extra, tokenizer=SMALL_TOKENIZER,
    )  # fmt: skip


def _worker(rank: int, world_size: int, data: str, root: str) -> dict[str, object]:
    """4 steps logged at the end only, and 8 steps logged every 2 steps."""
    return {
        "4-steps": _counted_run(rank, world_size, _args(Path(root) / "a", data, 4, 4)),
        "8-steps-log-2": _counted_run(rank, world_size, _args(Path(root) / "b", data, 8, 2)),
    }


@pytest.fixture(scope="module")
def counts(sample_data: Path, tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    root = tmp_path_factory.mktemp("hot-loop")
    return run_distributed(_worker, 2, str(sample_data), str(root), timeout=300)


def test_steps_run_only_the_gradient_all_reduce_and_log_steps_one_more(
    counts: list[dict],
) -> None:
    """8 steps logged every 2 against 4 steps logged at the end: 4 more steps of 2 micro-batches
    add 4 gradient all-reduces of every bucket, and log steps 2, 4 and 6 one all-reduce each;
    nothing else (no buffer broadcast before the 8 extra forwards, no per-step flag all-reduce).
    """
    for rank in counts:
        buckets = rank["4-steps"]["backward"]
        assert set(buckets) == {"gloo:all_reduce"} and buckets["gloo:all_reduce"] >= 1
        extra = Counter(rank["8-steps-log-2"]["loop"])
        extra.subtract(rank["4-steps"]["loop"])
        assert +extra == Counter({"gloo:all_reduce": 4 * buckets["gloo:all_reduce"] + 3})
        assert -extra == Counter(), "the longer run has no fewer collectives of any kind"


def test_no_save_at_end_leaves_no_checkpoint_and_no_final_model(counts: list[dict]) -> None:
    """--no-save-at-end (these runs' flag; --checkpoint-every 0): training ends with neither
    the last step's checkpoint nor final_model/."""
    for rank in counts:
        for run in ("4-steps", "8-steps-log-2"):
            assert rank[run]["saved"] == {"steps": [], "final_model": False}


def _sync_worker(rank: int, world_size: int, data: str, root: str) -> dict[str, Counter[str]]:
    """CUDA host synchronisations (``set_sync_debug_mode("warn")``) in two runs that log only
    at their end, 4 and 8 steps: per run, how many warnings each Python line that called the
    synchronising operation raised (``file:line``, the warning's location)."""
    counts = {}
    for steps in (4, 8):
        argv = _args(Path(root) / str(steps), data, steps, steps, "--device", "cuda")
        torch.cuda.set_sync_debug_mode("warn")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _counted_run(rank, world_size, argv, device="cuda")
        torch.cuda.set_sync_debug_mode("default")
        syncs = [w for w in caught if "synchroniz" in str(w.message)]
        counts[str(steps)] = Counter(f"{w.filename}:{w.lineno}" for w in syncs)
    return counts


UPSTREAM_SYNCS = {
    "transformers/masking_utils.py": 1,
    "liger_kernel/ops/fused_linear_cross_entropy.py": 3,
}
"""Host synchronisations per training forward (and its backward) in code that is not ours,
as counted on an H200 (docs/benchmarks.md#gpu). transformers 5.x reads one bool in every forward
that has no attention mask or cache (``find_packed_sequence_indices``:
``(packed_sequence_mask[:, -1] == 0).all()``), to tell packed examples from one sequence.
Liger's fused loss (``--fused-loss auto`` on CUDA, liger-kernel 0.8.5) reads the count of
trained tokens in its forward (``target_mask.sum().item()``, line 132) and, in its backward,
copies a 1.0 to the GPU and reads whether the loss's gradient equals it (``torch.equal(grad_output,
torch.tensor(1.0, device=...))``, line 420: two)."""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_no_host_sync_between_log_steps_on_cuda(sample_data: Path, tmp_path: Path) -> None:
    """Four more steps between the same log points add no host synchronisation of ours (NCCL,
    1 GPU), and each upstream file (``UPSTREAM_SYNCS``) exactly its count per forward (4 steps
    x 2 micro-batches). On failure the message names the lines whose synchronisations the
    longer run adds."""
    (counts,) = run_distributed(
        _sync_worker, 1, str(sample_data), str(tmp_path), timeout=300, backend="nccl"
    )
    added = counts["8"] - counts["4"]
    ours = {line: n for line, n in added.items() if not any(f in line for f in UPSTREAM_SYNCS)}
    assert not ours, f"added per line: {dict(added)}"
    for upstream, per_forward in UPSTREAM_SYNCS.items():
        found = sum(n for line, n in added.items() if upstream in line)
        assert found == per_forward * 4 * 2, f"{upstream}: added per line: {dict(added)}"
    assert counts["8"].total() - counts["4"].total() == added.total(), "no line has fewer"
