"""Training throughput: prisma-jax's train step on configs/bench_58m.yaml vs transformers + torch.optim.AdamW.

    .venv/bin/python benchmarks/train.py [--config configs/bench_58m.yaml] [--steps 8] [--warmup 2] [--skip-torch]
                                         [--device auto|cpu|cuda] [--profile [--top 15]] [--head-gemms]
                                         [--head-loss] [--against section.key=value ...] [section.key=value ...]

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
Prints one Markdown table row per side and a JSON line.
`--profile` (CPU) instead first times each side's forward alone, forward + backward and the whole step
(unprofiled, best of 3 after an untimed call), then traces `--steps` steps of each side: the JAX step under
`jax.profiler` (each XLA:CPU op event is an HLO instruction: grouped into the matmuls — `dot`, or the YNNPACK
fusions XLA:CPU builds around one —, copies and transposes, and the rest), transformers' under
`torch.profiler` (self time by aten op), and prints each side's op kinds and largest ops beside its unprofiled
step time: the profilers add their own cost, so shares are the numbers to read.
`--head-gemms` instead times the LM head's three GEMMs (forward, input and weight gradients) at the step's
shapes, each jitted alone against torch's `mm` on the same arrays. `--head-loss` times the head with its loss,
forward and backward, three ways: whole logits (`train.step.head_xent`), the fused loss (`fused_head_xent`) and
torch. `--against KEY=VALUE` compiles the JAX step twice, as configured and with that override added, and times
one step of each per round, alternately, for `--steps` rounds: an A/B of one option in one process.
Both sides run under the host-allocator settings that importing prisma_jax applies (prisma_jax/core/runtime.py;
`PRISMA_MALLOC_TUNING=0` turns them off).
"""
from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import prisma_jax  # noqa: E402,F401  first: its host-allocator settings (prisma_jax/core/runtime.py) then hold for both sides


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


def jax_step(cfg):
    """(compiled jitted train step, state, batch iterator, compile seconds, memory analysis)."""
    import jax

    from train import data, step
    ds, _ = data.build(cfg, "/tmp/prisma_bench_train")
    it = iter(ds)
    st = step.init_state(cfg)
    fn = jax.jit(step.make_train_step(cfg, st.params), donate_argnums=0)
    t = time.perf_counter()
    compiled = fn.lower(st, next(it)).compile()
    return compiled, st, it, time.perf_counter() - t, compiled.memory_analysis()


def bench_jax(cfg, steps, warmup):
    import jax
    compiled, st, it, compile_s, mem = jax_step(cfg)
    print(f"jax: compiled in {compile_s:.0f} s", file=sys.stderr, flush=True)
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


def torch_step(cfg, device="cpu"):
    """(one step of transformers' Qwen3ForCausalLM + torch AdamW on fresh random tokens → loss, the model)."""
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

    def one(phase="step"):
        """phase: "forward" (no autograd), "backward" (forward + backward, no update) or "step" (all)."""
        ids = torch.randint(0, t.vocab_size, (cfg.train.batch_size, cfg.train.seq_len), generator=g).to(device)
        with torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=bf16), \
                torch.set_grad_enabled(phase != "forward"):
            loss = model(input_ids=ids, labels=ids).loss
        if phase != "forward":
            opt.zero_grad(set_to_none=True)
            loss.backward()
        if phase == "step":
            torch.nn.utils.clip_grad_norm_(model.parameters(), o.clip_norm or 1e9)
            opt.step()
        return loss.item()          # waits for the step (a GPU's too)

    return one, model


def bench_torch(cfg, steps, warmup, device="cpu"):
    one, model = torch_step(cfg, device)
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


# ---------------------------------------------------------------------------------------------- --profile

def _xla_kind(name: str) -> str:
    """An XLA:CPU op's kind, from its HLO instruction name (`ynn_fusion.12`, `copy_bitcast_fusion.3`, ...)."""
    base = name.split(".")[0]
    if base.startswith(("ynn_fusion", "xnn_fusion", "dot", "convolution", "custom-call")):
        return "matmuls (YNNPACK fusions, dot)"
    if base.startswith(("copy", "transpose")):
        return "copies / transposes"
    if base.startswith(("while", "call", "conditional")):
        return "control flow"
    return "other fusions and ops"


def _torch_kind(name: str) -> str:
    if any(x in name for x in ("mm", "linear", "matmul")):
        return "matmuls (mm, addmm, ...)"
    if "attention" in name:
        return "attention (SDPA)"
    if "softmax" in name or "nll" in name:
        return "softmax / cross-entropy"
    return "other ops"


def _best(fn, n=3) -> float:
    """The shortest of `n` timed calls of `fn`, after one untimed call."""
    fn()
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def profile_jax(cfg, steps: int, top: int) -> dict:
    """The JAX side of `--profile`: unprofiled seconds of the loss alone, the gradients alone (`train.step`'s, each
    jitted on its own) and the whole step (best of 3); then `steps` steps under `jax.profiler` (a Perfetto trace),
    its op events, named by HLO instruction, summed."""
    import collections
    import glob
    import gzip
    import tempfile

    import jax

    from train import step
    compiled, st, it, _, _ = jax_step(cfg)
    b = next(it)
    frozen = step.frozen_mask(cfg, st.params)

    def loss(p, b):
        mb, tg = step.micro(b, 0)
        return step._micro_loss(step.compute_params(cfg, p, frozen), cfg, mb, tg)[0]

    fwd = jax.jit(loss)
    bwd = jax.jit(lambda p, b: step.grads_and_stats(cfg, p, b)[0])
    holder = [st]

    def whole(batch=b):
        holder[0], m = compiled(holder[0], batch)
        jax.block_until_ready(m)

    phase = {"forward": _best(lambda: jax.block_until_ready(fwd(holder[0].params, b))),
             "backward": _best(lambda: jax.block_until_ready(bwd(holder[0].params, b))),
             "step": _best(whole)}
    batches = [next(it) for _ in range(steps)]
    with tempfile.TemporaryDirectory(prefix="prisma_profile_") as out:
        t = time.perf_counter()
        with jax.profiler.trace(out, create_perfetto_trace=True):
            for batch in batches:
                whole(batch)
        traced = (time.perf_counter() - t) / steps
        with gzip.open(glob.glob(os.path.join(out, "**", "*.trace.json.gz"), recursive=True)[0]) as f:
            events = json.load(f)
    events = events["traceEvents"] if isinstance(events, dict) else events
    ops = collections.Counter()
    for e in events:
        name = e.get("name", "")
        if e.get("ph") == "X" and "dur" in e and name[:1].islower() and "." in name and " " not in name:
            ops[name] += e["dur"] / 1e6 / steps
    return {"phases": phase, "traced_step_s": traced, "ops": ops, "kind": _xla_kind, "top": top}


def profile_torch(cfg, steps: int, top: int) -> dict:
    """The torch side of `--profile`: unprofiled seconds of the forward under `no_grad`, forward + backward and the
    whole step (best of 3); then `steps` steps under `torch.profiler`, self CPU time by aten op."""
    import collections

    from torch.profiler import ProfilerActivity, profile
    one, _ = torch_step(cfg)
    phase = {name: _best(lambda name=name: one(name)) for name in ("forward", "backward", "step")}
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t = time.perf_counter()
        for _ in range(steps):
            one()
        traced = (time.perf_counter() - t) / steps
    ops = collections.Counter({e.key: e.self_cpu_time_total / 1e6 / steps for e in prof.key_averages()})
    return {"phases": phase, "traced_step_s": traced, "ops": ops, "kind": _torch_kind, "top": top}


def head_gemms(cfg, n: int = 5) -> None:
    """`--head-gemms`: the LM head's three float32 GEMMs at the step's shapes (T tokens, hidden D, vocabulary V),
    each jitted alone in JAX against torch's `mm` on the same arrays, best of `n` after an untimed call."""
    import jax
    import jax.numpy as jnp
    import torch
    t, d, v = cfg.train.batch_size * cfg.train.seq_len, cfg.model.text.hidden_size, cfg.model.text.vocab_size
    rng = np.random.default_rng(0)
    h, w, g = (rng.standard_normal(shape, np.float32) for shape in ((t, d), (d, v), (t, v)))
    cases = (("forward [T, D] · [D, V]", "td,dv->tv", (h, w), lambda a, b: a @ b),
             ("input gradient [T, V] · [V, D]", "tv,dv->td", (g, w), lambda a, b: a @ b.t()),
             ("weight gradient [D, T] · [T, V]", "td,tv->dv", (h, g), lambda a, b: a.t() @ b))
    print(f"T = {t}, D = {d}, V = {v}\n| matmul | XLA:CPU (s) | torch (s) |\n| --- | --- | --- |")
    for name, spec, args, torch_mm in cases:
        f, xs = jax.jit(lambda a, b, spec=spec: jnp.einsum(spec, a, b)), [jnp.asarray(x) for x in args]
        ts = [torch.from_numpy(x) for x in args]
        print(f"| {name} | {_best(lambda: jax.block_until_ready(f(*xs)), n):.3f} "
              f"| {_best(lambda: torch_mm(*ts), n):.3f} |", flush=True)


def head_loss(cfg, n: int = 5, rounds: int = 2) -> None:
    """`--head-loss`: the LM head and its summed cross-entropy, forward and backward (gradients with respect to the
    final hidden states and the head), at the step's shapes: `train.step.head_xent` on the whole logits,
    `train.step.fused_head_xent` in the step's chunks, and torch's `linear` + `cross_entropy`; best of `n` after an
    untimed call, `rounds` rounds."""
    import jax
    import jax.numpy as jnp
    import torch

    from train import step
    b, s, d, v = cfg.train.batch_size, cfg.train.seq_len, cfg.model.text.hidden_size, cfg.model.text.vocab_size
    rng = np.random.default_rng(0)
    h, w = rng.standard_normal((b, s, d), np.float32), (rng.standard_normal((d, v)) * 0.05).astype(np.float32)
    t = jnp.asarray(rng.integers(0, v, (b, s)).astype(np.int32))

    def logits(x, w):
        return (x.reshape(-1, d) @ w).reshape(*x.shape[:2], v)

    class Head:                     # the one thing head_xent asks of a model
        def __init__(self, w):
            self.head = functools.partial(logits, w=w)

    chunk = max(1, step.FUSED_TOKENS // b)
    plain = jax.jit(jax.grad(lambda x, w: jnp.sum(step.head_xent(Head(w), x, t)[0]), argnums=(0, 1)))
    fused = jax.jit(jax.grad(lambda x, w: step.fused_head_xent(lambda p, y: logits(y, p), w, x, t, chunk)[0],
                             argnums=(0, 1)))
    ht = torch.from_numpy(h.reshape(-1, d)).requires_grad_()
    wt = torch.from_numpy(w.T.copy()).requires_grad_()
    tt = torch.from_numpy(np.array(t).reshape(-1)).long()

    def torch_side():
        ht.grad = wt.grad = None
        torch.nn.functional.cross_entropy(torch.nn.functional.linear(ht, wt), tt, reduction="sum").backward()
    hj, wj = jnp.asarray(h), jnp.asarray(w)
    print(f"B = {b}, S = {s}, D = {d}, V = {v}; fused chunks of {chunk} positions\n"
          "| round | head_xent, whole logits (s) | fused_head_xent (s) | torch (s) |\n| --- | --- | --- | --- |")
    for r in range(rounds):
        print(f"| {r + 1} | {_best(lambda: jax.block_until_ready(plain(hj, wj)), n):.3f} "
              f"| {_best(lambda: jax.block_until_ready(fused(hj, wj)), n):.3f} | {_best(torch_side, n):.3f} |", flush=True)


def against(config: str, overrides: list, extra: list, rounds: int) -> None:
    """`--against`: the JAX step as configured (A) and with `extra` overrides added (B), each compiled and run once,
    then one step of each per round, alternately, on a fixed batch; best and median seconds, and temporaries."""
    import jax

    from train.config import load_train_config
    arms = {}
    for name, ov in (("A", overrides), ("B", overrides + extra)):
        cfg, _ = load_train_config(config, ov)
        compiled, st, it, _, mem = jax_step(cfg)
        b = next(it)
        st, m = compiled(st, b)
        jax.block_until_ready(m)
        arms[name] = {"fn": compiled, "state": st, "batch": b, "times": [], "temp": mem.temp_size_in_bytes,
                      "overrides": " ".join(ov) or "(none)"}
    for r in range(rounds):
        for arm in arms.values():
            t = time.perf_counter()
            arm["state"], m = arm["fn"](arm["state"], arm["batch"])
            jax.block_until_ready(m)
            arm["times"].append(time.perf_counter() - t)
        print(f"round {r + 1}: " + ", ".join(f"{k} {a['times'][-1]:.2f} s" for k, a in arms.items()),
              file=sys.stderr, flush=True)
    print("| arm | overrides | best (s) | median (s) | temporaries |\n| --- | --- | --- | --- | --- |")
    for k, a in arms.items():
        print(f"| {k} | {a['overrides']} | {min(a['times']):.2f} | {np.median(a['times']):.2f} "
              f"| {a['temp'] / 2**20:,.0f} MiB |")


def print_phases(jax_r: dict, torch_r: dict) -> None:
    j, t = jax_r["phases"], torch_r["phases"]
    print("| phase | prisma-jax (s) | transformers (s) | speed-up (transformers ÷ prisma-jax) |\n"
          "| --- | --- | --- | --- |")
    prev_j = prev_t = 0.0
    for name, label in (("forward", "forward"), ("backward", "+ backward"), ("step", "+ clip and AdamW")):
        dj, dt = j[name] - prev_j, t[name] - prev_t
        print(f"| {label} | {dj:.2f} | {dt:.2f} | {dt / dj:.2f}× |")
        prev_j, prev_t = j[name], t[name]
    print(f"| the whole step | {j['step']:.2f} | {t['step']:.2f} | {t['step'] / j['step']:.2f}× |")


def print_profile(side: str, r: dict) -> None:
    import collections
    kinds = collections.Counter()
    for name, s in r["ops"].items():
        kinds[r["kind"](name)] += s
    print(f"\n{side}: step {r['phases']['step']:.2f} s unprofiled, {r['traced_step_s']:.2f} s profiled")
    print("| kind | s a profiled step | share |\n| --- | --- | --- |")
    for k, s in kinds.most_common():
        print(f"| {k} | {s:.2f} | {100 * s / r['traced_step_s']:.0f} % |")
    print("\n| op | s a profiled step |\n| --- | --- |")
    for n, s in r["ops"].most_common(r["top"]):
        print(f"| `{n[:90]}` | {s:.3f} |")


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="configs/bench_58m.yaml")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--skip-torch", action="store_true")
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                    help="torch's device (auto: CUDA when torch sees a GPU)")
    ap.add_argument("--profile", action="store_true",
                    help="instead: where each side's step goes, op by op (jax.profiler / torch.profiler, CPU)")
    ap.add_argument("--top", type=int, default=15, help="with --profile: the largest ops listed")
    ap.add_argument("--head-gemms", action="store_true",
                    help="instead: the LM head's three GEMMs at the step's shapes, XLA:CPU against torch's mm")
    ap.add_argument("--head-loss", action="store_true",
                    help="instead: the head and its loss, forward + backward, whole logits vs fused vs torch")
    ap.add_argument("--against", action="append", default=[], metavar="KEY=VALUE",
                    help="instead: the JAX step compiled twice, as configured and with these overrides added, "
                         "timed alternately for --steps rounds (repeatable)")
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args(argv)
    import jax
    import torch

    from train.config import load_train_config
    cfg, _ = load_train_config(a.config, a.overrides)
    if a.head_gemms:
        head_gemms(cfg)
        return
    if a.head_loss:
        head_loss(cfg)
        return
    if a.against:
        against(a.config, a.overrides, a.against, a.steps)
        return
    if a.profile:
        jr = profile_jax(cfg, a.steps, a.top)
        tr = None if a.skip_torch else profile_torch(cfg, a.steps, a.top)
        if tr is not None:
            print_phases(jr, tr)
        print_profile("prisma-jax (XLA:CPU ops)", jr)
        if tr is not None:
            print_profile("transformers (aten ops, self time)", tr)
        return
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
