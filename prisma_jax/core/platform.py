"""The platform a traced program targets, for the choices that depend on it (kernels, the CPU's layer layout)."""
from __future__ import annotations

import jax


def platform() -> str:
    """The platform the program being traced targets: the active mesh's devices, else the default backend
    (so an ahead-of-time compile for a TPU topology from a CPU host picks the TPU kernels)."""
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty and mesh.abstract_device is not None:
        return mesh.abstract_device.platform
    return jax.default_backend()
