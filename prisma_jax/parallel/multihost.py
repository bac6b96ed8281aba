"""Several hosts, one program: starting `jax.distributed`, feeding each host's slice of the batch, and Orbax
saves / restores of sharded arrays in which every host writes and reads only its own shards.

    initialize()                      # TPU pods: no arguments (JAX finds the slice); elsewhere flags or env
    rows = host_rows(mesh, global_batch)  # the rows this host loads
    arr = host_batch(local_rows, mesh)   # → one global Array laid out by the batch rules
    save(path, tree); tree = restore(path, abstract_tree_with_shardings)

Environment for non-TPU clusters (the flags of `prisma train` map onto the same names):
`PRISMA_COORDINATOR=host:port`, `PRISMA_NUM_PROCESSES`, `PRISMA_PROCESS_ID` (JAX's own `JAX_COORDINATOR_ADDRESS`
/ `JAX_NUM_PROCESSES` / `JAX_PROCESS_ID` and cluster auto-detection work too). On CPU, cross-process collectives
use gloo. Not here: what to save (train/), the converted-checkpoint layout (conversion/).
"""
from __future__ import annotations

import os

import jax
import numpy as np
from jax.sharding import Mesh

from prisma_jax.core.partitioning import spec_for

_ENV = ("PRISMA_COORDINATOR", "PRISMA_NUM_PROCESSES", "PRISMA_PROCESS_ID")


def initialize(coordinator: str | None = None, num_processes: int | None = None, process_id: int | None = None,
               local_device_ids=None) -> None:
    """`jax.distributed.initialize` from arguments, else PRISMA_* environment variables, else JAX's own
    detection (TPU pods, SLURM, JAX_* variables). Call before anything touches a device; a no-op when the
    environment names a single process and nothing is given."""
    coordinator = coordinator or os.environ.get(_ENV[0])
    if num_processes is None and os.environ.get(_ENV[1]):
        num_processes = int(os.environ[_ENV[1]])
    if process_id is None and os.environ.get(_ENV[2]):
        process_id = int(os.environ[_ENV[2]])
    if coordinator is None and num_processes is None and process_id is None and not _on_cluster():
        return
    if num_processes == 1 and coordinator is None:
        return
    if os.environ.get("JAX_PLATFORMS", "") == "cpu":    # CPU-only processes talk through gloo
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes,
                               process_id=process_id, local_device_ids=local_device_ids)


def _on_cluster() -> bool:
    """A TPU VM of a pod slice or a launcher that JAX detects by itself."""
    return any(k in os.environ for k in ("TPU_WORKER_HOSTNAMES", "JAX_COORDINATOR_ADDRESS", "SLURM_JOB_ID",
                                          "OMPI_COMM_WORLD_SIZE")) or os.path.exists("/dev/accel0")


def host_rows(mesh: Mesh, global_batch: int) -> slice:
    """The rows of a global batch this process loads: those its devices hold under the batch rules
    (a contiguous block when the mesh is laid out host by host, as `jax.make_mesh` does)."""
    sh = jax.sharding.NamedSharding(mesh, spec_for((global_batch,), ("batch",), mesh))
    idx = [i[0] for i in sh.addressable_devices_indices_map((global_batch,)).values()]
    lo = min(i.start or 0 for i in idx)
    hi = max(global_batch if i.stop is None else i.stop for i in idx)
    if hi - lo != global_batch // jax.process_count():
        raise ValueError(f"this process's rows of the batch are not one contiguous block ({lo}:{hi})")
    return slice(lo, hi)


def host_batch(local, mesh: Mesh, logical: tuple | None = None, batch_axis: int = 0) -> jax.Array:
    """This host's rows (NumPy, batch on `batch_axis`) → a global Array over `mesh` whose batch axis is laid
    out by the rules; every host passes its own rows, none holds the global batch."""
    local = np.asarray(local)
    shape = list(local.shape)
    shape[batch_axis] *= jax.process_count()
    if logical is None:
        logical = tuple("batch" if i == batch_axis else None for i in range(local.ndim))
    sh = jax.sharding.NamedSharding(mesh, spec_for(shape, logical, mesh))
    return jax.make_array_from_process_local_data(sh, local, tuple(shape))


def save(path: str, tree) -> None:
    """Save a pytree of (sharded) jax Arrays with Orbax; every process calls this and writes its own shards."""
    import orbax.checkpoint as ocp

    with ocp.StandardCheckpointer() as ck:
        ck.save(os.path.abspath(path), tree)
        ck.wait_until_finished()


def restore(path: str, target):
    """Restore onto the shardings of `target` (a pytree of ShapeDtypeStructs with shardings, or of Arrays);
    each process reads only the chunks of its own shards."""
    import orbax.checkpoint as ocp

    with ocp.StandardCheckpointer() as ck:
        return ck.restore(os.path.abspath(path), target)

