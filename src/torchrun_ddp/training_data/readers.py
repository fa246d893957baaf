"""Local data files read one record at a time: JSON lines line by line, a file holding one JSON
array element by element, Parquet files and ``save_to_disk`` folders row by row through
``datasets``, Arrow files batch by batch through ``pyarrow.ipc`` (``raw_records``; a table that
cannot be read is a damaged record, not a traceback); each record checked against its example format
(``formats.check_record``) into ``{"text", "error"}`` (``RECORD_FEATURES``), a damaged one named
by file and line or row (``file_records``); several files in order, with a deterministic slice of
each held out (``read_records``, ``is_heldout``). Imports ``formats`` and ``errors``.
"""

from __future__ import annotations

import gzip
import json
import zlib
from collections.abc import Callable, Iterable, Iterator
from functools import partial
from pathlib import Path

import pyarrow
import pyarrow.ipc
import pyarrow.parquet
from datasets import Features, Value, load_dataset, load_from_disk

from torchrun_ddp.errors import UserError, first_line
from torchrun_ddp.training_data.formats import ExampleFormat, check_record

TABLE_BUILDERS = {".parquet": "parquet", ".arrow": "arrow"}
"""File suffixes read as tables, row by row (``_builder_rows``)."""


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
    Parquet, Arrow and saved folders, "element N" for a JSON file holding one array. A table or
    folder that cannot be read (not Parquet, a truncated Arrow file, a folder that is no
    ``save_to_disk`` output), or stops being readable at a row, is one such damaged record that
    ends the file, as a damaged gzip stream is. Raises UserError for a file of an unknown type
    and for a saved folder of several splits."""
    suffix = "".join(Path(path).suffixes[-2:]) if path.endswith(".gz") else Path(path).suffix
    if Path(path).is_dir():
        yield from _table_rows(path, "a save_to_disk folder", partial(_saved_rows, path))
    elif suffix in TABLE_BUILDERS:
        builder = TABLE_BUILDERS[suffix]
        yield from _table_rows(path, f"{builder.title()}", partial(_builder_rows, path, builder))
    elif suffix in JSON_SUFFIXES or path.endswith(".gz"):
        yield from _json_array(path) if _holds_array(path) else _json_lines(path)
    else:
        raise UserError(
            f"{path} is not a .json, .jsonl, .json.gz, .parquet or .arrow file or a "
            "save_to_disk folder; convert it to one of these"
        )


UNREADABLE = (OSError, json.JSONDecodeError, pyarrow.ArrowException)
"""What ``datasets`` and ``pyarrow`` raise for a table or folder that is not what it seems: a
file that is not Parquet or Arrow (``ArrowInvalid``), a truncated or corrupt one (``OSError``),
a folder without (or with a damaged) ``dataset_info.json`` or ``state.json``."""


def _table_rows(
    path: str, kind: str, rows: Callable[[], Iterable[object]]
) -> Iterator[tuple[object, str]]:
    """(row, "row N") of ``rows()``, then one damaged record where it fails (``UNREADABLE``)."""
    count = 0
    try:
        for row in rows():
            yield row, f"row {count}"
            count += 1
    except UNREADABLE as exc:
        why = f"{type(exc).__name__}: {first_line(exc)}"
        if count == 0:
            yield None, f"cannot be read as {kind} ({why})"
        else:
            yield None, f"row {count} cannot be read ({why}), nor the rest of the file"


def _saved_rows(path: str) -> Iterable[object]:
    rows = load_from_disk(path)
    if not hasattr(rows, "to_iterable_dataset"):
        raise UserError(f"{path} is a save_to_disk folder of several splits; name one split")
    return rows.to_iterable_dataset()


def _builder_rows(path: str, builder: str) -> Iterable[object]:
    """The rows of a Parquet file through ``datasets``' packaged builder, streamed, its footer
    read first (``pyarrow.parquet.read_metadata``), so that a file that is not Parquet fails
    here, before the builder logs its own error line; an Arrow file's through ``_arrow_rows``."""
    if builder == "arrow":
        return _arrow_rows(path)
    pyarrow.parquet.read_metadata(path)
    return load_dataset(builder, data_files=[path], split="train", streaming=True)


def _arrow_rows(path: str) -> Iterator[dict[str, object]]:
    """The rows of an Arrow IPC file, batch by batch (``pyarrow.ipc``): the stream format that
    ``save_to_disk`` writes, else the random-access file format, as ``datasets``' arrow builder
    reads them (not through it: it logs an error line of its own for a damaged batch)."""
    with pyarrow.OSFile(path) as source:
        try:
            stream = pyarrow.ipc.open_stream(source)
        except pyarrow.ArrowInvalid:
            source.seek(0)
            table = pyarrow.ipc.open_file(source)
            for index in range(table.num_record_batches):
                yield from table.get_batch(index).to_pylist()
            return
        for batch in stream:
            yield from batch.to_pylist()


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
