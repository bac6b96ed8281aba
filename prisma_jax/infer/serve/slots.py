"""The engine's device side: a fixed set of decode slots and the three programs that change them.

    init_slots(cfg, spec, n_slots, max_len, dtype)          → Slots          every slot free
    admit(cfg, spec, params, slots, i, ...)                → Slots, Emitted  prefill one request into slot i
    advance(cfg, spec, window, k, params, slots)           → Slots, Emitted  k decode steps of every slot
    release(slots, i)                                      → Slots          slot i stops (its client left)

Each slot is one row of a dense KV cache of `max_len` entries. A request is prefilled alone by core.py's
`prompt_pass` (its prompt bucket, vision included; one program per bucket, whatever max_new is) and its cache
copied into a free row without the prompt's left padding (`shift`): its n prompt tokens in entries [0, n), the
token generated at step t at entry n + t — generate.py's layout, each row's keys its first entries, which TPU's
paged decode kernel reads as they are (attention.py). From then on every slot carries a row of the decode
core's `DecodeState` — last token, the uint16 code of the distribution it was drawn from
(docs/introspection-contract.md §4), M-RoPE position, cache entry (`write`) — plus what `generate` keeps per
call and a slot must keep per row: PRNG key, done flag, count, `max_new`, sampling parameters and end ids. All
are data: requests come and go without recompiling.

`advance` runs the model once per step on all slots, each row at its own cache entry (the cached forward of
`generate.decode`'s steps), over the first `window` entries of the cache only (a static power of two
covering every live row: short requests do not pay for `max_len`). Rows that are done or free compute and
are ignored; a row's outputs stop at its end token or at `max_new`.

Not here: which request goes where, stop strings, text (engine.py).
"""
from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from prisma_jax.core.config import ModelConfig
from prisma_jax.infer import core
from prisma_jax.infer.core import DecodeState
from prisma_jax.infer.sampling import SamplingParams, UncertaintyTemperature
from prisma_jax.nn import model as M
from prisma_jax.nn.kvcache import KVCache

MAX_TOP_LOGPROBS = 20     # OpenAI's limit on top_logprobs
MAX_END_IDS = 8           # end token ids per request (the checkpoint's and the request's)


class ServeSpec(NamedTuple):
    """Static choices of the slot programs (each distinct value is one compiled program per shape)."""
    introspection: bool = True
    unroll_layers: bool = False                 # per-layer cache arrays, layers unrolled (text.py; CPU default)
    top_logprobs: int = 0                       # 0, or MAX_TOP_LOGPROBS: also report the most likely tokens
    temperature_fn: Any = UncertaintyTemperature()


class Slots(NamedTuple):
    state: DecodeState       # every slot's cache (per layer when unrolled), token, code, position, write (core.py)
    count: jax.Array         # [S] int32 tokens generated so far
    max_new: jax.Array       # [S] int32
    done: jax.Array          # [S] bool: finished, released or free
    rng: jax.Array           # [S] PRNG keys
    sp: SamplingParams       # each field [S]
    greedy: jax.Array        # [S] bool: temperature 0
    eos: jax.Array           # [S, MAX_END_IDS] int32, −1 padded
    pad: jax.Array           # [] int32 the token a done row emits (ignored)


class Emitted(NamedTuple):
    """What the steps drew, per slot: [S, k] (admit: [1, 1]); `top_*` [S, k, top_logprobs]."""
    token: jax.Array
    code: jax.Array
    entropy: jax.Array
    logprob: jax.Array       # log-probability of `token` under the model's distribution (before temperature)
    top_ids: jax.Array
    top_logprobs: jax.Array
    live: jax.Array          # bool: the slot drew this token (else it was done)


def _row_axis(spec: ServeSpec) -> int:
    return 0 if spec.unroll_layers else 1


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 4))
def init_slots(cfg: ModelConfig, spec: ServeSpec, n_slots: int, max_len: int, dtype) -> Slots:
    cache = KVCache.zeros(cfg, n_slots, max_len, dtype, per_layer=spec.unroll_layers)
    zi = jnp.zeros((n_slots,), jnp.int32)
    sp = SamplingParams(jnp.zeros((n_slots,), jnp.float32), zi, jnp.ones((n_slots,), jnp.float32),
                        jnp.zeros((n_slots,), jnp.float32))
    return Slots(DecodeState(cache, zi, zi.astype(jnp.uint16), zi, zi), zi, zi,
                 jnp.ones((n_slots,), bool), jax.random.split(jax.random.key(0), n_slots), sp,
                 jnp.ones((n_slots,), bool), jnp.full((n_slots, MAX_END_IDS), -1, jnp.int32), jnp.int32(0))


def _choose(cfg: ModelConfig, spec: ServeSpec, logits, prev_code, sp: SamplingParams, greedy_rows, keys, live):
    return core.choose_rows(cfg, logits, prev_code, sp, greedy_rows, keys, live, introspection=spec.introspection,
                            temperature_fn=spec.temperature_fn, top_logprobs=spec.top_logprobs)


def _ended(tok, count, max_new, eos):
    return (tok[:, None] == eos).any(-1) | (count >= max_new)


@functools.partial(jax.jit, static_argnums=(0, 1), donate_argnums=(3,))
def admit(cfg: ModelConfig, spec: ServeSpec, params: dict, slots: Slots, i, batch: M.Batch, next_pos,
          sp: SamplingParams, eos, max_new, rng, shift) -> tuple[Slots, Emitted]:
    """Prefill one request (batch of one row, left-padded to its bucket P), draw its first token as
    `generate.prefill` does, and put it into slot `i`: its cache entries [shift, P) at [0, P − shift).
    sp / max_new / rng: the request's (scalars); eos [MAX_END_IDS]."""
    cache, logits, prev = core.prompt_pass(cfg, params, batch, 0)
    # the request is row 0 (under a mesh `generate.plan` adds dummy rows up to the batch shards)
    cache = jax.tree.map(lambda a: a[:, :1], cache)
    logits, prev = logits[:1], prev[:1]
    p = batch.input_ids.shape[1]
    rng, key = jax.random.split(rng)
    one = lambda x: jnp.asarray(x)[None]                                                     # noqa: E731
    sp1 = jax.tree.map(one, sp)
    greedy = sp.temperature <= 0
    out = _choose(cfg, spec, logits, prev, sp1, one(greedy), key[None], jnp.ones((1,), bool))
    tok, code = out[0][0], out[1][0]

    old = slots.state.cache
    c = min(p, old.slots)

    def entries(src, axis):                        # entries [shift, shift + c) of src along `axis`
        pad = jnp.zeros(src.shape[:axis] + (c,) + src.shape[axis + 1:], src.dtype)
        return jax.lax.dynamic_slice_in_dim(jnp.concatenate([src, pad], axis), shift, c, axis)

    if old.per_layer:
        new = KVCache(*(tuple(jax.lax.dynamic_update_slice(full, entries(src[layer], 2).astype(full.dtype),
                                                           (i, 0, 0, 0))
                              for layer, full in enumerate(dst)) for src, dst in ((cache.k, old.k), (cache.v, old.v))))
    else:
        new = KVCache(*(jax.lax.dynamic_update_slice(dst, entries(src, 3).astype(dst.dtype), (0, i, 0, 0, 0))
                        for src, dst in ((cache.k, old.k), (cache.v, old.v))))
    put = lambda a, x: a.at[i].set(x)                                                         # noqa: E731
    done = _ended(tok[None], jnp.ones((1,), jnp.int32), max_new, eos[None])[0]
    d = slots.state
    slots = Slots(DecodeState(new, put(d.token, tok), put(d.code, code), put(d.position, next_pos[0]),
                              put(d.write, p - shift)), put(slots.count, 1),
                  put(slots.max_new, max_new), put(slots.done, done), put(slots.rng, rng),
                  jax.tree.map(put, slots.sp, sp), put(slots.greedy, greedy), put(slots.eos, eos), slots.pad)
    return slots, Emitted(*(x[:, None] for x in out), jnp.ones((1, 1), bool))


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3), donate_argnums=(6,))
def advance(cfg: ModelConfig, spec: ServeSpec, window: int, k: int, params: dict, layer_params, slots: Slots
            ) -> tuple[Slots, Emitted]:
    """k decode steps of every slot over cache entries [0, window); Emitted fields are [S, k].
    `layer_params`: with `spec.unroll_layers`, the decoder layers as separate arrays (text.split_layers, made
    once by the engine: slicing the stack here would copy every layer's weights each round on XLA:CPU)."""
    model = core.bind(cfg, params, unroll=spec.unroll_layers, layer_params=layer_params)
    ax = _row_axis(spec) + 2                                        # the cache's entry axis
    m = slots.state.cache.slots
    cut = (lambda a: jax.lax.slice_in_dim(a, 0, window, axis=ax)) if window < m else (lambda a: a)  # noqa: E731
    s = slots._replace(state=slots.state.replace(cache=jax.tree.map(cut, slots.state.cache)))
    n = s.state.token.shape[0]

    def step(s: Slots, _):
        live = ~s.done
        d = s.state
        code_in = d.code.astype(jnp.int32) if spec.introspection else jnp.full((n,), -1, jnp.int32)
        h, cache = core.cached_step(model, d.replace(write=jnp.minimum(d.write, window - 1)), code_in)
        logits = model.head(h)
        split = jax.vmap(jax.random.split)(s.rng)
        tok, code, ent, lp, top_ids, top_lp = _choose(cfg, spec, logits, d.code, s.sp, s.greedy, split[:, 1], live)
        tok = jnp.where(live, tok, s.pad)
        code = jnp.where(live, code, 0).astype(jnp.uint16)
        count = s.count + live
        done = s.done | (live & _ended(tok, count, s.max_new, s.eos))
        d = DecodeState(cache, jnp.where(live, tok, d.token), jnp.where(live, code, d.code), d.position + live,
                        d.write + live)
        s = s._replace(state=d, count=count, done=done, rng=split[:, 0])
        return s, Emitted(tok, code, jnp.where(live, ent, 0.0), lp, top_ids, top_lp, live)

    s, out = jax.lax.scan(step, s, None, length=k)
    if window < m:
        back = lambda full, w: jax.lax.dynamic_update_slice_in_dim(full, w, 0, axis=ax)     # noqa: E731
        s = s._replace(state=s.state.replace(cache=jax.tree.map(back, slots.state.cache, s.state.cache)))
    return s, jax.tree.map(lambda a: jnp.swapaxes(a, 0, 1), out)


@functools.partial(jax.jit, donate_argnums=(0,))
def release(slots: Slots, i) -> Slots:
    """Slot i stops at once (its request was cancelled); its row is free for the next admission."""
    return slots._replace(done=slots.done.at[i].set(True))
