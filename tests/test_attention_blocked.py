"""`prisma_jax.nn.attention_blocked.blocked_attention`: output and q/k/v gradients equal the "xla" attention's
(prisma_jax/nn/attention.py) and a float64 torch autograd re-derivation (GQA; causal `Mask`s with padding, packed
segments and an offset, or their dense form with `causal=True`; blocks that do not divide the sequence; a
bidirectional and a random mask), under jit; bad shapes are refused."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from prisma_jax.nn.mask import Mask, causal
from prisma_jax.nn.attention import attention
from prisma_jax.nn.attention_blocked import blocked_attention

B, S, H, KV, HD = 3, 40, 4, 2, 16


def inputs(seed=0):
    r = np.random.default_rng(seed)
    q, k, v, d_out = (r.standard_normal((B, S, n, HD)).astype(np.float32) for n in (H, KV, KV, H))
    return q, k, v, d_out


def segments():
    """Row 0 one sequence, row 1 right-padded, row 2 left-padded and then two packed conversations."""
    seg = np.ones((B, S), np.int32)
    seg[1, 29:] = 0
    seg[2, :7] = 0
    seg[2, 25:] = 2
    return jnp.asarray(seg)


def padding_mask():
    return causal(segments())


def xla(q, k, v, mask):
    return attention(q, k, v, mask, "xla")


def torch_reference(q, k, v, mask, d_out):
    """Output and (dq, dk, dv) of masked GQA softmax attention, float64 autograd."""
    qt, kt, vt = (torch.tensor(x, dtype=torch.float64, requires_grad=True) for x in (q, k, v))
    g = H // KV
    kr, vr = kt.repeat_interleave(g, dim=2), vt.repeat_interleave(g, dim=2)
    s = torch.einsum("bqhd,bshd->bhqs", qt, kr) / np.sqrt(HD)
    dense = mask.dense() if isinstance(mask, Mask) else mask
    s = s.masked_fill(~torch.tensor(np.asarray(dense))[:, None], torch.finfo(torch.float32).min)
    out = torch.einsum("bhqs,bshd->bqhd", torch.softmax(s, -1), vr)
    (out * torch.tensor(d_out, dtype=torch.float64)).sum().backward()
    return out.detach().numpy(), tuple(x.grad.numpy() for x in (qt, kt, vt))


def value_and_grads(fn, q, k, v, mask, d_out):
    def loss(q, k, v):                      # the mask is built in the trace, as the model does
        o = fn(q, k, v, mask())
        return (o * d_out).sum(), o
    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    return np.asarray(out), tuple(np.asarray(x) for x in grads)


MASKS = {
    "causal": padding_mask,
    "dense causal": lambda: padding_mask().dense(),
    "offset 5": lambda: Mask(segments(), segments(), 5),
    "bidirectional": lambda: Mask(segments(), segments(), None),
}


@pytest.mark.parametrize("block_q,block_k,mask_kind", [
    (16, 12, "causal"), (8, 40, "causal"), (128, 512, "causal"), (12, 7, "dense causal"), (16, 8, "offset 5"),
    (16, 16, "bidirectional"), (12, 7, "dense"), (None, None, "causal")])
def test_blocked_equals_xla_and_torch(block_q, block_k, mask_kind):
    q, k, v, d_out = inputs()
    mask = MASKS.get(mask_kind, lambda: padding_mask().dense())
    dense_causal = mask_kind == "dense causal"        # "dense": the same mask, every key block computed
    ref_out, ref_grads = torch_reference(q, k, v, mask(), d_out)
    ein_out, ein_grads = value_and_grads(xla, q, k, v, mask, d_out)
    out, grads = value_and_grads(
        lambda *a: blocked_attention(*a, block_q=block_q, block_k=block_k, causal=dense_causal), q, k, v, mask,
        d_out)
    np.testing.assert_allclose(out, ein_out, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out, ref_out, rtol=1e-5, atol=1e-5)
    for got, ein, ref in zip(grads, ein_grads, ref_grads):
        np.testing.assert_allclose(got, ein, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


def test_random_mask():
    """A dense mask without causality: a random one (each query sees itself, so no row is empty)."""
    q, k, v, d_out = inputs(1)
    r = np.random.default_rng(2)
    mask = (r.random((B, S, S)) < 0.4) | np.eye(S, dtype=bool)[None]
    ref_out, ref_grads = torch_reference(q, k, v, mask, d_out)
    out, grads = value_and_grads(lambda *a: blocked_attention(*a, block_q=16, block_k=16),
                                 q, k, v, lambda: jnp.asarray(mask), d_out)
    np.testing.assert_allclose(out, ref_out, rtol=1e-5, atol=1e-5)
    for got, ref in zip(grads, ref_grads):
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


def test_bad_input():
    q, k, v, _ = inputs()
    mask = padding_mask().dense()
    with pytest.raises(ValueError, match="mask"):
        blocked_attention(q, k, v, mask[:, :-1])
    with pytest.raises(ValueError, match="not a multiple"):
        blocked_attention(q[:, :, :3], k, v, mask)
    with pytest.raises(ValueError, match="block sizes"):
        blocked_attention(q, k, v, mask, block_q=0)
