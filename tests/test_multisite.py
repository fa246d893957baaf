"""Two sites, no shared file system, real torchrun agents: 2 agents x 2 ranks on loopback (c10d
rendezvous, gloo), each agent with a --checkpoint-dir of its own. The second agent is killed
mid-run and its folder deleted (a replaced machine); a new agent takes its place. The first
agent's torchrun restarts its workers once (the one fault), the new node gets the checkpoint from
its peer, and the run ends with an uninterrupted run's losses and final weights, bit for bit.
The uninterrupted run is one group of 4 forked ranks: so this also checks that agents on several
nodes (c10d rendezvous) train exactly what one group trains."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from distributed_harness import (
    Agent,
    folder_args,
    free_port,
    kill_agent,
    logged_losses,
    run_distributed,
    start_agent,
    subprocess_env,
    torchrun_command,
)
from test_elastic import _listening, _wait_for
from test_node_local import _train
from tiny_models import digest
from transformers import AutoModelForCausalLM

pytestmark = pytest.mark.slow  # torchrun agents, one killed and replaced

STEPS = 20
RDZV = (
    "--rdzv-id=multisite",
    "--rdzv-conf=join_timeout=120,keep_alive_interval=1,keep_alive_max_attempt=3",
    "--monitor-interval=0.5",
)
"""A dead agent is dropped after 3 missed 1 s heartbeats. As run.sh does, a store per
rendezvous round (``subprocess_env(shared_store=False)``): with torchrun's shared store, torch's
agents time out in the round after an agent joins (docs/fault-tolerance.md)."""


def _agent(base: Path, node: int, port: int, restarts: int, log: Path) -> Agent:
    """One node: a torchrun agent of 2 ranks (forks of the agent, which imported the trainer:
    ``forked_torchrun.py``), its own checkpoint folder ``base/node-<n>``."""
    args = folder_args(base, f"node-{node}", STEPS, "--train-timeout-s", "30", "--timeout-s", "120")
    command = torchrun_command(args, 2, 2, port, (f"--max-restarts={restarts}", *RDZV), forked=True)
    return start_agent(command, log, subprocess_env(shared_store=False))


def test_a_node_replaced_with_an_empty_disk_recovers_from_its_peer_bit_identically(
    tmp_path: Path,
) -> None:
    run = tmp_path / "run"
    port = free_port()
    logs = [tmp_path / f"agent-{name}.log" for name in ("first", "killed", "new")]
    procs: list[Agent] = []
    try:
        procs.append(_agent(run, 0, port, 1, logs[0]))  # hosts the store; one restart
        _wait_for(lambda: _listening(port), "the first agent's rendezvous store")
        procs.append(_agent(run, 1, port, 1, logs[1]))
        _wait_for((run / "node-1" / "step-6" / "COMPLETE").is_file, "step 6 on node 1")
        kill_agent(procs[1])
        shutil.rmtree(run / "node-1")
        procs.append(_agent(run, 1, port, 0, logs[2]))
        assert procs[0].wait(timeout=300) == 0, logs[0].read_text()[-4000:]
        assert procs[2].wait(timeout=60) == 0, logs[2].read_text()[-4000:]
    finally:
        for proc in procs:
            if proc.poll() is None:
                kill_agent(proc)
    text = logs[0].read_text() + logs[2].read_text()
    recovered = [line for line in text.splitlines() if "MiB from peers" in line]
    assert len(recovered) == 1, text[-4000:]
    print(recovered[0])  # the bytes and seconds of the recovery (pytest -s)
    assert text.count("resumed from") == 1, text[-4000:]
    no_checkpoints = ["--checkpoint-every", "0"]  # saving changes nothing trained
    straight = run_distributed(
        _train, 4, str(tmp_path / "straight"), STEPS, no_checkpoints, timeout=300.0
    )
    assert logged_losses(run / "out") == logged_losses(tmp_path / "straight" / "out")
    model = AutoModelForCausalLM.from_pretrained(run / "out" / "final_model")
    assert digest(dict(model.named_parameters())) == straight[0]["digest"]
