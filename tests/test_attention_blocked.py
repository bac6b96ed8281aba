"""`prisma_jax.attention_blocked.blocked_attention`: output and q/k/v gradients equal `layers.attention`'s and a
float64 torch autograd re-derivation (GQA, causal + padding masks from `model.attention_mask`, blocks that do
not divide the sequence, a non-causal mask), under jit; bad shapes are refused."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from prisma_jax.attention_blocked import blocked_attention
from prisma_jax.layers import attention
from prisma_jax.model import attention_mask

B, S, H, KV, HD = 3, 40, 4, 2, 16


def inputs(seed=0):
    r = np.random.default_rng(seed)
    q, k, v, d_out = (r.standard_normal((B, S, n, HD)).astype(np.float32) for n in (H, KV, KV, H))
    return q, k, v, d_out


def padding_mask():
    """Causal over each row's valid keys: row 0 full, row 1 right-padded, row 2 left-padded."""
    valid = np.ones((B, S), bool)
    valid[1, 29:] = False
    valid[2, :7] = False
    return attention_mask(jnp.asarray(valid), 0, S)


def torch_reference(q, k, v, mask, d_out):
    """Output and (dq, dk, dv) of masked GQA softmax attention, float64 autograd."""
    qt, kt, vt = (torch.tensor(x, dtype=torch.float64, requires_grad=True) for x in (q, k, v))
    g = H // KV
    kr, vr = kt.repeat_interleave(g, dim=2), vt.repeat_interleave(g, dim=2)
    s = torch.einsum("bqhd,bshd->bhqs", qt, kr) / np.sqrt(HD)
    s = s.masked_fill(~torch.tensor(np.asarray(mask))[:, None], torch.finfo(torch.float32).min)
    out = torch.einsum("bhqs,bshd->bqhd", torch.softmax(s, -1), vr)
    (out * torch.tensor(d_out, dtype=torch.float64)).sum().backward()
    return out.detach().numpy(), tuple(x.grad.numpy() for x in (qt, kt, vt))


def value_and_grads(fn, q, k, v, mask, d_out):
    def loss(q, k, v):
        o = fn(q, k, v, mask)
        return (o * d_out).sum(), o
    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    return np.asarray(out), tuple(np.asarray(x) for x in grads)


@pytest.mark.parametrize("block_q,block_k,causal", [(16, 12, True), (8, 40, True), (128, 512, True),
                                                    (12, 7, False)])
def test_blocked_equals_einsum_and_torch(block_q, block_k, causal):
    q, k, v, d_out = inputs()
    mask = padding_mask()
    ref_out, ref_grads = torch_reference(q, k, v, mask, d_out)
    ein_out, ein_grads = value_and_grads(attention, q, k, v, mask, d_out)
    out, grads = value_and_grads(
        lambda *a: blocked_attention(*a, block_q=block_q, block_k=block_k, causal=causal), q, k, v, mask, d_out)
    np.testing.assert_allclose(out, ein_out, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out, ref_out, rtol=1e-5, atol=1e-5)
    for got, ein, ref in zip(grads, ein_grads, ref_grads):
        np.testing.assert_allclose(got, ein, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


def test_non_causal_mask():
    """causal=False takes any mask: a random one (each query sees itself, so no row is empty)."""
    q, k, v, d_out = inputs(1)
    r = np.random.default_rng(2)
    mask = (r.random((B, S, S)) < 0.4) | np.eye(S, dtype=bool)[None]
    ref_out, ref_grads = torch_reference(q, k, v, mask, d_out)
    out, grads = value_and_grads(lambda *a: blocked_attention(*a, block_q=16, block_k=16, causal=False),
                                 q, k, v, jnp.asarray(mask), d_out)
    np.testing.assert_allclose(out, ref_out, rtol=1e-5, atol=1e-5)
    for got, ref in zip(grads, ref_grads):
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


def test_bad_input():
    q, k, v, _ = inputs()
    mask = padding_mask()
    with pytest.raises(ValueError, match="mask"):
        blocked_attention(q, k, v, mask[:, :-1])
    with pytest.raises(ValueError, match="not a multiple"):
        blocked_attention(q[:, :, :3], k, v, mask)
    with pytest.raises(ValueError, match="block sizes"):
        blocked_attention(q, k, v, mask, block_q=0)
