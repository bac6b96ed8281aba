"""The KV cache as a typed pytree, and the mode of a pass over the decoder.

`KVCache(k, v)` holds the keys and values of every decoder layer, in one of two layouts:

* stacked: `k`, `v` are `[layers, B, KV, slots, hd]` arrays, scanned alongside the stacked layer weights
  (text.py). This is the layout that crosses jit boundaries and that TPU and GPU decode in.
* per layer: `k`, `v` are tuples of `layers` arrays `[B, KV, slots, hd]`. The CPU decodes in this layout (its
  layers unrolled, text.py), and Tunix's caches are made of such batch-major leaves (integrations/tunix.py).

Each row's and head's slots are contiguous: the paged decode kernel's pages (attention.py). A pytree
dataclass whose leaves flatten as `k` then `v`, in that order.

`Mode` says what a pass does with the cache, explicitly, instead of inferring it from argument types:
FORWARD has none; PREFILL writes a prompt from slot 0, and its causal queries attend to the new keys only (no
attention over empty slots, no copy of the cache in another layout); DECODE writes new keys at `write_pos`
and attends over the cache.
"""
from __future__ import annotations

import dataclasses
import enum

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding

from prisma_jax.core.config import ModelConfig
from prisma_jax.core.partitioning import CACHE_AXES, constrain, spec_for


class Mode(enum.Enum):
    FORWARD = "forward"    # no cache: keys are the batch's own
    PREFILL = "prefill"    # a prompt written from slot 0; queries attend to the new keys
    DECODE = "decode"      # keys written at `write_pos`; queries attend over the cache


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    k: jax.Array | tuple   # [layers, B, KV, slots, hd], or a tuple of per-layer [B, KV, slots, hd]
    v: jax.Array | tuple

    # ------------------------------------------------------------------------------------------ construction
    @staticmethod
    def shape(cfg: ModelConfig, batch: int, slots: int) -> tuple[int, ...]:
        tc = cfg.text
        return (tc.num_hidden_layers, batch, tc.num_key_value_heads, slots, tc.head_dim)

    @classmethod
    def zeros(cls, cfg: ModelConfig, batch: int, slots: int, dtype, per_layer: bool = False) -> "KVCache":
        if per_layer:
            row = cls.shape(cfg, batch, slots)[1:]
            n = cfg.text.num_hidden_layers
            return cls(*(tuple(jnp.zeros(row, dtype) for _ in range(n)) for _ in "kv"))
        shape = cls.shape(cfg, batch, slots)
        return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))

    @classmethod
    def abstract(cls, cfg: ModelConfig, batch: int, slots: int, dtype, mesh: Mesh | None = None) -> "KVCache":
        """ShapeDtypeStructs of a stacked cache (with `mesh`, carrying their shardings): no bytes allocated."""
        shape = cls.shape(cfg, batch, slots)
        sharding = None if mesh is None else NamedSharding(mesh, spec_for(shape, CACHE_AXES, mesh))
        return cls(*(jax.ShapeDtypeStruct(shape, jnp.dtype(dtype), sharding=sharding) for _ in "kv"))

    def shardings(self, mesh: Mesh) -> "KVCache":
        """The NamedSharding of each leaf: KV heads over `tensor`, rows over the batch axes (CACHE_AXES)."""
        def one(a):
            logical = CACHE_AXES if a.ndim == len(CACHE_AXES) else CACHE_AXES[1:]
            return NamedSharding(mesh, spec_for(a.shape, logical, mesh))
        return jax.tree.map(one, self)

    # ------------------------------------------------------------------------------------------ layouts
    @property
    def per_layer(self) -> bool:
        return isinstance(self.k, tuple)

    @property
    def slots(self) -> int:
        """Slots per row: the second-to-last axis of every leaf."""
        return jax.tree.leaves(self)[0].shape[-2]

    def unstacked(self) -> "KVCache":
        """The per-layer layout (a slice per layer; the identity when already per layer)."""
        if self.per_layer:
            return self
        return KVCache(*(tuple(a[i] for i in range(a.shape[0])) for a in (self.k, self.v)))

    def stacked(self) -> "KVCache":
        """The stacked layout (the identity when already stacked)."""
        if not self.per_layer:
            return self
        return KVCache(jnp.stack(self.k), jnp.stack(self.v))

    def constrained(self) -> "KVCache":
        """A stacked cache constrained to CACHE_AXES (inside a trace under a mesh; the identity without one)."""
        return KVCache(constrain(self.k, CACHE_AXES), constrain(self.v, CACHE_AXES))

    def layer(self, i: int) -> tuple[jax.Array, jax.Array]:
        """(k, v) of layer i, `[B, KV, slots, hd]` each."""
        return self.k[i], self.v[i]

    @classmethod
    def from_layers(cls, layers) -> "KVCache":
        """A per-layer cache from a sequence of (k, v) pairs."""
        ks, vs = zip(*layers)
        return cls(tuple(ks), tuple(vs))

    def replace(self, **kw) -> "KVCache":
        return dataclasses.replace(self, **kw)
