"""The decode core's types (infer/core.py, nn/kvcache.py): the cache's two layouts, its abstract form and
shardings, the explicit mode, and the layout chosen at bind time."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from prisma_jax.core.config import load_config
from prisma_jax.core.partitioning import CACHE_AXES, spec_for
from prisma_jax.infer import core
from prisma_jax.nn.kvcache import KVCache, Mode
from prisma_jax.nn.model import Batch
from prisma_jax.nn.params import init_params_numpy
from prisma_jax.nn.text import is_unrolled

CFG = load_config("configs/tiny.yaml")


def test_cache_layouts_round_trip():
    tc = CFG.text
    c = KVCache.zeros(CFG, 3, 40, jnp.float32)
    assert c.k.shape == (tc.num_hidden_layers, 3, tc.num_key_value_heads, 40, tc.head_dim) and not c.per_layer
    c = KVCache(*(jnp.asarray(np.random.default_rng(i).standard_normal(c.k.shape), jnp.float32) for i in range(2)))
    per = c.unstacked()
    assert per.per_layer and len(per.k) == tc.num_hidden_layers and per.slots == c.slots == 40
    np.testing.assert_array_equal(per.layer(1)[1], c.v[1])
    back = per.stacked()
    assert jax.tree.structure(back) == jax.tree.structure(c)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(c)):
        np.testing.assert_array_equal(a, b)
    assert per.unstacked() is per and c.stacked() is c
    again = KVCache.from_layers(per.layer(i) for i in range(tc.num_hidden_layers))
    assert all(a is b for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(per)))
    z = KVCache.zeros(CFG, 3, 40, jnp.bfloat16, per_layer=True)
    assert z.per_layer and z.k[0].shape == c.k.shape[1:] and z.k[0].dtype == jnp.bfloat16
    # the leaves flatten k then v, as the dict {"k", "v"} of 0.1 did (the compiled programs' parameter order)
    assert jax.tree.leaves(c)[0] is c.k and jax.tree.leaves(c)[1] is c.v


def test_abstract_state_matches_a_real_one():
    state = core.DecodeState(KVCache.zeros(CFG, 2, 24, jnp.bfloat16), jnp.zeros(2, jnp.int32),
                             jnp.zeros(2, jnp.uint16), jnp.zeros(2, jnp.int32), jnp.zeros(2, jnp.int32))
    abstract = core.DecodeState.abstract(CFG, 2, 24, jnp.bfloat16)
    assert jax.tree.structure(abstract) == jax.tree.structure(state)
    assert [(a.shape, a.dtype) for a in jax.tree.leaves(abstract)] == \
        [(a.shape, a.dtype) for a in jax.tree.leaves(state)]


def test_cache_shardings_follow_the_cache_axes():
    """On 4 abstract TPU devices (data 2 × tensor 2): rows over the batch axes, KV heads over tensor, stacked
    and per layer alike."""
    pytest.importorskip("libtpu")
    from jax.experimental import topologies

    devices = topologies.get_topology_desc(platform="tpu", topology_name="v5p:2x2x1").devices
    mesh = jax.sharding.Mesh(np.asarray(devices).reshape(2, 1, 2), ("data", "fsdp", "tensor"))
    c = KVCache.abstract(CFG, 4, 32, jnp.bfloat16, mesh)
    want = spec_for(c.k.shape, CACHE_AXES, mesh)
    assert want[1] == ("data", "fsdp") and want[2] == "tensor"
    assert c.k.sharding.spec == want and c.shardings(mesh).v.spec == want
    per = KVCache(*(tuple(jax.ShapeDtypeStruct(c.k.shape[1:], c.k.dtype) for _ in range(c.k.shape[0])) for _ in "kv"))
    assert per.shardings(mesh).k[0].spec == spec_for(c.k.shape[1:], CACHE_AXES[1:], mesh)


def test_the_mode_is_explicit():
    params = jax.tree.map(jnp.asarray, init_params_numpy(CFG, 0))
    model = core.bind(CFG, params)
    b = Batch(jnp.ones((1, 4), jnp.int32), jnp.ones((1, 4), bool), jnp.full((1, 4), -1, jnp.int32),
              jnp.zeros((3, 1, 4), jnp.int32))
    cache = KVCache.zeros(CFG, 1, 8, jnp.float32)
    with pytest.raises(ValueError, match="names its mode"):
        model.hidden(b, cache, 0, jnp.ones((1, 8), bool))
    with pytest.raises(ValueError, match="mode Mode.PREFILL with cache absent"):
        model.hidden(b, mode=Mode.PREFILL)


def test_the_layer_layout_is_chosen_at_bind():
    params = jax.tree.map(jnp.asarray, init_params_numpy(CFG, 0))
    stacked, unrolled = core.bind(CFG, params), core.bind(CFG, params, unroll=True)
    assert not is_unrolled(stacked.text) and is_unrolled(unrolled.text)
    cache = KVCache.zeros(CFG, 1, 8, jnp.float32)
    assert core.in_layout(stacked, cache) is cache and core.in_layout(unrolled, cache).per_layer
