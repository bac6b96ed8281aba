"""Serving: `prisma serve` (continuous batching) vs static batches of `PrismaVL.generate` vs transformers'
`generate` in the same static batches, on one bounded Poisson trace with a fixed seed, in one run.

    .venv/bin/python benchmarks/serve.py [--requests 64] [--prompt 32 512] [--output 16 256] [--rate 1.0]
                                         [--slots 8] [--steps 8] [--batch 8] [--max-len 1024] [--quick] [--no-hf]

Model: the 408 M decode config of benchmarks/decode.py (Qwen3-VL text 8 × 1024, V = 151,936) with a 2^16 × 1024
uncertainty table, fp32, random weights, no end token (every request runs to its max_tokens). Trace: `--requests`
arrivals, exponential gaps of mean 1/rate, prompts of random token ids with lengths uniform in `--prompt`,
outputs uniform in `--output` (numpy seed 0).

* **serve**: `prisma_jax.infer.serve` (Engine + the FastAPI app under uvicorn, in this process, on a free 127.0.0.1
  port); an asyncio client sends each request at its arrival time to `/v1/completions` (token-id prompt,
  `stream: true`, greedy) and records the first chunk (time to first token) and the last. Programs are compiled
  first by warm-up requests (every prompt bucket, and the longest request, which passes every attention window).
  `--steps` may list several K: one serve run each.
* **static**: batches of `--batch` requests in arrival order; a batch starts when its last request has arrived
  and the previous batch is done, left-pads its prompts and generates its longest output for every row
  (`PrismaVL.generate`'s two programs, compiled beforehand); its rows end together. Time to first token = the
  batch's start + its prefill; end-to-end = its end. The clock is virtual: arrival gaps are not slept, compute
  is measured.
* **hf**: the same batches through transformers' `generate` (greedy, `min_new_tokens` = `max_new_tokens`), time
  to first token from a streamer's first token.

Reported: generated tokens/s (the requested output tokens ÷ first arrival to last completion), p50/p99 time to
first token and end-to-end latency, and (serve) the largest gap between two chunks of one stream. With
`--image-load N`, N chat requests with a large image each (`--image-size`, a PNG data URL) are sent, two at a
time, while the trace runs, and `/health` is polled every 20 ms: its p50 / p99 / max latency says whether image
decoding and processing ever hold up the event loop (they run in worker threads: docs/serve.md). Prints a
Markdown table and one JSON line.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import sys
import tempfile
import time

import numpy as np

import prisma_jax  # noqa: F401  first: the host-allocator settings hold for every side

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def trace(n: int, prompt: tuple[int, int], output: tuple[int, int], rate: float, vocab: int, seed: int = 0):
    """[(arrival s, prompt ids, max_tokens)]: Poisson arrivals (exponential gaps), uniform lengths."""
    rng = np.random.default_rng(seed)
    t = np.cumsum(rng.exponential(1.0 / rate, n))
    t -= t[0]
    lens = rng.integers(prompt[0], prompt[1] + 1, n)
    outs = rng.integers(output[0], output[1] + 1, n)
    return [(float(t[i]), rng.integers(13, vocab, lens[i]).tolist(), int(outs[i])) for i in range(n)]


def summary(arrivals, ttft, done, tokens) -> dict:
    """tokens/s over first arrival → last completion; p50/p99 TTFT and end-to-end latency (s)."""
    arrivals, ttft, done = map(np.asarray, (arrivals, ttft, done))
    e2e = done - arrivals
    pct = lambda x, q: float(np.percentile(x, q))                # noqa: E731
    return {"tok_s": float(tokens / (done.max() - arrivals.min())), "ttft_p50": pct(ttft, 50), "ttft_p99": pct(ttft, 99),
            "e2e_p50": pct(e2e, 50), "e2e_p99": pct(e2e, 99), "makespan_s": float(done.max() - arrivals.min())}


# ---------------------------------------------------------------------------------------------- serve

async def _client(url: str, reqs, model: str):
    import httpx

    t0 = time.perf_counter()
    out = [None] * len(reqs)

    async def one(i, client):
        at, ids, m = reqs[i]
        await asyncio.sleep(max(0.0, at - (time.perf_counter() - t0)))
        sent = time.perf_counter() - t0
        first, n, last, gap = None, 0, None, 0.0
        body = {"model": model, "prompt": ids, "max_tokens": m, "temperature": 0, "stream": True}
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            assert r.status_code == 200, await r.aread()
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    now = time.perf_counter() - t0
                    n += len(json.loads(line[6:])["choices"][0]["uncertainty"]["codes"])
                    first = first if first is not None else now
                    gap = gap if last is None else max(gap, now - last)
                    last = now
        assert n == m, (n, m)
        out[i] = (sent, first - sent, time.perf_counter() - t0, gap)

    limits = httpx.Limits(max_connections=len(reqs) + 4)
    async with httpx.AsyncClient(timeout=3600, limits=limits) as client:
        await asyncio.gather(*(one(i, client) for i in range(len(reqs))))
    return out


async def _image_load(url: str, model: str, n: int, size: tuple[int, int], stop: asyncio.Event):
    """n chat requests with one large PNG each, two at a time; returns their status codes."""
    import base64
    import io

    import httpx
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (size[0], size[1], 3), np.uint8)).save(buf, "PNG")
    image = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    body = {"model": model, "max_tokens": 4, "temperature": 0, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": image}}, {"type": "text", "text": "t1 t2"}]}]}
    codes = []
    async with httpx.AsyncClient(timeout=3600) as client:
        async def worker(k):
            for _ in range(k):
                codes.append((await client.post(url + "/v1/chat/completions", json=body)).status_code)
        await asyncio.gather(worker(n - n // 2), worker(n // 2))
    stop.set()
    return codes


async def _health(url: str, stop: asyncio.Event) -> list[float]:
    import httpx

    lat = []
    async with httpx.AsyncClient(timeout=3600) as client:
        while not stop.is_set():
            t = time.perf_counter()
            assert (await client.get(url + "/health")).status_code == 200
            lat.append(time.perf_counter() - t)
            await asyncio.sleep(0.02)
    return lat


async def _loaded(url: str, reqs, model: str, n_images: int, size):
    """The trace, with `n_images` large-image requests beside it and /health polled throughout."""
    stop = asyncio.Event()
    trace_out, codes, lat = await asyncio.gather(_client(url, reqs, model), _image_load(url, model, n_images, size, stop),
                                                 _health(url, stop))
    return trace_out, codes, lat


def run_serve(model, proc, reqs, slots: int, steps: int, max_len: int, n_images: int = 0,
              image_size=(2000, 1500)) -> dict:
    from prisma_jax.infer.serve.app import ServeLimits
    from prisma_jax.infer.serve.local import LocalServer

    server = LocalServer.start(model, proc, "bench", None, {"limits": ServeLimits(max_image_pixels=1 << 26)},
                               slots=slots, max_len=max_len, steps=steps, max_queue=len(reqs) + 4)
    engine = server.engine
    try:
        t = time.perf_counter()
        longest = max(reqs, key=lambda r: len(r[1]) + r[2])
        warm = [(0.0, longest[1], longest[2])]
        for p in sorted({1 << (max(len(r[1]), 32) - 1).bit_length() for r in reqs}):
            ids = next(r[1] for r in reqs if 1 << (max(len(r[1]), 32) - 1).bit_length() == p)
            warm.append((0.0, ids, 2))
        asyncio.run(_client(server.url, warm, "bench"))
        warm_s = time.perf_counter() - t
        extra = {}
        if n_images:                   # the image programs compiled before the clock starts
            asyncio.run(_image_load(server.url, "bench", 1, image_size, asyncio.Event()))
        before = engine.load()
        if n_images:
            res, codes, lat = asyncio.run(_loaded(server.url, reqs, "bench", n_images, image_size))
            pct = lambda q: float(np.percentile(lat, q))                # noqa: E731
            extra = {"image_requests": len(codes), "image_ok": codes.count(200), "image_status": sorted(set(codes)),
                     "health_polls": len(lat),
                     "health_p50_s": pct(50), "health_p99_s": pct(99), "health_max_s": float(max(lat))}
        else:
            res = asyncio.run(_client(server.url, reqs, "bench"))
        after = engine.load()
    finally:
        server.close()
    s = summary([r[0] for r in res], [r[1] for r in res], [r[2] for r in res], sum(r[2] for r in reqs))
    return s | {"warmup_s": warm_s, "rounds": after["rounds"] - before["rounds"], "max_busy": after["max_busy"],
                "max_chunk_gap_s": max(r[3] for r in res)} | extra


# ---------------------------------------------------------------------------------------------- static batches

def _batches(reqs, size: int):
    return [reqs[i:i + size] for i in range(0, len(reqs), size)]


def _left_pad(rows):
    s = max(len(r) for r in rows)
    ids = np.zeros((len(rows), s), np.int64)
    mask = np.zeros((len(rows), s), np.int64)
    for i, r in enumerate(rows):
        ids[i, s - len(r):], mask[i, s - len(r):] = r, 1
    return ids, mask


def _static(reqs, size: int, run_batch) -> dict:
    """Virtual clock: batch j starts at max(its last arrival, end of batch j − 1); run_batch → (prefill s, total s)."""
    arrivals, ttft, done, end = [], [], [], 0.0
    for b in _batches(reqs, size):
        start = max(end, b[-1][0])
        pre, total = run_batch(b)
        end = start + total
        for at, _, _ in b:
            arrivals.append(at)
            ttft.append(start + pre - at)
            done.append(end)
    return summary(arrivals, ttft, done, sum(r[2] for r in reqs))


def prisma_batch(model):
    import jax

    from prisma_jax.infer import generate as G

    cfg, params = model.config, model.params

    def plan(b):
        ids, mask = _left_pad([r[1] for r in b])
        return G.request(cfg, G.Inputs(ids, mask), options=G.Options(max_new_tokens=max(r[2] for r in b)))

    def compile_only(b):                 # the batch's two programs, run for no step
        p = plan(b)
        with model._precision():
            st = G.prefill(cfg, p.spec, params, p.batch, p.next_pos, p.sp, p.eos, p.pad, jax.random.key(0))
            G.decode(cfg, p.spec, params, st, p.sp, p.eos, p.pad, np.int32(1)).tokens.block_until_ready()

    def run(b):
        with model._precision():
            t = time.perf_counter()
            p = plan(b)
            st = G.prefill(cfg, p.spec, params, p.batch, p.next_pos, p.sp, p.eos, p.pad, jax.random.key(0))
            st.tokens.block_until_ready()
            pre = time.perf_counter() - t
            st = G.decode(cfg, p.spec, params, st, p.sp, p.eos, p.pad, p.max_new)
            jax.device_get((st.tokens, st.codes, st.lengths))
            return pre, time.perf_counter() - t
    return run, compile_only


def hf_batch(hf):
    import torch
    from transformers.generation.streamers import BaseStreamer

    class FirstToken(BaseStreamer):
        def __init__(self):
            self.calls, self.first = 0, None

        def put(self, value):
            self.calls += 1
            if self.calls == 2:
                self.first = time.perf_counter()

        def end(self):
            pass

    def run(b):
        ids, mask = _left_pad([r[1] for r in b])
        m = max(r[2] for r in b)
        st = FirstToken()
        t = time.perf_counter()
        with torch.no_grad():
            hf.generate(input_ids=torch.as_tensor(ids), attention_mask=torch.as_tensor(mask), max_new_tokens=m,
                        min_new_tokens=m, do_sample=False, pad_token_id=0, streamer=st)
        return st.first - t, time.perf_counter() - t
    return run


# ---------------------------------------------------------------------------------------------- main

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prompt", type=int, nargs=2, default=[32, 512])
    ap.add_argument("--output", type=int, nargs=2, default=[16, 256])
    ap.add_argument("--rate", type=float, default=1.0, help="mean arrivals per second")
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--steps", type=int, nargs="+", default=[4], help="K; several: one serve run each")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--quick", action="store_true", help="a small config, to check the script runs")
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--image-load", type=int, default=0, metavar="N",
                    help="N large-image chat requests during the serve run(s); /health polled throughout")
    ap.add_argument("--image-size", type=int, nargs=2, default=[2000, 1500], metavar=("H", "W"))
    ap.add_argument("--no-static", action="store_true", help="serve runs only")
    args = ap.parse_args(argv)

    import jax
    import torch
    from decode import text_config
    from transformers import Qwen3VLForConditionalGeneration

    from prisma_jax import PrismaVL
    from prisma_jax.core.config import config_from_hf
    from prisma_jax.host.processing import Processor, build_tokenizer

    hf_cfg = text_config(args.quick)
    cfg = config_from_hf(hf_cfg.to_dict())
    with tempfile.TemporaryDirectory() as d:       # a word-level tokenizer over the whole vocabulary (decoding)
        ids = build_tokenizer(d, [f"t{i}" for i in range(cfg.text.vocab_size - 13)])
        proc = Processor.from_pretrained(d)
    if args.image_load:                            # the tokenizer's vision ids (the trace's prompts never hold them)
        cfg = dataclasses.replace(cfg, **{k: ids[k] for k in ("image_token_id", "video_token_id",
                                                              "vision_start_token_id", "vision_end_token_id")})
    model = PrismaVL.from_config(cfg, seed=0, dtype="float32", uncertainty_init="normal")
    reqs = trace(args.requests, tuple(args.prompt), tuple(args.output), args.rate, cfg.text.vocab_size)
    n_tok = sum(r[2] for r in reqs)
    info = {"device": str(jax.devices()[0].device_kind), "cores": os.cpu_count(), "args": vars(args),
            "requests": len(reqs), "output_tokens": n_tok, "trace_span_s": reqs[-1][0],
            "loadavg_start": os.getloadavg()[0], "rows": {}}
    print(f"# {len(reqs)} requests over {reqs[-1][0]:.1f} s, {n_tok} output tokens; load avg "
          f"{info['loadavg_start']:.1f}", flush=True)

    for k in args.steps:
        row = run_serve(model, proc, reqs, args.slots, k, args.max_len, args.image_load, tuple(args.image_size))
        info["rows"][f"serve K={k}"] = row
        print(f"serve K={k}", json.dumps(row), flush=True)

    if args.no_static:
        print("\n| system | generated tok/s | TTFT p50 / p99 s | largest chunk gap s | /health p50 / p99 / max ms |")
        print("| --- | --- | --- | --- | --- |")
        for name, r in info["rows"].items():
            health = (f"{1e3 * r['health_p50_s']:.1f} / {1e3 * r['health_p99_s']:.1f} / {1e3 * r['health_max_s']:.1f}"
                      f" ({r['image_ok']} of {r['image_requests']} image requests)" if "health_p99_s" in r else "–")
            print(f"| {name} | {r['tok_s']:.1f} | {r['ttft_p50']:.2f} / {r['ttft_p99']:.2f} | "
                  f"{r['max_chunk_gap_s']:.2f} | {health} |")
        print(json.dumps(info))
        return 0
    run, compile_only = prisma_batch(model)
    for b in _batches(reqs, args.batch):
        compile_only(b)
    info["rows"]["static generate"] = _static(reqs, args.batch, run)
    print("static generate", json.dumps(info["rows"]["static generate"]), flush=True)

    if not args.no_hf:
        torch.manual_seed(0)
        hf = Qwen3VLForConditionalGeneration(hf_cfg).eval()
        hf_run = hf_batch(hf)
        hf_run(reqs[:1])                                    # warm-up
        info["rows"]["static transformers"] = _static(reqs, args.batch, hf_run)
        print("static transformers", json.dumps(info["rows"]["static transformers"]), flush=True)

    base = info["rows"]["static generate"]["tok_s"]
    print("\n| system | generated tok/s | vs static generate | TTFT p50 / p99 s | end-to-end p50 / p99 s |")
    print("| --- | --- | --- | --- | --- |")
    for name, r in info["rows"].items():
        print(f"| {name} | {r['tok_s']:.1f} | {r['tok_s'] / base:.2f}× | {r['ttft_p50']:.2f} / {r['ttft_p99']:.2f} | "
              f"{r['e2e_p50']:.2f} / {r['e2e_p99']:.2f} |")
    info["loadavg_end"] = os.getloadavg()[0]
    print(json.dumps(info))
    return 0


if __name__ == "__main__":
    sys.exit(main())
