"""The documents a run reads: one streaming dataset of ``{"text", "error"}`` records from local
files (``readers.read_records``: every file's held-out slice, or the rest) or from the hub
(``hub.hub_documents``), a rank's share of it, and one document's tokens. Imports ``readers``,
``hub``, ``formats`` and ``errors``; ``raw_records`` stays importable from here for
``multiple_choice``.
"""

from __future__ import annotations

from datasets import IterableDataset
from datasets.distributed import split_dataset_by_node
from transformers import PreTrainedTokenizerBase

from torchrun_ddp.errors import UserError
from torchrun_ddp.training_data.formats import ExampleFormat, text_tokens
from torchrun_ddp.training_data.hub import hub_documents
from torchrun_ddp.training_data.readers import RECORD_FEATURES, raw_records, read_records

__all__ = ["document_tokens", "open_documents", "raw_records", "shard_for_rank"]


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
    held-out slice if ``heldout``, else the rest); the hub's through ``hub.hub_documents``.
    Raises UserError when the hub cannot be reached or the data has no field of the format.
    """
    fmt = fmt or ExampleFormat()
    if files:
        return IterableDataset.from_generator(
            read_records,
            features=RECORD_FEATURES,
            gen_kwargs={"files": files, "fmt": fmt, "heldout_fraction": heldout_fraction,
                        "heldout": heldout},
        )  # fmt: skip
    return hub_documents(dataset, dataset_config, split, fmt)


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
