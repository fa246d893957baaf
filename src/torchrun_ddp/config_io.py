"""Reading and writing a TrainConfig: command-line flags, TOML config files, saved config.

Parsing uses transformers' ``HfArgumentParser`` (flags accept ``--seq-length`` and
``--seq_length``); a TOML file given with ``--config FILE`` supplies defaults that flags then
override. Config-file values are checked like flags (types, choices, unknown keys) by a strict
pydantic model built from the dataclass fields (``file_schema``), input paths in a file are
relative to the file, and ``config_checks.validate`` checks ranges of the merged config; all raise
``UserError`` before any process group starts.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import inspect
import os
import re
import tomllib
from functools import cache
from pathlib import Path
from typing import Literal, get_type_hints

import tomli_w
from pydantic import BaseModel, ConfigDict, ValidationError, create_model
from transformers import HfArgumentParser

from torchrun_ddp.config import TrainConfig, field_names, flag_name
from torchrun_ddp.config_checks import validate
from torchrun_ddp.config_fields import help_text
from torchrun_ddp.errors import UserError
from torchrun_ddp.methods import PRESETS
from torchrun_ddp.peer_names import peer_flag


def load_toml(path: str) -> dict[str, object]:
    """Read a TOML config file into a flat dict; raises UserError on a missing or bad file."""
    file = Path(path)
    if not file.is_file():
        raise UserError(
            f"config file {path} does not exist; pass an existing TOML file to --config"
        )
    try:
        values = tomllib.loads(file.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise UserError(f"config file {path} is not valid TOML ({exc}); fix the syntax") from exc
    unknown = [
        _file_key(key, value)
        for key, value in values.items()
        if key.replace("-", "_") not in field_names()
    ]
    if unknown:
        raise UserError(f"config file {path}: {_unknown_message(unknown[0])}")
    flat = {key.replace("-", "_"): value for key, value in values.items()}
    return resolve_input_paths(check_file_values(flat, path), file.resolve().parent)


def _file_key(key: str, value: object) -> str:
    """An unknown top-level key of a config file, as ``section.key`` for a TOML table (the
    first key of torchtitan's ``[training]`` gives ``training.steps``)."""
    if isinstance(value, dict) and value:
        return f"{key}.{next(iter(value))}"
    return key


@cache
def file_schema() -> type[BaseModel]:
    """A strict pydantic model of the config-file values, built from TrainConfig's fields.

    Each field keeps its annotated type; a field with ``choices`` becomes ``Literal[choices]``.
    Strict mode refuses what a flag's type would refuse: 4.5 or true for an int, a string for a
    list, an int for a string (an int is accepted for a float, as TOML writes ``1`` for 1.0).
    Unknown keys are refused (``extra="forbid"``).
    """
    hints = get_type_hints(TrainConfig)
    fields: dict[str, tuple[object, object]] = {}
    for item in dataclasses.fields(TrainConfig):
        choices = item.metadata.get("choices")
        kind = Literal[tuple(choices)] if choices else hints[item.name]
        fields[item.name] = (kind, None)
    strict = ConfigDict(strict=True, extra="forbid")
    return create_model("TrainConfigFile", __config__=strict, **fields)


def check_file_values(values: dict[str, object], path: str) -> dict[str, object]:
    """The config-file ``values`` (underscored keys, as TOML parsed them) after the checks a flag
    gets, ints for float fields made floats; raises UserError naming the first bad key."""
    try:
        return file_schema().model_validate(values).model_dump(exclude_unset=True)
    except ValidationError as exc:
        error = exc.errors()[0]
        key = ".".join(str(part) for part in error["loc"])
        raise UserError(
            f"config file {path}: {key} = {error['input']!r} is invalid ({error['msg']}); "
            f"fix it in the file (see --help for --{flag_name(str(error['loc'][0]))})"
        ) from exc


# Inputs a config file may name by a path relative to itself. Outputs (output_dir,
# checkpoint_dir) stay relative to the working directory, as in torchtitan and HF Trainer.
_PATH_OR_HUB_ID = ("model", "tokenizer")
_PATHS = ("resume_from", "chat_template", "eval_multiple_choice")
_PATH_LISTS = ("data_files", "eval_files")


def _is_path(value: str) -> bool:
    """Whether ``value`` cannot be a hub id (``namespace/name``): it starts with ``.``, ``/`` or
    ``~``, ends in ``.json``, or has more than one ``/``."""
    return value.startswith((".", "/", "~")) or value.endswith(".json") or value.count("/") > 1


def resolve_input_paths(values: dict[str, object], base: Path) -> dict[str, object]:
    """Make the input paths of a config file absolute, relative to ``base`` (its folder).

    ``model`` and ``tokenizer`` may be hub ids: they are resolved when ``base / value`` exists
    or the value cannot be a hub id (``_is_path``), so a missing file is reported where it was
    looked for. ``resume_from`` and each glob of ``data_files``/``eval_files`` are always joined to
    ``base`` unless absolute or empty. Other values pass through unchanged.
    """
    resolved = dict(values)
    for name in _PATH_OR_HUB_ID:
        value = resolved.get(name)
        if isinstance(value, str) and value and ((base / value).exists() or _is_path(value)):
            resolved[name] = str((base / value).resolve())
    for name in _PATHS:
        value = resolved.get(name)
        if isinstance(value, str) and value:
            resolved[name] = _joined(base, value)
    for name in _PATH_LISTS:
        value = resolved.get(name)
        if isinstance(value, list):
            resolved[name] = [
                _joined(base, item) if isinstance(item, str) else item for item in value
            ]
    return resolved


def _joined(base: Path, value: str) -> str:
    """``value`` if absolute, else ``base / value`` normalised (globs kept as written)."""
    path = Path(value).expanduser()
    return str(path if path.is_absolute() else Path(os.path.normpath(base / path)))


def _unknown_message(name: str) -> str:
    """'unknown option X: this project calls it Y' for a Hugging Face Trainer or torchtitan name
    (``peer_names``); else 'unknown option X; did you mean Y?' with the nearest valid field name;
    for ``--no-X`` of a switch that is off by default, how to turn it off (``--X false``) when a
    config file turned it on."""
    key = name.lstrip("-").split("=")[0].replace("-", "_")
    peer = peer_flag(key)
    if peer:
        return f"unknown option {name}: this project calls it {peer}"
    switch = key.removeprefix("no_")
    if key != switch and switch in _switches_off_by_default():
        return f"unknown option {name}; use --{switch.replace('_', '-')} false"
    close = difflib.get_close_matches(key, [*field_names(), "config"], n=1)
    hint = f"; did you mean --{close[0].replace('_', '-')}?" if close else "; see --help"
    return f"unknown option {name}{hint}"


def _switches_off_by_default() -> set[str]:
    """Boolean TrainConfig fields that default to False (their flag takes ``true``/``false``)."""
    return {
        field.name
        for field in dataclasses.fields(TrainConfig)
        if field.type in (bool, "bool") and field.default is False
    }


_SECTION = re.compile(r"^    # (?P<title>\S.*)$")
_FIELD = re.compile(r"^    (?P<name>[a-z_][a-z0-9_]*): ")


@cache
def sections() -> dict[str, str]:
    """Field name -> the title of the ``# Section`` comment above it in TrainConfig's source
    (the configuration page's and ``--help``'s sections).

    Fields above the first section comment get the title "General".
    """
    lines, _ = inspect.getsourcelines(TrainConfig)
    title = "General"
    found: dict[str, str] = {}
    for line in lines:
        section = _SECTION.match(line)
        if section:
            title = section.group("title")
            continue
        field = _FIELD.match(line)
        if field:
            found[field.group("name")] = title
    return found


def group_by_section(parser: argparse.ArgumentParser) -> None:
    """Move each field's flags from the parser's one options group into an argument group per
    ``sections`` title, in source order, so ``--help`` reads like the configuration page.
    argparse keeps a group's entries in ``_group_actions``; parsing does not look at groups."""
    titles = sections()
    groups: dict[str, argparse._ArgumentGroup] = {}
    default_group = parser._optionals
    for action in list(default_group._group_actions):
        title = titles.get(action.dest)
        if title is None:
            continue
        if title not in groups:
            groups[title] = parser.add_argument_group(title)
        default_group._group_actions.remove(action)
        groups[title]._group_actions.append(action)


def build_parser() -> HfArgumentParser:
    """The command-line parser: ``--config FILE`` plus one flag per TrainConfig field, grouped in
    ``--help`` by the configuration page's sections."""
    parser = HfArgumentParser(
        TrainConfig,
        description="Train a causal LM (LLaMA and any AutoModelForCausalLM) with PyTorch DDP "
        "under torchrun.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        allow_abbrev=False,
        exit_on_error=False,
    )
    parser.add_argument("--config", default=None, help="TOML file of defaults; flags override it.")
    parser.add_argument(
        "--print-config",
        action="store_true",
        help="Print the resolved config as TOML (readable by --config) and exit.",
    )
    helps = {item.name: help_text(item) for item in dataclasses.fields(TrainConfig)}
    for action in parser._actions:  # show --seq-length before its alias --seq_length
        action.option_strings.sort(key=lambda option: "_" in option)
        action.help = helps.get(action.dest, action.help)
    group_by_section(parser)
    return parser


def parse_config(argv: list[str]) -> TrainConfig:
    """Parse ``argv`` (without the program name) into a validated TrainConfig.

    Raises UserError for a bad config file, an unknown flag or an invalid value. ``--help``
    prints the options and exits 0 (argparse's SystemExit).
    """
    parser = build_parser()
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", default=None)
    for name in PRESETS:  # a method's preset, applied under the file's and the flags' values
        pre.add_argument(f"--{flag_name(name)}", f"--{name}", dest=name, default=None)
    known, _ = pre.parse_known_args(argv)
    values = load_toml(known.config) if known.config else {}
    parser.set_defaults(**{**preset_values(vars(known), values), **values})
    try:
        namespace, unknown = parser.parse_known_args(argv)
    except argparse.ArgumentError as exc:
        raise UserError(f"{exc}; see --help") from exc
    if unknown:
        raise UserError(_unknown_message(unknown[0]))
    given = given_fields(parser, argv, values)
    values = {name: getattr(namespace, name) for name in field_names()}
    # Flags name paths relative to the working directory; save them absolute so that the saved
    # config means the same from anywhere (config-file paths were resolved by load_toml).
    config = TrainConfig(**resolve_input_paths(values, Path.cwd()))
    validate(config, given)
    return config


def preset_values(flags: dict[str, object], file_values: dict[str, object]) -> dict[str, object]:
    """The field values of the methods' presets (``methods.PRESETS``) the flags or the config
    file name (a flag's choice first), merged; {} where none is named."""
    values: dict[str, object] = {}
    for name, presets in PRESETS.items():
        chosen = flags.get(name) or file_values.get(name)
        values.update(presets.get(str(chosen), {}))
    return values


_UNSET = object()
"""Marks a field that the command line did not set (``given_fields``)."""


def given_fields(
    parser: argparse.ArgumentParser, argv: list[str], file_values: dict[str, object]
) -> frozenset[str]:
    """The fields ``argv`` sets (any value, the default's included) and those the config file
    sets to a value other than the default (a saved or printed config lists every field, so its
    defaults say nothing). Defaults from a preset are not given.

    ``argv`` is parsed a second time into a namespace that already holds a marker for every
    field: argparse fills in defaults only for missing attributes, so a field still holding the
    marker was not on the command line."""
    marked = argparse.Namespace(**dict.fromkeys(field_names(), _UNSET))
    namespace, _ = parser.parse_known_args(argv, namespace=marked)
    flags = {name for name in field_names() if getattr(namespace, name) is not _UNSET}
    defaults = default_values()
    in_file = {name for name, value in file_values.items() if value != defaults[name]}
    return frozenset(flags | in_file)


def default_values() -> dict[str, object]:
    """Every TrainConfig field's default value."""
    return dataclasses.asdict(TrainConfig())


def to_toml(config: TrainConfig) -> str:
    """The config as TOML text that ``--config`` reads back to an equal config (no secrets)."""
    return tomli_w.dumps(dataclasses.asdict(config))


def save_config(config: TrainConfig, path: Path, test_hooks: str = "") -> None:
    """Write the resolved config to ``path`` as TOML (the config holds no secrets: HF_TOKEN
    is only ever read from the environment); ``test_hooks`` (the hooks the test harness armed,
    faults.py) goes first as a comment line, so the file still loads as a config."""
    path.parent.mkdir(parents=True, exist_ok=True)
    note = f"# test hooks armed: {test_hooks}\n" if test_hooks else ""
    path.write_text(note + to_toml(config))
