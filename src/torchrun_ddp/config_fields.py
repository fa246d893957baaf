"""How a config field is declared (``opt``: its default, help and choices) and named as a flag
(``flag_name``), and the choices another module's table holds: ``--optimizer``'s values come
from the training methods' table (``methods.METHODS``), which registers them here when it is
imported, with a line of help each, so that a method is added in its own module.
"""

from __future__ import annotations

import dataclasses
from dataclasses import field

OPTIMIZER_CHOICES: list[str] = []
"""--optimizer's values (``TrainConfig.optimizer``'s choices: the field holds this list)."""
_CHOICE_HELP: dict[str, dict[str, str]] = {}
"""Field -> {value: one line} appended to its help (``help_text``)."""
_NOTES: dict[str, str] = {}
"""Field -> a sentence appended to its help after the choices (``register_note``)."""


def opt(default: object, help: str, **extra: object) -> object:
    """A dataclass field whose help text becomes the flag's ``--help`` entry (``extra``: more
    metadata, e.g. ``choices``)."""
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"help": help, **extra})
    return field(default=default, metadata={"help": help, **extra})


def flag_name(name: str) -> str:
    """The flag of config field ``name`` without its leading ``--`` (``seq_length`` ->
    ``seq-length``)."""
    return name.replace("_", "-")


def register_choices(name: str, choices: list[str], lines: dict[str, str]) -> None:
    """Make ``lines``' keys the choices of field ``name`` (in place: ``choices`` is the list the
    field holds) and their values, one line each, part of its help (``help_text``)."""
    choices[:] = list(lines)
    _CHOICE_HELP[name] = dict(lines)


def register_note(name: str, note: str) -> None:
    """Append ``note`` (a sentence) to field ``name``'s help (``help_text``), e.g. the
    data-parallel modes that refuse it (``parallel.modes``)."""
    _NOTES[name] = note


def help_text(field_: dataclasses.Field[object]) -> str:
    """The help of a config field as ``--help`` and the configuration page show it: its own,
    then a line per choice registered for it (``register_choices``), then its note
    (``register_note``)."""
    text = str(field_.metadata.get("help", ""))
    lines = _CHOICE_HELP.get(field_.name, {})
    note = [_NOTES[field_.name]] if field_.name in _NOTES else []
    return " ".join([text, *(f"{name}: {line}." for name, line in lines.items()), *note])
