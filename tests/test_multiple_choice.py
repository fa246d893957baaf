"""Multiple-choice accuracy by log-likelihood: questions read and tokenised as
lm-evaluation-harness builds its requests, each choice's summed log-likelihood against a direct
per-choice computation, answers known in advance, the standard error, and one-line errors for a
bad question file. (The distributed count over 2 ranks is checked in tests/test_sft_resume.py,
against the exported model.)"""

from __future__ import annotations

import gzip
import json
import math
from pathlib import Path

import pytest
import torch
from tiny_models import tiny_llama_config
from transformers import LlamaForCausalLM, PreTrainedTokenizerBase
from transformers.modeling_outputs import CausalLMOutput

from torchrun_ddp.choice_scoring import accuracy_stderr, choice_loglikelihoods, picks
from torchrun_ddp.errors import UserError
from torchrun_ddp.evaluation import multiple_choice_record
from torchrun_ddp.training_data import load_tokenizer, read_questions

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def tokenizer(sample_data: Path) -> PreTrainedTokenizerBase:
    return load_tokenizer(str(sample_data / "tokenizer" / "mistral-7b-v0.1"))


def _write(path: Path, lines: list[str]) -> str:
    with gzip.open(path, "wt") as handle:
        handle.write("\n".join(lines) + "\n")
    return str(path)


class FixedNextToken(torch.nn.Module):
    """A causal-LM stand-in whose next-token distribution is ``probs`` at every position,
    whatever came before: a choice's log-likelihood is then known in closed form."""

    def __init__(self, probs: torch.Tensor) -> None:
        super().__init__()
        self.log_probs = probs.log()

    def forward(
        self, input_ids: torch.Tensor, use_cache: bool = False, logits_to_keep: int = 0
    ) -> CausalLMOutput:
        logits = self.log_probs.expand(*input_ids.shape, -1)
        return CausalLMOutput(logits=logits[:, -logits_to_keep:].clone())


def test_scores_sum_each_choice_tokens_log_probabilities() -> None:
    probs = torch.full((8,), 0.05)
    probs[5], probs[6] = 0.5, 0.2
    model = FixedNextToken(probs / probs.sum())
    p5, p6 = float(model.log_probs[5]), float(model.log_probs[6])
    scores = choice_loglikelihoods(model, [1, 3], [[5, 5, 5], [5], [6, 5]], 16, CPU)
    torch.testing.assert_close(scores, torch.tensor([3 * p5, p5, p6 + p5], dtype=torch.float64))
    # by the sum the single token wins; per character the long choice (30 characters) does
    assert picks(scores, [30, 1, 2]) == (1, 0)


def test_scores_match_a_direct_per_choice_computation(tokenizer: PreTrainedTokenizerBase,
                                                      tmp_path: Path) -> None:  # fmt: skip
    """Batched and right-padded choices against each choice run alone through the model's own
    loss with the context's labels -100 (sum = -loss x tokens), in fp32."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config(vocab_size=len(tokenizer))).eval()
    record = {
        "query": "Question: Which gas do plants take in?\nAnswer:",
        "choices": ["carbon dioxide", "oxygen", "water vapour from the air"],
        "gold": 0,
    }
    file = _write(tmp_path / "mc.jsonl.gz", [json.dumps(record)])
    (question,) = read_questions(file, tokenizer)
    assert question.context[0] == tokenizer.bos_token_id and question.gold == 0
    assert question.chars == [14, 6, 25]
    decoded = [tokenizer.decode(question.context[1:] + ids) for ids in question.choices]
    assert decoded == [record["query"] + " " + choice for choice in record["choices"]]
    with torch.no_grad():
        scores = choice_loglikelihoods(model, question.context, question.choices, 64, CPU)
        for index, choice in enumerate(question.choices):
            ids = torch.tensor([question.context + choice])
            labels = ids.clone()
            labels[0, : len(question.context)] = -100
            loss = model(input_ids=ids, labels=labels).loss
            assert float(scores[index]) == pytest.approx(-float(loss) * len(choice), abs=1e-4)
        # a context cut from the left to fit max_length: the same as the model on the cut rows
        cut = choice_loglikelihoods(model, question.context, question.choices, 12, CPU)
        row = (question.context + question.choices[2])[-13:]
        logits = model(input_ids=torch.tensor([row[:-1]])).logits.log_softmax(-1)[0]
        count = len(question.choices[2])
        want = sum(float(logits[12 - count + i, row[13 - count + i]]) for i in range(count))
        assert float(cut[2]) == pytest.approx(want, abs=1e-4)


class FavourTokens(torch.nn.Module):
    """A stand-in that gives the tokens ``favoured`` most of the probability at every position."""

    def __init__(self, vocab: int, favoured: list[int]) -> None:
        super().__init__()
        self.logits = torch.zeros(vocab)
        self.logits[favoured] = 10.0

    def forward(
        self, input_ids: torch.Tensor, use_cache: bool = False, logits_to_keep: int = 0
    ) -> CausalLMOutput:
        logits = self.logits.expand(*input_ids.shape, -1)
        return CausalLMOutput(logits=logits[:, -logits_to_keep:].clone())


def test_a_model_that_favours_the_gold_answers_scores_all_right(
    tokenizer: PreTrainedTokenizerBase, tmp_path: Path
) -> None:
    records = [
        {"query": "Question: What melts ice?\nAnswer:", "choices": ["heat", "cold"], "gold": 0},
        {"query": "Question: What do cows eat?\nAnswer:", "choices": ["rocks", "grass", "metal"],
         "gold": 1},
    ]  # fmt: skip
    file = _write(tmp_path / "mc.jsonl.gz", [json.dumps(record) for record in records])
    questions = read_questions(file, tokenizer)
    gold_tokens = [t for q in questions for t in q.choices[q.gold]]
    wrong_tokens = {t for q in questions for i, c in enumerate(q.choices) if i != q.gold for t in c}
    assert not wrong_tokens & set(gold_tokens)
    for favoured, expected in ((gold_tokens, [0, 1]), (sorted(wrong_tokens), None)):
        model = FavourTokens(len(tokenizer), favoured)
        for question, gold in zip(questions, expected or [None, None], strict=True):
            scores = choice_loglikelihoods(model, question.context, question.choices, 64, CPU)
            by_sum, _ = picks(scores, question.chars)
            assert by_sum == gold if gold is not None else by_sum != question.gold


def test_the_record_has_accuracies_and_binomial_standard_errors() -> None:
    record = multiple_choice_record([40.0, 28.0, 10.0])
    assert record["mc_questions"] == 40
    assert record["mc_accuracy"] == pytest.approx(0.7)
    assert record["mc_accuracy_per_char"] == pytest.approx(0.25)
    assert record["mc_accuracy_stderr"] == pytest.approx(math.sqrt(0.7 * 0.3 / 40))
    assert record["mc_accuracy_per_char_stderr"] == pytest.approx(math.sqrt(0.25 * 0.75 / 40))
    assert multiple_choice_record([0.0, 0.0, 0.0]) == {}
    assert accuracy_stderr(0.5, 570) == pytest.approx(0.02094, abs=1e-5)


GOOD = {"query": "Question: q?\nAnswer:", "choices": ["a", "b"], "gold": 1}


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", "line 2 is not JSON"),
        (json.dumps({**GOOD, "query": ""}), "line 2 has no 'query' string"),
        (json.dumps({**GOOD, "choices": ["a"]}), "line 2 has no list of two or more 'choices'"),
        (json.dumps({**GOOD, "choices": ["a", ""]}), "line 2 has a choice that is not a non-empty"),
        (json.dumps({**GOOD, "gold": 2}), "line 2 has 'gold' 2, not an index from 0 to 1"),
        (json.dumps({**GOOD, "gold": True}), "line 2 has 'gold' True"),
        (json.dumps({"text": "a document"}), "line 2 has no 'query' string"),
    ],
)
def test_a_bad_question_file_is_refused_in_one_line(
    tokenizer: PreTrainedTokenizerBase, tmp_path: Path, line: str, message: str
) -> None:
    file = _write(tmp_path / "mc.jsonl.gz", [json.dumps(GOOD), line])
    with pytest.raises(UserError, match=message) as info:
        read_questions(file, tokenizer)
    assert str(info.value).startswith(f"--eval-multiple-choice {file} line 2")
    assert "\n" not in str(info.value)


def test_an_empty_question_file_is_refused(tokenizer: PreTrainedTokenizerBase,
                                           tmp_path: Path) -> None:  # fmt: skip
    file = _write(tmp_path / "mc.jsonl.gz", [""])
    with pytest.raises(UserError, match="holds no questions"):
        read_questions(file, tokenizer)


def test_the_bundled_sample_reads(tokenizer: PreTrainedTokenizerBase, sample_data: Path) -> None:
    file = sample_data / "sft" / "arc_easy.validation.first100.multiple_choice.jsonl.gz"
    questions = read_questions(str(file), tokenizer)
    assert len(questions) == 100
    assert all(2 <= len(q.choices) <= 5 and 0 <= q.gold < len(q.choices) for q in questions)
