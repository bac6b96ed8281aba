"""Partitioning declared once: the logical-axis rules for every array the model owns, and the two primitives the
math uses to follow them (`constrain`, `take_rows`).

The math names its axes (`constrain(x, ("batch", "seq", "embed"))`); `LOGICAL_RULES` decides where they live:
logical axis → mesh axis (or axes, or None = replicated), for activations, weights, the KV cache and (by
inheritance from the weights) the optimizer state. Each parameter's logical axes are declared beside its math,
by the module that owns it (nn/layers.py's `Dense(d, f, ("hidden", "mlp"))`, stacked layers adding "layers");
parallel/placement.py reads them off the model.

Why the big tables are laid out as they are (docs/sharding.md has the long form): the token embedding
`[V, D]`, `lm_head` `[D, V]` and the uncertainty table `[L, D]` put their rows (vocabulary / levels) on
`tensor` and the model dimension on `fsdp`. A lookup is then a masked local gather plus a sum over
`tensor` of a `[B, S, D]` activation — never a gathered table — and the logits come out vocab-sharded, so
the entropy of docs/introspection-contract.md §2 (max, Σexp, Σexp·z over the vocabulary) is combined from per-shard
partial reductions without forming `[B, V]` anywhere.

A batch dimension that the batch axes (data × fsdp) do not divide is an error naming the sizes (`spec_for`,
raised on the host while batches are placed or a program is traced); inference pads its rows to a multiple
instead (`batch_shards`). Any other dimension that a mesh axis does not divide stays replicated over that axis,
with one log line (`logging`, once per logical axis, dimension and mesh), so tiny test models run on any mesh.
With no mesh active (`jax.set_mesh`), `constrain` is the identity, so single-device code pays nothing. This
module places nothing on devices (parallel/).
"""
from __future__ import annotations

import logging
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P


MESH_AXES = ("data", "fsdp", "tensor")


log = logging.getLogger(__name__)


# logical axis -> mesh axis (or tuple of mesh axes, or None = replicated)
LOGICAL_RULES: dict[str, object] = {
    # activations
    "batch": ("data", "fsdp"),   # examples: pure data parallelism × FSDP
    "frames": ("data", "fsdp"),  # vision frames attended one by one: split like the batch when it divides them
                                 # (training's per-row image slots), else replicated (generation's packed images)
    "seq": None,
    "embed": None,               # activations' model dim (the batch is already split over data × fsdp)
    "heads": "tensor",           # query heads (activations and q/o projection weights)
    "kv_heads": "tensor",        # key/value heads (activations, k/v weights, KV cache)
    "mlp": "tensor",             # MLP width (activations and weights)
    "vocab": "tensor",           # vocabulary rows of the embedding / columns of lm_head / logits
    "cache_seq": None,           # KV-cache slots
    # weights only
    "layers": None,              # stacked layer axis, run by lax.scan: never sharded
    "hidden": "fsdp",            # weights' model dim: ZeRO-3 style, gathered layer by layer in the scan
    "levels": "tensor",          # uncertainty-table rows (2**n_bits)
}


# The KV cache {"k", "v"}: [layers, B, KV, S_max, hd] (text.py).
CACHE_AXES = ("layers", "batch", "kv_heads", "cache_seq", None)


def _axis_size(mesh, axes) -> int:
    return math.prod(mesh.shape[a] for a in axes)


def batch_shards(mesh, rules: dict | None = None) -> int:
    """How many ways the batch axes split a batch on `mesh`: every batch dimension must be a multiple."""
    rules = LOGICAL_RULES if rules is None else rules
    return _axis_size(mesh, [a for a in _axes_of(rules["batch"]) if a in mesh.shape])


_logged: set = set()


def _log_replicated(name, dim: int, dropped: list, mesh) -> None:
    key = (name, int(dim), tuple(sorted(dict(mesh.shape).items())))
    if key in _logged:
        return
    _logged.add(key)
    sizes = " × ".join(f"{a}={mesh.shape[a]}" for a in dropped)
    log.warning("sharding: logical axis %r of size %d is not divisible by mesh axis %s; replicated over it",
                name, dim, sizes)


def spec_for(shape, logical: tuple, mesh=None, rules: dict | None = None) -> P:
    """The PartitionSpec of an array with these logical axes. With `mesh` (concrete or abstract): a batch
    dimension that its mesh axes do not divide is a ValueError naming the sizes; on any other dimension such
    an axis is dropped (replicated, logged once), as is an axis that an earlier dimension already uses."""
    rules = LOGICAL_RULES if rules is None else rules
    if len(logical) != len(shape):
        raise ValueError(f"logical axes {logical} do not match shape {tuple(shape)}")
    used: set = set()
    out = []
    for dim, name in zip(shape, logical):
        axes = () if name is None else _axes_of(rules[name])
        keep, dropped = [], []
        for a in axes:
            if a in used or (mesh is not None and a not in mesh.shape):
                continue
            if mesh is not None and dim % (_axis_size(mesh, keep) * mesh.shape[a]):
                dropped.append(a)
                continue
            keep.append(a)
        if dropped and name == "batch":
            split = [a for a in axes if a in mesh.shape and a not in used]
            sizes = " × ".join(f"{a}={mesh.shape[a]}" for a in split)
            raise ValueError(f"batch dimension {dim} (of shape {tuple(shape)}) is not a multiple of the mesh's "
                             f"batch shards {sizes} = {_axis_size(mesh, split)}; use a batch that is")
        if dropped:
            _log_replicated(name, dim, dropped, mesh)
        used.update(keep)
        out.append(None if not keep else keep[0] if len(keep) == 1 else tuple(keep))
    return P(*out)


def logical_to_spec(logical: tuple, rules: dict | None = None) -> P:
    rules = LOGICAL_RULES if rules is None else rules
    return P(*[None if a is None else rules.get(a) for a in logical])


def constrain(x: jax.Array, logical: tuple) -> jax.Array:
    """Pin an activation's layout under the active mesh; the identity with none."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x
    return jax.lax.with_sharding_constraint(x, spec_for(x.shape, logical, mesh))


def _axes_of(entry) -> tuple:
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def take_rows(table: jax.Array, ids: jax.Array, logical: tuple) -> jax.Array:
    """`jnp.take(table, ids, axis=0)` for a row-sharded table `[R, D]` (logical axes e.g. ("vocab", "hidden")):
    each device looks up the ids that fall in its rows (zeros elsewhere), a sum over the row axes combines
    them, and an all-to-all over the column axes returns full-width rows to the batch shards. The table is
    never gathered; only `[B, S, D]`-sized activations and the ids move. The identity of jnp.take with no mesh.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return jnp.take(table, ids, axis=0)
    t_spec = spec_for(table.shape, logical, mesh)
    i_spec = spec_for(ids.shape, ("batch",) + (None,) * (ids.ndim - 1), mesh)
    rows, cols, batch = _axes_of(t_spec[0]), _axes_of(t_spec[1]), _axes_of(i_spec[0])
    gather_ids = bool(cols) and batch[-len(cols):] == cols
    if not gather_ids and set(cols) & set(batch):   # ids replicated over the column axes instead
        kept = tuple(a for a in batch if a not in cols)
        i_spec = P(kept or None, *i_spec[1:])
    out_spec = P(i_spec[0], *([None] * ids.ndim))

    def body(tab, idx):
        if gather_ids:      # every column shard needs the ids of its whole fsdp group
            idx = jax.lax.all_gather(idx, cols, axis=0, tiled=True)
        n = tab.shape[0]
        local = idx - (jax.lax.axis_index(rows) * n if rows else 0)
        hit = (local >= 0) & (local < n)
        out = jnp.where(hit[..., None], jnp.take(tab, jnp.clip(local, 0, n - 1), axis=0), 0).astype(tab.dtype)
        if rows:
            out = jax.lax.psum(out, rows)
        if cols:
            out = (jax.lax.all_to_all(out, cols, 0, out.ndim - 1, tiled=True) if gather_ids
                   else jax.lax.all_gather(out, cols, axis=out.ndim - 1, tiled=True))
        return out

    return jax.shard_map(body, in_specs=(t_spec, i_spec), out_specs=out_spec, check_vma=False)(table, ids)
