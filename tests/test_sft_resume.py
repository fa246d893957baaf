"""Fine-tuning on chat (messages) data through the real trainer: a run stopped and resumed ends
bit-identical to a straight one (2 gloo ranks, one spawn), a run resumed at world size 1 from a
2-rank checkpoint trains on, and the multiple-choice accuracy the 2 ranks log together equals
the exported model's, scored in one process. At the loader level (fast), every example of a
messages file is trained exactly once across a world-size change 2 -> 1, as
tests/test_elastic_data.py checks for text.

The model is configs/tiny-models/llama (hidden 64, 2 layers, 128 positions), fp32."""

from __future__ import annotations

import gzip
import json
import shutil
from collections import Counter
from pathlib import Path

import pytest
import torch
from distributed_harness import (
    assert_logged_once,
    assert_same_run,
    logged_losses,
    metrics_records,
    run_distributed,
    tiny_args,
)
from tiny_models import digest, train_in_group
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from torchrun_ddp.choice_scoring import choice_loglikelihoods, picks
from torchrun_ddp.training_data import (
    IGNORE_INDEX,
    ExampleFormat,
    TrainLoader,
    build_train_loader,
    check_record,
    example_tokens,
    load_chat_template,
    load_tokenizer,
    open_documents,
    read_questions,
)

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "configs" / "tiny-models" / "llama" / "config.json"
STEPS, HALF = 4, 2
MC_FILE = "arc_easy.validation.first100.multiple_choice.jsonl.gz"
MC_QUESTIONS = 20


def _args(data: Path, output_dir: Path, *extra: str) -> list[str]:
    """configs/sft_tiny.toml (bundled ARC-Easy chat examples, loss on the answers, packed
    examples kept apart, 100 multiple-choice questions) on the hidden-64 LLaMA: STEPS steps of
    2 windows of 128 tokens per rank, a checkpoint every HALF, evaluation at the end only, on
    MC_QUESTIONS multiple-choice questions (``root``/mc.jsonl.gz, written by the fixture)."""
    args = tiny_args(
        data, output_dir,
        "--model", str(TINY), "--precision", "fp32", "--seq-length", "128", "--batch-size", "2",
        "--max-steps", str(STEPS), "--warmup-steps", "1", "--log-every", "1",
        "--eval-every", "0", "--eval-batches", "1", "--checkpoint-every", str(HALF),
        "--threads", "1", "--shuffle-buffer", "16",
        "--eval-multiple-choice", str(output_dir.parent / "mc.jsonl.gz"), *extra,
    )  # fmt: skip
    config = args.index("--config") + 1
    args[config] = str(REPO / "configs" / "sft_tiny.toml")
    sft = data / "sft"
    files = {"--data-files": "*train*.messages.jsonl.gz", "--eval-files": "*validation*.messages*"}
    for flag, pattern in files.items():
        args[args.index(flag) + 1] = str(sft / pattern)
    return args


def _two_ranks(rank: int, world_size: int, data: str, root: str) -> dict[str, str]:
    """A straight run, and one stopped at step HALF and resumed; its folder at step HALF is
    copied for the world size 1 phase. Returns the trained parameters' digests."""
    base, no_mc = Path(root), ("--eval-multiple-choice", "")  # scored in the straight run only
    straight = train_in_group(rank, world_size, _args(Path(data), base / "straight"))
    split = _args(Path(data), base / "split", *no_mc)
    train_in_group(rank, world_size, [*split, "--max-steps", str(HALF)], export=False)
    if rank == 0:
        shutil.copytree(base / "split", base / "elastic")
    torch.distributed.barrier()
    resumed = train_in_group(rank, world_size, split)
    return {
        "straight": digest(dict(straight.model.module.named_parameters())),
        "resumed": digest(dict(resumed.model.module.named_parameters())),
    }


def _one_rank(rank: int, world_size: int, data: str, root: str) -> dict[str, int]:
    """The 2-rank run stopped at step HALF, resumed alone (--keep-global-batch: 2 micro-batches
    of 2 windows a step, as 2 ranks of 1)."""
    argv = _args(Path(data), Path(root) / "elastic", "--eval-multiple-choice", "")
    trainer = train_in_group(rank, world_size, [*argv, "--keep-global-batch"])
    return {"step": trainer.step, "tokens_seen": trainer.tokens_seen}


@pytest.fixture(scope="module")
def runs(sample_data: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, dict, Path]:
    root = tmp_path_factory.mktemp("sft_resume")
    with gzip.open(sample_data / "sft" / MC_FILE, "rt") as handle:
        lines = handle.read().splitlines()[:MC_QUESTIONS]
    with gzip.open(root / "mc.jsonl.gz", "wt") as handle:
        handle.write("\n".join(lines) + "\n")
    two = run_distributed(_two_ranks, 2, str(sample_data), str(root), timeout=600)
    one = run_distributed(_one_rank, 1, str(sample_data), str(root), timeout=600)
    return two[0], one[0], root


@pytest.mark.slow
def test_a_stopped_and_resumed_sft_run_is_bit_identical(runs: tuple[dict, dict, Path]) -> None:
    digests, _, root = runs
    assert digests["resumed"] == digests["straight"]
    assert_same_run(root / "split", root / "straight", STEPS)


@pytest.mark.slow
def test_an_sft_run_resumed_at_world_size_one_trains_on(runs: tuple[dict, dict, Path]) -> None:
    _, alone, root = runs
    assert alone["step"] == STEPS
    assert alone["tokens_seen"] == STEPS * 2 * 2 * 128  # the global batch kept: 2 x 2 windows
    losses = logged_losses(root / "elastic")
    assert_logged_once(root / "elastic", STEPS)
    straight = logged_losses(root / "straight")
    assert all(losses[step] == straight[step] for step in range(1, HALF + 1))
    # after the resume, the 2-rank run's loss at each step: the same global batch (the data
    # re-split keeps the global order; --keep-global-batch: 2 micro-batches on 1 rank), summed
    # in another order: 1e-4 (1e-6 apart here on 2026-11-28; a restart from scratch logs step
    # 1's loss, 0.17 above step 3's)
    for step in range(HALF + 1, STEPS + 1):
        assert losses[step] == pytest.approx(straight[step], abs=1e-4), (step, losses, straight)
    assert (root / "elastic" / "final_model" / "model.safetensors").is_file()


@pytest.mark.slow
def test_the_ranks_mc_accuracy_is_the_exported_models(
    runs: tuple[dict, dict, Path], sample_data: Path
) -> None:
    """The last evaluation's accuracies, counted by 2 ranks over their halves of the questions
    and summed in the all-reduce, against the exported model scoring all of them here."""
    _, _, root = runs
    (record,) = [r for r in metrics_records(root / "straight") if "mc_accuracy" in r]
    assert record["step"] == STEPS and record["mc_questions"] == MC_QUESTIONS
    tokenizer = load_tokenizer(str(sample_data / "tokenizer" / "mistral-7b-v0.1"))
    questions = read_questions(str(root / "mc.jsonl.gz"), tokenizer)
    model = AutoModelForCausalLM.from_pretrained(root / "straight" / "final_model").eval()
    right = Counter()
    with torch.no_grad():
        for question in questions:
            scores = choice_loglikelihoods(model, question.context, question.choices, 128,
                                           torch.device("cpu"))  # fmt: skip
            by_sum, by_char = picks(scores, question.chars)
            right.update(sum=by_sum == question.gold, char=by_char == question.gold)
    assert record["mc_accuracy"] == pytest.approx(right["sum"] / MC_QUESTIONS)
    assert record["mc_accuracy_per_char"] == pytest.approx(right["char"] / MC_QUESTIONS)


@pytest.mark.slow
def test_final_model_renders_a_conversation_as_training_did(
    runs: tuple[dict, dict, Path], sample_data: Path
) -> None:
    """The tokenizer has no chat template, so training rendered with the bundled one; the
    exported tokenizer carries it, and ``apply_chat_template`` renders the same text."""
    _, _, root = runs
    tokenizer = load_tokenizer(str(sample_data / "tokenizer" / "mistral-7b-v0.1"))
    train = next((sample_data / "sft").glob("*train*.messages.jsonl.gz"))
    with gzip.open(train, "rt") as handle:
        messages = json.loads(handle.readline())["messages"]
    template = load_chat_template("", tokenizer)
    assert template and not tokenizer.chat_template
    trained = tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False)
    saved = AutoTokenizer.from_pretrained(root / "straight" / "final_model")
    assert saved.apply_chat_template(messages, tokenize=False) == trained


SEQ, BATCH, BLOCK = 128, 2, 16


def _close(loader: TrainLoader) -> None:
    iterator = loader.loader._iterator
    if iterator is not None:
        iterator._shutdown_workers()


def _examples(window: torch.Tensor) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """The examples of one [3, SEQ] window (positions restart at each; padding has no label)."""
    starts = (window[2] == 0).nonzero().flatten().tolist()
    found = []
    for start, end in zip(starts, [*starts[1:], SEQ], strict=True):
        ids, labels = window[0, start:end].tolist(), window[1, start:end].tolist()
        if any(label != IGNORE_INDEX for label in labels):
            found.append((tuple(ids), tuple(labels)))
    return found


def test_every_messages_example_is_trained_once_across_world_sizes(
    sample_data: Path, tmp_path: Path
) -> None:
    """60 chat examples, 2 ranks for 5 micro-batches each, then 1 rank to the end: the examples
    in its windows and its carry are every example of the file exactly once."""
    tokenizer: PreTrainedTokenizerBase = load_tokenizer(
        str(sample_data / "tokenizer" / "mistral-7b-v0.1")
    )
    fmt = ExampleFormat("messages", chat_template=load_chat_template("", tokenizer))
    source = sample_data / "sft" / "arc_easy.train.first400.messages.jsonl.gz"
    with gzip.open(source, "rt") as handle:
        lines = handle.read().splitlines()[:60]
    file = tmp_path / "chat.jsonl.gz"
    with gzip.open(file, "wt") as handle:
        handle.write("\n".join(lines) + "\n")
    expected = Counter()
    for line in lines:
        ids, labels = example_tokens(tokenizer, check_record(json.loads(line), fmt)[0], fmt)
        assert len(ids) <= SEQ
        expected[(tuple(ids), tuple(labels))] += 1

    def loader(rank: int, world: int) -> TrainLoader:
        documents = open_documents([str(file)], "", "", "", fmt)
        return build_train_loader(documents, tokenizer, SEQ, BATCH, rank, world, 1, BLOCK, 7,
                                  fmt=fmt)  # fmt: skip

    trained: Counter = Counter()
    states = []
    for rank in range(2):
        first = loader(rank, 2)
        iterator = iter(first)
        for _ in range(5):
            trained.update(e for window in next(iterator) for e in _examples(window))
        states.append(json.loads(json.dumps(first.state_dict())))
        _close(first)
    alone = loader(0, 1)
    alone.load_resharded(states)
    trained.update(e for window in alone.windows for e in _examples(window))
    trained.update((tuple(ids), tuple(labels)) for ids, labels in alone.windows.state["carry"])
    assert trained == expected
