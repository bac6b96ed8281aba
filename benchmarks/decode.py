"""Decode throughput: prisma-jax vs transformers, same random config, one process, side by side.

    .venv/bin/python benchmarks/decode.py [--batches 1 8] [--prompt 128] [--new 64] [--repeats 3] [--quick]
    .venv/bin/python benchmarks/decode.py --dtype bfloat16 --batches 1 [--config configs/bench_1p7b.yaml] [overrides]

Config (issue 3): Qwen3-VL text 8 layers × 1024 (16 heads, 4 kv heads, head_dim 64, intermediate 3072,
V = 151,936, untied) + a 2^16 × 1024 uncertainty table, a 1-block vision tower that decoding never runs.
Greedy, no end token (every row runs to --new tokens). Both sides are timed the same way: prisma-jax runs
generate.py's compiled `prefill` and then its compiled `decode` loop (the programs `generate` runs);
transformers runs one forward over the prompt, then one cached forward per token (`generate` minus its
Python bookkeeping). Reported per batch size:

* decode tokens/s: B ÷ the decode-only step time, (time of new − 1 steps − time of 1 step) / (new − 2), so
  that what a decode call costs once is left out; both sides, and the ratio;
* the fp32 memory roofline: weight bytes read per decode step ÷ the fastest read bandwidth measured (a jitted
  read of a 1 GiB array, or the fp32 matrix-vector products below); and the bytes/s XLA:CPU reads weights at
  in fp32 and bf16 matrix-vector products;
* tokens/s of the best whole run (prefill + all steps), both sides;
* first-call compile time (first run − best run);
* mechanism cost, two ways: the same loop with `introspection=False` (no injection, no entropy) — the median
  over rounds of each round's on/off step-time ratio, since rounds seconds apart differ by more than the
  mechanism costs; and the mechanism's own operations timed alone at the run's shapes (the entropy and code of
  `[B, V]` logits, the table row gathered and added for B tokens; best of 200 calls) as a share of the step;
* bf16 weights.

`--dtype bfloat16` runs both sides in bf16 (weights and KV cache) instead, with no separate bf16 variant; that
is how an accelerator is measured (benchmarks/gpu.py). There the roofline uses the bandwidth of a jitted copy of
a large array (read once, written once), and `--nominal-bw` adds the fraction of the device's nominal
bandwidth. `--config` takes the model section of a training YAML (with `section.key=value` overrides) instead
of the built-in config; transformers runs on `--device` (auto: CUDA when torch sees a GPU, else the CPU).

Prints a Markdown table (paste into docs/benchmarks.md) and one JSON line.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import prisma_jax  # noqa: E402,F401  first: its host-allocator settings (prisma_jax/core/runtime.py) then hold for both sides


def text_config(quick: bool):
    """The built-in config (transformers' Qwen3VLConfig): 408 M parameters, or a small one with `quick`."""
    from transformers import Qwen3VLConfig
    layers, hidden, inter, vocab = (2, 256, 768, 32000) if quick else (8, 1024, 3072, 151936)
    text = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                num_attention_heads=16 if not quick else 4, num_key_value_heads=4 if not quick else 2,
                head_dim=64, hidden_act="silu", rms_norm_eps=1e-6, max_position_embeddings=4096,
                rope_parameters={"rope_type": "default", "rope_theta": 5e6, "mrope_section": [12, 10, 10],
                                 "mrope_interleaved": True})
    vision = dict(depth=1, hidden_size=64, num_heads=2, intermediate_size=128, patch_size=16, temporal_patch_size=2,
                  spatial_merge_size=2, out_hidden_size=hidden, num_position_embeddings=64,
                  deepstack_visual_indexes=[0], hidden_act="gelu_pytorch_tanh", in_channels=3)
    return Qwen3VLConfig(text_config=text, vision_config=vision, image_token_id=151655, video_token_id=151656,
                         vision_start_token_id=151652, vision_end_token_id=151653, tie_word_embeddings=False)


def read_bandwidth() -> float:
    """Bytes/s of the fastest jitted read of a 1 GiB float32 array (best of 5 each): a full sum, and a
    matrix-vector product — the operation a decode step is made of. (A column reduction, `sum(axis=0)`, runs
    at a small fraction of this on XLA:CPU and must not be used.)"""
    import jax
    import jax.numpy as jnp
    w = jnp.ones((1 << 18, 1024), jnp.float32)
    v = jnp.ones((1024,), jnp.float32)
    best = 0.0
    for f, args in ((jax.jit(jnp.sum), (w,)), (jax.jit(jnp.matmul), (w, v))):
        f(*args).block_until_ready()
        best = max(best, w.nbytes / min(_timed(lambda: f(*args).block_until_ready()) for _ in range(5)))
    del w
    return best


def copy_bandwidth(nbytes: int) -> float:
    """Bytes/s moved by a jitted copy of an `nbytes` float32 array (`x * 1.5`: each byte read once and written
    once, so 2 × nbytes a call): best of 3 timings of 10 calls each."""
    import jax
    import jax.numpy as jnp
    x = jnp.ones((nbytes // 4,), jnp.float32)
    f = jax.jit(lambda a: a * 1.5)
    f(x).block_until_ready()
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(10):
            y = f(x)
        y.block_until_ready()
        best = min(best, (time.perf_counter() - t) / 10)
    del x, y
    return 2 * nbytes / best


def matvec_read_rates() -> dict:
    """Bytes/s of weights read by a jitted [1, 1024] × [1024, 3072] product, per weight dtype (best of 20 over
    16 matrices): explains the bf16 column — XLA:CPU converts a bf16 weight to float32 before each dot."""
    import jax
    import jax.numpy as jnp
    out = {}
    for dt in (jnp.float32, jnp.bfloat16):
        ws = [jnp.full((1024, 3072), 0.01 * (i + 1), dt) for i in range(16)]
        x = jnp.ones((1, 1024), dt)
        f = jax.jit(lambda ws, x: [x @ w for w in ws])
        jax.block_until_ready(f(ws, x))
        best = min(_timed(lambda: jax.block_until_ready(f(ws, x))) for _ in range(20))
        out[jnp.dtype(dt).name] = sum(w.nbytes for w in ws) / best
    return out


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def prisma_runner(model, ids, **kw):
    """A run of `new` tokens through generate.py's two compiled programs, as `generate` runs them — `prefill`,
    then one `decode` call for the remaining new − 1 tokens — and a second run whose decode call stops after
    one step (`max_new` is data: the same program). Returns (prefill s, decode s, one-step decode s)."""
    import jax

    from prisma_jax.infer import generate as G
    cfg, params = model.config, model.params

    def timed_decode(p, max_new):
        state = G.prefill(cfg, p.spec, params, p.batch, p.next_pos, p.sp, p.eos, p.pad, jax.random.key(0))
        state.tokens.block_until_ready()
        t = time.perf_counter()
        G.decode(cfg, p.spec, params, state, p.sp, p.eos, p.pad, np.int32(max_new)).tokens.block_until_ready()
        return time.perf_counter() - t

    def run(new):
        with model._precision():
            p = G.request(cfg, G.Inputs(ids), options=G.Options(max_new_tokens=new, **kw))
            t = time.perf_counter()
            G.prefill(cfg, p.spec, params, p.batch, p.next_pos, p.sp, p.eos, p.pad,
                      jax.random.key(0)).tokens.block_until_ready()
            pre = time.perf_counter() - t
            return pre, timed_decode(p, new), timed_decode(p, 2)
    return run


def hf_runner(hf, ids):
    """The same for transformers: one forward over the prompt, then one cached forward per greedy token
    (`generate` minus its Python bookkeeping), on the model's device (each step waits for a GPU to finish).
    Returns (prefill s, decode s, first decode step s)."""
    import torch
    dev = next(hf.parameters()).device
    x = torch.as_tensor(ids, device=dev)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    def run(new):
        steps = []
        with torch.no_grad():
            mask = torch.ones_like(x)
            t = time.perf_counter()
            out = hf(input_ids=x, attention_mask=mask, use_cache=True)
            tok = out.logits[:, -1].argmax(-1, keepdim=True)
            sync()
            pre = time.perf_counter() - t
            for _ in range(new - 1):
                t = time.perf_counter()
                mask = torch.cat([mask, torch.ones_like(tok)], dim=1)
                out = hf(input_ids=tok, attention_mask=mask, past_key_values=out.past_key_values, use_cache=True)
                tok = out.logits[:, -1].argmax(-1, keepdim=True)
                sync()
                steps.append(time.perf_counter() - t)
        return pre, sum(steps), steps[0]
    return run


def mechanism_ops_s(cfg, params, b: int, calls: int = 200) -> float:
    """Best time of the mechanism's own per-step work at batch b, jitted alone: the entropy and uint16 code of
    `[b, V]` float32 logits (uncertainty.py, §2) plus the table rows gathered and added to `[b, 1, D]` token
    embeddings (§3, `Uncertainty.__call__`)."""
    import jax
    import jax.numpy as jnp

    from prisma_jax.nn.model import bind
    from prisma_jax.nn.uncertainty import codes_from_logits
    rng = np.random.default_rng(1)
    logits = jnp.asarray(rng.normal(size=(b, cfg.text.vocab_size)).astype(np.float32) * 3)
    emb = jnp.asarray(rng.normal(size=(b, 1, cfg.text.hidden_size)).astype(np.float32))
    ids = jnp.asarray(rng.integers(0, 1000, (b, 1)), jnp.int32)
    codes = jnp.asarray(rng.integers(0, cfg.n_levels, (b, 1)), jnp.int32)
    @jax.jit
    def f(logits, emb, params, ids, codes):
        return codes_from_logits(logits, cfg.n_bits), bind(cfg, params).uncertainty(emb, ids, codes)
    jax.block_until_ready(f(logits, emb, params, ids, codes))
    best = float("inf")
    for _ in range(calls):
        best = min(best, _timed(lambda: jax.block_until_ready(f(logits, emb, params, ids, codes))))
    return best


def measure(runners: dict, new: dict, repeats: int) -> dict:
    """{name: {"first_s", "best_run_s", "best_step_s"}}: the best whole run (prefill + n − 1 decode steps, with
    n = new[name] tokens) and the best decode-only step time, (decode s − one-step decode s) / (n − 2), which leaves out what a
    decode call costs once (for prisma-jax: entering the compiled loop). The variants take turns, round after
    round, so that all of them see the same machine (this VM's memory speed varies 10× from second to second:
    docs/benchmarks.md); the best of `repeats` rounds is kept, and every round's step time in "step_s" (NaN for a
    round whose one-step call took as long as the whole decode call: too few steps to see past the noise)."""
    out = {}
    for k, r in runners.items():
        t = time.perf_counter()
        r(new[k])                                        # compiles (prisma-jax) / warms up (transformers)
        out[k] = {"first_s": time.perf_counter() - t, "best_run_s": float("inf"), "best_step_s": float("inf"),
                  "step_s": []}
    for i in range(repeats):
        print(f"  round {i + 1}/{repeats}", flush=True)
        for k, r in runners.items():
            pre, dec, one = r(new[k])
            out[k]["best_run_s"] = min(out[k]["best_run_s"], pre + dec)
            step = (dec - one) / (new[k] - 2) if dec > one else float("nan")      # noise above the steps' time
            out[k]["step_s"].append(step)
            if step == step:
                out[k]["best_step_s"] = min(out[k]["best_step_s"], step)
    return out


def build_configs(args):
    """(prisma-jax ModelConfig, transformers Qwen3VLConfig) of the same model: the built-in one, or the model
    section of `--config` (a training YAML) with its overrides."""
    from transformers import Qwen3VLConfig

    from prisma_jax.core.config import config_from_hf, config_to_hf
    if args.config:
        from train.config import load_train_config
        cfg = load_train_config(args.config, args.overrides)[0].model
        hf_cfg = Qwen3VLConfig.from_dict(config_to_hf(cfg))
    else:
        if args.overrides:
            raise SystemExit("decode.py: overrides need --config")
        hf_cfg = text_config(args.quick)
        cfg = config_from_hf(hf_cfg.to_dict())
    return (cfg if args.attention is None else cfg.replace(attention=args.attention)), hf_cfg


def hf_model(hf_cfg, dtype: str, device: str):
    """transformers' model, created on `device` ("auto": CUDA when torch sees a GPU) in `dtype`."""
    import torch
    from transformers import Qwen3VLForConditionalGeneration
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    with torch.device(device):
        hf = Qwen3VLForConditionalGeneration(hf_cfg)
    return hf.to(getattr(torch, dtype)).eval()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--bf16-new", type=int, default=9, help="tokens per bf16 run (its steps are slow on XLA:CPU)")
    ap.add_argument("--quick", action="store_true", help="a small config, to check the script runs")
    ap.add_argument("--no-hf", action="store_true", help="skip transformers (e.g. on an accelerator host)")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                    help="weights and KV cache of both sides (float32 also times a bf16 copy of prisma-jax's)")
    ap.add_argument("--attention", choices=("auto", "xla", "pallas"), default=None,
                    help="prisma-jax's attention kernels (default: the config's, auto)")
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="transformers' device")
    ap.add_argument("--config", help="a training YAML whose model section replaces the built-in config")
    ap.add_argument("--no-off", action="store_true", help="skip the mechanism-off variant")
    ap.add_argument("--nominal-bw", type=float, help="the device's nominal memory bandwidth in bytes/s")
    ap.add_argument("overrides", nargs="*", help="section.key=value overrides of --config")
    args = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp

    from prisma_jax import PrismaVL

    cfg, hf_cfg = build_configs(args)
    backend = jax.default_backend()
    if backend == "cpu":
        model = PrismaVL.from_config(cfg, seed=0, dtype=args.dtype, uncertainty_init="normal")
    else:               # one jitted program on the device (NumPy takes most of a minute for 1.7 B weights)
        from prisma_jax.nn.params import init_params
        model = PrismaVL(cfg, jax.jit(lambda k: init_params(cfg, k, jnp.dtype(args.dtype)))(jax.random.key(0)))
    tc = cfg.text
    el = jnp.dtype(args.dtype).itemsize
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(model.params))
    per_layer = (tc.hidden_size * tc.head_dim * (2 * tc.num_attention_heads + 2 * tc.num_key_value_heads)
                 + 3 * tc.hidden_size * tc.intermediate_size + 2 * tc.hidden_size + 2 * tc.head_dim)
    step_bytes = el * (tc.num_hidden_layers * per_layer + tc.hidden_size * tc.vocab_size + tc.hidden_size)
    kv_token_bytes = el * 2 * tc.num_hidden_layers * tc.num_key_value_heads * tc.head_dim   # per row and position
    copy_bw = copy_bandwidth(1 << 31 if backend != "cpu" else 1 << 28)
    mv = matvec_read_rates()
    if backend == "cpu":
        bw, bw_how = max(read_bandwidth(), mv["float32"]), "fastest jitted read (sum or matvec)"
    else:
        bw, bw_how = copy_bw, "jitted copy of a 2 GiB array (read + write)"
    roofline = bw / step_bytes
    load = os.getloadavg()[0]
    info = {"device": str(jax.devices()[0].device_kind), "backend": backend, "cores": os.cpu_count(),
            "dtype": args.dtype, "attention": cfg.attention, "config": args.config or ("quick" if args.quick else
                                                                                       "built-in 408M"),
            "params": n_params, "step_weight_bytes": step_bytes, "kv_bytes_per_token": kv_token_bytes,
            "read_GBps": bw / 1e9, "bandwidth_measured_by": bw_how, "copy_GBps": copy_bw / 1e9,
            "nominal_GBps": args.nominal_bw / 1e9 if args.nominal_bw else None, "roofline_tok_s_b1": roofline,
            "matvec_read_GBps": {k: v / 1e9 for k, v in mv.items()}, "loadavg_start": load, "rows": []}
    print(f"# {n_params / 1e6:.1f} M params (table included), {step_bytes / 1e9:.3f} GB weights read per step, "
          f"read bandwidth {bw / 1e9:.2f} GB/s ({bw_how}) → {args.dtype} weights-only roofline {roofline:.2f} "
          f"tok/s at B=1; jitted copy {copy_bw / 1e9:.1f} GB/s; matvec weight reads fp32 "
          f"{mv['float32'] / 1e9:.1f} GB/s, bf16 {mv['bfloat16'] / 1e9:.1f} GB/s; load avg {load:.1f}", flush=True)

    hf = None if args.no_hf else hf_model(hf_cfg, args.dtype, args.device)
    if hf is not None:
        info["hf_device"] = str(next(hf.parameters()).device)

    bf16 = (PrismaVL(cfg, jax.tree.map(lambda a: a.astype(jnp.bfloat16), model.params))
            if args.dtype == "float32" else None)
    specials = (cfg.image_token_id, cfg.video_token_id, cfg.vision_start_token_id, cfg.vision_end_token_id)
    hi = min(tc.vocab_size, 150000 if not args.quick else 30000)
    lo = 0 if min(specials) >= hi else max(specials) + 1          # random prompts hold no vision token
    rng = np.random.default_rng(0)
    for b in args.batches:
        ids = rng.integers(lo, hi, (b, args.prompt))
        runners = {"prisma": prisma_runner(model, ids)}
        if not args.no_off:
            runners["off"] = prisma_runner(model, ids, introspection=False)
        if bf16 is not None:
            runners["bf16"] = prisma_runner(bf16, ids)
        if hf is not None:
            runners["hf"] = hf_runner(hf, ids)
        news = {k: min(args.new, args.bf16_new) if k == "bf16" else args.new for k in runners}
        t = measure(runners, news, args.repeats)
        row = {"B": b, "compile_s": t["prisma"]["first_s"] - t["prisma"]["best_run_s"]}
        for k, v in t.items():
            row[k] = v
            row[f"{k}_tok_s"] = b * news[k] / v["best_run_s"]             # prefill included, like `generate`
            row[f"{k}_step_tok_s"] = b / v["best_step_s"]
        # bytes a step must read: the weights, and the KV of the B rows' mean context over the run
        row["step_bytes"] = step_bytes + b * kv_token_bytes * (args.prompt + args.new / 2)
        row["roofline_tok_s"] = b * bw / row["step_bytes"]
        for k in ("prisma", "hf"):
            if k in t:
                row[f"{k}_roofline_frac"] = row[f"{k}_step_tok_s"] / row["roofline_tok_s"]
                if args.nominal_bw:
                    row[f"{k}_nominal_frac"] = row[f"{k}_step_tok_s"] * row["step_bytes"] / b / args.nominal_bw
        if "off" in t:
            ratios = [a / o for a, o in zip(t["prisma"]["step_s"], t["off"]["step_s"])]
            row["mechanism_overhead_pct"] = 100 * (float(np.nanmedian(ratios)) - 1)
            row["mechanism_overhead_pct_rounds"] = [100 * (r - 1) for r in ratios]
        ops_s = mechanism_ops_s(cfg, model.params, b)
        row["mechanism_ops_ms"] = 1e3 * ops_s
        row["mechanism_ops_pct"] = 100 * ops_s / t["prisma"]["best_step_s"]
        row["loadavg"] = os.getloadavg()[0]
        info["rows"].append(row)
        print(json.dumps(row), flush=True)

    dt = "fp32" if args.dtype == "float32" else "bf16"
    print(f"\n| B | prisma {dt} decode tok/s | transformers {dt} decode tok/s | ratio | {dt} roofline tok/s | "
          "whole run tok/s prisma / transformers | compile s | mechanism off decode tok/s | overhead (median of rounds) | "
          "mechanism ops alone | "
          "bf16 decode tok/s (bf16 / fp32) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in info["rows"]:
        b = r["B"]
        has_hf = "hf" in r
        hf_s = f"{r['hf_step_tok_s']:.1f}" if has_hf else "–"
        ratio = f"{r['prisma_step_tok_s'] / r['hf_step_tok_s']:.2f}×" if has_hf else "–"
        whole = f"{r['prisma_tok_s']:.1f} / {r['hf_tok_s']:.1f}" if has_hf else f"{r['prisma_tok_s']:.1f} / –"
        off = (f"{r['off_step_tok_s']:.1f} | {r['mechanism_overhead_pct']:+.1f} %" if "off" in r else "– | –")
        bf = (f"{r['bf16_step_tok_s']:.1f} ({r['bf16_step_tok_s'] / r['prisma_step_tok_s']:.2f}×)"
              if r.get("bf16_step_tok_s") else "–")                     # 0: no round left a step estimate
        print(f"| {b} | {r['prisma_step_tok_s']:.1f} | {hf_s} | {ratio} | {r['roofline_tok_s']:.1f} | {whole} | "
              f"{r['compile_s']:.1f} | {off} | "
              f"{r['mechanism_ops_ms']:.3f} ms ({r['mechanism_ops_pct']:.2f} %) | {bf} |")
    print(f"\n(decode tok/s = B ÷ the best decode-only step time over {args.repeats} rounds; roofline at B = B × read "
          f"bandwidth ÷ bytes read per step: weights + the KV of a mean context; whole run = prefill + "
          f"{args.new - 1} steps, best round)")
    print(json.dumps(info))
    return 0


if __name__ == "__main__":
    sys.exit(main())
