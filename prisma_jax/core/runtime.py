"""Process settings that importing prisma_jax applies, before JAX starts a backend.

**The host allocator** (off with `PRISMA_MALLOC_TUNING=0`). XLA:CPU allocates every large buffer of a program
afresh on each call. glibc serves those from `mmap` (a thread's arena always maps chunks larger than its 64 MB
heap, whatever `M_MMAP_MAX` says) and unmaps them on free, so every call page-faults and zeroes its
temporaries again: on VMs that is a large share of a CPU step (docs/benchmarks.md). Four `mallopt` settings make
glibc keep the pages instead, as jemalloc's `retain` does: one arena for all threads (so large chunks come from
the main heap), no `mmap` for large chunks, never trim the heap, and grow it 64 MB at a time. They are set
through ctypes at import, so the `prisma` CLI, the Python API and the tests get them with nothing to install or
preload. They change where memory comes from, never a value (tested). Not glibc (musl, macOS) → nothing is
done. A process that preloads another allocator is unaffected: glibc's settings then govern nothing.

**libtpu on machines without a TPU.** The `[tpu]` extra installs libtpu for `prisma plan`'s ahead-of-time
compiles. On a machine without TPU chips, initialising it prints half a dozen lines of errors about
the accelerator type and worker hostnames it cannot find. There we describe the host as the single-host,
single-worker machine it is (`TPU_WORKER_HOSTNAMES=localhost`, `TPU_HOST_BOUNDS=1,1,1`), which libtpu accepts
silently; compiling for abstract TPU topologies is unchanged. With no chip to guard, libtpu's lock file
(`/tmp/libtpu_lockfile`, which makes a second process that loads libtpu fail) is switched off too
(`ALLOW_MULTIPLE_LIBTPU_LOAD=1`), so that a plan, a test and a compile can run side by side. Where chips are
present, or the variables are already set, nothing is touched.
"""
from __future__ import annotations

import ctypes
import os

MALLOC_SWITCH = "PRISMA_MALLOC_TUNING"

# glibc's mallopt parameters (malloc.h) and our values. The trim threshold is a size_t that mallopt takes as an
# int: −1 becomes SIZE_MAX, "never trim" (the largest positive int, 2 GiB, is smaller than one training step's
# temporaries, which then get trimmed and faulted in again on every step).
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -2, -4, -8
MALLOPT = {_M_ARENA_MAX: 1, _M_MMAP_MAX: 0, _M_TRIM_THRESHOLD: -1, _M_TOP_PAD: 64 << 20}


def tune_malloc() -> bool:
    """Apply `MALLOPT` to glibc's malloc unless `PRISMA_MALLOC_TUNING=0`; True when applied."""
    if os.environ.get(MALLOC_SWITCH, "1") == "0":
        return False
    try:
        if not os.confstr("CS_GNU_LIBC_VERSION"):
            return False
        mallopt = ctypes.CDLL(None).mallopt
    except (ValueError, OSError, AttributeError):   # not glibc
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return all(mallopt(param, value) == 1 for param, value in MALLOPT.items())


def _tpu_chips() -> int | None:
    try:
        from jax._src import hardware_utils   # jax's own detection (PCI vendor and device ids)
        return hardware_utils.num_available_tpu_chips_and_device_id()[0]
    except Exception:   # jax moved it: leave libtpu as it is
        return None


def quiet_libtpu_without_tpu() -> bool:
    """Describe a TPU-less host to libtpu so that initialising it prints nothing; True when set."""
    if _tpu_chips() != 0 or "JAX_FORCE_TPU_INIT" in os.environ:
        return False
    if any(v in os.environ for v in ("TPU_WORKER_HOSTNAMES", "TPU_HOST_BOUNDS")):
        return False
    os.environ["TPU_WORKER_HOSTNAMES"] = "localhost"
    os.environ["TPU_HOST_BOUNDS"] = "1,1,1"
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    return True


def configure() -> None:
    tune_malloc()
    quiet_libtpu_without_tpu()
