"""The Qwen3 text decoder with M-RoPE and DeepStack injection (QWEN3_VL.md §4), layers run by one `lax.scan`.

One function serves a full forward, a prefill that fills a KV cache, and a cached decode step: the cache is
`{"k", "v"}: [layers, B, S_max, KV, hd]`, scanned alongside the stacked layer parameters, and new keys/values
are written at slot `write_pos`. Which keys a query may see is the caller's `mask [B, S_q, S_k]`.

Unrolled layout (`unstack_layers`): the layers as a tuple of per-layer trees and the cache as tuples of per-layer
arrays, run by a Python loop. XLA:CPU copies a scanned layer's weight slice out of the stack before every
matmul, which triples the memory traffic of a decode step; the jitted decode loop therefore slices the stack
once per call, outside its `while_loop` (generate.py), and runs this layout on CPU.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from .config import TextConfig
from .layers import apply_rope, attention, dense, rms_norm
from .sharding import CACHE_AXES, constrain


class DeepStack(NamedTuple):
    """Vision features added after the first decoder layers at image-token rows (§4.5)."""
    features: jax.Array   # [n_ds, N_tok, D] (one packed list) or [n_ds, B, T, D] (each row's own features)
    index: jax.Array      # [B, S] int32 row of `features` (of the row's own, when per row) for each image token
    is_image: jax.Array   # [B, S] bool


def image_features(features: jax.Array, index: jax.Array) -> jax.Array:
    """The feature [B, S, D] of each position: `features` [N, D] is one list that `index` counts across the
    batch; [B, T, D] holds each row's own, `index` counting within the row (a gather local to the row's shard)."""
    if features.ndim == 2:
        return jnp.take(features, index, axis=0)
    return jnp.take_along_axis(features, index[..., None], axis=1)


def _layer(cfg: TextConfig, p: dict, x, cos, sin, mask, k_cache, v_cache, write_pos):
    b, s, _ = x.shape
    hd = cfg.head_dim
    h = rms_norm(p["input_norm"], x, cfg.rms_norm_eps)
    q = dense(p["attn"]["q_proj"], h).reshape(b, s, cfg.num_attention_heads, hd)
    k = dense(p["attn"]["k_proj"], h).reshape(b, s, cfg.num_key_value_heads, hd)
    v = dense(p["attn"]["v_proj"], h).reshape(b, s, cfg.num_key_value_heads, hd)
    q = apply_rope(rms_norm(p["attn"]["q_norm"], q, cfg.rms_norm_eps), cos, sin)
    k = apply_rope(rms_norm(p["attn"]["k_norm"], k, cfg.rms_norm_eps), cos, sin)
    if k_cache is not None:
        k_cache = jax.lax.dynamic_update_slice_in_dim(k_cache, k.astype(k_cache.dtype), write_pos, axis=1)
        v_cache = jax.lax.dynamic_update_slice_in_dim(v_cache, v.astype(v_cache.dtype), write_pos, axis=1)
        k, v = k_cache.astype(x.dtype), v_cache.astype(x.dtype)
    o = attention(q, k, v, mask).reshape(b, s, -1)
    x = x + dense(p["attn"]["o_proj"], o)
    h = rms_norm(p["post_attn_norm"], x, cfg.rms_norm_eps)
    mlp = p["mlp"]
    x = x + dense(mlp["down_proj"], jax.nn.silu(dense(mlp["gate_proj"], h)) * dense(mlp["up_proj"], h))
    return constrain(x, ("batch", "seq", "embed")), k_cache, v_cache


def decoder(cfg: TextConfig, p: dict, x: jax.Array, cos: jax.Array, sin: jax.Array, mask: jax.Array,
            cache: dict | None = None, write_pos: jax.Array | int = 0, deepstack: DeepStack | None = None,
            remat_policy=None):
    """x [B, S, D] → final-normed hidden [B, S, D], updated cache (or None)."""
    n_ds = 0 if deepstack is None else deepstack.features.shape[0]

    def body(x, xs):
        lp, idx, kc, vc = xs
        x, kc, vc = _layer(cfg, lp, x, cos, sin, mask, kc, vc, write_pos)
        if n_ds:
            j = jnp.minimum(idx, n_ds - 1)
            feat = image_features(jax.lax.dynamic_index_in_dim(deepstack.features, j, keepdims=False),
                                  deepstack.index)                                     # [B, S, D]
            x = jnp.where((deepstack.is_image & (idx < n_ds))[..., None], x + feat.astype(x.dtype), x)
        return x, (kc, vc)

    if isinstance(p["layers"], tuple):                                 # unrolled layout (module docstring)
        none = (None,) * len(p["layers"])
        ks, vs = (none, none) if cache is None else (cache["k"], cache["v"])
        new = []
        for i, (lp, kc, vc) in enumerate(zip(p["layers"], ks, vs)):
            x, kv = body(x, (lp, jnp.int32(i), kc, vc))
            new.append(kv)
        x = rms_norm(p["norm"], x, cfg.rms_norm_eps)
        return x, (None if cache is None else {"k": tuple(k for k, _ in new), "v": tuple(v for _, v in new)})

    if remat_policy is not None:
        body = jax.checkpoint(body, policy=remat_policy)
    layers = jnp.arange(cfg.num_hidden_layers)
    kc = None if cache is None else constrain(cache["k"], CACHE_AXES)
    vc = None if cache is None else constrain(cache["v"], CACHE_AXES)
    x, (kc, vc) = jax.lax.scan(body, x, (p["layers"], layers, kc, vc))
    x = rms_norm(p["norm"], x, cfg.rms_norm_eps)
    return x, (None if cache is None else {"k": constrain(kc, CACHE_AXES), "v": constrain(vc, CACHE_AXES)})


def unstack_layers(text_params: dict, cache: dict | None = None):
    """Stacked layout → unrolled layout: (text params with `layers` a tuple, cache {"k", "v"} of tuples)."""
    n = jax.tree.leaves(text_params["layers"])[0].shape[0]
    split = lambda tree: tuple(jax.tree.map(lambda a: a[i], tree) for i in range(n))   # noqa: E731
    p = {**text_params, "layers": split(text_params["layers"])}
    return p, (None if cache is None else {"k": split(cache["k"]), "v": split(cache["v"])})
