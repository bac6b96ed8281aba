"""Logits of `PrismaVL.forward` against transformers' Qwen3VLForConditionalGeneration on tiny random
checkpoints (float32), with the table zeroed and with a non-zero table + arbitrary codes (INTROSPECTION §3
implemented on the PyTorch side by a forward hook on the embedding)."""
import numpy as np
import pytest

from hf_tiny import (IMAGE, build_model, image_tokens, random_pixels, reference_logits, save_checkpoint,
                     tiny_hf_config)
from prisma_jax import PrismaVL

TOL = 1e-4


@pytest.fixture(scope="module")
def untied(tmp_path_factory):
    model = build_model(tiny_hf_config(deepstack=(0, 2)), seed=0)
    path = save_checkpoint(model, str(tmp_path_factory.mktemp("untied")))
    return model, PrismaVL.from_pretrained(path)


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    model = build_model(tiny_hf_config(tie=True, deepstack=(1,), rope_style="5.x"), seed=1)
    path = save_checkpoint(model, str(tmp_path_factory.mktemp("tied")))
    return model, PrismaVL.from_pretrained(path)


def _cmp(hf, ours, mask=None, **kw):
    ref = reference_logits(hf, mask=None, **kw) if False else reference_logits(hf, attention_mask=mask, **kw)
    out = np.asarray(ours.forward(kw["input_ids"], attention_mask=mask, pixel_values=kw.get("pixel_values"),
                                  image_grid_thw=kw.get("image_grid_thw"), codes_in=kw.get("codes_in")))
    assert out.shape == ref.shape
    if mask is not None:  # padded positions are not defined by either side
        ref, out = ref[np.asarray(mask, bool)], out[np.asarray(mask, bool)]
    err = np.abs(out - ref).max()
    assert err <= TOL, err
    return err


def test_text_only_batch(untied):
    ids = np.random.default_rng(0).integers(7, 128, (3, 11))
    assert _cmp(*untied, input_ids=ids) < 1e-5


def test_tied_head_text_only(tied):
    ids = np.random.default_rng(1).integers(7, 128, (2, 9))
    _, ours = tied
    assert "lm_head" not in ours.params
    assert _cmp(*tied, input_ids=ids) < 1e-5


def test_one_image(untied):
    grid = [[1, 4, 6]]
    ids = np.array([[10, 11, 12, *image_tokens((1, 4, 6)), 13, 14]])
    assert _cmp(*untied, input_ids=ids, pixel_values=random_pixels(grid), image_grid_thw=grid) < 1e-5


def test_two_images_of_different_grids_one_larger_than_the_position_table(untied):
    # the learned position grid is 8x8; 14x10 patches is larger (up-sampling), 4x6 smaller
    grids = [[1, 4, 6], [1, 14, 10]]
    ids = np.array([[10, *image_tokens((1, 4, 6)), 11, 12, *image_tokens((1, 14, 10)), 13]])
    assert _cmp(*untied, input_ids=ids, pixel_values=random_pixels(grids, 1), image_grid_thw=grids) < 1e-5


def test_left_padded_batch_with_images(untied):
    grids = [[1, 4, 4], [1, 6, 4], [1, 2, 2]]
    row0 = [10, 11, *image_tokens((1, 4, 4)), 12, *image_tokens((1, 2, 2)), 13]
    row1 = [20, *image_tokens((1, 6, 4)), 21, 22]
    s = max(len(row0), len(row1))
    ids = np.zeros((2, s), np.int64)
    mask = np.zeros((2, s), np.int64)
    for r, row in enumerate((row0, row1)):
        ids[r, s - len(row):] = row
        mask[r, s - len(row):] = 1
    # images are consumed in batch-row order: row 0 holds grids 0 and 2, row 1 grid 1
    grids_in_order = [grids[0], grids[2], grids[1]]
    pv = random_pixels(grids_in_order, 2)
    assert _cmp(*untied, mask=mask, input_ids=ids, pixel_values=pv, image_grid_thw=grids_in_order) < 1e-5


def test_deepstack_tied_single_index_with_image(tied):
    grid = [[1, 6, 6]]
    ids = np.array([[9, *image_tokens((1, 6, 6)), 30, 31]])
    assert _cmp(*tied, input_ids=ids, pixel_values=random_pixels(grid, 3), image_grid_thw=grid) < 1e-5


@pytest.mark.parametrize("n_bits", [8, 16])
def test_nonzero_table_and_arbitrary_codes(tmp_path, n_bits):
    hf = build_model(tiny_hf_config(deepstack=(0, 1)), seed=4)
    rng = np.random.default_rng(n_bits)
    table = rng.normal(0, 0.5, (2**n_bits, 64)).astype(np.float32)
    ours = PrismaVL.from_pretrained(save_checkpoint(hf, str(tmp_path), table=table))
    assert ours.config.n_bits == n_bits          # the table's row count decides
    grid = [[1, 4, 4]]
    ids = np.array([[10, 11, *image_tokens((1, 4, 4)), 12, 13, 14],
                    [0, 0, 20, 21, *image_tokens((1, 4, 4)), 22]])
    mask = (np.arange(ids.shape[1]) >= np.array([[0], [2]])).astype(np.int64)
    codes = rng.integers(-1, 2**n_bits, ids.shape)
    codes[ids == IMAGE] = rng.integers(0, 2**n_bits, int((ids == IMAGE).sum()))  # must be ignored there
    pv = random_pixels([grid[0], grid[0]], 5)
    grids = [grid[0], grid[0]]
    _cmp(hf, ours, mask=mask, input_ids=ids, pixel_values=pv, image_grid_thw=grids, table=table, codes_in=codes)
    # the default prompt rule: first real token none, neutral elsewhere
    from prisma_jax.nn.uncertainty import prompt_codes
    rule = prompt_codes(mask, n_bits)
    assert (rule[0, 0], rule[1, 2], rule[1, 1]) == (-1, -1, -1) and rule[0, 1] == 2 ** (n_bits - 1)
    ref = reference_logits(hf, ids, mask, pv, grids, table=table, codes_in=rule)
    out = np.asarray(ours.forward(ids, mask, pv, grids))
    m = mask.astype(bool)
    assert np.abs(ref[m] - out[m]).max() <= TOL


def test_bfloat16_params_close_to_float32(untied, tmp_path):
    hf, ours32 = untied
    ours16 = PrismaVL.from_pretrained(ours32.path, dtype="bfloat16")
    assert ours16.params["text"]["embed"]["embedding"].dtype.name == "bfloat16"
    grid = [[1, 4, 6]]
    ids = np.array([[10, 11, 12, *image_tokens((1, 4, 6)), 13, 14]])
    pv = random_pixels(grid)
    a = np.asarray(ours32.forward(ids, None, pv, grid), np.float32)
    b = np.asarray(ours16.forward(ids, None, pv, grid), np.float32)
    # measured 2026-11-29: max |Δ| = 0.0048 on logits with max |x| 0.55, std 0.16 (docs/design.md "Numerics"); 4x margin
    assert np.abs(a - b).max() < 0.02
    assert np.abs(a - b).max() > 0  # really ran in bf16


def test_frames_of_one_size_attend_per_frame(untied):
    """Equal frames run the vision attention as a batch of frames ([F, L, L]); that equals the block-diagonal
    [N, N] mask that frames of different sizes use (and transformers' per-frame attention, tested above)."""
    import dataclasses

    import jax

    from prisma_jax.nn.model import bind
    from prisma_jax.nn.vision import vision_geometry
    _, ours = untied
    cfg = ours.config.vision
    assert vision_geometry(cfg, np.array([[1, 4, 6], [1, 14, 10]])).frame_len == 0
    assert vision_geometry(cfg, np.array([[2, 4, 4], [1, 4, 4]])).frame_len == 16   # a 2-frame video + an image
    grids = np.array([[1, 4, 6], [2, 4, 6]])
    geo = vision_geometry(cfg, grids)
    assert geo.frame_len == 24
    pv = random_pixels(grids.tolist(), 7)
    run = jax.jit(lambda p, g: bind(ours.config, p).vision(pv, g))
    (m1, d1), (m0, d0) = run(ours.params, geo), run(ours.params, dataclasses.replace(geo, frame_len=0))
    assert np.abs(np.asarray(m1) - np.asarray(m0)).max() < 1e-5
    assert np.abs(np.asarray(d1) - np.asarray(d0)).max() < 1e-5
    assert np.abs(np.asarray(m1)).max() > 0.1
