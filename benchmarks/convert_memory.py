"""Peak memory and wall time of `prisma convert` (hf-to-orbax, orbax-to-hf, train-to-hf) on a synthetic
multi-GB checkpoint.

The checkpoint uses the real Prisma-VL-8B naming scheme and tensor shapes (vocab 151936, hidden 4096,
MLP 12288, 2^16-row uncertainty table, untied head) with fewer layers (`--full`: the config's own 36 text
layers and vision depth 27), random bf16 values, in ≤ 2 GB shards. Each direction runs in a child process
under `/usr/bin/time -v` (or, without it, psutil polling of the child's RSS); the round trip is then checked
tensor by tensor (crc32 of the bytes). With --train (or --train-only, which skips the two directions), a
`prisma train` workdir checkpoint of the same model shapes is written at step 0 in the training loop's Orbax
layout (float32 params as training holds them, Adam moments of the same size, zeros as at step 0), leaf by
leaf and chunk by chunk (`write_train_checkpoint`: no more than one storage chunk in memory), exported with
`train-to-hf`, measured, and the export checked value by value against the params; then everything is
deleted.

    .venv/bin/python benchmarks/convert_memory.py [--text-layers 1] [--vision-depth 1 | --full] [--dir /tmp/...]
                                                  [--train | --train-only]
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
from prisma_jax.core.config import config_to_hf, load_config
from prisma_jax.checkpoint.hf_names import hf_names
from prisma_jax.checkpoint.safetensors import INDEX_NAME, Checkpoint, plan_shards, write_streaming

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BF16 = np.dtype(ml_dtypes.bfloat16)


def model_config(text_layers: int, vision_depth: int):
    """configs/prisma_vl_8b.yaml with these layer counts (its own deepstack indexes when they fit, else the
    first min(3, depth) blocks)."""
    cfg = load_config(os.path.join(ROOT, "configs", "prisma_vl_8b.yaml"))
    deep = cfg.vision.deepstack_visual_indexes
    if max(deep) >= vision_depth:
        deep = tuple(range(min(3, vision_depth)))
    return cfg.replace(text=dataclasses.replace(cfg.text, num_hidden_layers=text_layers),
                       vision=dataclasses.replace(cfg.vision, depth=vision_depth, deepstack_visual_indexes=deep))


def make_checkpoint(path: str, cfg, shard_bytes: int = 2 * 10**9) -> dict:
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


POOL = 1 << 24   # a leaf's values are windows of one pool of random values (see leaf_values)


def leaf_values(cfg, trained: bool = False):
    """values(path, index) → the float32 values of param `path` at `index` (a slice per axis): element (r, c)
    of the leaf (r: its position over all axes but the last) is pool[(7919·r + crc32(path) + c) mod POOL] of a
    pool of N(0, 0.02²) draws, so any region can be made, and checked, on its own and the same whatever the
    chunking. The draws are rounded to bfloat16 (a step-0 checkpoint initialised from the bf16 release: zstd
    stores them in about 40 % of their size), or with `trained` kept in full float32 (a trained run's master
    weights, with random low mantissa bits: about 60 %, so more of each chunk is read)."""
    from prisma_jax.core.trees import flatten
    from prisma_jax.nn.params import param_shapes

    shapes = dict(flatten(param_shapes(cfg)))
    pool = np.random.default_rng(1).normal(0, 0.02, POOL).astype(np.float32)
    if not trained:
        pool = (pool.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)
    pool = np.concatenate([pool, pool[:max(s[-1] for s in shapes.values())]])   # periodic: no window wraps

    def values(path, index):
        shape = shapes[path]
        ranges = [range(*sl.indices(n)) for sl, n in zip(index, shape)]
        rows = (np.ravel_multi_index(np.meshgrid(*ranges[:-1], indexing="ij"), shape[:-1]) if len(shape) > 1
                else np.zeros((), np.int64))
        starts = (rows.astype(np.int64) * 7919 + zlib.crc32(".".join(path).encode()) + ranges[-1].start) % POOL
        return np.lib.stride_tricks.sliding_window_view(pool, len(ranges[-1]))[starts]

    return values


def train_config(cfg):
    """train/config.py's Config around a model config: the optimizer's state has the real structure."""
    from train.config import config_from_raw
    return config_from_raw({"model": cfg.to_dict(), "train": {"steps": 1, "batch_size": 1, "seq_len": 16}})


def write_train_checkpoint(workdir: str, tcfg, values, step: int = 0, chunk_bytes: int | None = None) -> dict:
    """A `prisma train` checkpoint of `tcfg` at `step`, in the layout Orbax's CheckpointManager writes for
    train/loop.py, written leaf by leaf and chunk by chunk with tensorstore, so no more than one storage chunk is
    ever in memory (Orbax's own save of a state holds it whole): params from `values(path, index)`, every
    other array (the Adam moments, counts, step, RNG) zeros, as at step 0.

    Layout: `<step>/state` is one OCDBT database (the one Orbax's merge of its per-process databases gives) of
    zarr v2 arrays named by their key paths, zstd level 1, each chunked as Orbax chunks an array saved from one
    host (`choose_chunk_shape` with its 2 GiB target; `chunk_bytes` overrides the target, e.g. for a small
    test), beside Orbax's `_METADATA`, `_sharding` and `array_metadatas/process_0`; `<step>/meta` the JSON
    item, `<step>/data` a grain iterator state, `<step>/_CHECKPOINT_METADATA`. Written in
    `<step>.orbax-checkpoint-tmp` and renamed. Returns {"params": bytes, "largest": bytes, "largest_chunk":
    bytes}."""
    import base64

    import jax
    import tensorstore as ts
    from orbax.checkpoint._src.arrays.subchunking import choose_chunk_shape

    from train.loop import _as_dict, checkpoint_dir
    from train.step import fresh_state

    abstract = jax.eval_shape(lambda: _as_dict(fresh_state(tcfg, jax.random.PRNGKey(0))))
    empty = lambda x: x is None or (isinstance(x, (tuple, list, dict)) and len(x) == 0)   # noqa: E731
    leaves = jax.tree_util.tree_flatten_with_path(abstract, is_leaf=empty)[0]
    final = os.path.join(checkpoint_dir(workdir), str(step))
    tmp = final + ".orbax-checkpoint-tmp"
    state = os.path.join(tmp, "state")
    for item in ("state", "data", "meta"):
        os.makedirs(os.path.join(tmp, item))
    kv = {"driver": "ocdbt", "base": {"driver": "file", "path": state}, "target_data_file_size": 2 ** 31,
          "config": {"max_inline_value_bytes": 1024, "max_decoded_node_bytes": 100000000}}
    context = ts.Context({"file_io_sync": False})
    tree, sharding, arrays, info = {}, {}, [], {"params": 0, "largest": 0, "largest_chunk": 0}
    single = json.dumps({"sharding_type": "SingleDeviceSharding", "device_str": "cpu:0"})
    for kp, x in leaves:
        keys = [(str(k.key), 2) if isinstance(k, jax.tree_util.DictKey) else (k.name, 2)
                if isinstance(k, jax.tree_util.GetAttrKey) else (str(k.idx), 1) for k in kp]
        entry = {"key_metadata": [{"key": k, "key_type": t} for k, t in keys]}
        tree[str(tuple(k for k, _ in keys))] = entry
        if empty(x):
            entry["value_metadata"] = {"value_type": "None", "skip_deserialize": True}
            continue
        name, shape, dt = ".".join(k for k, _ in keys), tuple(x.shape), np.dtype(x.dtype)
        entry["value_metadata"] = {"value_type": "jax.Array", "skip_deserialize": False, "write_shape": list(shape)}
        nbytes = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
        target = chunk_bytes if chunk_bytes is not None else (2 ** 31 if nbytes > 2 ** 31 else None)
        chunks = tuple(choose_chunk_shape(shape, shape, dt, target))
        sharding[base64.b64encode(name.encode()).decode()] = single
        arrays.append({"array_metadata": {"param_name": name, "write_shape": list(shape), "chunk_shape": list(chunks),
                                          "ext_metadata": None}})
        arr = ts.open({"driver": "zarr", "kvstore": {**kv, "path": name}, "metadata": {
            "shape": list(shape), "chunks": list(chunks), "dtype": np.dtype(dt).newbyteorder("<").str,
            "compressor": {"id": "zstd", "level": 1}, "fill_value": None, "order": "C", "filters": None,
            "dimension_separator": "."}}, create=True, context=context).result()
        param = keys[0][0] == "params"
        path = tuple(k for k, _ in keys[1:])
        if param:
            info["params"] += nbytes
            info["largest"] = max(info["largest"], nbytes)
        info["largest_chunk"] = max(info["largest_chunk"], int(np.prod(chunks, dtype=np.int64)) * dt.itemsize)
        for start in np.ndindex(*[-(-n // c) for n, c in zip(shape, chunks)]):
            index = tuple(slice(i * c, min((i + 1) * c, n)) for i, c, n in zip(start, chunks, shape))
            block = values(path, index) if param else np.zeros([sl.stop - sl.start for sl in index], dt)
            arr[index].write(block).result()
            del block
    now = time.time_ns()
    dumps = {
        ("state", "_METADATA"): {"tree_metadata": tree, "use_ocdbt": True, "use_zarr3": False,
                                 "store_array_data_equal_to_fill_value": True, "custom_metadata": None},
        ("state", "_sharding"): sharding,
        ("state", "array_metadatas", "process_0"): {"array_metadatas": arrays},
        ("meta", "metadata"): {"model": tcfg.model.to_dict(), "config": tcfg.to_dict()},
        ("data", "process_0-of-1.json"): {"next_index": 0},
        ("_CHECKPOINT_METADATA",): {
            "item_handlers": {
                "data": "grain._src.python.checkpoint.handler.CheckpointHandler",
                "meta": "orbax.checkpoint._src.handlers.json_checkpoint_handler.JsonCheckpointHandler",
                "state": "orbax.checkpoint._src.handlers.standard_checkpoint_handler.StandardCheckpointHandler"},
            "metrics": {}, "performance_metrics": {}, "init_timestamp_nsecs": now, "commit_timestamp_nsecs": now,
            "custom_metadata": {}},
    }
    for parts, obj in dumps.items():
        os.makedirs(os.path.join(tmp, *parts[:-1]), exist_ok=True)
        with open(os.path.join(tmp, *parts), "w") as f:
            json.dump(obj, f)
    for item in ("state", "data", "meta", ""):
        with open(os.path.join(tmp, item, "commit_success.txt"), "w") as f:
            f.write(f"Checkpoint commit was successful to {os.path.join(final, item).rstrip('/')}")
    os.rename(tmp, final)
    return info


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


def check_export(directory: str, cfg, values) -> int:
    """How many tensors of the Hugging Face export at `directory` differ from `values` (compared in row blocks,
    so the check holds no whole tensor either)."""
    from prisma_jax.checkpoint import orbax as L

    bad = 0
    with Checkpoint(directory) as ck:
        for n in hf_names(cfg):
            got = ck.get(n.hf)
            stack = () if n.index is None else (slice(n.index, n.index + 1),)
            if not L.blockable(n):
                want = [n.to_hf(values(n.path, stack + (slice(None),) * (got.ndim - len(stack)))[0 if stack else ...])]
                same = np.array_equal(got, want[0])
            else:
                same = True
                for r0, r1 in L.row_blocks(n, 4):
                    region = L.leaf_region(n, r0, r1)[len(stack):]
                    x = values(n.path, stack + tuple(region) + (slice(None),) * (
                        len(n.hf_shape) - len(region)))
                    same &= np.array_equal(got[r0:r1], n.to_hf(x[0] if stack else x))
            bad += not same
            ck.release(n.hf)
    return bad


def measure_train_to_hf(cfg, root: str, prisma: list[str], trained: bool = False) -> None:
    wd, exp = os.path.join(root, "train"), os.path.join(root, "train_export")
    values = leaf_values(cfg, trained)
    t0 = time.time()
    info = write_train_checkpoint(wd, train_config(cfg), values)
    disk = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(wd) for f in fs)
    print(f"training checkpoint: params {info['params'] / 1e9:.2f} GB float32 "
          f"({'full float32 values' if trained else 'bf16-valued'}) + Adam moments of the same size "
          f"(zeros, as at step 0), largest leaf {info['largest'] / 1e9:.3f} GB, largest storage chunk "
          f"{info['largest_chunk'] / 1e9:.3f} GB; {disk / 1e9:.2f} GB on disk (zstd), written in {time.time() - t0:.0f} s",
          flush=True)
    rss, wall, _ = run_measured(prisma + ["train-to-hf", wd, exp])
    print(f"train-to-hf: peak RSS {rss / 1e9:.2f} GB (expected ≈ 2 × the largest chunk + a block + interpreter; "
          f"the largest leaf is {info['largest'] / 1e9:.2f} GB, params + moments {3 * info['params'] / 1e9:.2f} GB), "
          f"wall {wall:.1f} s, {info['params'] / 1e9 / wall:.2f} GB/s", flush=True)
    bad = check_export(exp, cfg, values)
    print(f"export equals the checkpoint's params: {bad == 0} ({len(hf_names(cfg))} tensors, {bad} differ)")
    if bad:
        sys.exit(1)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--text-layers", type=int, default=1)
    ap.add_argument("--vision-depth", type=int, default=1)
    ap.add_argument("--full", action="store_true",
                    help="configs/prisma_vl_8b.yaml's own layer counts (36 text layers, vision depth 27)")
    ap.add_argument("--dir", default="/tmp/prisma_convert_bench")
    ap.add_argument("--keep", action="store_true", help="keep the files")
    ap.add_argument("--train", action="store_true", help="also measure train-to-hf (≈ 6 × the bf16 size on disk)")
    ap.add_argument("--train-only", action="store_true", help="measure train-to-hf alone (implies --train)")
    ap.add_argument("--trained", action="store_true",
                    help="train-to-hf on full float32 values (a trained run's) instead of bf16-rounded ones")
    args = ap.parse_args()
    full = load_config(os.path.join(ROOT, "configs", "prisma_vl_8b.yaml"))
    if args.full:
        args.text_layers, args.vision_depth = full.text.num_hidden_layers, full.vision.depth
    if args.text_layers < 1 or args.vision_depth < 1:
        ap.error("--text-layers and --vision-depth must be ≥ 1")
    cfg = model_config(args.text_layers, args.vision_depth)
    shutil.rmtree(args.dir, ignore_errors=True)
    src, orb, out = (os.path.join(args.dir, n) for n in ("hf", "orbax", "hf_export"))
    prisma = [sys.executable, "-m", "prisma_jax.apps.cli", "convert"]
    try:
        if args.train_only:
            return measure_train_to_hf(cfg, args.dir, prisma, args.trained)
        t0 = time.time()
        info = make_checkpoint(src, cfg)
        print(f"synthetic checkpoint: {info['bytes'] / 1e9:.2f} GB, {info['tensors']} tensors in {info['shards']} "
              f"shards, largest tensor {info['largest'] / 1e9:.3f} GB (written in {time.time() - t0:.0f} s)")
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
            measure_train_to_hf(cfg, args.dir, prisma, args.trained)
    finally:
        if not args.keep:
            shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
