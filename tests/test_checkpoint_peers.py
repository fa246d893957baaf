"""Checkpoint folders that are not shared (checkpoint/storage.py, transfer.py, peers.py): which
ranks see one folder, files copied between ranks in bounded chunks with a checksum, and the step
every rank can resume. Pure functions directly; collectives on real gloo ranks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch.distributed as dist
from distributed_harness import run_distributed

from torchrun_ddp.checkpoint import (
    StorageLayout,
    Stream,
    detect_storage,
    exchange,
    inventory,
    plan_across,
    single_layout,
)
from torchrun_ddp.checkpoint.storage import _domains
from torchrun_ddp.errors import UserError

LAYOUT = StorageLayout(domains=((0, 1), (2, 3)), domain=0, buddy_copies=1)
THREE = StorageLayout(domains=((0, 1), (2, 3), (4, 5)), domain=0, buddy_copies=1)


def test_a_layout_keeps_each_ranks_files_in_its_own_folder_and_the_next_ones() -> None:
    assert LAYOUT.keeps(0) == LAYOUT.keeps(1) == [0, 1, 2, 3]
    assert THREE.keeps(0) == [0, 1, 4, 5] and THREE.keeps(1) == [0, 1, 2, 3]
    assert THREE.buddy_targets(1) == [3] and THREE.buddy_targets(5) == [1]
    two_copies = StorageLayout(THREE.domains, 0, 2)
    assert two_copies.buddy_targets(2) == [4, 0] and two_copies.keeps(2) == list(range(6))
    uneven = StorageLayout(((0, 1, 2), (3,)), 0, 1)
    assert [uneven.buddy_targets(r) for r in range(4)] == [[3], [3], [3], [0]]
    assert LAYOUT.describe() == "2 checkpoint folders: ranks 0-1 | ranks 2-3, 1 buddy copy"


def test_probe_views_that_do_not_partition_the_ranks_are_one_line() -> None:
    yes, no = True, False
    assert _domains([[yes, no], [no, yes]], Path("c")) == ((0,), (1,))
    assert _domains([[yes, yes], [yes, yes]], Path("c")) == ((0, 1),)
    with pytest.raises(UserError, match=r"^the ranks disagree on which of them see the same"):
        _domains([[yes, yes], [no, yes]], Path("c"))  # rank 1 does not see rank 0's file


def _detect(rank: int, world: int, base: str, groups: list[int], mode: str) -> object:
    """This rank's view: folder ``base/f<groups[rank]>``."""
    root = Path(base) / f"f{groups[rank]}"
    from datetime import timedelta  # noqa: PLC0415

    try:
        layout = detect_storage(root, mode, 2, 1, timedelta(seconds=30))
    except UserError as exc:
        return f"UserError: {exc}"
    leftovers = sorted(p.name for p in root.iterdir()) if root.is_dir() else []
    return [[list(d) for d in layout.domains], layout.domain, layout.buddy_copies, leftovers]


def _detect_cases(rank: int, world: int, base: str) -> dict[str, object]:
    return {
        "per_node": _detect(rank, world, base + "/a", [0, 0, 1, 1], "auto"),
        "shared": _detect(rank, world, base + "/b", [0, 0, 0, 0], "auto"),
        "sites": _detect(rank, world, base + "/c", [0, 0, 0, 1], "node-local"),
        "trusted": _detect(rank, world, base + "/d", [0, 1, 2, 3], "shared"),
    }


def _chunked(rank: int, world: int, base: str) -> object:
    """Rank 0 sends two files and an empty one to rank 2; rank 3 sends one file to rank 1; in
    chunks of 100 bytes. Then a file shorter than announced: every rank stops with one line."""
    folder = Path(base) / f"r{rank}"
    streams = [
        Stream(0, 2, (("a.bin", 250), ("empty", 0), ("sub/b.bin", 120))),
        Stream(3, 1, (("c.bin", 99),)),
    ]
    moved = exchange(streams, folder, folder / "in", chunk_bytes=100)
    try:
        exchange([Stream(1, 0, (("c.bin", 200),))], folder, folder / "bad", chunk_bytes=64)
        error = ""
    except UserError as exc:
        error = str(exc)
    dist.barrier()
    return [moved.received, error]


@pytest.mark.slow  # one spawn of 4 ranks, several collectives
def test_detection_and_chunked_copies_on_four_ranks(tmp_path: Path) -> None:
    payload = {"a.bin": bytes(range(250)), "empty": b"", "sub/b.bin": b"x" * 120}
    for name, data in payload.items():
        (tmp_path / "r0" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "r0" / name).write_bytes(data)
    (tmp_path / "r3").mkdir()
    (tmp_path / "r3" / "c.bin").write_bytes(b"y" * 99)
    (tmp_path / "r1").mkdir()
    (tmp_path / "r1" / "c.bin").write_bytes(b"z" * 150)  # 200 announced below
    (tmp_path / "r2").mkdir()
    found = run_distributed(_detect_cases, 4, str(tmp_path), timeout=120.0)
    copied = run_distributed(_chunked, 4, str(tmp_path), timeout=120.0)
    assert found[0]["per_node"] == [[[0, 1], [2, 3]], 0, 1, []]  # probe folder removed
    assert found[3]["per_node"] == [[[0, 1], [2, 3]], 1, 1, []]
    assert found[2]["shared"] == [[[0, 1, 2, 3]], 0, 0, []]
    refused = "UserError: --checkpoint-storage node-local: the folders seen are [[0, 1, 2], [3]]"
    assert all(r["sites"].startswith(refused) for r in found)
    assert found[1]["trusted"] == [[[0, 1, 2, 3]], 0, 0, []]  # trusted: no probe at all
    for name, data in payload.items():
        assert (tmp_path / "r2" / "in" / name).read_bytes() == data
    assert (tmp_path / "r1" / "in" / "c.bin").read_bytes() == b"y" * 99
    assert [c[0] for c in copied] == [0, 99, 370, 0]
    errors = {c[1] for c in copied}
    assert len(errors) == 1
    assert errors.pop().startswith("copying checkpoint files between ranks failed: ")


def _step(
    root: Path, step: int, ranks: list[int], world: int = 4, run: str = "run-a", segment: int = 0
) -> None:
    """A complete step folder as a domain writes it: DCP shard, shared.json, meta.json and the
    own files of ``ranks``."""
    folder = root / f"step-{step}"
    (folder / "dcp").mkdir(parents=True)
    (folder / "dcp" / "shard-1.safetensors").write_bytes(b"s" * 10)
    (folder / "shared.json").write_text("{}")
    meta = {"step": step, "run_id": run, "world_size": world, "data_since": 0, "segment": segment}
    (folder / "meta.json").write_text(json.dumps(meta))
    for rank in ranks:
        (folder / f"rank-{rank}.json").write_text("{}")
        (folder / f"rank-{rank}.safetensors").write_bytes(b"t" * rank)
    (folder / "COMPLETE").write_text("")
    (root / "run.json").write_text(json.dumps({"run_id": run}))


def _plan(
    roots: list[Path], layout: StorageLayout = LAYOUT, why: str = "", **flags: object
) -> dict:
    options = {"resume": True, "resume_from": "", "overwrite": False, **flags}
    listed = [inventory(root, str(options["resume_from"])) for root in roots]
    return plan_across(listed, layout, rebuild=lambda meta: why, **options)


def test_an_empty_folder_gets_the_newest_step_and_the_buddy_files_from_its_peer(
    tmp_path: Path,
) -> None:
    node0, node1 = tmp_path / "n0", tmp_path / "n1"
    for step in (4, 6):
        _step(node0, step, [0, 1, 2, 3])  # own ranks and node 1's buddy copies
    node1.mkdir()
    decision = _plan([node0, node1])
    assert decision["plan"] == {"run_id": "run-a", "step": 6, "lost": [], "segment": 1}
    assert decision["holders"] == [0]  # node 1 gets the whole step
    [(source, target, files)] = decision["streams"]
    assert (source, target) == (0, 2)  # leader of node 0 to leader of node 1
    names = [name for name, _ in files]
    assert names[:3] == ["dcp/shard-1.safetensors", "meta.json", "shared.json"]
    assert sorted(names[3:]) == sorted(
        f"rank-{r}.{e}" for r in range(4) for e in ("json", "safetensors")
    )


def test_a_folder_with_an_older_newest_step_makes_everyone_resume_the_common_one(
    tmp_path: Path,
) -> None:
    """No buddy copies: node 0 has steps 4 and 6 of its own ranks, node 1 only step 4 of its
    own; step 6 of ranks 2 and 3 is nowhere, so step 4 is resumed exactly."""
    node0, node1 = tmp_path / "n0", tmp_path / "n1"
    for step in (4, 6):
        _step(node0, step, [0, 1])
    _step(node1, 4, [2, 3])
    layout = StorageLayout(LAYOUT.domains, 0, 0)
    decision = _plan([node0, node1], layout)
    assert decision["plan"] == {"run_id": "run-a", "step": 4, "lost": [], "segment": 1}
    assert decision["streams"] == [] and decision["holders"] == [0, 1]
    assert decision["note"] == (
        "resuming step 4 from the nodes' own folders (step 6: the own state of ranks 2, 3 is "
        "in no folder)"
    )


def test_lost_own_state_is_rebuilt_where_the_caller_can_and_refused_in_one_line_where_not(
    tmp_path: Path,
) -> None:
    node0, node1 = tmp_path / "n0", tmp_path / "n1"
    _step(node0, 6, [])  # every per-rank file lost, the replicated state kept
    _step(node1, 6, [])
    decision = _plan([node0, node1])
    assert decision["plan"] == {"run_id": "run-a", "step": 6, "lost": [0, 1, 2, 3], "segment": 1}
    assert decision["note"].endswith("; the own state of ranks 0, 1, 2, 3 is rebuilt")
    with pytest.raises(UserError) as refused:
        _plan([node0, node1], why="a ZeRO-1 optimizer shard cannot be rebuilt")
    assert str(refused.value) == (
        "no checkpoint can be resumed: step 6: the own state of ranks 0, 1, 2, 3 is in no "
        "folder and a ZeRO-1 optimizer shard cannot be rebuilt; keep more copies "
        "(--buddy-copies) or start fresh with --no-resume"
    )


def test_folders_of_another_run_a_fresh_start_and_resume_from_are_decided_in_one_line(
    tmp_path: Path,
) -> None:
    node0, node1 = tmp_path / "n0", tmp_path / "n1"
    _step(node0, 4, [0, 1, 2, 3])
    _step(node1, 2, [0, 1, 2, 3], run="run-b")
    with pytest.raises(
        UserError,
        match=r"^the nodes' --checkpoint-dir folders hold different runs \(run-a, run-b\)",
    ):
        _plan([node0, node1])
    (node1 / "run.json").unlink()
    (node1 / "step-2").rename(node1 / "old")  # node 1 now empty
    with pytest.raises(UserError, match=r"^--no-resume: the --checkpoint-dir folders hold the"):
        _plan([node0, node1], resume=False)
    fresh = _plan([node0, node1], resume=False, overwrite=True)
    assert fresh["delete"] and fresh["plan"]["run_id"] != "run-a"
    chosen = _plan([node0, node1], resume_from=str(node0 / "step-4"))
    assert chosen["plan"]["step"] == 4 and chosen["source"] == "resume_from"
    assert chosen["holders"] == [0, 1] and chosen["streams"] == []  # both see that path here
    (node0 / "run.json").unlink()  # --resume-from into new folders keeps the checkpoint's run
    assert _plan([node0, node1], resume_from=str(node0 / "step-4"))["plan"]["run_id"] == "run-a"
    with pytest.raises(UserError, match=r"is not a complete checkpoint on any node"):
        _plan([node0, node1], resume_from=str(tmp_path / "nowhere"))


def test_a_stale_copy_of_a_step_from_an_abandoned_timeline_is_replaced_not_mixed(
    tmp_path: Path,
) -> None:
    """Node 1 kept a step 6 saved before the run went back to step 4 and trained again (segment
    0); node 0 holds the new step 6 (segment 1): node 1 gets the whole new step."""
    node0, node1 = tmp_path / "n0", tmp_path / "n1"
    _step(node0, 6, [0, 1, 2, 3], segment=1)
    _step(node1, 6, [0, 1, 2, 3], segment=0)
    decision = _plan([node0, node1])
    assert decision["plan"]["step"] == 6 and decision["holders"] == [0]
    assert decision["plan"]["segment"] == 2  # above every timeline in any folder
    [(source, target, files)] = decision["streams"]
    assert (source, target) == (0, 2) and len(files) == 3 + 8  # replicated files and all ranks


def test_one_shared_folder_is_one_domain_planned_the_same_way_with_nothing_to_copy(
    tmp_path: Path,
) -> None:
    """A shared --checkpoint-dir takes the same plan: the newest step, no streams, the folder
    named in the note and in the refusals."""
    shared = tmp_path / "ckpt"
    for step in (4, 6):
        _step(shared, step, [0, 1, 2, 3], segment=step // 2)
    one = single_layout(4)
    decision = _plan([shared], one)
    assert decision["plan"] == {"run_id": "run-a", "step": 6, "lost": [], "segment": 4}
    assert decision["streams"] == [] and decision["holders"] == [0]
    assert decision["note"] == f"resuming step 6 from --checkpoint-dir {shared}"
    older = _plan([shared], one, resume_from=str(shared / "step-4"))
    assert older["plan"]["step"] == 4 and older["source"] == "resume_from"
    with pytest.raises(UserError, match=rf"^--no-resume: --checkpoint-dir {shared} holds the"):
        _plan([shared], one, resume=False)
    assert _plan([shared], one, resume=False, overwrite=True)["delete"]
    with pytest.raises(UserError, match=r"is not a complete checkpoint; pass a complete step-N"):
        _plan([shared], one, resume_from=str(tmp_path / "nowhere"))
    (shared / "run.json").write_text(json.dumps({"run_id": "run-b"}))
    with pytest.raises(UserError, match=rf"but --checkpoint-dir {shared} holds run run-b;"):
        _plan([shared], one)
