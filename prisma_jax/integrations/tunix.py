"""Prisma-VL as a Tunix model (google-tunix 0.1.7): its `Sampler` and `PeftTrainer` drive `PrismaTunix` as
they drive Tunix's own Qwen3, and the introspective mechanism comes along (docs/tunix.md).

    model = PrismaTunix.from_prisma(PrismaVL.from_pretrained(path), lora=LoraSpec(rank=8, alpha=16))
    sampler = tunix.Sampler(model, tokenizer, tunix.CacheConfig(cache_size=256, num_layers=model.config.num_layers,
                                                                num_kv_heads=model.config.num_kv_heads,
                                                                head_dim=model.config.head_dim))
    trainer = (tunix.PeftTrainer(model, optax.adam(1e-2), tunix.TrainingConfig(eval_every_n_steps=100, max_steps=20))
               .with_loss_fn(loss_fn).with_gen_model_input_fn(model_input_fn(pad_id)))

Tunix's model protocol, as the installed 0.1.7 calls it: `__call__(input_tokens [B, S], positions [B, S], cache,
attention_mask [B, S, S_k]) -> (logits [B, S, V] float32, cache)` (`images=` too, on the prompt; the Sampler adds
`decode_only_last_token=True` when its signature has it), `init_cache(batch, cache_size, dtype)`,
`get_model_input()` (the dummy input of `qwix.apply_lora_to_model`), `num_embed`, and a `config` with
`num_layers`, `num_kv_heads`, `head_dim` (for `CacheConfig`) and `dtype` (the Sampler's cache dtype).

The math is `model.PrismaVLModule`'s (`embed` → `hidden` with Tunix's mask → `head`); this file only translates:

- **The code rides in the cache.** The cache is `{"layer_i": {"k", "v"} [B, KV, S_max, hd], "prisma": {"end_index",
  "code", "delta"} [B]}`, every leaf batch-major as Tunix's own caches are (its beam search repeats and gathers
  leaves on axis 0). Each call stores `code(logits[:, -1])` (docs/introspection-contract.md §2) in the cache
  it returns, and the next call feeds it with its first token: the token the Sampler drew from those logits
  enters with the code of that very distribution (§4's decode rule), with no change on Tunix's side. A call on a
  fresh cache (`end_index` 0: the prompt) and a call without a cache (training) get §4's prompt rule: the first
  real token none, every later real token the neutral code. Real tokens are those that see themselves in
  Tunix's attention mask.
- **M-RoPE positions.** Text: all three axes are Tunix's position. With `images` (prompt and training only),
  the positions come from the tokens and the wrapper's fixed `image_grid` (`rope_positions`, equal to
  `rope.rope_index`), and the prompt's rope delta is kept in the cache: a decode position is Tunix's + delta.
- **Images** are pixel rows in the per-row layout, `[B, k·t·h·w, 1536]` (k image slots per row, each of
  `image_grid` (t, h, w) patches, as `Processor` makes them), passed as the Sampler's `images=` (without an
  image processor, the Sampler hands them over as they are) or `TrainingInput.images`.
- **Training.** `loss_fn` is Tunix's default SFT loss (next-token NLL where `input_mask` is set) over
  `introspection_passes` passes (§4: pass k feeds code(pass k−1's logits) at each position whose predecessor is
  supervised; 2 by default, as `prisma train`). `PeftTrainer` updates the `nnx.LoRAParam`s: our adapters
  (`LoraSpec`, Flax's `nnx.LoRA` inside `layers.Dense`) and, with `train_table=True` (the default, as
  `train.lora`), the uncertainty table, which the wrapper holds as an `nnx.LoRAParam` for that reason.
- The layers run unrolled when there is a cache (each layer's cache is its own leaf), scanned in training.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from prisma_jax.nn import model as M
from prisma_jax.nn.lora import LoraSpec, is_adapter
from prisma_jax.core.trees import flatten, set_path
from prisma_jax.nn.params import param_shapes
from prisma_jax.nn.kvcache import KVCache, Mode
from prisma_jax.nn.text import unstack_layers
from prisma_jax.nn.uncertainty import NONE, codes_from_logits, shift_codes
from prisma_jax.nn.vision import vision_geometry


@dataclasses.dataclass(frozen=True)
class TunixConfig:
    """What Tunix reads off `model.config`: the cache geometry (`CacheConfig`) and the cache dtype."""
    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_embed: int
    dtype: Any


def adapter_params(cfg, spec: LoraSpec, seed: int = 0) -> dict:
    """Fresh adapters for `spec` as a param dict (only the `lora` leaves): A [layers, in, r] He-uniform and
    B [layers, r, out] zeros, as `nnx.LoRA` initializes them, drawn with NumPy (no XLA compile)."""
    rng = np.random.default_rng(seed)
    out: dict = {}
    for path, shape in flatten(param_shapes(cfg, spec)):
        if not is_adapter(path):
            continue
        if path[-1] == "lora_a":
            bound = np.sqrt(3.0 / shape[-2])
            x = rng.uniform(-bound, bound, shape).astype(np.float32)
        else:
            x = np.zeros(shape, np.float32)
        set_path(out, path, jnp.asarray(x))
    return out


def _merge(a: dict, b: dict) -> dict:
    out = dict(a)
    for k, v in b.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and k in out else v
    return out


def rope_positions(cfg, input_ids: jax.Array, real: jax.Array, grid: tuple[int, int, int] | None):
    """`rope.rope_index` inside a trace, for prompts whose images all have the grid `grid` (t, h, w): positions
    [3, B, S] int32 (0 at padding) and rope deltas [B]. Text counts up on all three axes; the k-th token of an
    image run gets (cur + t_k, cur + row_k, cur + col_k); each image advances `cur` by max(h, w)/merge."""
    real = real.astype(bool)
    if grid is None:
        text = jnp.cumsum(real, axis=1) - 1
        pos = jnp.where(real, text, 0).astype(jnp.int32)
        return jnp.broadcast_to(pos, (3,) + pos.shape), jnp.zeros(pos.shape[:1], jnp.int32)
    t, gh, gw = grid
    m = cfg.vision.spatial_merge_size
    hh, ww = gh // m, gw // m
    n = t * hh * ww
    is_img = real & (input_ids == cfg.image_token_id)
    is_txt = real & ~is_img
    text_before = jnp.cumsum(is_txt, axis=1) - is_txt                     # text tokens before this one
    k = jnp.cumsum(is_img, axis=1)                                       # image tokens up to this one
    j = jnp.maximum(k - 1, 0)                                            # index among the row's image tokens
    images_before = jnp.where(is_img, j // n, k // n)
    base = text_before + images_before * max(hh, ww)
    w = j % n
    offs = jnp.stack([w // (hh * ww), (w // ww) % hh, w % ww])           # [3, B, S]
    pos = base[None] + jnp.where(is_img[None], offs, 0)
    pos = jnp.where(real[None], pos, 0).astype(jnp.int32)
    delta = jnp.max(pos, axis=(0, 2)) + 1 - jnp.sum(real, axis=1)
    return pos, delta.astype(jnp.int32)


class PrismaTunix(nnx.Module):
    """A `PrismaVLModule` behind Tunix's model protocol (module docstring). `image_grid`: the (t, h, w) patch
    grid of every image the model will be given (None: text only)."""

    def __init__(self, model: M.PrismaVLModule, *, image_grid: tuple[int, int, int] | None = None,
                 introspection_passes: int = 2, train_table: bool = True):
        cfg = model.cfg
        if introspection_passes < 1:
            raise ValueError(f"introspection_passes must be ≥ 1, got {introspection_passes}")
        self.model = model
        self.image_grid = None if image_grid is None else tuple(int(x) for x in image_grid)
        self.introspection_passes = int(introspection_passes)
        tc = cfg.text
        self.config = TunixConfig(tc.num_hidden_layers, tc.num_key_value_heads, tc.head_dim, tc.vocab_size,
                                  jnp.dtype(model.text.embed.embedding.get_value().dtype))
        if train_table:          # PeftTrainer trains exactly the nnx.LoRAParams (wrt=nnx.LoRAParam)
            table = model.uncertainty.embedding
            model.uncertainty.embedding = nnx.LoRAParam(table.get_value(), **table.get_metadata())

    @classmethod
    def from_prisma(cls, prisma, lora: LoraSpec | None = None, seed: int = 0, **kw) -> "PrismaTunix":
        """From a `PrismaVL` (its params, not copied), with fresh adapters for `lora` (`adapter_params`)."""
        params = prisma.params
        if lora is not None:
            params = _merge(params, adapter_params(prisma.config, lora.check("lora"), seed))
        return cls(M.bind(prisma.config, params, lora), **kw)

    @property
    def num_embed(self) -> int:
        return self.config.num_embed

    # ------------------------------------------------------------------------------------------ protocol
    def init_cache(self, batch_size: int, cache_size: int, dtype=None) -> dict:
        c = self.config
        dtype = c.dtype if dtype is None else dtype
        shape = (batch_size, c.num_kv_heads, cache_size, c.head_dim)
        cache = {f"layer_{i}": {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}
                 for i in range(c.num_layers)}
        cache["prisma"] = {"end_index": jnp.zeros((batch_size,), jnp.int32),     # distinct buffers: the Sampler
                           "code": jnp.zeros((batch_size,), jnp.uint16),         # donates the cache
                           "delta": jnp.zeros((batch_size,), jnp.int32)}
        return cache

    def get_model_input(self) -> dict:
        """A dummy input (batch 2, one token), as Tunix's models give for `qwix.apply_lora_to_model`."""
        return {"input_tokens": jnp.ones((2, 1), jnp.int32), "positions": jnp.zeros((2, 1), jnp.int32),
                "cache": None, "attention_mask": jnp.ones((2, 1, 1), bool)}

    def __call__(self, input_tokens, positions, cache, attention_mask, images=None, codes=None,
                 decode_only_last_token: bool = False):
        """Logits [B, S, V] float32 (the last position only with `decode_only_last_token`) and the new cache.
        `codes [B, S]` int32 (−1 none): incoming codes to use instead of the rules above (training passes)."""
        model = self.model
        cfg = model.cfg
        ids = jnp.asarray(input_tokens).astype(jnp.int32)
        b, s = ids.shape
        mask = jnp.asarray(attention_mask).astype(bool)
        state = None if cache is None else cache["prisma"]
        start = jnp.int32(0) if state is None else state["end_index"][0]
        slot = jnp.broadcast_to((start + jnp.arange(s))[None, :, None], (b, s, 1))
        real = jnp.take_along_axis(mask, slot, axis=2)[..., 0]            # a real token sees itself

        grid = None
        pixels = geometry = None
        if images is not None:
            if self.image_grid is None:
                raise ValueError("images given, but this PrismaTunix has no image_grid")
            pixels = jnp.asarray(images, jnp.float32)
            t, gh, gw = self.image_grid
            slots = pixels.shape[1] // (t * gh * gw)
            if pixels.ndim != 3 or pixels.shape[0] != b or slots * t * gh * gw != pixels.shape[1]:
                raise ValueError(f"images must be [B={b}, k·{t * gh * gw}, patch_dim] pixel rows (k image slots "
                                 f"of grid {self.image_grid} per row), got {pixels.shape}")
            geometry = vision_geometry(cfg.vision, np.asarray([self.image_grid] * slots))
            grid = self.image_grid
            pos3, delta = rope_positions(cfg, ids, real, grid)
        else:
            delta = jnp.zeros((b,), jnp.int32) if state is None else state["delta"]
            pos = jnp.asarray(positions).astype(jnp.int32) + delta[:, None]
            pos3 = jnp.broadcast_to(pos[None], (3, b, s))

        if codes is None:
            first = real & (jnp.cumsum(real, axis=1) == 1)
            prompt = jnp.where(real & ~first, cfg.neutral_code, NONE)
            codes = prompt
            if state is not None:                                       # a continuation: the carried code first
                cont = jnp.where(real, cfg.neutral_code, NONE).at[:, 0].set(state["code"].astype(jnp.int32))
                codes = jnp.where(start == 0, prompt, cont)
        batch = M.Batch(ids, real, jnp.asarray(codes, jnp.int32), pos3, pixels, geometry)

        with _precision(self.config.dtype):
            if cache is None:
                h, _ = model.hidden(batch, mask=mask)
                new = None
            else:
                unrolled = nnx.merge(*nnx.split(model))                  # a copy: `model` keeps its stacked layers
                unstack_layers(unrolled.text)                            # per-layer cache leaves: unrolled layers
                n = self.config.num_layers
                kv = KVCache.from_layers((cache[f"layer_{i}"]["k"], cache[f"layer_{i}"]["v"]) for i in range(n))
                h, kv = unrolled.hidden(batch, kv, start, mask=mask, mode=Mode.DECODE)
                new = {f"layer_{i}": dict(zip("kv", kv.layer(i))) for i in range(n)}
            if decode_only_last_token:
                h = h[:, -1:]
            logits = model.head(h).astype(jnp.float32)
        if new is not None:
            code = codes_from_logits(logits[:, -1], cfg.n_bits)
            new["prisma"] = {"end_index": state["end_index"] + s, "code": code,
                             "delta": jnp.where(start == 0, delta, state["delta"]).astype(jnp.int32)}
        return logits, new

    def training_codes(self, input_tokens, input_mask, positions, attention_mask, images=None):
        """§4's teacher-forced codes for the last of `introspection_passes` passes: the prompt rule, then each
        pass feeds code(previous pass's logits) wherever the previous position is supervised (its next token
        is a target: `input_mask[:, 1:]`, as Tunix's loss reads it). Integer codes carry no gradient."""
        real = jnp.diagonal(jnp.asarray(attention_mask).astype(bool), axis1=1, axis2=2)
        first = real & (jnp.cumsum(real, axis=1) == 1)
        codes = jnp.where(real & ~first, self.model.cfg.neutral_code, NONE).astype(jnp.int32)
        mask = jnp.asarray(input_mask).astype(bool)
        supervised = jnp.pad(mask[:, 1:], ((0, 0), (0, 1)))
        base = codes
        for _ in range(self.introspection_passes - 1):
            logits, _ = self(input_tokens, positions, None, attention_mask, images=images, codes=codes)
            prev = codes_from_logits(jax.lax.stop_gradient(logits), self.model.cfg.n_bits)
            codes = shift_codes(base, prev, supervised)
        return codes


def _precision(dtype):
    # float32 weights mean float32 math, as PrismaVL runs them (no bf16 passes on TPU/GPU matmuls)
    return jax.default_matmul_precision("highest") if dtype == jnp.float32 else contextlib.nullcontext()


def loss_fn(model: PrismaTunix, input_tokens, input_mask, positions, attention_mask, images=None):
    """Tunix's default SFT loss (mean NLL of each next token where `input_mask` is set) on the logits of the
    last introspection pass (`PrismaTunix.training_codes`); `PeftTrainer.with_loss_fn(loss_fn)`."""
    codes = model.training_codes(input_tokens, input_mask, positions, attention_mask, images)
    logits, _ = model(input_tokens, positions, None, attention_mask, images=images, codes=codes)
    logits = logits[:, :-1]
    target = jnp.asarray(input_tokens)[:, 1:]
    weight = jnp.asarray(input_mask)[:, 1:].astype(jnp.float32)
    logp = jnp.take_along_axis(jax.nn.log_softmax(logits), target[..., None], axis=-1)[..., 0]
    return -jnp.sum(logp * weight) / (jnp.sum(weight) + 1e-8)


def model_input_fn(pad_id: int):
    """`PeftTrainer.with_gen_model_input_fn`: a `TrainingInput` (tokens, loss mask, images) → the keyword
    arguments of `loss_fn`: tokens equal to `pad_id` are padding (Tunix's convention); positions count the
    real tokens; the attention mask is causal over them."""
    def gen(x) -> dict:
        ids = jnp.asarray(x.input_tokens)
        real = ids != pad_id
        c = jnp.cumsum(real, axis=-1)
        s = ids.shape[1]
        out = {"input_tokens": ids, "input_mask": jnp.asarray(x.input_mask), "positions": c - (c >= 1),
               "attention_mask": real[:, None, :] & jnp.tril(jnp.ones((s, s), bool))[None]}
        if getattr(x, "images", None) is not None:
            out["images"] = x.images
        return out
    return gen
