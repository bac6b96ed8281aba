"""`prisma eval`'s input: a JSONL file of prompts with reference answers, read and checked on the host before
any model is loaded.

One item a line, in the training data's message format (docs/training.md) without the assistant's reply:

    {"messages": [{"role": "user", "content": [{"type": "image", "image": "img.png"},
                                               {"type": "text", "text": "What colour is the cube?"}]}],
     "answer": "red", "answerable": true, "id": "q17", "group": "colour"}

`answer` is the reference; `"answerable": false` makes the expected answer the abstention text (`answer` may
then be left out, and must equal that text when given). `answerable` defaults to true; `id` and `group` are
optional; every other key is kept verbatim as the answer row's `meta`. Image paths resolve against the JSONL's
folder, as in training. Problems → one ValueError naming file and line. Message text may not hold special-token
text (processing.py `check_message_text`): `prisma eval` passes the checkpoint tokenizer's special and added
tokens (`Processor.special_texts`; `SPECIAL_TOKENS`, the Qwen control tokens, by default).
"""
from __future__ import annotations

import dataclasses
import json
import os

from prisma_jax.host.processing import SPECIAL_TOKENS, check_message_text, resolve_messages
from prisma_jax.apps.evaluation.metrics import normalize

KEYS = ("messages", "answer", "answerable", "id", "group")


@dataclasses.dataclass
class Item:
    index: int               # 0-based among the file's items
    messages: list           # the prompt, image paths absolute
    reference: str           # the expected answer: `answer`, or the abstention text when not answerable
    answerable: bool
    id: object = None
    group: str | None = None
    meta: dict = dataclasses.field(default_factory=dict)   # the item's other keys


def read_items(path: str, abstain_text: str, special_tokens=SPECIAL_TOKENS) -> list[Item]:
    """Every item of the JSONL file `path` (blank lines skipped), checked; see the module docstring.
    `special_tokens`: the token texts refused in message text (`Processor.special_texts` for a checkpoint's)."""
    if not os.path.isfile(path):
        raise ValueError(f"--data {path}: no such file")
    base = os.path.dirname(os.path.abspath(path))
    items = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if line.strip():
                items.append(parse_item(line, f"{path}:{lineno}", base, len(items), abstain_text, special_tokens))
    if not items:
        raise ValueError(f"--data {path}: no items")
    return items


def parse_item(line: str, where: str, base: str, index: int, abstain_text: str,
               special_tokens=SPECIAL_TOKENS) -> Item:
    try:
        rec = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: malformed JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(rec, dict) or not isinstance(rec.get("messages"), list) or not rec["messages"]:
        raise ValueError(f"{where}: expected an object with a non-empty 'messages' list")
    resolve_messages(rec["messages"], where, base)
    check_message_text(rec["messages"], special_tokens, f"{where}: ")
    if rec["messages"][-1]["role"] == "assistant":
        raise ValueError(f"{where}: the last message is the assistant's; an item holds the prompt only "
                         "(the reference answer goes in 'answer')")
    answerable = rec.get("answerable", True)
    if not isinstance(answerable, bool):
        raise ValueError(f"{where}: 'answerable' must be true or false, got {answerable!r}")
    answer = rec.get("answer")
    if answer is not None and not isinstance(answer, str):
        raise ValueError(f"{where}: 'answer' must be a string, got {answer!r}")
    if answerable:
        if answer is None:
            raise ValueError(f"{where}: no 'answer' (the reference answer; an unanswerable item sets "
                             "\"answerable\": false)")
        if not normalize(answer):
            raise ValueError(f"{where}: 'answer' {answer!r} is empty once normalised (docs/eval.md)")
    elif answer is not None and normalize(answer) != normalize(abstain_text):
        raise ValueError(f"{where}: an unanswerable item expects the abstention text {abstain_text!r}, but its "
                         f"'answer' is {answer!r} (set --abstain-text, or drop 'answer')")
    group = rec.get("group")
    if group is not None and not isinstance(group, str):
        raise ValueError(f"{where}: 'group' must be a string, got {group!r}")
    return Item(index, rec["messages"], answer if answerable else abstain_text, answerable, rec.get("id"), group,
                {k: v for k, v in rec.items() if k not in KEYS})
