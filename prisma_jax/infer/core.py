"""The decode core: one state, one prefill, one step and one token choice, for every decoding caller.

    bind(cfg, params, unroll)            → the bound model (float or int8 params; the layer layout chosen here)
    prompt_pass(cfg, params, batch, t)   → DecodeState of a prompt, its last logits      (Mode.PREFILL)
    cached_step(model, state, codes_in)  → final hidden [B, D], the new cache              (Mode.DECODE)
    choose(...) / choose_rows(...)       → token, its distribution's code and entropy    (one row's rules)

`generate`'s `while_loop` (generate.py), the serve engine's K-step rounds (serve/slots.py), the Tunix adapter
(integrations/tunix.py, through `nn` directly: its model is a module, not params) and `prisma plan`'s decode
program (through generate) are built on these.

`DecodeState` is what every decoding row carries from one step to the next: its KV cache (a `KVCache`), last
token, the uint16 code of the distribution that token was drawn from (docs/introspection-contract.md §2, §4's
decode rule), M-RoPE position and the cache slot the token goes to. A row's real tokens are slots
[0, write): each row's keys from slot 0, the ragged form of attention.py's paged decode kernel. Callers add
what they keep per call (generate: output buffers, one PRNG key) or per request (serve: sampling parameters,
end ids, per-row keys) around it.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from prisma_jax.core.config import ModelConfig
from prisma_jax.infer.sampling import SamplingParams, greedy, sample
from prisma_jax.nn import model as M
from prisma_jax.nn.kvcache import KVCache, Mode
from prisma_jax.nn.mask import Mask
from prisma_jax.nn.text import is_unrolled
from prisma_jax.nn.uncertainty import codes_from_entropy, entropy
from prisma_jax.quant import int8


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeState:
    cache: KVCache           # [layers, B, KV, slots, hd] (or per layer); a row's real tokens in slots [0, write)
    token: jax.Array         # [B] int32: last token, the next step's input
    code: jax.Array          # [B] uint16: code of the distribution `token` was drawn from = its incoming code
    position: jax.Array      # [B] int32: M-RoPE position of `token` (text position + rope delta, all 3 axes)
    write: jax.Array         # [B] int32: the cache slot `token` goes to

    def replace(self, **kw) -> "DecodeState":
        return dataclasses.replace(self, **kw)

    @staticmethod
    def abstract(cfg: ModelConfig, batch: int, slots: int, dtype, mesh=None) -> "DecodeState":
        """ShapeDtypeStructs of a state (with `mesh`, the cache's carrying their shardings)."""
        row = lambda dt: jax.ShapeDtypeStruct((batch,), jnp.dtype(dt))             # noqa: E731
        return DecodeState(KVCache.abstract(cfg, batch, slots, dtype, mesh), row(jnp.int32), row(jnp.uint16),
                           row(jnp.int32), row(jnp.int32))


def bind(cfg: ModelConfig, params: dict, unroll: bool = False, layer_params=None) -> M.PrismaVLModule:
    """The model on `params` (float, or int8 from quant/int8.py), with its decoder layers unrolled when `unroll`
    (the CPU's decode layout, text.py; from `layer_params` when held split)."""
    abstract = int8.abstract_model(cfg) if int8.is_quantized(params) else None
    return M.bind(cfg, params, unroll=unroll, layer_params=layer_params, abstract=abstract)


def forward(cfg: ModelConfig, params: dict, batch: M.Batch) -> jax.Array:
    """Logits [B, S, V] for a whole sequence (no cache)."""
    model = bind(cfg, params)
    h, _ = model.hidden(batch)
    return model.head(h)


def in_layout(model: M.PrismaVLModule, cache: KVCache) -> KVCache:
    """`cache` in the bound model's layer layout (per layer when its layers are unrolled)."""
    return cache.unstacked() if is_unrolled(model.text) else cache


# ---------------------------------------------------------------------------------------------- prefill

def prompt_pass(cfg: ModelConfig, params: dict, batch: M.Batch, t: int):
    """The prompt [B, P] (vision included) through the model into a fresh cache of P + t slots (traced inside
    a caller's jit), left-padded as the batch is (Mode.PREFILL). Returns (cache, the last position's logits
    [B, V], and the code the first generated token is drawn under: the last prompt token's incoming code, or
    N, as uint16 [B])."""
    b, p = batch.input_ids.shape
    dtype = params["text"]["embed"]["embedding"].dtype
    cache = KVCache.zeros(cfg, b, p + t, dtype)
    key_valid = jnp.concatenate([batch.attention_mask, jnp.zeros((b, t), bool)], axis=1)
    model = bind(cfg, params)
    h, cache = model.hidden(batch, cache, 0, key_valid, mode=Mode.PREFILL)
    logits = model.head(h[:, -1])                                                 # [B, V]
    last_in = batch.codes[:, -1]                                  # incoming code of the last prompt token
    prev = jnp.where(last_in >= 0, last_in, cfg.neutral_code).astype(jnp.uint16)
    return cache, logits, prev


# ---------------------------------------------------------------------------------------------- decode step

def cached_step(model: M.PrismaVLModule, state: DecodeState, codes_in) -> tuple[jax.Array, KVCache]:
    """One cached step of every row (Mode.DECODE): `state.token [B]` (incoming codes `codes_in`, M-RoPE
    `state.position`) into cache slot `state.write [B]`, attending over slots `[0, write]`. Returns the final
    hidden [B, D] and the cache."""
    token, write = state.token, state.write
    b = token.shape[0]
    batch = M.Batch(token[:, None], jnp.ones((b, 1), bool), codes_in[:, None],
                    jnp.broadcast_to(state.position[None, :, None], (3, b, 1)))
    key_valid = (jnp.arange(state.cache.slots) <= write[:, None]).astype(jnp.int32)
    mask = Mask(jnp.ones((b, 1), jnp.int32), key_valid, write, write + 1)
    h, cache = model.hidden(batch, state.cache, write, mask=mask, mode=Mode.DECODE)
    return h[:, 0], cache


# ---------------------------------------------------------------------------------------------- token choice

def choose(cfg: ModelConfig, logits, prev_code, sp: SamplingParams | None, key, *, greedy_: bool,
           introspection: bool = True, temperature_fn=None):
    """logits [B, V] → token [B] int32, its distribution's code [B] uint16 and entropy [B] float32, every row
    under the same sampling parameters (greedy: the argmax)."""
    z = logits.astype(jnp.float32)
    if introspection:
        h = entropy(z)
        code = codes_from_entropy(h, cfg.text.vocab_size, cfg.n_bits)
    else:
        h = jnp.zeros(z.shape[:1], jnp.float32)
        code = jnp.zeros(z.shape[:1], jnp.uint16)
    if greedy_:
        tok = greedy(z)
    else:
        tok = sample(z, sp, key, prev_code, cfg.n_levels, temperature_fn)
    return tok, code, h


def choose_rows(cfg: ModelConfig, logits, prev_code, sp: SamplingParams, greedy_rows, keys, live, *,
                introspection: bool, temperature_fn, top_logprobs: int = 0):
    """`choose` with each row's own sampling parameters `sp` (fields [B]) and key: greedy rows take the argmax,
    the others `sampling.sample` with their values (the sort is skipped while every live row is greedy).
    Returns (token, code, entropy, logprob of the token, top ids, top logprobs [B, top_logprobs])."""
    tok, code, ent = choose(cfg, logits, prev_code, None, None, greedy_=True, introspection=introspection)
    z = logits.astype(jnp.float32)

    def sampled():
        one = lambda zr, p, k, c: sample(zr[None], p, k, c[None], cfg.n_levels, temperature_fn)[0]  # noqa: E731
        return jnp.where(greedy_rows, tok, jax.vmap(one)(z, sp, keys, prev_code))

    tok = jax.lax.cond(jnp.any(live & ~greedy_rows), sampled, lambda: tok)
    lse = jax.nn.logsumexp(z, axis=-1)
    logprob = jnp.take_along_axis(z, tok[:, None], axis=-1)[:, 0] - lse
    if top_logprobs:
        top_lp, top_ids = jax.lax.top_k(z, top_logprobs)
        top_lp = top_lp - lse[:, None]
    else:
        top_lp, top_ids = jnp.zeros((z.shape[0], 0), jnp.float32), jnp.zeros((z.shape[0], 0), jnp.int32)
    return tok, code, ent, logprob, top_ids.astype(jnp.int32), top_lp
