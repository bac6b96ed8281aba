"""The introspective mechanism, all of it (docs/introspection-contract.md, section by section).

§1  `Uncertainty`: the module holding the table `U [L, hidden]`, L = 2**n_bits (`params["uncertainty"]
    ["embedding"]`). Neutral code N = L/2. `fresh_table` / `table_rows`: the one initialisation of a new table
    (zeros, or normal(0, 0.02) from a seed), used by every path that creates one — the module, both Hugging
    Face loaders, hf-to-orbax conversion.
§2  `codes_from_logits`: the float32 natural-log entropy of each next-token distribution, normalised by ln V,
    clipped to [0, 1] and floored onto L levels, as uint16. Written as reductions over the vocabulary axis
    (max, Σexp, Σexp·z), so with vocab-sharded logits XLA combines per-shard partial sums and never gathers
    `[B, V]`.
§3  `Uncertainty.__call__`: e_i = E[x_i] + U[c_i] where c_i is a code (≥ 0) and x_i is not an image/video
    placeholder; otherwise e_i = E[x_i]. Applied right after the token lookup, before vision features are scattered in.
§4  `prompt_codes`: first real token of each row — of each segment, in packed training rows — none (−1), every
    other real token N, padding none.
    `shift_codes`: the teacher-forced rule of training pass k ≥ 2 (codes of pass k−1 move one position right
    wherever the previous position is supervised). Generation carries the code as uint16 loop state.

Codes travel as int32 with −1 for "none" wherever "none" is possible, and as uint16 where it is not.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from prisma_jax.core.partitioning import take_rows

NONE = -1  # "no injection"
TABLE_STD = 0.02
TABLE_INITS = ("zeros", "normal")
_TABLE_STREAM = 0x7AB1E5   # fold_in tag of the table's stream: far above the leaf count init_params splits into


# ---------------------------------------------------------------------------------------------- §1 a fresh table

def check_table_init(init: str) -> str:
    if init not in TABLE_INITS:
        raise ValueError(f"uncertainty_init must be 'zeros' or 'normal', got {init!r}")
    return init


def table_rows(key: jax.Array, start, n_rows: int, hidden: int, dtype=jnp.float32) -> jax.Array:
    """Rows [start, start + n_rows) of the normal table drawn from `key` (traceable). Row r is
    TABLE_STD·normal(fold_in(k, r)) with k = fold_in(key, tag): each row is its own stream, so a block of rows
    (conversion), a sharded program (each device draws its own rows) and the whole table give the same numbers."""
    k = jax.random.fold_in(key, _TABLE_STREAM)
    rows = jnp.asarray(start, jnp.uint32) + jnp.arange(n_rows, dtype=jnp.uint32)
    draw = lambda r: jax.random.normal(jax.random.fold_in(k, r), (hidden,), jnp.float32)   # noqa: E731
    return (jnp.float32(TABLE_STD) * jax.vmap(draw)(rows)).astype(dtype)


@functools.lru_cache(maxsize=16)
def _table_program(n_rows: int, hidden: int, dtype, init: str, sharding):
    if init == "zeros":
        fn = lambda key, start: jnp.zeros((n_rows, hidden), dtype)   # noqa: E731
    else:
        fn = lambda key, start: table_rows(key, start, n_rows, hidden, dtype)   # noqa: E731
    return jax.jit(fn) if sharding is None else jax.jit(fn, out_shardings=sharding)


def fresh_table(seed: int, shape: tuple[int, int], dtype=jnp.float32, init: str = "normal", sharding=None,
                rows: tuple[int, int] | None = None) -> jax.Array:
    """The table of a model that has none: zeros (the model then reproduces Qwen3-VL) or `table_rows` from
    `jax.random.key(seed)` — the same values as `params.init_params(cfg, jax.random.key(seed))`'s table.
    `sharding`: created directly in it (no device or host holds the whole table); `rows=(r0, r1)`: only that
    block (a streaming writer). One compiled program per shape, dtype and sharding."""
    check_table_init(init)
    r0, r1 = (0, shape[0]) if rows is None else rows
    if not 0 <= r0 < r1 <= shape[0]:
        raise ValueError(f"rows {rows} outside the table's {shape[0]} rows")
    fn = _table_program(r1 - r0, int(shape[1]), jnp.dtype(dtype), init, sharding)
    return fn(jax.random.key(int(seed)), np.uint32(r0))


def entropy(logits: jax.Array) -> jax.Array:
    """H(z) = logsumexp(z) − Σ softmax(z)·z in float32 nats; −inf logits contribute nothing. [..., V] → [...]."""
    return entropy_parts(logits)[0]


def entropy_parts(logits: jax.Array):
    """`entropy` and the pieces it is made of, for callers that need the softmax too (the training loss):
    (H [...], m [...] the finite max, e = exp(z − m) [..., V], s = Σ e [...]); logsumexp(z) = m + log s."""
    z = logits.astype(jnp.float32)
    m = jnp.max(z, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    zc = z - m
    e = jnp.exp(zc)                                             # 0 where z = −inf
    s = jnp.maximum(jnp.sum(e, axis=-1), jnp.finfo(jnp.float32).tiny)  # all −inf → H clips to 0
    ez = jnp.sum(jnp.where(e > 0, e * zc, 0.0), axis=-1)        # no 0·(−inf)
    return jnp.log(s) - ez / s, m[..., 0], e, s


def codes_from_entropy(h: jax.Array, vocab_size: int, n_bits: int) -> jax.Array:
    levels = 2**n_bits
    x = jnp.clip(h.astype(jnp.float32) / jnp.float32(math.log(vocab_size)), 0.0, 1.0)
    return jnp.floor(x * jnp.float32(levels - 1)).astype(jnp.uint16)


def codes_from_logits(logits: jax.Array, n_bits: int) -> jax.Array:
    """docs/introspection-contract.md §2: [..., V] logits → [...] uint16 codes (V is the logits' last axis)."""
    return codes_from_entropy(entropy(logits), logits.shape[-1], n_bits)


class Uncertainty(nnx.Module):
    """§1 and §3: the table, and its injection into the token embeddings.

    The table is drawn from the `table` stream's key of `rngs` when it has one (`nnx.Rngs(table=seed)` gives
    `fresh_table(seed)`), else from `rngs.params()`; `init="zeros"` reproduces Qwen3-VL."""

    def __init__(self, levels: int, hidden: int, placeholder_ids: tuple[int, ...], init: str = "normal", *,
                 rngs: nnx.Rngs):
        check_table_init(init)
        key = rngs["table"].key[...] if "table" in rngs else rngs.params()
        table = _table_program(levels, hidden, jnp.dtype(jnp.float32), init, None)(key, np.uint32(0))
        self.placeholder_ids = tuple(placeholder_ids)
        self.embedding = nnx.Param(table, out_sharding=("levels", "hidden"), eager_sharding=False)

    def __call__(self, embeds: jax.Array, input_ids: jax.Array, codes: jax.Array) -> jax.Array:
        """§3: embeds [B, S, D] + U[codes] where codes ≥ 0 and the token is not a vision placeholder."""
        on = codes >= 0
        for tok in self.placeholder_ids:
            on &= input_ids != tok
        u = take_rows(self.embedding[...], jnp.maximum(codes, 0).astype(jnp.int32), ("levels", "hidden"))
        return jnp.where(on[..., None], embeds + u.astype(embeds.dtype), embeds)


def segment_starts(attention_mask: np.ndarray) -> np.ndarray:
    """[B, S] bool: the first real token of each segment — the first occurrence of each nonzero segment id in
    its row. A bool (or 0/1) mask is one segment: its start is the row's first real token, whatever the padding."""
    seg = np.asarray(attention_mask).astype(np.int64)
    starts = np.zeros(seg.shape, bool)
    for r in range(seg.shape[0]):
        ids, first = np.unique(seg[r], return_index=True)
        starts[r, first[ids > 0]] = True
    return starts


def prompt_codes(attention_mask: np.ndarray, n_bits: int) -> np.ndarray:
    """§4 prompt rule on the host: [B, S] int32, −1 at padding and at the first real token of each segment (of
    each row when the mask is bool; of each packed conversation when it holds segment ids), N elsewhere."""
    mask = np.asarray(attention_mask)
    codes = np.where(mask.astype(bool), 2 ** (n_bits - 1), NONE).astype(np.int32)
    codes[segment_starts(mask)] = NONE
    return codes


def shift_codes(base_codes: jax.Array, prev_codes: jax.Array, supervised: jax.Array,
                segments: jax.Array | None = None) -> jax.Array:
    """§4 training pass k ≥ 2: position i takes code(logits[i−1]) from the previous pass wherever position i−1
    is supervised (its label is a real target) and, given `segments`, belongs to the same segment as i (no code
    crosses from one packed conversation into the next); elsewhere the prompt rule (`base_codes`) stays.

    base_codes [B, S] int32 (−1 = none), prev_codes [B, S] uint16 (code of logits at each position),
    supervised [B, S] bool (position's label is a target), segments [B, S] segment ids or bool mask. Returns
    [B, S] int32.
    """
    shifted = jnp.pad(prev_codes.astype(jnp.int32)[:, :-1], ((0, 0), (1, 0)))
    prev_sup = jnp.pad(supervised[:, :-1], ((0, 0), (1, 0)))
    if segments is not None:
        seg = segments.astype(jnp.int32)
        prev_sup &= (seg > 0) & (seg == jnp.pad(seg[:, :-1], ((0, 0), (1, 0))))
    return jnp.where(prev_sup, shifted, base_codes)
