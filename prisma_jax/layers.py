"""Small numerical building blocks shared by both towers: norms, dense layers, rotary embedding, attention.

Numerics follow transformers' Qwen3-VL exactly (reference/QWEN3_VL.md §9): RMSNorm normalises in float32 and
casts back before the weight; LayerNorm uses the two-pass variance; softmax runs in float32.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .sharding import constrain


def dense(p: dict, x: jax.Array) -> jax.Array:
    y = jnp.einsum("...i,io->...o", x, p["kernel"].astype(x.dtype))
    if "bias" in p:
        y = y + p["bias"].astype(x.dtype)
    return y


def rms_norm(p: dict, x: jax.Array, eps: float) -> jax.Array:
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return p["scale"].astype(x.dtype) * y.astype(x.dtype)


def layer_norm(p: dict, x: jax.Array, eps: float) -> jax.Array:
    xf = x.astype(jnp.float32)
    mu = jnp.mean(xf, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(xf - mu), axis=-1, keepdims=True)
    y = (xf - mu) * jax.lax.rsqrt(var + eps)
    return (y * p["scale"].astype(jnp.float32) + p["bias"].astype(jnp.float32)).astype(x.dtype)


def rotate_half(x: jax.Array) -> jax.Array:
    h = x.shape[-1] // 2
    return jnp.concatenate([-x[..., h:], x[..., :h]], axis=-1)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Split-half (NeoX) rotary embedding; `cos`/`sin` broadcast over the heads axis."""
    return x * cos + rotate_half(x) * sin


def attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """Grouped-query attention.

    q [B, Sq, H, hd], k/v [B, Sk, KV, hd], mask [B, Sq, Sk] bool (True = may attend) → [B, Sq, H, hd].
    Scores and softmax in float32; the weights are cast back to v's dtype before the value product.
    """
    b, sq, h, hd = q.shape
    kv = k.shape[2]
    q = q.reshape(b, sq, kv, h // kv, hd)
    scores = jnp.einsum("bqkgd,bskd->bkgqs", q, k, preferred_element_type=jnp.float32) * (hd ** -0.5)
    scores = jnp.where(mask[:, None, None], scores, jnp.finfo(jnp.float32).min)
    w = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgqs,bskd->bqkgd", w, v)
    return constrain(out.reshape(b, sq, h, hd), ("batch", "seq", "heads", None))


def torch_inv_freq(dim: int, theta: float) -> jax.Array:
    """`1 / theta ** (arange(0, dim, 2) / dim)` as transformers computes it in float32.

    Exponents in float32, the power correctly rounded to float32, the reciprocal in float32: this equals
    torch's values in all but at most one slot (1 ulp), where numpy's or XLA's float32 pow differ in many.
    """
    exps = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    powers = np.power(np.float64(theta), exps.astype(np.float64)).astype(np.float32)
    return jnp.asarray(np.float32(1.0) / powers)
