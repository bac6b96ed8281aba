"""The leaf modules and numerical building blocks shared by both towers: dense, embedding and norm modules,
rotary embedding, attention.

Each leaf module holds its `nnx.Param`s as direct attributes (`kernel`, `bias`, `embedding`, `scale`) and does
its own matmul or lookup; every Param carries its logical sharding axes (`out_sharding`, resolved by
core/partitioning.py's rules: `placement.param_specs`). A stacked module (`stacked`) gets the leading "layers" axis.

Numerics follow transformers' Qwen3-VL exactly (docs/design.md): RMSNorm normalises in float32 and casts back
before the weight; LayerNorm uses the two-pass variance; softmax runs in float32.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from prisma_jax.core.platform import platform
from prisma_jax.core.partitioning import take_rows

INIT_STD = 0.02
normal = nnx.initializers.normal(INIT_STD)
ones, zeros = nnx.initializers.ones, nnx.initializers.zeros


def token_matmul(x: jax.Array, w: jax.Array, rhs: str = "io") -> jax.Array:
    """x [..., i] times w ([i, o] with `rhs` "io", [o, i] with "oi") → [..., o]. On the CPU the leading token axes
    are merged first: XLA:CPU runs the weight gradient of a [B, S, i] input (a contraction over two token axes)
    about 1.5× slower than over one merged axis (docs/benchmarks.md, "One token axis"). Elsewhere the einsum
    keeps the axes, as the sharding rules name them."""
    spec = f"...i,{rhs}->...o"
    if x.ndim <= 2 or platform() != "cpu":
        return jnp.einsum(spec, x, w)
    tokens = x.reshape(math.prod(x.shape[:-1]), x.shape[-1])
    return jnp.einsum(spec, tokens, w).reshape(*x.shape[:-1], w.shape[rhs.index("o")])


def param(init, key, shape, axes: tuple) -> nnx.Param:
    """A float32 Param with its logical axes as metadata (placed by the caller: never eagerly sharded)."""
    return nnx.Param(init(key, shape, jnp.float32), out_sharding=tuple(axes), eager_sharding=False)


def stacked(n: int, make, rngs: nnx.Rngs):
    """`n` copies of the module `make(rngs)` as one module whose params have a leading "layers" axis."""
    @nnx.split_rngs(splits=n)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
    def build(r):
        return make(r)
    return build(rngs)


def layer_slices(stack: nnx.Module, start: int = 0, stop: int | None = None):
    """(graphdef of one layer, the state of layers [start, stop) with the layer axis leading): a `lax.scan`
    runs the layers as `nnx.merge(graphdef, state_i)(...)`."""
    graphdef, state = nnx.split(stack)
    if start or stop is not None:
        state = jax.tree.map(lambda a: a[start:stop], state)
    return graphdef, state


def unstack(stack: nnx.Module, params: list | None = None) -> nnx.List:
    """The stacked layers as a list of per-layer modules: each a slice of the stack, or holding `params[i]`
    (per-layer arrays, in the layout of one layer's pure dict) when given."""
    graphdef, state = nnx.split(stack)
    n = jax.tree.leaves(state)[0].shape[0]
    out = []
    for i in range(n):
        st = jax.tree.map(lambda a, i=i: a[i], state)
        if params is not None:
            nnx.replace_by_pure_dict(st, params[i])        # the slice above is then dead code
        out.append(nnx.merge(graphdef, st))
    return nnx.List(out)


class Dense(nnx.Module):
    """y = x·kernel (+ bias) (+ scale · LoRA(x) with `lora`, lora.py); kernel [in, out], computed in x's dtype."""

    def __init__(self, d_in: int, d_out: int, axes: tuple, *, bias: bool = True, lora=None, rngs: nnx.Rngs):
        self.kernel = param(normal, rngs.params(), (d_in, d_out), axes)
        self.bias = param(zeros, rngs.params(), (d_out,), (None,)) if bias else None
        self.lora_scale = None if lora is None else float(lora.scale)
        self.lora = None if lora is None else nnx.LoRA(
            d_in, lora.rank, d_out, rngs=rngs, dtype=None,
            a_metadata={"out_sharding": (axes[0], None), "eager_sharding": False},
            b_metadata={"out_sharding": (None, axes[1]), "eager_sharding": False})

    def __call__(self, x: jax.Array) -> jax.Array:
        y = token_matmul(x, self.kernel[...].astype(x.dtype))
        if self.bias is not None:
            y = y + self.bias[...].astype(x.dtype)
        if self.lora is not None:
            a, b = self.lora.lora_a[...].astype(x.dtype), self.lora.lora_b[...].astype(x.dtype)
            low = token_matmul(token_matmul(x, a), b)
            y = y + low * jnp.asarray(self.lora_scale, x.dtype)
        return y


class Embed(nnx.Module):
    """A lookup table [rows, dim]; a lookup never gathers a row-sharded table (sharding.take_rows)."""

    def __init__(self, rows: int, dim: int, axes: tuple, *, rngs: nnx.Rngs, init=normal):
        self.axes = tuple(axes)
        self.embedding = param(init, rngs.params(), (rows, dim), axes)

    def __call__(self, ids: jax.Array) -> jax.Array:
        return take_rows(self.embedding[...], ids, self.axes)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, *, rngs: nnx.Rngs):
        self.eps = eps
        self.scale = param(ones, rngs.params(), (dim,), (None,))

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)
        y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return self.scale[...].astype(x.dtype) * y.astype(x.dtype)


class LayerNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, *, rngs: nnx.Rngs):
        self.eps = eps
        self.scale = param(ones, rngs.params(), (dim,), (None,))
        self.bias = param(zeros, rngs.params(), (dim,), (None,))

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)
        mu = jnp.mean(xf, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(xf - mu), axis=-1, keepdims=True)
        y = (xf - mu) * jax.lax.rsqrt(var + self.eps)
        return (y * self.scale[...].astype(jnp.float32) + self.bias[...].astype(jnp.float32)).astype(x.dtype)


def rotate_half(x: jax.Array) -> jax.Array:
    h = x.shape[-1] // 2
    return jnp.concatenate([-x[..., h:], x[..., :h]], axis=-1)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Split-half (NeoX) rotary embedding; `cos`/`sin` broadcast over the heads axis."""
    return x * cos + rotate_half(x) * sin


def torch_inv_freq(dim: int, theta: float) -> jax.Array:
    """`1 / theta ** (arange(0, dim, 2) / dim)` as transformers computes it in float32.

    Exponents in float32, the power correctly rounded to float32, the reciprocal in float32: this equals
    torch's values in all but at most one slot (1 ulp), where numpy's or XLA's float32 pow differ in many.
    """
    exps = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    powers = np.power(np.float64(theta), exps.astype(np.float64)).astype(np.float32)
    return jnp.asarray(np.float32(1.0) / powers)
