"""Model FLOPs of one training step, and the peak of the device that runs it: MFU as MaxText reports it.

Model FLOPs count what the math needs, not what the compiled program runs: remat's recompute is excluded, and
so are norms, softmax, the optimizer and the uncertainty lookup (small next to the matmuls). Per step of
`batch × seq` tokens:

* text matmuls: 2·N FLOPs a token forward (N: the text stack's matmul parameters, layers and lm_head; lookups
  are free), 4·N backward when the weights train (input and weight gradients), 2·N when they are frozen (LoRA's
  base, `train.freeze`: input gradients only, which the uncertainty table and adapters below still need);
* attention: 4·S²·H·hd a layer forward (QKᵀ and AV over the whole sequence, as MaxText counts it), ×3 with
  the backward;
* the vision tower: 2·(its matmul parameters × the rows each sees: patches, or merged tokens for the mergers)
  plus per-frame attention forward, ×3 when it trains, ×1 when frozen (nothing below it trains), for every
  image slot of every row (`data.max_images`: slots without an image are computed all the same);
* introspection: the P − 1 gradient-free passes before the last run the text stack forward again (the vision
  tower runs once for all of them, train/step.py).

`PEAK_TFLOPS`: dense bf16 peaks per chip from the vendors' data sheets; MFU = model FLOPs / step time / devices
/ peak. On a CPU or an unknown device only the achieved TFLOP/s is reported.
"""
from __future__ import annotations

import math

from prisma_jax.core.config import ModelConfig
from prisma_jax.core.trees import flatten
from prisma_jax.nn.params import param_shapes

# dense bf16 TFLOP/s per chip (one JAX device; a v4 / v5p megacore chip is one device)
PEAK_TFLOPS = {"TPU v4": 275.0, "TPU v5 lite": 197.0, "TPU v5e": 197.0, "TPU v5p": 459.0, "TPU v5": 459.0,
               "TPU v6 lite": 918.0, "TPU v6e": 918.0, "NVIDIA H100": 989.0, "NVIDIA H200": 989.0}


def device_peak(device_kind: str) -> float | None:
    """The bf16 peak of a `jax.Device.device_kind` (the longest matching name), None when unknown (CPU)."""
    hits = [k for k in PEAK_TFLOPS if device_kind.startswith(k) or k in device_kind]
    return PEAK_TFLOPS[max(hits, key=len)] if hits else None


def text_matmul_params(cfg: ModelConfig) -> int:
    """Parameters that multiply activations in the text stack (layers + lm_head, tied or not)."""
    t = cfg.text
    q, kv = t.num_attention_heads * t.head_dim, t.num_key_value_heads * t.head_dim
    per_layer = t.hidden_size * (2 * q + 2 * kv) + 3 * t.hidden_size * t.intermediate_size
    return t.num_hidden_layers * per_layer + t.hidden_size * t.vocab_size


def vision_forward_flops(cfg: ModelConfig, image_size: int) -> int:
    """Forward FLOPs of the vision tower on one image of `image_size`² pixels (one temporal patch pair)."""
    v = cfg.vision
    side = image_size // v.patch_size
    patches = side * side
    merged = patches // v.spatial_merge_size**2
    flops = 0
    for path, shape in flatten(param_shapes(cfg)):
        if path[0] != "vision" or path[-1] != "kernel":
            continue
        rows = merged if path[1] in ("merger", "deepstack") else patches
        flops += 2 * rows * math.prod(shape)                   # stacked kernels: the leading axis multiplies
    return flops + 4 * patches * patches * v.hidden_size * v.depth     # attention within the frame


def step_flops(tcfg, trained: dict[str, bool] | None = None) -> dict[str, float]:
    """Model FLOPs of one step of the training config `tcfg` (train/config.py), by part. `trained`: which groups
    train ({"text", "vision"}; default from `train.lora` and `train.freeze`)."""
    cfg, tr, d = tcfg.model, tcfg.train, tcfg.data
    if trained is None:
        frozen = set(tr.freeze)
        trained = {"text": tr.lora is None and not {"text", "lm_head"} & frozen,
                   "vision": tr.lora is None and "vision" not in frozen}
    t = cfg.text
    tokens = tr.batch_size * tr.seq_len
    dense = 2 * text_matmul_params(cfg) * tokens
    attn = 4 * tr.batch_size * tr.seq_len**2 * t.num_attention_heads * t.head_dim * t.num_hidden_layers
    images = tr.batch_size * d.max_images
    vision = images * vision_forward_flops(cfg, d.image_size) if images else 0
    out = {"text": dense * (3 if trained["text"] else 2), "attention": 3 * attn,
           "vision": vision * (3 if trained["vision"] else 1),
           "introspection": (tr.introspection_passes - 1) * (dense + attn)}
    out["total"] = sum(out.values())
    return out
