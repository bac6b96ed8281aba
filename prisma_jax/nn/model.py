"""Prisma-VL as one Flax NNX module, and the functional entry points that run it on a plain param dict.

    embed tokens → inject uncertainty (§3) → scatter vision features → decoder (M-RoPE, DeepStack) → head

`PrismaVLModule` is the model: `vision` (VisionTower), `text` (TextModel), `lm_head` (absent when tied) and
`uncertainty` (the table and its injection, uncertainty.py). Its params as a plain nested dict
(`nnx.to_pure_dict`) are the checkpoint layout (params.py); `bind(cfg, params)` merges a dict back into the
module inside a trace, so infer/core.py's prefill and decode step and train/step.py are pure functions of
(config, params, inputs). The uncertainty code is an input (`Batch.codes`); no module state holds it.

`Batch` is the device-side input, already validated and indexed on the host (`inputs.prepare`). The KV cache
(text.py) is optional, so the same code serves a plain forward, prefill and decode.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from prisma_jax.core.config import ModelConfig
from prisma_jax.nn.mask import causal
from prisma_jax.nn.layers import Dense, Embed, token_matmul
from prisma_jax.nn.rope import mrope_cos_sin
from prisma_jax.core.partitioning import constrain
from prisma_jax.nn.kvcache import KVCache, Mode
from prisma_jax.nn.text import DeepStack, TextModel, image_features, unstack_layers
from prisma_jax.nn.uncertainty import Uncertainty
from prisma_jax.nn.vision import VisionGeometry, VisionTower, tile_geometry


class Batch(NamedTuple):
    input_ids: jax.Array                 # [B, S] int32
    attention_mask: jax.Array            # [B, S] bool, or int32 segment ids of packed rows (0 = padding)
    codes: jax.Array                     # [B, S] int32 incoming uncertainty codes, −1 = none
    positions: jax.Array                 # [3, B, S] int32 M-RoPE positions
    pixel_values: jax.Array | None = None   # [N_patch, C·T·P·P] packed, or [B, N_row, C·T·P·P] per row
    geometry: VisionGeometry | None = None  # of the packed patches, or of one row's N_row (the same for every row)


class PrismaVLModule(nnx.Module):
    """Qwen3-VL + the uncertainty table. `rngs`: `nnx.Rngs(params=key, table=seed)` draws the table as
    `uncertainty.fresh_table(seed)`; `uncertainty_init="zeros"` gives plain Qwen3-VL. `lora`: a
    `lora.LoraSpec` adds adapters to its target modules."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, uncertainty_init: str = "normal", lora=None):
        self.cfg = cfg
        self.vision = VisionTower(cfg.vision, attention=cfg.attention, lora=lora, rngs=rngs)
        self.text = TextModel(cfg.text, attention=cfg.attention, lora=lora, rngs=rngs)
        self.lm_head = (None if cfg.tie_word_embeddings else
                        Dense(cfg.text.hidden_size, cfg.text.vocab_size, ("hidden", "vocab"), bias=False, rngs=rngs))
        self.uncertainty = Uncertainty(cfg.n_levels, cfg.text.hidden_size, (cfg.image_token_id, cfg.video_token_id),
                                       uncertainty_init, rngs=rngs)

    def vision_features(self, pixel_values, geometry, remat=False):
        """The vision tower's (merged, deepstack) features: [B, T, D] / [L_ds, B, T, D] per row, or [T, D] /
        [L_ds, T, D] packed. They do not depend on the codes, so introspection passes share them."""
        if pixel_values.ndim == 3:
            b = pixel_values.shape[0]
            merged, deep = self.vision(pixel_values.reshape(-1, pixel_values.shape[-1]), tile_geometry(geometry, b),
                                       remat=remat)
            t, d = merged.shape[0] // b, merged.shape[-1]
            return (constrain(merged.reshape(b, t, d), ("batch", None, "embed")),
                    constrain(deep.reshape(deep.shape[0], b, t, d), (None, "batch", None, "embed")))
        return self.vision(pixel_values, geometry, remat=remat)

    def embed(self, input_ids, codes, pixel_values=None, geometry=None, remat=False, features=None):
        """Input embeddings [B, S, D] with the uncertainty injected and vision features scattered in.

        Two image layouts. Packed, `pixel_values` [N_patch, ·]: one list of every image in batch order, the
        k-th image token of the batch reads feature k. Per row, [B, N_row, ·] (training: each row's image
        slots, its images first): row r's k-th image token reads row r's feature k, so a row needs nothing from
        other rows and the pixels shard with their rows (train/sharded.py). `features`: the tower's output
        (`vision_features` of these `pixel_values`, which still give the layout), computed once by a caller that
        embeds the same images several times."""
        cfg = self.cfg
        x = self.uncertainty(self.text.embed(input_ids), input_ids, codes)
        if pixel_values is None:
            return constrain(x, ("batch", "seq", "embed")), None
        is_img = input_ids == cfg.image_token_id
        merged, deep = self.vision_features(pixel_values, geometry, remat) if features is None else features
        if pixel_values.ndim == 3:
            index = jnp.cumsum(is_img, axis=1)
        else:
            index = jnp.cumsum(is_img.reshape(-1)).reshape(is_img.shape)
        index = jnp.maximum(index - 1, 0).astype(jnp.int32)
        x = jnp.where(is_img[..., None], image_features(merged, index).astype(x.dtype), x)
        return constrain(x, ("batch", "seq", "embed")), DeepStack(deep, index, is_img)

    def hidden(self, batch: Batch, cache: KVCache | None = None, write_pos=0, key_valid=None, remat_policy=None,
               mask=None, features=None, mode: Mode | None = None):
        """Final-normed hidden states [B, S, D] and the updated cache.

        `mode` (kvcache.py) says what the pass does with the cache: FORWARD (the default without a cache), keys
        are the batch itself (`key_valid` = its mask); PREFILL and DECODE write new keys at `write_pos`, and
        `key_valid [B, S_max]` says which cache slots hold real tokens (bool, or segment ids).
        The mask is causal within each segment (prisma_jax/nn/attention.py); a dense `mask [B, S, S_k]` (True = may
        attend) replaces it (prisma_jax/integrations/tunix.py: Tunix brings its own). `features`: as for `embed`."""
        x, ds = self.embed(batch.input_ids, batch.codes, batch.pixel_values, batch.geometry,
                           remat=remat_policy is not None, features=features)
        cos, sin = mrope_cos_sin(self.cfg, batch.positions, x.dtype)
        if mask is None:
            mask = causal(batch.attention_mask if key_valid is None else key_valid, write_pos, x.shape[1])
        if mode is None:
            if cache is not None:
                raise ValueError("a pass with a cache names its mode: Mode.PREFILL or Mode.DECODE")
            mode = Mode.FORWARD
        return self.text(x, cos, sin, mask, cache, write_pos, ds, remat_policy, mode)

    def head_module(self) -> nnx.Module:
        """The module whose params the head reads: `lm_head`, or the embedding when tied (`head_logits`)."""
        return self.text.embed if self.lm_head is None else self.lm_head

    def head(self, h: jax.Array) -> jax.Array:
        """Final hidden [..., D] → logits [..., V] (tied heads use the embedding table)."""
        return head_logits(self.head_module(), h)

    def __call__(self, input_ids, attention_mask=None, positions=None, codes_in=None, pixel_values=None,
                 geometry=None) -> jax.Array:
        """Logits [B, S, V] of a whole sequence. `codes_in [B, S]` int32 (−1 = none; None: none anywhere);
        `positions [3, B, S]` M-RoPE positions (None: 0…S−1 on all three axes, text only)."""
        b, s = input_ids.shape
        if attention_mask is None:
            attention_mask = jnp.ones((b, s), bool)
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (3, b, s))
        if codes_in is None:
            codes_in = jnp.full((b, s), -1, jnp.int32)
        h, _ = self.hidden(Batch(input_ids, attention_mask, codes_in, positions, pixel_values, geometry))
        return self.head(h)


# ---------------------------------------------------------------------------------------------- functional API

@functools.lru_cache(maxsize=16)
def abstract_model(cfg: ModelConfig, lora=None) -> tuple[nnx.GraphDef, nnx.State]:
    """(graphdef, abstract param state) of the model: shapes, dtypes and sharding metadata, no weights."""
    return nnx.split(nnx.eval_shape(lambda: PrismaVLModule(cfg, rngs=nnx.Rngs(0), lora=lora)))


def bind(cfg: ModelConfig, params: dict, lora=None, unroll: bool = False, layer_params=None,
         abstract: tuple | None = None) -> PrismaVLModule:
    """The module holding `params` (a plain dict in the nn/params.py layout; with `lora`, its adapters too), to
    call inside a trace. The layer layout is chosen here, once: `unroll` gives the unrolled decoder layers
    (text.py), from `layer_params` when the caller holds them split (`text.split_layers`). `abstract`: the
    (graphdef, abstract state) to merge into instead of the float model's (quant/int8.py's int8 model)."""
    graphdef, state = abstract_model(cfg, lora) if abstract is None else abstract
    state = jax.tree.map(lambda x: x, state)                      # fresh Variables; the cached state stays
    nnx.replace_by_pure_dict(state, params)
    model = nnx.merge(graphdef, state)
    if unroll:
        unstack_layers(model.text, layer_params)
    return model


def to_params(model: PrismaVLModule) -> dict:
    """The module's params as a plain nested dict (the checkpoint layout)."""
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def head_logits(module: nnx.Module, h: jax.Array) -> jax.Array:
    """Logits [..., V] of final hidden states [..., D] from `PrismaVLModule.head_module()`: the `lm_head` Dense, or
    the tied embedding table [V, D]."""
    if isinstance(module, Embed):
        logits = token_matmul(h, module.embedding[...].astype(h.dtype), "oi")
    else:
        logits = module(h)
    return constrain(logits, ("batch", "seq", "vocab")[-logits.ndim:])
