"""Multiple-choice questions for evaluation: ``{"query": str, "choices": [str, ...], "gold":
int}`` records (the layout of the bundled ``data/sft/*.multiple_choice.jsonl.gz``: OLMES' "rc"
form), read from one file of any type ``documents`` reads, checked, and tokenised the way
lm-evaluation-harness builds its log-likelihood requests: each choice is the continuation
``" " + choice`` of the query, tokenised together with it, and its tokens are those past the
query's own tokens.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from torchrun_ddp.errors import UserError
from torchrun_ddp.training_data.documents import raw_records

TARGET_DELIMITER = " "
"""Put between the query and each choice (lm-evaluation-harness' ``target_delimiter``)."""

FIX = "each record needs 'query' (a string), 'choices' (two or more strings) and 'gold' (an index)"


@dataclass(frozen=True)
class MultipleChoiceQuestion:
    """One question, tokenised.

    ``context``: token ids of the query (BOS first where the tokenizer has one). ``choices``:
    each choice's token ids after the context (never empty). ``chars``: each choice's length in
    characters (without the delimiter: lm-evaluation-harness' ``acc_norm`` length). ``gold``:
    the index of the right choice.
    """

    context: list[int]
    choices: list[list[int]]
    chars: list[int]
    gold: int


def read_questions(
    path: str, tokenizer: PreTrainedTokenizerBase | None
) -> list[MultipleChoiceQuestion]:
    """Every question of ``path`` (JSON lines, .json.gz, Parquet, Arrow or a ``save_to_disk``
    folder), in file order, tokenised; with no ``tokenizer`` (``--dry-run`` of a hub tokenizer,
    which is not downloaded) every record is checked all the same and [] returned.

    Raises UserError in one line, naming the file and line (or row), for a record that cannot
    be read or lacks a query, two or more non-empty choices or a gold index among them, for a
    choice that gives no token after the query, and for a file with no question."""
    questions = []
    found = 0
    for record, where in raw_records(path):
        if record is None:
            raise UserError(f"--eval-multiple-choice {path} {where}; repair or replace the file")
        query, choices, gold = _checked(record, f"--eval-multiple-choice {path} {where}")
        found += 1
        if tokenizer is not None:
            questions.append(_tokenised(tokenizer, query, choices, gold, f"{path} {where}"))
    if not found:
        raise UserError(f"--eval-multiple-choice {path} holds no questions; {FIX}")
    return questions


def _checked(record: object, where: str) -> tuple[str, list[str], int]:
    """(query, choices, gold) of a raw record; raises UserError naming ``where``."""
    fields = record if isinstance(record, Mapping) else {}
    query, choices, gold = fields.get("query"), fields.get("choices"), fields.get("gold")
    if not isinstance(query, str) or not query:
        raise UserError(f"{where} has no 'query' string; {FIX}")
    if not isinstance(choices, list) or len(choices) < 2:
        raise UserError(f"{where} has no list of two or more 'choices'; {FIX}")
    if not all(isinstance(choice, str) and choice for choice in choices):
        raise UserError(f"{where} has a choice that is not a non-empty string; {FIX}")
    if isinstance(gold, bool) or not isinstance(gold, int) or not 0 <= gold < len(choices):
        raise UserError(
            f"{where} has 'gold' {gold!r}, not an index from 0 to {len(choices) - 1}; {FIX}"
        )
    return query, choices, gold


def _tokenised(
    tokenizer: PreTrainedTokenizerBase, query: str, choices: list[str], gold: int, where: str
) -> MultipleChoiceQuestion:
    """The question's context and each choice's tokens: ``tokens(query + " " + choice)`` past
    the ``len(tokens(query))`` first (lm-evaluation-harness' ``_encode_pair``)."""
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    context = tokenizer(query, add_special_tokens=False)["input_ids"]
    continuations = []
    for index, choice in enumerate(choices):
        whole = tokenizer(query + TARGET_DELIMITER + choice, add_special_tokens=False)
        continuation = list(whole["input_ids"][len(context) :])
        if not continuation:
            raise UserError(
                f"--eval-multiple-choice {where}: choice {index} gives no token after the "
                "query; check the record's query and choices"
            )
        continuations.append(continuation)
    return MultipleChoiceQuestion(
        context=bos + list(context),
        choices=continuations,
        chars=[len(choice) for choice in choices],
        gold=gold,
    )
