"""An ahead-of-time compile of the tiny model's decode step with the real TPU compiler (libtpu, `[tpu]` extra)
for a v5p:2x2x1 topology, from this CPU machine: it compiles for TPU, and its HLO all-gathers no table and no
`[B, V]` logits (the TPU partitioner is the one that matters)."""
import json
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
    assert r["forbidden"] == []
    # every TPU preset's abstract topology has the preset's device count (v4: megacore chips, one device each)
    from prisma_jax.sharding import PRESETS
    assert r["topology_devices"] == {p.name: p.n_devices for p in PRESETS.values() if p.topology}
    assert r["arguments"] > 0 and r["memory_total"] >= r["arguments"]
