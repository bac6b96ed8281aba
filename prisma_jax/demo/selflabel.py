"""Self-labelled confidence on the demo task (docs/introspection.md): a trained QA model answers questions, each
answer is followed by a word it is then fine-tuned to say — "sure" when that answer was right, "unsure" when it
was wrong — and on held-out questions the word is scored as a predictor of the model's own correctness.

    label_items(train_jsonl, path)    the training questions (captions left out) as `prisma eval` items
    confidence_reply(prediction, ok)  the fine-tuning reply: the model's own answer, not learned (`"loss": false`,
                                      its code still fed on), then the word, the only token learned
    self_label_records(items, rows)   one training conversation per answered item (rows: eval's answers.jsonl)
    word_rows(model, processor, ...)  held-out: greedy answer + word; P("unsure") at the word's step
    word_metrics(rows)                AUROC of P("unsure") for wrong answers, the word's accuracy, and more

The word's position is where the feedback has work to do: its input carries the code of the distribution the
answer's last token was drawn from, and that entropy is a final-layer quantity the position's early layers cannot
otherwise see. Not here: training, the arms, the statistics (benchmarks/introspection.py).
"""
from __future__ import annotations

import numpy as np

from ..evaluation.answers import end_ids
from ..evaluation.metrics import auroc, normalize
from . import dataset as D


def label_items(train_jsonl: str, path: str, limit: int | None = None) -> int:
    """Write the questions of a demo `train.jsonl` (not the captions) as `prisma eval` items to `path`, in the
    same folder so that image paths still resolve; the first `limit` of them when given. Returns their number."""
    caption = D.question_text({"type": D.CAPTION})
    items = []
    for i, rec in enumerate(D.read_jsonl(train_jsonl)):
        user, reply = rec["messages"]
        if user["content"][-1]["text"] == caption:
            continue
        label = reply["content"][0]["text"]
        items.append({"id": f"train_{i}", "messages": [user], "answer": label, "answerable": label != D.UNKNOWN})
        if limit is not None and len(items) == limit:
            break
    D.write_jsonl(path, items)
    return len(items)


def confidence_reply(prediction: str, correct: bool) -> dict:
    """The assistant turn to fine-tune on: `prediction` (the model's own answer) then "sure" / "unsure". Only the
    word is learned: the message is `"loss": false` (its end token included), the word's item `"loss": true`."""
    word = D.SURE if correct else D.UNSURE
    answer = [{"type": "text", "text": prediction}] if prediction else []
    return {"role": "assistant", "loss": False,
            "content": answer + [{"type": "text", "text": f" {word}" if prediction else word, "loss": True}]}


def self_label_records(items: list[dict], rows: list[dict]) -> list[dict]:
    """Training conversations from the eval items (as written by `label_items`) and eval's answers.jsonl rows
    of them (joined on `index`): the item's prompt, then `confidence_reply` of the row's answer."""
    return [{"messages": [*items[r["index"]]["messages"], confidence_reply(r["prediction"], r["correct"])]}
            for r in rows]


def word_rows(model, processor, items: list, batch: int, max_new_tokens: int) -> list[dict]:
    """Greedy answers of the fine-tuned model to eval `Item`s. A row's answer is its tokens before the first
    "sure", "unsure" or end token — the word's step k (the last step when none comes); `p_unsure` is
    P("unsure") / (P("sure") + P("unsure")) at step k, `code` the largest code among the answer's tokens."""
    eos = end_ids(model, processor)
    pad = model.generation_config.get("pad_token_id", processor.pad_token_id)
    sure, unsure = processor.tokenizer.convert_tokens_to_ids([D.SURE, D.UNSURE])
    size = min(batch, len(items))
    rows = []
    for start in range(0, len(items), size):
        chunk = items[start:start + size]
        convs = [it.messages for it in chunk] + [chunk[-1].messages] * (size - len(chunk))   # one batch shape
        enc = processor(messages=convs, add_generation_prompt=True)
        res = model.generate(enc["input_ids"], enc["attention_mask"], enc.get("pixel_values"),
                             enc.get("image_grid_thw"), max_new_tokens=max_new_tokens, temperature=0.0,
                             eos_token_id=eos, pad_token_id=pad, return_logits=True)
        for i, it in enumerate(chunk):
            ids = [int(t) for t in res.tokens[i, :int(res.lengths[i])]]
            k = next((t for t, x in enumerate(ids) if x in (sure, unsure, *eos)), len(ids) - 1)
            z = res.logits[i, k].astype(np.float64)                   # the word's distribution, in float64
            p_sure, p_unsure = np.exp(z[[sure, unsure]] - z.max()) / np.exp(z - z.max()).sum()
            answer = processor.decode(ids[:k]).strip()
            codes = [int(c) for c in res.codes[i, :k]]
            rows.append({"index": it.index, "id": it.id, "group": it.group, "reference": it.reference,
                         "answer": answer, "correct": normalize(answer) == normalize(it.reference),
                         "word": {sure: D.SURE, unsure: D.UNSURE}.get(ids[k]),
                         "p_unsure": float(p_unsure / (p_sure + p_unsure)), "p_words": float(p_sure + p_unsure),
                         "code": max(codes) if codes else None,
                         "tokens": processor.tokenizer.convert_ids_to_tokens(ids)})
    return rows


def word_metrics(rows: list[dict]) -> dict:
    """How well the word predicts the answer's correctness: `word_auroc` = P(P("unsure") of a wrong answer >
    that of a right one), ties ½; `word_accuracy` = share of rows whose word is the right one ("unsure" exactly
    when wrong; no word counts as a miss); against the answer's own code, `code_auroc` (code → wrong)."""
    correct = np.array([r["correct"] for r in rows], bool)
    p = np.array([r["p_unsure"] for r in rows], np.float64)
    word = np.array([r["word"] or "" for r in rows], object)
    want = np.where(correct, D.SURE, D.UNSURE)
    has_code = np.array([r["code"] is not None for r in rows], bool)       # an empty answer has no code
    code = np.array([r["code"] for r in rows if r["code"] is not None], np.float64)
    return {"n": len(rows), "answer_accuracy": float(correct.mean()), "word_auroc": auroc(p, correct),
            "word_accuracy": float(np.mean(word == want)), "word_emitted": float(np.mean(word != "")),
            "unsure_share": float(np.mean(word == D.UNSURE)), "mean_p_words": float(np.mean([r["p_words"]
                                                                                           for r in rows])),
            "code_auroc": auroc(code, correct[has_code])}
