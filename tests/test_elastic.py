"""Elastic training under torchrun (real agents on loopback, c10d rendezvous, gloo): two agents
of one process each train with ZeRO-1; one agent is killed, and the other goes on alone at world
size 1 from the last checkpoint; then a third agent joins, and the group restarts at world size 2.
--keep-global-batch doubles the accumulation at world size 1 (which also keeps that phase long
enough for the third agent to join before the end). The loss carries on across both changes (no
fall back towards an untrained model), every step is logged once, and the run ends normally."""

from __future__ import annotations

import json
import re
import socket
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from distributed_harness import (
    PEAK,
    REPO,
    Agent,
    assert_logged_once,
    free_port,
    kill_agent,
    logged_losses,
    run_distributed,
    start_agent,
    subprocess_env,
    torchrun_command,
)
from tiny_models import train_in_group

pytestmark = pytest.mark.slow  # torchrun agents leave and join a running group

STEPS = 40


def _args(sample_data: Path, output_dir: Path) -> list[str]:
    """The run's flags. ``--timeout-s 60``: should the killed peer's connections stay open (seen
    once in a full-suite run, where the survivor's collective then waited out the 600 s
    default), the survivor's next collective fails within a minute, and the group restarts as
    it does after a connection reset."""
    return [
        "--config", str(REPO / "configs" / "tiny.toml"),
        "--model", str(REPO / "configs" / "tiny-models" / "llama" / "config.json"),
        "--tokenizer", str(sample_data / "tokenizer" / "mistral-7b-v0.1"),
        "--data-files", str(sample_data / "c4" / "*train*.json.gz"),
        "--eval-files", str(sample_data / "c4" / "*validation*.json.gz"),
        "--output-dir", str(output_dir), "--seq-length", "32", "--batch-size", "2",
        "--max-steps", str(STEPS), "--checkpoint-every", "2", "--log-every", "1",
        "--eval-every", "0", "--eval-batches", "1", "--learning-rate", "1e-2",
        "--warmup-steps", "2", "--zero1", "--threads", "1", "--keep-global-batch",
        "--timeout-s", "60", *PEAK,
    ]  # fmt: skip


RDZV = (
    "--max-restarts=1",
    "--rdzv-id=elastic-test",
    "--rdzv-conf=join_timeout=120,last_call_timeout=8,keep_alive_interval=1,"
    "keep_alive_max_attempt=3",
    "--monitor-interval=0.5",
)
"""One restart for the one injected fault (the killed agent fails the survivor's worker); the
third agent's join is a membership change, which torchrun does not count against
--max-restarts. Short rendezvous timeouts: a dead agent is dropped after 3 missed 1 s
heartbeats; a round waits 8 s for more agents once one is there (so the second agent joins the
first round)."""


def _wait_for(condition: Callable[[], bool], what: str, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def _listening(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def _trained_after(log: str, marker: str) -> bool:
    """Whether ``log`` shows a training step logged after the line holding ``marker``."""
    at = log.find(marker)
    return at >= 0 and re.search(r"\bstep \d+ \| loss", log[at:]) is not None


def test_an_agent_leaves_and_another_joins(sample_data: Path, tmp_path: Path) -> None:
    port = free_port()
    command = torchrun_command(_args(sample_data, tmp_path), 1, "1:2", port, RDZV)  # type: ignore[arg-type]
    logs = [tmp_path / f"agent-{name}.log" for name in "abc"]
    procs: list[Agent] = []

    def start(log: Path) -> Agent:
        proc = start_agent(command, log, subprocess_env(shared_store=False))
        procs.append(proc)
        return proc

    try:
        first = start(logs[0])
        _wait_for(lambda: _listening(port), "the first agent's rendezvous store")
        leaving = start(logs[1])  # the store lives in the first agent, which stays
        _wait_for((tmp_path / "checkpoints" / "step-8" / "COMPLETE").is_file, "step 8")
        kill_agent(leaving)
        text_a = logs[0].read_text
        _wait_for(
            lambda: _trained_after(text_a(), "world size 2 -> 1"), "a step at world size 1", 300
        )
        joining = start(logs[2])
        assert first.wait(timeout=240) == 0, text_a()[-4000:]
        assert joining.wait(timeout=60) == 0, logs[2].read_text()[-4000:]
    finally:
        for proc in procs:
            if proc.poll() is None:
                kill_agent(proc)
    log_a = text_a()
    # After the join either agent may host rank 0, which alone logs the resume: read both logs.
    both = log_a + logs[2].read_text()
    assert "world size 2 -> 1: tokens per step 128 -> 128" in log_a, log_a[-4000:]
    assert "world size 1 -> 2: tokens per step 128 -> 128" in both, both[-4000:]
    assert "accumulation 2" in log_a and "accumulation 1" in both
    losses = logged_losses(tmp_path)
    assert_logged_once(tmp_path, STEPS)
    resumed = [int(m) for m in re.findall(r"resumed from \S+ at step (\d+)", both)]
    assert len(resumed) == 2, both[-4000:]  # one after the kill, one after the join
    for step in resumed:
        assert losses[step + 1] < losses[1] - 0.5, (step, losses)  # not an untrained model
        assert abs(losses[step + 1] - losses[step]) < 1.0, (step, losses)
    assert (tmp_path / "final_model" / "model.safetensors").is_file()


def _meta(output_dir: Path, step: int) -> dict[str, object]:
    return json.loads((output_dir / "checkpoints" / f"step-{step}" / "meta.json").read_text())


def _train(rank: int, world: int, args: list[str]) -> int:
    return train_in_group(rank, world, args).step


def test_tokens_seen_counts_each_world_size_at_its_own_tokens_per_step(
    sample_data: Path, tmp_path: Path
) -> None:
    """2 steps at world size 2 (2 x 2 x 32 tokens a step), then 2 at world size 1 without
    --keep-global-batch (2 x 32 a step): the checkpoint counts 256 + 128 tokens, not 4 x 128.
    Forked ranks (``run_distributed``), not torchrun: the count is the loop's, not the agent's."""
    args = [a for a in _args(sample_data, tmp_path) if a != "--keep-global-batch"]
    at = args.index("--max-steps") + 1
    for world, steps in ((2, 2), (1, 4)):
        args[at] = str(steps)
        assert run_distributed(_train, world, list(args)) == [steps] * world
    assert _meta(tmp_path, 2)["tokens_seen"] == 2 * 128
    assert _meta(tmp_path, 4)["tokens_seen"] == 2 * 128 + 2 * 64
