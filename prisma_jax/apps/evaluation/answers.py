"""Greedy answers to eval items, each with its per-token trace: tokens, codes and probabilities.

Items go through `PrismaVL.generate` `batch` at a time; the last batch is padded with copies of its last item
(whose answers are dropped), so every batch has one shape and, with generate's prompt and output buckets, one
compiled program serves all of them (one per prompt bucket). A row's `codes[t]` is the code of the distribution
its token t was drawn from — the value fed back with that token (docs/introspection-contract.md §2–3) — and
`probs[t]` that distribution's probability of the token (from generate's `return_logprobs`, computed in the
decode loop, so no [B, T, V] logits leave the device). The answer's `confidence` is the product of `probs`
and its `code` the largest of `codes`, the end token's included.

Not here: reading items (items.py), the metrics (metrics.py).
"""
from __future__ import annotations

import numpy as np

from prisma_jax.apps.evaluation.items import Item
from prisma_jax.apps.evaluation.metrics import normalize


def end_ids(model, processor) -> list[int]:
    """The end token(s): the checkpoint's generation config, else the tokenizer's `<|im_end|>`."""
    eos = model.generation_config.get("eos_token_id", processor.ids["eos_token_id"])
    return [int(e) for e in np.ravel(eos)]


def answer_items(model, processor, items: list[Item], batch: int, max_new_tokens: int, progress=None) -> list[dict]:
    """One answers.jsonl row per item (docs/eval.md): the prediction, whether it matches the reference, its
    confidence and code, and its trace. `progress`: anything with `update(n)` (a tqdm bar)."""
    eos = end_ids(model, processor)
    pad = model.generation_config.get("pad_token_id", processor.pad_token_id)
    size = min(batch, len(items))
    rows = []
    for start in range(0, len(items), size):
        chunk = items[start:start + size]
        convs = [it.messages for it in chunk] + [chunk[-1].messages] * (size - len(chunk))
        enc = processor(messages=convs, add_generation_prompt=True)
        res = model.generate(enc["input_ids"], enc["attention_mask"], enc.get("pixel_values"),
                             enc.get("image_grid_thw"), max_new_tokens=max_new_tokens, temperature=0.0,
                             eos_token_id=eos, pad_token_id=pad, return_logprobs=True)
        for i, it in enumerate(chunk):
            n = int(res.lengths[i])
            ids = res.tokens[i, :n]
            ended = n > 0 and int(ids[-1]) in eos
            prediction = processor.decode(ids[:-1] if ended else ids).strip()
            probs = np.exp(res.logprobs[i, :n].astype(np.float64))
            codes = [int(c) for c in res.codes[i, :n]]
            rows.append({
                "index": it.index, "id": it.id, "group": it.group, "answerable": it.answerable,
                "reference": it.reference, "prediction": prediction,
                "correct": normalize(prediction) == normalize(it.reference), "ended": bool(ended),
                "confidence": float(np.prod(probs)), "code": max(codes),
                "tokens": processor.tokenizer.convert_ids_to_tokens([int(t) for t in ids]),
                "token_ids": [int(t) for t in ids], "codes": codes, "probs": [float(p) for p in probs],
                "meta": it.meta,
            })
        if progress is not None:
            progress.update(len(chunk))
    return rows
