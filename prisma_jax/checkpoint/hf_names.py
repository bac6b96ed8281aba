"""The Hugging Face name mapping: every leaf of the parameter tree (nn/params.py) ↔ one Hugging Face tensor
name, or one per stacked index. `hf_names` is the single source of that mapping, used by the loader, the
converter and the exporter alike."""
from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

from prisma_jax.core.config import ModelConfig
from prisma_jax.core.trees import Path, get_path
from prisma_jax.nn.params import param_shapes


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
