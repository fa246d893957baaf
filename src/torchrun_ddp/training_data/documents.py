"""Where documents come from: local files (checked at start-up; JSON lines read line by line,
Parquet, Arrow and ``save_to_disk`` folders row by row through ``datasets``' own builders, with
damaged records named by file and line or row) or the hub, the tokenizer, and one document's
tokens. Each record is checked against its example format (``formats.check_record``) where it is
read, and a deterministic slice of every file can be held out (``--eval-fraction``).
"""

from __future__ import annotations

import functools
import glob
import gzip
import json
import logging
import zlib
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

from datasets import Features, IterableDataset, Value, load_dataset, load_from_disk
from datasets.distributed import split_dataset_by_node
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from torchrun_ddp.errors import UserError
from torchrun_ddp.training_data.formats import (
    ExampleFormat,
    check_record,
    detect_format,
    example_tokens,
    text_tokens,
)

log = logging.getLogger("torchrun_ddp")


def resolve_files(
    patterns: list[str],
    flag: str,
    max_bad_records: int = 0,
    fmt: ExampleFormat | None = None,
) -> list[str]:
    """Expand globs into a sorted list of files (or ``save_to_disk`` folders), each checked by
    ``check_data_file`` against ``fmt`` (default: ``text``); raises UserError if a pattern
    matches nothing, a file has no readable record or is of an unknown type, or the damaged
    records found exceed ``max_bad_records`` (fewer are logged as a warning and skipped in
    training)."""
    files = expand_patterns(patterns, flag)
    fmt = fmt or ExampleFormat()
    damaged = [error for file in files for error in check_data_file(file, flag, fmt)]
    if len(damaged) > max_bad_records:
        raise UserError(
            f"{flag} {damaged[0]}; {len(damaged)} damaged records in all, more than "
            f"--max-bad-records {max_bad_records}: repair the file or raise --max-bad-records"
        )
    if damaged:
        log.warning(
            "%s: %d damaged records will be skipped, the first: %s", flag, len(damaged), damaged[0]
        )
    return files


def expand_patterns(patterns: list[str], flag: str) -> list[str]:
    """Globs expanded into sorted paths, in pattern order; raises UserError for a pattern that
    matches nothing."""
    files: list[str] = []
    for pattern in patterns:
        matched = sorted(glob.glob(pattern)) or ([pattern] if Path(pattern).exists() else [])
        if not matched:
            raise UserError(f"{flag} {pattern} matches no file; check the path or the glob")
        files.extend(matched)
    return files


FULL_CHECK_BYTES = 64 * 2**20
"""Files up to this size (64 MiB on disk) are read to the end by ``check_data_file``; larger
ones only to their first record, so a run over many large shards starts quickly (a damaged
record further in is skipped when training reaches it: see the module docstring)."""


def check_data_file(path: str, flag: str, fmt: ExampleFormat | None = None) -> list[str]:
    """The damaged records of ``path`` (``read_records`` errors: file and line), read to the end
    for files up to ``FULL_CHECK_BYTES``, else up to the first good record.

    Raises UserError naming ``path`` if the file holds no readable record before that point (an
    empty file, a corrupt gzip stream, a file that is not JSON lines of objects with ``text``).
    """
    full = _size(path) <= FULL_CHECK_BYTES
    damaged: list[str] = []
    good = 0
    for record in _file_records(path, fmt or ExampleFormat()):
        if record["error"]:
            damaged.append(str(record["error"]))
            continue
        good += 1
        if not full:
            return damaged
    if good == 0:
        why = f"{damaged[0]}; replace the file" if damaged else f"{path} holds no records"
        raise UserError(f"{flag} {why}; records of the format given by --data-format are needed")
    return damaged


def _size(path: str) -> int:
    """Bytes on disk of a file, or of every file in a ``save_to_disk`` folder."""
    if Path(path).is_dir():
        return sum(file.stat().st_size for file in Path(path).rglob("*") if file.is_file())
    return Path(path).stat().st_size


TABLE_BUILDERS = {".parquet": "parquet", ".arrow": "arrow"}
"""File suffixes read through a ``datasets`` packaged builder, row by row."""

JSON_SUFFIXES = (".json", ".jsonl", ".json.gz", ".jsonl.gz")
"""File suffixes read as JSON lines, line by line."""


def first_record(files: list[str], flag: str) -> dict[str, object]:
    """The first readable raw record of ``files`` (to detect the format). Raises UserError if
    none of the first lines of any file is a JSON object, or a file is of an unknown type."""
    for path in files:
        for record in raw_records(path):
            if isinstance(record[0], dict):
                return record[0]
    raise UserError(f"{flag} holds no readable record; pass JSON lines, Parquet or Arrow files")


def data_format(fmt: ExampleFormat, record: dict[str, object], where: str) -> ExampleFormat:
    """``fmt`` with its name detected from ``record`` where it is ``auto``; raises UserError for
    a layout that fits no format (see ``formats.detect_format``)."""
    if fmt.name != "auto":
        return fmt
    return replace(fmt, name=detect_format(record, fmt.text_field, where))


def count_tokens(
    files: list[str],
    tokenizer: PreTrainedTokenizerBase,
    limit: int,
    fmt: ExampleFormat | None = None,
    heldout_fraction: float = 0.0,
) -> int | None:
    """Tokens the readable training records of local ``files`` give (``BOS + ids + EOS`` a
    document, ``formats.example_tokens``; the held-out slice left out), counted in stream order
    until ``limit`` is reached (padding kept-apart windows need comes on top).

    Returns None where counting is too costly: no local files (hub streaming) or a file larger
    than ``FULL_CHECK_BYTES`` (only its first record is checked at start-up). Damaged records
    are skipped, as training skips them. Documents are tokenised one at a time, so the
    tokenizer's thread pool stays unused before the loader worker is forked.
    """
    if not files or any(_size(file) > FULL_CHECK_BYTES for file in files):
        return None
    fmt = fmt or ExampleFormat()
    total = 0
    for record in read_records(files, fmt, heldout_fraction):
        if record["error"]:
            continue
        total += len(example_tokens(tokenizer, str(record["text"]), fmt)[0])
        if total >= limit:
            break
    return total


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")
"""A local tokenizer folder holds at least one of these (what AutoTokenizer loads from)."""


def is_local_path(name: str) -> bool:
    """Whether a tokenizer or model ``name`` names a local path rather than a hub id: it starts
    with ``.``, ``/`` or ``~``, or exists here."""
    return name.startswith((".", "/", "~")) or Path(name).exists()


def load_tokenizer(name: str) -> PreTrainedTokenizerBase:
    """The tokenizer from a hub id or local folder; raises UserError if it cannot be loaded.

    Loaded once per process for the same hub id or, for a folder, the same resolved path and
    files (names, sizes and modification times): a process that trains several times (the
    tests, the benchmarks, a notebook) gets the same object back instead of parsing
    tokenizer.json again (0.2 s for a 32,000-token one, docs/benchmarks.md#test-suite). Callers
    do not modify it."""
    looks_local = is_local_path(name)
    if looks_local and not Path(name).expanduser().is_dir():
        raise UserError(f"tokenizer folder {name} does not exist; pass an existing --tokenizer")
    if looks_local and not any((Path(name).expanduser() / f).is_file() for f in TOKENIZER_FILES):
        raise UserError(
            f"tokenizer folder {name} has none of {', '.join(TOKENIZER_FILES)}; pass a folder "
            "saved by save_pretrained as --tokenizer"
        )
    try:
        if not looks_local:
            return _cached_tokenizer(name, ())
        folder = Path(name).expanduser().resolve()
        return _cached_tokenizer(str(folder), _folder_stamp(folder))
    except OSError as exc:
        raise UserError(f"cannot load tokenizer {name}: {str(exc).splitlines()[0]}") from exc


def _folder_stamp(folder: Path) -> tuple[tuple[str, int, int], ...]:
    """(file name, size in bytes, modification time in ns) of every file in ``folder``."""
    files = sorted(p for p in folder.iterdir() if p.is_file())
    return tuple((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files)


@functools.lru_cache(maxsize=4)
def _cached_tokenizer(
    name: str, stamp: tuple[tuple[str, int, int], ...]
) -> PreTrainedTokenizerBase:
    """``AutoTokenizer.from_pretrained(name)``, kept per ``(name, stamp)``."""
    del stamp  # part of the cache key only
    return AutoTokenizer.from_pretrained(name)


def open_documents(
    files: list[str],
    dataset: str,
    dataset_config: str,
    split: str,
    fmt: ExampleFormat | None = None,
    heldout_fraction: float = 0.0,
    heldout: bool = False,
) -> IterableDataset:
    """A streaming dataset of ``{"text": str, "error": str | None}`` records (``text``: the
    example as ``formats.check_record`` keeps it), from local files or the hub's ``split``.

    Local files go through ``read_records`` (one shard per file; damaged records come as
    ``{"text": None, "error": "<file> line <n>: ..."}``; ``heldout_fraction`` > 0: every file's
    held-out slice if ``heldout``, else the rest). From the hub a ``text`` dataset keeps only
    that column (C4's ``timestamp`` is inferred as a datetime, which the default collation cannot
    batch); other formats are checked record by record. Raises UserError when the hub cannot be
    reached or the data has no field of the format.
    """
    fmt = fmt or ExampleFormat()
    if files:
        return IterableDataset.from_generator(
            read_records,
            features=RECORD_FEATURES,
            gen_kwargs={"files": files, "fmt": fmt, "heldout_fraction": heldout_fraction,
                        "heldout": heldout},
        )  # fmt: skip
    stream = _hub_stream(dataset, dataset_config, split)
    if fmt.name == "text" and fmt.text_field == "text":
        try:
            return stream.select_columns(["text"])
        except ValueError as exc:
            raise UserError(
                f"the data has no 'text' field ({exc}); name it with --text-field"
            ) from exc
    return stream.map(
        _checked, fn_kwargs={"fmt": fmt}, remove_columns=list(stream.column_names or [])
    ).cast(RECORD_FEATURES)


def hub_format(fmt: ExampleFormat, dataset: str, dataset_config: str, split: str) -> ExampleFormat:
    """``fmt`` with an ``auto`` name detected from the first record of the hub's ``split``."""
    if fmt.name != "auto":
        return fmt
    first = next(iter(_hub_stream(dataset, dataset_config, split)), None)
    if first is None:
        raise UserError(f"--dataset {dataset} split {split} is empty; pass another --dataset")
    return data_format(fmt, dict(first), f"--dataset {dataset}")


def _hub_stream(dataset: str, dataset_config: str, split: str) -> IterableDataset:
    try:
        return load_dataset(dataset, dataset_config or None, split=split, streaming=True)
    except ConnectionError as exc:
        raise UserError(
            f"cannot reach the Hugging Face hub to stream {dataset}; pass local files "
            "with --data-files (and --eval-files or --eval-fraction)"
        ) from exc


def _checked(record: dict[str, object], fmt: ExampleFormat) -> dict[str, str | None]:
    text, error = check_record(record, fmt)
    return {"text": text, "error": f"a hub record {error}" if error else None}


RECORD_FEATURES = Features({"text": Value("string"), "error": Value("string")})
"""Columns of ``read_records``: the example (``formats.check_record``), or None and what is
wrong with the record."""


def read_records(
    files: list[str],
    fmt: ExampleFormat | None = None,
    heldout_fraction: float = 0.0,
    heldout: bool = False,
) -> Iterator[dict[str, str | None]]:
    """The records of ``files``, in order, as ``{"text", "error"}`` (see ``open_documents``).

    JSON lines (``.json``, ``.jsonl``, ``.gz``) are read line by line: a line that is not UTF-8,
    not a JSON object or not a record of ``fmt`` (default ``text``) yields ``text`` None and an
    ``error`` naming the file and line; a damaged or truncated gzip stream yields one such record
    and ends that file; blank lines are skipped. Parquet, Arrow and ``save_to_disk`` folders are
    read by ``datasets``, their errors naming the file and row. Record ``i`` of a file (from 0)
    is held out when ``floor((i + 1) f) > floor(i f)`` for ``f = heldout_fraction``: an even,
    deterministic slice of ``f`` of each file; ``heldout`` picks that slice, else the rest.
    """
    for path in files:
        for index, record in enumerate(_file_records(path, fmt or ExampleFormat())):
            if is_heldout(index, heldout_fraction) == heldout:
                yield record


def is_heldout(index: int, fraction: float) -> bool:
    """Whether record ``index`` of a file is in the held-out slice of ``fraction`` (0 to 1)."""
    return int((index + 1) * fraction) > int(index * fraction)


def _file_records(path: str, fmt: ExampleFormat) -> Iterator[dict[str, str | None]]:
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


def shard_for_rank(documents: IterableDataset, rank: int, world_size: int) -> IterableDataset:
    """This rank's disjoint share of ``documents``, in stream order.

    ``split_dataset_by_node`` gives whole files to ranks when the file count divides by the
    world size, and otherwise every world_size-th document of the stream.
    """
    return split_dataset_by_node(documents, rank=rank, world_size=world_size)


def document_tokens(tokenizer: PreTrainedTokenizerBase, text: str | None) -> list[int]:
    """``[BOS] + ids + [EOS]`` of one document (``formats.text_tokens``); ``[]`` for a blank
    document. Raises UserError for a record without text."""
    if text is None:
        raise UserError("a data record has no 'text' field; every JSON line needs one")
    return text_tokens(tokenizer, text)
