"""The configuration reference page, generated from ``TrainConfig`` and the command-line parser.

``uv run python -m torchrun_ddp.config_docs --out docs/configuration.md`` writes the page (without
``--out`` it prints it). Every option gets its flags, type, default and help text exactly as
``train.py --help`` knows them; options are grouped by the ``# Section`` comments that precede
them in ``TrainConfig``'s source, so a new field lands in the section it is written in.
tests/test_docs.py fails when the committed page differs from ``render()``.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import get_type_hints

import tomli_w

from torchrun_ddp.config import TrainConfig
from torchrun_ddp.config_fields import help_text
from torchrun_ddp.config_io import build_parser, sections
from torchrun_ddp.peer_names import HF_TRAINER, TORCHTITAN

REGENERATE = "uv run python -m torchrun_ddp.config_docs --out docs/configuration.md"
"""The command that rewrites the page; the staleness test prints it."""


_PREAMBLE = f"""\
# Configuration

<!-- Generated from TrainConfig (src/torchrun_ddp/config.py); do not edit by hand.
     Regenerate with: {REGENERATE} -->

Every option is a command-line flag of `train.py` and a key of a TOML config file. A file given
with `--config FILE` sets defaults; flags override them:

```bash
uv run python train.py --config configs/tiny.toml --max-steps 20 --log-every 5
```

In a file the key is the option's name with underscores (`seq_length = 256`; `seq-length` is
accepted too). A file's values get the same type, choice and range checks as flags, and input
paths in a file (`model`, `tokenizer`, `data_files`, `eval_files`, `resume_from`) are relative to
the file. Each run saves its resolved config as `<output-dir>/config.toml`, which `--config`
reads back; `--print-config` prints it without training. Boolean options take `--zero1`,
`--zero1 true` or `--zero1 false`; those that default to true also have a negated flag such as
`--no-resume`. List options take several values after one flag
(`--data-files a.json.gz b.json.gz`).

Defaults are shown as TOML values. This page is generated from the code: `train.py --help`
prints the same help text.
"""


def option_strings(parser: argparse.ArgumentParser) -> dict[str, list[str]]:
    """Destination -> its hyphenated flags (``--no-x`` after ``--x``); help is left out."""
    flags: dict[str, list[str]] = {}
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        hyphenated = [flag for flag in action.option_strings if "_" not in flag]
        flags.setdefault(action.dest, []).extend(hyphenated or action.option_strings)
    return flags


def type_text(field: dataclasses.Field[object], hint: object) -> str:
    """The option's type as the page shows it: the Python type, or its choices."""
    choices = field.metadata.get("choices")
    if choices:
        return "one of " + ", ".join(f"`{choice}`" for choice in choices)
    name = getattr(hint, "__name__", None)
    return f"`{hint}`" if name is None or getattr(hint, "__args__", None) else f"`{name}`"


def toml_value(value: object) -> str:
    """``value`` as a TOML value on one line (``"fp32"``, ``false``, ``1e-05``, ``["a", "b"]``)."""
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(item) for item in value) + "]"
    return tomli_w.dumps({"x": value}).strip().removeprefix("x = ")


def _cell(text: str) -> str:
    """Text safe inside a Markdown table cell."""
    return text.replace("|", "\\|").replace("\n", " ")


def _row(flags: list[str], kind: str, default: str, description: str) -> str:
    names = " ".join(f"`{flag}`" for flag in flags)
    return f"| {names} | {kind} | {default} | {_cell(description)} |"


def _table(rows: list[str]) -> list[str]:
    return ["| option | type | default | meaning |", "|---|---|---|---|", *rows, ""]


def _command_line_rows(parser: argparse.ArgumentParser) -> list[str]:
    """Rows for the flags that are not config fields (``--config``, ``--print-config``)."""
    names = {field.name for field in dataclasses.fields(TrainConfig)}
    rows = []
    for action in parser._actions:
        if action.dest in names or isinstance(action, argparse._HelpAction):
            continue
        kind = "flag" if action.nargs == 0 else "path"
        rows.append(_row(list(action.option_strings), kind, "", action.help or ""))
    return rows


def render() -> str:
    """The whole Markdown page (ends with a newline)."""
    parser = build_parser()
    flags = option_strings(parser)
    hints = get_type_hints(TrainConfig)
    titles = sections()
    grouped: dict[str, list[str]] = {}
    for field in dataclasses.fields(TrainConfig):
        default = field.default_factory() if callable(field.default_factory) else field.default
        row = _row(
            flags[field.name],
            type_text(field, hints[field.name]),
            f"`{toml_value(default)}`",
            help_text(field),
        )
        grouped.setdefault(titles.get(field.name, "General"), []).append(row)
    lines = [_PREAMBLE, "## Command line only", "", *_table(_command_line_rows(parser))]
    for title, rows in grouped.items():
        lines += [f"## {title}", "", *_table(rows)]
    lines += _peer_names()
    return "\n".join(lines).rstrip("\n") + "\n"


def _peer_names() -> list[str]:
    """The section of other trainers' names (``peer_names``), as the unknown-flag message
    answers them."""
    lines = [
        "## Names from Hugging Face Trainer and torchtitan",
        "",
        "An unknown flag or config key that one of these trainers uses is answered with this "
        "project's name for it, from this table, in one line with exit status 2 (a guess by "
        "spelling comes only for names not here). Names they share with this project "
        "(`--learning_rate`, `--max_steps`, `--report_to`, ...) are flags here already.",
        "",
        "| their name | this project |",
        "|---|---|",
    ]
    for prefix, table in (("HF Trainer `", HF_TRAINER), ("torchtitan `", TORCHTITAN)):
        lines += [f"| {prefix}{name}` | {flag} |" for name, flag in table.items()]
    return [*lines, ""]


def main(argv: list[str] | None = None) -> int:
    """Print the page, or write it to ``--out``; exit status 0."""
    parser = argparse.ArgumentParser(
        prog="python -m torchrun_ddp.config_docs", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--out", type=Path, default=None, help="write the page here")
    args = parser.parse_args(argv)
    page = render()
    if args.out is None:
        sys.stdout.write(page)
        return 0
    args.out.write_text(page)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
