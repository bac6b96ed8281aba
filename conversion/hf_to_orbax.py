"""Hugging Face safetensors (Qwen3-VL or Prisma-VL) → an Orbax checkpoint of the param tree, streamed.

Every tensor is validated first (files, keys, shapes against config.json, table size → n_bits), then copied
block by block — a memory-mapped row block of the source, transposed into a column block of our kernel,
written into the zarr chunk it fills — so peak memory is a few blocks (≤ 64 MB each) plus the interpreter,
whatever the model size. The dtype is the source's unless `dtype` asks otherwise (bf16 stays bf16).
A plain Qwen3-VL source gets the uncertainty table of docs/introspection-contract.md §1 (zeros by default, or normal(0, 0.02)).
The crc32 of each tensor (Hugging Face layout) and of each chunk is recorded (orbax_layout.py, "checksums").
"""
from __future__ import annotations

import datetime
import os
import sys
import zlib

import numpy as np

import prisma_jax
from prisma_jax.checkpoint.loading import open_checked, resolve_dtype
from prisma_jax.checkpoint.hf_names import UNCERTAINTY_KEY
from prisma_jax.nn.params import param_shapes
from prisma_jax.core.trees import get_path
from prisma_jax.checkpoint.safetensors import Checkpoint, CheckpointError
from prisma_jax.nn.uncertainty import fresh_table

from prisma_jax.checkpoint import orbax as L
from conversion.staging import Staging, check_destination, copy_side_files, human_bytes, progress_bar

BASE_RSS = 450 << 20   # interpreter + numpy + jax + tensorstore, measured (docs/benchmarks.md)


def _plan(ck: Checkpoint, src: str, dtype, init_uncertainty: str):
    """(cfg, names, leaf dtypes {path: dtype}, whether the table is created) — or a CheckpointError."""
    if init_uncertainty not in ("zeros", "normal"):
        raise ValueError(f"init_uncertainty must be 'zeros' or 'normal', got {init_uncertainty!r}")
    cfg, names = open_checked(ck, src)
    target = resolve_dtype(dtype)
    leaf_dt: dict[tuple, np.dtype] = {}
    for n in names:
        if n.hf not in ck.where:
            continue
        dt = target or ck.dtype(n.hf)
        if dt not in L.DTYPE_NAMES:
            raise CheckpointError(f"{src}: tensor {n.hf} has dtype {ck.dtype(n.hf)}; expected a float dtype")
        if leaf_dt.setdefault(n.path, dt) != dt:
            raise CheckpointError(f"{src}: tensors of stacked leaf {'/'.join(n.path)} have different dtypes "
                                  f"({leaf_dt[n.path]} and {dt} at {n.hf}); pass --dtype to convert them")
    created = UNCERTAINTY_KEY not in ck.where
    if created:
        leaf_dt[("uncertainty", "embedding")] = leaf_dt[("text", "embed", "embedding")]
    return cfg, names, leaf_dt, created


def _nbytes(shape, dt) -> int:
    return int(np.prod(shape, dtype=np.int64)) * np.dtype(dt).itemsize


def peak_estimate(names, leaf_dt, src_dt) -> int:
    """Expected peak RSS: the interpreter plus ~4 copies of the largest block (mapped source rows, the
    transposed block, a dtype cast, tensorstore's write buffer)."""
    big = 0
    for n in names:
        dt = leaf_dt[n.path]
        isz = max(np.dtype(dt).itemsize, np.dtype(src_dt.get(n.hf, dt)).itemsize)
        rows = L.block_rows(n, isz)
        big = max(big, rows * int(np.prod(n.hf_shape[1:], dtype=np.int64)) * isz)
    return BASE_RSS + 4 * big


def convert(src: str, dst: str, dtype="keep", init_uncertainty: str = "zeros", seed: int = 0,
            overwrite: bool = False, dry_run: bool = False, progress: bool | None = None, out=None) -> dict:
    """Convert the checkpoint directory `src` into the Orbax directory `dst`; returns the metadata written
    (for a dry run: the plan, nothing written). Bad input raises ValueError (CheckpointError/ConfigError)."""
    out = out or sys.stdout
    check_destination(dst, overwrite, src)
    with Checkpoint(src) as ck:
        cfg, names, leaf_dt, created = _plan(ck, src, dtype, init_uncertainty)
        shapes = param_shapes(cfg)
        leaves = {n.path: get_path(shapes, n.path) for n in names}
        src_dt = {n.hf: ck.dtype(n.hf) for n in names if n.hf in ck.where}
        total = sum(_nbytes(n.hf_shape, leaf_dt[n.path]) for n in names)
        peak = peak_estimate(names, leaf_dt, src_dt)
        if dry_run:
            print(f"would write {dst}: {len(leaves)} arrays from {len(names)} tensors, "
                  f"{human_bytes(total)}, n_bits={cfg.n_bits}, tied head={cfg.tie_word_embeddings}", file=out)
            for p, s in leaves.items():
                print(f"  {L.param_name(p):48s} {str(list(s)):24s} {L.DTYPE_NAMES[leaf_dt[p]]}", file=out)
            if created:
                print(f"  (uncertainty table created: {init_uncertainty})", file=out)
            print(f"expected peak memory: {human_bytes(peak)}", file=out)
            return {"dry_run": True, "peak_bytes": peak, "bytes": total}
        with Staging(dst, overwrite, src) as tmp:
            arrays, chunks = {}, {}
            for n in names:
                if n.path not in arrays:
                    dt = leaf_dt[n.path]
                    chunks[n.path] = L.chunk_shape(n, leaves[n.path], np.dtype(dt).itemsize)
                    arrays[n.path] = L.open_array(tmp, n.path, leaves[n.path], dt, chunks[n.path])
            tensors, chunk_crcs = {}, {L.param_name(p): {} for p in leaves}
            with progress_bar(total, "hf-to-orbax", progress) as bar:
                for n in names:
                    dt = leaf_dt[n.path]
                    crc = 0
                    for r0, r1 in L.row_blocks(n, np.dtype(dt).itemsize):
                        if n.hf in ck.where:
                            hf_block = ck.get(n.hf)[r0:r1].astype(dt, copy=False)
                        elif init_uncertainty == "zeros":
                            hf_block = np.zeros((r1 - r0, *n.hf_shape[1:]), dt)
                        else:   # rows r0:r1 of loading.load_hf's normal table (the same layout in HF)
                            hf_block = np.asarray(fresh_table(seed, n.hf_shape, dt, rows=(r0, r1)))
                        crc = zlib.crc32(np.ascontiguousarray(hf_block).reshape(-1).view(np.uint8), crc)
                        region, block = L.leaf_region(n, r0, r1), n.to_jax(hf_block)
                        chunk_crcs[L.param_name(n.path)][L.chunk_key(region, chunks[n.path])] = L.chunk_crc(block)
                        arrays[n.path][region].write(block).result()
                        del hf_block, block
                        if n.hf in ck.where:
                            ck.release(n.hf)
                        bar.update(_nbytes((r1 - r0, *n.hf_shape[1:]), dt))
                    tensors[n.hf] = {"shape": list(n.hf_shape), "dtype": L.DTYPE_NAMES[dt],
                                     "crc32": f"{crc:08x}", "leaf": "/".join(n.path), "index": n.index}
            L.write_tree_metadata(tmp, leaves)
            copied = copy_side_files(src, tmp, skip=L.ORBAX_FILES)
            meta = {
                "format": L.FORMAT, "format_version": L.FORMAT_VERSION, "prisma_jax_version": prisma_jax.__version__,
                "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "source": os.path.abspath(src), "source_files": sorted(ck.files),
                "source_dtypes": sorted({L.DTYPE_NAMES.get(d, str(d)) for d in src_dt.values()}),
                "dtype": "keep" if resolve_dtype(dtype) is None else L.DTYPE_NAMES[resolve_dtype(dtype)],
                "n_bits": cfg.n_bits, "tie_word_embeddings": cfg.tie_word_embeddings,
                "uncertainty": "checkpoint" if not created else init_uncertainty,
                "seed": seed if created and init_uncertainty == "normal" else None,
                "side_files": copied, "checksum": "crc32 of each tensor's bytes in Hugging Face layout",
                "leaf_dtypes": {"/".join(p): L.DTYPE_NAMES[d] for p, d in leaf_dt.items()},
                "tensors": tensors,
                "chunk_checksum": "crc32 of each zarr chunk's in-bounds data, C order, stored dtype",
                "chunk_crc32": chunk_crcs,
            }
            L.write_meta(tmp, meta)
    return meta
