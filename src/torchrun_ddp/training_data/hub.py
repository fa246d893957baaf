"""Documents streamed from the Hugging Face hub: a split opened with ``datasets`` streaming (a
hub that cannot be reached refused in one line), its records as ``readers.RECORD_FEATURES``
(a ``text`` dataset keeps only that column, other formats are checked record by record), and an
``auto`` format detected from its first record. Imports ``readers``, ``formats`` and ``errors``.
"""

from __future__ import annotations

from dataclasses import replace

from datasets import IterableDataset, load_dataset

from torchrun_ddp.errors import UserError
from torchrun_ddp.training_data.formats import ExampleFormat, check_record, detect_format
from torchrun_ddp.training_data.readers import RECORD_FEATURES


def hub_documents(
    dataset: str, dataset_config: str, split: str, fmt: ExampleFormat
) -> IterableDataset:
    """A streaming dataset of the hub's ``split`` of ``dataset`` (``dataset_config``, or its
    default for ""), as ``{"text": str, "error": str | None}`` records.

    A ``text`` dataset keeps only that column (C4's ``timestamp`` is inferred as a datetime, which
    the default collation cannot batch); other formats are checked record by record
    (``formats.check_record``). Raises UserError when the hub cannot be reached or the data has
    no field of the format.
    """
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
    return replace(fmt, name=detect_format(dict(first), fmt.text_field, f"--dataset {dataset}"))


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
