"""`PrismaVL`: the public, transformers-flavoured entry point.

    model = PrismaVL.from_pretrained(path, dtype="float32")
    logits = model.forward(input_ids, attention_mask=None, pixel_values=None, image_grid_thw=None, codes_in=None)
    codes = model.uncertainty_codes(logits)
    model.params, model.config

Inputs are checked on the host (`inputs.prepare`) before any device work; the math is `model.forward` under
`jax.jit` with the config static. The object holds data only (config, params, generation defaults): every
compiled entry point is a pure function of them.
"""
from __future__ import annotations

import contextlib
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from . import model as M
from .config import ModelConfig, load_config
from .inputs import prepare
from .loading import load_hf, resolve_dtype
from .params import init_params
from .uncertainty import codes_from_logits

_forward = jax.jit(M.forward, static_argnums=0)
_codes = jax.jit(codes_from_logits, static_argnums=1)


class PrismaVL:
    def __init__(self, config: ModelConfig, params: dict, generation_config: dict | None = None,
                 path: str | None = None):
        self.config = config
        self.params = params
        self.generation_config = generation_config or {}
        self.path = path

    # ------------------------------------------------------------------------------------------ construction
    @classmethod
    def from_pretrained(cls, path: str, dtype="float32", uncertainty_init: str = "zeros", seed: int = 0):
        """A Hugging Face Qwen3-VL / Prisma-VL checkpoint directory (safetensors)."""
        params, cfg = load_hf(path, dtype=dtype, uncertainty_init=uncertainty_init, seed=seed)
        params = jax.tree.map(jnp.asarray, params)
        return cls(cfg, params, _generation_config(path), path)

    @classmethod
    def from_config(cls, config: ModelConfig | str, seed: int = 0, dtype="float32",
                    uncertainty_init: str = "normal"):
        """A randomly initialised model from a config object, a YAML file or a checkpoint directory."""
        cfg = load_config(config) if isinstance(config, (str, os.PathLike)) else config
        dt = resolve_dtype(dtype) or np.dtype(np.float32)
        params = init_params(cfg, jax.random.key(seed), jnp.dtype(dt), uncertainty_init=uncertainty_init)
        return cls(cfg, params)

    @property
    def dtype(self):
        return self.params["text"]["embed"]["embedding"].dtype

    def _precision(self):
        # float32 weights mean float32 parity: no TF32 / bf16 passes on GPU/TPU matmuls
        if self.dtype == jnp.float32:
            return jax.default_matmul_precision("highest")
        return contextlib.nullcontext()

    # ------------------------------------------------------------------------------------------ inference
    def prepare(self, input_ids, attention_mask=None, pixel_values=None, image_grid_thw=None, codes_in=None):
        """Validate and index inputs on the host; returns a `model.Batch` of NumPy arrays."""
        return prepare(self.config, input_ids, attention_mask, pixel_values, image_grid_thw, codes_in)

    def forward(self, input_ids, attention_mask=None, pixel_values=None, image_grid_thw=None, codes_in=None):
        """Logits [B, S, V] (the params' dtype). `codes_in [B, S]`: −1 none, else a table row; None = the
        prompt rule of INTROSPECTION.md §4 (first real token none, neutral elsewhere)."""
        batch = self.prepare(input_ids, attention_mask, pixel_values, image_grid_thw, codes_in)
        with self._precision():
            return _forward(self.config, self.params, batch)

    def uncertainty_codes(self, logits) -> np.ndarray:
        """INTROSPECTION.md §2 codes (uint16) of logits [..., V]."""
        logits = jnp.asarray(logits)
        if logits.shape[-1] != self.config.text.vocab_size:
            raise ValueError(f"logits last axis {logits.shape[-1]} != vocab size {self.config.text.vocab_size}")
        return np.asarray(_codes(logits, self.config.n_bits))


def _generation_config(path: str) -> dict:
    """`generation_config.json`, falling back to `config.json`'s eos/pad ids, as transformers does."""
    out: dict = {}
    for name in ("config.json", "generation_config.json"):
        p = os.path.join(path, name)
        if os.path.isfile(p):
            with open(p) as f:
                d = json.load(f)
            for k in ("eos_token_id", "pad_token_id", "bos_token_id"):
                v = d.get(k, (d.get("text_config") or {}).get(k))
                if v is not None:
                    out[k] = v
    return out
