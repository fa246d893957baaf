"""Sharding, packing, blank documents, bad records and exact resume of the packed stream."""

from __future__ import annotations

import copy
import gzip
import json
import multiprocessing
import multiprocessing.synchronize
import os
import signal
import sys
import time
from pathlib import Path

import pytest
from datasets import Dataset
from transformers import PreTrainedTokenizerBase

from torchrun_ddp.errors import UserError
from torchrun_ddp.training_data import (
    ExampleFormat,
    PackedWindows,
    build_loader,
    load_tokenizer,
    open_documents,
    own_process_group,
    read_questions,
    resolve_files,
    shard_for_rank,
)


@pytest.fixture(scope="module")
def tokenizer(sample_data: Path) -> PreTrainedTokenizerBase:
    return load_tokenizer(str(sample_data / "tokenizer" / "mistral-7b-v0.1"))


@pytest.fixture(scope="module")
def train_files(sample_data: Path) -> list[str]:
    return resolve_files([str(sample_data / "c4" / "*train*.json.gz")], "--data-files")


def _texts(files: list[str], rank: int, world_size: int) -> list[str]:
    docs = shard_for_rank(open_documents(files, "", "", "train"), rank, world_size)
    return [record["text"] for record in docs]


def test_ranks_get_disjoint_shares_that_cover_the_data(train_files: list[str]) -> None:
    everything = _texts(train_files, 0, 1)
    assert len(everything) == 600  # documents in the bundled training sample
    shares = [_texts(train_files, rank, 2) for rank in range(2)]
    assert set(shares[0]).isdisjoint(shares[1])
    assert sorted(shares[0] + shares[1]) == sorted(everything)


class _Characters:
    """A tokenizer stand-in with one id per document, so windows show the document order."""

    bos_token_id, eos_token_id = 1, 2

    def __init__(self, texts: list[str]) -> None:
        self.ids = {text: index + 3 for index, text in enumerate(texts)}

    def __call__(self, text: str, add_special_tokens: bool) -> dict[str, list[int]]:
        return {"input_ids": [self.ids[text]]}


def test_shuffle_buffer_permutes_each_epoch(train_files: list[str]) -> None:
    texts = _texts(train_files, 0, 2)
    docs = shard_for_rank(open_documents(train_files, "", "", "train"), 0, 2)
    windows = PackedWindows(docs, _Characters(texts), 3, epochs=2, shuffle_buffer=64, seed=5)
    order = [int(w[1]) - 3 for w in windows]
    first, second = order[: len(texts)], order[len(texts) :]
    assert sorted(first) == sorted(second) == list(range(len(texts)))
    assert first != sorted(first) and first != second


def test_packing_gives_full_windows_of_the_token_stream(
    train_files: list[str], tokenizer: PreTrainedTokenizerBase
) -> None:
    docs = shard_for_rank(open_documents(train_files, "", "", "train"), 0, 1)
    windows = list(zip(range(40), PackedWindows(docs, tokenizer, 64), strict=False))
    stream: list[int] = []
    for text in _texts(train_files, 0, 1)[:40]:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        stream += [tokenizer.bos_token_id, *ids, tokenizer.eos_token_id]
    flat = [int(t) for _, window in windows for t in window]
    assert all(window.shape == (64,) for _, window in windows)
    assert flat == stream[: len(flat)]


def _write_jsonl(path: Path, records: list[dict[str, str]]) -> str:
    with gzip.open(path, "wt", encoding="utf-8") as handle:
        for record in records:
            handle.write(json.dumps(record) + "\n")
    return str(path)


def test_blank_documents_are_skipped(tmp_path: Path, tokenizer: PreTrainedTokenizerBase) -> None:
    texts = ["one two three", "", "   \n ", "four five"]
    file = _write_jsonl(tmp_path / "d.json.gz", [{"text": t} for t in texts])
    docs = open_documents([file], "", "", "train")
    windows = PackedWindows(docs, tokenizer, 1)
    ids = [int(w) for w in windows]
    assert ids.count(tokenizer.bos_token_id) == 2


def test_a_held_out_record_without_text_is_skipped(
    tmp_path: Path, tokenizer: PreTrainedTokenizerBase
) -> None:
    file = _write_jsonl(tmp_path / "d.json.gz", [{"text": "fine"}, {"body": "no text here"}])
    clean = _write_jsonl(tmp_path / "e.json.gz", [{"text": "fine"}])
    windows = PackedWindows(open_documents([file], "", "", "train"), tokenizer, 2)
    expected = PackedWindows(open_documents([clean], "", "", "train"), tokenizer, 2)
    assert [w.tolist() for w in windows] == [w.tolist() for w in expected]


def test_files_that_match_nothing_are_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="matches no file"):
        resolve_files([str(tmp_path / "*.json.gz")], "--data-files")


@pytest.mark.parametrize("steps", [30, 480, 530])
def test_state_dict_resumes_at_the_exact_next_batch(
    train_files: list[str], tokenizer: PreTrainedTokenizerBase, steps: int
) -> None:
    """Resume mid-epoch, while draining the shuffle buffer, and in the second epoch (each rank
    has ~510 batches of 4 x 128 tokens an epoch)."""

    def fresh() -> PackedWindows:
        docs = shard_for_rank(open_documents(train_files, "", "", "train"), 1, 2)
        return PackedWindows(docs, tokenizer, 128, epochs=2, shuffle_buffer=50, seed=3)

    first = fresh()
    batches = iter(build_loader(first, 4))
    for _ in range(steps):
        next(batches)
    state = first.state_dict()
    expected = [next(batches) for _ in range(5)]
    resumed = fresh()
    resumed.load_state_dict(state)
    got = list(zip(range(5), build_loader(resumed, 4), strict=False))
    assert all((a == b).all() for a, (_, b) in zip(expected, got, strict=True))


def test_a_tokenizer_without_bos_packs_ids_and_eos(sample_data: Path, tmp_path: Path) -> None:
    """Qwen2-style: bos_token_id is None. Each document is ids + EOS, no None in any window."""
    cached = load_tokenizer(str(sample_data / "tokenizer" / "mistral-7b-v0.1"))
    no_bos = copy.deepcopy(cached)  # load_tokenizer shares one object per folder in a process
    no_bos.bos_token = None
    assert no_bos.bos_token_id is None and no_bos.eos_token_id is not None
    data = tmp_path / "docs.json"
    texts = ["the first document", "a second one, a little longer than the first"]
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    windows = PackedWindows(open_documents([str(data)], "", "", "train"), no_bos, 4)
    got = [int(token) for window in windows for token in window]
    expected: list[int] = []
    for text in texts:
        expected += [*no_bos(text, add_special_tokens=False)["input_ids"], no_bos.eos_token_id]
    assert got == expected[: len(got)] and len(expected) - len(got) < 4


def _gzip_bytes(text: str) -> bytes:
    return gzip.compress(text.encode(), mtime=0)  # the same bytes in every pytest-xdist worker


GOOD_LINES = "".join(json.dumps({"text": f"document {i}"}) + "\n" for i in range(200))


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("corrupt.json.gz", b"\x1f\x8b\x08\x00garbage that is not deflate", "cannot be read"),
        ("truncated.json.gz", _gzip_bytes(GOOD_LINES)[:-40], "cannot be read"),
        ("empty.json", b"", "holds no records"),
        ("empty.json.gz", _gzip_bytes(""), "holds no records"),
        ("csv.json", b"a,b\n1,2\n", "line 1 is not JSON"),
        ("notext.json", b'{"text": "ok"}\n{"body": "x"}\n', "line 2 has no 'text' string"),
        ("list.json", b'["text"]\n', "element 0 is not a JSON object"),  # one JSON array
        ("lists.json", b'["text"]\n["more"]\n', "line 1 is not a JSON object"),  # JSON lines
        ("binary.json", b"\xff\xfe\x00bad", "cannot be read"),
    ],
)
@pytest.mark.parametrize("data_format", ["text", "auto"])
def test_bad_data_files_are_one_line_errors_naming_the_file(
    tmp_path: Path, name: str, content: bytes, message: str, data_format: str
) -> None:
    """As text, and under auto (a held-out file whose format is its own: --dry-run's check of
    --eval-files without --data-files)."""
    (tmp_path / name).write_bytes(content)
    with pytest.raises(UserError) as info:
        resolve_files([str(tmp_path / name)], "--eval-files", 0, ExampleFormat(data_format))
    text = str(info.value)
    assert text.startswith(f"--eval-files {tmp_path / name} ") and message in text, text
    assert "\n" not in text


def _damaged_table(tmp_path: Path, kind: str) -> Path:
    """A Parquet file, an Arrow file or a save_to_disk folder that cannot be read."""
    rows = Dataset.from_list([{"text": f"document {i}"} for i in range(100)])
    rows.save_to_disk(str(tmp_path / "saved"))
    arrow = next((tmp_path / "saved").glob("*.arrow"))
    if kind == "parquet":
        path = tmp_path / "bad.parquet"
        path.write_bytes(b"PAR1 this is no Parquet file" * 8)
    elif kind == "arrow":  # its schema readable, its batches cut off
        path = tmp_path / "cut.arrow"
        path.write_bytes(arrow.read_bytes()[:300])
    else:
        path = tmp_path / "saved"
        arrow.write_bytes(b"garbage" * 20)
    return path


@pytest.mark.parametrize(
    ("kind", "message"),
    [
        ("parquet", "cannot be read as Parquet (ArrowInvalid: "),
        ("arrow", "cannot be read as Arrow (ArrowInvalid: "),
        ("saved", "cannot be read as a save_to_disk folder (ArrowInvalid: "),
    ],
)
def test_a_table_that_cannot_be_read_is_one_line_naming_it(
    tmp_path: Path, kind: str, message: str
) -> None:
    """As training data, as held-out data of the training data's format or of its own, and as
    multiple-choice questions: one UserError line naming the file and pyarrow's reason, no
    pyarrow exception."""
    path = str(_damaged_table(tmp_path, kind))
    cases = [("--data-files", "text"), ("--eval-files", "auto")]
    for flag, data_format in cases:
        with pytest.raises(UserError) as info:
            resolve_files([path], flag, 100, ExampleFormat(data_format))
        assert str(info.value).startswith(f"{flag} {path} {message}"), str(info.value)
        assert "\n" not in str(info.value)
    with pytest.raises(UserError) as info:
        read_questions(path, None)
    assert str(info.value).startswith(f"--eval-multiple-choice {path} {message}")


def _data_worker(ready: multiprocessing.synchronize.Event) -> None:
    own_process_group(0)  # what the training loader's worker runs first
    ready.set()
    time.sleep(600)


def _training_process(pids: multiprocessing.SimpleQueue) -> None:
    context = multiprocessing.get_context("fork")
    ready = context.Event()
    worker = context.Process(target=_data_worker, args=(ready,))
    worker.start()
    ready.wait(60)
    pids.put(worker.pid)
    time.sleep(600)


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie left for init to reap counts as ended)."""
    try:
        stat = (Path("/proc") / str(pid) / "stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl(2) is Linux's")
def test_the_data_worker_dies_at_once_with_a_killed_training_process() -> None:
    """The loader's worker has a process group of its own (torchrun's killpg must not reach
    it), and still ends when its training process is SIGKILLed: here it would otherwise sleep
    its 600 s, and in training hold the rank's gloo sockets open for DataLoader's 5 s watchdog."""
    context = multiprocessing.get_context("fork")
    pids = context.SimpleQueue()
    parent = context.Process(target=_training_process, args=(pids,))
    parent.start()
    try:
        worker = pids.get()
        assert os.getpgid(worker) == worker  # its own process group
        assert _alive(worker)
    finally:
        os.kill(parent.pid, signal.SIGKILL)
        parent.join(30)
    deadline = time.monotonic() + 30
    while _alive(worker) and time.monotonic() < deadline:
        time.sleep(0.05)
    outlived = _alive(worker)
    if outlived:
        os.kill(worker, signal.SIGKILL)
    assert not outlived, "the data worker outlived its training process"
