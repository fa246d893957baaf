"""The front door: other trainers' names answered with this project's flag, and a flag that the
chosen method, --compression or --peft does not read refused, each in one line with status 2
through the real entry point."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import train  # noqa: E402
from torchrun_ddp.config import TrainConfig, flag_name  # noqa: E402
from torchrun_ddp.config_checks import LORA_FLAGS, SCHEDULE_FLAGS  # noqa: E402
from torchrun_ddp.config_io import build_parser, parse_config, to_toml  # noqa: E402
from torchrun_ddp.errors import UserError  # noqa: E402
from torchrun_ddp.methods import method_flag_owners  # noqa: E402
from torchrun_ddp.methods.adamw import COMPRESSION_FLAGS  # noqa: E402
from torchrun_ddp.peer_names import HF_TRAINER, TORCHTITAN  # noqa: E402

OPTIONS = {option for action in build_parser()._actions for option in action.option_strings}
OWNERS = {**method_flag_owners(), **COMPRESSION_FLAGS, **LORA_FLAGS, **SCHEDULE_FLAGS}
SWITCH_VALUES = {"optimizer": ("adamw", "demo", "diloco", "sparseloco"), "peft": ("none", "lora")}
SWITCH_VALUES["compression"] = ("none", "dct", "dct-topk", "fp16", "bf16", "powersgd")
SWITCH_VALUES["lr_scheduler"] = ("cosine-restarts", "cosine", "linear", "constant", "wsd")


def _error_line(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    assert train.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err, err
    return err


@pytest.mark.parametrize("name", sorted({**HF_TRAINER, **TORCHTITAN}))
def test_peer_names_are_answered_with_this_projects_flag(
    capsys: pytest.CaptureFixture[str], name: str
) -> None:
    """Each mapped name gives its flag, which this project accepts, before any spelling guess."""
    suggestion = HF_TRAINER.get(name) or TORCHTITAN[name]
    flag = suggestion.split()[0]
    assert flag in OPTIONS, f"{name} maps to {flag}, which train.py does not accept"
    err = _error_line(capsys, [f"--{name}", "1"])
    assert err == f"error: unknown option --{name}: this project calls it {suggestion}"


@pytest.mark.parametrize(
    ("argv", "modes"),
    [
        (["--fsdp", "full_shard"], ["--data-parallel fsdp", "--data-parallel hsdp"]),
        (["--fsdp", "hybrid_shard"], ["--data-parallel hsdp", "--shard-degree"]),
        (["--fsdp_config", "fsdp.json"], ["--data-parallel fsdp"]),
        (["--deepspeed", "ds.json"], ["--data-parallel fsdp", "--zero1"]),
        (["--parallelism.data_parallel_shard_degree", "8"], ["--data-parallel fsdp", "hsdp"]),
        (["--parallelism.data_parallel_replicate_degree", "2"], ["--data-parallel hsdp"]),
    ],
)
def test_other_trainers_sharding_names_map_to_data_parallel(
    capsys: pytest.CaptureFixture[str], argv: list[str], modes: list[str]
) -> None:
    """HF's --fsdp and --deepspeed and torchtitan's data-parallel degrees name this project's
    modes (not --zero1 alone, which fsdp refuses; not a spelling guess such as --seed)."""
    err = _error_line(capsys, argv)
    assert "this project calls it --data-parallel" in err, err
    assert all(mode in err for mode in modes), err


def test_a_torchtitan_section_in_a_config_file_is_answered(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    file = tmp_path / "titan.toml"
    file.write_text("[training]\nsteps = 10\n")
    err = _error_line(capsys, ["--config", str(file)])
    assert err.endswith("unknown option training.steps: this project calls it --max-steps")


def _value(name: str) -> list[str]:
    """The field's default as command-line words (a given default counts as given)."""
    default = dataclasses.asdict(TrainConfig())[name]
    return [str(item) for item in default] if isinstance(default, list) else [str(default)]


@pytest.mark.parametrize("name", sorted(OWNERS))
def test_a_flag_the_run_does_not_read_is_refused(
    capsys: pytest.CaptureFixture[str], name: str
) -> None:
    """Given under a value of its switch that does not read it: one line naming the owner; given
    under its owner: accepted."""
    switch, owners = OWNERS[name]
    other = next(value for value in SWITCH_VALUES[switch] if value not in owners)
    flag = [f"--{flag_name(name)}", *_value(name), "--max-steps", "500"]
    err = _error_line(capsys, [f"--{flag_name(switch)}", other, *flag])
    assert f"--{flag_name(name)} is a setting of --{flag_name(switch)} " in err
    assert f"{' or '.join(owners)} and does nothing under --{flag_name(switch)} {other}" in err
    owner = [f"--{flag_name(switch)}", owners[0]]
    assert getattr(parse_config([*owner, *flag]), switch) == owners[0]


def test_a_config_file_gives_a_flag_unless_it_holds_the_default(tmp_path: Path) -> None:
    """A key set in a file to a non-default value counts as given; a printed config (every key,
    defaults included) reads back."""
    file = tmp_path / "run.toml"
    file.write_text("demo_topk = 8\n")
    with pytest.raises(UserError, match="--demo-topk is a setting of --optimizer demo"):
        parse_config(["--config", str(file)])
    printed = tmp_path / "printed.toml"
    printed.write_text(to_toml(parse_config([])))
    assert parse_config(["--config", str(printed)]) == parse_config([])


def test_a_dry_run_refuses_a_hook_on_one_planned_replica(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """hsdp with a --compression hook on one node of 8 (one replica: the hook would exchange
    with nobody): one line, status 2, naming ddp; the same plan on 2 nodes is printed."""
    flags = ["--dry-run", "--data-parallel", "hsdp", "--compression", "dct", "--zero1", "false"]
    err = _error_line(capsys, [*flags, "--plan-world-size", "8"])
    assert "1 replica of 8 ranks" in err and "use --data-parallel ddp" in err, err
    assert train.main([*flags, "--plan-world-size", "16"]) == 0
    assert "communication plan" in capsys.readouterr().out
