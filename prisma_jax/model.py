"""The whole Prisma-VL forward pass as pure functions of (config, params, inputs).

    embed tokens → inject uncertainty (§3) → scatter vision features → decoder (M-RoPE, DeepStack) → head

`Batch` is the device-side input, already validated and indexed on the host (`inputs.prepare`). Everything
here is jit-able with the config static; the KV cache (text.decoder) is optional, so the same code serves a
plain forward, prefill and decode.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from .config import ModelConfig
from .rope import mrope_cos_sin
from .sharding import constrain, take_rows
from .text import DeepStack, decoder, image_features
from .uncertainty import inject
from .vision import VisionGeometry, tile_geometry, vision_tower


class Batch(NamedTuple):
    input_ids: jax.Array                 # [B, S] int32
    attention_mask: jax.Array            # [B, S] bool
    codes: jax.Array                     # [B, S] int32 incoming uncertainty codes, −1 = none
    positions: jax.Array                 # [3, B, S] int32 M-RoPE positions
    pixel_values: jax.Array | None = None   # [N_patch, C·T·P·P] packed, or [B, N_row, C·T·P·P] per row
    geometry: VisionGeometry | None = None  # of the packed patches, or of one row's N_row (the same for every row)


def embed(cfg: ModelConfig, params: dict, input_ids, codes, pixel_values=None, geometry=None, remat=False):
    """Input embeddings [B, S, D] with the uncertainty injected and vision features scattered in.

    Two image layouts. Packed, `pixel_values` [N_patch, ·]: one list of every image in batch order, the k-th
    image token of the batch reads feature k. Per row, [B, N_row, ·] (training: each row's image slots, its
    images first): row r's k-th image token reads row r's feature k, so a row needs nothing from other rows
    and the pixels shard with their rows (train/sharded.py)."""
    table = params["text"]["embed"]["embedding"]
    x = take_rows(table, input_ids, ("vocab", "hidden"))
    x = inject(x, params["uncertainty"]["embedding"], input_ids, codes,
               (cfg.image_token_id, cfg.video_token_id))
    if pixel_values is None:
        return constrain(x, ("batch", "seq", "embed")), None
    is_img = input_ids == cfg.image_token_id
    if pixel_values.ndim == 3:
        b = pixel_values.shape[0]
        merged, deep = vision_tower(cfg.vision, params["vision"], pixel_values.reshape(-1, pixel_values.shape[-1]),
                                    tile_geometry(geometry, b), remat=remat)
        t, d = merged.shape[0] // b, merged.shape[-1]
        merged = constrain(merged.reshape(b, t, d), ("batch", None, "embed"))
        deep = constrain(deep.reshape(deep.shape[0], b, t, d), (None, "batch", None, "embed"))
        index = jnp.cumsum(is_img, axis=1)
    else:
        merged, deep = vision_tower(cfg.vision, params["vision"], pixel_values, geometry, remat=remat)
        index = jnp.cumsum(is_img.reshape(-1)).reshape(is_img.shape)
    index = jnp.maximum(index - 1, 0).astype(jnp.int32)
    x = jnp.where(is_img[..., None], image_features(merged, index).astype(x.dtype), x)
    return constrain(x, ("batch", "seq", "embed")), DeepStack(deep, index, is_img)


def attention_mask(key_valid: jax.Array, write_pos, n_query: int) -> jax.Array:
    """Causal + padding mask [B, S_q, S_k]: query at slot write_pos+i sees valid keys at slots ≤ its own.
    A query always sees itself, so padded rows stay finite."""
    s_k = key_valid.shape[1]
    q_slot = write_pos + jnp.arange(n_query)
    k_slot = jnp.arange(s_k)
    causal = k_slot[None, :] <= q_slot[:, None]
    return (causal[None] & key_valid[:, None, :]) | (k_slot[None, :] == q_slot[:, None])[None]


def head(cfg: ModelConfig, params: dict, h: jax.Array) -> jax.Array:
    """Final hidden [..., D] → logits [..., V] (tied heads use the embedding table)."""
    if cfg.tie_word_embeddings:
        w = params["text"]["embed"]["embedding"]
        logits = jnp.einsum("...d,vd->...v", h, w.astype(h.dtype))
    else:
        logits = jnp.einsum("...d,dv->...v", h, params["lm_head"]["kernel"].astype(h.dtype))
    return constrain(logits, ("batch", "seq", "vocab")[-logits.ndim:])


def hidden(cfg: ModelConfig, params: dict, batch: Batch, cache=None, write_pos=0, key_valid=None,
           remat_policy=None):
    """Final-normed hidden states [B, S, D] and the updated cache.

    Without a cache, keys are the batch itself (`key_valid` = its mask); with one, new keys are written at
    `write_pos` and `key_valid [B, S_max]` says which cache slots hold real tokens.
    """
    x, ds = embed(cfg, params, batch.input_ids, batch.codes, batch.pixel_values, batch.geometry,
                  remat=remat_policy is not None)
    cos, sin = mrope_cos_sin(cfg, batch.positions, x.dtype)
    if key_valid is None:
        key_valid = batch.attention_mask
    mask = attention_mask(key_valid, write_pos, x.shape[1])
    return decoder(cfg.text, params["text"], x, cos, sin, mask, cache, write_pos, ds, remat_policy)


def forward(cfg: ModelConfig, params: dict, batch: Batch) -> jax.Array:
    """Logits [B, S, V] for a whole sequence (no cache)."""
    h, _ = hidden(cfg, params, batch)
    return head(cfg, params, h)
