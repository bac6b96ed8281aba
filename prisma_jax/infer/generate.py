"""Batch generation: a jitted prefill, then one jitted `lax.while_loop` decode that carries the uncertainty code.

    request(cfg, Inputs(...), SamplingParams(...), Options(...)) → Request    (host: validated, padded, indexed)
    prefill(params, batch)  → GenerateState        (vision tower, whole prompt, first token: core.prompt_pass)
    decode(params, state)   → GenerateState        (core.cached_step in a while_loop; the cache is donated)

`GenerateState` is every row's `core.DecodeState` plus the call's output buffers. The mechanism rides in the
decode state: the previous code is a uint16 per row, computed from the very logits the row's last token was drawn from (docs/introspection-contract.md §2) and
injected with that token at the next position (§3, §4's decode rule). The prompt gets §4's prompt rule.

Shapes are bucketed so that few programs serve many requests: prompts are left-padded to a power of two
(≥ `prompt_floor`) and the output buffers to a power of two ≥ max_new_tokens (≥ `new_floor`); max_new_tokens
itself is data. The cache has prompt_bucket + new_bucket slots. The prompt pass writes the left-padded prompt to
slots [0, P); `prefill` then shifts each row left over its padding, so that a row with n prompt tokens holds
them in slots [0, n) and the token generated at step t (0-based) enters at slot n + t: every row's keys are
slots [0, kv_len), the ragged form of attention.py's paged decode kernel.

Abstention (`abstain_above=τ`, docs/generation.md#abstention): a row whose emitted token was drawn from a
distribution with code > τ — `codes[t]`, the code that token carries into the next step (§4, §5) — is done at
that step, as if the token were an end token: the token and its code are kept as the row's last, `abstain_step`
records t. τ is data (a traced int32 scalar: no recompile per τ); `Spec.abstain` is static, so the program
without abstention is the one it always was.

Host side (`generate`): validate everything (ValueError) before any compile, pad (under a mesh, the rows too:
to a multiple of its batch shards, with dummy rows whose outputs are dropped; they may keep the loop running
to max_new_tokens), index the rope positions, run the two programs, fetch the buffers once. Not here: the
model's step and token choice (core.py), sampling math (sampling.py), tokenization (host/processing.py).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from prisma_jax.nn import model as M
from prisma_jax.core.config import ModelConfig
from prisma_jax.host.inputs import pad_rows, prepare
from prisma_jax.infer import core
from prisma_jax.infer.core import DecodeState
from prisma_jax.infer.sampling import SamplingParams, UncertaintyTemperature, check_sampling
from prisma_jax.core.partitioning import batch_shards
from prisma_jax.nn.text import unroll_default
from prisma_jax.nn.uncertainty import NONE


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GenerateState:
    """The decode loop's carry: every row's `core.DecodeState` plus what one `generate` call keeps."""
    state: DecodeState       # cache, token, code, position, write (infer/core.py)
    step: jax.Array          # [] int32: tokens generated so far
    rng: jax.Array           # PRNG key
    done: jax.Array          # [B] bool: row has emitted an end token (or abstained)
    lengths: jax.Array       # [B] int32: tokens generated per row (its end token included)
    tokens: jax.Array        # [B, T] int32 output buffer, pad after a row's end
    codes: jax.Array         # [B, T] uint16 codes of the distributions the tokens were drawn from
    entropies: jax.Array     # [B, T] float32 their entropies in nats
    logits: jax.Array | None = None   # [B, T, V] float32 the distributions themselves (debugging; Spec.keep_logits)
    abstain_step: jax.Array | None = None   # [B] int32: step whose code exceeded τ, −1 if none (Spec.abstain)
    logprobs: jax.Array | None = None       # [B, T] float32 log p(token) under its logits (Spec.keep_logprobs)

    def replace(self, **kw) -> "GenerateState":
        return dataclasses.replace(self, **kw)


class Spec(NamedTuple):
    """Static choices: each distinct Spec (with the shapes) is one compiled program."""
    greedy: bool = True
    introspection: bool = True       # False: no injection and no code (the benchmark's "mechanism off")
    new_bucket: int = 16             # output buffer length T
    keep_logits: bool = False        # also record every step's logits [B, T, V] (tests, debugging)
    unroll_layers: bool = False      # decode with the unrolled layer layout (text.py; the default on CPU)
    temperature_fn: Any = UncertaintyTemperature()
    abstain: bool = False            # stop a row at a token whose code exceeds τ (the `abstain_above` argument)
    keep_logprobs: bool = False      # also record each chosen token's log-probability [B, T]


ABSTAIN_TEXT = "I don't know"


@dataclasses.dataclass
class GenerateResult:
    tokens: np.ndarray               # [B, T] int32, pad after each row's end (T = longest row)
    codes: np.ndarray                # [B, T] uint16, 0 after each row's end
    lengths: np.ndarray              # [B] int32
    entropies: np.ndarray | None = None   # [B, T] float32 nats, on request
    logits: np.ndarray | None = None      # [B, T, V] float32, on request (return_logits=True)
    abstained: np.ndarray | None = None   # [B] bool: the row stopped at a code above `abstain_above`
    abstain_step: np.ndarray | None = None   # [B] int32: that step (its token is the row's last), −1 if none
    abstain_text: str = ABSTAIN_TEXT
    logprobs: np.ndarray | None = None    # [B, T] float32 log-probability of each token, on request

    def texts(self, processor, skip_special_tokens: bool = True) -> list[str]:
        """Each row's decoded answer (`processor.decode` of its `lengths[i]` tokens); an abstained row's is
        `abstain_text` instead."""
        return [self.abstain_text if self.abstained is not None and self.abstained[i] else
                processor.decode(self.tokens[i, :n], skip_special_tokens) for i, n in enumerate(self.lengths)]


def bucket(n: int, floor: int) -> int:
    """Smallest power of two ≥ max(n, floor)."""
    return 1 << (max(int(n), int(floor)) - 1).bit_length()


def enable_compilation_cache(directory: str) -> None:
    """Persist compiled programs in `directory` across processes (JAX's persistent compilation cache)."""
    jax.config.update("jax_compilation_cache_dir", str(directory))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


# ---------------------------------------------------------------------------------------------- device side

def _token_logprob(z, tok):
    """log softmax(z)[tok] per row: z [B, V] float32, tok [B] → [B] float32 (no [B, V] log-softmax kept)."""
    return jnp.take_along_axis(z, tok[:, None], axis=-1)[:, 0] - jax.nn.logsumexp(z, axis=-1)


def _abstain(spec: Spec, done, code, live, abstain_above, step, abstain_step):
    """With `Spec.abstain`, live rows whose token's code exceeds τ are done too, and their `abstain_step`
    becomes `step`: returns (done, abstain_step). Without it, (done, None): the program is unchanged."""
    if not spec.abstain:
        return done, None
    over = live & (code.astype(jnp.int32) > abstain_above)
    return done | over, jnp.where(over, step, abstain_step)


def _choose(cfg: ModelConfig, spec: Spec, logits, prev_code, sp: SamplingParams, key):
    return core.choose(cfg, logits, prev_code, sp, key, greedy_=spec.greedy, introspection=spec.introspection,
                       temperature_fn=spec.temperature_fn)


@functools.partial(jax.jit, static_argnums=(0, 1))
def prefill(cfg: ModelConfig, spec: Spec, params: dict, batch: M.Batch, next_pos, sp: SamplingParams,
            eos, pad_id, rng, abstain_above=None) -> DecodeState:
    """Whole prompt [B, P] (vision included) into a fresh cache of P + T slots; draws the first token.
    `abstain_above`: τ as an int32 scalar when `spec.abstain` (else unused)."""
    b, p = batch.input_ids.shape
    t = spec.new_bucket
    cache, logits, prev = core.prompt_pass(cfg, params, batch, t)
    n = batch.attention_mask.astype(jnp.int32).sum(1)                         # each row's prompt tokens
    from_slot = (jnp.arange(p) + (p - n)[:, None]) % p                          # [B, P]: shift left by the padding
    shifted = lambda c: jnp.take_along_axis(c[..., :p, :], from_slot[None, :, None, :, None], axis=3)  # noqa: E731
    cache = jax.tree.map(lambda c: jax.lax.dynamic_update_slice_in_dim(c, shifted(c), 0, axis=3), cache)
    rng, key = jax.random.split(rng)
    tok, code, ent = _choose(cfg, spec, logits, prev, sp, key)
    done, step = _abstain(spec, jnp.isin(tok, eos), code, jnp.ones((b,), bool), abstain_above, jnp.int32(0),
                          jnp.full((b,), -1, jnp.int32))
    put = lambda buf, x: buf.at[:, 0].set(x)                                      # noqa: E731
    z = logits.astype(jnp.float32)
    kept = put(jnp.zeros((b, t, z.shape[-1]), jnp.float32), z) if spec.keep_logits else None
    lp = put(jnp.zeros((b, t), jnp.float32), _token_logprob(z, tok)) if spec.keep_logprobs else None
    return GenerateState(DecodeState(cache, tok, code, next_pos.astype(jnp.int32), n), jnp.int32(1), rng, done,
                         jnp.ones((b,), jnp.int32),
                       put(jnp.full((b, t), pad_id, jnp.int32), tok), put(jnp.zeros((b, t), jnp.uint16), code),
                         put(jnp.zeros((b, t), jnp.float32), ent), kept, step, lp)


@functools.partial(jax.jit, static_argnums=(0, 1), donate_argnums=(3,))
def decode(cfg: ModelConfig, spec: Spec, params: dict, state: GenerateState, sp: SamplingParams, eos, pad_id,
           max_new, abstain_above=None) -> GenerateState:
    """Steps until every row is done (an end token, or with `spec.abstain` a code above `abstain_above`) or
    `max_new` tokens are out; one compiled `lax.while_loop`."""
    b = state.tokens.shape[0]
    model = core.bind(cfg, params, unroll=spec.unroll_layers)

    def cond(s: GenerateState):
        return (s.step < max_new) & ~jnp.all(s.done)

    def body(s: GenerateState) -> GenerateState:
        d = s.state
        codes_in = d.code.astype(jnp.int32) if spec.introspection else jnp.full((b,), NONE, jnp.int32)
        h, cache = core.cached_step(model, d, codes_in)
        logits = model.head(h)
        rng, key = jax.random.split(s.rng)
        tok, code, ent = _choose(cfg, spec, logits, d.code, sp, key)
        live = ~s.done
        tok = jnp.where(live, tok, pad_id)
        code = jnp.where(live, code, 0).astype(jnp.uint16)
        def put(buf, x):
            x = x[:, None].astype(buf.dtype)
            return jax.lax.dynamic_update_slice(buf, x, (0, s.step) + (0,) * (buf.ndim - 2))
        z = logits.astype(jnp.float32)
        kept = None if s.logits is None else put(s.logits, z)
        done, step = _abstain(spec, s.done | jnp.isin(tok, eos), code, live, abstain_above, s.step,
                              s.abstain_step)
        lp = None if s.logprobs is None else put(s.logprobs, jnp.where(live, _token_logprob(z, tok), 0.0))
        return GenerateState(DecodeState(cache, tok, code, d.position + 1, d.write + 1), s.step + 1, rng,
                             done, s.lengths + live.astype(jnp.int32),
                             put(s.tokens, tok), put(s.codes, code), put(s.entropies, jnp.where(live, ent, 0.0)),
                             kept, step, lp)

    # the loop runs in the bound model's layer layout: on CPU the stack is sliced once per call, not per step
    state = state.replace(state=state.state.replace(cache=core.in_layout(model, state.state.cache)))
    out = jax.lax.while_loop(cond, body, state)
    return out.replace(state=out.state.replace(cache=out.state.cache.stacked()))


# ---------------------------------------------------------------------------------------------- host side

def _eos_list(eos_token_id, vocab: int) -> list[int]:
    if eos_token_id is None:
        return []
    ids = [eos_token_id] if np.ndim(eos_token_id) == 0 else list(np.asarray(eos_token_id).ravel())
    out = []
    for e in ids:
        if int(e) != e or not 0 <= e < vocab:
            raise ValueError(f"eos_token_id {e} is outside the vocabulary [0, {vocab})")
        out.append(int(e))
    return out


class Inputs(NamedTuple):
    """A request's inputs, as `Processor` gives them: left-padded prompts and their images."""
    input_ids: Any                       # [B, S] (or [S]) token ids
    attention_mask: Any = None           # [B, S], 0s then 1s (None: all real)
    pixel_values: Any = None             # [N_patch, C·T·P·P] packed patches of every image, in order
    image_grid_thw: Any = None           # [N_img, 3]


@dataclasses.dataclass(frozen=True)
class Options:
    """Everything about a generation that is not its inputs or its sampling parameters (`generate` documents
    each)."""
    max_new_tokens: int = 16
    seed: int = 0
    eos_token_id: Any = None
    pad_token_id: int | None = None
    temperature_fn: Any = None
    introspection: bool = True
    return_logits: bool = False
    return_logprobs: bool = False
    abstain_above: int | None = None
    prompt_floor: int = 32
    new_floor: int = 16
    unroll_layers: bool | None = None    # None: the platform's layout (text.unroll_default)


class Request(NamedTuple):
    """One validated request, ready for the device: the arguments of `prefill` and `decode` after `params`."""
    spec: Spec
    batch: M.Batch
    next_pos: np.ndarray     # [B] int32
    sp: SamplingParams
    eos: np.ndarray          # [4k] int32, −1 padded
    pad: np.int32
    max_new: np.int32
    seed: int
    rows: int | None = None  # the request's rows; `batch` may hold more (padding to the mesh's batch shards)
    abstain_above: np.int32 | None = None   # τ when `spec.abstain`


def check_abstain(cfg: ModelConfig, abstain_above, introspection: bool = True) -> None:
    """Host-side validation of τ: None, or an integer code in [0, L); abstention needs the mechanism on."""
    if abstain_above is None:
        return
    levels = cfg.n_levels
    if isinstance(abstain_above, bool) or not isinstance(abstain_above, (int, np.integer)) \
            or not 0 <= abstain_above < levels:
        raise ValueError(f"abstain_above must be an integer code in [0, {levels - 1}] (n_bits = {cfg.n_bits}), "
                         f"got {abstain_above!r}")
    if not introspection:
        raise ValueError("abstain_above needs introspection=True (with the mechanism off every code is 0)")


def request(cfg: ModelConfig, inputs: Inputs, sampling: SamplingParams = SamplingParams(0.0, 0, 1.0, 0.0),
            options: Options = Options()) -> Request:
    """Host side of `generate`: validate (ValueError before any compile), pad to the buckets, index positions.
    `sampling`: temperature (0 = greedy), top_k, top_p and uncertainty_power, as Python numbers."""
    input_ids, attention_mask, pixel_values, image_grid_thw = inputs
    temperature, top_k, top_p, uncertainty_power = sampling
    o = options
    max_new_tokens, seed, eos_token_id, pad_token_id = o.max_new_tokens, o.seed, o.eos_token_id, o.pad_token_id
    temperature_fn, introspection, abstain_above = o.temperature_fn, o.introspection, o.abstain_above
    check_abstain(cfg, abstain_above, introspection)
    if isinstance(max_new_tokens, bool) or int(max_new_tokens) != max_new_tokens or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer ≥ 1, got {max_new_tokens}")
    max_new_tokens = int(max_new_tokens)
    check_sampling(temperature, top_k, top_p, uncertainty_power)
    vocab = cfg.text.vocab_size
    eos = _eos_list(eos_token_id, vocab)
    if pad_token_id is None:
        pad_token_id = eos[0] if eos else 0
    if not 0 <= int(pad_token_id) < vocab:
        raise ValueError(f"pad_token_id {pad_token_id} is outside the vocabulary [0, {vocab})")

    ids = np.asarray(input_ids)
    if ids.ndim == 1:
        ids = ids[None]
        attention_mask = None if attention_mask is None else np.asarray(attention_mask)[None]
    batch = prepare(cfg, ids, attention_mask, pixel_values, image_grid_thw)      # validates everything
    mask = np.asarray(batch.attention_mask, bool)
    n_real = mask.sum(1)
    if (n_real == 0).any():
        raise ValueError(f"row {int(np.argmin(n_real))} of the prompt has no real tokens (attention_mask all 0)")
    if not mask[:, -1].all() or (np.diff(mask.astype(np.int8), axis=1) < 0).any():
        raise ValueError("prompts must be left-padded: each row of attention_mask must be 0s then 1s, ending in 1")
    longest = int(n_real.max())
    if longest + max_new_tokens > cfg.text.max_position_embeddings:
        raise ValueError(f"prompt length {longest} + max_new_tokens {max_new_tokens} exceeds the model's maximum "
                         f"length {cfg.text.max_position_embeddings} (max_position_embeddings)")

    # left-pad to the bucket; re-index (positions and the prompt rule do not change with left padding).
    # Under a mesh, rows are padded to a multiple of its batch shards with one-token text rows, whose outputs
    # are dropped: the batch is split evenly, whatever the request's size.
    b, s = batch.input_ids.shape
    extra = bucket(s, o.prompt_floor) - s
    fill = pad_token_id if pad_token_id not in (cfg.image_token_id, cfg.video_token_id) else 0
    ids_p = np.concatenate([np.full((b, extra), fill, np.int64), batch.input_ids], axis=1)
    mask_p = np.concatenate([np.zeros((b, extra), bool), mask], axis=1)
    mesh = jax.sharding.get_abstract_mesh()
    batch = prepare(cfg, ids_p, mask_p, pixel_values, image_grid_thw)
    batch = pad_rows(cfg, batch, 0 if mesh.empty else -b % batch_shards(mesh), fill)
    if not introspection:
        batch = batch._replace(codes=np.full_like(batch.codes, NONE))
    pos = np.asarray(batch.positions)
    real = np.asarray(batch.attention_mask) > 0
    next_pos = np.where(real[None], pos, -1).max(axis=(0, 2)) + 1                  # text position + rope delta

    greedy_ = temperature == 0
    fn = temperature_fn or UncertaintyTemperature()
    spec = Spec(greedy=bool(greedy_), introspection=bool(introspection),
                new_bucket=bucket(max_new_tokens, o.new_floor), keep_logits=bool(o.return_logits),
                unroll_layers=unroll_default(o.unroll_layers),
                temperature_fn=fn, abstain=abstain_above is not None, keep_logprobs=bool(o.return_logprobs))
    sp = SamplingParams(np.float32(temperature), np.int32(top_k), np.float32(top_p), np.float32(uncertainty_power))
    n_eos = max(4, -(-len(eos) // 4) * 4)                  # padded with −1 to a multiple of 4: few shapes
    eos_arr = np.asarray(eos + [-1] * (n_eos - len(eos)), np.int32)
    pad = np.int32(pad_token_id)
    tau = None if abstain_above is None else np.int32(abstain_above)
    return Request(spec, batch, next_pos.astype(np.int32), sp, eos_arr, pad, np.int32(max_new_tokens), int(seed), b,
                   tau)


def generate(cfg: ModelConfig, params: dict, input_ids, attention_mask=None, pixel_values=None,
             image_grid_thw=None, max_new_tokens: int = 16, temperature: float = 0.0, top_k: int = 0,
             top_p: float = 1.0, seed: int = 0, eos_token_id=None, pad_token_id: int | None = None,
             uncertainty_power: float = 0.0, temperature_fn=None, return_entropies: bool = False,
             return_logits: bool = False, introspection: bool = True, prompt_floor: int = 32,
             new_floor: int = 16, unroll_layers: bool | None = None, abstain_above: int | None = None,
             abstain_text: str = ABSTAIN_TEXT, return_logprobs: bool = False) -> GenerateResult:
    """Generate up to `max_new_tokens` per row from left-padded prompts; see the module docstring.

    temperature 0 = greedy (top_k / top_p ignored). `eos_token_id`: int, list or None (no end token).
    `introspection=False` turns the mechanism off (no injection, codes 0) for measuring its cost.
    `unroll_layers`: decode layer loop unrolled (text.py); None = on the CPU backend only.
    `abstain_above=τ`: a row stops at its first token whose code (`codes[i, t]`) is > τ; the result's
    `abstained` / `abstain_step` say which rows and where, `texts(processor)` puts `abstain_text` in their place.
    `return_logprobs`: each token's log-probability under the logits it was drawn from (its `codes` entry's).
    """
    if not isinstance(abstain_text, str):
        raise ValueError(f"abstain_text must be a string, got {abstain_text!r}")
    p = request(cfg, Inputs(input_ids, attention_mask, pixel_values, image_grid_thw),
                SamplingParams(temperature, top_k, top_p, uncertainty_power),
                Options(max_new_tokens, seed, eos_token_id, pad_token_id, temperature_fn, introspection, return_logits,
                        return_logprobs, abstain_above, prompt_floor, new_floor, unroll_layers))
    state = prefill(cfg, p.spec, params, p.batch, p.next_pos, p.sp, p.eos, p.pad, jax.random.key(p.seed),
                    p.abstain_above)
    state = decode(cfg, p.spec, params, state, p.sp, p.eos, p.pad, p.max_new, p.abstain_above)
    out = jax.device_get((state.tokens, state.codes, state.entropies, state.lengths, state.logits,
                          state.abstain_step, state.logprobs))
    tokens, codes, ents, lengths, logits, step, lps = (None if x is None else np.asarray(x)[:p.rows] for x in out)
    t = int(lengths.max())
    step = np.full(lengths.shape, -1, np.int32) if step is None else step.astype(np.int32)
    return GenerateResult(tokens[:, :t].astype(np.int32), codes[:, :t].astype(np.uint16), lengths.astype(np.int32),
                          ents[:, :t] if return_entropies else None, None if logits is None else logits[:, :t],
                          step >= 0, step, abstain_text, None if lps is None else lps[:, :t])
