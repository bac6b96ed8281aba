"""Meshes: the three axes (`MESH_AXES`), `MeshSpec` sizes (`{"data": 2, "fsdp": -1, "tensor": 2}`, −1 = the
rest) and `PRESETS`, the TPU slices we plan for, with device count, HBM per chip and the topology name for
ahead-of-time compiles."""
from __future__ import annotations

import dataclasses
import math
from typing import Mapping

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from prisma_jax.core.partitioning import MESH_AXES


@dataclasses.dataclass(frozen=True)
class MeshSpec:
    """Sizes of the three mesh axes; one of them may be −1 ("the rest of the devices")."""
    data: int = 1
    fsdp: int = -1
    tensor: int = 1

    @classmethod
    def parse(cls, spec) -> "MeshSpec":
        """A MeshSpec, a dict / YAML mapping `{data, fsdp, tensor}`, or a preset name."""
        if isinstance(spec, MeshSpec):
            return spec
        if isinstance(spec, str):
            return preset(spec).train
        if not isinstance(spec, Mapping):
            raise ValueError(f"mesh must be a preset name or a mapping of {list(MESH_AXES)}, got {spec!r}")
        unknown = sorted(set(spec) - set(MESH_AXES))
        if unknown:
            raise ValueError(f"mesh: unknown axis name(s) {unknown}; the axes are {list(MESH_AXES)}")
        sizes = {k: spec.get(k, 1) for k in MESH_AXES}
        if "fsdp" not in spec and -1 not in sizes.values():
            sizes["fsdp"] = -1                     # unnamed devices go to fsdp
        for k, v in sizes.items():
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or not (v >= 1 or v == -1):
                raise ValueError(f"mesh: axis {k!r} must be a positive integer or -1, got {v!r}")
        if sum(v == -1 for v in sizes.values()) > 1:
            raise ValueError(f"mesh: at most one axis may be -1, got {sizes}")
        return cls(**{k: int(v) for k, v in sizes.items()})

    def shape(self, n_devices: int) -> tuple[int, int, int]:
        sizes = [self.data, self.fsdp, self.tensor]
        known = math.prod(s for s in sizes if s != -1)
        if -1 in sizes:
            if n_devices % known:
                raise ValueError(f"mesh {self.as_dict()}: {n_devices} devices are not a multiple of {known}")
            sizes[sizes.index(-1)] = n_devices // known
        if math.prod(sizes) != n_devices:
            raise ValueError(f"mesh {self.as_dict()} needs {math.prod(sizes)} devices, {n_devices} available")
        return tuple(sizes)

    def as_dict(self) -> dict[str, int]:
        return {k: getattr(self, k) for k in MESH_AXES}


@dataclasses.dataclass(frozen=True)
class Preset:
    """A slice we plan for. `train` / `generate` are the recommended meshes for each job."""
    name: str
    n_devices: int                  # JAX devices (chips; a v4/v5p megacore chip is one device)
    hbm_gib: float | None           # HBM per device (None: host memory, simulated)
    topology: str | None            # `get_topology_desc` name for ahead-of-time compiles (None: CPU)
    chips_per_host: tuple[int, int, int] | None
    train: MeshSpec
    generate: MeshSpec
    chip_config: str = "default"    # `get_topology_desc` chip config: v4 pods run "megacore" (2 cores, 1 device)


PRESETS: dict[str, Preset] = {p.name: p for p in (
    Preset("cpu-8", 8, None, None, None, MeshSpec(2, 2, 2), MeshSpec(2, 2, 2)),
    Preset("v5e-8", 8, 16, "v5e:2x4", (2, 4, 1), MeshSpec(1, 8, 1), MeshSpec(1, 1, 8)),
    Preset("v5e-16", 16, 16, "v5e:4x4", (2, 2, 1), MeshSpec(1, 16, 1), MeshSpec(2, 1, 8)),
    Preset("v5p-8", 4, 95, "v5p:2x2x1", (2, 2, 1), MeshSpec(1, 4, 1), MeshSpec(1, 1, 4)),
    Preset("v4-32", 16, 32, "v4:2x2x4", (2, 2, 1), MeshSpec(1, 16, 1), MeshSpec(2, 1, 8), "megacore"),
    Preset("v5p-64", 32, 95, "v5p:4x4x2", (2, 2, 1), MeshSpec(2, 16, 1), MeshSpec(4, 1, 8)),
)}


def preset(name: str) -> Preset:
    if name not in PRESETS:
        raise ValueError(f"unknown mesh preset {name!r}; choose one of {', '.join(PRESETS)}")
    return PRESETS[name]


def make_mesh(spec=None, devices=None) -> Mesh:
    """A `Mesh` with axes `MESH_AXES` (Auto axis types) over `devices` (default: all of `jax.devices()`)."""
    devices = list(jax.devices() if devices is None else devices)
    shape = MeshSpec.parse(spec if spec is not None else {}).shape(len(devices))
    return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * 3, devices=devices)
