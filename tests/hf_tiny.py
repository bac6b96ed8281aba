"""Tiny random Qwen3-VL / Prisma-VL checkpoints built with transformers, and the PyTorch references.

These are the independent side of every parity test: transformers' `Qwen3VLForConditionalGeneration`
(+ a forward hook that adds docs/introspection-contract.md §3's uncertainty embedding) and NumPy float64 re-derivations.
"""
from __future__ import annotations

import os

import numpy as np
import torch
from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

IMAGE, VIDEO, VSTART, VEND = 5, 6, 3, 4


def tiny_hf_config(tie=False, deepstack=(0, 2), vocab=128, text_layers=3, vision_depth=3, rope_style="4.57"):
    text = dict(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=text_layers,
                num_attention_heads=4, num_key_value_heads=2, head_dim=32, hidden_act="silu",
                rms_norm_eps=1e-6, max_position_embeddings=4096)
    rope = {"rope_type": "default", "mrope_section": [6, 5, 5], "mrope_interleaved": True}
    if rope_style == "4.57":
        text.update(rope_scaling=rope, rope_theta=5e6)
    else:
        text.update(rope_parameters={**rope, "rope_theta": 5e6})
    vision = dict(depth=vision_depth, hidden_size=32, num_heads=2, intermediate_size=48, patch_size=16,
                  temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=64, num_position_embeddings=64,
                  deepstack_visual_indexes=list(deepstack), hidden_act="gelu_pytorch_tanh", in_channels=3)
    return Qwen3VLConfig(text_config=text, vision_config=vision, image_token_id=IMAGE, video_token_id=VIDEO,
                         vision_start_token_id=VSTART, vision_end_token_id=VEND, tie_word_embeddings=tie)


def build_model(cfg, seed=0):
    torch.manual_seed(seed)
    model = Qwen3VLForConditionalGeneration(cfg).eval()
    with torch.no_grad():  # randomise the parameters that init to constants so every one is exercised
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "norm1.weight", "norm2.weight", "layernorm.weight")):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.05 * torch.randn_like(p))
            elif "pos_embed" in name:
                p.copy_(0.1 * torch.randn_like(p))
    return model


def save_checkpoint(model, path, table: np.ndarray | None = None, dtype=torch.float32):
    """save_pretrained as safetensors; with `table`, append model.uncertainty_embeddings.weight."""
    model.to(dtype).save_pretrained(path, safe_serialization=True)
    model.float()
    if table is not None:
        from safetensors.torch import load_file, save_file
        f = os.path.join(path, "model.safetensors")
        sd = load_file(f)
        sd["model.uncertainty_embeddings.weight"] = torch.from_numpy(np.asarray(table, np.float32)).to(dtype)
        save_file(sd, f, metadata={"format": "pt"})
    return path


def reference_logits(model, input_ids, attention_mask=None, pixel_values=None, image_grid_thw=None,
                     table=None, codes_in=None, grad=False):
    """transformers logits; with `table`/`codes_in`, docs/introspection-contract.md §3 added by a hook on embed_tokens.
    NumPy float32, or with `grad` the torch tensor with its autograd graph (for gradient references)."""
    emb = model.model.language_model.embed_tokens
    handle = None
    if table is not None:
        ids_t = torch.as_tensor(np.asarray(input_ids))
        codes = torch.as_tensor(np.asarray(codes_in)).long()
        on = (codes >= 0) & (ids_t != IMAGE) & (ids_t != VIDEO)
        u = torch.as_tensor(np.asarray(table, np.float32))[codes.clamp(min=0)]

        def hook(_mod, _inp, out):
            return torch.where(on[..., None], out + u.to(out.dtype), out)
        handle = emb.register_forward_hook(hook)
    try:
        kw = dict(input_ids=torch.as_tensor(np.asarray(input_ids)).long())
        if attention_mask is not None:
            kw["attention_mask"] = torch.as_tensor(np.asarray(attention_mask)).long()
        if pixel_values is not None:
            kw["pixel_values"] = torch.as_tensor(np.asarray(pixel_values, np.float32))
            kw["image_grid_thw"] = torch.as_tensor(np.asarray(image_grid_thw)).long()
            kw["mm_token_type_ids"] = (kw["input_ids"] == IMAGE).long()
        if grad:
            return model(**kw).logits.float()
        with torch.no_grad():
            return model(**kw).logits.float().numpy()
    finally:
        if handle is not None:
            handle.remove()


def random_pixels(grids, seed=0, patch_dim=1536):
    n = int(sum(t * h * w for t, h, w in grids))
    return np.random.default_rng(seed).uniform(-1, 1, (n, patch_dim)).astype(np.float32)


def image_tokens(grid, merge=2):
    t, h, w = grid
    return [VSTART] + [IMAGE] * (t * h * w // merge**2) + [VEND]
