"""Positions: the host-side 3-D rope index (QWEN3_VL.md §5) and the interleaved M-RoPE tables (§4.3).

`rope_index` runs in NumPy on the host, before anything reaches XLA: it depends only on token ids, the mask and
the image grids (all known on the host), and its per-row run structure is data-dependent control flow that has
no business inside a compiled program. The device side (`mrope_cos_sin`) is a pure function of the positions.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from prisma_jax.nn.mask import segments_in_order
from prisma_jax.core.config import ModelConfig
from prisma_jax.nn.layers import torch_inv_freq


def rope_index(cfg: ModelConfig, input_ids: np.ndarray, attention_mask: np.ndarray,
               image_grid_thw: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """3-D positions `[3, B, S]` int32 and `rope_deltas [B]` int32.

    Per row and, where `attention_mask` holds segment ids (packed training rows), per segment, in the order of
    their first tokens: padding removed; text runs count up on all three axes from 0; an image run with merged
    grid (t, h, w) gets (cur + t_i, cur + row, cur + col) and advances `cur` by max(h, w). Each segment's
    positions are those of its tokens alone. Padded slots get 0. Decode positions are `text_position + rope_delta`
    on every axis (the delta of the row's last segment: a bool mask has one).
    """
    b, s = input_ids.shape
    m = cfg.vision.spatial_merge_size
    seg_ids = np.asarray(attention_mask).astype(np.int64)
    pos = np.zeros((3, b, s), np.int64)
    deltas = np.zeros((b,), np.int64)
    grids = iter([] if image_grid_thw is None else [tuple(int(x) for x in g) for g in image_grid_thw])
    for r in range(b):
        for seg in segments_in_order(seg_ids[r]):
            keep = np.nonzero(seg_ids[r] == seg)[0]
            out = _segment_positions(cfg, input_ids[r, keep], grids, m)
            pos[:, r, keep] = out
            deltas[r] = out.max() + 1 - len(keep)
    return pos.astype(np.int32), deltas.astype(np.int32)


def _segment_positions(cfg: ModelConfig, ids: np.ndarray, grids, m: int) -> np.ndarray:
    """[3, n] positions of one segment's tokens (padding removed), taking its images' grids from `grids`."""
    is_img = ids == cfg.image_token_id
    out = np.zeros((3, len(ids)), np.int64)
    cur, i = 0, 0
    while i < len(ids):
        j = i
        while j < len(ids) and is_img[j] == is_img[i]:
            j += 1
        if not is_img[i]:
            out[:, i:j] = cur + np.arange(j - i)
            cur += j - i
        else:
            t, gh, gw = next(grids)
            hh, ww = gh // m, gw // m
            tt, rr, cc = np.meshgrid(np.arange(t), np.arange(hh), np.arange(ww), indexing="ij")
            out[0, i:j] = cur + tt.ravel()
            out[1, i:j] = cur + rr.ravel()
            out[2, i:j] = cur + cc.ravel()
            cur += max(hh, ww)
        i = j
    return out


def mrope_axis_of_slot(cfg: ModelConfig) -> np.ndarray:
    """For each of the head_dim/2 frequency slots, which position axis (0 T, 1 H, 2 W) feeds it."""
    half = cfg.text.head_dim // 2
    _, s_h, s_w = cfg.text.mrope_section
    j = np.arange(half)
    axis = np.zeros(half, np.int32)
    axis[(j % 3 == 1) & (j < 3 * s_h)] = 1
    axis[(j % 3 == 2) & (j < 3 * s_w)] = 2
    return axis


def mrope_cos_sin(cfg: ModelConfig, positions: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """positions [3, B, S] → cos, sin [B, S, 1, head_dim] (float32 angles, cast to the compute dtype)."""
    inv_freq = torch_inv_freq(cfg.text.head_dim, cfg.text.rope_theta)        # [hd/2]
    axis = jnp.asarray(mrope_axis_of_slot(cfg))
    p = positions.astype(jnp.float32)                                         # [3, B, S]
    p_slot = jnp.take(p, axis, axis=0)                                        # [hd/2, B, S]
    phi = jnp.moveaxis(p_slot, 0, -1) * inv_freq                              # [B, S, hd/2]
    emb = jnp.concatenate([phi, phi], axis=-1)[:, :, None, :]
    return jnp.cos(emb).astype(dtype), jnp.sin(emb).astype(dtype)
