"""Self-labelled confidence on the demo task (docs/introspection.md): a trained QA model answers questions, each
answer is followed by a word it is then fine-tuned to say — "sure" when that answer was right, "unsure" when it
was wrong — and on held-out questions the word is scored as a predictor of the model's own correctness.

    label_items(train_jsonl, path)    the training questions (captions left out) as `prisma eval` items
    confidence_reply(prediction, ok)  the fine-tuning reply: the model's own answer, not learned (`"loss": false`,
                                      its code still fed on), then the word, the only token learned
    self_label_records(items, rows)   one training conversation per answered item (rows: eval's answers.jsonl)
    word_rows(cfg, params, ...)       held-out: the stage-1 answer teacher-forced, P("unsure") at the word
    word_metrics(rows)                AUROC of P("unsure") for wrong answers, the word's accuracy, and more

The word's position is where the feedback has work to do: its input carries the code of the distribution the
answer's last token was drawn from, and that entropy is a final-layer quantity the position's early layers cannot
otherwise see. Not here: training, the arms, the statistics (benchmarks/introspection.py).
"""
from __future__ import annotations

import numpy as np

from prisma_jax.apps.evaluation.metrics import auroc
from prisma_jax.apps.demo import dataset as D


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


def word_rows(cfg, params: dict, processor, records_path: str, answers: list[dict], batch: int) -> list[dict]:
    """The word, scored where it was trained: each held-out question with the stage-1 model's own answer
    (`answers`: that model's eval answers.jsonl rows, in `records_path`'s order, written by `self_label_records`)
    teacher-forced through the fine-tuned `params` exactly as training feeds it — `training_logits`, with
    `cfg.train.introspection_passes` passes, so the answer's codes reach the word's position as in generation.
    `p_unsure` is P("unsure") / (P("sure") + P("unsure")) at the word's position, `word` the likelier of the two,
    `correct` and `code` (the largest code of its tokens) the stage-1 answer's. Scored this way, the word judges
    the answer it was trained to judge: fine-tuning that moves the model's own answers (only the word is learned,
    so nothing holds them) cannot change what is scored."""
    import jax

    from train.data import Collate, LoadImages, index_jsonl
    from train.step import micro, training_logits

    records, _ = index_jsonl(cfg, records_path, processor)
    if len(records) != len(answers):
        raise ValueError(f"{records_path}: {len(records)} conversations for {len(answers)} answers")
    sure, unsure = processor.tokenizer.convert_tokens_to_ids([D.SURE, D.UNSURE])
    load, collate = LoadImages(cfg, processor.image_processor), Collate(cfg, batch)
    logits_of = jax.jit(lambda p, mb, tg: training_logits(cfg, p, mb, tg)[0])
    rows = []
    for start in range(0, len(records), batch):
        chunk = records[start:start + batch]
        tb = collate([load(r) for r in chunk + [chunk[-1]] * (batch - len(chunk))])     # one batch shape
        mb, targets = micro(tb, 0)
        z = np.asarray(logits_of(params, mb, targets), np.float64)
        for i, a in enumerate(answers[start:start + len(chunk)]):
            k = int(np.flatnonzero(np.asarray(targets[i]) >= 0)[0])          # the word: the one learned target
            zk = z[i, k] - z[i, k].max()
            p_sure, p_unsure = np.exp(zk[[sure, unsure]]) / np.exp(zk).sum()
            rows.append({"index": a["index"], "id": a.get("id"), "group": a.get("group"),
                         "reference": a["reference"], "answer": a["prediction"], "correct": bool(a["correct"]),
                         "word": D.UNSURE if p_unsure > p_sure else D.SURE,
                         "p_unsure": float(p_unsure / (p_sure + p_unsure)), "p_words": float(p_sure + p_unsure),
                         "code": max(a["codes"]) if a["codes"] else None})
    return rows


def word_metrics(rows: list[dict]) -> dict:
    """How well the word predicts the answer's correctness: `word_auroc` = P(P("unsure") of a wrong answer >
    that of a right one), ties ½; `word_accuracy` = share of rows whose likelier word is the right one ("unsure"
    exactly when wrong); beside them the answers' accuracy and the signal the word has to beat or use, the AUROC
    of the answer's own code (code → wrong; an empty answer has no code)."""
    correct = np.array([r["correct"] for r in rows], bool)
    p = np.array([r["p_unsure"] for r in rows], np.float64)
    word = np.array([r["word"] for r in rows], object)
    has_code = np.array([r["code"] is not None for r in rows], bool)
    code = np.array([r["code"] for r in rows if r["code"] is not None], np.float64)
    return {"n": len(rows), "answer_accuracy": float(correct.mean()), "word_auroc": auroc(p, correct),
            "word_accuracy": float(np.mean(word == np.where(correct, D.SURE, D.UNSURE))),
            "unsure_share": float(np.mean(word == D.UNSURE)),
            "mean_p_words": float(np.mean([r["p_words"] for r in rows])), "code_auroc": auroc(code, correct[has_code])}
