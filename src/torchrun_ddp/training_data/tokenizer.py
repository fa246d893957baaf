"""The tokenizer: from a hub id or a local folder (checked first, a missing or empty folder
refused in one line), loaded once per process for the same id or the same folder's files.
Imports ``errors``.
"""

from __future__ import annotations

import functools
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from torchrun_ddp.errors import UserError

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
