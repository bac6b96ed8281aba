"""Hugging Face safetensors checkpoint → parameter pytree (host NumPy), checked against its config.

The table size decides `n_bits` (INTROSPECTION.md §1): a checkpoint with `model.uncertainty_embeddings.weight`
of 2**k rows has n_bits = k; a plain Qwen3-VL checkpoint gets a fresh table (zeros by default, so the model
reproduces Qwen3-VL exactly, or normal(0, 0.02) on request).
"""
from __future__ import annotations

import math

import ml_dtypes
import numpy as np

from .config import ModelConfig, load_hf_config
from .params import UNCERTAINTY_KEY, get_path, hf_names, param_shapes, set_path, flatten
from .safetensors_io import Checkpoint, CheckpointError

DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16),
          "float16": np.dtype(np.float16)}


def resolve_dtype(dtype) -> np.dtype | None:
    """'float32' | 'bfloat16' | 'float16' | numpy/jax dtype | None / 'keep' (the checkpoint's own)."""
    if dtype is None or dtype == "keep":
        return None
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}; expected one of {sorted(DTYPES)} or 'keep'")
        return DTYPES[dtype]
    return np.dtype(dtype)


def checkpoint_n_bits(ck: Checkpoint, hidden: int) -> int | None:
    if UNCERTAINTY_KEY not in ck.where:
        return None
    rows, *rest = ck.shape(UNCERTAINTY_KEY)
    bits = int(round(math.log2(rows))) if rows > 0 else -1
    if rows <= 1 or 2**bits != rows or bits > 16 or rest != [hidden]:
        raise CheckpointError(f"{UNCERTAINTY_KEY} has shape {ck.shape(UNCERTAINTY_KEY)}; expected "
                              f"[2**n_bits (n_bits ≤ 16), {hidden}]")
    return bits


def check_keys(cfg: ModelConfig, ck: Checkpoint, directory: str) -> list:
    """Missing / unexpected / mis-shaped tensors → one CheckpointError listing them by name."""
    names = hf_names(cfg)
    expected = {n.hf: n for n in names}
    present = set(ck.keys())
    optional = {UNCERTAINTY_KEY} | ({"lm_head.weight"} if cfg.tie_word_embeddings else set())
    missing = sorted(set(expected) - present - optional)
    unexpected = sorted(present - set(expected) - optional)
    problems = []
    if missing:
        problems.append(f"missing tensors: {', '.join(missing[:20])}" + (" ..." if len(missing) > 20 else ""))
    if unexpected:
        problems.append(f"unexpected tensors: {', '.join(unexpected[:20])}"
                        + (" ..." if len(unexpected) > 20 else ""))
    for n in names:
        if n.hf in present and tuple(ck.shape(n.hf)) != tuple(n.hf_shape):
            problems.append(f"{n.hf} has shape {list(ck.shape(n.hf))} but config.json implies {list(n.hf_shape)}")
    if problems:
        raise CheckpointError(f"{directory}: " + "; ".join(problems[:20]))
    return names


def load_hf(directory: str, dtype="float32", uncertainty_init: str = "zeros", seed: int = 0,
            progress=None) -> tuple[dict, ModelConfig]:
    """Read a checkpoint directory into (params as NumPy arrays, config).

    `progress(n)` is called after each tensor with its byte count (for progress bars).
    """
    target = resolve_dtype(dtype)
    with Checkpoint(directory) as ck:
        cfg = load_hf_config(directory)
        bits = checkpoint_n_bits(ck, cfg.text.hidden_size)
        if bits is not None:
            cfg = cfg.replace(n_bits=bits)
        names = check_keys(cfg, ck, directory)
        shapes = param_shapes(cfg)
        src_dtype = ck.dtype(names[0].hf)
        out_dtype = target or src_dtype
        params: dict = {}
        for path, shape in flatten(shapes):
            set_path(params, path, np.empty(shape, out_dtype))
        for n in names:
            if n.hf not in ck.where:
                continue
            leaf = get_path(params, n.path)
            arr = n.to_jax(ck.get(n.hf)).astype(out_dtype, copy=False)
            if n.index is None:
                leaf[...] = arr
            else:
                leaf[n.index] = arr
            if progress:
                progress(arr.nbytes)
        if UNCERTAINTY_KEY not in ck.where:
            table = get_path(params, ("uncertainty", "embedding"))
            if uncertainty_init == "zeros":
                table[...] = 0
            elif uncertainty_init == "normal":
                rng = np.random.default_rng(seed)
                table[...] = (0.02 * rng.standard_normal(table.shape, np.float32)).astype(out_dtype)
            else:
                raise ValueError(f"uncertainty_init must be 'zeros' or 'normal', got {uncertainty_init!r}")
    return params, cfg
