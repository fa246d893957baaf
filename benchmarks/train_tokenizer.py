"""Build the 4,096-token byte-level BPE tokenizer of ``configs/llama-8m/`` from the training
documents of ``../shared/data`` with the ``tokenizers`` library, and save it next to the model's
config.json (``save_pretrained``: tokenizer.json, tokenizer_config.json, special_tokens_map.json).

    uv run python benchmarks/train_tokenizer.py --data-dir ../shared/data --out configs/llama-8m

The special tokens are ``<unk>`` (0), ``<s>`` (1, BOS) and ``</s>`` (2, EOS), the ids LLaMA's
config names. Training is deterministic: the same documents give the same files. Prints the
tokens per document and per epoch of the training and held-out files as a Markdown table.
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
from collections.abc import Iterator
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

VOCAB_SIZE = 4096
SPECIAL = ("<unk>", "<s>", "</s>")
TRAIN = "c4/c4-train.00000-of-01024.first1000.json.gz"
HELD_OUT = "c4/c4-validation.olmo-sample.1000.json.gz"


def texts(path: Path) -> Iterator[str]:
    """The ``text`` of every JSON line of a gzip file, in order."""
    with gzip.open(path, "rt", encoding="utf-8") as handle:
        for line in handle:
            if line.strip():
                yield json.loads(line)["text"]


def train_tokenizer(documents: list[str], vocab_size: int = VOCAB_SIZE) -> PreTrainedTokenizerFast:
    """A byte-level BPE of ``vocab_size`` tokens trained on ``documents``, wrapped for
    transformers with ``<s>`` as BOS and ``</s>`` as EOS (``document_tokens`` adds them)."""
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(documents, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )


def token_table(tokenizer: PreTrainedTokenizerFast, data_dir: Path) -> str:
    """Tokens per document (BOS and EOS included) and per epoch of both files, Markdown."""
    lines = [
        "| file | documents | tokens per epoch | tokens per document (median) | characters "
        "per token |",
        "|---|---:|---:|---:|---:|",
    ]
    for name in (TRAIN, HELD_OUT):
        docs = list(texts(data_dir / name))
        counts = [len(tokenizer(doc, add_special_tokens=False)["input_ids"]) + 2 for doc in docs]
        chars = sum(len(doc) for doc in docs)
        lines.append(
            f"| {name} | {len(docs):,} | {sum(counts):,} | {statistics.median(counts):.0f} | "
            f"{chars / sum(counts):.2f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", type=Path, default=Path("../shared/data"))
    parser.add_argument("--out", type=Path, default=Path("configs/llama-8m"))
    args = parser.parse_args()
    tokenizer = train_tokenizer(list(texts(args.data_dir / TRAIN)))
    tokenizer.save_pretrained(args.out)
    print(token_table(tokenizer, args.data_dir))


if __name__ == "__main__":
    main()
