"""Stream, order, tokenise and pack text or examples into full windows; train and eval loaders.

Formats (``formats``): ``text`` documents, ``prompt-completion`` pairs and chat ``messages``,
each record checked where it is read; examples are packed whole and kept apart with labels and
restarting positions (``packing``), ``text`` back to back unless ``--separate-documents``.

Documents come from ``datasets`` streaming (the hub's ``allenai/c4`` or local json/json.gz
files in C4's layout), are tokenised as ``BOS + tokens + EOS`` (without BOS for tokenizers that
have none, such as Qwen2's) and packed back to back into windows of exactly ``seq_length``
tokens, so no padding token is ever trained on. Local files are checked at start-up
(``files``) and read record by record (``readers``), the hub is streamed (``hub``), either
becomes one stream of documents (``documents``), and the tokenizer is loaded once per process
(``tokenizer``).

Training data (``build_train_loader``) follows one global document order that is a pure function
of the seed, the epoch and the position in the stream (``GlobalPackedWindows``): every rank reads
the whole stream, shuffles it in fixed blocks, and takes the positions dealt to it. Its state is
small and can be re-split among another number of ranks (``reshard_positions``), so a run can
continue at another world size with every document trained exactly once. Held-out data is split
per rank with ``datasets.distributed.split_dataset_by_node`` and packed by ``PackedWindows``.

Multiple-choice questions for evaluation (``multiple_choice``: ``query``/``choices``/``gold``
records) are read, checked and tokenised here too; their scoring is ``choice_scoring``'s.

Damaged records. Local files are read line by line (``read_records``), so a damaged record deep
inside a large shard (invalid JSON, bad UTF-8, no ``text``, a damaged gzip stream) becomes a
record that names the file and line instead of an exception from the JSON parser. The training
order skips it: it takes no position, the same on every rank and after every resume. Each
distinct damaged record is logged once (rank 0), kept in the data position (so the count
survives restarts) and counted in the metrics (``bad_records``); past ``--max-bad-records`` the
run stops with a ``DataError``. A damaged gzip stream loses the rest of its file: one record.
"""

from torchrun_ddp.training_data.documents import document_tokens, open_documents, shard_for_rank
from torchrun_ddp.training_data.files import (
    FULL_CHECK_BYTES,
    check_data_file,
    count_tokens,
    data_format,
    expand_patterns,
    first_record,
    resolve_files,
)
from torchrun_ddp.training_data.formats import (
    FORMATS,
    IGNORE_INDEX,
    ExampleFormat,
    check_record,
    check_tokenizer,
    example_tokens,
    load_chat_template,
)
from torchrun_ddp.training_data.global_order import (
    DATA_ORDER,
    UNSHUFFLED_BLOCK,
    DocumentBlocks,
    GlobalPackedWindows,
    fresh_position,
    reshard_positions,
    windows_per_rank,
)
from torchrun_ddp.training_data.heldout import PackedWindows, build_loader, eval_batches
from torchrun_ddp.training_data.hub import hub_format
from torchrun_ddp.training_data.loader import (
    TrainLoader,
    bad_record_count,
    build_train_loader,
    data_position,
    own_process_group,
)
from torchrun_ddp.training_data.multiple_choice import MultipleChoiceQuestion, read_questions
from torchrun_ddp.training_data.packing import Packer
from torchrun_ddp.training_data.readers import RECORD_FEATURES, read_records
from torchrun_ddp.training_data.tokenizer import TOKENIZER_FILES, is_local_path, load_tokenizer

__all__ = [
    "DATA_ORDER",
    "FORMATS",
    "FULL_CHECK_BYTES",
    "IGNORE_INDEX",
    "RECORD_FEATURES",
    "TOKENIZER_FILES",
    "UNSHUFFLED_BLOCK",
    "DocumentBlocks",
    "ExampleFormat",
    "GlobalPackedWindows",
    "MultipleChoiceQuestion",
    "PackedWindows",
    "Packer",
    "TrainLoader",
    "bad_record_count",
    "build_loader",
    "build_train_loader",
    "check_data_file",
    "check_record",
    "check_tokenizer",
    "count_tokens",
    "data_format",
    "data_position",
    "document_tokens",
    "eval_batches",
    "example_tokens",
    "expand_patterns",
    "first_record",
    "fresh_position",
    "hub_format",
    "is_local_path",
    "load_chat_template",
    "load_tokenizer",
    "open_documents",
    "own_process_group",
    "read_questions",
    "read_records",
    "reshard_positions",
    "resolve_files",
    "shard_for_rank",
    "windows_per_rank",
]
