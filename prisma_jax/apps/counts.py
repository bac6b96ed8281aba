"""`prisma inspect PATH`: parameter counts and bytes of a config or checkpoint, without materialising a weight.

The counts come from `jax.eval_shape` of the real initialiser, so they are the model's, not a formula's.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from prisma_jax.core.config import ModelConfig, load_config
from prisma_jax.nn.params import abstract_params

GROUPS = ("vision", "text", "lm_head", "uncertainty")


def param_counts(cfg: ModelConfig) -> dict[str, int]:
    # abstract evaluation of building every leaf: shapes only, no bytes
    shapes = jax.eval_shape(lambda: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), abstract_params(cfg)))
    counts = {g: int(sum(np.prod(x.shape) for x in jax.tree.leaves(shapes.get(g, {})))) for g in GROUPS}
    counts["total"] = sum(counts.values())
    return counts


def report(cfg: ModelConfig) -> str:
    c = param_counts(cfg)
    label = {"vision": "vision tower", "text": "text decoder (incl. embedding)",
             "lm_head": "lm_head" + (" (tied: shares the embedding)" if cfg.tie_word_embeddings else ""),
             "uncertainty": f"uncertainty table ({cfg.n_levels} x {cfg.text.hidden_size})"}
    lines = [f"{label[g]:<44}{c[g]:>16,}" for g in GROUPS]
    lines.append(f"{'total':<44}{c['total']:>16,}")
    lines.append("")
    for dt in ("float32", "bfloat16"):
        n = c["total"] * jnp.dtype(dt).itemsize
        lines.append(f"bytes as {dt:<35}{n:>16,}  ({n / 2**30:.2f} GiB)")
    return "\n".join(lines)


def add_parser(sub):
    p = sub.add_parser("inspect", help="parameter counts and bytes of a YAML config or checkpoint directory")
    p.add_argument("path", help="configs/*.yaml or a Hugging Face / Orbax checkpoint directory")
    p.set_defaults(func=lambda a: print(report(load_config(a.path))))
