"""Ahead-of-time compiles of the tiny model with the real TPU compiler (libtpu, `[tpu]` extra) for a v5p:2x2x1
topology, from this CPU machine: generate.py's decode loop compiles for TPU and its HLO all-gathers no table
and no `[B, V]` logits (the TPU partitioner is the one that matters); the planned training step carries its
image slots, whose pixels the compiler counts in every device's arguments; with `attention: auto` the TPU compiler
accepts the training step with splash attention's Pallas kernels and the decode loop with the paged decode kernel,
and `prisma plan` says so."""
import json
import math
import os
import subprocess
import sys

HERE = os.path.dirname(__file__)


def test_tiny_decode_step_compiles_for_tpu_without_table_gathers(tmp_path):
    out = str(tmp_path / "tpu.json")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    p = subprocess.run([sys.executable, os.path.join(HERE, "sharding_worker.py"), "tpu", out], env=env,
                       capture_output=True, text=True, timeout=1800)
    assert p.returncode == 0, p.stderr[-3000:]
    with open(out) as f:
        r = json.load(f)
    assert r["platform"] == "tpu" and r["n_devices"] == 4 and r["hlo_has_tpu_layout"]
    assert r["forbidden"] == [] and r["hlo_has_while"]       # the whole `lax.while_loop`, not one step
    # with head dim 128 the TPU compiler accepts the decode loop with jax's paged decode kernel (sharded over
    # fsdp × tensor), which "xla" does not call
    assert [k.split("_inline")[0] for k in r["decode_kernels"]["auto"]] == ["paged_flash_attention_kernel"]
    assert r["decode_kernels"]["xla"] == []
    # every TPU preset's abstract topology has the preset's device count (v4: megacore chips, one device each)
    from prisma_jax.parallel.mesh import PRESETS
    assert r["topology_devices"] == {p.name: p.n_devices for p in PRESETS.values() if p.topology}
    assert r["arguments"] > 0 and r["memory_total"] >= r["arguments"]

    # training, batch 8 × seq 64 on fsdp=4, 0 or 2 image slots a row of 64² (a 4 × 4 patch grid): the slots are
    # 8 · 2 · 16 patch rows of 3 · 2 · 16² float32 pixels, whole on every device or split over the 4 row shards
    # (train/sharded.py decides), plus their geometry (≤ 4 + 4 + 3 numbers a patch, 4 bytes each; the compiler
    # may drop a leaf the program does not read)
    n = 8 * 2 * 16
    pixel_bytes, geometry_bytes = n * 3 * 2 * 16 * 16 * 4, n * 11 * 4
    t0, t2 = r["train"]["0"], r["train"]["2"]
    assert t0["pixel_shape"] is None and math.prod(t2["pixel_shape"]) == n * 3 * 2 * 16 * 16
    assert t2["pixel_bytes"] in (pixel_bytes, pixel_bytes // 4)
    added = t2["arguments"] - t0["arguments"]
    assert t2["pixel_bytes"] <= added <= t2["pixel_bytes"] + geometry_bytes
    assert t2["temporaries"] > t0["temporaries"]               # the vision tower's activations


def test_plan_tiny_uses_splash_kernels_on_tpu_and_says_so():
    """`prisma plan` on v5p:2x2x1 with the YAML's `attention: auto`: the TPU compiler accepts the training step
    with splash attention's Pallas kernels (forward, dq and dkv), the plan says which attention each program ran
    (the decode loop: XLA), and `--attention xla` lowers no Pallas kernel."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=os.path.dirname(HERE))
    p = subprocess.run([sys.executable, "-m", "prisma_jax.apps.cli", "plan", "--config",
                        os.path.join(HERE, "..", "configs", "tiny.yaml"), "--mesh", "v5p-8", "--seq", "256"],
                       env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    train, decode = p.stdout.split("decode loop")
    assert "GiB of 95 GiB: fits" in train and "GiB of 95 GiB: fits" in decode
    assert "  attention: pallas (splash) (model.attention=auto)\n" in train
    assert "  attention: xla (model.attention=auto)\n" in decode                 # head_dim 32: no decode kernel

    script = ("import json; from prisma_jax.apps.plan import *; from prisma_jax.parallel.mesh import make_mesh, preset\n"
              "mesh = make_mesh(preset('v5p-8').train, plan_devices(preset('v5p-8')))\n"
              "print(json.dumps({a: pallas_kernels(lower_train(train_config('configs/tiny.yaml', 4, 256, "
              "[f'model.attention={a}']), mesh).as_text()) for a in ('xla', 'pallas')}))")
    q = subprocess.run([sys.executable, "-c", script], env=env, cwd=os.path.dirname(HERE), capture_output=True,
                       text=True, timeout=900)
    assert q.returncode == 0, q.stderr[-3000:]
    kernels = json.loads(q.stdout.strip().splitlines()[-1])
    assert kernels["xla"] == []
    # the causal text layers and the bidirectional vision tower, each with its backward (remat: full recomputes
    # the forward with residuals)
    assert {k.split("_segmented")[0] for k in kernels["pallas"]} == {"splash_mqa_fwd", "splash_mqa_dq",
                                                                      "splash_mqa_dkv"}
