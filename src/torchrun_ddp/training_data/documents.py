"""Where documents come from: local JSON-lines files (checked at start-up, read line by line
with damaged records named by file and line) or the hub, the tokenizer, and one document's tokens.
"""

from __future__ import annotations

import glob
import gzip
import json
import logging
import zlib
from collections.abc import Iterator
from pathlib import Path

from datasets import Features, IterableDataset, Value, load_dataset
from datasets.distributed import split_dataset_by_node
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from torchrun_ddp.errors import UserError

log = logging.getLogger("torchrun_ddp")


def resolve_files(patterns: list[str], flag: str, max_bad_records: int = 0) -> list[str]:
    """Expand globs into a sorted list of files, each checked by ``check_data_file``; raises
    UserError if a pattern matches nothing, a file has no readable record, or the damaged records
    found exceed ``max_bad_records`` (fewer are logged as a warning and skipped in training)."""
    files: list[str] = []
    for pattern in patterns:
        matched = sorted(glob.glob(pattern)) or ([pattern] if Path(pattern).is_file() else [])
        if not matched:
            raise UserError(f"{flag} {pattern} matches no file; check the path or the glob")
        files.extend(matched)
    damaged = [error for file in files for error in check_data_file(file, flag)]
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


FULL_CHECK_BYTES = 64 * 2**20
"""Files up to this size (64 MiB on disk) are read to the end by ``check_data_file``; larger
ones only to their first record, so a run over many large shards starts quickly (a damaged
record further in is skipped when training reaches it: see the module docstring)."""


def check_data_file(path: str, flag: str) -> list[str]:
    """The damaged records of ``path`` (``read_records`` errors: file and line), read to the end
    for files up to ``FULL_CHECK_BYTES``, else up to the first good record.

    Raises UserError naming ``path`` if the file holds no readable record before that point (an
    empty file, a corrupt gzip stream, a file that is not JSON lines of objects with ``text``).
    """
    full = Path(path).stat().st_size <= FULL_CHECK_BYTES
    damaged: list[str] = []
    good = 0
    for record in _file_records(path):
        if record["error"]:
            damaged.append(str(record["error"]))
            continue
        good += 1
        if not full:
            return damaged
    if good == 0:
        why = f"{damaged[0]}; replace the file" if damaged else f"{path} holds no records"
        raise UserError(f"{flag} {why}; JSON lines with a 'text' string are needed")
    return damaged


def count_tokens(files: list[str], tokenizer: PreTrainedTokenizerBase, limit: int) -> int | None:
    """Tokens the readable records of local ``files`` give as training packs them (``BOS + ids +
    EOS`` a document, ``document_tokens``), counted in stream order until ``limit`` is reached.

    Returns None where counting is too costly: no local files (hub streaming) or a file larger
    than ``FULL_CHECK_BYTES`` (only its first record is checked at start-up). Damaged records
    are skipped, as training skips them. Documents are tokenised one at a time, so the
    tokenizer's thread pool stays unused before the loader worker is forked.
    """
    if not files or any(Path(file).stat().st_size > FULL_CHECK_BYTES for file in files):
        return None
    total = 0
    for record in read_records(files):
        if record["error"]:
            continue
        total += len(document_tokens(tokenizer, record["text"]))
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
    """The tokenizer from a hub id or local folder; raises UserError if it cannot be loaded."""
    looks_local = is_local_path(name)
    if looks_local and not Path(name).expanduser().is_dir():
        raise UserError(f"tokenizer folder {name} does not exist; pass an existing --tokenizer")
    if looks_local and not any((Path(name).expanduser() / f).is_file() for f in TOKENIZER_FILES):
        raise UserError(
            f"tokenizer folder {name} has none of {', '.join(TOKENIZER_FILES)}; pass a folder "
            "saved by save_pretrained as --tokenizer"
        )
    try:
        return AutoTokenizer.from_pretrained(name)
    except OSError as exc:
        raise UserError(f"cannot load tokenizer {name}: {str(exc).splitlines()[0]}") from exc


def open_documents(
    files: list[str], dataset: str, dataset_config: str, split: str
) -> IterableDataset:
    """A streaming dataset of ``{"text": str}`` records, from local files or the hub.

    Local files go through ``read_records`` (one shard per file; damaged records come as
    ``{"text": None, "error": "<file> line <n>: ..."}``). From the hub only the ``text`` column
    is kept (C4's ``timestamp`` is inferred as a datetime, which the default collation cannot
    batch). Raises UserError when the hub cannot be reached or has no ``text`` field.
    """
    if files:
        return IterableDataset.from_generator(
            read_records, features=RECORD_FEATURES, gen_kwargs={"files": files}
        )
    try:
        stream = load_dataset(dataset, dataset_config, split=split, streaming=True)
    except ConnectionError as exc:
        raise UserError(
            f"cannot reach the Hugging Face hub to stream {dataset}; pass local json.gz files "
            "with --data-files (and --eval-files)"
        ) from exc
    try:
        return stream.select_columns(["text"])
    except ValueError as exc:
        raise UserError(f"the data has no 'text' field ({exc}); use files in C4's layout") from exc


RECORD_FEATURES = Features({"text": Value("string"), "error": Value("string")})
"""Columns of ``read_records``: the document text, or None and what is wrong with the record."""


def read_records(files: list[str]) -> Iterator[dict[str, str | None]]:
    """The records of JSON-lines files (``.gz`` or plain), in order, as ``{"text", "error"}``.

    A line that is not UTF-8, not a JSON object or has no ``text`` string yields ``text`` None
    and an ``error`` naming the file and line; a damaged or truncated gzip stream yields one
    such record and ends that file. Blank lines are skipped. Never raises for bad content.
    """
    for path in files:
        yield from _file_records(path)


def _file_records(path: str) -> Iterator[dict[str, str | None]]:
    opener = gzip.open if path.endswith(".gz") else open
    number = 0
    try:
        with opener(path, "rb") as handle:
            for number, line in enumerate(handle, start=1):
                if line.strip():
                    yield _parse_record(line, path, number)
    except (OSError, EOFError, zlib.error) as exc:
        reason = f"cannot be read ({exc}), nor the rest of the file"
        yield {"text": None, "error": f"{path} line {number + 1} {reason}"}


def _parse_record(line: bytes, path: str, number: int) -> dict[str, str | None]:
    try:
        record = json.loads(line.decode("utf-8"))
    except UnicodeDecodeError as exc:
        return {"text": None, "error": f"{path} line {number} cannot be read as UTF-8 ({exc})"}
    except json.JSONDecodeError as exc:
        return {"text": None, "error": f"{path} line {number} is not JSON ({exc})"}
    if not isinstance(record, dict) or not isinstance(record.get("text"), str):
        return {"text": None, "error": f"{path} line {number} has no 'text' string"}
    return {"text": record["text"], "error": None}


def shard_for_rank(documents: IterableDataset, rank: int, world_size: int) -> IterableDataset:
    """This rank's disjoint share of ``documents``, in stream order.

    ``split_dataset_by_node`` gives whole files to ranks when the file count divides by the
    world size, and otherwise every world_size-th document of the stream.
    """
    return split_dataset_by_node(documents, rank=rank, world_size=world_size)


def document_tokens(tokenizer: PreTrainedTokenizerBase, text: str | None) -> list[int]:
    """``[BOS] + ids + [EOS]`` of one document (BOS or EOS left out where the tokenizer has
    none); ``[]`` for a blank document. Raises UserError for a record without text."""
    if text is None:
        raise UserError("a data record has no 'text' field; every JSON line needs one")
    if not text.strip():
        return []
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    return [*([bos] if bos is not None else []), *ids, *([eos] if eos is not None else [])]
