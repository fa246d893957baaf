"""The data-parallel modes as objects (``parallel``): each built once from the config and its
ranks, answering for its mesh, replicas, flag checks and plan rows, so that nothing else asks
which mode a run uses; and the methods' table filling --optimizer's choices and help."""

from __future__ import annotations

import dataclasses

import pytest

from torchrun_ddp.config import TrainConfig
from torchrun_ddp.config_fields import help_text
from torchrun_ddp.config_io import build_parser, parse_config
from torchrun_ddp.errors import UserError
from torchrun_ddp.methods import METHODS, PRESETS, method_class
from torchrun_ddp.parallel.base import MeshShape
from torchrun_ddp.parallel.modes import MODES, mode_class, mode_for


@pytest.mark.parametrize(
    ("flags", "shape", "groups"),
    [
        ((), MeshShape(4, 1), None),
        (("--data-parallel", "fsdp"), MeshShape(1, 4), [[0], [1], [2], [3]]),
        (("--data-parallel", "hsdp"), MeshShape(2, 2), [[0, 2], [1, 3]]),
        (("--data-parallel", "hsdp", "--shard-degree", "4"), MeshShape(1, 4), [[0], [1], [2], [3]]),
    ],
)
def test_a_mode_is_built_once_with_its_mesh_and_replica_groups(
    flags: tuple[str, ...], shape: MeshShape, groups: list[list[int]] | None
) -> None:
    """4 ranks, 2 a node: ddp is 4 replicas of 1 rank, fsdp one shard group of 4, hsdp replicas
    of a node's 2 ranks (or --shard-degree's); ranks holding the same shard are one group."""
    mode = mode_for(parse_config(["--model", "x", *flags]), 4, 2)
    assert mode.shape == shape
    assert mode.replica_groups() == groups
    assert mode.identity() == {"data_parallel": mode.name}


def test_only_ddp_plans_bucket_views_and_zero1_suggestions() -> None:
    config = parse_config(["--model", "x"])
    assert MODES["ddp"](8, 8).plan_bucket_view(config) is config.gradient_as_bucket_view
    assert MODES["ddp"](8, 8).fit_changes() == {"--zero1", "--gradient-as-bucket-view"}
    for name in ("fsdp", "hsdp"):
        assert not MODES[name](8, 8).plan_bucket_view(config)
        assert MODES[name](8, 8).fit_changes() == frozenset()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--data-parallel", "fsdp", "--shard-degree", "2"), "applies to --data-parallel hsdp"),
        (("--data-parallel", "fsdp", "--zero1"), "--zero1 shards AdamW's state over DDP"),
        (("--data-parallel", "fsdp", "--compression", "dct"), "use --data-parallel hsdp"),
        (("--data-parallel", "fsdp", "--optimizer", "demo", "--compression", "none"), "hsdp"),
    ],
)
def test_a_mode_refuses_a_flag_naming_the_mode_that_takes_it(
    flags: tuple[str, ...], message: str
) -> None:
    with pytest.raises(UserError, match=message):
        parse_config(["--model", "x", *flags])


def test_an_hsdp_mesh_that_does_not_divide_the_ranks_is_one_line() -> None:
    config = parse_config(["--model", "x", "--data-parallel", "hsdp", "--shard-degree", "4"])
    with pytest.raises(UserError, match=r"^--data-parallel hsdp shards over 4 ranks .* 6"):
        mode_for(config, 6, 2)
    with pytest.raises(UserError, match="unknown --data-parallel 'tp'"):
        mode_class("tp")


def test_the_methods_table_fills_optimizer_choices_help_and_presets() -> None:
    """--optimizer's choices and each method's line of help come from ``methods.METHODS``; a
    method's presets from its class (SparseLoCo's templar)."""
    field = next(f for f in dataclasses.fields(TrainConfig) if f.name == "optimizer")
    assert field.metadata["choices"] == list(METHODS)
    help_text = build_parser().format_help()
    for name, method in METHODS.items():
        assert f"{name}: {method.summary.split(' ')[0]}" in " ".join(help_text.split())
    assert {"sparseloco_preset": method_class("sparseloco").presets} == PRESETS
    with pytest.raises(UserError, match="unknown --optimizer 'lamb'"):
        method_class("lamb")


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--data-parallel", "fsdp", "--ddp-bucket-cap-mb", "50"), "use --data-parallel ddp"),
        (("--data-parallel", "fsdp", "--gradient-as-bucket-view", "false"), "--data-parallel ddp"),
        (("--data-parallel", "hsdp", "--no-gradient-as-bucket-view"), "use --data-parallel ddp"),
        (("--data-parallel", "hsdp", "--ddp-bucket-cap-mb", "50"), "or a --compression hook"),
    ],
)
def test_a_ddp_bucket_flag_given_under_a_sharded_mode_is_refused(
    flags: tuple[str, ...], message: str
) -> None:
    """DDP's bucket flags do nothing under FSDP: given, they are refused in one line naming the
    mode that reads them; left at their defaults (a saved config lists them) they pass."""
    with pytest.raises(UserError, match=message) as caught:
        parse_config(["--model", "x", *flags])
    assert "does nothing under --data-parallel" in str(caught.value)
    assert "\n" not in str(caught.value)
    for mode in ("fsdp", "hsdp"):
        assert parse_config(["--model", "x", "--data-parallel", mode]).ddp_bucket_cap_mb == 25.0


def test_hsdps_hook_sizes_its_buckets_and_needs_two_replicas() -> None:
    """Under hsdp a --compression hook reads --ddp-bucket-cap-mb (its buckets across the
    replicas), and needs a replica to exchange with: on one node of 8 ranks (one replica of 8)
    it is refused naming ddp, on 2 nodes it is accepted; a dry run checks the planned mesh."""
    flags = ["--model", "x", "--data-parallel", "hsdp", "--compression", "dct"]
    config = parse_config([*flags, "--ddp-bucket-cap-mb", "50"])
    assert config.ddp_bucket_cap_mb == 50.0
    with pytest.raises(UserError, match="use --data-parallel ddp for a comm hook") as caught:
        mode_for(config, 8, 8)
    assert "1 replica of 8 ranks" in str(caught.value) and "\n" not in str(caught.value)
    assert mode_for(config, 16, 8).shape == MeshShape(2, 8)
    assert mode_for(parse_config([*flags, "--shard-degree", "4"]), 8, 8).shape == MeshShape(2, 4)
    assert mode_for(parse_config([*flags[:-2]]), 8, 8).shape == MeshShape(1, 8)  # no hook
    dry = parse_config([*flags, "--dry-run", "--plan-world-size", "16"])
    assert mode_for(dry, 1, 1).shape == MeshShape(1, 1)  # the plan's mesh is checked instead


def test_help_names_the_modes_that_refuse_each_flag() -> None:
    """--help's notes come from the modes' refusal tables: each refused flag names the modes
    that refuse it (and only those), and --optimizer's exchanging methods name fsdp."""
    helps = {action.dest: action.help or "" for action in build_parser()._actions}
    assert helps["zero1"].endswith("own shard. Refused under --data-parallel fsdp, hsdp (true).")
    assert helps["shard_degree"].endswith("Refused under --data-parallel ddp, fsdp (other than 0).")
    assert helps["compression"].endswith(
        "Refused under --data-parallel fsdp, hsdp with one replica (other than none)."
    )
    assert helps["checkpoint_storage"].endswith("Refused under --data-parallel fsdp (node-local).")
    assert "Refused" not in helps["peft"]
    for name, method in METHODS.items():
        refused = f"{name}: {method.summary} (refused under --data-parallel fsdp)."
        assert (refused in helps["optimizer"]) is (name != "adamw"), name
    for mode in MODES.values():
        for refusal in mode.refusals:
            field = next(f for f in dataclasses.fields(TrainConfig) if f.name == refusal.field)
            assert mode.name in help_text(field), (mode.name, refusal.field)
