"""Putting the model and its inputs onto a mesh, shard by shard: no full copy on one device or host.

* `load_hf_sharded`: a safetensors checkpoint → parameters created directly in their shardings; every device's
  shard is read from the memory-mapped file (`safetensors_io.Checkpoint`) by `jax.make_array_from_callback`,
  so only that shard's bytes are ever touched, on the host that owns the device.
* `init_sharded`: random parameters produced by a jitted `params.init_params` with `out_shardings` (threefry is
  partitionable, so the numbers equal the single-device ones).
* `put_global` / `shard_batch`: host arrays (the same global array on every host) → global jax Arrays laid
  out by the batch rules. `multihost.host_batch` is the per-host-slice variant for input pipelines.

The layout itself (which axis goes where) is core/partitioning.py's business; this file only places bytes.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from prisma_jax.checkpoint import hf_names as HN
from prisma_jax.core.trees import flatten, get_path, set_path
from prisma_jax.nn.params import init_params, param_shapes
from prisma_jax.checkpoint.loading import open_checked, resolve_dtype
from prisma_jax.core.config import ModelConfig
from prisma_jax.checkpoint.safetensors import Checkpoint
from prisma_jax.parallel.placement import batch_sharding, param_shardings
from prisma_jax.core.partitioning import spec_for
from prisma_jax.nn.uncertainty import check_table_init, fresh_table


def _read(ck: Checkpoint, n: HN.HFName, idx: tuple, dtype) -> np.ndarray:
    """The `idx` slice (in our layout) of one Hugging Face tensor, touching only those bytes where possible."""
    w = ck.get(n.hf)
    if n.to_jax is HN._t:                  # [in, out] kernel stored as [out, in]: slice first, then transpose
        out = np.swapaxes(w[tuple(idx[::-1])], -1, -2)
    elif n.to_jax is HN._ident:
        out = w[tuple(idx)]
    else:                                  # patch-embed reshape: small, convert whole then slice
        out = n.to_jax(w)[tuple(idx)]
    return np.ascontiguousarray(out, dtype=dtype)


def load_hf_sharded(directory: str, mesh: Mesh, dtype="float32", uncertainty_init: str = "zeros",
                    seed: int = 0) -> tuple[dict, ModelConfig]:
    """`loading.load_hf`, but each leaf is born sharded on `mesh` (by the logical axes its module declares:
    sharding.param_axes).

    A plain Qwen3-VL checkpoint gets `uncertainty.fresh_table(seed)` — the same table as `load_hf` — created in
    its sharding, so no device or host holds it whole.
    """
    check_table_init(uncertainty_init)
    target = resolve_dtype(dtype)
    ck = Checkpoint(directory)
    try:
        cfg, names = open_checked(ck, directory)
        out_dtype = target or ck.dtype(names[0].hf)
        by_path: dict = {}
        for n in names:
            if n.hf in ck.where:
                by_path.setdefault(n.path, []).append(n)
        shardings = param_shardings(cfg, mesh)
        params: dict = {}
        for path, shape in flatten(param_shapes(cfg)):
            sh = get_path(shardings, path)
            entries = by_path.get(path)
            if entries is None:       # the uncertainty table of a plain Qwen3-VL checkpoint
                arr = fresh_table(seed, shape, out_dtype, uncertainty_init, sharding=sh)
            elif entries[0].index is None:
                n = entries[0]
                arr = jax.make_array_from_callback(shape, sh, lambda idx, n=n: _read(ck, n, idx, out_dtype))
            else:
                def cb(idx, entries=entries):
                    rows = range(len(entries))[idx[0]]
                    return np.stack([_read(ck, entries[i], idx[1:], out_dtype) for i in rows])
                arr = jax.make_array_from_callback(shape, sh, cb)
            set_path(params, path, arr)
    finally:
        ck.close()
    return params, cfg


def init_sharded(cfg: ModelConfig, mesh: Mesh, key: jax.Array, dtype=jnp.float32,
                 uncertainty_init: str = "normal") -> dict:
    """`params.init_params` compiled with the parameter shardings as outputs: nothing is materialised whole."""
    shardings = param_shardings(cfg, mesh)
    fn = jax.jit(lambda k: init_params(cfg, k, dtype, uncertainty_init=uncertainty_init),
                 out_shardings=shardings)
    return fn(key)


def put_global(x, sharding: NamedSharding) -> jax.Array:
    """A host array that every process holds in full → a global Array; each device gets only its slice."""
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])


def shard_batch(batch, mesh: Mesh):
    """A `model.Batch` of host arrays → global Arrays: [B, ...] over the batch axes, positions [3, B, S] too,
    vision inputs (a packed patch list) replicated."""
    rep = NamedSharding(mesh, P())

    def put(name, x):
        if x is None:
            return None
        if name == "positions":
            return put_global(x, NamedSharding(mesh, spec_for(x.shape, (None, "batch", None), mesh)))
        if name in ("input_ids", "attention_mask", "codes"):
            return put_global(x, batch_sharding(mesh, np.shape(x)))
        if name == "geometry":
            return jax.tree.map(lambda g: put_global(g, rep), x)
        return put_global(x, rep)

    return type(batch)(*(put(k, v) for k, v in zip(batch._fields, batch)))
