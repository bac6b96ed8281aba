"""Demo tuning probe: train the demo's model in-process and score held-out answers per question type as it learns.

    .venv/bin/python benchmarks/demo_probe.py [--steps 2000] [--every 500] [--train-images 3000]
        [--questions-per-image 2] [--types color,shape,...] [--pos-embed-std S] [section.key=value ...]

What `prisma demo` trains (configs/demo.yaml, the same data pipeline, step and schedule), without the
conversion and generation stages: every `--every` steps, the held-out questions are scored teacher-forced —
an answer counts when the argmax at each of its supervised positions (its words and the end token) is the label's
token. That equals greedy generation of the label. It prints the answerable accuracy and the accuracy per
question type ("unanswerable"/"ambiguous" pooled by kind). About 80 s per 500 steps on 2 cores.

`--types` restricts the questions to some types; `--pos-embed-std` redraws the vision tower's position table
at that scale (the default init is normal(0, 0.02)). Both are for diagnosis (docs/benchmarks.md, demo probes).
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--every", type=int, default=500)
    ap.add_argument("--train-images", type=int, default=3000)
    ap.add_argument("--questions-per-image", type=int, default=2)
    ap.add_argument("--types", default=None, help="comma-separated question types (default: all)")
    ap.add_argument("--pos-embed-std", type=float, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("overrides", nargs="*", metavar="section.key=value")
    args = ap.parse_args(argv)

    import jax

    from prisma_jax.demo import dataset as D
    from prisma_jax.demo.run import DEFAULT_CONFIG
    from prisma_jax.processing import build_tokenizer
    from train import data as data_mod
    from train.config import load_train_config
    from train.step import init_state, make_train_step, micro, training_logits

    words = list(D.VOCABULARY)
    if args.types:
        types = tuple(args.types.split(","))
        known = D.QUESTION_TYPES + D.PROBE_TYPES
        if set(types) - set(known):
            raise SystemExit(f"unknown question types {sorted(set(types) - set(known))}; known: {', '.join(known)}")
        if set(types) & set(D.PROBE_TYPES):
            words += D.PROBE_WORDS
        D.QUESTION_TYPES = types
    work = tempfile.mkdtemp(prefix="demo_probe-")
    data_dir, tok_dir = os.path.join(work, "data"), os.path.join(work, "tokenizer")
    info = D.build_dataset(data_dir, args.train_images, 200, args.questions_per_image, args.seed)
    n = D.IMAGE_SIZE * D.IMAGE_SIZE
    vocab = build_tokenizer(tok_dir, words, min_pixels=n, max_pixels=n)["vocab_size"]
    base = [f"data.processor={tok_dir}", f"train.steps={args.steps}", f"model.text.vocab_size={vocab}",
            *args.overrides]
    cfg, _ = load_train_config(DEFAULT_CONFIG, [f"data.path={info['train']}", *base])

    held = D.read_jsonl(info["heldout"])
    held_path = os.path.join(data_dir, "heldout_conversations.jsonl")
    eval_batch = 40                                   # scored in order, in batches of 40
    held = held[:len(held) // eval_batch * eval_batch]
    D.write_jsonl(held_path, held, keys=("messages",))
    ecfg, _ = load_train_config(DEFAULT_CONFIG, [f"data.path={held_path}", "data.shuffle=false",
                                                 f"train.batch_size={eval_batch}", *base])

    dataset, dinfo = data_mod.build(cfg, os.path.join(work, "wd"))
    print(f"data: {dinfo.line()}; held-out {len(held)} questions", flush=True)
    batches = iter(dataset)
    state = init_state(cfg)
    if args.pos_embed_std is not None:
        pe = state.params["vision"]["pos_embed"]["embedding"]
        new = np.random.default_rng(args.seed + 1).normal(0, args.pos_embed_std, pe.shape).astype(np.float32)
        vision = {**state.params["vision"], "pos_embed": {"embedding": jax.numpy.asarray(new)}}
        state = state._replace(params={**state.params, "vision": vision})
    step = jax.jit(make_train_step(cfg, state.params), donate_argnums=0)

    @jax.jit
    def predict(params, batch):
        mb, targets = micro(batch, 0)
        return training_logits(ecfg, params, mb, targets)[0].argmax(-1), targets

    def evaluate() -> str:
        eval_set, einfo = data_mod.build(ecfg, os.path.join(work, "wd_eval"))
        assert einfo.records == len(held), einfo.line()      # none dropped: rows line up with `held`
        it = iter(eval_set)
        right = []
        for _ in range(len(held) // eval_batch):
            pred, tg = (np.asarray(a) for a in predict(state.params, next(it)))
            right += [bool((p[t >= 0] == t[t >= 0]).all()) for p, t in zip(pred, tg)]
        by: dict[str, list] = {}
        for r, ok in zip(held, right):
            by.setdefault(r["type"] if r["kind"] == "answerable" else r["kind"], []).append(ok)
        answerable = [ok for r, ok in zip(held, right) if r["kind"] == "answerable"]
        return (f"answerable {np.mean(answerable):.3f} | "
                + " ".join(f"{k} {np.mean(v):.2f}" for k, v in sorted(by.items())))

    t0, losses = time.perf_counter(), []
    try:
        for i in range(args.steps):
            state, m = step(state, next(batches))
            losses.append(float(m["loss"]))
            if (i + 1) % args.every == 0 or i + 1 == args.steps:
                print(f"step {i + 1} loss {np.mean(losses[-args.every:]):.4f} {time.perf_counter() - t0:.0f}s "
                      f"{evaluate()}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
