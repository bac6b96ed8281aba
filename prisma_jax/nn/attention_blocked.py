"""Blocked (flash-style) grouped-query attention for XLA:CPU training: no `S × S` tensor is kept.

`blocked_attention(q, k, v, mask)` computes the same function as `layers.attention` (float32 scores and
softmax, `finfo.min` at masked slots) block by block: the queries in blocks of `block_q` rows, each query block
over its key range in chunks of `block_k` keys with an online softmax (running max, running sum). The mask is
an `attention.Mask` or a dense `[B, Sq, Sk]` bool. A query block's key range stops at its last query's last
visible key when the mask says so: a `Mask` with a static `causal_start` c (keys j ≤ i + c), or a dense mask
with `causal=True` (keys j ≤ i: the caller's promise). Key blocks beyond are never computed. The blocks are
unrolled at trace time: all shapes are static.

A `jax.custom_vjp` keeps only q, k, v, the mask, the output and each row's log-sum-exp; the backward pass
recomputes each block's probabilities from them (the FlashAttention-2 backward: dS = P·(dP − rowsum(dO·O))).
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from prisma_jax.nn.mask import Mask

NEG = float(jnp.finfo(jnp.float32).min)


def _layout(q, k, v):
    """q [B, Sq, H, hd] → [B, KV, Sq·G, hd] (rows ordered (query, group)); k, v [B, Sk, KV, hd] → [B, KV, Sk, hd]."""
    b, sq, h, hd = q.shape
    kv = k.shape[2]
    qt = q.reshape(b, sq, kv, h // kv, hd).transpose(0, 2, 1, 3, 4).reshape(b, kv, sq * (h // kv), hd)
    return qt, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)


def _ranges(sq, sk, block_q, block_k, offset):
    """[(q0, q1, [(k0, k1), ...]), ...]: each query block with its key chunks; query i sees no key after
    i + offset (None: all keys)."""
    out = []
    for q0 in range(0, sq, block_q):
        q1 = min(q0 + block_q, sq)
        end = sk if offset is None else max(0, min(q1 + offset, sk))
        out.append((q0, q1, [(k0, min(k0 + block_k, end)) for k0 in range(0, end, block_k)]))
    return out


def _scores(qb, kb, mask_blk, g, scale):
    """Masked float32 scores [B, KV, bq·G, bk] of a query block and a key chunk; mask_blk [B, bq, bk]."""
    s = jnp.einsum("bkmd,bknd->bkmn", qb, kb, preferred_element_type=jnp.float32) * scale
    b, kv, m, n = s.shape
    s = s.reshape(b, kv, m // g, g, n)
    s = jnp.where(mask_blk[:, None, :, None, :], s, NEG)
    return s.reshape(b, kv, m, n)


def _forward(q, k, v, mask, block_q, block_k, offset):
    b, sq, h, hd = q.shape
    sk, kv = k.shape[1], k.shape[2]
    g, scale = h // kv, hd ** -0.5
    qt, kt, vt = _layout(q, k, v)
    outs, lses = [], []
    for q0, q1, chunks in _ranges(sq, sk, block_q, block_k, offset):
        qb = qt[:, :, q0 * g:q1 * g]
        m = l = acc = None
        for k0, k1 in chunks:
            s = _scores(qb, kt[:, :, k0:k1], mask[:, q0:q1, k0:k1], g, scale)
            m_new = s.max(-1) if m is None else jnp.maximum(m, s.max(-1))
            p = jnp.exp(s - m_new[..., None])
            pv = jnp.einsum("bkmn,bknd->bkmd", p.astype(v.dtype), vt[:, :, k0:k1],
                            preferred_element_type=jnp.float32)
            if m is None:
                l, acc = p.sum(-1), pv
            else:
                alpha = jnp.exp(m - m_new)
                l, acc = alpha * l + p.sum(-1), alpha[..., None] * acc + pv
            m = m_new
        outs.append(acc / l[..., None])
        lses.append(m + jnp.log(l))
    out_t = jnp.concatenate(outs, axis=2)                      # [B, KV, Sq·G, hd] float32
    out = out_t.reshape(b, kv, sq, g, hd).transpose(0, 2, 1, 3, 4).reshape(b, sq, h, hd).astype(q.dtype)
    return out, jnp.concatenate(lses, axis=2)


@partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _blocked(q, k, v, mask, block_q, block_k, offset):
    return _forward(q, k, v, mask, block_q, block_k, offset)[0]


def _blocked_fwd(q, k, v, mask, block_q, block_k, offset):
    out, lse = _forward(q, k, v, mask, block_q, block_k, offset)
    return out, (q, k, v, mask, out, lse)


def _blocked_bwd(block_q, block_k, offset, res, d_out):
    q, k, v, mask, out, lse = res
    b, sq, h, hd = q.shape
    sk, kv = k.shape[1], k.shape[2]
    g, scale = h // kv, hd ** -0.5
    qt, kt, vt = _layout(q, k, v)
    dot, _, _ = _layout(d_out.astype(jnp.float32), k, v)
    ot, _, _ = _layout(out.astype(jnp.float32), k, v)
    delta = (dot * ot).sum(-1)                                 # rowsum(dO·O) [B, KV, Sq·G]
    dk = jnp.zeros(kt.shape, jnp.float32)
    dv = jnp.zeros(vt.shape, jnp.float32)
    dqs = []
    for q0, q1, chunks in _ranges(sq, sk, block_q, block_k, offset):
        rows = slice(q0 * g, q1 * g)
        qb, dob = qt[:, :, rows], dot[:, :, rows]
        dq = jnp.zeros(qb.shape, jnp.float32)
        for k0, k1 in chunks:
            kb, vb = kt[:, :, k0:k1], vt[:, :, k0:k1]
            p = jnp.exp(_scores(qb, kb, mask[:, q0:q1, k0:k1], g, scale) - lse[:, :, rows, None])
            dv = dv.at[:, :, k0:k1].add(jnp.einsum("bkmn,bkmd->bknd", p, dob))
            dp = jnp.einsum("bkmd,bknd->bkmn", dob, vb.astype(jnp.float32))
            ds = p * (dp - delta[:, :, rows, None]) * scale
            dq = dq + jnp.einsum("bkmn,bknd->bkmd", ds, kb.astype(jnp.float32))
            dk = dk.at[:, :, k0:k1].add(jnp.einsum("bkmn,bkmd->bknd", ds, qb.astype(jnp.float32)))
        dqs.append(dq)
    dq = jnp.concatenate(dqs, axis=2).reshape(b, kv, sq, g, hd).transpose(0, 2, 1, 3, 4).reshape(b, sq, h, hd)
    return (dq.astype(q.dtype), dk.transpose(0, 2, 1, 3).astype(k.dtype), dv.transpose(0, 2, 1, 3).astype(v.dtype),
            None)


_blocked.defvjp(_blocked_fwd, _blocked_bwd)


SHORT_KEYS = 512     # up to this many keys, query blocks of 64; beyond, of 128 (docs/attention-cpu.md)


def default_blocks(n_keys: int) -> tuple[int, int]:
    """(block_q, block_k) for `n_keys` keys: key chunks of 512; query blocks of 64 for short sequences (less of the
    causal triangle's diagonal computed: forward + backward 14–21 % faster at 256 keys, the same at 512) and of 128
    beyond, which compile to fewer unrolled blocks (64 × 64 blocks were slower from 512 keys on)."""
    return (64 if n_keys <= SHORT_KEYS else 128), 512


def blocked_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask, block_q: int | None = None,
                      block_k: int | None = None, causal: bool = False) -> jax.Array:
    """Grouped-query attention in blocks: q [B, Sq, H, hd], k/v [B, Sk, KV, hd], `mask` an `attention.Mask` or a
    dense [B, Sq, Sk] bool (True = may attend) → [B, Sq, H, hd], equal to `attention.attention(q, k, v, mask,
    "xla")` up to float32 rounding. Block sizes left None take `default_blocks(Sk)`.

    A `Mask` with a static `causal_start` skips the keys no query of a block may see. For a dense mask
    `causal=True` skips the keys after each query block's last query: the mask must allow none of them."""
    offset = 0 if causal else None
    if isinstance(mask, Mask):
        start = mask.causal_start
        offset = start if isinstance(start, int) and start >= 0 else None   # else: every key block is computed
        mask = mask.dense()
    if q.ndim != 4 or k.shape != v.shape or k.shape[0] != q.shape[0] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"blocked_attention: q {q.shape}, k {k.shape}, v {v.shape} are not [B, S, H, hd] / "
                         "[B, S, KV, hd] of one batch and head size")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"blocked_attention: {q.shape[2]} query heads are not a multiple of {k.shape[2]} kv heads")
    if mask.shape != (q.shape[0], q.shape[1], k.shape[1]):
        raise ValueError(f"blocked_attention: mask {mask.shape} is not [B, Sq, Sk] = "
                         f"{(q.shape[0], q.shape[1], k.shape[1])}")
    dq, dk = default_blocks(k.shape[1])
    block_q, block_k = dq if block_q is None else block_q, dk if block_k is None else block_k
    if block_q < 1 or block_k < 1:
        raise ValueError(f"blocked_attention: block sizes must be positive, got {block_q}, {block_k}")
    return _blocked(q, k, v, mask.astype(bool), block_q, block_k, offset)
