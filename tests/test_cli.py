"""Bad input through the real entry point: one line on stderr, exit status 2, nothing saved."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import huggingface_hub
import pytest
import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import train  # noqa: E402
from torchrun_ddp.config_io import parse_config  # noqa: E402


def _tiny_args(sample_data: Path, tmp_path: Path) -> list[str]:
    return [
        "--config", str(REPO / "configs" / "tiny.toml"),
        "--model", str(REPO / "configs" / "llama-tiny" / "config.json"),
        "--tokenizer", str(sample_data / "tokenizer" / "mistral-7b-v0.1"),
        "--data-files", str(sample_data / "c4" / "*train*.json.gz"),
        "--eval-files", str(sample_data / "c4" / "*validation*.json.gz"),
        "--output-dir", str(tmp_path / "out"),
    ]  # fmt: skip


def _error_line(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    assert train.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err, err
    return err


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (["--seq-length", "4096"], "exceeds the model's 1024 positions"),
        (["--data-files", "/nonexistent/*.json.gz"], "matches no file"),
        (["--eval-files", "/nonexistent/eval.json.gz"], "matches no file"),
        (["--tokenizer", "/nonexistent/tokenizer"], "tokenizer folder /nonexistent/tokenizer"),
        (["--model", "/nonexistent/model"], "model path /nonexistent/model does not exist"),
        (["--learning-rate", "0"], "--learning-rate must be > 0"),
        (["--unknown-flag", "1"], "unknown option --unknown-flag"),
        (["--device-memory-gib", "1.5"], "the memory plan needs 1.7 GiB per rank but the device"),
        (["--device-memory-gib", "1.5"], "it would fit with --batch-size 1"),
        (["--device-memory-gib", "0.5"], "no combination fits in 0.5 GiB"),
        (["--fused-loss", "liger"], "--fused-loss liger runs Triton kernels on CUDA"),
    ],
)
def test_bad_input_gives_one_line_and_saves_nothing(
    capsys: pytest.CaptureFixture[str],
    sample_data: Path,
    tmp_path: Path,
    override: list[str],
    message: str,
) -> None:
    err = _error_line(capsys, _tiny_args(sample_data, tmp_path) + override)
    assert message in err
    assert not (tmp_path / "out").exists(), "rejected before anything is written"


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (["--output-dir", "{file}"], "--output-dir {file} is a file, not a folder"),
        (["--output-dir", "{file}/out"], "--output-dir {file}/out is inside the file {file}"),
        (["--checkpoint-dir", "{file}"], "--checkpoint-dir {file} is a file, not a folder"),
        (["--output-dir", "/proc/out"], "--output-dir /proc/out cannot be written (/proc: "),
        (["--tokenizer", "{empty}"], "tokenizer folder {empty} has none of tokenizer.json"),
        (["--resume-from", "{empty}"], "{empty} is not a complete checkpoint"),
    ],
)
def test_paths_that_are_not_what_they_seem_are_one_line_before_any_process_group(
    capsys: pytest.CaptureFixture[str],
    sample_data: Path,
    tmp_path: Path,
    override: list[str],
    message: str,
) -> None:
    """A file where a folder belongs, an unwritable folder, a tokenizer folder without its files,
    a resume path that is not a checkpoint."""
    names = {"file": tmp_path / "a-file", "empty": tmp_path / "empty", "toml": tmp_path / "c.toml"}
    names["file"].write_text("")
    names["empty"].mkdir()
    names["toml"].write_text('model = "nope/config.json"\n')
    override = [part.format(**names) for part in override]
    err = _error_line(capsys, _tiny_args(sample_data, tmp_path) + override)
    assert message.format(**names) in err
    assert not dist.is_initialized()


def test_a_config_files_relative_path_that_does_not_exist_is_one_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Input paths in a config file are relative to the file: the error names the path."""
    (tmp_path / "c.toml").write_text('model = "nope/config.json"\n')
    err = _error_line(capsys, ["--config", str(tmp_path / "c.toml")])
    assert f"model path {tmp_path / 'nope' / 'config.json'} does not exist" in err, err
    assert not dist.is_initialized()


def test_gated_model_without_token(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))
    monkeypatch.setattr(train, "load_dotenv", lambda: None)
    err = _error_line(capsys, ["--model", "meta-llama/Llama-2-7b-hf"])
    assert "gated" in err and "HF_TOKEN" in err


def test_hub_dataset_without_network_points_to_data_files(
    sample_data: Path, tmp_path: Path
) -> None:
    tiny = (REPO / "configs" / "tiny.toml").read_text().splitlines()
    hub = [line for line in tiny if not line.startswith(("data_files", "eval_files"))]
    (tmp_path / "hub.toml").write_text("\n".join(hub) + "\n")
    args = _tiny_args(sample_data, tmp_path)
    cut = args.index("--data-files")
    args = args[:cut] + args[cut + 4 :]  # no --data-files and no --eval-files: stream the hub
    args[args.index("--config") + 1] = str(tmp_path / "hub.toml")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    result = subprocess.run(
        [sys.executable, str(REPO / "train.py"), *args],
        capture_output=True, text=True, env=env, timeout=300, check=False,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr[-2000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: cannot reach the Hugging Face hub") and "--data-files" in last


def test_print_config_round_trips_through_config(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    argv = ["--seq-length", "96", "--compression", "dct-topk", "--data-files", "a.json", "b.json"]
    assert train.main([*argv, "--print-config"]) == 0
    printed = capsys.readouterr().out
    (tmp_path / "printed.toml").write_text(printed)
    assert parse_config(["--config", str(tmp_path / "printed.toml")]) == parse_config(argv)


def test_dry_run_plans_llama2_7b_offline(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr(train, "load_dotenv", lambda: None)
    assert train.main(["--dry-run", "--device-memory-gib", "80"]) == 0
    out = capsys.readouterr().out
    assert "6,738,415,616 parameters" in out
    assert "| weights | 25.10 |" in out and "does not fit" in out


def test_a_model_that_is_not_a_causal_lm_is_one_line(
    capsys: pytest.CaptureFixture[str], sample_data: Path, tmp_path: Path
) -> None:
    from transformers import T5Config  # noqa: PLC0415 - only this test needs it

    T5Config(d_model=32, num_layers=1, num_heads=2).to_json_file(tmp_path / "t5.json")
    args = [*_tiny_args(sample_data, tmp_path), "--model", str(tmp_path / "t5.json")]
    err = _error_line(capsys, args)
    assert "is a t5 model, not a causal language model" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a CPU-only machine")
def test_device_cuda_without_a_gpu_is_one_line(
    capsys: pytest.CaptureFixture[str], sample_data: Path, tmp_path: Path
) -> None:
    err = _error_line(capsys, [*_tiny_args(sample_data, tmp_path), "--device", "cuda"])
    assert "--device cuda was asked for but torch sees no GPU" in err


def test_bad_adamw_option_in_a_config_file_is_one_line(
    capsys: pytest.CaptureFixture[str], sample_data: Path, tmp_path: Path
) -> None:
    (tmp_path / "adamw.toml").write_text('adamw_implementation = "apex"\n')
    args = [*_tiny_args(sample_data, tmp_path), "--config", str(tmp_path / "adamw.toml")]
    err = _error_line(capsys, args)
    assert "adamw_implementation = 'apex' is invalid" in err


def test_a_token_saved_by_hf_auth_login_is_accepted_and_never_shown(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """No HF_TOKEN in the environment, but the file `hf auth login` writes: the gated-model
    check passes (huggingface_hub.get_token), and the token appears in no output or saved file."""
    from torchrun_ddp.model import check_access  # noqa: PLC0415

    secret = "hf_notarealtoken0123456789"
    (tmp_path / "token").write_text(secret)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_TOKEN_PATH", str(tmp_path / "token"))
    check_access("meta-llama/Llama-2-7b-hf")
    assert train.main(["--model", "meta-llama/Llama-2-7b-hf", "--print-config"]) == 0
    captured = capsys.readouterr()
    assert secret not in captured.out + captured.err


def test_dry_run_plans_llama2_7b_lora_on_one_24gb_gpu_offline(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr(train, "load_dotenv", lambda: None)
    config = str(REPO / "configs" / "llama2_7b_lora.toml")
    assert train.main(["--config", config, "--dry-run", "--device-memory-gib", "24"]) == 0
    out = capsys.readouterr().out
    assert "6,738,415,616 parameters (+ 19,988,480 LoRA adapter parameters, trained)" in out
    assert "| weights (frozen bf16 base + fp32 LoRA adapters) | 12.63 |" in out
    assert "| verdict | fits, " in out and "1 x 24 GiB" in out


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--data-files", "missing/*.json.gz"], "--data-files missing/*.json.gz matches no file"),
        (["--tokenizer", "./no-tokenizer"], "tokenizer folder no-tokenizer does not exist"),
        (["--output-dir", "a-file"], "--output-dir a-file is a file, not a folder"),
    ],
)
def test_dry_run_checks_the_inputs_a_start_checks(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    sample_data: Path,
    tmp_path: Path,
    flags: list[str],
    message: str,
) -> None:
    """--dry-run refuses what a real start refuses (data files, tokenizer, output folder), in
    one line with status 2, and creates nothing."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a-file").write_text("")
    err = _error_line(capsys, [*_tiny_args(sample_data, tmp_path), *flags, "--dry-run"])
    assert message in err.replace(str(tmp_path) + "/", "")
    assert sorted(path.name for path in tmp_path.iterdir()) == ["a-file"]


def _sft_args(tmp_path: Path, *extra: str) -> list[str]:
    """configs/sft_tiny.toml (bundled ARC-Easy chat examples, --data-format auto, 100
    multiple-choice questions) under --dry-run, its output in ``tmp_path``."""
    config = str(REPO / "configs" / "sft_tiny.toml")
    return ["--config", config, "--output-dir", str(tmp_path / "out"), "--dry-run", *extra]


def test_dry_run_of_the_sft_config_reads_its_data_as_a_start_does(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """The chat data is checked in its own format (detected, rendered with the chat template)
    and its tokens counted as training packs them, not refused as text records."""
    from torchrun_ddp.inputs import example_format  # noqa: PLC0415
    from torchrun_ddp.training_data import count_tokens, load_tokenizer  # noqa: PLC0415

    assert train.main(_sft_args(tmp_path)) == 0
    out = capsys.readouterr().out
    config = parse_config(_sft_args(tmp_path))
    tokenizer = load_tokenizer(config.tokenizer)
    fmt = example_format(config, tokenizer)
    assert fmt.name == "messages" and fmt.chat_template
    files = sorted(str(path) for path in (REPO / "data" / "sft").glob("*train*.messages*"))
    tokens = count_tokens(files, tokenizer, 10**12, fmt)
    assert tokens and f"epochs of the training data's {tokens:,} tokens" in out


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ({"query": "Q?", "choices": ["a", "b"], "gold": 2}, "line 2 has 'gold' 2, not an index"),
        ({"query": "Q?", "choices": ["a"], "gold": 0}, "line 2 has no list of two or more"),
    ],
)
def test_dry_run_refuses_a_malformed_multiple_choice_file(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, content: dict, message: str
) -> None:
    good = {"query": "Q?", "choices": ["a", "b"], "gold": 0}
    questions = tmp_path / "mc.jsonl"
    questions.write_text(json.dumps(good) + "\n" + json.dumps(content) + "\n")
    err = _error_line(capsys, _sft_args(tmp_path, "--eval-multiple-choice", str(questions)))
    assert err.startswith(f"error: --eval-multiple-choice {questions} {message}"), err


def test_dry_run_tells_a_prompt_completion_file_its_data_format(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    pairs = tmp_path / "pc.jsonl"
    pairs.write_text("".join(json.dumps({"prompt": "Q?", "completion": " A"}) + "\n" for _ in "ab"))
    argv = _sft_args(tmp_path, "--data-format", "messages", "--eval-files", str(pairs))
    err = _error_line(capsys, argv)
    assert err == (
        f"error: --eval-files {pairs} holds prompt-completion records, not messages: pass "
        "--data-format prompt-completion or auto"
    )


@pytest.mark.parametrize("flag", ["--data-files", "--eval-files"])
@pytest.mark.parametrize("dry_run", [True, False])
@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("bad.parquet", b"PAR1 no Parquet" * 8, "cannot be read as Parquet (ArrowInvalid: "),
        ("bad.arrow", b"no Arrow" * 8, "cannot be read as Arrow (ArrowInvalid: "),
        ("bad.json.gz", b"\x1f\x8b\x08\x00garbage", "line 1 cannot be read ("),
        ("empty.json.gz", gzip.compress(b"", mtime=0), "holds no records"),
        ("bytes.jsonl", b"\xff\xfe\x00", "line 1 cannot be read as UTF-8"),
    ],
)
def test_a_corrupt_data_file_is_one_line_naming_it_at_a_start_and_a_dry_run(
    capsys: pytest.CaptureFixture[str],
    sample_data: Path,
    tmp_path: Path,
    flag: str,
    dry_run: bool,
    name: str,
    content: bytes,
    message: str,
) -> None:
    """One line, status 2, naming the file (and the line where there is one): no pyarrow
    traceback, before any process group."""
    (tmp_path / name).write_bytes(content)
    argv = [*_tiny_args(sample_data, tmp_path), flag, str(tmp_path / name)]
    err = _error_line(capsys, [*argv, "--dry-run"] if dry_run else argv)
    assert err.startswith(f"error: {flag} {tmp_path / name} {message}"), err
    assert not dist.is_initialized()


def test_dry_run_prints_steps_tokens_epochs_and_time(
    capsys: pytest.CaptureFixture[str], sample_data: Path, tmp_path: Path
) -> None:
    """The run-length line: --max-steps x tokens per step, the epochs those tokens are of the
    training files (counted here as training packs them), and the compute time, which halves
    at twice --plan-tflops."""
    from torchrun_ddp.training_data import count_tokens, load_tokenizer, resolve_files  # noqa: PLC0415

    args = [*_tiny_args(sample_data, tmp_path), "--dry-run", "--max-steps", "40"]
    config = parse_config(args)
    files = resolve_files(config.data_files, "--data-files")
    data = count_tokens(files, load_tokenizer(config.tokenizer), 10**12)
    assert data
    per_step = config.batch_size * config.seq_length * config.accumulation_steps
    lines = {}
    for tflops in ("100", "200"):
        assert train.main([*args, "--plan-tflops", tflops]) == 0
        out = capsys.readouterr().out
        lines[tflops] = next(line for line in out.splitlines() if line.startswith("run length"))
    expected = (
        f"run length: 40 optimizer steps (--max-steps) x {per_step:,} tokens = "
        f"{40 * per_step:,} tokens, {40 * per_step / data:.3g} epochs of the training data's "
        f"{data:,} tokens; compute "
    )
    assert lines["100"].startswith(expected), lines["100"]
    slow, fast = (float(lines[key].split("compute ")[1].split()[0]) for key in ("100", "200"))
    assert slow == pytest.approx(2 * fast, rel=0.01)


class _ExitCalledError(Exception):
    """Raised by the stand-in for ``os._exit`` with the status it was given."""


def test_an_uncaught_error_prints_its_traceback_and_exits_1_at_once(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """train.py's exit after an exception (a dead peer seen in a collective, say): the
    traceback as the interpreter prints it, then ``os._exit(1)``, with no interpreter teardown
    for torchrun to wait for. ``os._exit`` and the log and child shutdown are stand-ins here."""

    def fail(argv: list[str]) -> int:
        raise RuntimeError("Connection reset by peer")

    def exit_(status: int) -> None:
        raise _ExitCalledError(status)

    monkeypatch.setattr(train, "main", fail)
    monkeypatch.setattr(train.os, "_exit", exit_)
    monkeypatch.setattr(train.logging, "shutdown", lambda: None)
    monkeypatch.setattr(train.multiprocessing, "active_children", list)
    with pytest.raises(_ExitCalledError) as exited:
        train.run_and_exit([])
    assert exited.value.args == (1,)
    err = capsys.readouterr().err
    assert "Traceback" in err and "RuntimeError: Connection reset by peer" in err
