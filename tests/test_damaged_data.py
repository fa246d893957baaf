"""Damaged records in the training data: named by file and line, skipped the same way on every
rank and after every resume, counted, and an error past --max-bad-records (training_data/)."""

from __future__ import annotations

import gzip
import json
import logging
from pathlib import Path

import pytest
from distributed_harness import REPO, run_distributed, tiny_args, torchrun
from tiny_models import train_in_group
from transformers import PreTrainedTokenizerBase

from torchrun_ddp.config_io import parse_config
from torchrun_ddp.errors import DataError, UserError
from torchrun_ddp.inputs import check_data_error, record_data_error
from torchrun_ddp.training_data import (
    GlobalPackedWindows,
    TrainLoader,
    load_tokenizer,
    open_documents,
    read_records,
    resolve_files,
)

TEXTS = [f"document {i} " + "word " * (i % 7) for i in range(120)]
DAMAGED = {30: b"{not json\n", 50: b'{"text": "caf\xe9"}\n', 70: b'{"body": "no text"}\n'}
"""Line number (1-based) -> damaged line replacing the document there."""


@pytest.fixture(scope="module")
def tokenizer(sample_data: Path) -> PreTrainedTokenizerBase:
    return load_tokenizer(str(sample_data / "tokenizer" / "mistral-7b-v0.1"))


def _lines(damaged: bool) -> list[bytes]:
    good = [json.dumps({"text": text}).encode() + b"\n" for text in TEXTS]
    if not damaged:
        return [line for number, line in enumerate(good, 1) if number not in DAMAGED]
    return [DAMAGED.get(number, line) for number, line in enumerate(good, 1)]


def _write(path: Path, lines: list[bytes], cut: int = 0) -> str:
    data = gzip.compress(b"".join(lines))
    path.write_bytes(data[: len(data) - cut])
    return str(path)


def test_read_records_names_the_file_and_line_of_each_damaged_record(tmp_path: Path) -> None:
    file = _write(tmp_path / "d.json.gz", _lines(damaged=True), cut=30)
    records = list(read_records([file]))
    errors = [r["error"] for r in records if r["error"]]
    assert errors[:3] == [
        f"{file} line 30 is not JSON (Expecting property name enclosed in double quotes: "
        "line 1 column 2 (char 1))",
        f"{file} line 50 cannot be read as UTF-8 ('utf-8' codec can't decode byte 0xe9 in "
        "position 13: invalid continuation byte)",
        f"{file} line 70 has no 'text' string",
    ]
    assert len(errors) == 4 and "cannot be read" in errors[3] and "rest of the file" in errors[3]
    texts = [r["text"] for r in records if not r["error"]]
    assert texts == [t for n, t in enumerate(TEXTS, 1) if n not in DAMAGED][: len(texts)]
    assert len(texts) > 100


def _windows(file: str, tokenizer: PreTrainedTokenizerBase, limit: int) -> GlobalPackedWindows:
    documents = open_documents([file], "", "", "train")
    return GlobalPackedWindows(documents, tokenizer, 8, 1, 2, 1, 16, 5, limit)


def test_damaged_records_take_no_position_and_resume_skips_the_same(
    tmp_path: Path, tokenizer: PreTrainedTokenizerBase
) -> None:
    """Rank 1 of 2 over the damaged file reads what it reads over the file without those lines;
    a resume from the middle continues identically with the count kept; one record over the
    limit is a DataError naming the file and line."""
    damaged = _write(tmp_path / "d.json.gz", _lines(damaged=True))
    clean = _write(tmp_path / "c.json.gz", _lines(damaged=False))
    expected = [w.tolist() for w in _windows(clean, tokenizer, 3)]
    first = _windows(damaged, tokenizer, 3)
    iterator = iter(first)
    head = [next(iterator).tolist() for _ in range(len(expected) // 2)]
    state = first.state_dict()
    assert state["bad_records"] and "line 30 is not JSON" in state["bad_records"][0]
    resumed = _windows(damaged, tokenizer, 3)
    resumed.load_state_dict(json.loads(json.dumps(state)))
    assert head + [w.tolist() for w in resumed] == expected
    kept = resumed.state_dict()["bad_records"]
    assert len(kept) == 3 and kept[: len(state["bad_records"])] == state["bad_records"]
    with pytest.raises(DataError, match=r"3 damaged training records, more than .* 2; the last: "):
        list(_windows(damaged, tokenizer, 2))


def test_a_loader_worker_stopping_on_damaged_data_is_one_line(
    tmp_path: Path, tokenizer: PreTrainedTokenizerBase
) -> None:
    damaged = _write(tmp_path / "d.json.gz", _lines(damaged=True))
    loader = TrainLoader(_windows(damaged, tokenizer, 1), batch_size=2)
    with pytest.raises(DataError) as info:
        list(loader)
    assert "\n" not in str(info.value)
    assert str(info.value).startswith("2 damaged training records, more than --max-bad-records 1")


def test_start_up_refuses_more_damaged_records_than_allowed(tmp_path: Path) -> None:
    file = _write(tmp_path / "d.json.gz", _lines(damaged=True))
    assert resolve_files([file], "--data-files", max_bad_records=3) == [file]
    with pytest.raises(UserError) as info:
        resolve_files([file], "--data-files", max_bad_records=2)
    assert str(info.value).startswith(f"--data-files {file} line 30 is not JSON")
    assert "3 damaged records in all, more than --max-bad-records 2" in str(info.value)
    assert parse_config(["--max-bad-records", "0"]).max_bad_records == 0
    with pytest.raises(UserError, match="--max-bad-records must be >= 0"):
        parse_config(["--max-bad-records", "-1"])


def test_a_kept_data_error_refuses_the_start_until_the_limit_is_raised(tmp_path: Path) -> None:
    """data_error.json (written when a run stopped on damaged data) refuses a start in that
    output folder with the kept line, unless --max-bad-records is now higher; an unreadable one
    is one line too."""
    config = parse_config(["--output-dir", str(tmp_path), "--max-bad-records", "2"])
    record_data_error(config, DataError("3 damaged training records, more than 2"))
    with pytest.raises(DataError, match=r"^3 damaged training records, more than 2 \(kept in "):
        check_data_error(config)
    check_data_error(parse_config(["--output-dir", str(tmp_path), "--max-bad-records", "3"]))
    (tmp_path / "data_error.json").write_text("{not json")
    with pytest.raises(UserError, match=r"cannot read .*data_error\.json"):
        check_data_error(config)


def _large_shard(path: Path, sample_data: Path) -> str:
    """A 65 MiB JSON-lines file (more than the start-up check reads to the end) of real C4
    documents repeated, with damaged lines 5, 9 and 13, which only training reaches."""
    with gzip.open(next((sample_data / "c4").glob("*train*.json.gz")), "rb") as handle:
        lines = [line for line in handle if line.strip()]
    for number in (5, 9, 13):
        lines[number - 1] = b'{"text": broken\n'
    size, out = 0, []
    while size < 65 * 2**20:
        out += lines
        size += sum(map(len, lines))
    path.write_bytes(b"".join(out))
    return str(path)


def _deep_args(shard: str) -> list[str]:
    """3 steps of 1 x 32 tokens a rank on ``shard``, the hidden-64 LLaMA, a record every step."""
    base = ["--data-files", shard, "--max-steps", "3", "--seq-length", "32", "--eval-every", "0"]
    base += ["--log-every", "1", "--checkpoint-every", "0", "--batch-size", "1"]
    return [*base, "--model", str(REPO / "configs" / "tiny-models" / "llama" / "config.json")]


def _skipping_worker(rank: int, world_size: int, sample: str, shard: str, root: str) -> None:
    """Train on ``shard`` within --max-bad-records 3, into ``root/ok``; the log lines of this
    rank and of its data-loader worker (a forked process, where the records are read) go to
    ``root/rank-<r>.log``."""
    args = tiny_args(Path(sample), Path(root) / "ok", *_deep_args(shard), "--max-bad-records", "3")
    handler, logger = logging.FileHandler(Path(root) / f"rank-{rank}.log"), logging.getLogger()
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        train_in_group(rank, world_size, args)
    finally:
        logger.removeHandler(handler)
        handler.close()


@pytest.mark.slow
def test_a_damaged_record_deep_in_a_large_shard_is_skipped_or_stops_in_one_line(
    sample_data: Path, tmp_path: Path
) -> None:
    """Within --max-bad-records the run warns (file and line), counts bad_records in its
    metrics and finishes (spawned ranks). Past it, under torchrun, every rank stops with one
    line, and the torchrun restart stops at once with the same line instead of training into
    the same records again."""
    shard = _large_shard(tmp_path / "large.json", sample_data)
    base = _deep_args(shard)
    run_distributed(_skipping_worker, 2, str(sample_data), shard, str(tmp_path))
    logs = "".join((tmp_path / f"rank-{rank}.log").read_text() for rank in (0, 1))
    assert f"skipped damaged training record 1: {shard} line 5 is not JSON" in logs, logs
    records = (tmp_path / "ok" / "metrics.jsonl").read_text().splitlines()
    assert any(json.loads(r).get("bad_records") == 3 for r in records), records
    args = tiny_args(sample_data, tmp_path / "stop", *base, "--max-bad-records", "2")
    stop = torchrun(args, extra=("--max-restarts=1",), forked=True)
    assert stop.returncode != 0
    errors = [line for line in stop.stderr.splitlines() if line.startswith("error: ")]
    line = f"error: 3 damaged training records, more than --max-bad-records 2; the last: {shard}"
    assert all(e.startswith(line) for e in errors), stop.stderr[-3000:]
    kept = [e for e in errors if "kept in" in e]  # the restart: refused before training
    assert len(errors) - len(kept) == 2, stop.stderr[-3000:]  # both ranks, in training
    # Once one rank of the restart has exited, torchrun stops the other: it may not get to
    # write its line first.
    assert 1 <= len(kept) <= 2, stop.stderr[-3000:]
    frames = [f for f in stop.stderr.splitlines() if f.strip().startswith('File "')]
    assert not [f for f in frames if "torchrun_ddp" in f], stop.stderr[-3000:]  # only torchrun's
