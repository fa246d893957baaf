"""The overlapped sync of DiLoCo and SparseLoCo (``--overlap-exchange``, ``--sync-delay``):
its algebra, rank agreement, exact resume and stop inside the delay, the flush at the end, the
plan and the refusals.

One spawn of 2 real gloo ranks runs:

- the algebra: with parameter-independent gradients, inner AdamW without weight decay and outer
  SGD at lr 1 without momentum, every rank's parameters after step ``t`` have a closed form in a
  lone AdamW's (no wrapper, same gradients): ``x_r(t) = mean_r lone_r(s) + lone_r(t) - lone_r(s)``,
  ``s`` the last sync start whose outer update has landed (``s + tau <= t``). It checks the delay
  (the update lands ``tau`` steps after the start, not sooner) and the rebase (no inner step is
  lost). SparseLoCo that sends everything is DiLoCo with plain SGD, so it has the same form;
- a small DDP model over 3 windows with a checkpoint inside the delay (DiLoCo one step after a
  sync started, SparseLoCo at a window's end, the sync just started and still on the wire),
  resumed by a fresh model;
- the real trainer on the tiny LLaMA: SparseLoCo on bf16 parameters stopped by SIGTERM inside
  the delay and resumed, DiLoCo resumed from a periodic checkpoint inside its delay, both against
  straight runs that end inside a delay (the flush applies it).

Then 4 ranks as 2 nodes x 2 check the closed form of node-aware SparseLoCo (nodes as replicas),
and one rank resumes the SIGTERM checkpoint at another world size.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from distributed_harness import SMALL_LLAMA, SMALL_TOKENIZER, run_distributed, tiny_args
from local_update_helpers import LocalUpdates, build_local_updates, memory_rows
from tiny_models import (
    accumulate_local_batches,
    digest,
    flat_parameters,
    random_gradients,
    random_parameters,
    small_mlp,
)
from torch.nn.parallel import DistributedDataParallel

from torchrun_ddp.build import Trainer
from torchrun_ddp.checkpoint import ModelAndOptimizer, load_checkpoint, save_checkpoint
from torchrun_ddp.compression import (
    register_local_gradients,
)
from torchrun_ddp.config_io import parse_config
from torchrun_ddp.distributed import DistEnv, NodeGroups, new_node_groups
from torchrun_ddp.errors import UserError
from torchrun_ddp.inputs import prepare_inputs
from torchrun_ddp.main import start, train
from torchrun_ddp.optim import (
    LocalUpdateSettings,
    RankState,
    SyncedState,
    parameter_groups,
)
from torchrun_ddp.plan.communication import (
    Topology,
    local_update_estimates,
    predicted_step_seconds,
)

WORLD = 2
SHAPES = [(24, 40), (130,), (7,)]
H = 3
STEPS = 3 * H
SAVE_AT = H + 1
"""One step after the second window's start: inside the delay for tau = 2 and tau = H."""


def _lone_steps(replica: int, steps: int) -> list[list[torch.Tensor]]:
    """Parameters after each step 0..steps of AdamW alone (no weight decay) on this replica's
    gradients, and (appended) their mean over all ranks (over replicas: every node's ranks are
    one replica with the same gradients): [t] -> [own..., mean...]."""
    params = random_parameters(SHAPES, 0)
    adamw = torch.optim.AdamW(params, lr=0.05, weight_decay=0.0)
    history = []
    for step in range(steps + 1):
        if step:
            for param, grad in zip(params, random_gradients(SHAPES, step, replica), strict=True):
                param.grad = grad
            adamw.step()
        own = [p.detach().clone() for p in params]
        mean = [p.clone() for p in own]
        for tensor in mean:
            dist.all_reduce(tensor)
            tensor.div_(dist.get_world_size())
        history.append(own + mean)
    return history


def _expected(history: list[list[torch.Tensor]], step: int, tau: int) -> list[torch.Tensor]:
    """The closed form of the module docstring for the parameters after ``step``."""
    landed = [s for s in range(H, step + 1, H) if s + tau <= step]
    count = len(SHAPES)
    own = history[step][:count]
    if not landed:
        return own
    at = history[landed[-1]]
    return [mean + now - then for mean, now, then in zip(at[count:], own, at[:count], strict=True)]


def _settings(method: str, tau: int) -> LocalUpdateSettings:
    if method == "diloco":
        return LocalUpdateSettings("diloco", H, 1.0, 0.0, sync_delay=tau)
    return LocalUpdateSettings(
        "sparseloco", H, 1.0, 0.0, topk=64, chunk=8, beta=0.0, quant_bits=0, sync_delay=tau
    )


def _closed_form(
    rank: int, method: str, tau: int, groups: NodeGroups | None = None
) -> dict[str, float]:
    """Largest gap to the closed form over all steps and to the form without delay (must differ
    when tau > 0), and the outer updates applied. ``groups``: node-aware SparseLoCo, every node
    one replica (its ranks get the node's gradients, as the node-mean hook would give them)."""
    replica = rank // groups.local_world_size if groups else rank
    history = _lone_steps(replica, STEPS)
    params = random_parameters(SHAPES, 0)
    inner = torch.optim.AdamW(params, lr=0.05, weight_decay=0.0)
    wrapped = LocalUpdates(inner, _settings(method, tau), node_groups=groups)
    gap = undelayed = 0.0
    for step in range(1, STEPS + 1):
        for param, grad in zip(params, random_gradients(SHAPES, step, replica), strict=True):
            param.grad = grad
        wrapped.step()
        pairs = list(zip(params, _expected(history, step, tau), strict=True))
        gap = max(gap, *[float((p.detach() - e).abs().max()) for p, e in pairs])
        pairs = list(zip(params, _expected(history, step, 0), strict=True))
        undelayed = max(undelayed, *[float((p.detach() - e).abs().max()) for p, e in pairs])
    return {"gap": gap, "undelayed": undelayed, "applied": wrapped.syncs_applied}


Trained = tuple[DistributedDataParallel, LocalUpdates]


def _build(seed: int, settings: LocalUpdateSettings) -> Trained:
    ddp = DistributedDataParallel(small_mlp(seed))
    state = register_local_gradients(ddp)
    inner = torch.optim.AdamW(parameter_groups(ddp.module, 0.1), lr=0.01)
    return ddp, build_local_updates(inner, settings, state)


def _train(trained: Trained, rank: int, steps: range) -> list[str]:
    """Steps of this rank's own data; per step the digest of the synced copies."""
    ddp, optimizer = trained
    synced = []
    for step in steps:
        accumulate_local_batches(ddp, step, rank)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        synced.append(digest({str(i): t for i, t in enumerate(optimizer.synced)}))
    return synced


DILOCO = LocalUpdateSettings("diloco", H, 0.7, 0.9, "bfloat16", sync_delay=2)
SPARSE = LocalUpdateSettings("sparseloco", H, 1.0, 0.0, topk=4, chunk=8, sync_delay=H)


def _in_flight(optimizer: LocalUpdates) -> bool:
    """Whether a sync's collective was started and not yet waited for."""
    pending = optimizer.pending
    if pending is None:
        return False
    return pending.work is not None or (
        pending.flight is not None and pending.flight.work is not None
    )


def _resume_in_the_delay(
    rank: int, root: str, settings: LocalUpdateSettings, save_at: int
) -> dict[str, object]:
    """3 windows with a checkpoint inside the delay (after step ``save_at``), flushed at the
    end; a fresh model (another init) loads the checkpoint and redoes the rest."""
    trained = _build(5, settings)
    ddp, optimizer = trained
    synced = _train(trained, rank, range(save_at))
    in_flight, position = _in_flight(optimizer), optimizer.position
    shared = {"train": ModelAndOptimizer(ddp, None), "outer": SyncedState(optimizer)}
    per_rank = {"optimizer": RankState(optimizer).state_dict()}
    path = save_checkpoint(Path(root) / settings.method, save_at, shared, per_rank, {}, keep=1)
    synced += _train(trained, rank, range(save_at, STEPS))
    flushed = optimizer.flush()
    again = _build(6, settings)
    fresh, fresh_optimizer = again
    loaded = {"train": ModelAndOptimizer(fresh, None), "outer": SyncedState(fresh_optimizer)}
    saved = load_checkpoint(path, loaded)
    assert saved is not None
    RankState(fresh_optimizer).load_state_dict(saved["optimizer"])
    _train(again, rank, range(save_at, STEPS))
    fresh_optimizer.flush()
    return {
        "in_flight_at_save": in_flight,
        "position_at_save": position,
        "flushed": flushed,
        "synced": synced,
        "final": flat_parameters(ddp.module),
        "resumed": flat_parameters(fresh.module),
        "applied": optimizer.syncs_applied,
    }


END = 2 * H + 1
"""The trainer runs end one step into their third window: inside the delay."""


def _trainer_args(data: str, output: Path, *extra: str) -> list[str]:
    return tiny_args(
        Path(data), output,
        "--model", str(SMALL_LLAMA), "--seq-length", "16", "--batch-size", "2",
        "--accumulation-steps", "2", "--warmup-steps", "2", "--log-every", "1",
        "--eval-every", "0", "--eval-batches", "1", "--local-steps", str(H),
        "--overlap-exchange", *extra, tokenizer=SMALL_TOKENIZER,
    )  # fmt: skip


SPARSE_FLAGS = ("--optimizer", "sparseloco", "--sparseloco-topk", "8", "--precision", "bf16")
DILOCO_FLAGS = ("--optimizer", "diloco", "--sync-delay", "2", "--pseudo-gradient-dtype", "bfloat16")


def _run(rank: int, argv: list[str], stop_at: int = 0) -> Trainer:
    """The real trainer on this process group; ``stop_at``: SIGTERM to this rank during that
    step's last micro-batch (the loop then saves a checkpoint and returns)."""
    config = parse_config(argv)
    env = DistEnv(rank=rank, world_size=WORLD, local_rank=rank, local_world_size=WORLD)
    trainer = start(config, env, torch.device("cpu"), prepare_inputs(config, env))
    calls = [0]

    def stop(*_: object) -> None:
        calls[0] += 1
        if calls[0] == 2 * stop_at:  # 2 micro-batches per step
            os.kill(os.getpid(), signal.SIGTERM)

    handle = trainer.model.module.register_forward_hook(stop) if stop_at else None
    finished = train(trainer)
    assert finished == (not stop_at)
    if handle is not None:
        handle.remove()
    trainer.metrics.close()
    return trainer


def _state(trainer: Trainer) -> dict[str, object]:
    """Digests and position of a trainer's run; ``applied`` counts this process's outer steps
    only (a resumed run loads the ones before), so it stays out of ``same``."""
    optimizer = trainer.optimizer
    assert isinstance(optimizer, LocalUpdates)
    same = {
        "model": digest(dict(trainer.model.module.named_parameters())),
        "synced": digest({str(i): t for i, t in enumerate(optimizer.synced)}),
        "pending": optimizer.pending is not None,
        "step": trainer.step,
    }
    return {"same": same, "applied": optimizer.syncs_applied}


def _trainer_runs(rank: int, data: str, root: Path) -> dict[str, object]:
    """SparseLoCo (tau = H): straight to step 7; stopped by SIGTERM at step 4 (a sync pending)
    and resumed to 7. DiLoCo (tau = 2, bf16 wire): straight to 7 with a checkpoint at 4, and a
    run resumed from it."""
    runs: dict[str, object] = {}
    straight = _trainer_args(data, root / "straight", *SPARSE_FLAGS, "--max-steps", str(END))
    runs["straight"] = _state(_run(rank, straight))
    stopped = _trainer_args(data, root / "stopped", *SPARSE_FLAGS, "--max-steps", str(END))
    runs["stopped"] = _state(_run(rank, stopped, stop_at=SAVE_AT))
    runs["resumed"] = _state(_run(rank, stopped))
    diloco = [*DILOCO_FLAGS, "--max-steps", str(END), "--checkpoint-every", str(SAVE_AT)]
    runs["diloco"] = _state(_run(rank, _trainer_args(data, root / "diloco", *diloco)))
    checkpoint = root / "diloco" / "checkpoints" / f"step-{SAVE_AT}"
    again = _trainer_args(data, root / "diloco-resumed", *diloco, "--resume-from", str(checkpoint))
    runs["diloco_resumed"] = _state(_run(rank, again))
    return runs


def _worker(rank: int, world_size: int, root: str) -> dict[str, object]:
    assert world_size == WORLD
    forms = {
        f"{method}-{tau}": _closed_form(rank, method, tau)
        for method in ("diloco", "sparseloco")
        for tau in (0, 1, 2, H)
    }
    return {
        "forms": forms,
        "diloco": _resume_in_the_delay(rank, root, DILOCO, SAVE_AT),
        "sparse": _resume_in_the_delay(rank, root, SPARSE, H),
    }


def _trainer_worker(rank: int, world_size: int, root: str, data: str) -> dict[str, object]:
    assert world_size == WORLD
    return _trainer_runs(rank, data, Path(root))


def _aware_worker(rank: int, world_size: int) -> dict[str, object]:
    """Node-aware SparseLoCo on 2 nodes x 2 ranks: the closed form with nodes as replicas."""
    env = DistEnv(rank=rank, world_size=world_size, local_rank=rank % 2, local_world_size=2)
    groups = new_node_groups(env)
    return {f"sparseloco-{tau}": _closed_form(rank, "sparseloco", tau, groups) for tau in (0, H)}


def _elastic_worker(rank: int, world_size: int, root: str, data: str) -> dict[str, object]:
    """One rank resumes the SIGTERM checkpoint of the 2-rank SparseLoCo run (a sync pending)."""
    checkpoint = Path(root) / "stopped" / "checkpoints" / f"step-{SAVE_AT}"
    argv = _trainer_args(data, Path(root) / "elastic", *SPARSE_FLAGS, "--max-steps", str(END))
    config = parse_config([*argv, "--resume-from", str(checkpoint)])
    env = DistEnv(rank=rank, world_size=world_size, local_rank=rank, local_world_size=world_size)
    trainer = start(config, env, torch.device("cpu"), prepare_inputs(config, env))
    optimizer = trainer.optimizer
    assert isinstance(optimizer, LocalUpdates)
    pairs = zip(optimizer.trained, optimizer.synced, strict=True)
    return {
        "synced": digest({str(i): t for i, t in enumerate(optimizer.synced)}),
        "position": optimizer.position,
        "pending": optimizer.pending is not None,
        "from_synced": all(torch.equal(p.detach(), s.to(p.dtype)) for p, s in pairs),
    }


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("overlap")


@pytest.fixture(scope="module")
def ranks(root: Path) -> list[dict]:
    return run_distributed(_worker, WORLD, str(root), timeout=300)


@pytest.fixture(scope="module")
def trainer(root: Path, sample_data: Path) -> list[dict]:
    return run_distributed(_trainer_worker, WORLD, str(root), str(sample_data), timeout=400)


@pytest.fixture(scope="module")
def aware() -> list[dict]:
    return run_distributed(_aware_worker, 4, timeout=200)


@pytest.fixture(scope="module")
def elastic(trainer: list[dict], root: Path, sample_data: Path) -> dict:
    return run_distributed(_elastic_worker, 1, str(root), str(sample_data), timeout=200)[0]


@pytest.mark.parametrize("method", ["diloco", "sparseloco"])
@pytest.mark.parametrize("tau", [0, 1, 2, H])
def test_the_outer_update_lands_tau_steps_late_and_keeps_every_inner_step(
    ranks: list[dict], method: str, tau: int
) -> None:
    for result in ranks:
        form = result["forms"][f"{method}-{tau}"]
        assert form["gap"] < 1e-5, "x_r(t) = mean lone(s) + lone_r(t) - lone_r(s)"
        assert form["applied"] == STEPS // H - (tau > 0), "the last sync is still pending"
        if tau:
            assert form["undelayed"] > 1e-3, "the delay shows: not the undelayed parameters"


@pytest.mark.parametrize("method", ["diloco", "sparse"])
def test_synced_copies_agree_and_resume_inside_the_delay_is_bit_exact(
    ranks: list[dict], method: str
) -> None:
    first, second = (result[method] for result in ranks)
    assert first["in_flight_at_save"] and second["in_flight_at_save"], "the sync was left running"
    assert first["position_at_save"] == (0 if method == "sparse" else 1), "a window's end, or not"
    assert first["flushed"] and first["applied"] == STEPS // H
    assert first["synced"] == second["synced"], "every rank holds the same synced copy"
    for result in (first, second):
        assert torch.equal(result["final"], result["resumed"])
    assert torch.equal(first["final"], second["final"]), "flushed at a window's end: synced"


@pytest.mark.slow  # real trainer runs
def test_trainer_stop_inside_the_delay_loses_nothing(trainer: list[dict]) -> None:
    for runs in trainer:
        stopped, straight = runs["stopped"]["same"], runs["straight"]["same"]
        assert stopped["step"] == SAVE_AT and stopped["pending"], "stopped inside the delay"
        assert runs["resumed"]["same"] == straight
        assert runs["straight"]["applied"] == END // H and not straight["pending"]
    synced = [runs["straight"]["same"]["synced"] for runs in trainer]
    assert synced[0] == synced[1]


@pytest.mark.slow  # real trainer runs
def test_trainer_resume_from_a_checkpoint_inside_the_delay_is_bit_exact(
    trainer: list[dict],
) -> None:
    for runs in trainer:
        assert runs["diloco_resumed"]["same"] == runs["diloco"]["same"]
        assert runs["diloco"]["applied"] == END // H and not runs["diloco"]["same"]["pending"]


@pytest.mark.slow  # 4 spawned ranks
@pytest.mark.parametrize("tau", [0, H])
def test_node_aware_sparseloco_overlaps_with_nodes_as_replicas(aware: list[dict], tau: int) -> None:
    for result in aware:
        form = result[f"sparseloco-{tau}"]
        assert form["gap"] < 1e-5, "x_r(t) = mean lone(s) + lone_node(t) - lone_node(s)"
        assert form["applied"] == STEPS // H - (tau > 0)
        if tau:
            assert form["undelayed"] > 1e-3


@pytest.mark.slow  # resumes a real trainer run's checkpoint
def test_resume_at_another_world_size_keeps_the_pending_outer_update(
    trainer: list[dict], elastic: dict
) -> None:
    stopped = trainer[0]["stopped"]["same"]
    assert elastic["synced"] == stopped["synced"], "the settled outer step carried over"
    assert elastic["position"] == SAVE_AT - H and not elastic["pending"]
    assert elastic["from_synced"], "the rebase is dropped with the local progress"


def test_plan_hides_a_sync_behind_tau_steps() -> None:
    """compute + max(0, sync - tau x compute) / H per step; undelayed: compute + sync / H."""
    topo = Topology(16, 8, 2400e9, 1e9)
    sync, per_step = local_update_estimates("all_reduce", 1e9, 50, topo, sync_delay=20)
    _, waiting = local_update_estimates("all_reduce", 1e9, 50, topo)
    compute = 0.1
    assert per_step.seconds == pytest.approx(waiting.seconds)
    expected = compute + max(0.0, sync.seconds - 20 * compute) / 50
    assert predicted_step_seconds(per_step, compute) == pytest.approx(expected)
    assert predicted_step_seconds(waiting, compute) == pytest.approx(compute + sync.seconds / 50)
    assert predicted_step_seconds(per_step, 10.0) == pytest.approx(10.0), "hidden entirely"


def test_plan_never_hides_node_aware_work_inside_the_node() -> None:
    """Node-aware SparseLoCo: the sharing inside the node and the per-step all-reduce stay."""
    topo = Topology(16, 8, 100e9, 1e9)
    sync, per_step = local_update_estimates("all_gather", 1e8, 30, topo, 10**8, sync_delay=30)
    uplink_s = sync.uplink_bytes * 8 / topo.inter_bits_per_s
    inside_s, every_s = sync.seconds - uplink_s, per_step.seconds - sync.seconds / 30
    assert inside_s > 0 and every_s > 0
    compute = 0.05
    expected = compute + (max(0.0, uplink_s - 30 * compute) + inside_s) / 30 + every_s
    assert predicted_step_seconds(per_step, compute) == pytest.approx(expected)
    assert predicted_step_seconds(per_step, 100.0) == pytest.approx(100.0 + inside_s / 30 + every_s)


def test_memory_rows_keep_the_start_and_the_pseudo_gradient_in_flight() -> None:
    shapes = [(100, 10)]
    waiting = memory_rows(LocalUpdateSettings("diloco", 10), shapes, 8)
    overlapped = memory_rows(LocalUpdateSettings("diloco", 10, sync_delay=10), shapes, 8, 2)
    kept = {row.name: row.nbytes for row in overlapped if row.persistent}
    assert kept["parameters at the sync's start (overlap)"] == 2 * 1000
    assert kept["sync: pseudo-gradient (fp32)"] == 4 * 1000
    assert not any(row.persistent for row in waiting if row.name.startswith("sync:"))


def test_a_delay_longer_than_a_window_is_refused(sample_data: Path, tmp_path: Path) -> None:
    argv = _trainer_args(str(sample_data), tmp_path, *DILOCO_FLAGS[:2], "--sync-delay", "4")
    config = parse_config(argv)
    env = DistEnv(rank=0, world_size=1, local_rank=0, local_world_size=1)
    with pytest.raises(UserError, match="--sync-delay") as error:
        prepare_inputs(config, env)
    assert "\n" not in str(error.value)
