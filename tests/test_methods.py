"""The training methods as objects (methods/): the table matches --optimizer, and what each method
answers for checkpoints (identity keys, lost per-rank state) and the plan (checkpoint bytes,
memory rows). Building them on a process group is covered end to end by the method modules'
own tests (test_demo, test_local_updates, test_resume)."""

from __future__ import annotations

import dataclasses

import pytest

from torchrun_ddp.config import TrainConfig
from torchrun_ddp.config_io import parse_config
from torchrun_ddp.errors import UserError
from torchrun_ddp.methods import METHODS, CheckpointBytes, Method, PlanSizes, method_for

SIZES = PlanSizes(
    trained=1000, parameters=1200, weight_bytes=2, world_size=4, shapes=((10, 50), (500,))
)


def _method(*flags: str) -> Method:
    return method_for(parse_config(["--model", "x", *flags]))


def test_the_table_holds_every_optimizer_choice() -> None:
    """A method the flag offers but the table lacks (or the reverse) fails here, not at start."""
    field = next(f for f in dataclasses.fields(TrainConfig) if f.name == "optimizer")
    assert list(METHODS) == field.metadata["choices"]
    for name, method in METHODS.items():
        assert method.name == name


def test_an_unknown_method_is_one_line() -> None:
    config = dataclasses.replace(parse_config(["--model", "x"]), optimizer="lamb")
    with pytest.raises(UserError, match=r"^unknown --optimizer 'lamb'; use one of adamw, demo"):
        method_for(config)


@pytest.mark.parametrize(
    ("flags", "identity"),
    [
        ((), {}),
        (("--optimizer", "demo"), {"exchange": ["global", False]}),
        (
            ("--optimizer", "diloco", "--overlap-exchange", "--sync-delay", "2"),
            {"outer_momentum": True, "sync_delay": 2, "eager": False},
        ),
        (
            ("--optimizer", "sparseloco", "--compression-scope", "inter-node"),
            {
                "outer_momentum": False,
                "sync_delay": 0,
                "eager": False,
                "exchange": ["inter-node", False],
            },
        ),
    ],
)
def test_identity_keys_are_those_checkpoints_hold(
    flags: tuple[str, ...], identity: dict[str, object]
) -> None:
    """The keys and values e59445a's run_identity added per method: checkpoints it wrote must
    still match, so each key also has a default for older checkpoints."""
    method = _method(*flags)
    assert method.identity() == identity
    assert set(method.identity_defaults()) <= set(identity)


@pytest.mark.parametrize(
    ("flags", "problem"),
    [
        ((), ""),
        (("--zero1",), "a ZeRO-1 optimizer shard cannot be rebuilt"),
        (("--optimizer", "demo"), ""),
        (("--optimizer", "diloco"), "the diloco inner optimizer state cannot be rebuilt"),
        (("--optimizer", "sparseloco"), "the sparseloco inner optimizer state cannot be rebuilt"),
    ],
)
def test_which_lost_per_rank_state_can_be_rebuilt(flags: tuple[str, ...], problem: str) -> None:
    assert _method(*flags).rebuild_problem() == problem


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        ((), CheckpointBytes(2 * 2 * 1000, 0)),
        (("--zero1",), CheckpointBytes(0, 2 * 2 * 1000 // 4)),
        (("--optimizer", "demo"), CheckpointBytes(0, 4 * 1000)),
        (("--optimizer", "diloco"), CheckpointBytes(4 * 1000 + 4 * 1000, 3 * 2 * 1000)),
        (
            ("--optimizer", "diloco", "--outer-momentum", "0"),
            CheckpointBytes(4 * 1000, 3 * 2 * 1000),
        ),
        (("--optimizer", "sparseloco"), CheckpointBytes(4 * 1000, 3 * 2 * 1000 + 4 * 1000)),
    ],
)
def test_checkpoint_bytes_per_method(flags: tuple[str, ...], expected: CheckpointBytes) -> None:
    """AdamW: two moments replicated, or a 1/W share under ZeRO-1; DeMo: one fp32 momentum per
    rank; DiLoCo/SparseLoCo: the synced fp32 copy (and DiLoCo's outer momentum) replicated, the
    inner moments and local parameters (and SparseLoCo's fp32 error feedback) per rank."""
    assert _method(*flags).checkpoint_bytes(SIZES) == expected


def test_only_local_update_methods_add_memory_rows() -> None:
    assert _method().memory_rows(SIZES) == []
    assert _method("--optimizer", "demo").memory_rows(SIZES) == []
    rows = _method("--optimizer", "sparseloco").memory_rows(SIZES)
    assert rows[0].nbytes == 4 * 1000 and rows[0].persistent, "the synced fp32 copy"
    assert any("error feedback" in row.name for row in rows)


def test_a_method_is_not_built_before_build() -> None:
    with pytest.raises(RuntimeError, match="not built yet"):
        _ = _method().optimizer
