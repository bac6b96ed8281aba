"""Training throughput: prisma-jax's train step on configs/bench_58m.yaml vs transformers + torch.optim.AdamW.

    .venv/bin/python benchmarks/train.py [--config configs/bench_58m.yaml] [--steps 8] [--warmup 2] [--skip-torch]
                                         [--device auto|cpu|cuda] [section.key=value ...]

Both sides: the same dimensions (Qwen3 text decoder, 8 × 512, V = 32,000, untied), the same batch
(B × S random tokens, every position supervised), float32, AdamW with global-norm clipping. The JAX side is
`train.step.make_train_step` under `jax.jit` (state donated), fed by the grain synthetic source; its
ahead-of-time memory comes from `compiled.memory_analysis()`. MFU = model FLOPs/s over the measured
float32 matmul peak of this machine (the best of a JAX and a torch 2048² matmul loop, measured in the same
run), with model FLOPs = 6·N_matmul·tokens + 12·L·S·H·hd·tokens (attention scores and values, as computed).
With `train.compute_dtype=bfloat16` both sides compute in bf16 over float32 master weights (the torch side
under `torch.autocast`) and the peak is that of bf16 matmuls. torch runs on `--device` (auto: CUDA when torch
sees a GPU; then it runs first and frees its memory before the JAX step, which holds the rest); the JAX side
runs on JAX's default backend. On an accelerator the peak loop multiplies 8192² matrices.
Prints one Markdown table row per side and a JSON line. Both sides run under the host-allocator settings that
importing prisma_jax applies (prisma_jax/runtime.py; `PRISMA_MALLOC_TUNING=0` turns them off).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import prisma_jax  # noqa: E402,F401  first: its host-allocator settings (prisma_jax/runtime.py) then hold for both sides


def matmul_peak(dtype="float32", device="cpu", reps=10) -> float:
    """FLOP/s of the best of a jitted JAX and a torch (on `device`) n × n matmul loop, in `dtype`: n = 2048 on
    the CPU, 8192 on an accelerator."""
    import jax
    import jax.numpy as jnp
    import torch
    n = 2048 if jax.default_backend() == "cpu" else 8192
    a = jnp.ones((n, n), dtype)
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    best = 0.0
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(reps):
            f(a).block_until_ready()
        best = max(best, 2 * n**3 * reps / (time.perf_counter() - t))
    n = 2048 if device == "cpu" else 8192
    x = torch.ones(n, n, dtype=getattr(torch, dtype), device=device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    x @ x
    sync()
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(reps):
            x @ x
        sync()
        best = max(best, 2 * n**3 * reps / (time.perf_counter() - t))
    return best


def model_flops_per_step(cfg) -> float:
    t, b, s = cfg.model.text, cfg.train.batch_size, cfg.train.seq_len
    d, hd = t.hidden_size, t.head_dim
    per_layer = d * hd * (2 * t.num_attention_heads + 2 * t.num_key_value_heads) + 3 * d * t.intermediate_size
    n_mm = t.num_hidden_layers * per_layer + d * t.vocab_size
    attn = 12 * t.num_hidden_layers * s * t.num_attention_heads * hd
    fwd_passes = cfg.train.introspection_passes - 1      # stop-gradient passes: forward only (2·N per token)
    return b * s * (6 * n_mm + attn + fwd_passes * (2 * n_mm + attn / 3))


def bench_jax(cfg, steps, warmup):
    import jax

    from train import data, step
    ds, _ = data.build(cfg, "/tmp/prisma_bench_train")
    it = iter(ds)
    st = step.init_state(cfg)
    batch = next(it)
    fn = jax.jit(step.make_train_step(cfg, st.params), donate_argnums=0)
    t = time.perf_counter()
    compiled = fn.lower(st, batch).compile()
    compile_s = time.perf_counter() - t
    print(f"jax: compiled in {compile_s:.0f} s", file=sys.stderr, flush=True)
    mem = compiled.memory_analysis()
    for _ in range(warmup):
        st, m = compiled(st, next(it))
        jax.block_until_ready(m)
    times = []
    for _ in range(steps):
        b = next(it)
        t = time.perf_counter()
        st, m = compiled(st, b)
        jax.block_until_ready(m)
        times.append(time.perf_counter() - t)
        print(f"jax: step {len(times)} {times[-1]:.2f} s", file=sys.stderr, flush=True)
    return {"step_s": float(np.median(times)), "compile_s": compile_s, "loss": float(m["loss"]),
            "temp_bytes": int(mem.temp_size_in_bytes), "arg_bytes": int(mem.argument_size_in_bytes),
            "out_bytes": int(mem.output_size_in_bytes)}


def bench_torch(cfg, steps, warmup, device="cpu"):
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM
    torch.set_num_threads(os.cpu_count() or 1)
    t = cfg.model.text
    hc = Qwen3Config(vocab_size=t.vocab_size, hidden_size=t.hidden_size, intermediate_size=t.intermediate_size,
                     num_hidden_layers=t.num_hidden_layers, num_attention_heads=t.num_attention_heads,
                     num_key_value_heads=t.num_key_value_heads, head_dim=t.head_dim,
                     tie_word_embeddings=cfg.model.tie_word_embeddings,
                     max_position_embeddings=t.max_position_embeddings, rope_theta=t.rope_theta)
    hc._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3ForCausalLM(hc).train()
    bf16 = cfg.train.compute_dtype == "bfloat16"     # float32 master weights, bf16 matmuls (as the JAX step)
    o = cfg.optimizer
    opt = torch.optim.AdamW(model.parameters(), lr=o.lr, betas=(o.b1, o.b2), eps=o.eps,
                            weight_decay=o.weight_decay)
    g = torch.Generator().manual_seed(0)

    def one():
        ids = torch.randint(0, t.vocab_size, (cfg.train.batch_size, cfg.train.seq_len), generator=g).to(device)
        with torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=bf16):
            loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), o.clip_norm or 1e9)
        opt.step()
        return float(loss)          # waits for the step (a GPU's too)

    for _ in range(warmup):
        one()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        loss = one()
        times.append(time.perf_counter() - t0)
        print(f"torch: step {len(times)} {times[-1]:.2f} s", file=sys.stderr, flush=True)
    n = sum(p.numel() for p in model.parameters())
    return {"step_s": float(np.median(times)), "loss": loss, "params": n, "device": device}


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="configs/bench_58m.yaml")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--skip-torch", action="store_true")
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                    help="torch's device (auto: CUDA when torch sees a GPU)")
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args(argv)
    import jax
    import torch

    from train.config import load_train_config
    cfg, _ = load_train_config(a.config, a.overrides)
    device = a.device if a.device != "auto" else "cuda" if torch.cuda.is_available() else "cpu"
    tokens = cfg.train.batch_size * cfg.train.seq_len
    flops = model_flops_per_step(cfg)
    peak = matmul_peak(cfg.train.compute_dtype, device)
    res = {"ld_preload": os.environ.get("LD_PRELOAD", ""),
           "malloc_tuning": os.environ.get("PRISMA_MALLOC_TUNING", "1"), "peak_gflops": peak / 1e9,
           "model_gflop_per_step": flops / 1e9, "tokens_per_step": tokens, "config": a.config,
           "overrides": a.overrides, "compute_dtype": cfg.train.compute_dtype, "attention": cfg.model.attention,
           "device": str(jax.devices()[0].device_kind), "torch_device": device}
    if not a.skip_torch and device == "cuda":       # first, so that its freed memory goes to the JAX step
        res["torch"] = bench_torch(cfg, a.steps, a.warmup, device)
        gc.collect()
        torch.cuda.empty_cache()
    res["jax"] = bench_jax(cfg, a.steps, a.warmup)
    if not a.skip_torch and device != "cuda":
        res["torch"] = bench_torch(cfg, a.steps, a.warmup, device)
    print(f"{cfg.train.compute_dtype} matmul peak {peak / 1e9:.1f} GFLOP/s; {flops / 1e9:.1f} model GFLOP per step "
          f"of {tokens} tokens")
    print("| side | step (s) | tokens/s | MFU | AOT memory |")
    print("| --- | --- | --- | --- | --- |")
    for side in ("jax", "torch"):
        if side not in res:
            continue
        r = res[side]
        tps = tokens / r["step_s"]
        r["tokens_per_sec"], r["mfu"] = tps, flops / r["step_s"] / peak
        memtxt = (f"temp {r['temp_bytes'] / 2**20:.0f} MiB + args {r['arg_bytes'] / 2**20:.0f} MiB"
                  if side == "jax" else "—")
        name = "prisma-jax (jit, optax AdamW)" if side == "jax" else "transformers + torch.optim.AdamW"
        print(f"| {name} | {r['step_s']:.2f} | {tps:.0f} | {100 * r['mfu']:.0f} % | {memtxt} |")
    if "torch" in res:
        print(f"speed-up: {res['torch']['step_s'] / res['jax']['step_s']:.2f}x")
    print(json.dumps(res))


if __name__ == "__main__":
    main()
