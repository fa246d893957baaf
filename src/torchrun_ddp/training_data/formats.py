"""Training examples in five formats, and one example's token ids and labels.

- ``text``: a document under ``--text-field`` (C4's layout); every token is trained on.
- ``prompt-completion``: ``{"prompt": str, "completion": str}`` (TRL's prompt-completion
  format); the loss is on the completion (and EOS) only, unless ``--train-on-prompt``. A prompt
  and a completion that are both lists of messages (TRL's conversational prompt-completion)
  become one conversation.
- ``messages``: ``{"messages": [{"role", "content"}, ...]}`` (the conversational format of TRL,
  torchtune and axolotl), rendered with the tokenizer's chat template (``apply_chat_template``)
  or a ``--chat-template`` file; the loss is on the assistant turns only (system and user turns,
  and each assistant header, have labels -100), unless ``--train-on-prompt``. A content given
  as a list of parts (OpenAI's and transformers' ``[{"type": "text", "text": ...}]``) is its
  text parts joined by newlines (as vLLM's ``chat_utils`` passes them to a template that takes
  strings); another part (an image, say) damages the record.
- ``alpaca``: ``{"instruction", "input", "output"}`` (Stanford Alpaca's layout), read as
  ``prompt-completion``: the prompt is Stanford Alpaca's template (``PROMPT_DICT`` of its
  train.py, as axolotl's ``AlpacaPrompter`` writes it, ending ``"### Response:\n"``), with the
  ``### Input:`` section only where ``input`` is not empty; the completion is ``output``.
- ``sharegpt``: ``{"conversations": [{"from", "value"}, ...]}`` (ShareGPT's layout, as axolotl
  and LLaMA-Factory read it), read as ``messages``: ``from`` human (or user) is the user, gpt (or
  assistant) the assistant, system the system; ``value`` is the content.

A raw record is checked once, where it is read (``check_record``), and kept as one string: the
text for ``text``, the example as compact JSON for the others (``{"prompt", "completion"}`` or
``{"messages"}``, so Alpaca and ShareGPT take the prompt-completion and messages paths from
there on). A record that does not fit its format (no assistant turn, a role that is not
system/user/assistant, a missing field) is a damaged record: named by file and line, skipped and
counted against ``--max-bad-records``; the reason names what the record shows (an empty list,
the turn and its role, a content part that is not text).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from jinja2 import TemplateError
from transformers import PreTrainedTokenizerBase

from torchrun_ddp.errors import UserError

FORMATS = ("text", "prompt-completion", "messages", "alpaca", "sharegpt")
"""The example formats ``--data-format`` names (``auto``: detected from the first record)."""

CHAT_FORMATS = ("messages", "sharegpt")
"""The formats whose examples are conversations rendered by the chat template."""

IGNORE_INDEX = -100
"""The label of a token that is not trained on (``torch.nn.CrossEntropyLoss``'s ignore_index)."""

ROLES = ("system", "user", "assistant")

BUNDLED_CHAT_TEMPLATE = Path(__file__).with_name("chat_template.jinja")
"""The chat template used when neither the tokenizer nor ``--chat-template`` has one."""

SHAREGPT_ROLES = {
    "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
    "system": "system",
}  # fmt: skip
"""ShareGPT's ``from`` values as chat roles (axolotl's default roles for ShareGPT data)."""

ALPACA_HEAD = (
    "Below is an instruction that describes a task{}. Write a response that appropriately "
    "completes the request.\n\n### Instruction:\n{}\n\n"
)
"""Stanford Alpaca's prompt up to its instruction; ``{}``: ``ALPACA_INPUT`` where the record
has an input (else nothing), then the instruction."""

ALPACA_INPUT = ", paired with an input that provides further context"

# A first record's format: (keys it has, the format), in this order before the text field.
_DETECTED = (
    (("messages",), "messages"),
    (("prompt", "completion"), "prompt-completion"),
    (("conversations",), "sharegpt"),
    (("instruction", "output"), "alpaca"),
)

# Layouts that are not read, with the fix: (keys that identify the layout, the fix).
_REFUSED = (
    (("chosen", "rejected"), "preference pairs (chosen/rejected), which are for DPO, not "
     "fine-tuning: keep the chosen conversation as 'messages'"),
    (("prompt", "response"), "prompt/response records: rename 'response' to 'completion' "
     "(TRL's prompt-completion format), e.g. jq -c '{prompt, completion: .response}'"),
    (("prompt",), "'prompt' without 'completion': name the answer field 'completion'"),
)  # fmt: skip


@dataclass(frozen=True)
class _Layout:
    """Where a conversation's turns are: the record's list field, each turn's role and content
    keys, and the role names read (to system/user/assistant)."""

    field: str
    role: str
    content: str
    roles: Mapping[str, str]


_MESSAGES = _Layout("messages", "role", "content", {role: role for role in ROLES})
_SHAREGPT = _Layout("conversations", "from", "value", SHAREGPT_ROLES)


@dataclass(frozen=True)
class ExampleFormat:
    """How records become examples, and examples windows.

    ``name``: one of ``FORMATS`` (``auto`` until detected). ``text_field``: the text's field in
    ``text`` records. ``train_on_prompt``: labels on prompt, system and user tokens too.
    ``chat_template``: Jinja text used for conversations (None: the tokenizer's own).
    ``separate``: ``text`` documents are kept apart like examples (always so for the other
    formats). ``packing``: several examples share a window (False: one example per window,
    padded). ``detected_from``: where an ``auto`` format was detected (``"<file> line 1"``);
    empty for a format given by ``--data-format``.
    """

    name: str = "text"
    text_field: str = "text"
    train_on_prompt: bool = False
    chat_template: str | None = None
    separate: bool = False
    packing: bool = True
    detected_from: str = ""

    @property
    def labelled(self) -> bool:
        """Whether windows carry labels and positions ([3, seq_length]) rather than token ids
        only ([seq_length], today's packing of ``text`` back to back)."""
        return self.name != "text" or self.separate or not self.packing

    @property
    def renders_chat(self) -> bool:
        """Whether the examples are conversations rendered by the chat template (``messages``,
        ``sharegpt``), whose template ``final_model`` then keeps."""
        return self.name in CHAT_FORMATS


def detect_format(record: Mapping[str, object], text_field: str, where: str) -> str:
    """The format of a first record: ``messages``, ``prompt-completion``, ``sharegpt``
    (``conversations``), ``alpaca`` (``instruction`` and ``output``), then ``text`` (the text
    field), in that order.

    Raises UserError naming ``where`` and the fix for a layout that is none of them (preference
    pairs, prompt/response, a text field under another name)."""
    for keys, name in _DETECTED:
        if all(key in record for key in keys):
            return name
    if text_field in record:
        return "text"
    for keys, fix in _REFUSED:
        if all(key in record for key in keys):
            raise UserError(f"{where} holds {fix}")
    fields = ", ".join(sorted(record)) or "none"
    raise UserError(
        f"{where} has no '{text_field}', 'prompt'/'completion', 'messages', 'conversations' or "
        f"'instruction'/'output' field (fields: {fields}); name the text field with "
        "--text-field, or convert the records"
    )


def check_record(record: object, fmt: ExampleFormat) -> tuple[str | None, str | None]:
    """One raw record as (the example as one string, None), or (None, what is wrong): the text
    for ``text``, else compact JSON of ``{"prompt", "completion"}`` (prompt-completion, alpaca)
    or ``{"messages"}`` (messages, sharegpt, conversational prompt-completion)."""
    if not isinstance(record, dict):
        return None, "is not a JSON object (a record of named fields)"
    if fmt.name == "text":
        text = record.get(fmt.text_field)
        if not isinstance(text, str):
            return None, f"has no '{fmt.text_field}' string"
        return text, None
    if fmt.name == "prompt-completion":
        return _prompt_completion(record)
    if fmt.name == "alpaca":
        return _alpaca(record)
    layout = _SHAREGPT if fmt.name == "sharegpt" else _MESSAGES
    return _conversation(record.get(layout.field), layout)


def _prompt_completion(record: Mapping[str, object]) -> tuple[str | None, str | None]:
    prompt, completion = record.get("prompt"), record.get("completion")
    if isinstance(prompt, list) and isinstance(completion, list):
        return _conversation([*prompt, *completion], _MESSAGES)
    if not isinstance(prompt, str) or not isinstance(completion, str):
        return None, "has no 'prompt' and 'completion' strings"
    return json.dumps({"prompt": prompt, "completion": completion}), None


def _alpaca(record: Mapping[str, object]) -> tuple[str | None, str | None]:
    """An Alpaca record as prompt-completion (see the module docstring)."""
    instruction, output = record.get("instruction"), record.get("output")
    given = record.get("input")
    if not isinstance(instruction, str) or not isinstance(output, str):
        return None, "has no 'instruction' and 'output' strings"
    if given is not None and not isinstance(given, str):
        return None, "has an 'input' that is not a string"
    return json.dumps(
        {"prompt": alpaca_prompt(instruction, given or ""), "completion": output}
    ), None


def alpaca_prompt(instruction: str, given: str) -> str:
    """Stanford Alpaca's prompt for one record (its ``prompt_input`` where ``given``, the input,
    is not empty, else ``prompt_no_input``), ending ``"### Response:\n"`` as axolotl's
    ``AlpacaPrompter`` writes it; the output follows it directly."""
    if not given:
        return ALPACA_HEAD.format("", instruction) + "### Response:\n"
    head = ALPACA_HEAD.format(ALPACA_INPUT, instruction)
    return f"{head}### Input:\n{given}\n\n### Response:\n"


def _conversation(turns: object, layout: _Layout) -> tuple[str | None, str | None]:
    if not isinstance(turns, list):
        return None, f"has no '{layout.field}' list"
    if not turns:
        return None, f"has an empty '{layout.field}' list"
    kept = []
    for index, turn in enumerate(turns):
        message, error = _message(turn, layout)
        if message is None:
            return None, f"has {layout.field}[{index}] {error}"
        kept.append(message)
    if not any(message["role"] == "assistant" for message in kept):
        return None, "has no assistant turn to train on"
    return json.dumps({"messages": kept}), None


def _message(turn: object, layout: _Layout) -> tuple[dict[str, str] | None, str]:
    """One turn as ``{"role", "content"}``, or (None, what is wrong with it)."""
    if not isinstance(turn, dict):
        return None, f"that is not an object with '{layout.role}' and '{layout.content}'"
    name = turn.get(layout.role)
    role = layout.roles.get(name) if isinstance(name, str) else None
    if role is None:
        return None, f"with '{layout.role}' {name!r}, not one of {', '.join(layout.roles)}"
    content, error = _content(turn.get(layout.content), layout.content)
    if content is None:
        return None, error
    return {"role": role, "content": content}, ""


def _content(value: object, key: str) -> tuple[str | None, str]:
    """A turn's content: a string, or a list of text parts joined by newlines."""
    if isinstance(value, str):
        return value, ""
    if not isinstance(value, list):
        return None, f"without a '{key}' string or list of text parts"
    texts = []
    for part in value:
        kind = part.get("type") if isinstance(part, dict) else None
        text = part.get("text") if isinstance(part, dict) else None
        if kind != "text" or not isinstance(text, str):
            return None, (
                f"with a content part of type {kind!r}: only text parts "
                "({'type': 'text', 'text': str}) are trained on; drop the others"
            )
        texts.append(text)
    return "\n".join(texts), ""


def check_tokenizer(tokenizer: PreTrainedTokenizerBase, fmt: ExampleFormat) -> None:
    """Raise UserError for a slow (Python) tokenizer with ``prompt-completion`` or ``messages``:
    it gives no character offsets, which ``example_tokens`` needs to label each token by the
    piece (prompt or answer) it starts in."""
    if fmt.name == "text" or getattr(tokenizer, "is_fast", False):
        return
    raise UserError(
        f"the tokenizer is a slow (Python) one ({type(tokenizer).__name__}), which gives no "
        f"character offsets, so the answer tokens of {fmt.name} examples cannot be found; pass "
        "a fast tokenizer (a folder with tokenizer.json) as --tokenizer"
    )


def load_chat_template(path: str, tokenizer: PreTrainedTokenizerBase | None) -> str | None:
    """The Jinja text of ``path``; for an empty path the tokenizer's own template (None) or, if
    it has none, the bundled ``chat_template.jinja`` (None with no ``tokenizer``: a hub
    tokenizer that ``--dry-run`` does not download). Raises UserError for a missing file."""
    if path:
        if not Path(path).is_file():
            raise UserError(f"--chat-template {path} is not a file; pass a Jinja template file")
        return Path(path).read_text()
    if tokenizer is None or getattr(tokenizer, "chat_template", None):
        return None
    return BUNDLED_CHAT_TEMPLATE.read_text()


def example_tokens(
    tokenizer: PreTrainedTokenizerBase, example: str, fmt: ExampleFormat
) -> tuple[list[int], list[int]]:
    """Token ids and labels (equal lengths) of one checked example (``check_record``).

    ``text``: ``[BOS] + ids + [EOS]``, every token a label. ``prompt-completion``: ``[BOS] +
    prompt + completion + [EOS]``. ``messages``: the chat template's rendering, tokenised turn by
    turn. Labels are -100 on the prompt (unless ``fmt.train_on_prompt``) and always on the first
    token, which no token of its own example predicts (so packing never trains across examples).
    """
    if fmt.name == "text":
        ids = text_tokens(tokenizer, example)
        labels = list(ids)
    else:
        fields = json.loads(example)
        segments = _segments(tokenizer, fields, fmt.chat_template)
        ids, labels = _labelled_tokens(tokenizer, segments, fmt.train_on_prompt)
        if "prompt" in fields and ids:  # the chat template adds its own BOS and EOS
            ids, labels = _with_bos_eos(tokenizer, ids, labels)
    if labels:
        labels[0] = IGNORE_INDEX
    return ids, labels


def _labelled_tokens(
    tokenizer: PreTrainedTokenizerBase, segments: list[tuple[str, bool]], train_on_prompt: bool
) -> tuple[list[int], list[int]]:
    """The pieces joined and tokenised as one text (as at inference), each token labelled when
    it starts inside a trained piece (character offsets of a fast tokenizer)."""
    text = "".join(piece for piece, _ in segments)
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    trained_chars = []
    start = 0
    for piece, trained in segments:
        if trained or train_on_prompt:
            trained_chars.append((start, start + len(piece)))
        start += len(piece)
    labels = []
    for token, (begin, _) in zip(encoded["input_ids"], encoded["offset_mapping"], strict=True):
        inside = any(low <= begin < high for low, high in trained_chars)
        labels.append(token if inside else IGNORE_INDEX)
    return list(encoded["input_ids"]), labels


def _with_bos_eos(
    tokenizer: PreTrainedTokenizerBase, ids: list[int], labels: list[int]
) -> tuple[list[int], list[int]]:
    """``[BOS] + ids + [EOS]`` (where the tokenizer has them); EOS is trained on, BOS not."""
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    head = [bos] if bos is not None else []
    tail = [eos] if eos is not None else []
    return head + ids + tail, [IGNORE_INDEX] * len(head) + labels + tail


def text_tokens(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """``[BOS] + ids + [EOS]`` of one document (BOS or EOS left out where the tokenizer has
    none); ``[]`` for a blank document."""
    if not text.strip():
        return []
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    return [*([bos] if bos is not None else []), *ids, *([eos] if eos is not None else [])]


def _segments(
    tokenizer: PreTrainedTokenizerBase, example: Mapping[str, object], template: str | None
) -> list[tuple[str, bool]]:
    """An example as (text, trained) pieces in order."""
    if "prompt" in example:
        return [(str(example["prompt"]), False), (str(example["completion"]), True)]
    return chat_segments(tokenizer, list(example["messages"]), template)


def chat_segments(
    tokenizer: PreTrainedTokenizerBase, messages: Sequence[Mapping[str, str]], template: str | None
) -> list[tuple[str, bool]]:
    """A conversation rendered by its chat template, cut into (text, is an assistant reply)
    pieces: each turn is the difference between the renderings of the conversation up to it and
    up to the turn before; an assistant turn's header (the generation prompt) counts as prompt.

    Raises UserError when the template fails or does not render a shorter conversation as a
    prefix of a longer one (the pieces would then not add up to the whole)."""
    pieces: list[tuple[str, bool]] = []
    done = ""
    for index, message in enumerate(messages):
        assistant = message["role"] == "assistant"
        if assistant:
            head = _render(tokenizer, messages[:index], template, generation_prompt=True)
            pieces.append((_after(head, done), False))
            done = head
        rendered = _render(tokenizer, messages[: index + 1], template, generation_prompt=False)
        pieces.append((_after(rendered, done), assistant))
        done = rendered
    return [(text, trained) for text, trained in pieces if text]


def _render(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Mapping[str, str]],
    template: str | None,
    generation_prompt: bool,
) -> str:
    try:
        return str(
            tokenizer.apply_chat_template(
                list(messages),
                chat_template=template,
                add_generation_prompt=generation_prompt,
                tokenize=False,
            )
        )
    except (TemplateError, ValueError) as exc:
        raise UserError(
            f"the chat template cannot render a conversation ({exc}); pass a template for "
            "system/user/assistant turns with --chat-template"
        ) from exc


def _after(text: str, prefix: str) -> str:
    if not text.startswith(prefix):
        raise UserError(
            "the chat template renders a conversation differently once a turn is added, so "
            "the assistant turns cannot be found; pass a template that appends each turn with "
            "--chat-template"
        )
    return text[len(prefix) :]
