"""Training throughput with and without `data.packing`, side by side in one process.

    .venv/bin/python benchmarks/packing.py [--config configs/bench_58m.yaml] [--steps 5] [--warmup 1]
                                           [--conversations 400] [key=value overrides]

A JSONL of text conversations of mixed lengths is written deterministically into a temporary directory (a
word-level tokenizer from `prisma_jax.host.processing.build_tokenizer`; lengths log-uniform between 24 tokens and
`train.seq_len`, half prompt, half reply), then the same config trains on it padded (one conversation a row)
and packed (first-fit, several a row): the same compiled shapes, so the step time is the same and what changes
is how many of a step's `batch_size × seq_len` slots hold real tokens. Batches are drawn before the clock
starts; each side compiles once, runs `--warmup` steps, then `--steps` timed steps. Reported: the median step
time, real (non-padding) tokens per step (mean over the timed batches), real and supervised tokens per second
(per step / median step time), and the packed / padded ratio.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import prisma_jax  # noqa: E402,F401  its host-allocator settings (prisma_jax/core/runtime.py)


def write_conversations(directory: str, n: int, seq_len: int, seed: int = 0) -> tuple[str, str]:
    """(JSONL path, processor dir): `n` text conversations, lengths log-uniform in [24, seq_len] tokens."""
    from prisma_jax.host.processing import build_tokenizer
    from train.tiny_sft import WORDS
    proc = os.path.join(directory, "proc")
    build_tokenizer(proc, WORDS)
    rng = np.random.default_rng(seed)
    overhead = 12                                  # chat-template tokens around the two messages (about)
    path = os.path.join(directory, "train.jsonl")
    with open(path, "w") as f:
        for _ in range(n):
            total = int(np.exp(rng.uniform(np.log(24), np.log(seq_len)))) - overhead
            k = max(total // 2, 1)
            words = rng.choice(WORDS, size=total)
            f.write(json.dumps({"messages": [{"role": "user", "content": " ".join(words[:k])},
                                             {"role": "assistant", "content": " ".join(words[k:]) or "."}]}) + "\n")
    return path, proc


def bench(cfg, workdir: str, steps: int, warmup: int) -> dict:
    import jax

    from train import data, step
    ds, info = data.build(cfg, workdir)
    it = iter(ds)
    batches = [next(it) for _ in range(warmup + steps)]
    st = step.init_state(cfg)
    fn = jax.jit(step.make_train_step(cfg, st.params), donate_argnums=0)
    t = time.perf_counter()
    compiled = fn.lower(st, batches[0]).compile()
    compile_s = time.perf_counter() - t
    for b in batches[:warmup]:
        st, m = compiled(st, b)
        jax.block_until_ready(m)
    times = []
    for b in batches[warmup:]:
        t = time.perf_counter()
        st, m = compiled(st, b)
        jax.block_until_ready(m)
        times.append(time.perf_counter() - t)
        print(f"{'packed' if cfg.data.packing else 'padded'}: step {len(times)} {times[-1]:.2f} s",
              file=sys.stderr, flush=True)
    timed = batches[warmup:]
    real = np.mean([np.sum(b.attention_mask > 0) for b in timed])
    sup = np.mean([np.sum(b.targets >= 0) for b in timed])
    step_s = float(np.median(times))            # the median: robust to other jobs on a shared machine
    return {"data": info.line(), "compile_s": compile_s, "step_s": step_s, "step_times": times,
            "real_tokens_per_step": float(real), "slots_per_step": cfg.train.batch_size * cfg.train.seq_len,
            "real_tokens_per_sec": float(real) / step_s, "supervised_tokens_per_sec": float(sup) / step_s,
            "loss": float(m["loss"])}


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="configs/bench_58m.yaml")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--conversations", type=int, default=400)
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args(argv)
    from train.config import load_train_config
    with tempfile.TemporaryDirectory() as tmp:
        base, _ = load_train_config(a.config, a.overrides)
        path, proc = write_conversations(tmp, a.conversations, base.train.seq_len)
        res = {}
        for packing in (False, True):
            cfg, _ = load_train_config(a.config, [*a.overrides, "data.source=jsonl", f"data.path={path}",
                                                  f"data.processor={proc}", "data.max_images=0",
                                                  f"data.packing={str(packing).lower()}"])
            res["packed" if packing else "padded"] = bench(cfg, os.path.join(tmp, f"wd_{packing}"), a.steps,
                                                           a.warmup)
    t = base.train
    print(f"{a.config}: batch {t.batch_size} × seq_len {t.seq_len}, introspection_passes "
          f"{t.introspection_passes}, {a.conversations} conversations, {a.steps} timed steps")
    print("| layout | step (s) | real tokens / step | real tokens/s | supervised tokens/s |")
    print("| --- | --- | --- | --- | --- |")
    for name, r in res.items():
        print(f"| {name} | {r['step_s']:.2f} | {r['real_tokens_per_step']:.0f} of {r['slots_per_step']} | "
              f"{r['real_tokens_per_sec']:.0f} | {r['supervised_tokens_per_sec']:.0f} |")
    ratio = res["packed"]["real_tokens_per_sec"] / res["padded"]["real_tokens_per_sec"]
    print(f"packed / padded real tokens/s: {ratio:.2f}x")
    print(json.dumps(res))


if __name__ == "__main__":
    main()
