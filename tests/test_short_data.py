"""A run that would train nothing fails in one line: refused at start-up where the data files
can be counted (inputs.check_enough_tokens), stopped before the first step where they cannot
(main.train). A resume at the end of the data still succeeds: test_end_to_end.py."""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import pytest
from distributed_harness import REPO, tiny_args, torchrun
from tiny_models import LogLines
from transformers import PreTrainedTokenizerBase

from torchrun_ddp.config_io import parse_config
from torchrun_ddp.distributed import DistEnv
from torchrun_ddp.inputs import check_enough_tokens, warn_long_warmup
from torchrun_ddp.training_data import (
    FULL_CHECK_BYTES,
    count_tokens,
    document_tokens,
    load_tokenizer,
)

sys.path.insert(0, str(REPO))
import train

SHORT_TEXT = "A single short document about barbecue classes in Missoula."
SMALL_LLAMA = str(REPO / "configs" / "tiny-models" / "llama" / "config.json")


@pytest.fixture(scope="module")
def tokenizer(sample_data: Path) -> PreTrainedTokenizerBase:
    return load_tokenizer(str(sample_data / "tokenizer" / "mistral-7b-v0.1"))


def _gzip_lines(path: Path, texts: list[str], tail: bytes = b"") -> str:
    """``texts`` as a JSON-lines gzip file, with ``tail`` (damaged bytes) appended."""
    data = gzip.compress(b"".join(json.dumps({"text": t}).encode() + b"\n" for t in texts))
    path.write_bytes(data + tail)
    return str(path)


def test_count_tokens_counts_what_training_packs_and_stops_at_the_limit(
    tmp_path: Path, tokenizer: PreTrainedTokenizerBase
) -> None:
    texts = [f"document {i}: " + "word " * (5 + i) for i in range(6)]
    file = _gzip_lines(tmp_path / "d.json.gz", texts, tail=b"not gzip")
    sizes = [len(document_tokens(tokenizer, t)) for t in texts]
    assert count_tokens([file], tokenizer, 10**9) == sum(sizes)  # the damaged tail is skipped
    assert count_tokens([file], tokenizer, sizes[0] + 1) == sizes[0] + sizes[1]
    assert count_tokens([], tokenizer, 10) is None  # hub streaming: not counted
    large = tmp_path / "large.json"
    large.write_bytes(json.dumps({"text": "x"}).encode() + b"\n" + b" " * FULL_CHECK_BYTES)
    assert count_tokens([file, str(large)], tokenizer, 10) is None  # too costly to count


def _refusal(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    assert train.main(argv) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, err
    return errors[0]


def test_one_short_document_is_refused_at_start_up_in_one_line(
    capsys: pytest.CaptureFixture[str],
    sample_data: Path,
    tmp_path: Path,
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    """The one-document file of the issue: status 2, one line with the tokens found and the
    tokens a step needs, before anything is written."""
    one = _gzip_lines(tmp_path / "one.json.gz", [SHORT_TEXT])
    argv = tiny_args(sample_data, tmp_path / "out", "--data-files", one, "--max-steps", "5")
    line = _refusal(capsys, argv)
    assert line.startswith("error: --data-files give 16 tokens, fewer than one optimizer step")
    assert "1024 (world_size 1 x --batch-size 4 x --seq-length 256 x --accumulation-steps 1)" in (
        line
    )
    assert not (tmp_path / "out").exists()
    config = parse_config([*argv, "--epochs", "100"])  # 100 passes over it fill one step
    check_enough_tokens(config, DistEnv(), tokenizer, [one])


def test_a_truncated_gzip_with_three_documents_is_refused_at_start_up(
    capsys: pytest.CaptureFixture[str], sample_data: Path, tmp_path: Path
) -> None:
    """The truncated .json.gz of the issue: the damaged tail is warned about and skipped, and
    the 3 readable documents cannot fill one step."""
    texts = [SHORT_TEXT] * 3
    file = _gzip_lines(tmp_path / "cut.json.gz", texts, tail=b"\x1f\x8b\x08\x00damaged")
    argv = tiny_args(sample_data, tmp_path / "out", "--data-files", file, "--max-steps", "5")
    line = _refusal(capsys, argv)
    assert line.startswith("error: --data-files give 48 tokens, fewer than one optimizer step")
    assert not (tmp_path / "out").exists()


def test_a_warmup_as_long_as_the_run_is_warned_once() -> None:
    with LogLines() as log:
        for rank, warmup in ((0, 250), (1, 250), (0, 5), (0, 4)):
            argv = ["--max-steps", "5", "--warmup-steps", str(warmup), "--learning-rate", "1e-3"]
            warn_long_warmup(parse_config(argv), DistEnv(rank=rank, world_size=2))
    records = log.lines
    assert len(records) == 2, records  # rank 0 only; warmup 4 of 5 steps reaches the peak
    assert records[0].startswith("--warmup-steps 250 is not below --max-steps 5: the learning")
    assert "reaches 2e-05 (2% of --learning-rate) only at its last step" in records[0]
    assert "reaches 0.001 (100% of --learning-rate)" in records[1]


def _large_file_with_one_document(path: Path) -> str:
    """More than the start-up check reads to the end (so it cannot count the tokens): one
    short document, then one damaged record that only training reaches (and skips)."""
    with path.open("wb") as handle:
        handle.write(json.dumps({"text": SHORT_TEXT}).encode() + b"\n")
        handle.write(b"{" + b"x" * FULL_CHECK_BYTES + b"\n")
    return str(path)


@pytest.mark.slow
def test_data_that_ends_before_the_first_step_fails_in_one_line_and_saves_nothing(
    sample_data: Path, tmp_path: Path
) -> None:
    """Under torchrun, 2 ranks: every rank stops with one line and status 2 (not 0, not 143),
    no final_model and no checkpoint."""
    data = _large_file_with_one_document(tmp_path / "large.json")
    output = tmp_path / "out"
    args = tiny_args(sample_data, output, "--data-files", data, "--model", SMALL_LLAMA)
    args = [*args, "--max-steps", "5", "--seq-length", "32", "--batch-size", "1"]
    result = torchrun(args, forked=True)
    assert result.returncode not in (0, 143), result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 2, result.stderr[-3000:]
    assert all(
        e.startswith("error: the training data ended before step 5, the first") for e in errors
    )
    assert "ChildFailedError" in result.stderr and "exitcode  : 2" in result.stderr
    assert not (output / "final_model").exists()
    assert not list((output / "checkpoints").glob("step-*"))
