"""Config parsing: flags, TOML files, --help, validation and the saved config."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from torchrun_ddp.config import TrainConfig, field_names
from torchrun_ddp.config_checks import global_batch_accumulation
from torchrun_ddp.config_io import build_parser, parse_config, save_config
from torchrun_ddp.errors import UserError


def test_defaults_are_the_seeds_run() -> None:
    config = parse_config([])
    assert config.model == "meta-llama/Llama-2-7b-hf"
    assert (config.dataset, config.dataset_config) == ("allenai/c4", "en")
    assert (config.learning_rate, config.seq_length, config.batch_size) == (1e-5, 512, 4)
    assert (config.accumulation_steps, config.epochs, config.weight_decay) == (1, 1, 0.01)
    assert config.warmup_steps == 250


FLAT_FLAGS = [
    *("config", "model", "tokenizer", "dataset", "dataset-config", "data-files", "eval-files"),
    *("seq-length", "batch-size", "accumulation-steps", "learning-rate", "weight-decay"),
    *("warmup-steps", "epochs", "max-steps", "seed", "compression", "output-dir", "log-every"),
    "eval-every",
]


def test_help_lists_every_field_and_the_flat_flags(capsys: pytest.CaptureFixture[str]) -> None:
    build_parser().print_help()
    text = capsys.readouterr().out
    for flag in FLAT_FLAGS:
        assert f"--{flag}" in text, flag
    for name in field_names():
        assert f"--{name.replace('_', '-')}" in text, name
    assert "Peak learning rate of AdamW" in text


def test_toml_then_flags_override(tmp_path: Path) -> None:
    file = tmp_path / "run.toml"
    file.write_text('seq_length = 64\nbatch-size = 3\ndata_files = ["a.json", "b.json"]\n')
    config = parse_config(["--config", str(file), "--batch-size", "5"])
    assert (config.seq_length, config.batch_size) == (64, 5)
    assert config.data_files == [str(tmp_path / "a.json"), str(tmp_path / "b.json")]


def test_config_file_input_paths_resolve_relative_to_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "configs" / "tok").mkdir(parents=True)
    file = tmp_path / "configs" / "run.toml"
    file.write_text(
        'tokenizer = "tok"\nmodel = "org/hub-model"\ndata_files = ["../data/*train*.json.gz"]\n'
        'output_dir = "outputs/run"\n'
    )
    monkeypatch.chdir(tmp_path / "configs" / "tok")  # any working directory
    config = parse_config(["--config", str(file)])
    assert config.tokenizer == str(tmp_path / "configs" / "tok")
    assert config.model == "org/hub-model", "a hub id is not a path"
    assert config.data_files == [str(tmp_path / "data" / "*train*.json.gz")]
    assert config.output_dir == "outputs/run", "outputs stay relative to the working directory"


def test_relative_input_flags_are_saved_as_absolute_paths(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    config = parse_config(["--eval-files", "x.json", "--resume-from", "ckpt/step-5"])
    assert config.eval_files == [str(tmp_path / "x.json")]
    assert config.resume_from == str(tmp_path / "ckpt" / "step-5")


def test_saved_config_round_trips(tmp_path: Path) -> None:
    config = parse_config(["--seq-length", "32", "--eval-files", "x.json", "--compression", "dct"])
    save_config(config, tmp_path / "config.toml")
    again = parse_config(["--config", str(tmp_path / "config.toml")])
    assert dataclasses.asdict(again) == dataclasses.asdict(config)
    assert "HF_TOKEN" not in (tmp_path / "config.toml").read_text()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--learning-rate", "0"], "--learning-rate must be > 0"),
        (["--learning-rate=-1e-4"], "--learning-rate must be > 0"),
        (["--batch-size", "0"], "--batch-size must be > 0"),
        (["--seq-length", "-5"], "--seq-length must be > 0"),
        (["--max-steps", "0"], "--max-steps must be -1"),
        (["--compression-ratio", "1.5"], "--compression-ratio must be in"),
        (["--batch-sise", "2"], "did you mean --batch-size"),
        (["--batch-size", "two"], "invalid int value"),
        (["--config", "missing.toml"], "does not exist"),
        (["--ddp-static-graph", "--accumulation-steps", "2"], "does not work with --accum"),
        # DeMo
        (["--optimizer", "demo", "--compression", "dct"], "--compression none"),
        (["--optimizer", "demo", "--zero1"], "--zero1"),
        (["--demo-beta", "1.0"], "--demo-beta"),
        (["--demo-topk", "0"], "--demo-topk"),
        # DiLoCo and SparseLoCo
        (["--optimizer", "diloco", "--zero1"], "--zero1"),
        (["--optimizer", "sparseloco", "--compression", "dct"], "--compression none"),
        (["--quant-bits", "9"], "--quant-bits"),
        (["--sparseloco-beta", "1"], "--sparseloco-beta"),
        (["--outer-momentum", "1"], "--outer-momentum"),
        (["--local-steps", "-1"], "--local-steps"),
        (["--sparseloco-topk", "0"], "--sparseloco-topk"),
        # --overlap-exchange and --sync-delay
        (["--optimizer", "diloco", "--sync-delay", "2"], "--sync-delay"),
        (["--optimizer", "diloco", "--overlap-exchange", "--sync-delay", "-1"], "--sync-delay"),
        (["--overlap-exchange"], "does nothing for adamw"),
        (["--optimizer", "demo", "--overlap-exchange", "--sync-delay", "2"], "--sync-delay"),
        # node-aware exchange
        (["--optimizer", "diloco", "--compression-scope", "inter-node"], "not diloco"),
    ],
)
def test_bad_values_are_rejected_in_one_line(argv: list[str], message: str) -> None:
    """Each bad flag or combination is one UserError line naming it, raised by parse_config
    (before any process group). The optimizer cases came from test_demo.py,
    test_local_updates.py, test_local_update_overlap.py and test_demo_exchange.py."""
    with pytest.raises(UserError, match=message) as error:
        parse_config(argv)
    assert "\n" not in str(error.value)


def test_a_switch_a_config_file_turned_on_is_turned_off_with_false(tmp_path: Path) -> None:
    """``--no-zero1`` does not exist; the error names the spelling that does, and it works."""
    on = tmp_path / "on.toml"
    on.write_text("zero1 = true\n")
    assert parse_config(["--config", str(on)]).zero1
    with pytest.raises(UserError, match="unknown option --no-zero1; use --zero1 false"):
        parse_config(["--config", str(on), "--no-zero1"])
    assert not parse_config(["--config", str(on), "--zero1", "false"]).zero1


def test_malformed_and_unknown_toml(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("seq_length = = 3\n")
    with pytest.raises(UserError, match="not valid TOML"):
        parse_config(["--config", str(bad)])
    unknown = tmp_path / "unknown.toml"
    unknown.write_text("lerning_rate = 0.1\n")
    with pytest.raises(UserError, match="did you mean --learning-rate"):
        parse_config(["--config", str(unknown)])


def test_every_field_has_help() -> None:
    for item in dataclasses.fields(TrainConfig):
        assert item.metadata.get("help"), item.name


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('precision = "fp16"', "precision = 'fp16' is invalid (Input should be 'fp32'"),
        ("batch_size = 4.5", "batch_size = 4.5 is invalid (Input should be a valid integer)"),
        ("batch_size = true", "batch_size = True is invalid"),
        ('data_files = "a.json.gz"', "data_files = 'a.json.gz' is invalid (Input should be a "),
        ('init = "pretrianed"', "init = 'pretrianed' is invalid"),
        ('adamw_implementation = "fast"', "adamw_implementation = 'fast' is invalid"),
        ('device = "cuda:0"', "device = 'cuda:0' is invalid"),
        ('compression = "topk"', "compression = 'topk' is invalid"),
        ('seq_length = "64"', "seq_length = '64' is invalid"),
        ("zero1 = 1", "zero1 = 1 is invalid (Input should be a valid boolean)"),
        ("eval_files = [3]", "eval_files.0 = 3 is invalid"),
        ("learning_rate = -0.5", "--learning-rate must be > 0"),
    ],
)
def test_config_file_values_are_checked_like_flags(tmp_path: Path, line: str, message: str) -> None:
    """Types, choices and ranges of a config file: each bad value is one UserError naming the
    key, before anything is built (flags refuse the same values through argparse)."""
    file = tmp_path / "run.toml"
    file.write_text(line + "\n")
    with pytest.raises(UserError, match="^" + ("config file " if "=" in message else "")) as info:
        parse_config(["--config", str(file)])
    assert message in str(info.value) and "\n" not in str(info.value)


def test_config_file_int_for_a_float_is_a_float(tmp_path: Path) -> None:
    file = tmp_path / "run.toml"
    file.write_text("learning_rate = 1\nddp_bucket_cap_mb = 25\n")
    config = parse_config(["--config", str(file)])
    assert isinstance(config.learning_rate, float) and config.learning_rate == 1.0
    assert isinstance(config.ddp_bucket_cap_mb, float)


def test_a_flag_overrides_a_valid_file_value(tmp_path: Path) -> None:
    file = tmp_path / "run.toml"
    file.write_text('precision = "bf16"\n')
    assert parse_config(["--config", str(file), "--precision", "fp32"]).precision == "fp32"


def test_keep_global_batch_accumulation() -> None:
    assert global_batch_accumulation(1, 2, 1) == 2  # 2 ranks x 1 -> 1 rank x 2
    assert global_batch_accumulation(2, 1, 2) == 1
    assert global_batch_accumulation(3, 4, 6) == 2
    with pytest.raises(UserError, match=r"1 ranks x 2 micro-batches .* over 3 ranks") as info:
        global_batch_accumulation(2, 1, 3)
    assert "--keep-global-batch" in str(info.value) and "\n" not in str(info.value)


def test_help_is_grouped_by_the_configuration_pages_sections(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """--help has one heading per ``# Section`` of TrainConfig, in the configuration page's
    order, and each field's flag under its own heading."""
    from torchrun_ddp.config_io import sections  # noqa: PLC0415

    build_parser().print_help()
    blocks: dict[str, str] = {}
    title = ""
    for line in capsys.readouterr().out.splitlines():
        if line and not line[0].isspace() and line.endswith(":"):
            title = line[:-1]
            blocks[title] = ""
        elif title:
            blocks[title] += line + "\n"
    titles = list(dict.fromkeys(sections().values()))
    assert list(blocks) == ["options", *titles]
    for name, section in sections().items():
        flag = re.compile(rf"--{name.replace('_', '-')}(?![\w-])")
        assert flag.search(blocks[section]), (name, section)
    assert re.search(r"--config(?![\w-])", blocks["options"])
