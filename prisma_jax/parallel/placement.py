"""Where each array lives on a mesh: parameters (their modules' declared logical axes through
core/partitioning.py's rules), optimizer state (inherited from its parameter), KV caches and batches."""
from __future__ import annotations

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from prisma_jax.core.partitioning import CACHE_AXES, spec_for
from prisma_jax.core.trees import flatten, get_path, set_path
from prisma_jax.nn.model import abstract_model
from prisma_jax.nn.params import abstract_params, param_shapes


def param_axes(cfg, lora=None) -> dict:
    """The parameter tree (params.py layout; with `lora`, its adapters too) with each leaf's logical axes, as
    its module declares them."""
    out: dict = {}
    for path, var in nnx.to_flat_state(abstract_model(cfg, lora)[1]):
        axes = var.get_metadata().get("out_sharding")
        if axes is None or len(axes) != len(var.shape):
            raise ValueError(f"parameter {'/'.join(map(str, path))} of shape {var.shape} has logical axes {axes}")
        set_path(out, tuple(path), tuple(axes))
    return out


def param_specs(cfg, mesh, lora=None) -> dict:
    """PartitionSpec per parameter leaf (`mesh` None: the rules without divisibility checks)."""

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
