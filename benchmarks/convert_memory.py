"""Peak memory and wall time of `prisma convert` (hf-to-orbax, orbax-to-hf, train-to-hf) on a synthetic
multi-GB checkpoint.

The checkpoint uses the real Prisma-VL-8B naming scheme and tensor shapes (vocab 151936, hidden 4096,
MLP 12288, 2^16-row uncertainty table, untied head) with fewer layers, random bf16 values, in ≤ 2 GB shards.
Each direction runs in a child process under `/usr/bin/time -v` (or, without it, psutil polling of the
child's RSS); the round trip is then checked tensor by tensor (crc32 of the bytes). With --train, a `prisma
train` workdir checkpoint of the same params (float32, as training holds them, plus Adam-sized moments) is
saved at step 0 in the training loop's Orbax layout and exported with `train-to-hf`, also measured; then
everything is deleted.

    .venv/bin/python benchmarks/convert_memory.py [--text-layers 1] [--vision-depth 1] [--dir /tmp/...] [--train]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import time
import zlib

import ml_dtypes
import numpy as np

# the repository first: this folder's train.py would shadow the `train` package
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from prisma_jax.config import config_to_hf, load_config
from prisma_jax.params import hf_names
from prisma_jax.safetensors_io import INDEX_NAME, Checkpoint, plan_shards, write_streaming

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BF16 = np.dtype(ml_dtypes.bfloat16)


def make_checkpoint(path: str, text_layers: int, vision_depth: int, shard_bytes: int = 2 * 10**9) -> dict:
    cfg = load_config(os.path.join(ROOT, "configs", "prisma_vl_8b.yaml"))
    cfg = cfg.replace(text=dataclasses.replace(cfg.text, num_hidden_layers=text_layers),
                      vision=dataclasses.replace(cfg.vision, depth=vision_depth,
                                                 deepstack_visual_indexes=tuple(range(min(3, vision_depth)))))
    os.makedirs(path)
    names = hf_names(cfg)
    specs = [(n.hf, n.hf_shape, BF16) for n in names]
    shards = plan_shards(specs, shard_bytes)
    shape = {n.hf: n.hf_shape for n in names}
    pool = np.random.default_rng(0).integers(0, 1 << 16, (16 << 20) // 2 + 4099, dtype=np.uint16)
    pool = ((pool & 0x807F) | 0x3C00).view(BF16)   # random bf16 in ±[2^-7, 2)

    def blocks(name):   # 32 MB at a time, each block a different window of the random pool
        rows, row = shape[name][0], int(np.prod(shape[name][1:], dtype=np.int64))
        step = max(1, (16 << 20) // max(row, 1) // 2)
        for r in range(0, rows, step):
            n = min(step, rows - r) * row
            start = (zlib.crc32(f"{name}{r}".encode()) % 4099)
            yield pool[start:start + n].reshape(-1, *shape[name][1:])

    weight_map = {}
    for i, shard in enumerate(shards):
        f = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        write_streaming(os.path.join(path, f), [s for s in specs if s[0] in set(shard)], blocks, {"format": "pt"})
        weight_map.update({k: f for k in shard})
    total = sum(int(np.prod(s, dtype=np.int64)) * 2 for _, s, _ in specs)
    with open(os.path.join(path, INDEX_NAME), "w") as fh:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, fh)
    with open(os.path.join(path, "config.json"), "w") as fh:
        json.dump(config_to_hf(cfg), fh)
    largest = max(int(np.prod(s, dtype=np.int64)) * 2 for _, s, _ in specs)
    return {"bytes": total, "largest": largest, "tensors": len(specs), "shards": len(shards)}


def make_train_checkpoint(src: str, workdir: str) -> dict:
    """A `prisma train` checkpoint (train/loop.py's items and state layout) at step 0 holding `src`'s params in
    float32, with Adam-sized moments (the same arrays again: the export must never read them)."""
    import jax
    import orbax.checkpoint as ocp

    from prisma_jax.loading import load_hf
    from train.loop import CHECKPOINT_ITEMS, checkpoint_dir

    params, cfg = load_hf(src, dtype="float32")
    leaves = jax.tree.leaves(params)
    state = {"step": np.int32(0), "params": params, "opt_state": {"mu": params, "nu": params},
             "rng": np.zeros(2, np.uint32)}
    mngr = ocp.CheckpointManager(checkpoint_dir(workdir), item_names=CHECKPOINT_ITEMS)
    mngr.save(0, args=ocp.args.Composite(state=ocp.args.StandardSave(state), data=ocp.args.JsonSave({}),
                                         meta=ocp.args.JsonSave({"model": cfg.to_dict()})))
    mngr.wait_until_finished()
    mngr.close()
    return {"params": sum(x.nbytes for x in leaves), "largest": max(x.nbytes for x in leaves)}


def run_measured(argv: list[str]) -> tuple[float, float, str]:
    """(peak RSS bytes, wall seconds, stdout) of a child process."""
    if os.path.exists("/usr/bin/time"):
        t0 = time.time()
        r = subprocess.run(["/usr/bin/time", "-v", *argv], capture_output=True, text=True)
        wall = time.time() - t0
        if r.returncode:
            sys.exit(f"failed: {' '.join(argv)}\n{r.stderr[-2000:]}")
        rss = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", r.stderr).group(1)) * 1024
        return rss, wall, r.stdout
    import psutil
    t0, peak = time.time(), 0
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    ps = psutil.Process(p.pid)
    while p.poll() is None:
        try:
            peak = max(peak, ps.memory_info().rss)
        except psutil.NoSuchProcess:
            break
        time.sleep(0.05)
    return peak, time.time() - t0, p.stdout.read()


def checksums(directory: str) -> dict:
    out = {}
    with Checkpoint(directory) as ck:
        for k in ck.keys():
            out[k] = (ck.dtype(k).name, ck.shape(k), zlib.crc32(ck.get(k).reshape(-1).view(np.uint8)))
            ck.release(k)
    return out


def measure_train_to_hf(src: str, root: str, prisma: list[str]) -> None:
    wd, exp = os.path.join(root, "train"), os.path.join(root, "train_export")
    t0 = time.time()
    tinfo = make_train_checkpoint(src, wd)
    print(f"training checkpoint: params {tinfo['params'] / 1e9:.2f} GB float32 (+ {2 * tinfo['params'] / 1e9:.2f} "
          f"GB moments), largest leaf {tinfo['largest'] / 1e9:.3f} GB (saved in {time.time() - t0:.0f} s)")
    rss, wall, _ = run_measured(prisma + ["train-to-hf", wd, exp])
    print(f"train-to-hf: peak RSS {rss / 1e9:.2f} GB (expected ≈ largest leaf + a block + interpreter; the "
          f"whole state would be 3 × {tinfo['params'] / 1e9:.2f} = {3 * tinfo['params'] / 1e9:.2f} GB), "
          f"wall {wall:.1f} s")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--text-layers", type=int, default=1)
    ap.add_argument("--vision-depth", type=int, default=1)
    ap.add_argument("--dir", default="/tmp/prisma_convert_bench")
    ap.add_argument("--keep", action="store_true", help="keep the files")
    ap.add_argument("--train", action="store_true", help="also measure train-to-hf (≈ 6 × the bf16 size on disk)")
    ap.add_argument("--train-only", action="store_true", help="measure train-to-hf alone (implies --train)")
    args = ap.parse_args()
    shutil.rmtree(args.dir, ignore_errors=True)
    src, orb, out = (os.path.join(args.dir, n) for n in ("hf", "orbax", "hf_export"))
    prisma = [sys.executable, "-m", "prisma_jax.cli", "convert"]
    try:
        t0 = time.time()
        info = make_checkpoint(src, args.text_layers, args.vision_depth)
        print(f"synthetic checkpoint: {info['bytes'] / 1e9:.2f} GB, {info['tensors']} tensors in {info['shards']} "
              f"shards, largest tensor {info['largest'] / 1e9:.3f} GB (written in {time.time() - t0:.0f} s)")
        if args.train_only:
            return measure_train_to_hf(src, args.dir, prisma)
        dry = subprocess.run(prisma + ["hf-to-orbax", src, orb, "--dry-run"], capture_output=True, text=True)
        print("dry run:", dry.stdout.strip().splitlines()[-1])
        goal = 1.5 * info["largest"] + 1e9
        for name, argv in (("hf-to-orbax", prisma + ["hf-to-orbax", src, orb]),
                           ("orbax-to-hf", prisma + ["orbax-to-hf", orb, out])):
            rss, wall, _ = run_measured(argv)
            print(f"{name}: peak RSS {rss / 1e9:.2f} GB (goal ≤ 1.5 × largest + 1 GB = {goal / 1e9:.2f} GB), "
                  f"wall {wall:.1f} s, {info['bytes'] / 1e9 / wall:.2f} GB/s")
        a, b = checksums(src), checksums(out)
        same = a.keys() == b.keys() and all(a[k] == b[k] for k in a)
        print(f"round trip bit-identical: {same} ({len(a)} tensors)")
        if not same:
            sys.exit(1)
        if args.train:
            measure_train_to_hf(src, args.dir, prisma)
    finally:
        if not args.keep:
            shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
