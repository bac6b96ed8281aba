"""Host-side input checking and indexing: everything that can be wrong with user input is caught here, as a
`ValueError` naming the problem, before any device work (out-of-range gathers are silently clamped on device).

`prepare` turns transformers-style numpy inputs into a `model.Batch` (NumPy arrays): the M-RoPE positions,
the prompt-rule codes when none are given, and the vision geometry.
"""
from __future__ import annotations

import numpy as np

from prisma_jax.nn.mask import segments_in_order
from prisma_jax.core.config import ModelConfig
from prisma_jax.nn.model import Batch
from prisma_jax.nn.rope import rope_index
from prisma_jax.nn.uncertainty import prompt_codes
from prisma_jax.nn.vision import vision_geometry


def _int_array(x, name: str, ndim: int) -> np.ndarray:
    a = np.asarray(x)
    if a.dtype == object or not (np.issubdtype(a.dtype, np.integer) or a.dtype == bool):
        raise ValueError(f"{name} must be an integer array, got dtype {a.dtype}")
    if a.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {a.shape}")
    return a.astype(np.int64)


def check_grids(cfg: ModelConfig, pixel_values, image_grid_thw) -> tuple[np.ndarray | None, np.ndarray | None]:
    if (pixel_values is None) != (image_grid_thw is None):
        raise ValueError("pixel_values and image_grid_thw must be given together")
    if pixel_values is None:
        return None, None
    grid = _int_array(image_grid_thw, "image_grid_thw", 2)
    m = cfg.vision.spatial_merge_size
    if grid.shape[1] != 3 or len(grid) == 0:
        raise ValueError(f"image_grid_thw must have shape [N_images, 3], got {grid.shape}")
    for i, (t, h, w) in enumerate(grid):
        if t < 1 or h < m or w < m or h % m or w % m:
            raise ValueError(f"image_grid_thw[{i}] = {[int(t), int(h), int(w)]}: t must be ≥ 1 and h, w positive "
                             f"multiples of the merge size {m}")
    pv = np.asarray(pixel_values)
    if pv.ndim != 2 or not np.issubdtype(pv.dtype, np.floating) and pv.dtype.name != "bfloat16":
        raise ValueError(f"pixel_values must be a 2-D float array [N_patches, {cfg.vision.patch_dim}], "
                         f"got shape {pv.shape} dtype {pv.dtype}")
    n = int(np.sum(np.prod(grid, axis=1)))
    if pv.shape != (n, cfg.vision.patch_dim):
        raise ValueError(f"pixel_values has shape {pv.shape} but image_grid_thw needs "
                         f"({n}, {cfg.vision.patch_dim}) (sum of t·h·w rows of C·T·P·P values)")
    if not np.all(np.isfinite(pv if pv.dtype.kind == "f" else pv.astype(np.float32))):
        raise ValueError("pixel_values contains NaN or inf")
    return pv, grid


def prepare(cfg: ModelConfig, input_ids, attention_mask=None, pixel_values=None, image_grid_thw=None,
            codes_in=None, segments: bool = False) -> Batch:
    """`segments=True` (packed training rows, train/data.py): `attention_mask` holds int segment ids, 0 =
    padding, 1, 2, ... one per conversation, each a contiguous run; the batch's mask is then int32 segment ids
    and positions and prompt-rule codes restart in every segment. Otherwise it is 0/1 (or bool)."""
    ids = _int_array(input_ids, "input_ids", 2)
    b, s = ids.shape
    if b == 0 or s == 0:
        raise ValueError(f"input_ids must be non-empty, got shape {ids.shape}")
    v = cfg.text.vocab_size
    if ids.min() < 0 or ids.max() >= v:
        bad = ids[(ids < 0) | (ids >= v)][0]
        raise ValueError(f"input_ids contains {bad}, outside the vocabulary [0, {v})")
    if attention_mask is None:
        mask = np.ones_like(ids, dtype=bool)
    else:
        m = np.asarray(attention_mask)
        if m.shape != ids.shape:
            raise ValueError(f"attention_mask shape {m.shape} != input_ids shape {ids.shape}")
        if segments:
            mask = _segment_ids(m)
        elif not np.isin(m, (0, 1)).all():
            raise ValueError("attention_mask must contain only 0 and 1")
        else:
            mask = m.astype(bool)
    if (ids == cfg.video_token_id).any():
        raise ValueError(f"video placeholder tokens ({cfg.video_token_id}) are not supported")
    pv, grid = check_grids(cfg, pixel_values, image_grid_thw)
    is_img = ids == cfg.image_token_id
    if (is_img & (mask == 0)).any():
        raise ValueError("image placeholder tokens at padded positions (attention_mask 0)")
    _check_image_runs(cfg, is_img, mask, grid)

    if codes_in is None:
        codes = prompt_codes(mask, cfg.n_bits)
    else:
        codes = _int_array(codes_in, "codes_in", 2)
        if codes.shape != ids.shape:
            raise ValueError(f"codes_in shape {codes.shape} != input_ids shape {ids.shape}")
        if codes.min() < -1 or codes.max() >= cfg.n_levels:
            bad = codes[(codes < -1) | (codes >= cfg.n_levels)][0]
            raise ValueError(f"codes_in contains {bad}, outside [-1, {cfg.n_levels})")
        codes = codes.astype(np.int32)
    positions, _ = rope_index(cfg, ids, mask, grid)
    geo = None if grid is None else vision_geometry(cfg.vision, grid)
    return Batch(ids.astype(np.int32), mask, codes, positions,
                 None if pv is None else np.asarray(pv, np.float32) if pv.dtype != np.float32 else pv, geo)


def pad_rows(cfg: ModelConfig, batch: Batch, more: int, fill: int = 0) -> Batch:
    """`batch` (host arrays, from `prepare`) with `more` dummy rows appended, so that a mesh's batch shards split
    the rows evenly: text only, left-padded, one real token `fill` each (not a vision placeholder); callers drop
    their outputs. Packed pixel_values belong to the real rows and stay as they are."""
    if not more:
        return batch
    if fill in (cfg.image_token_id, cfg.video_token_id):
        raise ValueError(f"pad_rows: fill {fill} is a vision placeholder id")
    mask = np.zeros((more, batch.input_ids.shape[1]), bool)
    mask[:, -1] = True
    pad = prepare(cfg, np.full(mask.shape, fill, np.int64), mask)
    cat = lambda k, axis=0: np.concatenate([np.asarray(getattr(batch, k)), getattr(pad, k)], axis)  # noqa: E731
    return batch._replace(input_ids=cat("input_ids"), attention_mask=cat("attention_mask"), codes=cat("codes"),
                          positions=cat("positions", 1))


def _segment_ids(m) -> np.ndarray:
    """Packed rows' attention_mask → [B, S] int32 segment ids, checked: integers ≥ 0, each id one run per row."""
    if m.dtype == bool:
        return m.astype(np.int32)
    if not np.issubdtype(m.dtype, np.integer):
        raise ValueError(f"attention_mask of packed rows must hold integer segment ids, got dtype {m.dtype}")
    if m.min() < 0:
        raise ValueError(f"attention_mask segment ids must be ≥ 0 (0 = padding), got {int(m.min())}")
    for r, row in enumerate(m):
        starts = row[np.flatnonzero(np.diff(np.concatenate([[0], row])))]
        real = starts[starts > 0]
        if len(set(real.tolist())) != len(real):
            raise ValueError(f"attention_mask row {r}: each segment id must be one contiguous run, got "
                             f"runs of ids {real.tolist()}")
    return m.astype(np.int32)


def _check_image_runs(cfg: ModelConfig, is_img: np.ndarray, mask: np.ndarray, grid) -> None:
    """Each maximal run of image placeholders (within a segment, padding removed) is exactly one image's
    tokens."""
    m2 = cfg.vision.spatial_merge_size**2
    want = [] if grid is None else [int(t * h * w) // m2 for t, h, w in grid]
    runs = []
    for r in range(is_img.shape[0]):
        for seg in segments_in_order(mask[r]):
            row = is_img[r][mask[r] == seg].astype(np.int8)
            edges = np.flatnonzero(np.diff(np.concatenate([[0], row, [0]])))
            runs += list(edges[1::2] - edges[::2])
    if sum(runs) != sum(want):
        raise ValueError(f"{sum(runs)} image placeholder tokens in input_ids but image_grid_thw needs {sum(want)}")
    if runs != want:
        raise ValueError(f"image placeholder runs have lengths {runs} but image_grid_thw needs {want} "
                         "(one contiguous run per image, in order)")
