"""Fault-tolerant sites (``--fault-tolerance sites``, on torchft): each site its own torchrun job,
the sites meeting through a torchft lighthouse on loopback, the methods' syncs across them
through the Managers' gloo process group.

Fast: the flags' checks, the healing transfer's format (safetensors + JSON + SHA-256) refusing
what it must, a data position's record, the replica check after a heal, the plan's healing row.
Slow (real processes): two sites train what one torchrun job of all their ranks trains, also
after both stop and resume (DiLoCo, SparseLoCo under hsdp: the same losses and
bit-identical final weights); a site killed with SIGKILL and its disk wiped while the other
trains on without a restart, started again and healed; a site of 2 ranks restarted by torchrun,
healed. The lighthouse's outages: tests/test_sites_outages.py."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from distributed_harness import (
    Agent,
    assert_logged_once,
    final_weights,
    folder_args,
    free_port,
    hook_env,
    kill_agent,
    logged_losses,
    metrics_records,
    run_agent,
    run_distributed,
    start_agent,
    subprocess_env,
    torchrun_command,
    worker_pids,
)
from test_elastic import _listening, _wait_for
from tiny_models import train_in_group

from torchrun_ddp.checkpoint.heal import FORMAT, decode, encode
from torchrun_ddp.config_io import parse_config
from torchrun_ddp.distributed import DistEnv
from torchrun_ddp.dry_run import dry_run
from torchrun_ddp.errors import UserError
from torchrun_ddp.optim.demo import DemoSettings
from torchrun_ddp.optim.exchange import InFlight
from torchrun_ddp.sites import data_place, site_settings
from torchrun_ddp.sites.adamw import SiteAdamW
from torchrun_ddp.sites.check import HealCheck
from torchrun_ddp.sites.demo import SiteDeMo
from torchrun_ddp.sites.link import start_held
from torchrun_ddp.sites.positions import (
    GATHER_BYTES,
    Shared,
    gather_blobs,
    pack,
    position_files,
    read_position,
    record_files,
    unpack,
    write_position,
)

LIGHTHOUSE = Path(sys.executable).parent / "torchft_lighthouse"
DILOCO = ("--optimizer", "diloco", "--local-steps", "2")
"""Short windows: a sync every other step, so a kill lands near one."""
MULOCO = ("--optimizer", "muloco", "--local-steps", "2")
"""MuLoCo: Muon inside a site, SparseLoCo's gathered messages across sites at each sync."""
ADAMW = ("--optimizer", "adamw")
"""AdamW: the gradients averaged over the live sites every step."""
DCT = (
    "--compression",
    "dct",
    "--compression-ratio",
    "0.25",
    "--compression-value-dtype",
    "bfloat16",
)
"""AdamW's exchange through the dct hook (a quarter of each block's coefficients, in bf16)."""
TOPK = ("--compression", "dct-topk", "--compression-topk", "8")
"""AdamW's exchange through the dct-topk hook: each rank's 8 largest coefficients of each block
gathered from every live site (a healing site's zeros among them)."""
POWERSGD = ("--compression", "powersgd", "--powersgd-rank", "2")
"""AdamW's exchange through PowerSGD (rank 2 factors, compressing from step 2): the P and Q
memories are state the sites share, which a heal sends; the error feedback is each site's."""
DEMO = ("--optimizer", "demo", "--demo-topk", "8")
"""DeMo: every rank's top-k message gathered over the live sites every step."""
SPARSELOCO = ("--optimizer", "sparseloco")
"""Given after DILOCO: the later --optimizer wins, the sync every other step stays."""
SHARDED = (*SPARSELOCO, "--data-parallel", "hsdp", "--shard-degree", "2")
"""SparseLoCo with FSDP2 over a site's 2 ranks (one replica in the site)."""


def _sites_flags(site: int, lighthouse: str, *extra: str) -> list[str]:
    return [
        "--fault-tolerance", "sites", "--sites", "2", "--site-id", str(site),
        "--lighthouse", lighthouse, "--site-address", "127.0.0.1", *extra,
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--site-id", "1"], "--site-id applies to --fault-tolerance sites only"),
        (["--fault-tolerance", "sites", "--sites", "2", "--site-id", "2", *DILOCO], "--site-id"),
        (
            ["--fault-tolerance", "sites", "--sites", "2", "--optimizer", "demo",
             "--overlap-exchange"],
            "demo exchanges across sites without --overlap-exchange for now",
        ),
        (
            ["--fault-tolerance", "sites", "--sites", "2", "--optimizer", "demo",
             "--compression-scope", "inter-node"],
            "demo exchanges across sites with --compression-scope global",
        ),
        (
            ["--fault-tolerance", "sites", "--sites", "2", "--compression", "bf16",
             "--compression-scope", "inter-node"],
            "--compression-scope inter-node does not exchange across sites",
        ),
        (
            ["--fault-tolerance", "sites", "--sites", "2", "--zero1"],
            "adamw exchanges across sites without --zero1 for now; drop it",
        ),
        (["--fault-tolerance", "sites", "--sites", "2", *DILOCO], "needs the torchft lighthouse"),
        (
            ["--fault-tolerance", "sites", "--sites", "2", *DILOCO, "--site-heartbeat-ms", "9000",
             "--quorum-timeout-s", "10"],
            "fewer than 2 heartbeats in the quorum timeout",
        ),
        (
            ["--fault-tolerance", "sites", "--sites", "2", *DILOCO, "--overlap-exchange"],
            "without --overlap-exchange",
        ),
        (
            ["--fault-tolerance", "sites", "--sites", "2", *DILOCO, *SPARSELOCO,
             "--compression-scope", "inter-node"],
            "sparseloco syncs across sites with --compression-scope global",
        ),
        (
            ["--fault-tolerance", "sites", "--sites", "2", *DILOCO, "--data-parallel", "fsdp"],
            "runs --data-parallel ddp or hsdp inside each site",
        ),
        (
            ["--fault-tolerance", "sites", "--sites", "2", *DILOCO, "--site-start-wait-s", "-1"],
            "--site-start-wait-s must be >= 0",
        ),
        (["--site-start-wait-s", "30"], "--site-start-wait-s applies to --fault-tolerance sites"),
    ],
)  # fmt: skip
def test_sites_flags_are_checked_in_one_line(
    flags: list[str], message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    lighthouse = [] if "lighthouse" in message else ["--lighthouse", "127.0.0.1:1"]
    flags = [*flags, *lighthouse] if "--fault-tolerance" in flags else flags
    with pytest.raises(UserError, match=message) as error:
        parse_config(flags)
    assert "\n" not in str(error.value)


def test_sites_split_the_document_order_and_derive_timeouts() -> None:
    config = parse_config(
        ["--fault-tolerance", "sites", "--sites", "3", "--site-id", "2", *DILOCO,
         "--train-timeout-s", "40", "--lighthouse", "10.0.0.1:29510"]
    )  # fmt: skip
    assert data_place(config, 1, 4) == (9, 12)  # site 2's rank 1 of 4: global rank 9 of 12
    settings = site_settings(config)
    assert (settings.quorum_timeout_s, settings.timeout_s) == (40, 40)
    assert settings.lighthouse == "http://10.0.0.1:29510"
    assert settings.replica_id == "site2"
    assert data_place(parse_config([]), 1, 4) == (1, 4)


def test_the_healing_transfer_round_trips_and_refuses_a_changed_payload() -> None:
    state = {"outer": {"synced": {"0": torch.arange(6.0).view(2, 3)}, "position": 0}, "step": 7}
    header, payload = encode(state, 3)
    parsed = json.loads(header)
    assert parsed["format"] == FORMAT and parsed["bytes"] == len(payload)
    back = decode(parsed, payload, 3)
    assert isinstance(back, dict) and back["step"] == 7
    assert torch.equal(back["outer"]["synced"]["0"], state["outer"]["synced"]["0"])
    damaged = bytearray(payload)
    damaged[-1] ^= 0xFF
    with pytest.raises(ValueError, match="SHA-256"):
        decode(parsed, bytes(damaged), 3)
    with pytest.raises(ValueError, match="step 3, the quorum's is 4"):
        decode(parsed, payload, 4)


def test_a_data_position_round_trips_on_disk_and_between_sites(tmp_path: Path) -> None:
    position = {"epoch": 1, "offsets": torch.tensor([3, 5]), "nested": {"tokens": [1, 2]}}
    write_position(tmp_path, 1, pack(0, 12, position))
    step, back = read_position(tmp_path, 1) or (0, {})
    assert step == 12 and back["epoch"] == 1 and back["nested"] == {"tokens": [1, 2]}
    assert torch.equal(back["offsets"], position["offsets"])
    assert read_position(tmp_path, 0) is None
    shared = unpack(pack(3, 14, position, "ab12"))
    assert (shared.site, shared.step, shared.digest) == (3, 14, "ab12")
    assert torch.equal(shared.position["offsets"], position["offsets"])
    blob = pack(3, 14, position)
    blob[-1] ^= 0xFF
    with pytest.raises(ValueError, match="SHA-256"):
        unpack(blob)
    write_position(tmp_path, 1, blob)  # a record damaged on disk is refused, not trusted
    with pytest.raises(ValueError, match="SHA-256"):
        read_position(tmp_path, 1)


def test_a_record_torn_by_a_kill_leaves_the_one_before(tmp_path: Path) -> None:
    """The two slots are written in turn; a slot cut short reads as damaged and the other's
    record is taken; a shorter record over a longer one's bytes ignores their tail."""
    long = {"carry": list(range(500))}
    write_position(tmp_path, 0, pack(0, 11, long))
    write_position(tmp_path, 0, pack(0, 12, {"carry": []}))
    assert read_position(tmp_path, 0) == (12, {"carry": []})
    write_position(tmp_path, 0, pack(0, 13, {"carry": [1]}))  # over step 11's longer bytes
    assert read_position(tmp_path, 0) == (13, {"carry": [1]})
    newest = record_files(tmp_path, 0)[1]
    newest.write_bytes(newest.read_bytes()[:40])  # a kill mid-write
    assert read_position(tmp_path, 0) == (12, {"carry": []})


def _gathered(rank: int, world_size: int) -> list[bytes]:
    group = dist.group.WORLD
    assert group is not None
    size = 10 if rank == 0 else GATHER_BYTES + 5  # one fits the single all-gather, one does not
    blob = torch.full((size,), rank + 1, dtype=torch.uint8)
    small = gather_blobs(group, torch.tensor([rank + 7], dtype=torch.uint8), timedelta(seconds=60))
    return [bytes(b.numpy()) for b in [*small, *gather_blobs(group, blob, timedelta(seconds=60))]]


def test_the_sites_share_blobs_of_any_length() -> None:
    for got in run_distributed(_gathered, 2):
        assert got == [b"\x07", b"\x08", b"\x01" * 10, b"\x02" * (GATHER_BYTES + 5)]


def test_a_data_position_recorded_by_an_earlier_version_is_still_read(tmp_path: Path) -> None:
    """Before the packed record: a JSON header and a safetensors payload per rank."""
    header, payload = encode({"data": {"epoch": 2}}, 9)
    for path, data in zip(position_files(tmp_path, 0), (header, payload), strict=True):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    assert read_position(tmp_path, 0) == (9, {"epoch": 2})


def test_replicas_are_compared_at_the_first_sync_after_a_heal(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The site that took the state stops when its digest differs from the sender's; the
    sender logs it and trains on; equal digests are logged; a sync that is not committed
    waits for the next."""
    took, sent = HealCheck(1), HealCheck(0)
    for check, digest, healed in ((took, "aa", True), (sent, "bb", False)):
        check.fingerprint = lambda digest=digest: digest
        check.mark(took=healed)
        check.settle([])  # the sync of the heal: nothing to compare yet
        assert check.due() == digest  # the next sync shares the fingerprint
    shared = [Shared(0, 4, {}, "bb"), Shared(1, 4, {}, "aa"), Shared(2, 4, {}, "")]
    took.settle(None)  # not committed: still due
    with pytest.raises(UserError, match=r"site 1's synced state differs from site\(s\) \[0\]"):
        took.settle(shared)
    with caplog.at_level("INFO", logger="torchrun_ddp"):
        sent.settle(shared)
        assert "the healed site stops, this one trains on" in caplog.text
        assert sent.due() == ""  # checked once
        equal = HealCheck(1)
        equal.fingerprint = lambda: "bb"
        equal.mark(took=True)
        equal.settle([])
        equal.due()
        equal.settle([Shared(0, 4, {}, "bb"), Shared(1, 4, {}, "bb")])
        assert "replicas agree after the heal (sites [0, 1]" in caplog.text


def test_an_adamw_step_whose_exchange_was_not_committed_is_dropped() -> None:
    """A site died during the step's exchange: no update (weights and moments as they were);
    the next committed exchange updates again."""
    param = torch.nn.Parameter(torch.ones(3))
    optimizer = SiteAdamW([param], lr=0.1)
    param.grad = torch.ones(3)
    optimizer.committed = False
    optimizer.step()
    assert torch.equal(param.detach(), torch.ones(3)) and not optimizer.state
    optimizer.committed = True
    optimizer.step()
    assert (param.detach() < 1).all() and optimizer.state


def test_a_demo_step_whose_exchange_was_not_committed_keeps_its_gradient_in_the_momentum() -> None:
    """A site died during the step's exchange: no update, and what the message took out of the
    momentum is put back (the step's gradient waits in it for the next exchange)."""
    generator = torch.Generator().manual_seed(0)
    param = torch.nn.Parameter(torch.randn(8, 8, generator=generator))
    grad = torch.randn(8, 8, generator=generator)
    param.grad = grad.clone()
    optimizer = SiteDeMo([param], lr=0.1, settings=DemoSettings(topk=4, tile=8))
    message = optimizer._compress(param, 0.1)
    delta = optimizer.state[param]["delta"]
    assert not torch.allclose(delta, 0.1 * grad)  # the message took part of it
    before = param.detach().clone()
    optimizer.committed = False
    nothing = torch.zeros(0, message.numel(), dtype=torch.uint8)
    optimizer._apply(InFlight(message, None, [(0.1, 0.0)], [nothing]))
    assert torch.equal(param.detach(), before)
    assert torch.allclose(delta, 0.1 * grad, atol=1e-7)


# -- real processes --------------------------------------------------------------------------


def _lighthouse(port: int, min_replicas: int, log: Path) -> subprocess.Popen[bytes]:
    """A torchft lighthouse on loopback: a site is dead after 1 s without a heartbeat; a
    quorum waits up to 30 s for a site that heartbeats but has not asked for it yet (one that
    is starting)."""
    command = [
        str(LIGHTHOUSE), "--min_replicas", str(min_replicas), "--bind", f"127.0.0.1:{port}",
        "--join_timeout_ms", "30000", "--heartbeat_timeout_ms", "1000", "--quorum_tick_ms", "50",
    ]  # fmt: skip
    return subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT)


def _site(
    base: Path,
    site: int,
    steps: int,
    lighthouse: str,
    log: Path,
    env: dict[str, str] | None = None,
    ranks: int = 1,
    restarts: int = 0,
    extra: tuple[str, ...] = (),
    method: tuple[str, ...] = DILOCO,
) -> Agent:
    """Site ``site``: its own torchrun job of ``ranks`` ranks (forked; ``restarts``: torchrun's
    --max-restarts, one per fault the test injects), the ``method``'s flags and ``extra``, own
    folders ``base/site-<n>`` and ``base/out-<n>``; ``env``: variables added to its environment. Its
    quorum timeout (--train-timeout-s, 90 s) outlasts the lighthouse's join timeout (30 s): a
    site that starts late, while the other waits at a hold, gets a quorum of itself instead of
    timing out."""
    args = folder_args(
        base, f"site-{site}", steps, *method, "--output-dir", str(base / f"out-{site}"),
        *_sites_flags(site, lighthouse, "--train-timeout-s", "90", *extra),
    )  # fmt: skip
    command = torchrun_command(args, ranks, forked=True, extra=(f"--max-restarts={restarts}",))
    return start_agent(command, log, {**subprocess_env(), **(env or {})}, append=True)


@pytest.fixture
def lighthouse(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[str]:
    """A lighthouse (``min_replicas`` from the test's ``lighthouse_min`` marker, else 2)."""
    marker = request.node.get_closest_marker("lighthouse_min")
    port = free_port()
    proc = _lighthouse(port, marker.args[0] if marker else 2, tmp_path / "lighthouse.log")
    try:
        _wait_for(lambda: _listening(port), "the lighthouse", timeout=30)
        yield f"127.0.0.1:{port}"
    finally:
        proc.kill()
        proc.wait(timeout=30)


def _stop_left(procs: list[Agent]) -> None:
    """Kill the torchrun trees of ``procs`` still running (a test that failed midway)."""
    for proc in procs:
        if proc.poll() is None:
            kill_agent(proc)


def _wait_all(procs: list[Agent], logs: list[Path], timeout: float = 400) -> None:
    for proc, log in zip(procs, logs, strict=True):
        assert proc.wait(timeout=timeout) == 0, log.read_text()[-4000:]


def _run_sites(
    base: Path,
    steps: int,
    lighthouse: str,
    env: dict[str, str],
    method: tuple[str, ...],
    ranks: int,
) -> list[int]:
    """Both sites' torchrun jobs of ``ranks`` ranks until they end (``env`` added to both,
    ``method``'s flags); their exit statuses."""
    logs = [base / f"site-{site}.log" for site in range(2)]
    procs = [
        _site(base, site, steps, lighthouse, logs[site], env, ranks, 0, (), method)
        for site in (0, 1)
    ]
    try:
        return [proc.wait(timeout=400) for proc in procs]
    finally:
        _stop_left(procs)


def _assert_equal_replicas(base: Path) -> None:
    """The two sites' final models are bit-identical."""
    want, have = final_weights(base / "out-0"), final_weights(base / "out-1")
    assert have.keys() == want.keys()
    for name, tensor in want.items():
        assert torch.equal(have[name], tensor), name


@pytest.mark.slow
@pytest.mark.parametrize(
    ("method", "ranks"),
    [
        (DILOCO, 1),
        ((*DILOCO, *SHARDED), 2),
        (MULOCO, 1),
        (ADAMW, 1),
        ((*ADAMW, *SHARDED[2:]), 2),
        ((*ADAMW, *DCT, *SHARDED[2:]), 2),
        ((*ADAMW, *TOPK, *SHARDED[2:]), 2),
        ((*ADAMW, *POWERSGD, *SHARDED[2:]), 2),
        (DEMO, 1),
        ((*DEMO, *SHARDED[2:]), 2),
    ],
    ids=[
        "diloco-2x1",
        "sparseloco-hsdp-2x2",
        "muloco-2x1",
        "adamw-2x1",
        "adamw-hsdp-2x2",
        "adamw-dct-bf16-hsdp-2x2",
        "adamw-dct-topk-hsdp-2x2",
        "adamw-powersgd-hsdp-2x2",
        "demo-2x1",
        "demo-hsdp-2x2",
    ],
)
def test_two_sites_train_what_one_job_of_their_ranks_trains_and_resume_after_both_stop(
    tmp_path: Path, lighthouse: str, method: tuple[str, ...], ranks: int
) -> None:
    """DiLoCo, MuLoCo (SparseLoCo's gather across sites, Muon inside), DeMo (every rank's
    message gathered every step) and dense AdamW (DDP inside a site, the fp32 sum across sites)
    at 2 x 1 against one job of 2; SparseLoCo and AdamW (each
    rank's gradient shard averaged across sites every step: dense, dct, dct-topk or PowerSGD)
    and DeMo (each rank's message of its shard) with FSDP2 over each site's 2
    ranks, against one hsdp job of 4 (2 replicas of 2 shards). Both
    sites SIGKILL themselves in step 7 (after their checkpoint and committed sync of step 6;
    torchrun does not restart them), so the whole run stops; started again, each site resumes
    its own checkpoint of step 6 (no heal: both at the same step) and the run ends as one
    uninterrupted torchrun job of all their ranks ends: the same loss at every step and
    bit-identical final weights."""
    steps, logs = 8, [tmp_path / f"site-{site}.log" for site in range(2)]
    stopped = _run_sites(tmp_path, steps, lighthouse, hook_env(faults="step:0:7"), method, ranks)
    assert all(status != 0 for status in stopped), stopped
    assert max(logged_losses(tmp_path / "out-0")) == 6
    sizes = [len(log.read_text()) for log in logs]
    status = _run_sites(tmp_path, steps, lighthouse, subprocess_env(), method, ranks)
    assert status == [0, 0], logs[0].read_text()[-4000:]
    for log, size in zip(logs, sizes, strict=True):
        again = log.read_text()[size:]
        assert "at step 6" in again and "resumed from" in again, again[-4000:]
        assert "sites: healed" not in again, again[-4000:]
    _assert_trained_as_one_job(tmp_path, steps, method, ranks)
    _assert_same_bytes_but_the_joins(tmp_path, _optimizer(method))


@pytest.mark.slow
def test_a_site_that_resumes_an_older_step_heals_from_the_newest(
    tmp_path: Path, lighthouse: str
) -> None:
    """Both sites SIGKILL themselves in step 7 (after their checkpoint of step 6); site 1's
    step-6 checkpoint is then deleted, so when both start again site 1 resumes step 4 and site
    0 step 6. In their join (every site joining) site 1 sees the newer step and holds; site 0
    begins, and site 1 heals from it at its next sync instead of training on from step 4
    beside it: the replicas agree after the heal and end bit-identical."""
    steps, logs = 10, [tmp_path / f"site-{site}.log" for site in range(2)]
    stopped = _run_sites(tmp_path, steps, lighthouse, hook_env(faults="step:0:7"), DILOCO, 1)
    assert all(status != 0 for status in stopped), stopped
    shutil.rmtree(tmp_path / "site-1" / "step-6")
    sizes = [len(log.read_text()) for log in logs]
    assert _run_sites(tmp_path, steps, lighthouse, subprocess_env(), DILOCO, 1) == [0, 0]
    newest, older = (log.read_text()[size:] for log, size in zip(logs, sizes, strict=True))
    assert re.search(r"resumed from \S+step-4 at step 4", older), older[-4000:]
    assert "resumed step 4 and another site step 6" in older, older[-4000:]
    assert "sites: healed from a live site" in older, older[-4000:]
    assert "replicas agree after the heal" in older, older[-4000:]
    assert "sites: healed" not in newest, newest[-4000:]
    _assert_equal_replicas(tmp_path)


def _assert_trained_as_one_job(base: Path, steps: int, method: tuple[str, ...], ranks: int) -> None:
    """The two sites' run (``base/out-<n>``) is one torchrun job of their ``2 * ranks`` ranks
    with ``method``'s flags, run here: the same loss at every step and bit-identical final
    weights on both sites."""
    one_job = folder_args(
        base, "one-job", steps, *method, "--output-dir", str(base / "one-job-out")
    )
    done = run_agent(torchrun_command(one_job, 2 * ranks, forked=True), subprocess_env(), 400)
    assert done.returncode == 0, done.stderr[-4000:]
    expected = logged_losses(base / "one-job-out")
    sites = [logged_losses(base / f"out-{site}") for site in range(2)]
    assert sorted(expected) == list(range(1, steps + 1))
    for step, loss in expected.items():  # each site logs its ranks' mean loss: their mean
        assert (sites[0][step] + sites[1][step]) / 2 == pytest.approx(loss, rel=1e-6), step
    want = final_weights(base / "one-job-out")
    for site in range(2):
        have = final_weights(base / f"out-{site}")
        for name, tensor in want.items():
            assert torch.equal(have[name], tensor), (site, name)


@pytest.mark.parametrize(
    ("mine", "table", "members", "sites", "held"),
    [
        (0, [(0, True)], 1, 2, True),  # short of a site, in time: wait
        (0, [(0, True), (0, False)], 2, 3, True),  # one member still waits: all hold
        (0, [(0, False), (0, False)], 2, 3, False),  # every wait is over: begin
        (0, [(0, False), (0, False)], 2, 2, False),  # all here: begin
        (4, [(4, False), (6, False)], 2, 2, True),  # resumed older: wait for the newest
        (6, [(4, False), (6, False)], 2, 2, False),  # the newest begins
        (6, [(4, True), (6, True)], 2, 3, True),  # even the newest waits for a missing site
    ],
)
def test_a_join_is_held_while_a_member_waits_for_missing_sites_or_another_resumed_newer(
    mine: int, table: list[tuple[int, bool]], members: int, sites: int, held: bool
) -> None:
    assert start_held(mine, table, members, sites) is held


@pytest.mark.slow
@pytest.mark.lighthouse_min(1)
def test_sites_started_apart_wait_for_each_other_and_train_what_one_job_trains(
    tmp_path: Path, lighthouse: str
) -> None:
    """A lighthouse that forms a quorum of one site, no hold hook: site 0 starts alone and
    holds its join (``--site-start-wait-s``, 120 s by default) until site 1, started once site
    0 says it waits, is in its quorum. Neither heals, and the run is one job of their ranks:
    the same loss at every step, bit-identical final weights."""
    steps, logs = 6, [tmp_path / f"site-{site}.log" for site in range(2)]
    procs = [_site(tmp_path, 0, steps, lighthouse, logs[0])]
    try:
        _wait_for(lambda: "1 of 2 sites in the quorum" in logs[0].read_text(), "site 0's wait")
        time.sleep(2)  # a few held joins more
        procs.append(_site(tmp_path, 1, steps, lighthouse, logs[1]))
        _wait_all(procs, logs)
    finally:
        _stop_left(procs)
    for log in logs:
        assert "sites: healed" not in log.read_text(), log.read_text()[-4000:]
    _assert_trained_as_one_job(tmp_path, steps, DILOCO, 1)


@pytest.mark.slow
@pytest.mark.lighthouse_min(1)
@pytest.mark.parametrize("method", [DILOCO, ADAMW, DEMO], ids=["diloco", "adamw", "demo"])
def test_a_site_whose_sync_failed_alone_heals_at_its_next_sync(
    tmp_path: Path, lighthouse: str, method: tuple[str, ...]
) -> None:
    """Site 1 votes no on its third sync (the test hook ``vote-no``: a sync that failed on it
    alone) while site 0 commits it, so site 1 is a sync behind in the middle of the run. At its
    next sync it heals from site 0, the replicas agree after the heal, and both sites end
    bit-identical, neither restarted."""
    steps, logs = 10, [tmp_path / f"site-{site}.log" for site in range(2)]
    envs = [subprocess_env(), hook_env(perturb="vote-no:3")]
    procs = [
        _site(tmp_path, site, steps, lighthouse, logs[site], envs[site], method=method)
        for site in (0, 1)
    ]
    try:
        _wait_all(procs, logs)
    finally:
        _stop_left(procs)
    live, behind = (log.read_text() for log in logs)
    assert "sites: healed" not in live, live[-4000:]
    assert "not committed" in behind, behind[-4000:]
    for line in ("sites: healed from a live site at sync", "replicas agree after the heal"):
        assert line in behind, behind[-4000:]
    assert "attempt 1: ready" in behind and "attempt 2" not in behind, behind[-4000:]
    _assert_equal_replicas(tmp_path)


@pytest.mark.slow
@pytest.mark.lighthouse_min(1)
def test_a_site_alone_starts_once_its_start_wait_is_over(tmp_path: Path, lighthouse: str) -> None:
    """With ``--site-start-wait-s 3`` and the other site never started, site 0 holds its join
    for 3 s, says it starts with 1 of 2 sites, and trains to the end."""
    log = tmp_path / "site-0.log"
    began = time.monotonic()
    proc = _site(tmp_path, 0, 4, lighthouse, log, extra=("--site-start-wait-s", "3"))
    _wait_all([proc], [log])
    text = log.read_text()
    assert "1 of 2 sites in the quorum" in text, text[-4000:]
    assert "starting with 1 of 2 sites after --site-start-wait-s" in text, text[-4000:]
    assert max(logged_losses(tmp_path / "out-0")) == 4
    assert time.monotonic() - began > 3


def _optimizer(flags: tuple[str, ...]) -> str:
    """The method ``flags`` choose (the last --optimizer wins)."""
    return [flags[i + 1] for i, flag in enumerate(flags) if flag == "--optimizer"][-1]


def _assert_same_bytes_but_the_joins(base: Path, optimizer: str) -> None:
    """What a rank of site 0 sends per step, its exchange across sites included, is what one
    job's rank sends (plus the 24-byte header of a gathered message: SparseLoCo's and MuLoCo's
    at each sync, every 2nd step, DeMo's every step; DiLoCo's all-reduce has none); the first
    step of each start (1 and 7) also carries the sites' join. AdamW's dense figure is the one
    job's too."""
    adamw = optimizer == "adamw"
    sent, one_job = _step_bytes(base / "out-0"), _step_bytes(base / "one-job-out")
    for step in (1, 7):
        assert sent.pop(step)[0] > one_job.pop(step)[0], step
    for step, (wire, dense) in one_job.items():
        header = {"adamw": 0, "diloco": 0, "demo": 24}.get(optimizer, 0 if step % 2 else 24)
        assert sent[step][0] == wire + header, (step, sent[step], wire)
        assert not adamw or sent[step][1] == dense, (step, sent[step], dense)


def _step_bytes(output_dir: Path) -> dict[int, tuple[int, int]]:
    """Step -> the ``comm_bytes`` and ``comm_bytes_dense`` of its record in metrics.jsonl."""
    records = [r for r in metrics_records(output_dir) if "comm_bytes" in r]
    assert records, output_dir
    return {r["step"]: (r["comm_bytes"], r["comm_bytes_dense"]) for r in records}


def _both_trained(base: Path, step: int) -> bool:
    """Whether both sites have logged ``step`` or a later one, and site 1 has committed a
    sync with site 0 (its data position's record)."""
    logged = all(max(logged_losses(base / f"out-{site}"), default=0) >= step for site in (0, 1))
    return logged and read_position(base / "site-1", 0) is not None


@pytest.mark.slow
@pytest.mark.lighthouse_min(1)
@pytest.mark.parametrize(
    ("method", "healed_at", "ranks"),
    [
        (DILOCO, 20, 1),
        (ADAMW, 21, 1),
        ((*ADAMW, *DCT), 21, 1),
        ((*ADAMW, *DCT, *SHARDED[2:]), 21, 2),
        ((*ADAMW, *TOPK), 21, 1),
        ((*ADAMW, *POWERSGD), 21, 1),
        (DEMO, 21, 1),
    ],
    ids=[
        "diloco",
        "adamw",
        "adamw-dct-bf16",
        "adamw-dct-bf16-hsdp-2x2",
        "adamw-dct-topk",
        "adamw-powersgd",
        "demo",
    ],
)
def test_a_killed_site_costs_the_other_no_restart_and_heals_when_it_comes_back(
    tmp_path: Path, lighthouse: str, method: tuple[str, ...], healed_at: int, ranks: int
) -> None:
    """Site 1 is SIGKILLed once it has logged step 6 and its disk wiped; site 0 trains on alone and
    waits before step 20 (``hold``: only so that this short run is not over before site 1's new
    process has imported torch) until site 1 runs again; site 1 starts from nothing, heals in site
    0's sync of step 20 (DiLoCo's, in the optimizer step after the hold) or 21 (AdamW's exchange,
    dense or through the dct or dct-topk hook, after backward and before the hold: site 1 sends
    zeros with its error feedback set aside, a row of dct-topk's all-gather that the sum leaves out,
    PowerSGD's factors taken from site 0; DeMo's every step, whose quorum also starts before the
    hold, with a message marked as not taking part), takes its own data position at its last
    committed sync from site 0's copy, and both train to step 24. At the start both sites wait
    before their join until both are ready (``hold:0``), so they join in one quorum and neither
    heals from the other: a site alone (the lighthouse's minimum is 1) that reached its hold at step
    20 before the other started would leave the other a quorum of itself."""
    steps, hold, started = 24, tmp_path / "hold", time.monotonic()
    logs = [tmp_path / f"site-{site}.log" for site in range(2)]
    paced = {**hook_env(perturb="hold:0,hold:20"), "TORCHRUN_DDP_HOLD_FILE": str(hold)}
    procs = [
        _site(tmp_path, site, steps, lighthouse, logs[site], paced, ranks, method=method)
        for site in range(2)
    ]
    try:
        _wait_for(lambda: all("ready to train" in log.read_text() for log in logs), "starts", 300)
        hold.with_suffix(".0").touch()  # both join in one quorum
        _wait_for(lambda: _both_trained(tmp_path, 6), "both sites at step 6", 300)
        workers = worker_pids(procs[0].pid)
        assert not any("sites: healed" in log.read_text() for log in logs)  # started together
        kill_agent(procs[1])
        killed = len(logs[0].read_text()), max(logged_losses(tmp_path / "out-0"), default=0)
        record = read_position(tmp_path / "site-1", 0)  # its last committed sync's
        assert record is not None
        for folder in ("site-1", "out-1"):  # its disk is gone: a new machine
            shutil.rmtree(tmp_path / folder)
        _wait_for(
            lambda: max(logged_losses(tmp_path / "out-0"), default=0) >= 14, "site 0 alone", 120
        )
        before = len(logs[1].read_text())
        procs[1] = _site(tmp_path, 1, steps, lighthouse, logs[1], None, ranks, method=method)
        # released once site 1 asks for its join's quorum: site 0's sync of step 20 then meets
        # it (asked first, site 0's quorum of itself would form at once)
        _wait_for(lambda: "Start quorum" in logs[1].read_text()[before:], "site 1's join")
        assert worker_pids(procs[0].pid) == workers  # the same processes trained on
        hold.with_suffix(".20").touch()
        _wait_all(procs, logs)
    finally:
        _stop_left(procs)
    print(f"kill and heal test: {time.monotonic() - started:.1f} s")  # pytest -s
    site0, again = logs[0].read_text(), logs[1].read_text()[before:]
    assert "sites: healed" not in site0[killed[0] :] and "attempt 2" not in site0, site0[-3000:]
    healed = [line for line in again.splitlines() if "sites: healed from a live site" in line]
    assert len(healed) == 1, again[-4000:]
    print(healed[0])
    taken = re.search(r"own data position of step (\d+) .*, from its copy on a live site", again)
    assert taken is not None, again[-4000:]
    assert record[0] <= int(taken.group(1)) <= record[0] + 2  # a kill between commit and write
    assert f"sites: healed, training on from step {healed_at}" in again, again[-4000:]
    for log in (site0[killed[0] :], again):  # fingerprinted at the sync after the heal
        assert "sites: replicas agree after the heal (sites [0, 1]" in log, log[-3000:]
    trained = sorted(step for step in logged_losses(tmp_path / "out-0") if step >= killed[1])
    assert trained == list(range(max(killed[1], 1), steps + 1))  # every step, none lost
    _assert_equal_replicas(tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize(
    "method", [(*DILOCO, *SHARDED), (*DEMO, *SHARDED[2:])], ids=["sparseloco-hsdp", "demo-hsdp"]
)
def test_a_site_of_two_ranks_restarted_by_torchrun_resumes_heals_and_rejoins(
    tmp_path: Path, lighthouse: str, method: tuple[str, ...]
) -> None:
    """2 sites x 2 ranks. Rank 1 of site 1 SIGKILLs itself in step 7 (after the committed sync
    and checkpoint of step 6); torchrun restarts site 1 (one restart for the one fault), which
    resumes its checkpoint, heals from site 0 (ahead of it) and takes its ranks' own data
    positions from its disk; site 0 keeps its processes (it waits at its sync for the quorum of
    2 sites). The restarted site's Managers meet in a new store: torchrun's outlives the
    restart and would still hold the dead attempt's Manager address."""
    steps, logs = 12, [tmp_path / f"site-{site}.log" for site in range(2)]
    envs = [subprocess_env(), hook_env(faults="step:1:7")]
    procs = [
        _site(tmp_path, site, steps, lighthouse, logs[site], envs[site], 2, site, method=method)
        for site in range(2)
    ]
    try:
        _wait_for(lambda: max(logged_losses(tmp_path / "out-0"), default=0) >= 4, "step 4", 300)
        workers = worker_pids(procs[0].pid)
        _wait_for(lambda: "sites: healed from" in logs[1].read_text(), "site 1's heal", 300)
        assert worker_pids(procs[0].pid) == workers  # site 0: the same processes
        _wait_all(procs, logs)
    finally:
        _stop_left(procs)
    site0, site1 = (log.read_text() for log in logs)
    assert "attempt 2" in site1 and "attempt 2" not in site0, site1[-3000:]
    assert re.search(r"resumed from \S+step-6 at step 6", site1), site1[-4000:]
    again = site1[site1.index("attempt 2") :]
    assert "sites: healed from a live site" in again, again[-4000:]
    assert (
        "sites: own data position of step 6 (its last committed sync), from its own disk" in again
    )
    for log in (site0, again):
        assert "sites: replicas agree after the heal (sites [0, 1]" in log, log[-3000:]
    assert_logged_once(tmp_path / "out-0", steps)
    _assert_equal_replicas(tmp_path)


def test_the_plan_shows_a_sites_healing_transfer() -> None:
    config = parse_config(
        ["--fault-tolerance", "sites", "--sites", "2", *DILOCO, "--lighthouse", "h:1",
         "--plan-world-size", "8", "--plan-gpus-per-node", "8", "--plan-inter-node-gbit", "10"]
    )  # fmt: skip
    text = dry_run(config, DistEnv())  # LLaMA-2-7B, the default --model
    [row] = [line for line in text.splitlines() if "a site's healing from a live one" in line]
    gib, seconds = (float(cell) for cell in row.strip(" |").split(" | ")[1:])
    trained = 6_738_415_616  # LLaMA-2-7B: each rank gets the synced fp32 copy and momentum
    assert gib == pytest.approx(8 * 8 * trained / 2**30, abs=0.01)
    assert seconds == pytest.approx(8 * 8 * trained / (10e9 / 8), rel=1e-3)
    assert "a site's healing" not in dry_run(parse_config(["--plan-world-size", "8"]), DistEnv())
    # SparseLoCo under hsdp: the synced fp32 parameters only, each rank its 1/8 shard
    flags = [*DILOCO, *SPARSELOCO, "--lighthouse", "h:1", "--data-parallel", "hsdp"]
    plan = ["--plan-world-size", "8", "--plan-gpus-per-node", "8", "--shard-degree", "8"]
    sharded = parse_config(["--fault-tolerance", "sites", "--sites", "2", *flags, *plan])
    [row] = [line for line in dry_run(sharded, DistEnv()).splitlines() if "healing" in line]
    assert float(row.strip(" |").split(" | ")[1]) == pytest.approx(trained * 4 / 2**30, abs=0.01)
    # AdamW: the parameters and both moments, in the weights' dtype (fp32 by default)
    adamw = parse_config(
        ["--fault-tolerance", "sites", "--sites", "2", "--lighthouse", "h:1", *plan[:4]]
    )
    [row] = [line for line in dry_run(adamw, DistEnv()).splitlines() if "healing" in line]
    assert float(row.strip(" |").split(" | ")[1]) == pytest.approx(
        8 * 3 * trained * 4 / 2**30, abs=0.01
    )
    # and through PowerSGD rank 4: its P and Q too, fp32 [n, 4] and [m, 4] per matrix: per
    # layer q, k, v, o (4096 + 4096) and gate, up, down (11008 + 4096), and the embeddings
    # and the head (32000 + 4096)
    factors = 4 * (32 * (4 * 8192 + 3 * 15104) + 2 * 36096)
    powersgd = parse_config(
        ["--fault-tolerance", "sites", "--sites", "2", "--lighthouse", "h:1", *plan[:4],
         "--compression", "powersgd"]
    )  # fmt: skip
    [row] = [line for line in dry_run(powersgd, DistEnv()).splitlines() if "healing" in line]
    assert float(row.strip(" |").split(" | ")[1]) == pytest.approx(
        8 * (3 * trained + factors) * 4 / 2**30, abs=0.01
    )
    # under hsdp, 8 shards: each rank's 1/8 of the parameters and moments, and the factors of
    # its shards [n / 8, m]: q, k, v, o (512 + 4096), gate, up (1376 + 4096), down
    # (512 + 11008), the embeddings and the head (4000 + 4096)
    shard_factors = 4 * (32 * (4 * 4608 + 2 * 5472 + 11520) + 2 * 8096)
    hsdp = parse_config(
        ["--fault-tolerance", "sites", "--sites", "2", "--lighthouse", "h:1", *plan,
         "--compression", "powersgd", "--data-parallel", "hsdp"]
    )  # fmt: skip
    [row] = [line for line in dry_run(hsdp, DistEnv()).splitlines() if "healing" in line]
    assert float(row.strip(" |").split(" | ")[1]) == pytest.approx(
        8 * (3 * trained / 8 + shard_factors) * 4 / 2**30, abs=0.01
    )


def test_the_plan_of_adamw_across_sites_runs_its_hook_across_the_replicas() -> None:
    """AdamW through dct 0.25 bf16 across 2 sites of 8 ranks under hsdp: the plan's run is
    FSDP inside a site plus the hook's exchange across the replicas (the sites), not FSDP's
    native all-reduce of the shards."""
    flags = ["--fault-tolerance", "sites", "--sites", "2", "--lighthouse", "h:1", *DCT]
    plan = ["--data-parallel", "hsdp", "--plan-world-size", "16", "--plan-gpus-per-node", "8"]
    text = dry_run(parse_config([*flags, *plan, "--plan-inter-node-gbit", "10"]), DistEnv())
    [run] = [line for line in text.splitlines() if line.startswith("this run, per optimizer step")]
    assert "the replicas: dct 0.25 bf16 row" in run, run
    assert "native hsdp" not in run, run


def _refused_worker(rank: int, world_size: int, argv: list[str]) -> str:
    """The one-line refusal of a run on this rank (empty if it started)."""
    try:
        train_in_group(rank, world_size, argv)
    except UserError as exc:
        return str(exc)
    return ""


def test_a_hook_across_sites_refuses_hsdp_replicas_inside_a_site(tmp_path: Path) -> None:
    """A site of 2 ranks under hsdp with --shard-degree 1 (2 replicas inside the site) and a
    comm hook: refused before anything trains, on every rank (the hook runs between sites)."""
    extra = ("--data-parallel", "hsdp", "--shard-degree", "1", *DCT)
    argv = folder_args(tmp_path, "site-0", 4, *_sites_flags(0, "127.0.0.1:1", *extra))
    refusals = run_distributed(_refused_worker, 2, argv)
    assert all("set --shard-degree to the ranks of a site" in r for r in refusals), refusals
    assert not (tmp_path / "site-0").exists() or not list((tmp_path / "site-0").iterdir())
