"""`prisma convert`: HF → Orbax → HF is bit-identical, the Orbax copy gives the source's logits, transformers
loads the export, plain Orbax restores read the arrays, and a mesh restore places shards without gathering."""
import json
import os
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest
import torch
from transformers import Qwen3VLForConditionalGeneration

from conversion import convert, export, restore_params
from hf_tiny import build_model, reference_logits, save_checkpoint, tiny_hf_config
from prisma_jax import PrismaVL
from prisma_jax.apps.cli import main as cli
from prisma_jax.checkpoint.loading import load_hf
from prisma_jax.checkpoint.hf_names import UNCERTAINTY_KEY
from prisma_jax.core.trees import flatten
from prisma_jax.checkpoint.safetensors import Checkpoint

IDS = np.random.default_rng(0).integers(7, 128, (2, 9))   # text tokens (0..6 are special in hf_tiny)


def _tensors(directory):
    with Checkpoint(directory) as ck:
        return {k: (ck.dtype(k), ck.shape(k), ck.get(k).tobytes()) for k in ck.keys()}


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """fp32 Prisma-VL (untied, 8-bit table, one file) and bf16 plain Qwen3-VL (tied, 7 shards)."""
    root = tmp_path_factory.mktemp("convert")
    m32 = build_model(tiny_hf_config(tie=False), seed=1)
    table = (0.02 * np.random.default_rng(2).standard_normal((256, 64))).astype(np.float32)
    save_checkpoint(m32, str(root / "p32"), table=table)
    with open(root / "p32" / "tokenizer_config.json", "w") as f:     # a side file that must travel
        json.dump({"chat_template": "{{ messages }}"}, f)
    m16 = build_model(tiny_hf_config(tie=True), seed=3)
    m16.to(torch.bfloat16).save_pretrained(root / "q16", max_shard_size="100KB")
    m16.float()
    return root, m32, m16, table


@pytest.mark.parametrize("name,dtype", [("p32", "float32"), ("q16", "bfloat16")])
def test_round_trip_is_bit_identical(sources, name, dtype):
    root, *_ = sources
    src, orb, out = root / name, root / f"{name}.orbax", root / f"{name}.hf"
    assert cli(["convert", "hf-to-orbax", str(src), str(orb)]) == 0
    assert cli(["convert", "orbax-to-hf", str(orb), str(out), "--max-shard-size", "300KB"]) == 0
    a, b = _tensors(src), _tensors(out)
    if name == "q16":   # plain Qwen3-VL: the created table (zeros, docs/introspection-contract.md §1) is the one addition
        dt, shape, data = b.pop(UNCERTAINTY_KEY)
        assert shape == (2**16, 64) and dt == np.dtype(ml_dtypes.bfloat16) and not any(data)
    assert a.keys() == b.keys()
    for k in a:
        assert a[k] == b[k], k                                     # dtype, shape and every byte
    assert all(b[k][0] == np.dtype(dtype) for k in b)               # bf16 stays bf16
    index = json.load(open(out / "model.safetensors.index.json"))
    shards = sorted(set(index["weight_map"].values()))
    per_shard = {f: [k for k, v in index["weight_map"].items() if v == f] for f in shards}
    assert len(shards) > 1   # ≤ the limit, unless one tensor alone is larger (as transformers does)
    assert all(os.path.getsize(out / f) <= 300_000 + 20_000 or len(per_shard[f]) == 1 for f in shards)
    cfg = json.load(open(out / "config.json"))
    assert cfg["uncertainty_n_bits"] == (8 if name == "p32" else 16)
    meta = json.load(open(orb / "prisma_checkpoint.json"))
    assert meta["n_bits"] == cfg["uncertainty_n_bits"] and len(meta["tensors"]) == len(a) + (name == "q16")
    assert meta["uncertainty"] == ("checkpoint" if name == "p32" else "zeros")
    for side in ("config.json", "generation_config.json") + (("tokenizer_config.json",) if name == "p32" else ()):
        assert os.path.isfile(orb / side) and os.path.isfile(out / side)


def test_orbax_copy_gives_the_source_logits_and_plain_orbax_restores_it(sources):
    import orbax.checkpoint as ocp
    root, m32, *_ = sources
    orb = root / "p32.orbax2"
    convert(str(root / "p32"), str(orb))
    src_model = PrismaVL.from_pretrained(str(root / "p32"))
    orb_model = PrismaVL.from_pretrained(str(orb))
    assert orb_model.config == src_model.config and orb_model.config.n_bits == 8
    np.testing.assert_array_equal(np.asarray(orb_model.forward(IDS)), np.asarray(src_model.forward(IDS)))
    # Orbax's own readers, no target: the same arrays as the safetensors loader
    ref, _ = load_hf(str(root / "p32"), dtype="keep")
    for restored in (ocp.StandardCheckpointer().restore(str(orb)), ocp.PyTreeCheckpointer().restore(str(orb))):
        for (pa, a), (pb, b) in zip(flatten(ref), flatten(restored)):
            assert pa == pb and np.asarray(b).dtype == a.dtype and np.array_equal(np.asarray(b), a), pa


def test_plain_qwen3vl_with_zero_table_gives_transformers_logits(sources, tmp_path):
    root, _, m16, _ = sources
    src = tmp_path / "q32"
    save_checkpoint(m16, str(src))          # float32 plain Qwen3-VL, tied head
    assert cli(["convert", "hf-to-orbax", str(src), str(tmp_path / "o"), "--init-uncertainty", "zeros"]) == 0
    model = PrismaVL.from_pretrained(str(tmp_path / "o"))
    # reference: the checkpoint as transformers loads it (m16 itself went through .to(bf16).float(), which
    # also rounds its rotary inv_freq buffers to bf16 — a property of that object, not of the checkpoint)
    from transformers import Qwen3VLForConditionalGeneration
    ref = Qwen3VLForConditionalGeneration.from_pretrained(str(src)).eval()
    np.testing.assert_allclose(np.asarray(model.forward(IDS)), reference_logits(ref, IDS), atol=1e-5, rtol=0)


def test_transformers_loads_the_export(sources):
    root, m32, *_ = sources
    orb, out = root / "p32.orbax3", root / "p32.hf3"
    convert(str(root / "p32"), str(orb))
    export(str(orb), str(out), max_shard_bytes=200_000)
    loaded, info = Qwen3VLForConditionalGeneration.from_pretrained(str(out), output_loading_info=True)
    assert info["unexpected_keys"] == {UNCERTAINTY_KEY} or list(info["unexpected_keys"]) == [UNCERTAINTY_KEY]
    assert not info["missing_keys"] and not info.get("mismatched_keys")
    np.testing.assert_array_equal(reference_logits(loaded.eval(), IDS), reference_logits(m32, IDS))


def test_normal_table_and_dtype_option(sources, tmp_path):
    root, *_ = sources
    convert(str(root / "q16"), str(tmp_path / "n"), dtype="float32", init_uncertainty="normal", seed=5)
    params, cfg = restore_params(str(tmp_path / "n"))
    ref, _ = load_hf(str(root / "q16"), dtype="float32", uncertainty_init="normal", seed=5)
    for (pa, a), (pb, b) in zip(flatten(ref), flatten(params)):
        assert pa == pb and b.dtype == np.float32 and np.array_equal(a, b), pa
    table = params["uncertainty"]["embedding"]
    assert abs(float(table.std()) - 0.02) < 1e-3


def test_dry_run_writes_nothing_and_reports_memory(sources, capsys):
    root, *_ = sources
    dst = root / "never"
    assert cli(["convert", "hf-to-orbax", str(root / "q16"), str(dst), "--dry-run"]) == 0
    text = capsys.readouterr().out
    assert "text.layers.mlp.gate_proj.kernel" in text and "bfloat16" in text and "expected peak memory" in text
    assert not dst.exists() and not [p for p in os.listdir(root) if p.startswith(".never")]


_MESH_SCRIPT = r"""
import os, sys, numpy as np, jax
from jax.sharding import NamedSharding, PartitionSpec as P
from conversion import restore_params
from prisma_jax.checkpoint.loading import load_hf
from prisma_jax.nn.params import flatten, set_path
orb, src = sys.argv[1:]
mesh = jax.make_mesh((2, 2), ("fsdp", "tensor"))
ref, cfg = load_hf(src, dtype="keep")
shardings = {}
for path, a in flatten(ref):   # last axis over "tensor" where it divides, first over "fsdp" where it divides
    spec = [None] * a.ndim
    if a.shape[-1] % 2 == 0:
        spec[-1] = "tensor"
    if a.ndim > 1 and a.shape[0] % 2 == 0:
        spec[0] = "fsdp"
    set_path(shardings, path, NamedSharding(mesh, P(*spec)))
params, _ = restore_params(orb, shardings=shardings)
n = 0
for (path, a), (_, b) in zip(flatten(ref), flatten(params)):
    assert b.sharding == dict(flatten(shardings))[path], path
    for s in b.addressable_shards:
        np.testing.assert_array_equal(np.asarray(s.data), a[s.index])
        n += s.data.size < a.size
print("ok", n)
"""


def test_restore_onto_a_mesh_places_each_shard(sources, tmp_path):
    root, *_ = sources
    convert(str(root / "p32"), str(tmp_path / "o"))
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=4")
    r = subprocess.run([sys.executable, "-c", _MESH_SCRIPT, str(tmp_path / "o"), str(root / "p32")],
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split()[0] == "ok" and int(r.stdout.split()[1]) > 100   # shards really are partial
