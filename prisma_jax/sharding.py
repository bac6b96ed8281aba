"""Sharding, declared once: the mesh, its presets, and the logical-axis rules for every array the model owns.

The math names its axes (`constrain(x, ("batch", "seq", "embed"))`); the tables here decide where they live:

* `LOGICAL_RULES`  logical axis → mesh axis (or axes, or None = replicated), for activations, weights, the KV
  cache and (by inheritance from the weights) the optimizer state;
* each parameter's logical axes are declared beside its math, by the module that owns it (layers.py's
  `Dense(d, f, ("hidden", "mlp"))`, stacked layers adding "layers"): `param_axes` reads them off the model;
* `MeshSpec` / `PRESETS`  mesh shapes (`{"data": 2, "fsdp": -1, "tensor": 2}`, −1 = the rest) and the TPU
  slices we plan for, with device count, HBM per chip and the topology name for ahead-of-time compiles.

Why the big tables are laid out as they are (docs/sharding.md has the long form): the token embedding
`[V, D]`, `lm_head` `[D, V]` and the uncertainty table `[L, D]` put their rows (vocabulary / levels) on
`tensor` and the model dimension on `fsdp`. A lookup is then a masked local gather plus a sum over
`tensor` of a `[B, S, D]` activation — never a gathered table — and the logits come out vocab-sharded, so
the entropy of docs/introspection-contract.md §2 (max, Σexp, Σexp·z over the vocabulary) is combined from per-shard
partial reductions without forming `[B, V]` anywhere.

A batch dimension that the batch axes (data × fsdp) do not divide is an error naming the sizes (`spec_for`,
raised on the host while batches are placed or a program is traced); generation pads its rows to a multiple
instead (generate.py). Any other dimension that a mesh axis does not divide stays replicated over that axis,
with one log line (`logging`, once per logical axis, dimension and mesh), so tiny test models run on any mesh.
With no mesh active (`jax.set_mesh`), `constrain` is the identity, so single-device code pays nothing. This
module places nothing on devices (see `distribute.py`).
"""
from __future__ import annotations

import dataclasses
import logging
import math
from typing import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

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


# ------------------------------------------------------------------------------------------------ meshes

@dataclasses.dataclass(frozen=True)
class MeshSpec:
    """Sizes of the three mesh axes; one of them may be −1 ("the rest of the devices")."""
    data: int = 1
    fsdp: int = -1
    tensor: int = 1

    @classmethod
    def parse(cls, spec) -> "MeshSpec":
        """A MeshSpec, a dict / YAML mapping `{data, fsdp, tensor}`, or a preset name."""
        if isinstance(spec, MeshSpec):
            return spec
        if isinstance(spec, str):
            return preset(spec).train
        if not isinstance(spec, Mapping):
            raise ValueError(f"mesh must be a preset name or a mapping of {list(MESH_AXES)}, got {spec!r}")
        unknown = sorted(set(spec) - set(MESH_AXES))
        if unknown:
            raise ValueError(f"mesh: unknown axis name(s) {unknown}; the axes are {list(MESH_AXES)}")
        sizes = {k: spec.get(k, 1) for k in MESH_AXES}
        if "fsdp" not in spec and -1 not in sizes.values():
            sizes["fsdp"] = -1                     # unnamed devices go to fsdp
        for k, v in sizes.items():
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or not (v >= 1 or v == -1):
                raise ValueError(f"mesh: axis {k!r} must be a positive integer or -1, got {v!r}")
        if sum(v == -1 for v in sizes.values()) > 1:
            raise ValueError(f"mesh: at most one axis may be -1, got {sizes}")
        return cls(**{k: int(v) for k, v in sizes.items()})

    def shape(self, n_devices: int) -> tuple[int, int, int]:
        sizes = [self.data, self.fsdp, self.tensor]
        known = math.prod(s for s in sizes if s != -1)
        if -1 in sizes:
            if n_devices % known:
                raise ValueError(f"mesh {self.as_dict()}: {n_devices} devices are not a multiple of {known}")
            sizes[sizes.index(-1)] = n_devices // known
        if math.prod(sizes) != n_devices:
            raise ValueError(f"mesh {self.as_dict()} needs {math.prod(sizes)} devices, {n_devices} available")
        return tuple(sizes)

    def as_dict(self) -> dict[str, int]:
        return {k: getattr(self, k) for k in MESH_AXES}


@dataclasses.dataclass(frozen=True)
class Preset:
    """A slice we plan for. `train` / `generate` are the recommended meshes for each job."""
    name: str
    n_devices: int                  # JAX devices (chips; a v4/v5p megacore chip is one device)
    hbm_gib: float | None           # HBM per device (None: host memory, simulated)
    topology: str | None            # `get_topology_desc` name for ahead-of-time compiles (None: CPU)
    chips_per_host: tuple[int, int, int] | None
    train: MeshSpec
    generate: MeshSpec
    chip_config: str = "default"    # `get_topology_desc` chip config: v4 pods run "megacore" (2 cores, 1 device)


PRESETS: dict[str, Preset] = {p.name: p for p in (
    Preset("cpu-8", 8, None, None, None, MeshSpec(2, 2, 2), MeshSpec(2, 2, 2)),
    Preset("v5e-8", 8, 16, "v5e:2x4", (2, 4, 1), MeshSpec(1, 8, 1), MeshSpec(1, 1, 8)),
    Preset("v5e-16", 16, 16, "v5e:4x4", (2, 2, 1), MeshSpec(1, 16, 1), MeshSpec(2, 1, 8)),
    Preset("v5p-8", 4, 95, "v5p:2x2x1", (2, 2, 1), MeshSpec(1, 4, 1), MeshSpec(1, 1, 4)),
    Preset("v4-32", 16, 32, "v4:2x2x4", (2, 2, 1), MeshSpec(1, 16, 1), MeshSpec(2, 1, 8), "megacore"),
    Preset("v5p-64", 32, 95, "v5p:4x4x2", (2, 2, 1), MeshSpec(2, 16, 1), MeshSpec(4, 1, 8)),
)}


def preset(name: str) -> Preset:
    if name not in PRESETS:
        raise ValueError(f"unknown mesh preset {name!r}; choose one of {', '.join(PRESETS)}")
    return PRESETS[name]


def make_mesh(spec=None, devices=None) -> Mesh:
    """A `Mesh` with axes `MESH_AXES` (Auto axis types) over `devices` (default: all of `jax.devices()`)."""
    devices = list(jax.devices() if devices is None else devices)
    shape = MeshSpec.parse(spec if spec is not None else {}).shape(len(devices))
    return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * 3, devices=devices)


# ------------------------------------------------------------------------------------------------ specs

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


def param_axes(cfg, lora=None) -> dict:
    """The parameter tree (params.py layout; with `lora`, its adapters too) with each leaf's logical axes, as
    its module declares them."""
    from flax import nnx

    from .model import abstract_model
    from .params import set_path

    out: dict = {}
    for path, var in nnx.to_flat_state(abstract_model(cfg, lora)[1]):
        axes = var.get_metadata().get("out_sharding")
        if axes is None or len(axes) != len(var.shape):
            raise ValueError(f"parameter {'/'.join(map(str, path))} of shape {var.shape} has logical axes {axes}")
        set_path(out, tuple(path), tuple(axes))
    return out


def param_specs(cfg, mesh, lora=None) -> dict:
    """PartitionSpec per parameter leaf (`mesh` None: the rules without divisibility checks)."""
    from .params import flatten, get_path, param_shapes, set_path

    axes = param_axes(cfg, lora)
    out: dict = {}
    for path, shape in flatten(param_shapes(cfg, lora)):
        set_path(out, path, spec_for(shape, get_path(axes, path), mesh))
    return out


def param_shardings(cfg, mesh: Mesh, lora=None) -> dict:
    """NamedSharding per parameter leaf."""
    return jax.tree.map(lambda s: NamedSharding(mesh, s), param_specs(cfg, mesh, lora),
                        is_leaf=lambda x: isinstance(x, P))


def abstract_sharded_params(cfg, mesh: Mesh, dtype, lora=None) -> dict:
    """ShapeDtypeStruct leaves carrying their shardings: the model on a mesh without a byte of weights."""
    from .params import abstract_params

    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                        abstract_params(cfg, dtype, lora), param_shardings(cfg, mesh, lora))


def cache_sharding(mesh: Mesh, shape) -> NamedSharding:
    return NamedSharding(mesh, spec_for(shape, CACHE_AXES, mesh))


def batch_sharding(mesh: Mesh, shape, logical: tuple | None = None) -> NamedSharding:
    """Inputs: the leading axis (batch) over data × fsdp, the rest replicated (or the given logical axes)."""
    logical = logical or ("batch",) + (None,) * (len(shape) - 1)
    return NamedSharding(mesh, spec_for(shape, logical, mesh))


def opt_state_shardings(opt_state, params_shardings: dict, mesh: Mesh):
    """Optimizer state inherits each parameter's sharding: a state leaf whose path ends in a parameter's path
    with that parameter's shape (Adam's mu/nu, whatever wraps them) gets the parameter's sharding; anything
    else (step counts, schedule state) is replicated. `opt_state` may be abstract (`jax.eval_shape`)."""
    by_path = {tuple(getattr(k, "key", None) for k in path): sh
               for path, sh in jax.tree_util.tree_flatten_with_path(params_shardings)[0]}
    replicated = NamedSharding(mesh, P())

    def pick(path, leaf):
        keys = []
        for k in reversed(path):
            if not isinstance(k, jax.tree_util.DictKey):
                break
            keys.insert(0, k.key)
        sh = by_path.get(tuple(keys))
        if sh is not None and len(sh.spec) == len(getattr(leaf, "shape", ())):
            return sh
        return replicated

    return jax.tree_util.tree_map_with_path(pick, opt_state)
