"""`PrismaVL`: the public, transformers-flavoured entry point.

    model = PrismaVL.from_pretrained(path, dtype="float32")
    logits = model.forward(input_ids, attention_mask=None, pixel_values=None, image_grid_thw=None, codes_in=None)
    codes = model.uncertainty_codes(logits)
    model.params, model.config
    model.module                        # the same weights as a Flax NNX `model.PrismaVLModule`

    model = PrismaVL.from_pretrained(path, dtype="bfloat16", mesh={"data": 2, "fsdp": 2, "tensor": 2})  # or "cpu-8"
    model = PrismaVL.from_pretrained(path, quantize="int8")   # int8 weight-only kernels for generation (quant/int8.py)

With a mesh (a `parallel.mesh.MeshSpec`, a dict of axis sizes, a preset name or a `jax.sharding.Mesh`), every
parameter is created directly in its sharding (parallel/distribute.py) and the entry points run under that mesh; they
take any number of rows, padding the batch to a multiple of the mesh's batch shards and dropping the padding.

Inputs are checked on the host (`host.inputs.prepare`) before any device work; the math is `infer.core.forward` under
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

from prisma_jax.infer import core
from prisma_jax.nn.attention import IMPLS
from prisma_jax.core.config import ModelConfig, load_config
from prisma_jax.host.inputs import pad_rows, prepare
from prisma_jax.checkpoint.loading import load_hf, resolve_dtype
from prisma_jax.nn.params import init_params_numpy
from prisma_jax.quant.int8 import check_mode, is_quantized
from prisma_jax.parallel.mesh import make_mesh
from prisma_jax.core.partitioning import batch_shards
from prisma_jax.nn.uncertainty import codes_from_logits

_forward = jax.jit(core.forward, static_argnums=0)
_codes = jax.jit(codes_from_logits, static_argnums=1)


class PrismaVL:
    def __init__(self, config: ModelConfig, params: dict, generation_config: dict | None = None,
                 path: str | None = None, mesh: jax.sharding.Mesh | None = None):
        self.config = config
        self.params = params
        self.generation_config = generation_config or {}
        self.path = path
        self.mesh = mesh

    # ------------------------------------------------------------------------------------------ construction
    @classmethod
    def from_pretrained(cls, path: str, dtype="float32", uncertainty_init: str = "zeros", seed: int = 0,
                        mesh=None, verify: bool = True, quantize: str | None = None, attention: str = "auto"):
        """A Hugging Face Qwen3-VL / Prisma-VL checkpoint directory (safetensors), or an Orbax directory written
        by `prisma convert hf-to-orbax` (its recorded crc32s checked unless verify=False); `mesh` shards it on
        load; `quantize="int8"` then quantizes it for generation (`PrismaVL.quantize`). `attention`: auto | xla |
        pallas, the kernels (prisma_jax/nn/attention.py)."""
        if attention not in IMPLS:
            raise ValueError(f"attention must be one of {', '.join(IMPLS)}, got {attention!r}")
        if attention != "auto":
            model = cls.from_pretrained(path, dtype, uncertainty_init, seed, mesh, verify, quantize)
            model.config = model.config.replace(attention=attention)
            return model
        from prisma_jax.checkpoint.orbax import is_converted, restore_params

        if check_mode(quantize) is not None:
            return cls.from_pretrained(path, dtype, uncertainty_init, seed, mesh, verify).quantize(quantize)

        if is_converted(path):   # each shard restored straight onto its device (dtype "keep" = as stored)
            if mesh is not None:
                from prisma_jax.parallel.placement import param_shardings

                mesh = _as_mesh(mesh)
            params, cfg = restore_params(path, dtype=dtype, shardings=None if mesh is None else
                                         (lambda c: param_shardings(c, mesh)), verify=verify)
            if mesh is None:
                params = jax.tree.map(jnp.asarray, params)
            return cls(cfg, params, _generation_config(path), path, mesh)
        if mesh is not None:
            from prisma_jax.parallel.distribute import load_hf_sharded

            mesh = _as_mesh(mesh)
            params, cfg = load_hf_sharded(path, mesh, dtype=dtype, uncertainty_init=uncertainty_init, seed=seed)
            return cls(cfg, params, _generation_config(path), path, mesh)
        params, cfg = load_hf(path, dtype=dtype, uncertainty_init=uncertainty_init, seed=seed)
        params = jax.tree.map(jnp.asarray, params)
        return cls(cfg, params, _generation_config(path), path)

    @classmethod
    def from_config(cls, config: ModelConfig | str, seed: int = 0, dtype="float32",
                    uncertainty_init: str = "normal", mesh=None):
        """A randomly initialised model from a config object, a YAML file or a checkpoint directory."""
        cfg = load_config(config) if isinstance(config, (str, os.PathLike)) else config
        dt = resolve_dtype(dtype) or np.dtype(np.float32)
        if mesh is not None:
            from prisma_jax.parallel.distribute import init_sharded

            mesh = _as_mesh(mesh)
            params = init_sharded(cfg, mesh, jax.random.key(seed), jnp.dtype(dt), uncertainty_init)
            return cls(cfg, params, mesh=mesh)
        params = jax.tree.map(jnp.asarray, init_params_numpy(cfg, seed, dt, uncertainty_init=uncertainty_init))
        return cls(cfg, params)

    def quantize(self, mode: str = "int8") -> "PrismaVL":
        """This model with int8 weight-only kernels, for generation (quant/int8.py says which tensors and how);
        the unquantized leaves keep their dtype, which stays the compute dtype. It cannot be trained."""
        from prisma_jax.quant.int8 import quantize_params

        if check_mode(mode) is None:
            raise ValueError("quantize: a mode is required, e.g. 'int8'")
        return PrismaVL(self.config, quantize_params(self.config, self.params, self.mesh), self.generation_config,
                        self.path, self.mesh)

    @property
    def quantized(self) -> str | None:
        """"int8" when the params are quantized (`quantize`), else None."""
        return "int8" if is_quantized(self.params) else None

    @property
    def module(self):
        """The model as a `flax.nnx` module holding these params (`model.to_params` turns it back)."""
        return core.bind(self.config, self.params)

    @property
    def dtype(self):
        return self.params["text"]["embed"]["embedding"].dtype

    def _precision(self):
        # float32 weights mean float32 parity: no TF32 / bf16 passes on GPU/TPU matmuls
        if self.dtype == jnp.float32:
            return jax.default_matmul_precision("highest")
        return contextlib.nullcontext()

    def _on_mesh(self):
        """The model's mesh as the active one (so `sharding.constrain` applies); a no-op without a mesh."""
        return jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext()

    def _place(self, batch):
        """A host `model.Batch` → (device arrays laid out by the batch rules, its real row count); under a mesh
        the rows are first padded to a multiple of its batch shards (`host.inputs.pad_rows`). Unchanged without a mesh."""
        rows = batch.input_ids.shape[0]
        if self.mesh is None:
            return batch, rows
        from prisma_jax.parallel.distribute import shard_batch

        cfg = self.config
        fill = min({0, 1, 2} - {cfg.image_token_id, cfg.video_token_id})
        return shard_batch(pad_rows(cfg, batch, -rows % batch_shards(self.mesh), fill), self.mesh), rows

    # ------------------------------------------------------------------------------------------ inference
    def prepare(self, input_ids, attention_mask=None, pixel_values=None, image_grid_thw=None, codes_in=None):
        """Validate and index inputs on the host; returns a `model.Batch` of NumPy arrays."""
        return prepare(self.config, input_ids, attention_mask, pixel_values, image_grid_thw, codes_in)

    def forward(self, input_ids, attention_mask=None, pixel_values=None, image_grid_thw=None, codes_in=None):
        """Logits [B, S, V] (the params' dtype). `codes_in [B, S]`: −1 none, else a table row; None = the
        prompt rule of docs/introspection-contract.md §4 (first real token none, neutral elsewhere)."""
        batch = self.prepare(input_ids, attention_mask, pixel_values, image_grid_thw, codes_in)
        with self._precision(), self._on_mesh():
            batch, rows = self._place(batch)
            logits = _forward(self.config, self.params, batch)
            return logits if logits.shape[0] == rows else logits[:rows]

    def uncertainty_codes(self, logits) -> np.ndarray:
        """docs/introspection-contract.md §2 codes (uint16) of logits [..., V]."""
        logits = jnp.asarray(logits)
        if logits.shape[-1] != self.config.text.vocab_size:
            raise ValueError(f"logits last axis {logits.shape[-1]} != vocab size {self.config.text.vocab_size}")
        with self._on_mesh():
            return np.asarray(_codes(logits, self.config.n_bits))

    def generate(self, input_ids, attention_mask=None, pixel_values=None, image_grid_thw=None,
                 max_new_tokens: int = 16, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                 seed: int = 0, eos_token_id=None, **kw):
        """Jitted batch generation (generate.py): `.tokens [B, T]`, `.codes [B, T]` uint16, `.lengths [B]`
        (+ `.entropies` with `return_entropies=True`, `.logprobs` with `return_logprobs=True`).
        `abstain_above=τ` stops a row at a token whose code exceeds τ: `.abstained [B]`, `.abstain_step [B]`,
        `.texts(processor)` answers it with `abstain_text`. `eos_token_id` defaults to the checkpoint's."""
        from prisma_jax.infer.generate import generate

        gc = self.generation_config
        if eos_token_id is None:
            eos_token_id = gc.get("eos_token_id")
        kw.setdefault("pad_token_id", gc.get("pad_token_id"))
        with self._precision(), self._on_mesh():
            return generate(self.config, self.params, input_ids, attention_mask, pixel_values, image_grid_thw,
                            max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                            seed=seed, eos_token_id=eos_token_id, **kw)


def _as_mesh(mesh) -> jax.sharding.Mesh:
    return mesh if isinstance(mesh, jax.sharding.Mesh) else make_mesh(mesh)


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
