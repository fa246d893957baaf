"""Local data files read one record at a time: JSON lines line by line, a file holding one JSON
array element by element, Parquet, Arrow and ``save_to_disk`` folders row by row through
``datasets``' own builders (``raw_records``); each record checked against its example format
(``formats.check_record``) into ``{"text", "error"}`` (``RECORD_FEATURES``), a damaged one named
by file and line or row (``file_records``); several files in order, with a deterministic slice of
each held out (``read_records``, ``is_heldout``). Imports ``formats`` and ``errors``.
"""

from __future__ import annotations

import gzip
import json
import zlib
from collections.abc import Iterator
from pathlib import Path

from datasets import Features, Value, load_dataset, load_from_disk

from torchrun_ddp.errors import UserError
from torchrun_ddp.training_data.formats import ExampleFormat, check_record

TABLE_BUILDERS = {".parquet": "parquet", ".arrow": "arrow"}
"""File suffixes read through a ``datasets`` packaged builder, row by row."""


JSON_SUFFIXES = (".json", ".jsonl", ".json.gz", ".jsonl.gz")
"""File suffixes read as JSON lines, line by line."""


RECORD_FEATURES = Features({"text": Value("string"), "error": Value("string")})
"""Columns of ``read_records``: the example (``formats.check_record``), or None and what is
wrong with the record."""


def read_records(
    files: list[str],
    fmt: ExampleFormat | None = None,
    heldout_fraction: float = 0.0,
    heldout: bool = False,
) -> Iterator[dict[str, str | None]]:
    """The records of ``files``, in order, as ``{"text", "error"}`` (``RECORD_FEATURES``).

    JSON lines (``.json``, ``.jsonl``, ``.gz``) are read line by line: a line that is not UTF-8,
    not a JSON object or not a record of ``fmt`` (default ``text``) yields ``text`` None and an
    ``error`` naming the file and line; a damaged or truncated gzip stream yields one such record
    and ends that file; blank lines are skipped. Parquet, Arrow and ``save_to_disk`` folders are
    read by ``datasets``, their errors naming the file and row. Record ``i`` of a file (from 0)
    is held out when ``floor((i + 1) f) > floor(i f)`` for ``f = heldout_fraction``: an even,
    deterministic slice of ``f`` of each file; ``heldout`` picks that slice, else the rest.
    """
    for path in files:
        for index, record in enumerate(file_records(path, fmt or ExampleFormat())):
            if is_heldout(index, heldout_fraction) == heldout:
                yield record


def is_heldout(index: int, fraction: float) -> bool:
    """Whether record ``index`` of a file is in the held-out slice of ``fraction`` (0 to 1)."""
    return int((index + 1) * fraction) > int(index * fraction)


def file_records(path: str, fmt: ExampleFormat) -> Iterator[dict[str, str | None]]:
    """The records of one file, in order, as ``{"text", "error"}`` (see ``read_records``): each
    raw record (``raw_records``) checked against ``fmt``, a damaged one named by ``path`` and
    its line or row. Raises UserError for a file of an unknown type."""
    for raw, where in raw_records(path):
        if raw is None:
            yield {"text": None, "error": f"{path} {where}"}
            continue
        text, error = check_record(raw, fmt)
        yield {"text": text, "error": f"{path} {where} {error}" if error else None}


def raw_records(path: str) -> Iterator[tuple[object, str]]:
    """(record, "line N") of a file, or (None, "line N <why it cannot be read>"); "row N" for
    Parquet, Arrow and saved folders, "element N" for a JSON file holding one array. Raises
    UserError for a file of an unknown type."""
    suffix = "".join(Path(path).suffixes[-2:]) if path.endswith(".gz") else Path(path).suffix
    if Path(path).is_dir():
        rows = load_from_disk(path)
        if not hasattr(rows, "to_iterable_dataset"):
            raise UserError(f"{path} is a save_to_disk folder of several splits; name one split")
        yield from ((row, f"row {n}") for n, row in enumerate(rows.to_iterable_dataset()))
    elif suffix in TABLE_BUILDERS:
        builder = TABLE_BUILDERS[suffix]
        rows = load_dataset(builder, data_files=[path], split="train", streaming=True)
        yield from ((row, f"row {n}") for n, row in enumerate(rows))
    elif suffix in JSON_SUFFIXES or path.endswith(".gz"):
        yield from _json_array(path) if _holds_array(path) else _json_lines(path)
    else:
        raise UserError(
            f"{path} is not a .json, .jsonl, .json.gz, .parquet or .arrow file or a "
            "save_to_disk folder; convert it to one of these"
        )


def _holds_array(path: str) -> bool:
    """Whether a JSON file's first character that is not white space is ``[`` (one JSON array
    of records rather than JSON lines); False for a file that cannot be read (``_json_lines``
    then names the damage)."""
    opener = gzip.open if path.endswith(".gz") else open
    try:
        with opener(path, "rb") as handle:
            while chunk := handle.read(4096):
                if stripped := chunk.lstrip():
                    return stripped.startswith(b"[")
    except (OSError, EOFError, zlib.error):
        return False
    return False


def _json_array(path: str) -> Iterator[tuple[object, str]]:
    """The elements of a file holding one JSON array, parsed whole by ``json.load`` and then
    checked element by element as JSON lines are (``datasets``' json builder is not used: it
    turns a field whose type changes between elements into JSON text in every element, so
    ``" A0"`` would train as ``"\\" A0\\""``). An array that cannot be parsed is one damaged
    record, like a damaged gzip stream; a file of several values (JSON lines whose first line is
    an array) is read as JSON lines."""
    opener = gzip.open if path.endswith(".gz") else open
    try:
        with opener(path, "rb") as handle:
            elements = json.load(handle)
    except (OSError, EOFError, zlib.error, UnicodeDecodeError, json.JSONDecodeError) as exc:
        if isinstance(exc, json.JSONDecodeError) and exc.msg == "Extra data":
            yield from _json_lines(path)  # a whole value, then more: JSON lines of arrays
            return
        why = f"is one JSON array that cannot be read ({exc})"
        yield None, f"{why}; repair it or convert it to JSON lines"
        return
    yield from ((element, f"element {number}") for number, element in enumerate(elements))


def _json_lines(path: str) -> Iterator[tuple[object, str]]:
    opener = gzip.open if path.endswith(".gz") else open
    number = 0
    try:
        with opener(path, "rb") as handle:
            for number, line in enumerate(handle, start=1):
                if line.strip():
                    yield _parse_line(line, number)
    except (OSError, EOFError, zlib.error) as exc:
        yield None, f"line {number + 1} cannot be read ({exc}), nor the rest of the file"


def _parse_line(line: bytes, number: int) -> tuple[object, str]:
    try:
        return json.loads(line.decode("utf-8")), f"line {number}"
    except UnicodeDecodeError as exc:
        return None, f"line {number} cannot be read as UTF-8 ({exc})"
    except json.JSONDecodeError as exc:
        return None, f"line {number} is not JSON ({exc})"
