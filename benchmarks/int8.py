"""int8 weight-only generation (prisma_jax/quant/int8.py) against bfloat16 and float32, on the tiny config and
the 408M decode config (benchmarks/decode.py's).

    .venv/bin/python benchmarks/int8.py [--configs tiny 408m] [--prompts 8] [--prompt 32] [--new 64]
                                        [--batches 1 8] [--timing-prompt 128] [--repeats 3]
                                        [--tiny-checkpoint DIR]

Per config, one random model (seed 0, a normal(0, 0.02) uncertainty table) — for "tiny", the checkpoint
`--tiny-checkpoint` names instead when given (e.g. configs/tiny_sft.yaml's 24 steps exported by `prisma convert
train-to-hf`: random weights give near-uniform distributions) — in four forms: float32, bfloat16,
and each of them quantized (`PrismaVL.quantize("int8")`, what `from_pretrained(..., quantize="int8")` does):
"int8/f32" computes in float32, "int8/bf16" in bfloat16. Reported:

* max |Δlogit| over a forward of `prompts` random prompts (every position): int8/bf16 against bf16, int8/f32
  against f32, and bf16 against f32 for scale;
* greedy agreement, `prompts` × `new` tokens, int8/bf16 against bf16: the share of positions with the same
  token, and each prompt's common prefix; for scale, the same share for bf16 against f32 and int8/f32 against
  f32;
* codes: on bf16's greedy sequences, teacher-forced (its tokens, and its codes as the incoming codes), the
  share of generated positions where int8/bf16's code differs from bf16's, and the median / max |Δcode| in
  levels of 2^n_bits (and, for scale, bf16's against f32's on the same sequences); also the median top-1 −
  top-2 logit margin of bf16, which says how easily a greedy choice flips;
* weight bytes of each form, and the bytes a decode step reads (decoder layers, final norm, lm_head);
* decode tokens/s on this machine for the four forms at each batch size, timed as benchmarks/decode.py times
  prisma-jax (compiled prefill, then the decode loop; decode-only step time, best of the rounds), plus
  int8/f32 with the layers scanned in the loop ("int8/f32 scan"; the CPU default unrolls them, text.py);
* the decode program's memory on XLA:CPU (`memory_analysis()`: arguments, temporaries) for each of them at the
  largest batch: with the CPU's unrolled layers, XLA hoists the dequantization out of the loop, so the
  program holds a float copy of the int8 kernels while it runs.

Prints Markdown tables (paste into docs/benchmarks.md) and one JSON line.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

import prisma_jax  # noqa: F401  first: its host-allocator settings (prisma_jax/core/runtime.py)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from decode import measure, prisma_runner, text_config  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def model_config(name: str):
    from prisma_jax.core.config import config_from_hf, load_config

    if name == "tiny":
        return load_config(os.path.join(ROOT, "configs", "tiny.yaml"))
    if name == "408m":
        return config_from_hf(text_config(False).to_dict())
    raise ValueError(f"unknown config {name!r} (tiny, 408m)")


def step_bytes(params) -> int:
    """Bytes a decode step reads: the decoder layers, the final norm and lm_head (lookups excluded)."""
    from prisma_jax.quant.int8 import weight_bytes

    return weight_bytes(params["text"]["layers"]) + weight_bytes(params["text"]["norm"]) + \
        weight_bytes(params.get("lm_head", {}))


def quality(cfg, forms: dict, prompts: np.ndarray, new: int) -> dict:
    import jax.numpy as jnp

    from prisma_jax.nn.uncertainty import codes_from_logits, prompt_codes

    z = {k: np.asarray(m.forward(prompts), np.float32) for k, m in forms.items()}
    out = {"logit_max_abs_f32": float(np.abs(z["f32"]).max()), "logit_std_f32": float(z["f32"].std()),
           "dlogit_int8bf16_vs_bf16": float(np.abs(z["int8/bf16"] - z["bf16"]).max()),
           "dlogit_int8f32_vs_f32": float(np.abs(z["int8/f32"] - z["f32"]).max()),
           "dlogit_bf16_vs_f32": float(np.abs(z["bf16"] - z["f32"]).max())}

    g = {k: m.generate(prompts, max_new_tokens=new) for k, m in forms.items()}
    gb, gq = g["bf16"], g["int8/bf16"]
    same = gb.tokens == gq.tokens
    prefix = [int(np.argmin(r)) if not r.all() else new for r in same]
    common = [(gb.codes[i, :n] != gq.codes[i, :n]) for i, n in enumerate(prefix) if n]
    out.update(greedy_same_share=float(same.mean()), greedy_common_prefix=prefix,
               codes_differ_share_free_running=float(np.concatenate(common).mean()) if common else float("nan"),
               # for scale: how far bf16 itself, and int8 in float32, stray from float32's greedy tokens
               greedy_same_share_bf16_vs_f32=float((g["bf16"].tokens == g["f32"].tokens).mean()),
               greedy_same_share_int8f32_vs_f32=float((g["int8/f32"].tokens == g["f32"].tokens).mean()))

    # teacher-forced on bf16's sequences: each position's code from each model, on the same inputs
    b, p = prompts.shape
    seq = np.concatenate([prompts, gb.tokens], axis=1)
    mask = np.ones_like(seq)
    codes_in = np.concatenate([prompt_codes(np.ones_like(prompts), cfg.n_bits), gb.codes.astype(np.int32)], axis=1)
    codes = {}
    margins = None
    for k in ("bf16", "int8/bf16", "f32"):
        logits = forms[k].forward(seq, mask, codes_in=codes_in)[:, p - 1:p - 1 + new]
        codes[k] = np.asarray(codes_from_logits(jnp.asarray(logits, jnp.float32), cfg.n_bits)).astype(np.int64)
        if k == "bf16":
            top2 = np.sort(np.asarray(logits, np.float32), axis=-1)[..., -2:]
            margins = top2[..., 1] - top2[..., 0]
    d = np.abs(codes["int8/bf16"] - codes["bf16"])
    d32 = np.abs(codes["bf16"] - codes["f32"])
    out.update(codes_differ_share=float((d > 0).mean()), dcode_median=float(np.median(d)), dcode_max=int(d.max()),
               codes_differ_share_bf16_vs_f32=float((d32 > 0).mean()), dcode_median_bf16_vs_f32=float(np.median(d32)),
               code_levels=cfg.n_levels, bf16_code_range=[int(codes["bf16"].min()), int(codes["bf16"].max())],
               top1_margin_median_bf16=float(np.median(margins)))
    return out


def decode_memory(model, ids, new: int, **kw) -> dict:
    """Arguments and temporaries (bytes) of the compiled decode program `generate` runs for `ids`."""
    import jax

    from prisma_jax.infer import generate as G
    from prisma_jax.apps.plan import memory

    cfg, params = model.config, model.params
    with model._precision():
        p = G.request(cfg, G.Inputs(ids), options=G.Options(max_new_tokens=new, **kw))
        state = G.prefill(cfg, p.spec, params, p.batch, p.next_pos, p.sp, p.eos, p.pad, jax.random.key(0))
        m = memory(G.decode.lower(cfg, p.spec, params, state, p.sp, p.eos, p.pad, p.max_new).compile())
    return {"arguments": m.arguments, "temporaries": m.temporaries}


TIMED = ("f32", "bf16", "int8/f32", "int8/bf16", "int8/f32 scan")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", nargs="+", default=["tiny", "408m"])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=32, help="prompt length for the quality measures")
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--timing-prompt", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-timing", action="store_true")
    ap.add_argument("--tiny-checkpoint", default=None, help="a checkpoint of configs/tiny.yaml's model to use "
                    "for 'tiny' instead of random weights")
    args = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp

    from prisma_jax import PrismaVL
    from prisma_jax.quant.int8 import weight_bytes

    info = {"device": str(jax.devices()[0].device_kind), "cores": os.cpu_count(),
            "loadavg_start": os.getloadavg()[0], "configs": {}}
    for name in args.configs:
        if name == "tiny" and args.tiny_checkpoint:
            f32 = PrismaVL.from_pretrained(args.tiny_checkpoint, dtype="float32")
            cfg = f32.config
        else:
            cfg = model_config(name)
            f32 = PrismaVL.from_config(cfg, seed=0, dtype="float32", uncertainty_init="normal")
        bf16 = PrismaVL(cfg, jax.tree.map(lambda a: a.astype(jnp.bfloat16), f32.params))
        t = time.perf_counter()
        q32 = f32.quantize("int8")
        quantize_s = time.perf_counter() - t
        forms = {"f32": f32, "bf16": bf16, "int8/f32": q32, "int8/bf16": bf16.quantize("int8")}
        vocab = cfg.text.vocab_size
        hi = min(vocab, 150000)
        rng = np.random.default_rng(0)
        prompts = rng.integers(7, hi, (args.prompts, args.prompt))
        r = {"n_bits": cfg.n_bits, "quantize_s": quantize_s,
             "weight_bytes": {k: weight_bytes(m.params) for k, m in forms.items()},
             "step_bytes": {k: step_bytes(m.params) for k, m in forms.items()}}
        print(f"# {name}: quantized in {quantize_s:.2f} s; weight bytes {r['weight_bytes']}", flush=True)
        r.update(quality(cfg, forms, prompts, args.new))
        print(json.dumps({name: {k: v for k, v in r.items()}}), flush=True)
        rows = []
        if not args.no_timing:
            for b in args.batches:
                ids = rng.integers(7, hi, (b, args.timing_prompt))
                runners = {k: prisma_runner(m, ids) for k, m in forms.items()}
                runners["int8/f32 scan"] = prisma_runner(forms["int8/f32"], ids, unroll_layers=False)
                t = measure(runners, {k: args.new for k in runners}, args.repeats)
                row = {"B": b, **{k: b / v["best_step_s"] for k, v in t.items()},
                       "rounds_step_s": {k: v["step_s"] for k, v in t.items()}, "loadavg": os.getloadavg()[0]}
                rows.append(row)
                print(json.dumps(row), flush=True)
            ids = rng.integers(7, hi, (max(args.batches), args.timing_prompt))
            r["decode_memory"] = {k: decode_memory(forms[k.split()[0]], ids, args.new,
                                                   **({"unroll_layers": False} if "scan" in k else {}))
                                  for k in TIMED}
            print(json.dumps(r["decode_memory"]), flush=True)
        r["decode_tok_s"] = rows
        info["configs"][name] = r

    for name, r in info["configs"].items():
        mb = lambda n: f"{n / 1e6:.1f} MB"   # noqa: E731
        print(f"\n### {name} (codes of {r['n_bits']} bits)\n")
        print("| | " + " | ".join(TIMED) + " |")
        print("| --- " * (len(TIMED) + 1) + "|")
        print("| weight bytes | " + " | ".join(mb(r["weight_bytes"][k.split()[0]]) for k in TIMED) + " |")
        print("| read per decode step | " + " | ".join(mb(r["step_bytes"][k.split()[0]]) for k in TIMED) + " |")
        for row in r["decode_tok_s"]:
            print(f"| decode tok/s, B = {row['B']} | " + " | ".join(f"{row[k]:.1f}" for k in TIMED) + " |")
        if "decode_memory" in r:
            b = max(args.batches)
            for what in ("arguments", "temporaries"):
                print(f"| decode program {what} (XLA:CPU, B = {b}) | "
                      + " | ".join(mb(r["decode_memory"][k][what]) for k in TIMED) + " |")
        print(f"\nmax |Δlogit|: int8/bf16 vs bf16 {r['dlogit_int8bf16_vs_bf16']:.4f}, int8/f32 vs f32 "
              f"{r['dlogit_int8f32_vs_f32']:.4f}, bf16 vs f32 {r['dlogit_bf16_vs_f32']:.4f} (f32 logits: max |x| "
              f"{r['logit_max_abs_f32']:.3f}, std {r['logit_std_f32']:.3f})")
        print(f"greedy, int8/bf16 vs bf16: {100 * r['greedy_same_share']:.1f} % of tokens equal; common prefixes "
              f"{r['greedy_common_prefix']} (median top-1 margin of bf16 {r['top1_margin_median_bf16']:.4f}); for "
              f"scale, bf16 vs f32 {100 * r['greedy_same_share_bf16_vs_f32']:.1f} %, int8/f32 vs f32 "
              f"{100 * r['greedy_same_share_int8f32_vs_f32']:.1f} %")
        print(f"codes (teacher-forced on bf16's sequences): {100 * r['codes_differ_share']:.1f} % differ, "
              f"median |Δ| {r['dcode_median']:g}, max {r['dcode_max']} of {r['code_levels']} levels "
              f"(bf16 codes span {r['bf16_code_range']}); for scale, bf16 vs f32 "
              f"{100 * r['codes_differ_share_bf16_vs_f32']:.1f} % differ, median |Δ| "
              f"{r['dcode_median_bf16_vs_f32']:g}; free-running, before the first different token: "
              f"{100 * r['codes_differ_share_free_running']:.1f} % differ")
    print(json.dumps(info))
    return 0


if __name__ == "__main__":
    sys.exit(main())
