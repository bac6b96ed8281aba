"""Run by tests/test_attention.py in a subprocess with 8 simulated devices: the splash kernel (interpret mode)
inside its shard_map on a 2×2×2 mesh against the XLA path on one device, forward and gradients; the paged decode
kernel likewise on a bf16 decode step (the bound of test_paged_decode_kernel_equals_xla)."""
import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
sys.path.insert(0, os.path.dirname(__file__))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from prisma_jax.nn import attention as A  # noqa: E402
from prisma_jax.parallel.mesh import make_mesh  # noqa: E402
from test_attention import decode_step, qkv, rel_err  # noqa: E402

packed = np.array([[1] * 9 + [2] * 20 + [3] * 7 + [0] * 4, [1] * 33 + [2] * 7] * 2, np.int32)
mask = A.causal(jnp.asarray(packed))
q, k, v = qkv(4, 40, 40, 4, 2, 32)


def loss(impl):
    return lambda q, k, v: jnp.sum(jnp.sin(A.attention(q, k, v, mask, impl)))


dq, dk, dv, dmask = decode_step(jnp.bfloat16, (1, 37, 64, 16))
paged = jax.jit(lambda q, k, v: A.cached_attention(q, k, v, dmask, "pallas"))
want, gwant = A.attention(q, k, v, mask, "xla"), jax.grad(loss("xla"), (0, 1, 2))(q, k, v)
dwant = A.cached_attention(dq, dk, dv, dmask, "xla").astype(jnp.float32)
with jax.set_mesh(make_mesh({"data": 2, "fsdp": 2, "tensor": 2})):
    got = jax.jit(lambda q, k, v: A.attention(q, k, v, mask, "pallas"))(q, k, v)
    ggot = jax.jit(jax.grad(loss("pallas"), (0, 1, 2)))(q, k, v)
    assert A.resolve("pallas", dmask, 1, dk) == "paged"
    dgot = paged(dq, dk, dv).astype(jnp.float32)
assert len(got.sharding.device_set) == 8, got.sharding
errs = [rel_err(got, want)] + [rel_err(a, b) for a, b in zip(ggot, gwant)]
print(errs, rel_err(dgot, dwant))
sys.exit(0 if max(errs) < 1e-5 and rel_err(dgot, dwant) < 1e-2 else 1)
