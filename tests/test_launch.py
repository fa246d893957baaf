"""run.sh and the SLURM example: the torchrun command each node would run."""

from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path

from distributed_harness import REPO

# Stand-ins for SLURM's commands (no SLURM here): srun runs its command once per node, in turn,
# with SLURM_NODEID set as srun --ntasks-per-node=1 does; scontrol expands the node list.
FAKE_SRUN = """#!/usr/bin/env bash
while [[ "$1" == --* ]]; do shift; done
for ((node = 0; node < SLURM_JOB_NUM_NODES; node++)); do SLURM_NODEID=$node "$@" || exit $?; done
"""
FAKE_SCONTROL = """#!/usr/bin/env bash
[ "$1 $2" = "show hostnames" ] && [ "$3" = "gpu-a[17-18]" ] && printf 'gpu-a17\\ngpu-a18\\n'
"""


def _commands(stdout: str) -> list[list[str]]:
    """Each printed torchrun command, split like a shell would, from 'torchrun' on."""
    commands = [shlex.split(line) for line in stdout.splitlines() if "torchrun" in line]
    return [words[words.index("torchrun") :] for words in commands]


def test_run_sh_prints_a_multi_node_command() -> None:
    env = {**os.environ, "PRINT_ONLY": "1", "NNODES": "2", "NODE_RANK": "1"}
    env |= {"MASTER_ADDR": "node0", "NPROC_PER_NODE": "8"}
    env.pop("MASTER_PORT", None)  # run.sh's default port (a test before may have set one)
    result = subprocess.run(
        [str(REPO / "run.sh"), "--config", "configs/tiny.toml", "--output-dir", "a b"],
        env=env, capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    [command] = _commands(result.stdout)
    assert command[1:5] == [
        "--nproc_per_node=8",
        "--nnodes=2",
        "--node_rank=1",
        "--rdzv_id=default",
    ]
    assert "--rdzv_endpoint=node0:29400" in command and "--max_restarts=3" in command
    assert command[-5] == str(REPO / "train.py")
    assert command[-4:] == ["--config", "configs/tiny.toml", "--output-dir", "a b"]


FAKE_UV = """#!/usr/bin/env bash
printf 'cwd=%s\\n' "$PWD"
printf '%s\\n' "$@"
"""


def test_run_sh_keeps_the_callers_working_directory(tmp_path: Path) -> None:
    """run.sh runs torchrun (here a stand-in uv that prints where it runs and its arguments)
    in the caller's folder, with the repository's train.py and environment."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "uv").write_text(FAKE_UV)
    (bin_dir / "uv").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    env.pop("PRINT_ONLY", None)
    result = subprocess.run(
        [str(REPO / "run.sh"), "--config", "my.toml"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    lines = result.stdout.splitlines()
    assert lines[0] == f"cwd={tmp_path}"
    assert lines[1:4] == ["run", "--project", str(REPO)]
    assert lines[-3:] == [str(REPO / "train.py"), "--config", "my.toml"]


def test_run_sh_elastic_nnodes_leaves_node_ranks_to_the_rendezvous() -> None:
    env = {**os.environ, "PRINT_ONLY": "1", "NNODES": "1:4", "NODE_RANK": "3"}
    result = subprocess.run(
        [str(REPO / "run.sh"), "--config", "configs/tiny.toml"],
        env=env, capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    [command] = _commands(result.stdout)
    assert "--nnodes=1:4" in command and "--max_restarts=3" in command
    assert not [word for word in command if word.startswith("--node_rank")]


def test_slurm_example_launches_run_sh_on_every_node(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PRINT_ONLY": "1"}
    env |= {"SLURM_SUBMIT_DIR": str(REPO), "SLURM_JOB_NODELIST": "gpu-a[17-18]"}
    env |= {"SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_ID": "4242", "SLURM_GPUS_ON_NODE": "4"}
    for name in ("MASTER_ADDR", "MASTER_PORT", "NNODES", "NODE_RANK", "NPROC_PER_NODE"):
        env.pop(name, None)
    result = subprocess.run(
        ["bash", str(REPO / "examples" / "slurm" / "train.sbatch"), "--config", "c.toml"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    commands = _commands(result.stdout)
    assert len(commands) == 2, result.stdout
    for node_rank, command in enumerate(commands):
        assert f"--node_rank={node_rank}" in command
        assert {"--nnodes=2", "--nproc_per_node=4", "--rdzv_id=4242"} <= set(command)
        assert "--rdzv_endpoint=gpu-a17:29400" in command, "the job's first node hosts rendezvous"
        assert command[-3:] == [str(REPO / "train.py"), "--config", "c.toml"]


def test_slurm_example_needs_the_repository(tmp_path: Path) -> None:
    env = {**os.environ, "SLURM_SUBMIT_DIR": str(tmp_path), "PRINT_ONLY": "1"}
    result = subprocess.run(
        ["bash", str(REPO / "examples" / "slurm" / "train.sbatch")],
        env=env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 2
    assert "no run.sh" in result.stderr and "TORCHRUN_DDP_DIR" in result.stderr


def test_run_sh_starts_the_lighthouse_of_fault_tolerant_sites_beside_or_alone() -> None:
    env = {**os.environ, "PRINT_ONLY": "1", "LIGHTHOUSE": "1", "LIGHTHOUSE_MIN_SITES": "2"}
    env |= {"LIGHTHOUSE_BIND": "10.8.0.1:29510", "LIGHTHOUSE_HEARTBEAT_TIMEOUT_MS": "2000"}
    beside = subprocess.run(
        [str(REPO / "run.sh"), "--fault-tolerance", "sites"],
        env=env, capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    lighthouse, torchrun = (shlex.split(line) for line in beside.stdout.splitlines())
    assert lighthouse[-1] == "&"  # in the background, before the site's own torchrun
    start = lighthouse.index("torchft_lighthouse")
    assert lighthouse[start:-1] == [
        "torchft_lighthouse", "--bind", "10.8.0.1:29510", "--min_replicas", "2",
        "--heartbeat_timeout_ms", "2000", "--join_timeout_ms", "60000",
    ]  # fmt: skip
    assert torchrun[-2:] == ["--fault-tolerance", "sites"]
    alone = subprocess.run(
        [str(REPO / "run.sh"), "lighthouse"],
        env=env, capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    [words] = [shlex.split(line) for line in alone.stdout.splitlines()]
    assert words[words.index("torchft_lighthouse") :] == lighthouse[start:-1]
