"""Local data files checked at start-up: globs expanded (``expand_patterns``), each file read
for damaged records (to the end up to ``FULL_CHECK_BYTES``, else to its first good record; a
damaged record further in is skipped when training reaches it, as the package docstring says)
against ``--max-bad-records`` (``resolve_files``), the first record for an ``auto`` format
(``first_record``, ``data_format``), and the tokens the files give (``count_tokens``). Imports
``readers``, ``formats`` and ``errors``.
"""

from __future__ import annotations

import glob
import logging
from dataclasses import replace
from pathlib import Path

from transformers import PreTrainedTokenizerBase

from torchrun_ddp.errors import UserError
from torchrun_ddp.training_data.formats import ExampleFormat, detect_format, example_tokens
from torchrun_ddp.training_data.readers import file_records, raw_records, read_records

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
    for files up to ``FULL_CHECK_BYTES``, else up to the first good record. An ``auto`` format
    is the file's own, detected from its first record.

    Raises UserError naming ``path`` (and the line or row) if the file holds no readable record
    of ``fmt`` before that point: an empty file, a corrupt gzip stream, Parquet or Arrow file,
    a file of another format (named, with the ``--data-format`` that reads it), a layout of no
    format, or records that are all damaged (the first one's reason)."""
    fmt = fmt or ExampleFormat()
    if fmt.name == "auto":
        fmt = data_format(fmt, *first_record([path], flag))
    full = _size(path) <= FULL_CHECK_BYTES
    damaged: list[str] = []
    good = 0
    for record in file_records(path, fmt):
        if record["error"]:
            damaged.append(str(record["error"]))
            continue
        good += 1
        if not full:
            return damaged
    if good == 0:
        raise UserError(_no_good_record(path, flag, fmt, damaged))
    return damaged


def _no_good_record(path: str, flag: str, fmt: ExampleFormat, damaged: list[str]) -> str:
    """Why ``path`` holds no record of ``fmt``, in one line with the fix."""
    if not damaged:
        return f"{flag} {path} holds no records; pass a file of {fmt.name} records"
    first = next(((r, w) for r, w in raw_records(path) if isinstance(r, dict)), None)
    if first is not None:
        record, where = first
        found = detect_format(record, fmt.text_field, f"{flag} {path} {where}")
        if found != fmt.name and fmt.detected_from:
            return (
                f"{flag} {path} holds {found} records, but --data-format auto took {fmt.name} "
                f"from {fmt.detected_from}; pass files of one format"
            )
        if found != fmt.name:
            return (
                f"{flag} {path} holds {found} records, not {fmt.name}: pass --data-format "
                f"{found} or auto"
            )
    return f"{flag} {damaged[0]}; no record of the file can be read as {fmt.name}: repair it"


def _size(path: str) -> int:
    """Bytes on disk of a file, or of every file in a ``save_to_disk`` folder."""
    if Path(path).is_dir():
        return sum(file.stat().st_size for file in Path(path).rglob("*") if file.is_file())
    return Path(path).stat().st_size


def first_record(files: list[str], flag: str) -> tuple[dict[str, object], str]:
    """The first readable raw record of ``files`` (to detect the format), with where it is
    (``"<flag> <file> line N"``). Raises UserError naming the first file, the line or row and
    why it cannot be read (with the fix) if no file holds a JSON object, or for a file of an
    unknown type."""
    problem = ""
    for path in files:
        for record, where in raw_records(path):
            if isinstance(record, dict):
                return record, f"{flag} {path} {where}"
            problem = problem or _unreadable(path, where, record)
    problem = problem or (
        f"{files[0]} holds no records; pass JSON lines, Parquet or Arrow files (or save_to_disk "
        "folders) of records"
    )
    others = f" (nor does any of the other {len(files) - 1})" if len(files) > 1 else ""
    raise UserError(f"{flag} {problem}{others}")


def _unreadable(path: str, where: str, record: object) -> str:
    """Why a raw record that is not a JSON object cannot be detected, with the fix."""
    if record is None:  # ``where`` says what is damaged
        return f"{path} {where}; repair or replace the file"
    return (
        f"{path} {where} is not a JSON object; pass records of named fields (JSON lines of "
        "objects, Parquet or Arrow tables)"
    )


def data_format(fmt: ExampleFormat, record: dict[str, object], where: str) -> ExampleFormat:
    """``fmt`` with its name detected from ``record`` (found at ``where``, which the result
    keeps as ``detected_from``) where it is ``auto``; raises UserError naming ``where`` for a
    layout that fits no format (see ``formats.detect_format``)."""
    if fmt.name != "auto":
        return fmt
    name = detect_format(record, fmt.text_field, where)
    return replace(fmt, name=name, detected_from=where)


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
