"""`PrismaVL` on a 2×2×2 CPU mesh (4 batch shards) takes batches of any row count: forward, the codes and greedy
generation of 2 and 3 rows (text, and a row with an image) equal the one-device model's, in the real rows' shapes.

The mesh needs 8 host devices, so the scenario runs in its own process (`python test_api_mesh_padding.py CKPT
OUT`, XLA_FLAGS set before JAX is imported), as tests/sharding_worker.py's do."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MESH = {"data": 2, "fsdp": 2, "tensor": 2}
GRID = (1, 4, 6)
CASES = ("text2", "text3", "image2", "image3")


@pytest.fixture(scope="module")
def res(tmp_path_factory):
    from hf_tiny import build_model, save_checkpoint, tiny_hf_config

    d = tmp_path_factory.mktemp("mesh_padding")
    table = np.random.default_rng(3).normal(0, 0.02, (256, 64)).astype(np.float32)
    ckpt = save_checkpoint(build_model(tiny_hf_config()), str(d / "ckpt"), table=table)
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    out = str(d / "res.json")
    p = subprocess.run([sys.executable, os.path.abspath(__file__), ckpt, out], env=env, capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    with open(out) as f:
        return json.load(f)


@pytest.mark.parametrize("case", CASES)
def test_forward_and_codes_match_one_device(res, case):
    r = res[case]
    rows = int(case[-1])
    assert r["logits_shape"][0] == rows and r["logits_shape"] == r["logits_shape_one"]
    assert r["forward_max_diff"] <= 1e-5
    assert r["codes_shape"] == r["logits_shape"][:2] and r["codes_equal"]
    assert r["codes_in_max_diff"] <= 1e-5


@pytest.mark.parametrize("case", CASES)
def test_generation_matches_one_device(res, case):
    r = res[case]
    assert r["generate_rows"] == int(case[-1])
    assert r["generate_tokens_equal"] and r["generate_codes_equal"]


# ---------------------------------------------------------------------------------------------- the subprocess

def _inputs(case: str):
    """Left-padded prompts of 2 or 3 rows, 12 wide (one shape: fewer compiles); the image cases put one image in
    row 0 (packed pixel_values)."""
    from hf_tiny import image_tokens, random_pixels

    rng = np.random.default_rng(1)
    rows = [list(rng.integers(7, 128, n)) for n in (9, 4, 12)[:int(case[-1])]]
    kw = {}
    if case.startswith("image"):
        rows[0] = [20, 21, *image_tokens(GRID), 22]
        kw = dict(pixel_values=random_pixels([GRID], seed=2), image_grid_thw=[GRID])
    s = 12
    ids = np.zeros((len(rows), s), np.int64)
    mask = np.zeros((len(rows), s), np.int64)
    for i, r in enumerate(rows):
        ids[i, s - len(r):], mask[i, s - len(r):] = r, 1
    return ids, mask, kw


def _scenario(ckpt: str, out: str) -> None:
    import jax

    from prisma_jax.api import PrismaVL

    assert len(jax.devices()) == 8
    one = PrismaVL.from_pretrained(ckpt)
    sh = PrismaVL.from_pretrained(ckpt, mesh=MESH)
    res = {}
    for case in CASES:
        ids, mask, kw = _inputs(case)
        l1, l8 = np.asarray(one.forward(ids, mask, **kw)), sh.forward(ids, mask, **kw)
        c1, c8 = one.uncertainty_codes(l1), sh.uncertainty_codes(l8)
        codes_in = np.where(mask > 0, np.random.default_rng(4).integers(-1, 256, ids.shape), -1)
        k1 = np.asarray(one.forward(ids, mask, codes_in=codes_in, **kw))
        k8 = np.asarray(sh.forward(ids, mask, codes_in=codes_in, **kw))
        g1 = one.generate(ids, mask, max_new_tokens=5, **kw)
        g8 = sh.generate(ids, mask, max_new_tokens=5, **kw)
        res[case] = {
            "logits_shape": list(l8.shape), "logits_shape_one": list(l1.shape),
            "forward_max_diff": float(np.max(np.abs(l1 - np.asarray(l8)))),
            "codes_shape": list(c8.shape), "codes_equal": bool(np.array_equal(c1, c8))
            and bool(np.array_equal(c1, sh.uncertainty_codes(np.asarray(l8)))),
            "codes_in_max_diff": float(np.max(np.abs(k1 - k8))),
            "generate_rows": int(g8.tokens.shape[0]),
            "generate_tokens_equal": bool(np.array_equal(g1.tokens, g8.tokens)),
            "generate_codes_equal": bool(np.array_equal(g1.codes, g8.codes)),
        }
    with open(out, "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"   # before JAX is imported
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.path[:0] = [ROOT, os.path.dirname(os.path.abspath(__file__))]
    _scenario(*sys.argv[1:])
