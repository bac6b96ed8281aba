"""prisma-jax vs transformers on one GPU, bf16, `attention: auto`: decode at B = 1 and the training step.

    python benchmarks/gpu.py --out $OUT           # on a GPU host: about 8 minutes
    python benchmarks/gpu.py --smoke --out /tmp/gpu_smoke     # the same runs at toy sizes, on any host (CPU)

Needs, on the GPU host: `pip install -e .[dev]` (transformers, torch==2.13.0, ...) with a CUDA build of torch
2.13.0, plus `pip install "jax[cuda12]"` (the `jax[cuda13]` extra instead if torch is a CUDA 13 build: both load
into one process). Without a GPU that both JAX and torch see, it stops with one message saying which is missing
(`--no-hf` runs the JAX side alone and needs no CUDA torch).

One process per run, each bounded in time (a limit per run, and `--budget-s`, 480 s, for all: a run gets at
most what is left), in this order, the most wanted first:
1. decode.py, the built-in 408 M config: B = 1, prompt 128, 64 new tokens, bf16 both sides, with the
   mechanism-off variant (its overhead);
2. train.py on configs/bench_58m.yaml, `train.compute_dtype=bfloat16`;
3. decode.py on configs/bench_1p7b.yaml (Qwen3-1.7B's text dimensions), B = 1;
4. train.py on configs/bench_1p7b.yaml (batch 4 × 1024);
5. train.py on bench_58m with `model.attention=xla`, JAX side only: the ratio auto / xla.

Reports (stdout, and `summary.md` + `summary.json` in --out, with each run's log and JSON):
* decode tokens/s at B = 1, both sides, and as a fraction of the HBM roofline: bytes read per step (bf16
  weights + the KV of the mean context) over the bandwidth measured by a jitted copy of a 2 GiB array (read
  once, written once), and over the nominal bandwidth of the device when known (H200: 4.8 TB/s);
* training tokens/s and MFU: model FLOPs (train.py: 6·N_matmul + attention, per token) over the measured bf16
  matmul peak (best of a JAX and a torch 8192² loop), and over the nominal dense bf16 peak (H200: 989 TFLOP/s).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOMINAL = {"H200": (4.8e12, 989e12)}   # device kind substring → (HBM bytes/s, dense bf16 FLOP/s)
NEEDS = ('needs a CUDA GPU seen by JAX and by torch: pip install -e ".[dev]" "jax[cuda12]" with torch==2.13.0 '
         'built for CUDA (or --no-hf for the JAX side alone; --smoke for toy sizes on the CPU)')

# toy sizes for --smoke: the same scripts, configs and code paths, small enough for a CPU
TINY_TEXT = ["model.text.num_hidden_layers=2", "model.text.vocab_size=2000", "train.batch_size=2",
             "train.seq_len=64"]
TINY_1P7B = TINY_TEXT + ["model.text.hidden_size=256", "model.text.intermediate_size=512",
                         "model.vision.out_hidden_size=256"]


def runs(smoke: bool) -> list[dict]:
    """The runs, in order: name, script, arguments, time limit (s)."""
    bf16 = ["train.compute_dtype=bfloat16", "model.attention=auto"]
    if smoke:
        dec = ["--dtype", "bfloat16", "--batches", "1", "--prompt", "16", "--new", "8", "--repeats", "1"]
        steps = ["--steps", "2", "--warmup", "1"]
        return [
            dict(name="decode_408m", script="decode.py", args=dec + ["--quick"], limit=240),
            dict(name="train_58m", script="train.py", args=steps + bf16 + TINY_TEXT, limit=240),
            dict(name="decode_1p7b", script="decode.py", limit=240,
                 args=dec + ["--no-off", "--config", "configs/bench_1p7b.yaml"] + TINY_1P7B),
            dict(name="train_1p7b", script="train.py", limit=240,
                 args=steps + ["--config", "configs/bench_1p7b.yaml"] + bf16 + TINY_1P7B),
            dict(name="train_58m_xla", script="train.py", limit=240,
                 args=steps + ["--skip-torch", "train.compute_dtype=bfloat16", "model.attention=xla"] + TINY_TEXT),
        ]
    dec = ["--dtype", "bfloat16", "--batches", "1", "--prompt", "128", "--new", "64", "--repeats", "3"]
    return [
        dict(name="decode_408m", script="decode.py", args=dec, limit=120),
        dict(name="train_58m", script="train.py", args=["--steps", "10", "--warmup", "3"] + bf16, limit=90),
        dict(name="decode_1p7b", script="decode.py", args=dec + ["--no-off", "--config", "configs/bench_1p7b.yaml"],
             limit=120),
        dict(name="train_1p7b", script="train.py", limit=180,
             args=["--steps", "5", "--warmup", "2", "--config", "configs/bench_1p7b.yaml"] + bf16),
        dict(name="train_58m_xla", script="train.py",
             args=["--steps", "10", "--warmup", "3", "--skip-torch", "train.compute_dtype=bfloat16",
                   "model.attention=xla"], limit=60),
    ]


def preflight(smoke: bool, no_hf: bool) -> dict:
    """The devices JAX and torch see, and the packages' versions; exits with one message if this host cannot
    run the benchmark."""
    problems, info = [], {}
    try:
        import jax
        info["jax"] = jax.__version__
        info["jax_backend"] = jax.default_backend()
        info["jax_device"] = str(jax.devices()[0].device_kind)
        if jax.default_backend() != "gpu" and not smoke:
            problems.append(f"JAX runs on {jax.default_backend()} (no GPU backend: jax[cuda12] not installed?)")
    except Exception as e:                                  # noqa: BLE001  reported, then exit
        problems.append(f"JAX does not import ({e})")
    if not no_hf:
        try:
            import torch
            import transformers
            info["torch"], info["transformers"] = torch.__version__, transformers.__version__
            info["torch_cuda"] = torch.version.cuda
            if torch.cuda.is_available():
                info["torch_device"] = torch.cuda.get_device_name(0)
            elif not smoke:
                problems.append(f"torch {torch.__version__} sees no CUDA GPU")
        except Exception as e:                              # noqa: BLE001
            problems.append(f"torch/transformers do not import ({e})")
    if problems:
        sys.exit(f"benchmarks/gpu.py {NEEDS}. Found: {'; '.join(problems)}.")
    return info


def nominal(device: str, bw: float | None, flops: float | None) -> tuple[float | None, float | None]:
    known = next((v for k, v in NOMINAL.items() if k in device), (None, None))
    return bw or known[0], flops or known[1]


def run_one(r: dict, out: str, limit: float, no_hf: bool) -> dict:
    """One script in its own process; its stdout+stderr to <name>.log, its last JSON line to <name>.json."""
    args, flag = list(r["args"]), "--no-hf" if r["script"] == "decode.py" else "--skip-torch"
    if no_hf and flag not in args:
        args.insert(0, flag)
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", r["script"]), *args]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p),
           "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}          # JAX and torch share the GPU's memory
    log = os.path.join(out, r["name"] + ".log")
    print(f"## {r['name']} (limit {limit:.0f} s): {' '.join(cmd[1:])}", flush=True)
    t = time.perf_counter()
    with open(log, "w") as f:
        try:
            p = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=f, text=True, timeout=limit)
            stdout, rc = p.stdout, p.returncode
        except subprocess.TimeoutExpired as e:
            stdout, rc = (e.stdout.decode() if isinstance(e.stdout, bytes) else e.stdout or ""), "timeout"
        f.write(stdout)
    wall = time.perf_counter() - t
    lines = [ln for ln in stdout.splitlines() if ln.startswith("{")]
    res = {"name": r["name"], "cmd": cmd[1:], "rc": rc, "wall_s": wall}
    if rc == 0 and lines:
        res["result"] = json.loads(lines[-1])
        with open(os.path.join(out, r["name"] + ".json"), "w") as f:
            json.dump(res["result"], f, indent=1)
    else:
        with open(log) as f:
            tail = [ln for ln in f.read().splitlines() if ln.strip()][-1:] or [""]
        res["error"] = f"rc {rc}: {tail[0][:200]}"
    print(f"   {'ok' if 'result' in res else res['error']} ({wall:.0f} s)", flush=True)
    return res


def pct(x) -> str:
    return "–" if x is None else f"{100 * x:.1f} %"


def finished(by: dict, names, md: list, columns: int):
    """(name, JSON result) of each named run that finished, in order; a table row saying why for one that
    did not."""
    for name in names:
        r = by.get(name)
        if r is not None and "result" not in r:
            md.append(f"| {name} | {r['error']} |" + " |" * (columns - 2))
        elif r is not None:
            yield name, r["result"]


def summarize(info: dict, results: list[dict], bw_nom, flops_nom) -> tuple[str, dict]:
    """The Markdown report and the summary dict."""
    by = {r["name"]: r for r in results}
    md = [f"# prisma-jax vs transformers, bf16, attention auto: {info.get('jax_device')}",
          "",
          f"jax {info.get('jax')} ({info.get('jax_backend')}), torch {info.get('torch', '–')} (CUDA "
          f"{info.get('torch_cuda')}, {info.get('torch_device', 'no GPU')}), transformers "
          f"{info.get('transformers', '–')}.", ""]
    summary = {"info": info, "nominal_bw": bw_nom, "nominal_flops": flops_nom, "decode": [], "train": []}

    md += ["## Decode, B = 1 (prompt, then greedy tokens; bf16 weights and KV cache)", "",
           "| config | params (table included) | prisma-jax tok/s | transformers tok/s | ratio | "
           "bytes read / step (weights + KV) | measured bandwidth | roofline tok/s | "
           "prisma-jax: of roofline (of nominal) | transformers: of roofline (of nominal) | mechanism overhead |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, d in finished(by, ("decode_408m", "decode_1p7b"), md, 11):
        row = next(x for x in d["rows"] if x["B"] == 1)
        hf, ours = row.get("hf_step_tok_s"), row["prisma_step_tok_s"]
        frac = {k: row.get(f"{k}_roofline_frac") for k in ("prisma", "hf")}
        nom = {k: (row[f"{k}_step_tok_s"] * row["step_bytes"] / bw_nom if bw_nom and f"{k}_step_tok_s" in row
                   else None) for k in ("prisma", "hf")}
        over = row.get("mechanism_overhead_pct")
        md.append(f"| {name} | {d['params'] / 1e6:.0f} M | {ours:.1f} | {'–' if hf is None else f'{hf:.1f}'} | "
                  f"{'–' if hf is None else f'{ours / hf:.2f}×'} | "
                  f"{row['step_bytes'] / 1e9:.3f} GB | {d['read_GBps']:.0f} GB/s | {row['roofline_tok_s']:.0f} | "
                  f"{pct(frac['prisma'])} ({pct(nom['prisma'])}) | {pct(frac['hf'])} ({pct(nom['hf'])}) | "
                  f"{'–' if over is None else f'{over:+.1f} %'} |")
        summary["decode"].append({"name": name, "params": d["params"], "prisma_tok_s": ours,
                                  "hf_tok_s": hf, "step_bytes": row["step_bytes"], "measured_GBps": d["read_GBps"],
                                  "bandwidth_measured_by": d["bandwidth_measured_by"],
                                  "roofline_tok_s": row["roofline_tok_s"], "prisma_roofline_frac": frac["prisma"],
                                  "hf_roofline_frac": frac["hf"], "prisma_nominal_frac": nom["prisma"],
                                  "hf_nominal_frac": nom["hf"], "mechanism_overhead_pct": over,
                                  "compile_s": row["compile_s"]})
    bw_txt = next((d["bandwidth_measured_by"] for d in (by.get(n, {}).get("result") for n in
                                                      ("decode_408m", "decode_1p7b")) if d), "–")
    md += ["", f"Decode tok/s: 1 ÷ the best decode-only step time (decode.py). Bandwidth: {bw_txt}; nominal "
           f"{'–' if not bw_nom else f'{bw_nom / 1e12:.2f} TB/s'}.", ""]

    md += ["## Training step (bf16 compute, float32 master weights, AdamW with clipping)", "",
           "| config | attention | tokens / step | prisma-jax step ms | tok/s | MFU measured (nominal) | "
           "transformers step ms | tok/s | MFU measured (nominal) | prisma / transformers |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, d in finished(by, ("train_58m", "train_1p7b", "train_58m_xla"), md, 10):
        flops = d["model_gflop_per_step"] * 1e9
        cells, entry = [], {"name": name, "attention": d["attention"], "tokens": d["tokens_per_step"],
                            "peak_tflops": d["peak_gflops"] / 1e3}
        for side in ("jax", "torch"):
            s = d.get(side)
            if s is None:
                cells.append("– | – | –")
                continue
            mfu_nom = flops / s["step_s"] / flops_nom if flops_nom else None
            cells.append(f"{1e3 * s['step_s']:.1f} | {s['tokens_per_sec']:.0f} | {pct(s['mfu'])} ({pct(mfu_nom)})")
            entry[side] = {"step_s": s["step_s"], "tokens_per_sec": s["tokens_per_sec"], "mfu": s["mfu"],
                           "mfu_nominal": mfu_nom}
        ratio = (f"{d['torch']['step_s'] / d['jax']['step_s']:.2f}×" if "torch" in d and "jax" in d else "–")
        md.append(f"| {name} | {d['attention']} | {d['tokens_per_step']} | {cells[0]} | {cells[1]} | {ratio} |")
        summary["train"].append(entry)
    peak = next((r["result"]["peak_gflops"] for r in results if r["name"].startswith("train") and "result" in r),
                None)
    md += ["", f"MFU: model FLOPs per step ÷ step time ÷ peak; measured bf16 matmul peak "
           f"{'–' if peak is None else f'{peak / 1e3:.4g} TFLOP/s'} (best of JAX and torch), nominal "
           f"{'–' if not flops_nom else f'{flops_nom / 1e12:.0f} TFLOP/s'}."]
    auto, xla = by.get("train_58m", {}).get("result"), by.get("train_58m_xla", {}).get("result")
    if auto and xla:
        r = xla["jax"]["step_s"] / auto["jax"]["step_s"]
        md.append(f"bench_58m training step, attention auto vs xla: {r:.2f}× (xla step time ÷ auto step time).")
        summary["train_58m_auto_over_xla_speedup"] = r
    summary["runs"] = [{k: v for k, v in r.items() if k != "result"} for r in results]
    return "\n".join(md) + "\n", summary


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT") or "gpu_bench_out", help="output directory ($OUT)")
    ap.add_argument("--smoke", action="store_true", help="toy sizes; runs on any host, the CPU included")
    ap.add_argument("--no-hf", action="store_true", help="the JAX side only (no torch/transformers runs)")
    ap.add_argument("--budget-s", type=float, help="wall-clock budget of all runs (480 s; 900 s with --smoke)")
    ap.add_argument("--only", nargs="+", help="run only these (decode_408m train_58m decode_1p7b ...)")
    ap.add_argument("--nominal-bw", type=float, help="nominal memory bandwidth, bytes/s (default: known devices)")
    ap.add_argument("--nominal-flops", type=float, help="nominal dense bf16 FLOP/s (default: known devices)")
    a = ap.parse_args(argv)
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    info = preflight(a.smoke, a.no_hf)
    bw_nom, flops_nom = nominal(info.get("jax_device", ""), a.nominal_bw, a.nominal_flops)
    print(f"# device: JAX {info.get('jax_device')} ({info.get('jax_backend')}), torch {info.get('torch_device', '–')};"
          f" nominal bandwidth {bw_nom}, nominal bf16 FLOP/s {flops_nom}", flush=True)
    os.makedirs(a.out, exist_ok=True)
    budget = a.budget_s or (900 if a.smoke else 480)
    t0, results = time.perf_counter(), []
    for r in runs(a.smoke):
        if a.only and r["name"] not in a.only:
            continue
        left = budget - (time.perf_counter() - t0)
        if left < 20:
            results.append({"name": r["name"], "rc": "skipped", "error": f"skipped: {left:.0f} s of budget left"})
            continue
        if r["script"] == "decode.py" and bw_nom:
            r = {**r, "args": r["args"] + ["--nominal-bw", str(bw_nom)]}
        results.append(run_one(r, a.out, min(r["limit"], left), a.no_hf))
    md, summary = summarize(info, results, bw_nom, flops_nom)
    summary["total_s"] = time.perf_counter() - t0
    with open(os.path.join(a.out, "summary.md"), "w") as f:
        f.write(md)
    with open(os.path.join(a.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print("\n" + md)
    print(f"({summary['total_s']:.0f} s; logs, per-run JSON, summary.md and summary.json in {a.out})")
    return 0 if all("result" in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
