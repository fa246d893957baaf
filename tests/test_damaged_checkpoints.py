"""A damaged checkpoint is never loaded (issue 43): each published step's manifest (size and
SHA-256 of every file) is checked before a step is chosen, in a shared folder (2 real gloo ranks)
and in a folder per node (2 nodes of 2 ranks). A damaged newest step makes the run resume the
previous one, or a peer's intact copy, and end bit-identical to an uninterrupted run; with no
intact step every rank stops with one line naming the file. Flipped bytes, a truncated file, an
empty file, a damaged per-rank file and a damaged buddy copy are found by ``verify_step`` on real
checkpoint folders. Replicas that differ after a resume stop every rank; a NaN loss stops the run
without a checkpoint or final_model, as do an
infinite loss, one above --max-loss, and a NaN gradient or weight, each at a checkpoint step."""

from __future__ import annotations

import json
import shutil
from contextlib import nullcontext
from pathlib import Path

import pytest
from distributed_harness import (
    armed_hooks,
    assert_logged_once,
    folder_args,
    logged_losses,
    run_distributed,
)
from tiny_models import LogLines, digest, train_in_group

from torchrun_ddp.checkpoint import MANIFEST, inventory, verify_step
from torchrun_ddp.checkpoint.manifest import MANIFEST_KEY, UNVERIFIED
from torchrun_ddp.errors import UserError
from torchrun_ddp.faults import PERTURB_ENV

pytestmark = pytest.mark.slow  # spawned 2- and 4-rank training runs


def _train(
    rank: int, world: int, base: str, steps: int, per_node: int, perturb: str
) -> dict[str, object]:
    """One run on this rank (folder ``ckpt``, or ``node-<n>`` with 2 nodes): the final
    parameters' digest, the step reached and the log lines, or the one-line refusal."""
    folder = "ckpt" if per_node == world else f"node-{rank // per_node}"
    with armed_hooks(perturb=perturb) if perturb else nullcontext(), LogLines() as log:
        try:
            trainer = train_in_group(
                rank, world, folder_args(Path(base), folder, steps), False, per_node
            )
        except UserError as exc:
            return {"error": str(exc), "lines": log.lines}
    params = dict(trainer.model.module.named_parameters())
    return {"digest": digest(params), "step": trainer.step, "lines": log.lines}


def _run(
    base: Path, steps: int, world: int = 2, per_node: int = 2, perturb: str = ""
) -> list[dict[str, object]]:
    return run_distributed(_train, world, str(base), steps, per_node, perturb, timeout=300.0)


def _flip(file: Path, count: int = 4096) -> None:
    """Invert ``count`` bytes in the middle of ``file`` (its size unchanged): a bad sector."""
    data = bytearray(file.read_bytes())
    start = max(0, len(data) // 2 - count // 2)
    end = min(len(data), start + count)
    data[start:end] = bytes(b ^ 0xFF for b in data[start:end])
    file.write_bytes(bytes(data))


def _shard(step_dir: Path) -> Path:
    return sorted((step_dir / "dcp").glob("shard-*.safetensors"))[-1]


def _flip_weight(step_dir: Path, key: str, count: int = 4096) -> Path:
    """Invert ``count`` bytes in the middle of the model tensor ``key``'s data in whichever DCP
    shard of ``step_dir`` holds it (read from the safetensors header); returns that shard."""
    for shard in sorted((step_dir / "dcp").glob("shard-*.safetensors")):
        data = bytearray(shard.read_bytes())
        header = int.from_bytes(data[:8], "little")
        tensors = json.loads(data[8 : 8 + header])
        if key not in tensors:
            continue
        begin, end = tensors[key]["data_offsets"]
        start = 8 + header + (begin + end) // 2 - count // 2
        data[start : start + count] = bytes(b ^ 0xFF for b in data[start : start + count])
        shard.write_bytes(bytes(data))
        return shard
    raise AssertionError(f"no shard of {step_dir} holds {key}")


@pytest.fixture(scope="module")
def shared_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    """2 ranks, one shared folder, 6 steps uninterrupted (steps 2, 4 and 6 kept)."""
    base = tmp_path_factory.mktemp("shared")
    results = _run(base, 6)
    return base, [str(r["digest"]) for r in results]


@pytest.fixture(scope="module")
def node_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    """2 nodes x 2 ranks, a folder per node, 6 steps uninterrupted."""
    base = tmp_path_factory.mktemp("nodes")
    results = _run(base, 6, world=4)
    return base, [str(r["digest"]) for r in results]


def test_every_published_step_has_a_manifest_of_every_file(
    shared_run: tuple[Path, list[str]], node_run: tuple[Path, list[str]]
) -> None:
    for step_dir in [
        *(shared_run[0] / "ckpt").glob("step-*"),
        *(node_run[0] / "node-1").glob("step-*"),
    ]:
        listed = json.loads((step_dir / MANIFEST).read_text())["files"]
        on_disk = {
            str(f.relative_to(step_dir))
            for f in step_dir.rglob("*")
            if f.is_file() and f.name not in ("COMPLETE", MANIFEST)
        }
        assert set(listed) == on_disk, step_dir
        assert verify_step(step_dir) == ""
    manifest = node_run[0] / "node-1" / "step-6" / MANIFEST
    listed = set(json.loads(manifest.read_text())["files"])
    assert {"rank-0.safetensors", "rank-2.safetensors"} <= listed  # a buddy copy, its own


def test_a_damaged_newest_step_resumes_the_previous_one_and_ends_bit_identical(
    shared_run: tuple[Path, list[str]], tmp_path: Path
) -> None:
    reference, digests = shared_run
    shutil.copytree(reference, tmp_path, dirs_exist_ok=True)
    shutil.rmtree(tmp_path / "ckpt" / "step-6")  # as after step 4
    shard = _shard(tmp_path / "ckpt" / "step-4")
    _flip(shard)
    resumed = _run(tmp_path, 6)
    assert [r["digest"] for r in resumed] == digests
    damage = [line for line in resumed[0]["lines"] if "is damaged" in line]
    assert len(damage) == 1 and shard.name in damage[0] and "\n" not in damage[0], damage
    aside = tmp_path / "ckpt" / "step-4.damaged"
    assert (aside / "dcp" / shard.name).is_file()  # set aside, never deleted
    assert verify_step(tmp_path / "ckpt" / "step-4") == ""  # saved again, intact
    assert logged_losses(tmp_path / "out") == logged_losses(reference / "out")
    assert_logged_once(tmp_path / "out", 6)


def test_with_only_a_damaged_step_every_rank_stops_with_one_line_naming_the_file(
    shared_run: tuple[Path, list[str]], tmp_path: Path
) -> None:
    shutil.copytree(shared_run[0], tmp_path, dirs_exist_ok=True)
    for step in (2, 6):
        shutil.rmtree(tmp_path / "ckpt" / f"step-{step}")
    shard = _shard(tmp_path / "ckpt" / "step-4")
    _flip(shard)
    results = _run(tmp_path, 8)
    errors = {str(r.get("error")) for r in results}
    assert len(errors) == 1, results
    error = errors.pop()
    assert error.startswith("no intact checkpoint to resume: step 4: ") and str(shard) in error
    assert "\n" not in error and "nothing was loaded" in error
    assert not any("resumed from" in line for r in results for line in r["lines"])
    assert (tmp_path / "ckpt" / "step-4" / "COMPLETE").is_file()  # left as it was


def test_replicas_that_differ_after_a_resume_stop_every_rank_with_one_line(
    shared_run: tuple[Path, list[str]], tmp_path: Path
) -> None:
    shutil.copytree(shared_run[0], tmp_path, dirs_exist_ok=True)
    results = _run(tmp_path, 8, perturb="replica:1")
    errors = {str(r.get("error")) for r in results}
    assert len(errors) == 1, results
    error = errors.pop()
    assert error.startswith("the replicas differ after loading ") and "rank(s) 1 hold" in error
    assert "\n" not in error
    assert not (tmp_path / "ckpt" / "step-8").exists()


@pytest.mark.parametrize("damage", ["flipped", "truncated", "empty", "rank-file", "manifest"])
def test_verify_step_names_the_damaged_file(
    shared_run: tuple[Path, list[str]], tmp_path: Path, damage: str
) -> None:
    step_dir = tmp_path / "step-6"
    shutil.copytree(shared_run[0] / "ckpt" / "step-6", step_dir)
    shard = _shard(step_dir)
    if damage == "flipped":
        _flip(shard)
        expected, sizes_see_it = f"{shard} does not match its SHA-256", False
    elif damage == "truncated":
        shard.write_bytes(shard.read_bytes()[:-100])
        expected, sizes_see_it = f"{shard} has ", True
    elif damage == "empty":
        (step_dir / "rank-0.json").write_bytes(b"")
        expected, sizes_see_it = f"{step_dir / 'rank-0.json'} has 0 bytes", True
    elif damage == "rank-file":
        _flip(step_dir / "rank-1.safetensors", 64)
        expected, sizes_see_it = f"{step_dir / 'rank-1.safetensors'} does not match", False
    else:
        (step_dir / MANIFEST).write_text("{not json")
        expected, sizes_see_it = f"{step_dir / MANIFEST} cannot be read", True
    assert verify_step(step_dir, "full").startswith(expected)
    assert bool(verify_step(step_dir, "size")) == sizes_see_it
    assert verify_step(step_dir, "off") == ""


def test_a_damaged_buddy_copy_is_found_and_a_step_without_manifest_loads_unverified(
    node_run: tuple[Path, list[str]], tmp_path: Path
) -> None:
    shutil.copytree(node_run[0] / "node-0", tmp_path / "node-0")
    buddy = tmp_path / "node-0" / "step-6" / "rank-2.safetensors"  # node 1's rank, kept here
    _flip(buddy, 64)
    assert verify_step(buddy.parent).startswith(f"{buddy} does not match")
    old_step = tmp_path / "node-0" / "step-4"
    (old_step / MANIFEST).unlink()  # as older code wrote it: no manifest, no key saying one
    meta = json.loads((old_step / "meta.json").read_text())
    assert meta.pop(MANIFEST_KEY) == 1
    (old_step / "meta.json").write_text(json.dumps(meta))
    assert verify_step(old_step) == UNVERIFIED
    (tmp_path / "node-0" / "step-2" / MANIFEST).unlink()  # this version's step lost its manifest
    assert verify_step(tmp_path / "node-0" / "step-2").endswith("says it was saved with one")
    listed = inventory(tmp_path / "node-0")
    assert sorted(listed["steps"]) == ["4"]  # 2 and 6 count as absent, 4 loads unverified
    assert sorted(listed["damaged"]) == ["2", "6"] and str(buddy) in listed["damaged"]["6"]
    assert sorted(inventory(tmp_path / "node-0", verify="off")["steps"]) == ["2", "4", "6"]


def test_a_step_that_lost_its_manifest_and_has_a_flipped_shard_is_never_loaded(
    shared_run: tuple[Path, list[str]], tmp_path: Path
) -> None:
    """Issue 60: a user's disk deletes the newest step's manifest and flips 4 KiB of its shard;
    its meta.json says this version saved it with a manifest, so it is damaged: set aside, the
    previous step resumed, and the run ends bit-identical (not from the corrupt tensors)."""
    reference, digests = shared_run
    shutil.copytree(reference, tmp_path, dirs_exist_ok=True)
    newest = tmp_path / "ckpt" / "step-6"
    (newest / MANIFEST).unlink()
    shard = _flip_weight(newest, "train/model/lm_head.weight")  # loaded, it changes the weights
    resumed = _run(tmp_path, 6)
    assert [r["digest"] for r in resumed] == digests
    lines = resumed[0]["lines"]
    assert not any("loaded unverified" in line for line in lines)
    damage = [line for line in lines if "is damaged" in line]
    assert len(damage) == 1 and str(newest / MANIFEST) in damage[0], damage
    assert any("resumed from" in line and line.endswith("at step 4") for line in lines), lines
    assert (tmp_path / "ckpt" / "step-6.damaged" / "dcp" / shard.name).is_file()
    assert verify_step(newest) == ""  # saved again, with its manifest


def test_a_damaged_file_in_one_node_folder_is_replaced_from_the_peer_and_ends_bit_identical(
    node_run: tuple[Path, list[str]], tmp_path: Path
) -> None:
    reference, digests = node_run
    shutil.copytree(reference, tmp_path, dirs_exist_ok=True)
    for node in (0, 1):
        shutil.rmtree(tmp_path / f"node-{node}" / "step-6")
    shard = _shard(tmp_path / "node-1" / "step-4")
    _flip(shard)
    resumed = _run(tmp_path, 6, world=4)
    assert [r["digest"] for r in resumed] == digests
    assert any(shard.name in line and "is damaged" in line for line in resumed[2]["lines"])
    assert (tmp_path / "node-1" / "step-4.damaged" / "dcp" / shard.name).is_file()
    assert verify_step(tmp_path / "node-1" / "step-4") == ""  # node 0's copy, checked
    assert logged_losses(tmp_path / "out") == logged_losses(reference / "out")
    assert_logged_once(tmp_path / "out", 6)


DIVERGENCES = {
    "nan-loss": ("nan-loss:2", (), "the training loss is nan at step 2 (not finite)"),
    "inf-loss": ("inf-loss:2", (), "the training loss is inf at step 2 (not finite)"),
    "max-loss": ("big-loss:2", ("--max-loss", "100"), "at step 2 (above --max-loss 100)"),
    "nan-grad": ("nan-grad:2", (), "the weights are not finite (NaN or infinite) after step 2"),
    "nan-weight": ("nan-weight:2", (), "the weights are not finite (NaN or infinite) after step 2"),
}
"""Case -> (TORCHRUN_DDP_PERTURB at step 2, a checkpoint step; extra flags; the stop's words)."""


def _divergence_worker(rank: int, world_size: int, base: str) -> dict[str, str]:
    """Each case of DIVERGENCES, 3 steps with a checkpoint every 2 and the final model exported
    if it gets there: case -> the rank's one-line stop, or "" if none."""
    errors = {}
    for name, (perturb, extra, _) in DIVERGENCES.items():
        args = folder_args(Path(base) / name, "ckpt", 3, *extra)
        errors[name] = ""
        with armed_hooks(perturb=perturb):
            try:
                train_in_group(rank, world_size, args)
            except UserError as exc:
                errors[name] = str(exc)
    return errors


def test_a_diverged_step_stops_the_run_without_its_checkpoint_or_final_model(
    tmp_path: Path,
) -> None:
    """2 spawned ranks, one run per case of DIVERGENCES: a NaN, an infinite or a too large
    (--max-loss) loss stops every rank at the log step of step 2 before its record and its
    checkpoint; a NaN gradient or weight, whose step's loss is still finite, stops every rank at
    step 2's checkpoint before it is written. Each stop is one line that names the test hook;
    no checkpoint, no final_model. The armed hook is in config.toml. (Step 2 is the first
    checkpoint step: each case is one start, and starts are what this test costs.)"""
    results = run_distributed(_divergence_worker, 2, str(tmp_path))
    for name, (perturb, _, words) in DIVERGENCES.items():
        errors = [rank[name] for rank in results]
        assert len(set(errors)) == 1 and words in errors[0], (name, errors)
        assert "\n" not in errors[0] and "stopped without a checkpoint or final_model" in errors[0]
        assert errors[0].endswith(f"(the test hook {PERTURB_ENV}={perturb} perturbed this run)")
        run = tmp_path / name
        assert not list((run / "ckpt").glob("step-*")), name
        assert not (run / "out" / "final_model").exists(), name
        assert_logged_once(run / "out", 1 if "loss" in name else 2)
        config = (run / "out" / "config.toml").read_text()
        assert config.startswith(f"# test hooks armed: {PERTURB_ENV}={perturb}\n"), name
