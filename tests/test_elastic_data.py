"""The global document order at changing world sizes: every token of every document is trained
exactly once (2 -> 1, 1 -> 2, 2 -> 3, and several changes over two epochs), counted from records
that carry ids; same-size resume is bit-exact. Batches come from the real StatefulDataLoader
worker processes, as in training."""

from __future__ import annotations

import gzip
import json
from collections import Counter

import pytest
import torch

from torchrun_ddp.training_data import (
    TrainLoader,
    build_train_loader,
    data_position,
    open_documents,
    reshard_positions,
)

DOCS = 90
SEQ = 8
BATCH = 2
BLOCK = 16  # shuffle_buffer: documents per shuffled block


class IdTokens:
    """A tokenizer stand-in: document ``k``'s text is the word ``w<k>`` repeated, and each word
    becomes token ``k + 3``, so a window shows which document each token came from."""

    bos_token_id, eos_token_id = 1, 2

    def __call__(self, text: str, add_special_tokens: bool) -> dict[str, list[int]]:
        return {"input_ids": [int(word[1:]) + 3 for word in text.split()]}


def _length(doc_id: int) -> int:
    return 1 + (doc_id * 7) % 23  # 1..23 words: documents span windows and batches


@pytest.fixture(scope="module")
def data_file(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("elastic") / "docs.json.gz"
    with gzip.open(path, "wt", encoding="utf-8") as handle:
        for doc_id in range(DOCS):
            text = " ".join([f"w{doc_id}"] * _length(doc_id))
            handle.write(json.dumps({"id": doc_id, "text": text}) + "\n")
    return str(path)


def _expected(epochs: int) -> Counter[int]:
    counts: Counter[int] = Counter()
    for doc_id in range(DOCS):
        counts[doc_id + 3] += _length(doc_id) * epochs
    counts[1] = counts[2] = DOCS * epochs
    return counts


def _loader(data_file: str, rank: int, world: int, epochs: int) -> TrainLoader:
    documents = open_documents([data_file], "", "", "train")
    return build_train_loader(
        documents, IdTokens(), SEQ, BATCH, rank, world, epochs, shuffle_buffer=BLOCK, seed=7
    )


def _close(loader: TrainLoader) -> None:
    """End the loader's worker now: a worker forked later would inherit its pipes and make its
    shutdown wait for DataLoader's 5 s join timeout."""
    iterator = loader.loader._iterator
    if iterator is not None:
        iterator._shutdown_workers()


def _train(
    data_file: str, schedule: list[tuple[int, int | None]], epochs: int
) -> tuple[Counter[int], list[int]]:
    """Run the schedule of (world size, micro-batches per rank; None: to the end), resharding
    the saved loader states (round-tripped through JSON, as checkpoints do) at every change.
    Returns the tokens trained, counted by id, and the world sizes whose states were resharded.
    The last phase drains each rank's windows and counts the tokens left in its carry."""
    trained: Counter[int] = Counter()
    states: list[dict[str, object]] | None = None
    for world, batches in schedule:
        loaders = [_loader(data_file, rank, world, epochs) for rank in range(world)]
        for loader in loaders:
            if states is not None:
                loader.load_resharded(states)
        if batches is None:
            for loader in loaders:
                windows = loader.windows
                trained.update(int(t) for window in windows for t in window)
                trained.update(windows.state["carry"])  # fewer than SEQ tokens, never trained
            return trained, [world for world, _ in schedule]
        new_states = []
        for loader in loaders:
            iterator = iter(loader)
            for _ in range(batches):
                batch = next(iterator)
                assert batch.shape == (BATCH, SEQ) and batch.dtype == torch.int64
                trained.update(batch.flatten().tolist())
            new_states.append(json.loads(json.dumps(loader.state_dict())))
            _close(loader)
        states = new_states
    raise AssertionError("the schedule must end with a phase that runs to the end")


@pytest.mark.parametrize(
    ("schedule", "epochs"),
    [
        ([(2, 9), (1, None)], 1),
        ([(1, 11), (2, None)], 1),
        ([(2, 7), (3, None)], 1),
        ([(2, 30), (3, 20), (1, 9), (2, None)], 2),
    ],
    ids=["2-1", "1-2", "2-3", "2-3-1-2-two-epochs"],
)
def test_every_token_is_trained_exactly_once_across_world_sizes(
    data_file: str, schedule: list[tuple[int, int | None]], epochs: int
) -> None:
    trained, _ = _train(data_file, schedule, epochs)
    assert trained == _expected(epochs)


def test_reshard_spans_an_epoch_boundary(data_file: str) -> None:
    """After 45 batches per rank at W=2 (about 1.1 epochs), ranks stand in different epochs or
    in the second one; the re-split positions then hold the first epoch's leftovers."""
    loaders = [_loader(data_file, rank, 2, 2) for rank in range(2)]
    positions = []
    for loader in loaders:
        iterator = iter(loader)
        for _ in range(45):
            next(iterator)
        positions.append(data_position(loader.state_dict()))
        _close(loader)
    assert max(int(p["epoch"]) for p in positions) == 1 and positions[0]["length"] == DOCS
    new = reshard_positions(positions, 3, BLOCK)
    assert [p["rank"] for p in new] == [0, 1, 2] and {p["world_size"] for p in new} == {3}
    assert len({p["start"] for p in new}) == 1 and all(p["epoch"] == 1 for p in new)


def test_same_world_size_resume_is_bit_exact(data_file: str) -> None:
    first = _loader(data_file, 1, 2, 2)
    iterator = iter(first)
    for _ in range(20):
        next(iterator)
    held = first.state_dict()  # a training loop may hold it while it reads ahead
    text = json.dumps(held)
    expected = [next(iterator) for _ in range(30)]
    assert json.dumps(held) == text, "a held state_dict changed as later batches arrived"
    state = json.loads(text)
    resumed = _loader(data_file, 1, 2, 2)
    resumed.load_state_dict(state)
    again = iter(resumed)
    assert all(torch.equal(want, next(again)) for want in expected)
    _close(first)
    _close(resumed)


def test_order_is_a_function_of_the_seed(data_file: str) -> None:
    def first_batches(seed: int) -> list[torch.Tensor]:
        documents = open_documents([data_file], "", "", "train")
        loader = build_train_loader(documents, IdTokens(), SEQ, BATCH, 0, 1, 1, BLOCK, seed)
        iterator = iter(loader)
        batches = [next(iterator) for _ in range(6)]
        _close(loader)
        return batches

    same = zip(first_batches(1), first_batches(1), strict=True)
    assert all(torch.equal(a, b) for a, b in same)
    assert not all(
        torch.equal(a, b) for a, b in zip(first_batches(1), first_batches(2), strict=True)
    )


def test_reshard_refuses_a_partial_set_of_ranks(data_file: str) -> None:
    loader = _loader(data_file, 0, 2, 1)
    position = data_position(loader.state_dict())
    _close(loader)
    with pytest.raises(ValueError, match=r"ranks 0\.\.1"):
        reshard_positions([position], 1, BLOCK)
