"""A comm hook's exchange in which one member of the group sends zeros and is not counted, as a
site that heals across fault-tolerant sites does (``sites.adamw``): 3 real gloo ranks, rank 2 the
healing one, against the same exchange over a group of ranks 0 and 1 only."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import pytest
import torch
import torch.distributed as dist
from distributed_harness import run_distributed
from torch import nn

from torchrun_ddp.compression import CompressionSettings, CompressionState, ReplicaExchange
from torchrun_ddp.sites.adamw import SiteAdamW

STEPS = 4
"""PowerSGD's first 2 steps are dense all-reduces, its last 2 compressed."""
SETTINGS = {
    "powersgd": CompressionSettings("powersgd", powersgd_rank=2),
    "dct-topk": CompressionSettings("dct-topk", block_size=8, topk=3),
}
OWN = {"powersgd": "powersgd.error.", "dct-topk": "residual."}
"""The state_dict prefix of each hook's error feedback (each rank's own)."""

Result = dict[str, object]


def _own(state: CompressionState, prefix: str) -> dict[str, torch.Tensor]:
    return {k: v for k, v in state.state_dict().items() if k.startswith(prefix)}


def _exchange(
    exchange: ReplicaExchange,
    params: list[nn.Parameter],
    grads: list[torch.Tensor],
    group: dist.ProcessGroup,
    senders: int,
    step: int,
    aside: bool,
) -> list[torch.Tensor]:
    for param, grad in zip(params, grads, strict=True):
        param.grad = grad.clone()
    exchange.state.exchange_over(group, senders, step)
    if aside:
        with exchange.state.error_feedback_aside():
            exchange.average()
    else:
        exchange.average()
    return [param.grad.clone() for param in params if param.grad is not None]


def _senders(rank: int, method: str) -> Result:
    params = [nn.Parameter(torch.zeros(16, 8)), nn.Parameter(torch.zeros(8))]
    settings, prefix = SETTINGS[method], OWN[method]
    pair = dist.new_group([0, 1])
    world = dist.group.WORLD
    assert world is not None
    live = ReplicaExchange(CompressionState(settings, params), params, 2**20)
    alone = ReplicaExchange(CompressionState(settings, params, process_group=pair), params, 2**20)
    own = {f"{prefix}0": torch.full((128,), 0.5), f"{prefix}1": torch.full((8,), 0.5)}
    if rank == 2:  # its own error feedback from before the heal: to be left as it was
        live.state.load_state_dict({**live.state.state_dict(), **own})
    means, alone_means = [], []
    for step in range(STEPS):
        generator = torch.Generator().manual_seed(100 * step + rank)
        grads = [torch.randn(16, 8, generator=generator), torch.randn(8, generator=generator)]
        if rank < 2:
            alone_means.append(_exchange(alone, params, grads, pair, 2, step, aside=False))
        else:
            grads = [torch.zeros_like(grad) for grad in grads]
        means.append(_exchange(live, params, grads, world, 2, step, aside=rank == 2))
    return {
        "means": means,
        "alone": alone_means,
        "own": _own(live.state, prefix),
        "alone_own": _own(alone.state, prefix) if rank < 2 else {},
        "shared": live.state.shared_state_dict(),
    }


class _Vote:
    """What ``SiteAdamW.exchange`` reads of its ``SiteLink`` (the quorum taken, every site
    participating), over the real gloo group, with the vote's outcome set by the test: a site
    that died during the exchange makes it ``False``."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group, self.participating, self.healed = group, True, False
        self.participants = group.size()
        self.committed, self.errored = True, False

    def run(self, exchange: Callable[[], None]) -> bool:
        """``errored``: the Manager had an error before the exchange (a failed heal transfer,
        a process group that did not configure): no exchange, and the vote drops the step."""
        if not self.errored:
            exchange()
        return self.committed and not self.errored

    def after_commit(self) -> None:
        return None


def _rollback(rank: int) -> list[dict[str, torch.Tensor]]:
    param = nn.Parameter(torch.zeros(16, 8))
    optimizer = SiteAdamW([param], lr=0.1)
    state = CompressionState(SETTINGS["powersgd"], [param])
    optimizer.replicas, optimizer.counts = ReplicaExchange(state, [param], 2**20), state
    world = dist.group.WORLD
    assert world is not None
    vote = _Vote(world)
    optimizer.link = vote  # type: ignore[assignment]
    shared = []
    runs = [(0, False, None), (0, True, True), (1, True, True), (2, True, True)]
    runs += [(3, False, True), (3, True, False), (3, True, None), (3, True, True)]
    for index, (step, contribute, committed) in enumerate(runs):  # None: the Manager errored
        optimizer.steps = lambda step=step: step
        vote.committed, vote.errored = bool(committed), committed is None
        param.grad = torch.randn(16, 8, generator=torch.Generator().manual_seed(10 * index + rank))
        optimizer.exchange(contribute=contribute)
        shared.append(state.shared_state_dict())
    return shared


def _worker(rank: int, world_size: int) -> Result:
    return {
        **{method: _senders(rank, method) for method in SETTINGS},
        "rollback": _rollback(rank),
    }


@pytest.fixture(scope="module")
def spawned() -> list[Result]:
    """Every case of this module on one spawn of 3 gloo ranks."""
    return run_distributed(_worker, 3)


def test_an_exchange_not_committed_and_a_join_put_back_the_shared_state(
    spawned: list[Result],
) -> None:
    """AdamW's PowerSGD exchange across sites: a join in which no site healed (every site sends
    zeros), an exchange that is not committed (a site died during it) and one that did not run
    (the Manager had errored before it, here at the very first exchange, a join) leave P, Q and
    the RNG as they were before them; a committed exchange moves them on."""
    shared = spawned[0]["rollback"]
    first, _, _, compressed, joined, dropped, skipped, after = shared
    assert first["step"].item() == 0 and not any("powersgd.q." in key for key in first)
    assert any(key.startswith("powersgd.q.") for key in compressed)  # compressing from step 2

    def same(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> bool:
        return a.keys() == b.keys() and all(torch.equal(a[key], b[key]) for key in a)

    assert same(joined, compressed) and same(dropped, compressed) and same(skipped, compressed)
    assert not same(after, compressed)


@pytest.mark.parametrize("method", ["powersgd", "dct-topk"])
def test_a_member_that_sends_zeros_is_left_out_of_the_mean(
    method: str, spawned: list[Result]
) -> None:
    """Ranks 0 and 1 get the mean over the two of them at every step (PowerSGD: its dense and its
    compressed steps; its sums divided by the group of 3, then rescaled, so equal up to float
    rounding) and keep the error feedback of the exchange over the two; rank 2 gets the same
    mean bit for bit, ends with their shared state (PowerSGD's P, Q and RNG) and with its own
    error feedback as it was."""
    ranks = [result[method] for result in spawned]
    for rank in (0, 1):
        result = ranks[rank]
        for step, (got, want) in enumerate(zip(result["means"], result["alone"], strict=True)):
            for have, expected in zip(got, want, strict=True):
                torch.testing.assert_close(have, expected, rtol=1e-5, atol=1e-6, msg=str(step))
        own, alone = result["own"], result["alone_own"]
        assert own.keys() == alone.keys() and own
        for key, value in own.items():
            torch.testing.assert_close(value, alone[key], rtol=1e-5, atol=1e-6, msg=key)
    for got, want in zip(ranks[2]["means"], ranks[0]["means"], strict=True):
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    prefix = OWN[method]
    assert {k: v.tolist() for k, v in ranks[2]["own"].items()} == {
        f"{prefix}0": [0.5] * 128,
        f"{prefix}1": [0.5] * 8,
    }
    shared, healer = ranks[0]["shared"], ranks[2]["shared"]
    assert shared.keys() == healer.keys()
    assert all(torch.equal(shared[key], healer[key]) for key in shared)
    assert method != "powersgd" or any(key.startswith("powersgd.q.") for key in shared)
