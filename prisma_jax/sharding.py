"""Sharding, declared once: mesh axes and the logical-axis rules that map every named array axis onto them.

The math names its axes (`constrain(x, ("batch", "seq", "embed"))`); this table decides where they live.
With no mesh active (`jax.set_mesh`), `constrain` is the identity, so single-device code pays nothing.
"""
from __future__ import annotations

import jax
from jax.sharding import PartitionSpec as P

MESH_AXES = ("data", "fsdp", "tensor")

# logical axis -> mesh axis (or tuple of mesh axes, or None = replicated)
LOGICAL_RULES: dict[str, object] = {
    "batch": ("data", "fsdp"),
    "seq": None,
    "embed": None,
    "heads": "tensor",
    "kv_heads": "tensor",
    "mlp": "tensor",
    "vocab": "tensor",
}


def logical_to_spec(logical: tuple, rules: dict | None = None) -> P:
    rules = LOGICAL_RULES if rules is None else rules
    return P(*[None if a is None else rules.get(a) for a in logical])


def constrain(x: jax.Array, logical: tuple) -> jax.Array:
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x
    return jax.lax.with_sharding_constraint(x, logical_to_spec(logical))
