"""The parameter pytree: its layout, random initialisation, and the Hugging Face name mapping.

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

Dense kernels are stored `[in, out]` (torch Linear weights transposed). Every leaf maps to one Hugging Face
tensor name, or one per stacked index: `hf_names` is the single source of that mapping, used by the loader,
the converter and the exporter alike.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np

from .config import ModelConfig

Path = tuple[str, ...]
TABLE_PATH: Path = ("uncertainty", "embedding")


def param_shapes(cfg: ModelConfig, lora=None) -> dict:
    """The pytree of shapes (tuples of ints), read off the abstract module (with `lora`: its adapters too)."""
    from flax import nnx

    from .model import abstract_model

    return jax.tree.map(lambda a: tuple(a.shape), nnx.to_pure_dict(abstract_model(cfg, lora)[1]))


def _is_shape(x) -> bool:
    return isinstance(x, tuple) and all(isinstance(i, int) for i in x)


def abstract_params(cfg: ModelConfig, dtype=jnp.float32, lora=None) -> dict:
    """`jax.ShapeDtypeStruct` leaves: the 8B model without a byte of weights."""
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, jnp.dtype(dtype)), param_shapes(cfg, lora),
                        is_leaf=_is_shape)


def flatten(tree: dict, prefix: Path = ()) -> Iterator[tuple[Path, object]]:
    for k in sorted(tree):
        if isinstance(tree[k], dict):
            yield from flatten(tree[k], prefix + (k,))
        else:
            yield prefix + (k,), tree[k]


def get_path(tree: dict, path: Path):
    for k in path:
        tree = tree[k]
    return tree


def set_path(tree: dict, path: Path, value) -> None:
    for k in path[:-1]:
        tree = tree.setdefault(k, {})
    tree[path[-1]] = value


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
    from flax import nnx

    from .model import PrismaVLModule, to_params

    params = to_params(PrismaVLModule(cfg, rngs=nnx.Rngs(params=key, table=key), uncertainty_init=uncertainty_init,
                                      lora=lora))
    return jax.tree.map(lambda x: x.astype(dtype), params)


def init_params_numpy(cfg: ModelConfig, seed: int = 0, dtype=np.float32, std: float = 0.02,
                      uncertainty_init: str = "normal") -> dict:
    """The same distribution drawn on the host with NumPy: no XLA compile (threefry programs for dozens of
    leaves take tens of seconds to compile on CPU), for eager single-host construction. The uncertainty table
    is the exception: `uncertainty.fresh_table(seed)` (one small program), the table of every other path."""
    from .uncertainty import check_table_init, fresh_table

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


def count_params(tree) -> int:
    return int(sum(np.prod(x.shape) for x in jax.tree.leaves(tree)))


# ------------------------------------------------------------------------------------ Hugging Face names

@dataclasses.dataclass(frozen=True)
class HFName:
    """One Hugging Face tensor ↔ one leaf (or one stacked slice of a leaf).

    `to_jax(w)` turns the torch-layout array into ours, `to_hf(x)` back; both are pure reshapes/transposes,
    so a round trip is bit-identical.
    """
    hf: str
    path: Path
    index: int | None          # position along the leaf's stacked axis, None for unstacked leaves
    hf_shape: tuple[int, ...]
    to_jax: Callable[[np.ndarray], np.ndarray]
    to_hf: Callable[[np.ndarray], np.ndarray]


def _ident(x):
    return x


def _t(x):
    return np.ascontiguousarray(np.swapaxes(x, -1, -2))


_VISION_BLOCK = {
    ("norm1", "scale"): "norm1.weight", ("norm1", "bias"): "norm1.bias",
    ("norm2", "scale"): "norm2.weight", ("norm2", "bias"): "norm2.bias",
    ("attn", "qkv", "kernel"): "attn.qkv.weight", ("attn", "qkv", "bias"): "attn.qkv.bias",
    ("attn", "proj", "kernel"): "attn.proj.weight", ("attn", "proj", "bias"): "attn.proj.bias",
    ("mlp", "fc1", "kernel"): "mlp.linear_fc1.weight", ("mlp", "fc1", "bias"): "mlp.linear_fc1.bias",
    ("mlp", "fc2", "kernel"): "mlp.linear_fc2.weight", ("mlp", "fc2", "bias"): "mlp.linear_fc2.bias",
}
_MERGER = {
    ("norm", "scale"): "norm.weight", ("norm", "bias"): "norm.bias",
    ("fc1", "kernel"): "linear_fc1.weight", ("fc1", "bias"): "linear_fc1.bias",
    ("fc2", "kernel"): "linear_fc2.weight", ("fc2", "bias"): "linear_fc2.bias",
}
_TEXT_LAYER = {
    ("input_norm", "scale"): "input_layernorm.weight",
    ("post_attn_norm", "scale"): "post_attention_layernorm.weight",
    **{("attn", p, "kernel"): f"self_attn.{p}.weight" for p in ("q_proj", "k_proj", "v_proj", "o_proj")},
    ("attn", "q_norm", "scale"): "self_attn.q_norm.weight", ("attn", "k_norm", "scale"): "self_attn.k_norm.weight",
    **{("mlp", p, "kernel"): f"mlp.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")},
}
UNCERTAINTY_KEY = "model.uncertainty_embeddings.weight"


def hf_names(cfg: ModelConfig) -> list[HFName]:
    """Every Hugging Face tensor of a Prisma-VL checkpoint, in a stable order, with its leaf and layout."""
    shapes = param_shapes(cfg)
    v = cfg.vision
    out: list[HFName] = []

    def add(hf, path, index=None):
        shape = get_path(shapes, path)
        shape = shape[1:] if index is not None else shape
        kernel = path[-1] == "kernel"
        if path == ("vision", "patch_embed", "kernel"):
            hf_shape = (v.hidden_size, v.in_channels, v.temporal_patch_size, v.patch_size, v.patch_size)
            out.append(HFName(hf, path, index, hf_shape,
                              lambda w, n=shape[0]: np.ascontiguousarray(w.reshape(w.shape[0], n).T),
                              lambda x, s=hf_shape: np.ascontiguousarray(x.T).reshape(s)))
        elif kernel:
            out.append(HFName(hf, path, index, shape[::-1], _t, _t))
        else:
            out.append(HFName(hf, path, index, shape, _ident, _ident))

    add("model.visual.patch_embed.proj.weight", ("vision", "patch_embed", "kernel"))
    add("model.visual.patch_embed.proj.bias", ("vision", "patch_embed", "bias"))
    add("model.visual.pos_embed.weight", ("vision", "pos_embed", "embedding"))
    for i in range(v.depth):
        for sub, name in _VISION_BLOCK.items():
            add(f"model.visual.blocks.{i}.{name}", ("vision", "blocks", *sub), i)
    for sub, name in _MERGER.items():
        add(f"model.visual.merger.{name}", ("vision", "merger", *sub))
    for j in range(len(v.deepstack_visual_indexes)):
        for sub, name in _MERGER.items():
            add(f"model.visual.deepstack_merger_list.{j}.{name}", ("vision", "deepstack", *sub), j)
    add("model.language_model.embed_tokens.weight", ("text", "embed", "embedding"))
    for i in range(cfg.text.num_hidden_layers):
        for sub, name in _TEXT_LAYER.items():
            add(f"model.language_model.layers.{i}.{name}", ("text", "layers", *sub), i)
    add("model.language_model.norm.weight", ("text", "norm", "scale"))
    if not cfg.tie_word_embeddings:
        add("lm_head.weight", ("lm_head", "kernel"))
    add(UNCERTAINTY_KEY, ("uncertainty", "embedding"))
    return out
