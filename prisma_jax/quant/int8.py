"""int8 weight-only quantization for generation, with qwix's post-training quantization (PTQ).

    model = PrismaVL.from_pretrained(path, quantize="int8")       # or model.quantize("int8")

What is quantized: the dense kernels a decode step reads every token — the text decoder's q/k/v/o and
gate/up/down projections (stacked over layers) and an untied `lm_head` (`QUANTIZED`, a regex on module
paths, as qwix's rules match them). Each becomes int8 with one float32 scale per output channel (qwix's
symmetric absmax: scale = max|w| / 127.5 over the input axis, q = round(w / scale) clipped to [−128, 127]).
What stays as loaded, and why:

* the uncertainty table (`uncertainty/embedding`): the mechanism's own learned parameter, added unchanged to
  the next input (docs/introspection-contract.md §3); and a lookup — a step reads B of its rows, so int8
  would save memory but no traffic (and qwix PTQ quantizes matmuls, not gathers);
* the token embedding (`text/embed`): a lookup for the same reason (a tied head, which reads it as a
  matmul, therefore stays float too);
* the vision tower: it runs once per image in prefill (compute, not weight reads, bounds it) and decode
  never reads it; float keeps image features as they are;
* norms and biases: a few vectors.

How it fits the functional design (docs/design.md): the int8 params are still a plain nested dict, each
quantized kernel in qwix's NNX PTQ layout, `kernel: {"array": {"qvalue": int8 [..., in, out], "scale":
float32 [..., 1, out]}}`, written by `qwix.quantize_params` against `abstract_model(cfg)` below — the model
whose quantized kernels are qwix `WithAux[QArray]`s carrying how to quantize them. `model.bind` merges an int8
dict into that model inside the trace; stacked layers stay stacked (one int8 `[L, in, out]` array and
`[L, 1, out]` scales, sliced per layer by the scan). `Dense` is unchanged: its `kernel[...].astype(x.dtype)`
dequantizes (`qwix.dequantize`, qvalue · scale in float32) and rounds once to the compute dtype, and XLA
fuses that into the matmul's operand (TPU) or hoists it out of the decode loop (CPU, docs/benchmarks.md).

Why not qwix's own quantized einsum (the `PtqProvider` intercepting `jnp.einsum`): it dequantizes in the
scale's dtype, and casting its QArray to bfloat16 casts the scale — every output channel's weights then
share one rounding error of up to 2⁻⁹. On the 408M benchmark config, teacher-forced on bfloat16's greedy
sequences, that moved every 16-bit code against bfloat16's (median 6 levels, max 8); dequantizing in float32
and rounding each weight once moves 39 % of them, by at most 2 — bfloat16 itself moves 22 % of float32's
(benchmarks/int8.py, 2026-12-02; docs/benchmarks.md). The matmul is the same weight-only one either way.

Int8 params are for generation: training refuses them (`refuse_training`).
"""
from __future__ import annotations

import functools
import re

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import qwix
from flax import nnx
from qwix._src.core.qarray import HowToQuantize
from qwix._src.providers.ptq import WithAux
from qwix._src.utils.flax_util import unbox, update_boxed

from prisma_jax.core.config import ModelConfig
from prisma_jax.nn.layers import Dense
from prisma_jax.nn.model import PrismaVLModule

MODES = ("int8",)
QUANTIZED = r"text/layers/(attn/[qkvo]_proj|mlp/(gate|up|down)_proj)|lm_head"   # module paths, "/"-joined


def check_mode(quantize) -> str | None:
    """None (no quantization) or one of MODES; anything else is a ValueError."""
    if quantize is None or quantize in MODES:
        return quantize
    raise ValueError(f"quantize must be one of {MODES} (or None), got {quantize!r}")


def is_quantized(params: dict) -> bool:
    """Whether a param dict holds quantized kernels (qwix's `{"array": {"qvalue", "scale"}}` leaves)."""
    kernel = params.get("text", {}).get("layers", {}).get("attn", {}).get("q_proj", {}).get("kernel")
    return isinstance(kernel, dict)


def refuse_training(params: dict) -> None:
    if is_quantized(params):
        raise ValueError("these params are int8-quantized (quant/int8.py): they are for generation only and cannot be "
                         "trained; train the float checkpoint and quantize it afterwards")


def _how(ndim: int) -> HowToQuantize:
    """int8, one scale per output channel (and per layer of a stack): every axis but the input axis (−2) is
    channelwise — what qwix's einsum rule derives for `...i,io->...o` on each layer's [in, out] kernel."""
    return HowToQuantize(qtype=jnp.int8, channelwise_axes=tuple(a for a in range(ndim) if a != ndim - 2),
                         tiled_axes={}, calibration_method="absmax")


def _quantized_paths(module: nnx.Module):
    for path, sub in nnx.iter_modules(module):
        if isinstance(sub, Dense) and re.fullmatch(QUANTIZED, "/".join(map(str, path))):
            yield path, sub


# ---------------------------------------------------------------------------------------------- the model

@flax.struct.dataclass
class QuantizedKernel(WithAux):
    """An int8 kernel: qwix's PTQ weight, `WithAux[QArray]` (what `qwix.quantize_params` fills in), whose
    `astype` — `Dense` computes `kernel[...].astype(x.dtype)` — dequantizes in float32 (`qwix.dequantize`)
    and rounds each weight once to `dtype` (the module docstring says why not by casting the scale)."""

    def astype(self, dtype):
        return qwix.dequantize(unbox(self.array)).astype(dtype)


nnx.register_data_type(QuantizedKernel)


@functools.lru_cache(maxsize=16)
def abstract_model(cfg: ModelConfig) -> tuple[nnx.GraphDef, nnx.State]:
    """(graphdef, abstract state) of the int8 model: `model.abstract_model` with each quantized kernel a
    `QuantizedKernel` (int8 qvalue, float32 scale; logical axes kept, a size-1 scale axis unsharded)."""
    def build():
        model = PrismaVLModule(cfg, rngs=nnx.Rngs(0))
        for _, dense in _quantized_paths(model):
            how = _how(dense.kernel.ndim)
            q = QuantizedKernel(qwix.quantize(dense.kernel[...], jnp.int8, channelwise_axes=how.channelwise_axes,
                                              scale_dtype=jnp.float32), how)
            dense.kernel = jax.tree.map(lambda v, p=dense.kernel: update_boxed(p, value=v), q)
        return model
    return nnx.split(nnx.eval_shape(build))


def quantize_params(cfg: ModelConfig, params: dict, mesh=None) -> dict:
    """Float params (params.py layout) → the int8 param dict: `qwix.quantize_params` against the abstract int8
    model, one compiled program per quantized kernel (its float value is read once, no float32 copy of the
    model is made). With `mesh`, each int8 leaf is created in its sharding (`abstract_params`)."""
    if is_quantized(params):
        raise ValueError("these params are already quantized")
    out = jax.tree.map(lambda x: x, params)
    for path, _ in _quantized_paths(nnx.merge(*abstract_model(cfg))):
        sub = out
        for k in path:
            sub = sub[k]
        sub["kernel"] = _quantize_program(cfg, path, mesh)(sub["kernel"])
    return out


@functools.lru_cache(maxsize=64)
def _quantize_program(cfg: ModelConfig, path: tuple, mesh):
    """`qwix.quantize_params` for the kernel of the Dense at `path` (whose abstract int8 kernel says how), from
    its value in float32, so scales are float32 whatever the params' dtype."""
    dense = nnx.merge(*abstract_model(cfg))
    for k in path:
        dense = getattr(dense, k)
    out_shardings = None
    if mesh is not None:
        leaf = abstract_params(cfg, mesh=mesh)
        for k in path + ("kernel",):
            leaf = leaf[k]
        out_shardings = jax.tree.map(lambda a: a.sharding, leaf)
    return jax.jit(lambda w: qwix.quantize_params({"kernel": w.astype(jnp.float32)}, dense)["kernel"],
                   out_shardings=out_shardings)


def abstract_params(cfg: ModelConfig, dtype=jnp.bfloat16, mesh=None) -> dict:
    """The int8 param dict as `ShapeDtypeStruct`s (unquantized leaves in `dtype`, scales float32), each with
    its sharding on `mesh` (sharding.py's rules on the logical axes the modules declare) when one is given."""
    from prisma_jax.core.trees import set_path
    from prisma_jax.core.partitioning import spec_for

    out: dict = {}
    for path, var in nnx.to_flat_state(abstract_model(cfg)[1]):
        dt = var.dtype if "array" in path else jnp.dtype(dtype)          # int8 values, float32 scales
        sharding = None
        if mesh is not None:
            axes = tuple(var.get_metadata().get("out_sharding"))
            sharding = jax.sharding.NamedSharding(mesh, spec_for(var.shape, axes, mesh))
        set_path(out, tuple(path), jax.ShapeDtypeStruct(var.shape, dt, sharding=sharding))
    return out


def weight_bytes(params: dict) -> int:
    return int(sum(np.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(params)))
