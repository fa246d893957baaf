"""Fine-tuning data: formats, answer-only labels, examples kept apart in packed windows, the
held-out slice and the loss per trained token (one spawn of 2 gloo ranks)."""

from __future__ import annotations

import gzip
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from distributed_harness import run_distributed
from tiny_models import tiny_llama_config
from torch.nn.parallel import DistributedDataParallel
from transformers import (
    AutoTokenizer,
    ByT5Tokenizer,
    LlamaForCausalLM,
    PreTrainedTokenizerBase,
)

from torchrun_ddp.errors import UserError
from torchrun_ddp.main import forward_backward
from torchrun_ddp.model import causal_lm_inputs, export_final_model
from torchrun_ddp.training_data import (
    IGNORE_INDEX,
    ExampleFormat,
    GlobalPackedWindows,
    Packer,
    check_record,
    check_tokenizer,
    data_format,
    example_tokens,
    first_record,
    load_chat_template,
    load_tokenizer,
    open_documents,
    read_records,
    reshard_positions,
    resolve_files,
)

CHAT = {
    "messages": [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "Which gas do plants take in?"},
        {"role": "assistant", "content": "carbon dioxide"},
        {"role": "user", "content": "And give out?"},
        {"role": "assistant", "content": "oxygen"},
    ]
}


@pytest.fixture(scope="module")
def tokenizer(sample_data: Path) -> PreTrainedTokenizerBase:
    return load_tokenizer(str(sample_data / "tokenizer" / "mistral-7b-v0.1"))


def _messages_format(tokenizer: PreTrainedTokenizerBase, **extra: object) -> ExampleFormat:
    return ExampleFormat("messages", chat_template=load_chat_template("", tokenizer), **extra)


def _trained_text(tokenizer: PreTrainedTokenizerBase, ids: list[int], labels: list[int]) -> str:
    return tokenizer.decode([i for i, label in zip(ids, labels, strict=True) if label >= 0])


def test_messages_train_on_the_assistant_turns_only(tokenizer: PreTrainedTokenizerBase) -> None:
    fmt = _messages_format(tokenizer)
    example, error = check_record(CHAT, fmt)
    assert error is None
    ids, labels = example_tokens(tokenizer, example, fmt)
    assert len(ids) == len(labels) and labels[0] == IGNORE_INDEX
    runs, run = [], []
    for token, label in zip(ids, labels, strict=True):
        if label >= 0:
            assert label == token
            run.append(token)
        elif run:
            runs, run = [*runs, run], []
    runs.append(run)
    assert [tokenizer.decode(run) for run in runs] == ["carbon dioxide</s>", "oxygen</s>"]
    rendered = tokenizer.apply_chat_template(CHAT["messages"], chat_template=fmt.chat_template,
                                             tokenize=False)  # fmt: skip
    assert tokenizer.decode(ids) == tokenizer.decode(tokenizer(rendered, add_special_tokens=False)
                                                     ["input_ids"])  # fmt: skip
    everything = _messages_format(tokenizer, train_on_prompt=True)
    _, all_labels = example_tokens(tokenizer, example, everything)
    assert all_labels[1:] == ids[1:]


def test_prompt_completion_trains_on_the_completion(tokenizer: PreTrainedTokenizerBase) -> None:
    fmt = ExampleFormat("prompt-completion")
    record = {"prompt": "Question: Is ice cold?\nAnswer:", "completion": " yes", "id": "q1"}
    ids, labels = example_tokens(tokenizer, check_record(record, fmt)[0], fmt)
    assert ids[0] == tokenizer.bos_token_id and ids[-1] == tokenizer.eos_token_id
    assert _trained_text(tokenizer, ids, labels) == "yes</s>"
    assert labels[-2:] == ids[-2:] and labels.count(IGNORE_INDEX) == len(ids) - 2


@pytest.mark.parametrize(
    ("record", "expected"),
    [
        (CHAT, "messages"),
        ({"prompt": "a", "completion": "b"}, "prompt-completion"),
        ({"instruction": "a", "input": "", "output": "b"}, "alpaca"),
        ({"conversations": [{"from": "human", "value": "a"}]}, "sharegpt"),
        ({"text": "a"}, "text"),
    ],
)
def test_the_format_is_detected_from_a_record(record: dict, expected: str) -> None:
    assert data_format(ExampleFormat("auto"), record, "x").name == expected


@pytest.mark.parametrize(
    ("record", "fix"),
    [
        (
            {"prompt": "a", "response": "b"},
            "prompt/response records: rename 'response' to 'completion'",
        ),
        ({"prompt": "a", "answer": "b"}, "'prompt' without 'completion': name the answer"),
        ({"chosen": [], "rejected": []}, "for DPO"),
        ({"body": "a"}, "--text-field"),
    ],
)
def test_peer_layouts_are_refused_with_the_fix(record: dict, fix: str) -> None:
    """Each layout is named with its own fix; only a record with none of the known fields is
    pointed at --text-field."""
    with pytest.raises(UserError, match=fix) as info:
        data_format(ExampleFormat("auto"), record, "--data-files f.jsonl line 1")
    assert str(info.value).startswith("--data-files f.jsonl line 1 ")
    assert ("--text-field" in str(info.value)) == ("body" in record)


def _write_jsonl(path: Path, lines: list[str]) -> Path:
    with gzip.open(path, "wt") as handle:
        handle.write("\n".join(lines) + "\n")
    return path


def test_damaged_messages_records_are_named_by_file_and_line(tmp_path: Path) -> None:
    no_answer = {"messages": [{"role": "user", "content": "hi"}]}
    lines = [json.dumps(CHAT), "{not json", json.dumps(no_answer), json.dumps(CHAT)]
    file = str(_write_jsonl(tmp_path / "chat.jsonl.gz", lines))
    records = list(read_records([file], ExampleFormat("messages")))
    errors = [record["error"] for record in records if record["error"]]
    assert errors[0].startswith(f"{file} line 2 is not JSON")
    assert errors[1] == f"{file} line 3 has no assistant turn to train on"
    assert [record["text"] is not None for record in records] == [True, False, False, True]


def _turns(messages: list[dict], role: str = "role", content: str = "content") -> list[dict]:
    return [{role: m["role"], content: m["content"]} for m in messages]


def test_alpaca_records_are_read_as_prompt_completion_in_alpacas_prompt(
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    """Stanford Alpaca's two prompts (with and without an input), the output as the completion
    and the only text trained on; a record without its strings is damaged, named."""
    fmt = ExampleFormat("alpaca")
    head = (
        "Below is an instruction that describes a task{}. Write a response that appropriately "
        "completes the request.\n\n### Instruction:\nAdd 2 and 3.\n\n"
    )
    with_input = {"instruction": "Add 2 and 3.", "input": "Show the sum.", "output": "5"}
    example, error = check_record(with_input, fmt)
    assert error is None
    assert json.loads(example) == {
        "prompt": head.format(", paired with an input that provides further context")
        + "### Input:\nShow the sum.\n\n### Response:\n",
        "completion": "5",
    }
    for given in ({"input": ""}, {}):
        record = {"instruction": "Add 2 and 3.", "output": "5", **given}
        example, _ = check_record(record, fmt)
        assert json.loads(example)["prompt"] == head.format("") + "### Response:\n"
    ids, labels = example_tokens(tokenizer, example, fmt)
    assert ids[0] == tokenizer.bos_token_id and _trained_text(tokenizer, ids, labels) == "5</s>"
    assert check_record({"instruction": "a", "output": 5}, fmt) == (
        None, "has no 'instruction' and 'output' strings"
    )  # fmt: skip


def test_sharegpt_records_are_read_as_the_same_messages(tokenizer: PreTrainedTokenizerBase) -> None:
    """from human/gpt/system and value are the messages' user/assistant/system and content:
    the same example string, so the same tokens and labels; an unknown speaker is named."""
    roles = {"system": "system", "user": "human", "assistant": "gpt"}
    turns = [{"from": roles[m["role"]], "value": m["content"]} for m in CHAT["messages"]]
    fmt = _messages_format(tokenizer)
    example, error = check_record({"conversations": turns}, replace(fmt, name="sharegpt"))
    assert error is None and example == check_record(CHAT, fmt)[0]
    assert fmt.renders_chat and replace(fmt, name="sharegpt").renders_chat
    bad = {"conversations": [*turns[:2], {"from": "bot", "value": "x"}]}
    _, error = check_record(bad, ExampleFormat("sharegpt"))
    assert error == "has conversations[2] with 'from' 'bot', not one of human, user, gpt, " + (
        "assistant, system"
    )


def test_content_given_as_text_parts_is_read_as_their_joined_text() -> None:
    """OpenAI's and transformers' list of content parts: its text parts joined by newlines,
    the same example as the joined string; a part that is not text is named."""
    fmt = ExampleFormat("messages")
    parts = _turns(CHAT["messages"])
    parts[1]["content"] = [{"type": "text", "text": "Which gas"}, {"type": "text", "text": "?"}]
    joined = _turns(CHAT["messages"])
    joined[1]["content"] = "Which gas\n?"
    assert check_record({"messages": parts}, fmt) == check_record({"messages": joined}, fmt)
    parts[1]["content"].append({"type": "image_url", "image_url": {"url": "x"}})
    _, error = check_record({"messages": parts}, fmt)
    assert error.startswith("has messages[1] with a content part of type 'image_url': only text")


@pytest.mark.parametrize(
    ("record", "error"),
    [
        ({"messages": []}, "has an empty 'messages' list"),
        ({"messages": "hi"}, "has no 'messages' list"),
        ({"text": "hi"}, "has no 'messages' list"),
        ({"messages": [{"role": "bot", "content": "x"}]},
         "has messages[0] with 'role' 'bot', not one of system, user, assistant"),
        ({"messages": [{"role": "user"}]},
         "has messages[0] without a 'content' string or list of text parts"),
        ({"messages": ["hi"]}, "has messages[0] that is not an object with 'role' and 'content'"),
        (["a", "list"], "is not a JSON object (a record of named fields)"),
    ],
)  # fmt: skip
def test_a_damaged_conversation_is_named_by_what_it_shows(record: object, error: str) -> None:
    assert check_record(record, ExampleFormat("messages")) == (None, error)


def test_a_file_of_another_format_is_told_the_data_format_that_reads_it(tmp_path: Path) -> None:
    """Under --data-format messages a prompt/completion file is named with the fix, not told to
    repair itself; under auto, a held-out file of another format than the training data is told
    where the format came from; an Alpaca or ShareGPT file is detected and read."""
    pairs = [json.dumps({"prompt": f"Q{i}?", "completion": f" A{i}"}) for i in range(3)]
    pc = str(_write_jsonl(tmp_path / "pc.jsonl.gz", pairs))
    with pytest.raises(UserError) as info:
        resolve_files([pc], "--data-files", 0, ExampleFormat("messages"))
    assert str(info.value) == (
        f"--data-files {pc} holds prompt-completion records, not messages: pass --data-format "
        "prompt-completion or auto"
    )
    said = [json.dumps({"instruction": f"Say {i}.", "output": str(i)}) for i in range(3)]
    alpaca = _write_jsonl(tmp_path / "alpaca.jsonl.gz", said)
    chat = _write_jsonl(tmp_path / "chat.jsonl.gz", [json.dumps({"messages": CHAT["messages"]})])
    record, where = first_record([str(alpaca)], "--data-files")
    detected = data_format(ExampleFormat("auto"), record, where)
    assert (detected.name, detected.detected_from) == ("alpaca", f"--data-files {alpaca} line 1")
    assert resolve_files([str(alpaca)], "--data-files", 0, detected) == [str(alpaca)]
    with pytest.raises(UserError) as info:
        resolve_files([str(chat)], "--eval-files", 0, detected)
    assert str(info.value) == (
        f"--eval-files {chat} holds messages records, but --data-format auto took alpaca from "
        f"--data-files {alpaca} line 1; pass files of one format"
    )


def test_final_model_keeps_the_chat_template_that_rendered_training(
    tokenizer: PreTrainedTokenizerBase, tmp_path: Path
) -> None:
    """The bundled template (this tokenizer has none) saved with final_model's tokenizer:
    ``apply_chat_template`` there renders the text training tokenised; the tokenizer handed in
    keeps no template, and None saves none."""
    fmt = _messages_format(tokenizer)
    model = LlamaForCausalLM(tiny_llama_config(vocab_size=len(tokenizer)))
    saved = export_final_model(model, tokenizer, tmp_path / "a", False, None, fmt.chat_template)
    reloaded = AutoTokenizer.from_pretrained(saved)
    rendered = reloaded.apply_chat_template(CHAT["messages"], tokenize=False)
    ids, _ = example_tokens(tokenizer, check_record(CHAT, fmt)[0], fmt)
    assert rendered == tokenizer.apply_chat_template(
        CHAT["messages"], chat_template=fmt.chat_template, tokenize=False
    )
    assert rendered.startswith("<s><|system|>\nAnswer briefly.\n")
    assert ids == tokenizer(rendered, add_special_tokens=False)["input_ids"]
    assert not tokenizer.chat_template
    plain = export_final_model(model, tokenizer, tmp_path / "b", False, None, None)
    assert not AutoTokenizer.from_pretrained(plain).chat_template


def test_parquet_arrow_and_saved_folders_read_like_json_lines(tmp_path: Path) -> None:
    rows = [{"prompt": f"Q{i}?", "completion": f" A{i}", "id": str(i)} for i in range(5)]
    rows[3] = {"prompt": None, "completion": " x", "id": "3"}
    lines = _write_jsonl(tmp_path / "pc.jsonl.gz", [json.dumps(row) for row in rows])
    table = Dataset.from_list(rows)
    table.to_parquet(str(tmp_path / "pc.parquet"))
    table.save_to_disk(str(tmp_path / "saved"))
    arrow = next((tmp_path / "saved").glob("*.arrow"))
    fmt = ExampleFormat("prompt-completion")
    expected = [record["text"] for record in read_records([str(lines)], fmt)]
    assert expected[3] is None and expected[4] is not None
    for source in (tmp_path / "pc.parquet", arrow, tmp_path / "saved"):
        records = list(read_records([str(source)], fmt))
        assert [record["text"] for record in records] == expected
        assert records[3]["error"] == f"{source} row 3 has no 'prompt' and 'completion' strings"


def test_the_heldout_slice_is_even_disjoint_and_offline(tmp_path: Path) -> None:
    file = str(_write_jsonl(tmp_path / "t.jsonl.gz", [json.dumps({"text": str(i)}) for i in
                                                       range(20)]))  # fmt: skip
    kept = [r["text"] for r in open_documents([file], "no/such-hub-dataset", "", "", None, 0.25)]
    held = [r["text"] for r in open_documents([file], "no/such-hub-dataset", "", "", None, 0.25,
                                              heldout=True)]  # fmt: skip
    assert held == ["3", "7", "11", "15", "19"]
    assert sorted(kept + held, key=int) == [str(i) for i in range(20)]


def _packing_settings(tokenizer: PreTrainedTokenizerBase) -> tuple[ExampleFormat, list[str]]:
    fmt = ExampleFormat("prompt-completion")
    records = [{"prompt": f"Question {i}: " + "word " * (3 * i), "completion": f" answer {i}"}
               for i in range(6)]  # fmt: skip
    return fmt, [check_record(record, fmt)[0] for record in records]


def test_packed_examples_keep_apart_and_fit_whole(tokenizer: PreTrainedTokenizerBase) -> None:
    fmt, examples = _packing_settings(tokenizer)
    carry: list = []
    packer = Packer(tokenizer, fmt, 48, carry)
    windows = [window for example in examples for window in packer.add(example)]
    windows += list(packer.flush(final=True))
    alone = [example_tokens(tokenizer, example, fmt) for example in examples]
    restarts = [(window[2] == 0).nonzero().flatten().tolist() for window in windows]
    assert len(windows) < len(examples) and all(len(r) >= 2 for r in restarts[:-1])
    got = []
    for window, starts in zip(windows, restarts, strict=True):
        for start, end in zip(starts, [*starts[1:], 48], strict=True):
            if window[1, start:end].ne(IGNORE_INDEX).any():
                got.append((window[0, start:end].tolist(), window[1, start:end].tolist()))
    assert got == [(list(ids), list(labels)) for ids, labels in alone]
    unpacked = Packer(tokenizer, ExampleFormat("prompt-completion", packing=False), 48, [])
    assert [len(list(unpacked.add(example))) for example in examples] == [1] * 6


def test_an_example_packed_or_alone_gives_the_same_logits_and_loss(
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config(vocab_size=len(tokenizer))).eval()
    model.config._attn_implementation = "sdpa"
    fmt, examples = _packing_settings(tokenizer)
    window = Packer(tokenizer, fmt, 64, []).window(
        [list(example_tokens(tokenizer, e, fmt)) for e in examples[1:4]]
    )
    with torch.no_grad():
        packed = model(**causal_lm_inputs(window[None]))
        start = 0
        for example in examples[1:4]:
            ids, labels = example_tokens(tokenizer, example, fmt)
            alone = model(input_ids=torch.tensor([ids]), labels=torch.tensor([labels]),
                          use_cache=False)  # fmt: skip
            end = start + len(ids)
            torch.testing.assert_close(packed.logits[0, start:end], alone.logits[0],
                                       atol=1e-5, rtol=0)  # fmt: skip
            part = window[None, :, start:end]
            one = model(**causal_lm_inputs(part))
            torch.testing.assert_close(one.loss, alone.loss, atol=1e-5, rtol=0)
            start = end


def test_resharded_example_carries_are_emptied_window_by_window(
    tokenizer: PreTrainedTokenizerBase, tmp_path: Path
) -> None:
    fmt, examples = _packing_settings(tokenizer)
    file = _write_jsonl(tmp_path / "pc.jsonl.gz", [json.dumps(json.loads(e)) for e in examples])
    states = []
    for rank in range(2):
        documents = open_documents([str(file)], "", "", "", fmt)
        windows = GlobalPackedWindows(documents, tokenizer, 24, rank, 2, fmt=fmt)
        next(iter(windows))
        states.append(windows.state_dict())
    merged = reshard_positions(states, 1, 1024)[0]
    assert sum(len(ids) for ids, _ in merged["carry"]) > 0
    documents = open_documents([str(file)], "", "", "", fmt)
    alone = GlobalPackedWindows(documents, tokenizer, 24, 0, 1, fmt=fmt)
    alone.load_state_dict(merged)
    rest = list(alone)
    assert rest and all(window.shape == (3, 24) for window in rest)


def _windows(sizes: list[int], generator: torch.Generator) -> torch.Tensor:
    """Windows [n, 3, 16] over a vocabulary of 128 whose first ``size`` labels are trained."""
    ids = torch.randint(0, 128, (len(sizes), 16), generator=generator)
    labels = ids.clone()
    for row, size in enumerate(sizes):
        labels[row, size:] = IGNORE_INDEX
    positions = torch.arange(16).expand(len(sizes), 16)
    return torch.stack([ids, labels, positions], dim=1)


def _normalisation_worker(rank: int, world_size: int) -> tuple[float, float]:
    generator = torch.Generator().manual_seed(7)
    sizes = [[3, 16], [16], [5], [9, 2, 16]]  # rank r: micro-batches 2r and 2r + 1
    batches = [_windows(size, generator) for size in sizes]
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config())
    reference = LlamaForCausalLM(tiny_llama_config())
    reference.load_state_dict(model.state_dict())
    ddp = DistributedDataParallel(model)
    mine = batches[2 * rank : 2 * rank + 2]
    total = sum(int((b[:, 1, 1:] != IGNORE_INDEX).sum()) for b in batches)
    loss = forward_backward(ddp, mine, "fp32", torch.tensor(float(total), dtype=torch.float64))
    torch.distributed.all_reduce(loss)
    whole = torch.cat(batches)
    expected = reference(**causal_lm_inputs(whole)).loss
    expected.backward()
    for got, want in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got.grad, want.grad, atol=1e-6, rtol=1e-5)
    return float(loss) / world_size, float(expected)


def test_the_step_loss_is_the_mean_over_every_trained_token() -> None:
    """Two ranks x two micro-batches with different trained tokens (2 to 30 per window): the
    DDP gradient and the loss equal one batch holding every window."""
    for loss, expected in run_distributed(_normalisation_worker, 2):
        assert loss == pytest.approx(expected, rel=1e-5)


def test_a_json_array_file_reads_like_json_lines(tmp_path: Path) -> None:
    """A .json (or .json.gz) file holding one JSON array is read element by element, each
    checked as a JSON line is (a field of another type damages that element only); an array that
    cannot be parsed is one damaged record with the fix."""
    rows = [{"prompt": f"Q{i}?", "completion": f" A{i}"} for i in range(4)]
    rows[2] = {"prompt": "Q2?", "completion": 7}
    lines = _write_jsonl(tmp_path / "pc.jsonl.gz", [json.dumps(row) for row in rows])
    array = tmp_path / "pc.json"
    array.write_text("\n  " + json.dumps(rows, indent=2))
    packed = tmp_path / "pc_array.json.gz"
    with gzip.open(packed, "wt") as handle:
        handle.write(json.dumps(rows))
    fmt = ExampleFormat("prompt-completion")
    expected = [record["text"] for record in read_records([str(lines)], fmt)]
    for source in (array, packed):
        record, where = first_record([str(source)], "x")
        assert where == f"x {source} element 0"
        assert data_format(ExampleFormat("auto"), record, where).name == "prompt-completion"
        records = list(read_records([str(source)], fmt))
        assert [record["text"] for record in records] == expected
        assert records[2]["error"] == f"{source} element 2 has no 'prompt' and 'completion' strings"
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps(rows)[:-30])
    (record,) = read_records([str(broken)], fmt)
    assert record["text"] is None
    assert record["error"].startswith(f"{broken} is one JSON array that cannot be read")
    assert record["error"].endswith("convert it to JSON lines") and "\n" not in record["error"]


def test_a_slow_tokenizer_is_refused_for_examples_in_one_line() -> None:
    slow = ByT5Tokenizer()
    check_tokenizer(slow, ExampleFormat("text"))
    for name in ("prompt-completion", "messages"):
        with pytest.raises(
            UserError, match=r"slow .*\(ByT5Tokenizer\).*pass a fast tokenizer"
        ) as info:
            check_tokenizer(slow, ExampleFormat(name))
        assert "\n" not in str(info.value)
