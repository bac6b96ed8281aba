"""An Orbax directory written by `hf-to-orbax` → Hugging Face safetensors shards, streamed and verified.

Each tensor is read from its zarr array one block at a time (a column block of our kernel = a row block of
the torch weight), turned back into torch layout and appended to its shard; no tensor, and no shard, is ever
whole in memory. The crc32 of every tensor is checked against the one recorded at conversion time, so a
corrupted array is an error naming the tensor, never a silently different export. Shards are ≤ 5 GB with
`model.safetensors.index.json`; `config.json` records the table size (`uncertainty_n_bits`).
"""
from __future__ import annotations

import json
import os
import sys

import numpy as np

from prisma_jax.core.config import config_to_hf
from prisma_jax.checkpoint.hf_names import hf_names
from prisma_jax.checkpoint.safetensors import INDEX_NAME, CheckpointError, plan_shards, write_streaming

from prisma_jax.checkpoint import orbax as L
from conversion.staging import Staging, check_destination, copy_side_files, human_bytes, progress_bar

MAX_SHARD_BYTES = 5 * 10**9
BASE_RSS = 450 << 20


def export(src: str, dst: str, overwrite: bool = False, dry_run: bool = False, max_shard_bytes: int = MAX_SHARD_BYTES,
           progress: bool | None = None, out=None) -> dict:
    """Write the safetensors checkpoint `dst` from the converted Orbax directory `src`; returns the index."""
    out = out or sys.stdout
    check_destination(dst, overwrite, src)
    meta, cfg = L.read_meta(src)
    names = hf_names(cfg)
    dts = {n.hf: meta["_dtypes"][n.path] for n in names}
    recorded = meta.get("tensors", {})
    missing = [n.hf for n in names if n.hf not in recorded]
    if missing:
        raise CheckpointError(f"{src}: {L.META_NAME} has no checksum for {', '.join(missing[:10])}")
    specs = [(n.hf, n.hf_shape, dts[n.hf]) for n in names]
    shards = plan_shards(specs, max_shard_bytes)
    files = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    total = sum(int(np.prod(s, dtype=np.int64)) * np.dtype(d).itemsize for _, s, d in specs)
    big = max(L.block_rows(n, dts[n.hf].itemsize) * int(np.prod(n.hf_shape[1:], dtype=np.int64))
              * dts[n.hf].itemsize for n in names)
    peak = BASE_RSS + 3 * big
    if dry_run:
        print(f"would write {dst}: {len(names)} tensors, {human_bytes(total)} in {len(files)} shard(s) "
              f"of ≤ {human_bytes(max_shard_bytes)}, n_bits={cfg.n_bits}", file=out)
        for f, shard in zip(files, shards):
            print(f"  {f}: {len(shard)} tensors", file=out)
        print(f"expected peak memory: {human_bytes(peak)}", file=out)
        return {"dry_run": True, "peak_bytes": peak, "bytes": total}
    by_name = {n.hf: n for n in names}
    arrays = {}
    for n in names:
        if n.path not in arrays:
            arrays[n.path] = L.open_array(src, n.path)

    def blocks(hf: str, bar):
        n = by_name[hf]
        for block in L.hf_blocks(src, arrays[n.path], n, dts[hf], recorded):
            bar.update(block.nbytes)
            yield block

    weight_map = {}
    with Staging(dst, overwrite, src) as tmp:
        with progress_bar(total, "orbax-to-hf", progress) as bar:
            for f, shard in zip(files, shards):
                write_streaming(os.path.join(tmp, f), [(k, by_name[k].hf_shape, dts[k]) for k in shard],
                                lambda k: blocks(k, bar), metadata={"format": "pt"})
                weight_map.update({k: f for k in shard})
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        with open(os.path.join(tmp, INDEX_NAME), "w") as fh:
            json.dump(index, fh, indent=2)
        hf_cfg = _export_config(src, cfg, dts)
        with open(os.path.join(tmp, "config.json"), "w") as fh:
            json.dump(hf_cfg, fh, indent=2)
        copy_side_files(src, tmp, skip=L.ORBAX_FILES + ("config.json",))
    return index


def _export_config(src: str, cfg, dts) -> dict:
    """The source's config.json (as copied at conversion), recording the table size and stored dtype."""
    path = os.path.join(src, "config.json")
    try:
        with open(path) as f:
            hf = json.load(f)
    except (OSError, json.JSONDecodeError):
        hf = config_to_hf(cfg)
    hf["uncertainty_n_bits"] = cfg.n_bits
    kinds = {L.DTYPE_NAMES[d] for d in dts.values()}
    if len(kinds) == 1:
        hf["dtype"] = kinds.pop()
        for sub in ("text_config", "vision_config"):
            if isinstance(hf.get(sub), dict) and "dtype" in hf[sub]:
                hf[sub]["dtype"] = hf["dtype"]
    return hf
