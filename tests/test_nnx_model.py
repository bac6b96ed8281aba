"""The Flax NNX module is the model: called eagerly it gives the jitted functional forward's logits, its params
are today's plain dict (checkpoint layout), and module ↔ dict round trips change no logit."""
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hf_tiny import IMAGE, VEND, VSTART
from prisma_jax import PrismaVL
from prisma_jax.core.config import load_config
from prisma_jax.nn.model import PrismaVLModule, bind, to_params
from prisma_jax.core.trees import flatten
from prisma_jax.nn.params import param_shapes
from prisma_jax.nn.uncertainty import fresh_table

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CFG = load_config(os.path.join(ROOT, "configs", "tiny.yaml"))


def inputs(model: PrismaVL):
    """A text row and a row with one 32×64 image (grid 1×2×4 → 2 image tokens), their codes, on the host."""
    rng = np.random.default_rng(0)
    ids = rng.integers(7, CFG.text.vocab_size, (2, 10))
    ids[1, 2:6] = [VSTART, IMAGE, IMAGE, VEND]
    grid = np.array([[1, 2, 4]])
    pixels = rng.standard_normal((8, CFG.vision.patch_dim)).astype(np.float32)
    codes = rng.integers(-1, CFG.n_levels, (2, 10))
    return model.prepare(ids, pixel_values=pixels, image_grid_thw=grid, codes_in=codes)


def test_eager_module_equals_the_jitted_functional_forward():
    module = PrismaVLModule(CFG, rngs=nnx.Rngs(params=0, table=0))
    model = PrismaVL(CFG, to_params(module))
    b = inputs(model)
    eager = module(jnp.asarray(b.input_ids), jnp.asarray(b.attention_mask), jnp.asarray(b.positions),
                   codes_in=jnp.asarray(b.codes), pixel_values=jnp.asarray(b.pixel_values), geometry=b.geometry)
    jitted = model.forward(b.input_ids, pixel_values=b.pixel_values, image_grid_thw=np.array([[1, 2, 4]]),
                           codes_in=b.codes)
    assert eager.shape == (2, 10, CFG.text.vocab_size) and float(jnp.abs(eager).max()) > 0.1
    np.testing.assert_allclose(np.asarray(eager), np.asarray(jitted), atol=2e-6, rtol=0)
    # the codes are data: other codes, other logits, and nothing in the module remembers them
    other = module(jnp.asarray(b.input_ids), jnp.asarray(b.attention_mask), jnp.asarray(b.positions),
                   codes_in=jnp.asarray(b.codes) * 0 + 3, pixel_values=jnp.asarray(b.pixel_values),
                   geometry=b.geometry)
    assert float(jnp.abs(other - eager).max()) > 1e-3
    again = module(jnp.asarray(b.input_ids), jnp.asarray(b.attention_mask), jnp.asarray(b.positions),
                   codes_in=jnp.asarray(b.codes), pixel_values=jnp.asarray(b.pixel_values), geometry=b.geometry)
    np.testing.assert_array_equal(np.asarray(again), np.asarray(eager))


def test_module_dict_round_trip_gives_identical_logits():
    module = PrismaVLModule(CFG, rngs=nnx.Rngs(params=1, table=1))
    graphdef, state = nnx.split(module)
    params = nnx.to_pure_dict(state)
    assert {p: tuple(a.shape) for p, a in flatten(params)} == dict(flatten(param_shapes(CFG)))
    assert all(a.dtype == jnp.float32 for a in jax.tree.leaves(params))
    np.testing.assert_array_equal(np.asarray(params["uncertainty"]["embedding"]), np.asarray(fresh_table(1, (256, 64))))

    fresh = nnx.eval_shape(lambda: PrismaVLModule(CFG, rngs=nnx.Rngs(0)))
    g2, s2 = nnx.split(fresh)
    nnx.replace_by_pure_dict(s2, jax.tree.map(lambda x: x + 0, params))
    merged = nnx.merge(g2, s2)
    b = inputs(PrismaVL(CFG, params))
    args = (jnp.asarray(b.input_ids), jnp.asarray(b.attention_mask), jnp.asarray(b.positions))
    kw = dict(codes_in=jnp.asarray(b.codes), pixel_values=jnp.asarray(b.pixel_values), geometry=b.geometry)
    run = jax.jit(lambda gd, st: nnx.merge(gd, st)(*args, **kw))
    want = run(graphdef, state)
    np.testing.assert_array_equal(np.asarray(run(g2, nnx.state(merged))), np.asarray(want))
    np.testing.assert_array_equal(np.asarray(jax.jit(lambda p: bind(CFG, p)(*args, **kw))(params)), np.asarray(want))


def dot_lhs_ranks(fn, *args) -> list[int]:
    """The rank of the left operand of each dot in `fn`'s jaxpr: 2 when one token axis reaches the matmul."""
    return [e.invars[0].aval.ndim for e in jax.make_jaxpr(fn)(*args).eqns if e.primitive.name == "dot_general"]


def test_token_matmul_merges_the_token_axes_on_cpu_and_equals_the_einsum():
    """`token_matmul` (every Dense and the tied head): on the CPU one contraction over a merged token axis, with
    the values and gradients of the plain einsum (numpy in float64 as the reference)."""
    from prisma_jax.nn.layers import token_matmul
    rng = np.random.default_rng(0)
    for shape, rhs in (((2, 3, 8), "io"), ((2, 3, 4, 8), "oi"), ((0, 5, 8), "io"), ((6, 8), "oi")):
        x = rng.standard_normal(shape).astype(np.float32)
        w = rng.standard_normal((8, 5) if rhs == "io" else (5, 8)).astype(np.float32)
        want = np.einsum(f"...i,{rhs}->...o", x.astype(np.float64), w.astype(np.float64))
        got = jax.jit(token_matmul, static_argnums=2)(x, w, rhs)
        assert got.shape == want.shape == shape[:-1] + (5,)
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
        assert dot_lhs_ranks(lambda x, w: token_matmul(x, w, rhs), x, w) == [2]   # one token axis reaches the dot
        g = rng.standard_normal(want.shape).astype(np.float32)
        dx, dw = jax.grad(lambda a, b: jnp.sum(token_matmul(a, b, rhs) * g), argnums=(0, 1))(x, w)
        w64 = w.astype(np.float64) if rhs == "oi" else w.astype(np.float64).T      # [o, i]
        np.testing.assert_allclose(np.asarray(dx), np.einsum("...o,oi->...i", g, w64), rtol=1e-5, atol=1e-5)
        dw_want = g.reshape(-1, 5).T.astype(np.float64) @ x.reshape(-1, 8).astype(np.float64)      # [o, i]
        np.testing.assert_allclose(np.asarray(dw), dw_want if rhs == "oi" else dw_want.T, rtol=1e-5, atol=1e-5)


def test_dense_and_its_adapter_reach_xla_cpu_as_one_token_axis_and_other_platforms_keep_the_einsum(monkeypatch):
    """The wiring: a Dense with a LoRA adapter runs every matmul over one token axis on the CPU; a program traced
    for another platform (an ahead-of-time TPU plan from this host) keeps the [B, S, i] einsum."""
    from types import SimpleNamespace

    import prisma_jax.nn.layers as layers
    dense = layers.Dense(8, 5, ("hidden", "mlp"), bias=False, lora=SimpleNamespace(rank=2, scale=0.5),
                         rngs=nnx.Rngs(0))
    x = jnp.ones((2, 3, 8))
    assert dot_lhs_ranks(lambda x: dense(x), x) == [2, 2, 2]       # the kernel, then the adapter's a and b
    monkeypatch.setattr(layers, "platform", lambda: "tpu")
    assert dot_lhs_ranks(lambda x: dense(x), x) == [3, 3, 3]
