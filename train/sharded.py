"""Training on a device mesh (`train.mesh`): where the state and each batch live.

The parameters follow the model's logical rules (prisma_jax/core/partitioning.py), Adam's moments follow their
parameter, step and RNG are replicated. A batch `[A, b, S]` is split over the batch axes (data × fsdp) on its
row axis; each process puts only its own rows (train/data.py already reads `process_index::process_count`),
so the same code runs on one host and on a pod. Pixel values are per row (`[A, b, slots·patches, ·]`, each
row's own image slots) and shard with their rows, so a host's images land on the devices of its rows; the
vision geometry describes one row's slots, the same on every host, and is replicated.
"""
from __future__ import annotations

import functools

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from prisma_jax.parallel import multihost
from prisma_jax.parallel.distribute import load_hf_sharded, put_global
from prisma_jax.parallel.mesh import make_mesh
from prisma_jax.parallel.placement import opt_state_shardings, param_shardings

from train.config import Config
from train.step import TrainBatch, TrainState, fresh_state, is_trained, lora_init, partition

# the row (batch) axis of each TrainBatch field
ROW_AXIS = {"input_ids": 1, "attention_mask": 1, "codes": 1, "targets": 1, "positions": 2, "pixel_values": 1}


def mesh_of(cfg: Config) -> Mesh | None:
    return None if cfg.train.mesh is None else make_mesh(cfg.train.mesh)


def _lora_shardings(cfg: Config, mesh: Mesh) -> tuple[dict, dict]:
    """(shardings of the trained leaves, of the frozen base) of a LoRA run: an adapter follows its kernel's
    layer and model axes (lora_a [layers, in, r] like the kernel's in, lora_b [layers, r, out] like its out)."""
    ps = param_shardings(cfg.model, mesh, cfg.train.lora)
    return partition(ps, lambda p: is_trained(cfg, p))


def state_shardings(cfg: Config, mesh: Mesh) -> TrainState:
    """A TrainState of NamedShardings (for jit's out_shardings and for restoring checkpoints)."""
    ps = param_shardings(cfg.model, mesh) if cfg.train.lora is None else _lora_shardings(cfg, mesh)[0]
    abstract = jax.eval_shape(lambda: fresh_state(cfg, jax.random.PRNGKey(0)))
    rep = NamedSharding(mesh, P())
    opt = opt_state_shardings(abstract.opt_state, ps, mesh)
    return TrainState(rep, ps, opt, rep)


@functools.lru_cache(maxsize=8)
def _init_fn(cfg: Config, mesh: Mesh, given: bool):
    """One jitted init per config and mesh (a second run in the same process compiles nothing): `fresh_state`,
    or with LoRA `lora_init` then `fresh_state` of the trained leaves, returning (state, base)."""
    sh = state_shardings(cfg, mesh)
    if cfg.train.lora is not None:
        trained_sh, base_sh = _lora_shardings(cfg, mesh)
        first = jax.jit(lambda k, p: lora_init(cfg, k, p), out_shardings=(trained_sh, base_sh))
        then = jax.jit(lambda k, p: fresh_state(cfg, k, p), out_shardings=sh, donate_argnums=1)

        def init(k, p=None):
            trained, base = first(k, p)
            return then(k, trained), base
        return init
    if given:
        step = jax.jit(lambda k, p: fresh_state(cfg, k, p), out_shardings=sh, donate_argnums=1)
        return lambda k, p: (step(k, p), None)
    step = jax.jit(lambda k: fresh_state(cfg, k), out_shardings=sh)
    return lambda k: (step(k), None)


def init_state(cfg: Config, mesh: Mesh):
    """train/step.py's `fresh_state` (with LoRA also the frozen base: `lora_init`), created directly in its
    shardings: random params are drawn by a program whose outputs are sharded, `train.init` is read shard by
    shard; nothing whole on a device. Returns (state, base or None)."""
    key = jax.random.PRNGKey(cfg.train.seed)
    if cfg.train.init is None:
        return _init_fn(cfg, mesh, False)(key)
    params, _ = load_hf_sharded(cfg.train.init, mesh, dtype="float32")
    return _init_fn(cfg, mesh, True)(key, params)


def put_state(state: TrainState, shardings: TrainState) -> TrainState:
    """A host (NumPy or single-device) state that every process holds in full → the sharded state."""
    return jax.tree.map(lambda x, s: put_global(np.asarray(x), s), state, shardings)


def put_batch(batch: TrainBatch, mesh: Mesh) -> TrainBatch:
    """This process's rows of the global batch → global Arrays sharded over the batch axes."""
    rep = NamedSharding(mesh, P())
    out = {}
    for name, x in zip(batch._fields, batch):
        if x is None:
            out[name] = None
        elif name in ROW_AXIS:
            out[name] = multihost.host_batch(np.asarray(x), mesh, batch_axis=ROW_AXIS[name])
        else:                                         # the geometry
            out[name] = jax.tree.map(lambda g: put_global(g, rep), x)
    return TrainBatch(**out)
