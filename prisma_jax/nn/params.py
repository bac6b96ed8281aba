"""The parameter pytree: its layout and random initialisation.

The layout is that of the model's params as a plain nested dict (`nnx.to_pure_dict` of `model.PrismaVLModule`'s
params; Orbax saves it as is; `[n]` = leading stacked axis, run by one `lax.scan`)::

    vision/patch_embed/{kernel [C*T*P*P, Dv], bias [Dv]}
    vision/pos_embed/embedding [S*S, Dv]
    vision/blocks/...            [depth] x {norm1, norm2: {scale, bias}; attn/{qkv, proj}; mlp/{fc1, fc2}}
    vision/merger/{norm [Dv], fc1, fc2}
    vision/deepstack/...         [n_deepstack] x {norm [4Dv], fc1, fc2}
    text/embed/embedding [V, D]
    text/layers/...              [layers] x {input_norm, post_attn_norm; attn/{q,k,v,o}_proj, {q,k}_norm; mlp/...}
    text/norm/scale [D]
    lm_head/kernel [D, V]        (absent when the head is tied to text/embed)
    uncertainty/embedding [2**n_bits, D]

Dense kernels are stored `[in, out]` (torch Linear weights transposed). The Hugging Face name of each leaf is
checkpoint/hf_names.py's.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from prisma_jax.core.config import ModelConfig
from prisma_jax.core.trees import Path, flatten, set_path
from prisma_jax.nn.model import PrismaVLModule, abstract_model, to_params
from prisma_jax.nn.uncertainty import check_table_init, fresh_table


TABLE_PATH: Path = ("uncertainty", "embedding")


def param_shapes(cfg: ModelConfig, lora=None) -> dict:
    """The pytree of shapes (tuples of ints), read off the abstract module (with `lora`: its adapters too)."""
    return jax.tree.map(lambda a: tuple(a.shape), nnx.to_pure_dict(abstract_model(cfg, lora)[1]))


def _is_shape(x) -> bool:
    return isinstance(x, tuple) and all(isinstance(i, int) for i in x)


def abstract_params(cfg: ModelConfig, dtype=jnp.float32, lora=None) -> dict:
    """`jax.ShapeDtypeStruct` leaves: the 8B model without a byte of weights."""
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, jnp.dtype(dtype)), param_shapes(cfg, lora),
                        is_leaf=_is_shape)


def _leaf_init(path: Path, uncertainty_init: str) -> str:
    if path[-1] == "scale":
        return "ones"
    if path[-1] == "bias" or (path[0] == "uncertainty" and uncertainty_init == "zeros"):
        return "zeros"
    return "normal"


def init_params(cfg: ModelConfig, key: jax.Array, dtype=jnp.float32, uncertainty_init: str = "normal",
                lora=None) -> dict:
    """Random parameters of `model.PrismaVLModule` as a plain dict (traceable: jit it, e.g. with
    `out_shardings`): its `nnx.initializers` (normal(0, 0.02) matrices, ones for norm scales, zeros for biases)
    drawn from `key`, and the table of docs/introspection-contract.md §1 drawn from `key` itself
    (`uncertainty.fresh_table(seed)` for `key = jax.random.key(seed)`), or zeros. `lora`: with adapters."""
    params = to_params(PrismaVLModule(cfg, rngs=nnx.Rngs(params=key, table=key), uncertainty_init=uncertainty_init,
                                      lora=lora))
    return jax.tree.map(lambda x: x.astype(dtype), params)


def init_params_numpy(cfg: ModelConfig, seed: int = 0, dtype=np.float32, std: float = 0.02,
                      uncertainty_init: str = "normal") -> dict:
    """The same distribution drawn on the host with NumPy: no XLA compile (threefry programs for dozens of
    leaves take tens of seconds to compile on CPU), for eager single-host construction. The uncertainty table
    is the exception: `uncertainty.fresh_table(seed)` (one small program), the table of every other path."""

    check_table_init(uncertainty_init)
    rng = np.random.default_rng(seed)
    out: dict = {}
    for path, shape in flatten(param_shapes(cfg)):
        kind = _leaf_init(path, uncertainty_init)
        if path == TABLE_PATH and kind == "normal":     # one small jitted program: the same table as init_params
            x = np.asarray(fresh_table(seed, shape, dtype))
        elif kind == "normal":
            x = (np.float32(std) * rng.standard_normal(shape, np.float32)).astype(dtype)
        else:
            x = (np.ones if kind == "ones" else np.zeros)(shape, dtype)
        set_path(out, path, x)
    return out
