"""The Qwen3 text decoder with M-RoPE and DeepStack injection (docs/design.md), as Flax NNX modules.

`TextModel` holds the token embedding, the decoder layers stacked on a leading axis (`layers.stacked`) and the
final norm. One call serves a full forward, a prefill that fills a KV cache, and a cached decode step, as its
`Mode` says (kvcache.py): the cache is a `KVCache`, scanned alongside the split layer state by one `lax.scan`
(compile time flat in depth), and new keys/values are written at slot `write_pos` (one for every row, or `[B]`
each row's own). Which keys a query may see is the caller's `mask.Mask` (or a dense `[B, S_q, S_k]` one);
`attention` names the implementation (nn/attention.py).

Unrolled layout (`unstack_layers`, applied when the model is bound: `model.bind(..., unroll=True)`): `layers` a
list of per-layer modules, the cache per layer, run by a Python loop. XLA:CPU copies a scanned layer's weight
slice out of the stack before every matmul, which triples the memory traffic of a decode step; the CPU
therefore decodes in this layout, the stack sliced once per call (infer/core.py).
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from prisma_jax.core.config import TextConfig
from prisma_jax.nn.attention import attention, cached_attention, write_cache
from prisma_jax.core.platform import platform
from prisma_jax.nn.layers import Dense, Embed, RMSNorm, apply_rope, layer_slices, stacked, unstack
from prisma_jax.nn.lora import adapter
from prisma_jax.core.partitioning import constrain
from prisma_jax.nn.kvcache import KVCache, Mode


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


class TextAttention(nnx.Module):
    def __init__(self, cfg: TextConfig, *, attention: str = "auto", lora=None, rngs: nnx.Rngs):
        d, hd, h, kv = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
        self.cfg = cfg
        self.impl = attention
        self.q_proj = Dense(d, h * hd, ("hidden", "heads"), bias=False, lora=adapter(lora, "q_proj"), rngs=rngs)
        self.k_proj = Dense(d, kv * hd, ("hidden", "kv_heads"), bias=False, lora=adapter(lora, "k_proj"), rngs=rngs)
        self.v_proj = Dense(d, kv * hd, ("hidden", "kv_heads"), bias=False, lora=adapter(lora, "v_proj"), rngs=rngs)
        self.o_proj = Dense(h * hd, d, ("heads", "hidden"), bias=False, lora=adapter(lora, "o_proj"), rngs=rngs)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps, rngs=rngs)
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps, rngs=rngs)

    def __call__(self, h, cos, sin, mask, k_cache, v_cache, write_pos, mode: Mode):
        cfg = self.cfg
        b, s, _ = h.shape
        q = self.q_proj(h).reshape(b, s, cfg.num_attention_heads, cfg.head_dim)
        k = self.k_proj(h).reshape(b, s, cfg.num_key_value_heads, cfg.head_dim)
        v = self.v_proj(h).reshape(b, s, cfg.num_key_value_heads, cfg.head_dim)
        q = apply_rope(self.q_norm(q), cos, sin)
        k = apply_rope(self.k_norm(k), cos, sin)
        if k_cache is not None:
            k_cache, v_cache = write_cache(k_cache, k, write_pos), write_cache(v_cache, v, write_pos)
        if mode is not Mode.DECODE:
            # no cache, or a prompt pass from slot 0: causal queries 0..s−1 see no slot past s−1, so their keys
            # are the new ones (no attention over the empty slots, no copy of the cache in another layout)
            kv_mask = mask if mode is Mode.FORWARD else mask._replace(kv_segment=mask.kv_segment[:, :s])
            out = attention(q, k, v, kv_mask, self.impl)
        else:
            out = cached_attention(q, k_cache.astype(h.dtype), v_cache.astype(h.dtype), mask, self.impl)
        return self.o_proj(out.reshape(b, s, -1)), k_cache, v_cache


class TextMLP(nnx.Module):
    def __init__(self, cfg: TextConfig, *, lora=None, rngs: nnx.Rngs):
        d, f = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = Dense(d, f, ("hidden", "mlp"), bias=False, lora=adapter(lora, "gate_proj"), rngs=rngs)
        self.up_proj = Dense(d, f, ("hidden", "mlp"), bias=False, lora=adapter(lora, "up_proj"), rngs=rngs)
        self.down_proj = Dense(f, d, ("mlp", "hidden"), bias=False, lora=adapter(lora, "down_proj"), rngs=rngs)

    def __call__(self, h):
        return self.down_proj(jax.nn.silu(self.gate_proj(h)) * self.up_proj(h))


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: TextConfig, *, attention: str = "auto", lora=None, rngs: nnx.Rngs):
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, rngs=rngs)
        self.attn = TextAttention(cfg, attention=attention, lora=lora, rngs=rngs)
        self.post_attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, rngs=rngs)
        self.mlp = TextMLP(cfg, lora=lora, rngs=rngs)

    def __call__(self, x, cos, sin, mask, k_cache=None, v_cache=None, write_pos=0, mode: Mode = Mode.FORWARD):
        o, k_cache, v_cache = self.attn(self.input_norm(x), cos, sin, mask, k_cache, v_cache, write_pos, mode)
        x = x + o
        x = x + self.mlp(self.post_attn_norm(x))
        return constrain(x, ("batch", "seq", "embed")), k_cache, v_cache


class TextModel(nnx.Module):
    def __init__(self, cfg: TextConfig, *, attention: str = "auto", lora=None, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed = Embed(cfg.vocab_size, cfg.hidden_size, ("vocab", "hidden"), rngs=rngs)
        self.layers = stacked(cfg.num_hidden_layers, lambda r: DecoderLayer(cfg, attention=attention, lora=lora, rngs=r), rngs)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, rngs=rngs)

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array, mask, cache: KVCache | None = None,
                 write_pos: jax.Array | int = 0, deepstack: DeepStack | None = None, remat_policy=None,
                 mode: Mode = Mode.FORWARD):
        """x [B, S, D] (embedded) → final-normed hidden [B, S, D], updated cache (or None). The cache's layout
        is the layers' (stacked, or per layer when unrolled)."""
        cfg = self.cfg
        if (cache is None) != (mode is Mode.FORWARD):
            raise ValueError(f"mode {mode} with cache {'absent' if cache is None else 'given'}")
        n_ds = 0 if deepstack is None else deepstack.features.shape[0]

        def run(layer, x, idx, kc, vc):
            x, kc, vc = layer(x, cos, sin, mask, kc, vc, write_pos, mode)
            if n_ds:
                j = jnp.minimum(idx, n_ds - 1)
                feat = image_features(jax.lax.dynamic_index_in_dim(deepstack.features, j, keepdims=False),
                                      deepstack.index)                                 # [B, S, D]
                x = jnp.where((deepstack.is_image & (idx < n_ds))[..., None], x + feat.astype(x.dtype), x)
            return x, (kc, vc)

        if is_unrolled(self):                                          # unrolled layout (module docstring)
            none = (None,) * len(self.layers)
            ks, vs = (none, none) if cache is None else (cache.k, cache.v)
            new = []
            for i, (layer, kc, vc) in enumerate(zip(self.layers, ks, vs)):
                x, kv = run(layer, x, jnp.int32(i), kc, vc)
                new.append(kv)
            x = self.norm(x)
            return x, (None if cache is None else KVCache.from_layers(new))

        graphdef, state = layer_slices(self.layers)

        def body(x, xs):
            st, idx, kc, vc = xs
            return run(nnx.merge(graphdef, st), x, idx, kc, vc)

        if remat_policy is not None:
            body = jax.checkpoint(body, policy=remat_policy)
        layers = jnp.arange(cfg.num_hidden_layers)
        cache = None if cache is None else cache.constrained()
        kc, vc = (None, None) if cache is None else (cache.k, cache.v)
        x, (kc, vc) = jax.lax.scan(body, x, (state, layers, kc, vc))
        x = self.norm(x)
        return x, (None if cache is None else KVCache(kc, vc).constrained())


def unroll_default(unroll: bool | None) -> bool:
    """`unroll_layers` with None resolved: unrolled when the traced program targets the CPU (`platform()`), where
    XLA copies every slice of the stacked weights before its matmuls (docs/benchmarks.md, decode); TPU and GPU
    keep the scan (one layer compiled)."""
    return platform() == "cpu" if unroll is None else bool(unroll)


def unstack_layers(text: TextModel, layer_params: list | None = None) -> None:
    """Stacked layout → unrolled layout, in place on `text` (a module merged inside the caller's trace): its
    `layers` become a list of per-layer modules. `layer_params`: per-layer weights held as separate arrays
    (`split_layers`), used instead of slicing the stack (on XLA:CPU, a copy of every layer's weights per call)."""
    text.layers = unstack(text.layers, layer_params)


def is_unrolled(text: TextModel) -> bool:
    return isinstance(text.layers, nnx.List)


def split_layers(params: dict) -> list[dict]:
    """The decoder layers of a param dict as one dict of separate arrays per layer (a copy), for
    `unstack_layers(..., layer_params=)`."""
    stack = params["text"]["layers"]
    n = jax.tree.leaves(stack)[0].shape[0]
    return jax.jit(lambda st: [jax.tree.map(lambda a, i=i: a[i], st) for i in range(n)])(stack)
