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
from torchrun_ddp.inputs import prepare_inputs
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
    return {"loop": dict(loop), "backward": dict(buckets)}


def _args(root: Path, data: str, steps: int, log_every: int, *extra: str) -> list[str]:
    return tiny_args(
        Path(data), root,
        "--model", str(SMALL_LLAMA), "--seq-length", "16", "--batch-size", "2",
        "--accumulation-steps", "2", "--max-steps", str(steps), "--log-every", str(log_every),
        "--eval-every", "0", "--eval-batches", "1", "--checkpoint-every", "0",
        *extra, tokenizer=SMALL_TOKENIZER,
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


UPSTREAM_SYNC = "transformers/masking_utils.py"
"""transformers 5.x reads one bool on the host in every forward that has no attention mask or
cache (``find_packed_sequence_indices``: ``(packed_sequence_mask[:, -1] == 0).all()``), to
tell packed examples from one sequence; seen on an H100 (docs/benchmarks.md)."""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_no_host_sync_between_log_steps_on_cuda(sample_data: Path, tmp_path: Path) -> None:
    """Four more steps between the same log points add no host synchronisation of ours (NCCL,
    1 GPU), and transformers' mask check exactly one per forward (4 steps x 2 micro-batches).
    On failure the message names the lines whose synchronisations the longer run adds."""
    (counts,) = run_distributed(
        _sync_worker, 1, str(sample_data), str(tmp_path), timeout=300, backend="nccl"
    )
    added = counts["8"] - counts["4"]
    ours = {line: n for line, n in added.items() if UPSTREAM_SYNC not in line}
    upstream = sum(n for line, n in added.items() if UPSTREAM_SYNC in line)
    assert not ours and upstream == 4 * 2, f"added per line: {dict(added)}"
    assert counts["8"].total() - counts["4"].total() == upstream, "no line has fewer"
