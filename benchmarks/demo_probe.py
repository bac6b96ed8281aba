"""Demo tuning probe: train the demo's model in-process and score held-out answers per question type as it learns.

    .venv/bin/python benchmarks/demo_probe.py [--steps 3000] [--every 500] [--train-images 20000]
        [--questions-per-image 1] [--caption-share 0.5] [--types color,shape,...] [--pos-embed-std S]
        [section.key=value ...]

What `prisma demo` trains (configs/demo.yaml, the same data, init, pipeline, step and schedule), without the
conversion and generation stages: every `--every` steps, the held-out questions are scored teacher-forced —
an answer counts when the argmax at each of its supervised positions (its words and the end token) is the label's
token. That equals greedy generation of the label. It prints the answerable accuracy and the accuracy per
question type ("unanswerable"/"ambiguous" pooled by kind). About 80 s per 500 steps on 2 cores.

`--types` restricts the questions to some types (a type listed twice is drawn twice as often); "answerable" then
pools the demo's own types, when there are any, and the diagnostic types are scored apart. `--caption-share` is
the share of training images captioned instead of questioned; `--pos-embed-std` the scale of the vision tower's
position table (the demo's defaults; the model's own init is normal(0, 0.02)). For diagnosis (docs/demo.md).
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
    ap.add_argument("--steps", type=int, default=None, help="default: the config's")
    ap.add_argument("--every", type=int, default=500)
    ap.add_argument("--train-images", type=int, default=None, help="default: the demo's")
    ap.add_argument("--questions-per-image", type=int, default=None, help="default: the demo's")
    ap.add_argument("--heldout-images", type=int, default=None, help="default: the demo's")
    ap.add_argument("--types", default=None, help="comma-separated question types (default: all)")
    ap.add_argument("--caption-share", type=float, default=None)
    ap.add_argument("--pos-embed-std", type=float, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("overrides", nargs="*", metavar="section.key=value")
    args = ap.parse_args(argv)

    import jax

    from prisma_jax.apps.demo import dataset as D
    from prisma_jax.apps.demo.run import DEFAULT_CONFIG, POS_EMBED_STD, demo_init
    from prisma_jax.host.processing import build_tokenizer
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
    sizes = {"n_train_images": args.train_images, "n_heldout_images": args.heldout_images,
             "questions_per_image": args.questions_per_image,
             "caption_share": args.caption_share}
    info = D.build_dataset(data_dir, seed=args.seed, **{k: v for k, v in sizes.items() if v is not None})
    n = D.IMAGE_SIZE * D.IMAGE_SIZE
    vocab = build_tokenizer(tok_dir, words, min_pixels=n, max_pixels=n)["vocab_size"]
    base = [f"data.processor={tok_dir}", f"model.text.vocab_size={vocab}", *args.overrides]
    if args.steps:
        base.append(f"train.steps={args.steps}")
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
    std = POS_EMBED_STD if args.pos_embed_std is None else args.pos_embed_std
    state = init_state(cfg, demo_init(cfg.model, args.seed, std))         # the demo's init (`prisma demo`)
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
        apart = any(r["type"] not in D.PROBE_TYPES for r in held)      # score diagnostic types apart
        answerable = [ok for r, ok in zip(held, right)
                      if r["kind"] == "answerable" and not (apart and r["type"] in D.PROBE_TYPES)]
        return (f"answerable {np.mean(answerable):.3f} | "
                + " ".join(f"{k} {np.mean(v):.2f}" for k, v in sorted(by.items())))

    t0, losses = time.perf_counter(), []
    try:
        for i in range(cfg.train.steps):
            state, m = step(state, next(batches))
            losses.append(float(m["loss"]))
            if (i + 1) % args.every == 0 or i + 1 == cfg.train.steps:
                print(f"step {i + 1} loss {np.mean(losses[-args.every:]):.4f} {time.perf_counter() - t0:.0f}s "
                      f"{evaluate()}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
