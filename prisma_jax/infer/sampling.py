"""Choosing the next token from a row of logits: greedy, temperature, top-k, top-p, and uncertainty-aware
temperature. Pure functions of (logits, parameters, key), traced inside the decode loop.

The sampling parameters are data (`SamplingParams`, one scalar each), so changing them never recompiles;
only greedy vs. sampling is a static choice (greedy needs no sort and no key).

Uncertainty-aware temperature ("sample less when uncertain"): the temperature of step t is

    T_t = temperature · scale(c_prev),   scale(c) = (1 − c / (L − 1)) ** uncertainty_power

where `c_prev` is the code carried in the loop — the code of the distribution the previous token was drawn
from (the neutral code N at the first step, whose incoming code is the prompt's). `uncertainty_power = 0`
(the default) is plain temperature; larger powers cool sampling faster as the previous step gets more
uncertain, down to greedy at h = 1. `UncertaintyTemperature` can be replaced by any hashable callable
`(code uint16 [B], n_levels, power float32 []) → scale float32 [B]` passed as `temperature_fn` (it becomes
part of the compiled program).

Not here: the entropy/code itself (uncertainty.py), stopping rules (generate.py).
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp


class SamplingParams(NamedTuple):
    temperature: jax.Array        # [] float32, > 0 when sampling
    top_k: jax.Array              # [] int32, 0 = off
    top_p: jax.Array              # [] float32 in (0, 1], 1 = off
    uncertainty_power: jax.Array  # [] float32 ≥ 0, 0 = off


@dataclasses.dataclass(frozen=True)
class UncertaintyTemperature:
    """The default temperature scale: (1 − c/(L−1)) ** power, power from `SamplingParams`."""

    def __call__(self, code: jax.Array, n_levels: int, power: jax.Array) -> jax.Array:
        h = code.astype(jnp.float32) / jnp.float32(n_levels - 1)
        return jnp.power(jnp.maximum(1.0 - h, 0.0), power)


def check_sampling(temperature, top_k, top_p, uncertainty_power=0.0) -> None:
    """Host-side validation: one ValueError naming the bad value."""
    if not temperature >= 0:
        raise ValueError(f"temperature must be ≥ 0, got {temperature}")
    if int(top_k) != top_k or top_k < 0:
        raise ValueError(f"top_k must be an integer ≥ 0, got {top_k}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if not uncertainty_power >= 0:
        raise ValueError(f"uncertainty_power must be ≥ 0, got {uncertainty_power}")


def greedy(logits: jax.Array) -> jax.Array:
    """[B, V] → [B] int32, the first maximum."""
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)


def sample(logits: jax.Array, params: SamplingParams, key: jax.Array, prev_code: jax.Array, n_levels: int,
           temperature_fn=UncertaintyTemperature()) -> jax.Array:
    """[B, V] float32 logits → [B] int32 tokens, one sort per row.

    Order: temperature (scaled by `temperature_fn(prev_code)`), then top-k, then top-p on the renormalised
    top-k distribution (the nucleus: the shortest prefix of the sorted tokens whose mass reaches top_p).
    A row whose effective temperature is 0 takes its argmax. Ties sort by token id, so top-k = 1 is greedy.
    """
    z = logits.astype(jnp.float32)
    b, v = z.shape
    t = params.temperature * temperature_fn(prev_code, n_levels, params.uncertainty_power)   # [B]
    cold = t <= 0
    order = jnp.argsort(-z, axis=-1, stable=True)                                           # [B, V]
    zs = jnp.take_along_axis(z, order, axis=-1) / jnp.where(cold, 1.0, t)[:, None]
    rank = jnp.arange(v)[None, :]
    k = jnp.where(params.top_k > 0, params.top_k, v)
    zs = jnp.where(rank < k, zs, -jnp.inf)
    probs = jax.nn.softmax(zs, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs                          # mass strictly before each token
    nucleus = (before < params.top_p) | (rank == 0) | (params.top_p >= 1)   # top_p = 1 keeps everything
    zs = jnp.where(nucleus, zs, -jnp.inf)
    pick = jax.random.categorical(key, zs, axis=-1)                      # index into the sorted order
    tok = jnp.take_along_axis(order, pick[:, None], axis=-1)[:, 0]
    return jnp.where(cold, order[:, 0], tok).astype(jnp.int32)
