"""Fault-tolerant sites when the torchft lighthouse dies (real processes: a lighthouse on a fixed
loopback port that the test kills and starts again, and 2 sites of one rank, each its own
torchrun job): an outage shorter than the quorum timeout costs the sites a stall at one sync and
nothing else; a longer one stops them with one line, torchrun restarts them and they resume.
Both outages in one run (one start of the sites for both).
Apart from tests/test_sites.py so that the two xdist workers share the sites' slow tests."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from distributed_harness import (
    Agent,
    assert_logged_once,
    free_port,
    hook_env,
    kill_agent,
    logged_losses,
    metrics_records,
    worker_pids,
)
from test_elastic import _listening, _wait_for
from test_sites import _assert_equal_replicas, _both_trained, _lighthouse, _site, _wait_all

pytestmark = pytest.mark.slow


class Lighthouse:
    """A lighthouse (``min_replicas`` 2) on one loopback port that a test kills and starts
    again; each start logs to ``base/lighthouse-<n>.log``."""

    def __init__(self, base: Path) -> None:
        self.base, self.port, self.starts = base, free_port(), 0
        self.proc = self.start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> subprocess.Popen[bytes]:
        self.proc = _lighthouse(self.port, 2, self.base / f"lighthouse-{self.starts}.log")
        self.starts += 1
        _wait_for(lambda: _listening(self.port), "the lighthouse", timeout=30)
        return self.proc

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=30)


@pytest.fixture
def outage(tmp_path: Path) -> Iterator[Lighthouse]:
    """A ``Lighthouse`` for an outage test, killed at the end."""
    house = Lighthouse(tmp_path)
    try:
        yield house
    finally:
        house.kill()


@contextmanager
def _paced_sites(
    base: Path, lighthouse: str, *extra: str, restarts: int = 0
) -> Iterator[list[Agent]]:
    """Both sites of 1 rank for 16 steps, ``extra`` flags added, held before step 12 until
    ``base/hold.12`` exists (the run outlasts the test's outage), which the block creates; on
    leaving the block both must end with status 0 (whatever is left is killed)."""
    paced = {**hook_env(perturb="hold:12"), "TORCHRUN_DDP_HOLD_FILE": str(base / "hold")}
    logs = [base / f"site-{site}.log" for site in range(2)]
    procs = [
        _site(base, site, 16, lighthouse, logs[site], paced, 1, restarts, extra) for site in (0, 1)
    ]
    try:
        yield procs
        _wait_all(procs, logs)
    finally:
        for proc in procs:
            if proc.poll() is None:
                kill_agent(proc)


def test_a_lighthouse_outage_costs_a_stall_within_the_quorum_timeout_and_a_restart_past_it(
    tmp_path: Path, outage: Lighthouse
) -> None:
    """Two outages of one run (--quorum-timeout-s 20, one torchrun restart per site for the one
    outage that stops them). The first: the lighthouse is killed once both sites trained to
    step 4 and started again on its port 6 s later (it keeps nothing: the sites register again
    by their heartbeats); the sites wait at their next sync, their quorum call retried
    (--quorum-retries), then train on with the same processes. The second: the lighthouse is
    killed again and the hold before step 12 released; every site's next quorum fails after
    20 s, its rank stops with one line naming the timeout, torchrun restarts the site; the
    lighthouse is started once both have stopped, and the new attempts resume their
    checkpoints, join and end the run with equal replicas, every step logged."""
    logs = [tmp_path / f"site-{site}.log" for site in range(2)]
    with _paced_sites(tmp_path, outage.address, "--quorum-timeout-s", "20", restarts=1) as procs:
        _wait_for(lambda: _both_trained(tmp_path, 4), "both sites at step 4", 300)
        workers = [worker_pids(proc.pid) for proc in procs]
        outage.kill()
        down = max(logged_losses(tmp_path / "out-0"))
        time.sleep(6)
        assert max(logged_losses(tmp_path / "out-0")) <= down + 2  # stopped at its next sync
        outage.start()
        _wait_for(lambda: _both_trained(tmp_path, min(down + 3, 11)), "a sync after it", 120)
        assert workers == [worker_pids(proc.pid) for proc in procs]  # the same processes
        for site in range(2):
            assert "attempt 2" not in logs[site].read_text()
        records = metrics_records(tmp_path / "out-0")
        stall = max(r["step_time_s"] for r in records if "loss" in r)
        print(f"lighthouse outage of 6 s: site 0's longest step {stall:.1f} s")  # pytest -s
        assert stall > 4  # the outage stalled a sync
        outage.kill()
        (tmp_path / "hold.12").touch()
        stopped = "sites: no quorum within --quorum-timeout-s 20 s"
        _wait_for(lambda: all(stopped in log.read_text() for log in logs), "both stopped", 180)
        outage.start()
    for site in range(2):
        text = logs[site].read_text()
        assert "attempt 2" in text and "resumed from" in text, text[-3000:]
        assert_logged_once(tmp_path / f"out-{site}", 16)
    _assert_equal_replicas(tmp_path)
