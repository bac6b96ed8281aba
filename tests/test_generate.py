"""`PrismaVL.generate` against independent references: the same model's full forward recompute (KV cache
parity), a sequential PyTorch greedy loop (tests/gen_reference.py), and each row generated alone."""
import json
import os

import numpy as np
import pytest

from gen_reference import reference_greedy
from hf_tiny import IMAGE, VIDEO, build_model, image_tokens, random_pixels, save_checkpoint, tiny_hf_config
from prisma_jax import PrismaVL
from prisma_jax.nn.uncertainty import prompt_codes

BITS = 16
STEPS = 16
GRID = (1, 4, 6)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    hf = build_model(tiny_hf_config(deepstack=(0, 2)), seed=3)
    # a large table, so that a wrong code changes the next tokens
    table = np.random.default_rng(1).normal(0, 0.5, (2**BITS, 64)).astype(np.float32)
    path = save_checkpoint(hf, str(tmp_path_factory.mktemp("gen")), table=table)
    return hf, table, PrismaVL.from_pretrained(path)


def _prompts():
    """Prompts whose greedy continuations never produce a vision placeholder (which a full-recompute reference
    could not feed back): fixed here, checked in the tests."""
    rng = np.random.default_rng(0)
    text = [list(rng.integers(7, 128, n)) for n in (9, 4, 13)]
    img = [[20, 21, *image_tokens(GRID), 22], [30, *image_tokens(GRID), 31, 32, 33, 34]]
    return text, img


def _left_pad(rows, pad=0):
    s = max(len(r) for r in rows)
    ids = np.full((len(rows), s), pad, np.int64)
    mask = np.zeros((len(rows), s), np.int64)
    for i, r in enumerate(rows):
        ids[i, s - len(r):], mask[i, s - len(r):] = r, 1
    return ids, mask


def _no_placeholders(tokens):
    assert not np.isin(tokens, [IMAGE, VIDEO]).any(), "pick another prompt: a placeholder was generated"


def _check_codes(ours, ref_codes, ref_x):
    diff = ours.astype(np.int64) - ref_codes
    boundary = np.abs(ref_x - np.round(ref_x)) < 0.05
    assert np.all((diff == 0) | ((np.abs(diff) == 1) & boundary)), (ours, ref_codes)


@pytest.fixture(scope="module")
def mixed(models):
    """A left-padded batch of text and image rows, generated once (shared by the tests below)."""
    _, _, m = models
    text, img = _prompts()
    rows = [text[0], img[0], text[1], img[1], text[2]]
    ids, mask = _left_pad(rows)
    pv = random_pixels([GRID, GRID], seed=5)
    r = m.generate(ids, mask, pv, [GRID, GRID], max_new_tokens=STEPS, return_logits=True,
                   return_entropies=True)
    return rows, ids, mask, pv, r


@pytest.mark.parametrize("unroll", [True, False], ids=["unrolled-layers", "scanned-layers"])
def test_kv_cached_decode_equals_full_recompute(models, mixed, unroll):
    """Both decode layer layouts (text.py): unrolled (the CPU default, as `mixed` ran) and scanned."""
    _, _, m = models
    rows, ids, mask, pv, r = mixed
    if not unroll:
        r = m.generate(ids, mask, pv, [GRID, GRID], max_new_tokens=STEPS, return_logits=True, unroll_layers=False)
    assert r.logits.shape == (5, STEPS, 128) and r.lengths.tolist() == [STEPS] * 5
    # the whole sequence (prompt + generated tokens, each with the code it was fed with) in one forward
    seq = np.concatenate([ids, r.tokens], axis=1)
    full_mask = np.concatenate([mask, np.ones_like(r.tokens)], axis=1)
    codes = np.concatenate([prompt_codes(mask, BITS), r.codes.astype(np.int32)], axis=1)
    full = np.asarray(m.forward(seq, full_mask, pv, [GRID, GRID], codes_in=codes))
    s = ids.shape[1]
    np.testing.assert_allclose(r.logits, full[:, s - 1:s - 1 + STEPS], atol=1e-4, rtol=0)


@pytest.mark.parametrize("kind", ["text", "image"])
def test_greedy_equals_sequential_pytorch_reference(models, kind):
    hf, table, m = models
    text, img = _prompts()
    prompt = text[2] if kind == "text" else img[0]
    kw = dict(pixel_values=random_pixels([GRID], seed=2), image_grid_thw=[GRID]) if kind == "image" else {}
    r = m.generate(np.array([prompt]), max_new_tokens=STEPS, return_entropies=True, **kw)
    assert r.tokens.shape == (1, STEPS) and r.codes.dtype == np.uint16 and r.lengths.tolist() == [STEPS]
    _no_placeholders(r.tokens)
    ref_t, ref_c, ref_x = reference_greedy(hf, prompt, STEPS, table, BITS, **kw)
    np.testing.assert_array_equal(r.tokens[0], ref_t)
    _check_codes(r.codes[0], ref_c, ref_x)
    # the reported entropy is the one the code was made from
    h = np.clip(r.entropies[0] / np.log(128), 0, 1) * (2**BITS - 1)
    assert np.all(np.abs(h - ref_x) < 0.5)


def _agree_until_a_boundary(a, i, b, j):
    """Row i of result `a` against row j of result `b` (the same prompt in another batch): the same tokens,
    codes and logits (≤ 1e-5) at every step, until a step whose code differs by one where the entropy lies
    on a level boundary (float32 round-off of a differently shaped matmul may land either side; from there on
    the two runs feed different codes and legitimately part). Returns how many steps agreed exactly."""
    x = np.clip(b.entropies[j] / np.log(b.logits.shape[-1]), 0, 1) * (2**BITS - 1)
    for t in range(STEPS):
        np.testing.assert_allclose(a.logits[i, t], b.logits[j, t], atol=1e-5, rtol=0)
        if a.codes[i, t] != b.codes[j, t]:
            assert abs(int(a.codes[i, t]) - int(b.codes[j, t])) == 1, (i, t)
            assert abs(x[t] - np.round(x[t])) < 0.05, (i, t, x[t])
            return t
        assert a.tokens[i, t] == b.tokens[j, t], (i, t)
    return STEPS


def test_batch_rows_generate_what_they_generate_alone(models, mixed):
    _, _, m = models
    rows, _, _, pv, batch = mixed
    out = dict(max_new_tokens=STEPS, return_logits=True, return_entropies=True)
    half = pv.shape[0] // 2
    k, agreed = 0, []
    for i, row in enumerate(rows):
        kw = {}
        if IMAGE in row:
            kw = dict(pixel_values=pv[k * half:(k + 1) * half], image_grid_thw=[GRID])
            k += 1
        alone = m.generate(np.array([row]), **out, **kw)
        _no_placeholders(alone.tokens)
        agreed.append(_agree_until_a_boundary(batch, i, alone, 0))
    # a text-only batch as well (no vision tower in the program)
    text, _ = _prompts()
    only_text = m.generate(*_left_pad(text), **out)
    agreed += [_agree_until_a_boundary(batch, i, only_text, j) for j, i in enumerate([0, 2, 4])]
    assert sum(agreed) >= STEPS * len(agreed) // 2, agreed  # boundaries are rare: most steps are compared


def test_per_row_end_tokens_and_stop_when_all_done(models):
    _, _, m = models
    text, _ = _prompts()
    ids, mask = _left_pad(text)
    free = m.generate(ids, mask, max_new_tokens=STEPS)
    # end row 0 at its 3rd token and row 2 at its 6th: row 1 runs on unless it meets one of them first
    eos = [int(free.tokens[0, 2]), int(free.tokens[2, 5])]
    r = m.generate(ids, mask, max_new_tokens=STEPS, eos_token_id=eos, pad_token_id=0)
    for i in range(3):
        hit = np.flatnonzero(np.isin(free.tokens[i], eos))
        n = int(hit[0]) + 1 if len(hit) else STEPS
        assert r.lengths[i] == n
        np.testing.assert_array_equal(r.tokens[i, :n], free.tokens[i, :n])
        np.testing.assert_array_equal(r.codes[i, :n], free.codes[i, :n])
        assert (r.tokens[i, n:] == 0).all() and (r.codes[i, n:] == 0).all()
    assert r.tokens.shape[1] == r.lengths.max()
    # a single end token that every row hits early: the loop stops at the longest row
    first = [int(t[0]) for t in free.tokens]
    r1 = m.generate(ids, mask, max_new_tokens=STEPS, eos_token_id=first)
    assert r1.lengths.tolist() == [1, 1, 1] and r1.tokens.shape == (3, 1)


def test_eos_defaults_to_the_checkpoints_generation_config(models, tmp_path):
    hf, table, _ = models
    text, _ = _prompts()
    free = models[2].generate(np.array([text[0]]), max_new_tokens=STEPS)
    path = save_checkpoint(hf, str(tmp_path / "ck"), table=table)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [int(free.tokens[0, 3]), 127], "pad_token_id": 1}, f)
    r = PrismaVL.from_pretrained(path).generate(np.array([text[0]]), max_new_tokens=STEPS)
    n = int(np.flatnonzero(np.isin(free.tokens[0], [int(free.tokens[0, 3]), 127]))[0]) + 1
    assert r.lengths.tolist() == [n]


def test_carried_code_is_uint16(models):
    import jax

    from prisma_jax.infer import generate as G
    _, _, m = models
    batch = m.prepare(np.array([[10, 11, 12]]))
    spec = G.Spec(new_bucket=4)
    sp = G.SamplingParams(np.float32(0), np.int32(0), np.float32(1), np.float32(0))
    args = (np.array([3], np.int32), sp, np.array([-1] * 4, np.int32), np.int32(0), jax.random.key(0))
    state = jax.eval_shape(lambda p, b: G.prefill(m.config, spec, p, b, *args), m.params, batch)
    assert state.state.code.dtype == np.uint16 and state.state.code.shape == (1,) and state.codes.dtype == np.uint16
    out = jax.eval_shape(lambda p, s: G.decode(m.config, spec, p, s, sp, args[2], args[3], np.int32(4)),
                         m.params, state)
    assert out.state.code.dtype == np.uint16
