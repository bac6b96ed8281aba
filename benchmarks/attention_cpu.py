"""Attention forward + backward on XLA:CPU at configs/bench_58m.yaml's shapes: einsum vs blocked vs jax.nn.

    .venv/bin/python benchmarks/attention_cpu.py [--seq 512 2048] [--tokens 4096] [--reps 5]
    .venv/bin/python benchmarks/attention_cpu.py --step einsum blocked none [--rounds 4]

Kernel mode (default): for each sequence length S (batch B = tokens / S, so 8 × 512 = bench_58m's batch),
8 query / 4 kv heads of 64, float32, the causal mask (`attention.causal`, built inside the jit as the model
does), it times `jax.jit(jax.grad(sum(attention(q, k, v) · dO)))` w.r.t. q, k, v (one forward and one backward):
  einsum          prisma_jax.nn.attention.attention(..., "xla") (dense [B, KV, G, S, S] float32 scores)
  blocked QxK     prisma_jax.nn.attention_blocked.blocked_attention, query blocks Q, key chunks K (K = S: one chunk)
  jax.nn causal   jax.nn.dot_product_attention(implementation='xla', is_causal=True), no mask array
  jax.nn mask     the same with the dense mask as `mask` [B, 1, S, S]
Variants run in interleaved rounds (best of --reps for each) so that load from other processes hits all of
them alike; it prints the best time, its ratio to einsum, XLA's FLOP estimate and temporaries.

Step mode (--step): benchmarks/train.py's JAX step (train.step.make_train_step, jit, state donated) on
bench_58m, compiled once per named implementation of `prisma_jax.nn.text.attention` (einsum, blocked with its
default blocks, or none: a free stand-in `q + repeated v` that keeps the shapes, so the step with "none" bounds
what any attention could save), then timed one step of each per round; prints best and median per step.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import prisma_jax  # noqa: E402,F401  first: its host-allocator settings (prisma_jax/core/runtime.py)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from prisma_jax.nn.attention import attention as attention_entry  # noqa: E402
from prisma_jax.nn.mask import causal
from prisma_jax.nn.attention_blocked import blocked_attention  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 8, 4, 64


def attention(q, k, v, mask, impl="xla", **kw):
    """The einsum attention, the "xla" implementation of prisma_jax.nn.attention."""
    return attention_entry(q, k, v, mask, "xla", **kw)


def jax_nn(causal_only: bool):
    def f(q, k, v, mask):
        if causal_only:
            return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")
        return jax.nn.dot_product_attention(q, k, v, mask=mask.dense()[:, None], implementation="xla")
    return f


def blocked(bq: int, bk: int):
    return lambda q, k, v, mask, *a, **kw: blocked_attention(q, k, v, mask, block_q=bq, block_k=bk)


def free_attention(q, k, v, mask, *a, **kw):
    """A shape-keeping stand-in with no scores: q plus v repeated over the query groups."""
    return q + jnp.repeat(v, q.shape[2] // v.shape[2], axis=2)


def variants(s: int) -> dict:
    out = {"einsum": attention}
    for bq, bk in dict.fromkeys(((64, 64), (128, 128), (128, 512), (128, s), (256, 256), (64, s))):
        if bq <= s and bk <= s:
            out[f"blocked {bq}x{bk}"] = blocked(bq, bk)
    out["jax.nn causal"] = jax_nn(True)
    out["jax.nn mask"] = jax_nn(False)
    return out


def grad_fn(attn):
    def loss(q, k, v, valid, d_out):
        return (attn(q, k, v, causal(valid)).astype(jnp.float32) * d_out).sum()
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def kernel_bench(seqs, tokens, reps):
    rng = np.random.default_rng(0)
    for s in seqs:
        b = max(1, tokens // s)
        q, k, v, d_out = (jnp.asarray(rng.standard_normal((b, s, n, HEAD_DIM)), jnp.float32)
                          for n in (HEADS, KV_HEADS, KV_HEADS, HEADS))
        args = (q, k, v, jnp.ones((b, s), bool), d_out)
        compiled, info = {}, {}
        ref = None
        for name, attn in variants(s).items():
            c = grad_fn(attn).lower(*args).compile()
            cost = c.cost_analysis()
            cost = cost[0] if isinstance(cost, list) else cost
            info[name] = (float(cost.get("flops", float("nan"))), c.memory_analysis().temp_size_in_bytes)
            g = jax.block_until_ready(c(*args))
            if ref is None:
                ref = g
            err = max(float(jnp.abs(a - r).max()) for a, r in zip(g, ref))
            info[name] += (err,)
            compiled[name] = c
        best = {n: float("inf") for n in compiled}
        for _ in range(reps):
            for name, c in compiled.items():
                t = time.perf_counter()
                jax.block_until_ready(c(*args))
                best[name] = min(best[name], time.perf_counter() - t)
        print(f"\nS = {s}, B = {b}, {HEADS}/{KV_HEADS} heads of {HEAD_DIM}, float32, causal; forward + backward, "
              f"best of {reps}")
        print("| attention | ms | / einsum | XLA GFLOP | temp MiB | max abs grad diff |")
        print("| --- | --- | --- | --- | --- | --- |")
        for name in compiled:
            flops, temp, err = info[name]
            print(f"| {name} | {1e3 * best[name]:.0f} | {best[name] / best['einsum']:.2f} | {flops / 1e9:.1f} | "
                  f"{temp / 2**20:.0f} | {err:.1e} |", flush=True)


def step_bench(names, rounds, config):
    import prisma_jax.nn.text as text
    from train import data, step
    from train.config import load_train_config
    impls = {"einsum": attention, "blocked": blocked(None, None), "none": free_attention}
    original = text.attention
    cfg, _ = load_train_config(config, [])
    ds, _ = data.build(cfg, "/tmp/prisma_bench_train")
    it = iter(ds)
    batch = next(it)
    runs = {}
    for name in dict.fromkeys(names):                 # trace each step with its attention, then restore it
        text.attention = impls[name]
        st = step.init_state(cfg)
        compiled = jax.jit(step.make_train_step(cfg, st.params), donate_argnums=0).lower(st, batch).compile()
        st, m = compiled(st, batch)                   # warm-up
        jax.block_until_ready(m)
        runs[name] = [compiled, st, [], compiled.memory_analysis().temp_size_in_bytes]
    text.attention = original
    for _ in range(rounds):                           # interleaved: one step of each per round
        for name, r in runs.items():
            b = next(it)
            t = time.perf_counter()
            r[1], m = r[0](r[1], b)
            jax.block_until_ready(m)
            r[2].append(time.perf_counter() - t)
    print(f"\n{config}: JAX train step, {rounds} interleaved rounds after one warm-up step")
    print("| attention | best s | median s | temp MiB |")
    print("| --- | --- | --- | --- |")
    for name, r in runs.items():
        print(f"| {name} | {min(r[2]):.2f} | {np.median(r[2]):.2f} | {r[3] / 2**20:.0f} |", flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--tokens", type=int, default=4096, help="B = tokens / S")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--step", nargs="+", choices=["einsum", "blocked", "none"])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--config", default="configs/bench_58m.yaml")
    a = ap.parse_args(argv)
    if a.step:
        step_bench(a.step, a.rounds, a.config)
    else:
        kernel_bench(a.seq, a.tokens, a.reps)


if __name__ == "__main__":
    main()
