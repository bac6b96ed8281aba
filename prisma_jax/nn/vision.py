"""The Qwen3-VL vision tower (QWEN3_VL.md §3): patch embedding, resampled position embedding, 2-D rotary,
per-frame attention, blocks run by `lax.scan`, the patch merger and the DeepStack mergers.

`vision_geometry` runs on the host (NumPy) from `image_grid_thw` alone and produces every index the device
needs (bilinear taps and weights, rotary row/col ids, frame segment ids); `VisionTower` is the jitted math (Flax NNX modules).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from prisma_jax.core.config import VisionConfig
from prisma_jax.nn.mask import Mask
from prisma_jax.nn.attention import attention
from prisma_jax.nn.layers import Dense, Embed, LayerNorm, apply_rope, layer_slices, stacked, torch_inv_freq
from prisma_jax.nn.lora import adapter


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class VisionGeometry:
    """Per-patch host-computed indices for the packed `pixel_values` rows (block-major order, §3.1).
    A pytree: the arrays are its leaves, `frame_len` is static (part of the jitted program's signature)."""
    pos_idx: np.ndarray   # [4, N] int32 rows of the learned position table (bilinear taps)
    pos_w: np.ndarray     # [4, N] float32 tap weights
    rows: np.ndarray      # [N] int32 patch row (vision rotary)
    cols: np.ndarray      # [N] int32 patch column
    segment: np.ndarray   # [N] int32 frame id: attention is full within a frame, zero across
    # patches per frame when every frame has the same number (then attention runs per frame, [F, L, L],
    # instead of over all N patches with a block-diagonal [N, N] mask); 0 when the frames differ
    frame_len: int = dataclasses.field(default=0, metadata={"static": True})


def vision_geometry(cfg: VisionConfig, image_grid_thw: np.ndarray) -> VisionGeometry:
    """The geometry of these grids (cached: a training run or a generation bucket asks for the same grids
    every batch). Its arrays are read-only."""
    return _geometry(cfg, tuple(tuple(g) for g in np.asarray(image_grid_thw, np.int64).tolist()))


@functools.lru_cache(maxsize=32)
def _geometry(cfg: VisionConfig, grids: tuple) -> VisionGeometry:
    m, s = cfg.spatial_merge_size, cfg.pos_grid
    parts: list[tuple] = []
    seg = 0
    sizes = {gh * gw for _, gh, gw in grids}
    for t, gh, gw in grids:
        # patch (r, c) in merge-block-major order: (block row, block col, inner row, inner col)
        br, bc, ir, ic = np.meshgrid(np.arange(gh // m), np.arange(gw // m), np.arange(m), np.arange(m),
                                     indexing="ij")
        r = (br * m + ir).ravel()
        c = (bc * m + ic).ravel()
        y = _coords(r, gh, s)
        x = _coords(c, gw, s)
        y0, x0 = np.floor(y).astype(np.int64), np.floor(x).astype(np.int64)
        y1, x1 = np.minimum(y0 + 1, s - 1), np.minimum(x0 + 1, s - 1)
        dy, dx = (y - y0).astype(np.float32), (x - x0).astype(np.float32)
        one = np.float32(1)
        idx = np.stack([y0 * s + x0, y0 * s + x1, y1 * s + x0, y1 * s + x1])
        w = np.stack([(one - dy) * (one - dx), (one - dy) * dx, dy * (one - dx), dy * dx])
        for _ in range(int(t)):
            parts.append((idx, w, r, c, np.full(r.shape, seg)))
            seg += 1
    cat = lambda i, dt: np.concatenate([p[i] for p in parts], axis=-1).astype(dt)  # noqa: E731
    arrays = [cat(0, np.int32), cat(1, np.float32), cat(2, np.int32), cat(3, np.int32), cat(4, np.int32)]
    for a in arrays:
        a.flags.writeable = False
    return VisionGeometry(*arrays, frame_len=sizes.pop() if len(sizes) == 1 else 0)


def tile_geometry(geo: VisionGeometry, n: int) -> VisionGeometry:
    """The geometry of `n` copies of `geo`'s patches one after another (frames renumbered): one row's image
    slots → a batch of rows (traceable; model.embed's per-row layout)."""
    if n == 1:
        return geo
    seg = jnp.asarray(geo.segment)
    frames = seg[-1] + 1                       # frame ids run 0 … F−1 in order (`_geometry`)
    return VisionGeometry(jnp.tile(geo.pos_idx, (1, n)), jnp.tile(geo.pos_w, (1, n)), jnp.tile(geo.rows, n),
                          jnp.tile(geo.cols, n), (seg[None] + frames * jnp.arange(n)[:, None]).reshape(-1),
                          frame_len=geo.frame_len)


def _coords(i: np.ndarray, n: int, s: int) -> np.ndarray:
    """align_corners=True source coordinate of output index i (of n) on a grid of s, float32 as torch."""
    if n == 1:
        return np.zeros(i.shape, np.float32)
    return (i.astype(np.float32) * np.float32(s - 1)) / np.float32(n - 1)


class VisionAttention(nnx.Module):
    def __init__(self, cfg: VisionConfig, *, attention: str = "auto", lora=None, rngs: nnx.Rngs):
        d = cfg.hidden_size
        self.cfg = cfg
        self.impl = attention
        self.qkv = Dense(d, 3 * d, ("hidden", "mlp"), lora=adapter(lora, "qkv"), rngs=rngs)
        self.proj = Dense(d, d, ("mlp", "hidden"), lora=adapter(lora, "proj"), rngs=rngs)

    def __call__(self, h, cos, sin, mask):
        cfg = self.cfg
        n, d = h.shape
        hd = cfg.head_dim
        qkv = self.qkv(h).reshape(n, 3, cfg.num_heads, hd)
        q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]
        q = apply_rope(q.astype(jnp.float32), cos, sin).astype(h.dtype)
        k = apply_rope(k.astype(jnp.float32), cos, sin).astype(h.dtype)
        # mask segments [N/L, L]: frames of one size attend as a batch of N/L frames of L patches
        # (L = N: one row whose segment ids are the frames)
        ln = mask.q_segment.shape[-1]
        q, k, v = (a.reshape(n // ln, ln, cfg.num_heads, hd) for a in (q, k, v))
        return self.proj(attention(q, k, v, mask, self.impl, "frames").reshape(n, d))


class VisionMLP(nnx.Module):
    def __init__(self, cfg: VisionConfig, *, lora=None, rngs: nnx.Rngs):
        d, f = cfg.hidden_size, cfg.intermediate_size
        self.fc1 = Dense(d, f, ("hidden", "mlp"), lora=adapter(lora, "fc1"), rngs=rngs)
        self.fc2 = Dense(f, d, ("mlp", "hidden"), lora=adapter(lora, "fc2"), rngs=rngs)

    def __call__(self, h):
        return self.fc2(jax.nn.gelu(self.fc1(h), approximate=True))


class VisionBlock(nnx.Module):
    def __init__(self, cfg: VisionConfig, *, attention: str = "auto", lora=None, rngs: nnx.Rngs):
        self.norm1 = LayerNorm(cfg.hidden_size, cfg.layer_norm_eps, rngs=rngs)
        self.attn = VisionAttention(cfg, attention=attention, lora=lora, rngs=rngs)
        self.norm2 = LayerNorm(cfg.hidden_size, cfg.layer_norm_eps, rngs=rngs)
        self.mlp = VisionMLP(cfg, lora=lora, rngs=rngs)

    def __call__(self, x, cos, sin, mask):
        x = x + self.attn(self.norm1(x), cos, sin, mask)
        return x + self.mlp(self.norm2(x))


class Merger(nnx.Module):
    """2×2 patch merger. The final one (`norm_first`) normalises over Dv before the shuffle; the DeepStack
    mergers shuffle first and normalise over 4·Dv."""

    def __init__(self, cfg: VisionConfig, norm_first: bool, *, rngs: nnx.Rngs):
        md = cfg.hidden_size * cfg.spatial_merge_size**2
        self.norm_first = norm_first
        self.m2 = cfg.spatial_merge_size**2
        self.norm = LayerNorm(cfg.hidden_size if norm_first else md, cfg.layer_norm_eps, rngs=rngs)
        self.fc1 = Dense(md, md, ("hidden", "mlp"), rngs=rngs)
        self.fc2 = Dense(md, cfg.out_hidden_size, ("mlp", "hidden"), rngs=rngs)

    def __call__(self, x):
        m2 = self.m2
        if self.norm_first:
            x = self.norm(x).reshape(-1, m2 * x.shape[-1])
        else:
            x = self.norm(x.reshape(-1, m2 * x.shape[-1]))
        return self.fc2(jax.nn.gelu(self.fc1(x), approximate=False))


class VisionTower(nnx.Module):
    """pixel_values [N, C·T·P·P] → merged features [N/m², D] and DeepStack features [n_ds, N/m², D]."""

    def __init__(self, cfg: VisionConfig, *, attention: str = "auto", lora=None, rngs: nnx.Rngs):
        dv = cfg.hidden_size
        self.cfg = cfg
        self.patch_embed = Dense(cfg.patch_dim, dv, (None, "hidden"), rngs=rngs)
        self.pos_embed = Embed(cfg.num_position_embeddings, dv, (None, "hidden"), rngs=rngs)
        self.blocks = stacked(cfg.depth, lambda r: VisionBlock(cfg, attention=attention, lora=lora, rngs=r), rngs)
        self.merger = Merger(cfg, True, rngs=rngs)
        self.deepstack = stacked(len(cfg.deepstack_visual_indexes), lambda r: Merger(cfg, False, rngs=r), rngs)

    def __call__(self, pixel_values: jax.Array, geo: VisionGeometry, remat: bool = False):
        cfg = self.cfg
        dtype = self.patch_embed.kernel[...].dtype
        x = self.patch_embed(pixel_values.astype(dtype))
        table = self.pos_embed.embedding[...].astype(jnp.float32)
        taps = jnp.take(table, geo.pos_idx, axis=0) * geo.pos_w[..., None]        # [4, N, Dv] float32
        x = x + (((taps[0] + taps[1]) + taps[2]) + taps[3]).astype(dtype)

        inv = torch_inv_freq(cfg.head_dim // 2, cfg.rope_theta)                   # [hd/4]
        phi = jnp.concatenate([geo.rows[:, None] * inv, geo.cols[:, None] * inv], axis=-1).astype(jnp.float32)
        emb = jnp.concatenate([phi, phi], axis=-1)[:, None, :]                      # [N, 1, hd]
        cos, sin = jnp.cos(emb), jnp.sin(emb)
        if geo.frame_len:
            seg = jnp.ones((x.shape[0] // geo.frame_len, geo.frame_len), jnp.int32)
        else:
            seg = jnp.asarray(geo.segment, jnp.int32)[None] + 1
        mask = Mask(seg, seg, None)                                                # full within a frame

        taps_out, start = [], 0
        stops = [(i + 1, j) for j, i in enumerate(cfg.deepstack_visual_indexes)] + [(cfg.depth, None)]
        for end, tap in stops:   # scan the blocks between DeepStack taps; tap j reads block i's output
            if end > start:
                graphdef, state = layer_slices(self.blocks, start, end)

                def body(x, st, graphdef=graphdef):
                    return nnx.merge(graphdef, st)(x, cos, sin, mask), None

                x, _ = jax.lax.scan(jax.checkpoint(body) if remat else body, x, state)
            if tap is not None:
                graphdef, state = nnx.split(self.deepstack)
                taps_out.append(nnx.merge(graphdef, jax.tree.map(lambda a: a[tap], state))(x))
            start = end
        merged = self.merger(x)
        deep = jnp.stack(taps_out) if taps_out else jnp.zeros((0,) + merged.shape, merged.dtype)
        return merged, deep
