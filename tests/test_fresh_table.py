"""One initialisation of a fresh uncertainty table (`uncertainty.fresh_table`): for one seed, `from_config` with and
without a mesh, the Hugging Face loader, the sharded loader and hf-to-orbax conversion give the same table; on
the mesh it is born split. With it (one subprocess, 8 CPU devices): the batch rules at each boundary — an odd
batch is an error naming the sizes for forward, batch placement and training, and is padded by generation."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from hf_tiny import build_model, save_checkpoint, tiny_hf_config
from prisma_jax.api import PrismaVL
from prisma_jax.checkpoint.loading import load_hf

HERE = os.path.dirname(__file__)
SEED = 7


@pytest.fixture(scope="module")
def res(tmp_path_factory):
    d = tmp_path_factory.mktemp("table")
    ckpt = save_checkpoint(build_model(tiny_hf_config()), str(d / "plain"))      # Qwen3-VL: no table
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    out = str(d / "table.json")
    p = subprocess.run([sys.executable, os.path.join(HERE, "sharding_worker.py"), "table", ckpt, str(SEED), out],
                       env=env, capture_output=True, text=True, timeout=1800)
    assert p.returncode == 0, p.stderr[-3000:]
    with open(out) as f:
        r = json.load(f)
    return ckpt, r, dict(np.load(out + ".npz")), d


def test_every_path_gives_the_same_table_for_one_seed(res):
    from conversion.hf_to_orbax import convert

    ckpt, _, mesh_tables, d = res
    tables = dict(mesh_tables)
    tables["from_config"] = np.asarray(PrismaVL.from_config(ckpt, seed=SEED).params["uncertainty"]["embedding"])
    params, cfg = load_hf(ckpt, uncertainty_init="normal", seed=SEED)
    tables["hf"] = params["uncertainty"]["embedding"]
    convert(ckpt, str(d / "orbax"), dtype="float32", init_uncertainty="normal", seed=SEED, progress=False)
    tables["orbax"] = np.asarray(PrismaVL.from_pretrained(str(d / "orbax")).params["uncertainty"]["embedding"])
    assert set(tables) == {"from_config", "from_config_mesh", "hf", "hf_mesh", "orbax"}
    ref = tables["hf"]
    assert ref.shape == (2**cfg.n_bits, cfg.text.hidden_size) == (65536, 64) and ref.dtype == np.float32
    for name, t in tables.items():
        np.testing.assert_array_equal(t, ref, err_msg=name)
    # a normal(0, 0.02) table: 4.2M draws put the sample moments within a few standard errors
    assert abs(ref.mean()) < 5 * 0.02 / 2048 and abs(ref.std() - 0.02) < 5 * 0.02 / 2900
    assert len(np.unique(ref, axis=0)) == len(ref)               # every row its own stream
    other, _ = load_hf(ckpt, uncertainty_init="normal", seed=SEED + 1)
    assert np.mean(other["uncertainty"]["embedding"] == ref) < 1e-4
    zeros, _ = load_hf(ckpt, seed=SEED)                           # the default stays the all-zero table
    assert not zeros["uncertainty"]["embedding"].any()


def test_the_mesh_table_is_born_split(res):
    _, r, _, _ = res
    for name, (shape, shard_shapes, n) in r["table_shards"].items():
        # rows on tensor (2), columns on fsdp (2): each of the 8 devices holds a quarter
        assert shape == [65536, 64] and shard_shapes == [[32768, 32]] and n == 8, name


def test_an_odd_batch_is_an_error_naming_the_sizes_at_each_training_boundary(res):
    """Inference pads an odd batch (`forward` below, generation in the next test); the training boundaries keep
    the loud error."""
    _, r, _, _ = res
    sizes = "data=2 × fsdp=2 = 4"
    assert r["forward_odd_batch"] is None and r["forward_odd_batch_equal"] and r["forward_even_batch"] is None
    assert "batch dimension 6" in r["host_batch_odd_rows"] and sizes in r["host_batch_odd_rows"]
    assert "batch dimension 6" in r["host_rows_odd_batch"] and sizes in r["host_rows_odd_batch"]
    assert r["train_odd_micro_batch"] == ("train.batch_size 12 / train.grad_accum 2 = 6 rows per micro-batch is not "
                                          "a multiple of the mesh's 4 batch shards (data × fsdp of "
                                          "{'data': 2, 'fsdp': 2, 'tensor': 2})")


def test_generation_pads_an_odd_batch_and_matches_one_device(res):
    _, r, _, _ = res
    assert r["generate_odd_batch_shape"][0] == 3 and r["generate_odd_batch_equal"]
