"""Hugging Face safetensors checkpoint → parameter pytree (host NumPy), checked against its config.

The table size decides `n_bits` (docs/introspection-contract.md §1): a checkpoint with `model.uncertainty_embeddings.weight`
of 2**k rows has n_bits = k; a plain Qwen3-VL checkpoint gets a fresh table (`uncertainty.fresh_table`: zeros by
default, so the model reproduces Qwen3-VL exactly, or normal(0, 0.02) from `seed` on request).
"""
from __future__ import annotations

import math

import ml_dtypes
import numpy as np

from prisma_jax.core.config import ModelConfig, load_hf_config
from prisma_jax.nn.params import TABLE_PATH, param_shapes
from prisma_jax.checkpoint.hf_names import UNCERTAINTY_KEY, hf_names
from prisma_jax.core.trees import get_path, set_path, flatten
from prisma_jax.checkpoint.safetensors import Checkpoint, CheckpointError, shown
from prisma_jax.nn.uncertainty import check_table_init, fresh_table

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
        problems.append(f"unexpected tensors: {', '.join(map(shown, unexpected[:20]))}"
                        + (" ..." if len(unexpected) > 20 else ""))
    for n in names:
        if n.hf in present and tuple(ck.shape(n.hf)) != tuple(n.hf_shape):
            problems.append(f"{n.hf} has shape {list(ck.shape(n.hf))} but config.json implies {list(n.hf_shape)}")
    if problems:
        raise CheckpointError(f"{directory}: " + "; ".join(problems[:20]))
    return names


def check_tied_head(cfg: ModelConfig, ck: Checkpoint, directory: str) -> None:
    """A tied checkpoint may still hold `lm_head.weight` (some exporters write it): it is only accepted when
    it equals `embed_tokens` bit for bit (compared in row blocks of the memory map), and is then redundant."""
    if not cfg.tie_word_embeddings or "lm_head.weight" not in ck.where:
        return
    embed = next(n.hf for n in hf_names(cfg) if n.path == ("text", "embed", "embedding"))
    head, emb = ck.get("lm_head.weight"), ck.get(embed)
    same = head.shape == emb.shape and head.dtype == emb.dtype
    for i in range(0, head.shape[0] if same else 0, 8192):
        if not np.array_equal(head[i:i + 8192].view(np.uint8), emb[i:i + 8192].view(np.uint8)):
            same = False
            break
    ck.release("lm_head.weight")
    ck.release(embed)
    if not same:
        raise CheckpointError(f"{directory}: config.json ties the word embeddings, but lm_head.weight differs from "
                              f"{embed}; set tie_word_embeddings to false in config.json to keep both")


def open_checked(ck: Checkpoint, directory: str) -> tuple[ModelConfig, list]:
    """The config of a checkpoint with n_bits taken from its table, and its tensor names, all validated."""
    cfg = load_hf_config(directory)
    bits = checkpoint_n_bits(ck, cfg.text.hidden_size)
    if bits is not None:
        cfg = cfg.replace(n_bits=bits)
    names = check_keys(cfg, ck, directory)
    check_tied_head(cfg, ck, directory)
    return cfg, names


def load_hf(directory: str, dtype="float32", uncertainty_init: str = "zeros", seed: int = 0,
            progress=None) -> tuple[dict, ModelConfig]:
    """Read a checkpoint directory into (params as NumPy arrays, config).

    `progress(n)` is called after each tensor with its byte count (for progress bars).
    """
    target = resolve_dtype(dtype)
    check_table_init(uncertainty_init)
    with Checkpoint(directory) as ck:
        cfg, names = open_checked(ck, directory)
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
            table = get_path(params, TABLE_PATH)
            table[...] = np.asarray(fresh_table(seed, table.shape, out_dtype, uncertainty_init))
    return params, cfg
