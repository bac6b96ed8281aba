"""What importing prisma_jax sets up in the process (prisma_jax/core/runtime.py): glibc keeps freed pages, no result
changes by a bit, and libtpu stays quiet on a machine without a TPU."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "configs", "tiny.yaml")


def clean_env() -> dict:
    """This process's environment less what importing prisma_jax (here or in another test) may have set for libtpu."""
    return {k: v for k, v in os.environ.items()
            if not k.startswith("TPU_") and k not in ("ALLOW_MULTIPLE_LIBTPU_LOAD", "JAX_PLATFORMS")}


def run_py(code: str, **env) -> subprocess.CompletedProcess:
    full = clean_env()
    full.update(env)
    full = {k: v for k, v in full.items() if v != ""}
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=full, capture_output=True, text=True,
                          timeout=300)


# Page faults of a second 256 MB malloc + touch, after the first was freed: glibc as it is maps a fresh block
# (65,536 faults of 4 KiB pages); tuned, the freed pages are reused.
REFAULTS = """
import ctypes, resource, prisma_jax
libc = ctypes.CDLL(None); libc.malloc.restype = ctypes.c_void_p; libc.free.argtypes = [ctypes.c_void_p]
def touch():
    p = libc.malloc(256 << 20); ctypes.memset(p, 1, 256 << 20); return p
libc.free(touch())
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
libc.free(touch())
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.skipif(not hasattr(os, "confstr") or not os.confstr("CS_GNU_LIBC_VERSION"), reason="glibc only")
def test_freed_large_blocks_are_reused_without_page_faults():
    tuned = int(run_py(REFAULTS).stdout)
    off = int(run_py(REFAULTS, PRISMA_MALLOC_TUNING="0").stdout)
    assert off > 60_000, off            # the untuned allocator really unmaps and faults again
    assert tuned < off / 20, (tuned, off)


# logits of a forward pass, a generation's tokens and codes, and two training steps' losses and params
RESULTS = f"""
import hashlib, numpy as np, prisma_jax, jax
from prisma_jax import PrismaVL
from train.config import load_train_config
from train import data, step as S
m = PrismaVL.from_config({TINY!r}, seed=3)
ids = np.random.default_rng(0).integers(10, m.config.text.vocab_size, (2, 12))
h = hashlib.sha256(np.asarray(m.forward(ids)).tobytes())
g = m.generate(ids, max_new_tokens=6)
h.update(np.asarray(g.tokens).tobytes()); h.update(np.asarray(g.codes).tobytes())
cfg, _ = load_train_config({os.path.join(ROOT, "configs", "tiny_sft.yaml")!r}, ["data.source=synthetic"])
ds, _ = data.build(cfg, {{workdir!r}})
it, st = iter(ds), S.init_state(cfg)
fn = jax.jit(S.make_train_step(cfg, st.params), donate_argnums=0)
for _ in range(2):
    st, metrics = fn(st, next(it))
    h.update(np.asarray(metrics["loss"]).tobytes())
for leaf in jax.tree.leaves(st.params):
    h.update(np.asarray(leaf).tobytes())
print(h.hexdigest())
"""


def test_allocator_settings_change_no_result_by_a_bit(tmp_path):
    code = RESULTS.replace("{workdir!r}", repr(str(tmp_path)))
    tuned, off = run_py(code), run_py(code, PRISMA_MALLOC_TUNING="0")
    assert tuned.returncode == 0, tuned.stderr[-2000:]
    assert off.returncode == 0, off.stderr[-2000:]
    assert tuned.stdout == off.stdout and len(tuned.stdout.strip()) == 64


NOISE = ("TPU accelerator type", "TPU_WORKER_HOSTNAMES", "Source Location Trace", "libtpu_init_utils")
DEVICES_AND_TOPOLOGY = """
import sys
{first}
import jax
from jax.experimental import topologies
print(jax.devices()[0].platform, len(topologies.get_topology_desc(platform="tpu", topology_name="v5p:2x2x1").devices))
"""


def _has_libtpu():
    try:
        import libtpu  # noqa: F401
        return True
    except ImportError:
        return False


@pytest.mark.skipif(not _has_libtpu(), reason="needs libtpu (the [tpu] extra, which make test installs)")
def test_libtpu_is_quiet_without_a_tpu_and_still_compiles_for_tpu_topologies():
    from jax._src import hardware_utils
    assert hardware_utils.num_available_tpu_chips_and_device_id()[0] == 0, "this test is for TPU-less machines"
    plain = run_py(DEVICES_AND_TOPOLOGY.format(first=""))
    ours = run_py(DEVICES_AND_TOPOLOGY.format(first="import prisma_jax"))
    assert plain.returncode == 0 and ours.returncode == 0, (plain.stderr, ours.stderr)
    assert any(n in plain.stderr for n in NOISE), plain.stderr   # libtpu as it is: noisy
    assert not any(n in ours.stderr for n in NOISE), ours.stderr
    assert ours.stdout.split() == plain.stdout.split() == ["cpu", "4"]


@pytest.mark.skipif(not _has_libtpu(), reason="needs libtpu (the [tpu] extra, which make test installs)")
def test_a_second_process_loads_libtpu_beside_one_that_holds_its_lock():
    """libtpu as it is takes /tmp/libtpu_lockfile, and a second process that loads it then fails; with no chip to
    guard, prisma_jax switches the lock off, so a plan can run beside a test or another plan."""
    hold = DEVICES_AND_TOPOLOGY.format(first="") + "sys.stdin.read()\n"
    holder = subprocess.Popen([sys.executable, "-c", hold], cwd=ROOT, env=clean_env(), stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert holder.stdout.readline().split() == ["cpu", "4"]     # libtpu loaded, lock held
        plain = run_py(DEVICES_AND_TOPOLOGY.format(first=""))
        ours = run_py(DEVICES_AND_TOPOLOGY.format(first="import prisma_jax"))
    finally:
        holder.communicate("", timeout=60)
    assert plain.returncode != 0 and "lockfile" in plain.stderr, plain.stderr[-2000:]
    assert ours.returncode == 0 and ours.stdout.split() == ["cpu", "4"], ours.stderr[-2000:]

def test_switch_is_read_from_the_environment():
    out = run_py("from prisma_jax import runtime; print(runtime.tune_malloc())", PRISMA_MALLOC_TUNING="0")
    assert out.stdout.strip() == "False"
