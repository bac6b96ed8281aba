"""docs/introspection-contract.md §2: the code function against a float64 NumPy re-derivation."""
import math

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from prisma_jax.nn.uncertainty import Uncertainty, codes_from_logits, entropy, prompt_codes, shift_codes


def ref_entropy64(z):
    """float64, straight from the definition: H = logsumexp(z) − Σ softmax(z)·z, −inf entries dropped."""
    z = np.asarray(z, np.float64)
    out = np.empty(z.shape[:-1])
    for idx in np.ndindex(out.shape):
        row = z[idx]
        row = row[np.isfinite(row)]
        m = row.max()
        p = np.exp(row - m)
        s = p.sum()
        out[idx] = (m + math.log(s)) - (p * row).sum() / s
    return out


def logit_cases(v, rng):
    yield "random", rng.normal(0, 3, (6, v))
    one_hot = np.full((4, v), -30.0)
    one_hot[np.arange(4), rng.integers(0, v, 4)] = 30.0
    yield "near-one-hot", one_hot
    yield "uniform", np.zeros((3, v))
    yield "huge", rng.normal(0, 1, (4, v)) * 1e30
    part = rng.normal(0, 2, (5, v))
    part[:, : v // 2] = -np.inf
    part[0, :-1] = -np.inf   # a single finite logit
    yield "partly -inf", part
    yield "sharp", rng.normal(0, 40, (4, v))


@pytest.mark.parametrize("n_bits", [16, 8])
@pytest.mark.parametrize("v", [1000, 151936])
def test_codes_match_float64_reference(n_bits, v):
    rng = np.random.default_rng(v + n_bits)
    levels = 2**n_bits
    for name, z in logit_cases(v, rng):
        z32 = z.astype(np.float32)
        got = np.asarray(codes_from_logits(jnp.asarray(z32), n_bits))
        assert got.dtype == np.uint16, name
        h = ref_entropy64(z32) / math.log(v)
        x = np.clip(h, 0, 1) * (levels - 1)
        want = np.floor(x).astype(np.int64)
        diff = np.abs(got.astype(np.int64) - want)
        # ±1 allowed only where float64 puts the value within 1e-6 of a level boundary
        near = np.abs(x - np.round(x)) <= 1e-6 * (levels - 1)
        assert np.all((diff == 0) | ((diff == 1) & near)), (name, got, want)
        assert np.all(got <= levels - 1)
        assert np.isfinite(np.asarray(entropy(jnp.asarray(z32)))).all(), name


def test_uniform_is_top_code_and_one_hot_is_zero():
    v = 512
    assert int(codes_from_logits(jnp.zeros((v,)), 16)) == 65535
    z = np.full((v,), -np.inf, np.float32)
    z[3] = 1.0
    assert int(codes_from_logits(jnp.asarray(z), 16)) == 0


def test_inject_skips_none_and_placeholders():
    table = np.arange(4 * 3, dtype=np.float32).reshape(4, 3) + 1
    emb = np.zeros((1, 4, 3), np.float32)
    ids = np.array([[10, 5, 11, 6]])           # 5 image, 6 video placeholder
    codes = np.array([[2, 1, -1, 3]])
    u = Uncertainty(4, 3, (5, 6), rngs=nnx.Rngs(0))
    u.embedding[...] = jnp.asarray(table)
    out = np.asarray(u(jnp.asarray(emb), jnp.asarray(ids), jnp.asarray(codes)))
    np.testing.assert_array_equal(out[0, 0], table[2])
    np.testing.assert_array_equal(out[0, 1:], 0)


def test_prompt_rule_left_padded():
    mask = np.array([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0]])
    got = prompt_codes(mask, 16)
    np.testing.assert_array_equal(got, [[-1, -1, -1, 32768, 32768],
                                        [-1, 32768, 32768, 32768, 32768],
                                        [-1, -1, -1, -1, -1]])


def test_teacher_forcing_shift():
    base = np.array([[-1, 128, 128, 128, 128]])
    prev = np.array([[7, 8, 9, 10, 11]], np.uint16)
    sup = np.array([[False, True, True, False, True]])  # labels at positions 1, 2, 4 are targets
    got = np.asarray(shift_codes(jnp.asarray(base), jnp.asarray(prev), jnp.asarray(sup)))
    np.testing.assert_array_equal(got, [[-1, 128, 8, 9, 128]])
