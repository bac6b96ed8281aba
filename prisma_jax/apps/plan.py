"""`prisma plan`: ahead-of-time compiles of the training step and the decode program for a TPU slice, from
a CPU host, with the real TPU compiler (libtpu from the `[tpu]` extra) — nothing is materialised.

    prisma plan --config configs/prisma_vl_8b.yaml --mesh v5p-8 [--batch B --seq S] [--images N --image-size S]
                [--search] [--quantize int8] [--attention auto|xla|pallas]

`jax.experimental.topologies.get_topology_desc` gives abstract TPU devices for the preset's topology
(parallel/mesh.py PRESETS); every input is a `ShapeDtypeStruct` carrying its sharding (core/partitioning.py's rules). For each
step we print per-device bytes from `memory_analysis()` against the chip's HBM ("fits" / "does not fit"),
the model FLOPs (train/flops.py; XLA's cost analysis counts a scanned layer body once), and any
all-gather in the compiled HLO that materialises a whole table or `[B, V]` logits. `--mesh cpu-8` compiles
for 8 simulated CPU devices instead. The programs are the real ones: the training step is train/step.py's
`make_train_step` fed the batch train/data.py's `Collate` builds (its image slots included: a model-only YAML
plans PLAN_IMAGES image a row of PLAN_IMAGE_SIZE²); the decode program is generate.py's `decode` (the
`lax.while_loop` `generate` runs, greedy) on the state generate.py's `prefill` returns. `--quantize int8`
plans that decode program on the int8 params (quant/int8.py) and no training step (they cannot be trained).
Each program's line "attention:" names the kernels its lowered program holds (`pallas (splash)` when it calls
splash attention's Pallas kernels, `pallas (paged)` for the decode kernel, else `xla`) and the
`model.attention` asked for (`--attention`).
"""
from __future__ import annotations

import dataclasses
import functools
import math
import os
import re
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from prisma_jax.nn import model as M
from prisma_jax.core.config import ModelConfig, read_yaml
from prisma_jax.parallel.mesh import PRESETS, Preset, make_mesh, preset
from prisma_jax.parallel.placement import abstract_sharded_params, opt_state_shardings
from prisma_jax.core.partitioning import batch_shards, spec_for
from train.flops import device_peak, step_flops

GiB = 2**30


def chip_peak(p: Preset) -> float | None:
    """The bf16 TFLOP/s of one of the preset's chips (train/flops.py's table), None for the CPU presets."""
    chip = (p.topology or "").split(":")[0]
    return device_peak(f"TPU {chip}") if chip else None


# ------------------------------------------------------------------------------------------------ devices

def plan_devices(p: Preset) -> list:
    """Abstract TPU devices of the preset's topology, or the simulated CPU devices for `cpu-8`."""
    if p.topology is None:
        devs = jax.devices("cpu")
        if len(devs) < p.n_devices:
            raise ValueError(f"--mesh {p.name} needs {p.n_devices} CPU devices, JAX has {len(devs)}: set "
                             f"XLA_FLAGS=--xla_force_host_platform_device_count={p.n_devices} before JAX starts")
        return devs[:p.n_devices]
    from jax.experimental import topologies

    # compiling needs no chip: let several planning processes load libtpu at once (no lockfile)
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    try:
        topo = topologies.get_topology_desc(platform="tpu", topology_name=p.topology, chip_config_name=p.chip_config,
                                            chips_per_host_bounds=p.chips_per_host, num_slices=1)
    except Exception as e:   # libtpu missing or unusable: one clear line
        hint = "; install the TPU compiler with `pip install -e .[tpu]`" if "libtpu" not in str(e) else ""
        raise ValueError(f"cannot describe TPU topology {p.topology} ({type(e).__name__}: "
                         f"{str(e).splitlines()[0]}){hint}") from None
    devs = list(topo.devices)
    if len(devs) != p.n_devices:
        raise ValueError(f"topology {p.topology} has {len(devs)} devices, preset {p.name} says {p.n_devices}")
    return devs


# ------------------------------------------------------------------------------------------------ steps

def decode_spec(new_bucket: int = 16):
    """The decode program `generate` runs by default: greedy, mechanism on, layers scanned (the TPU layout)."""
    from prisma_jax.infer.generate import Spec

    return Spec(greedy=True, introspection=True, new_bucket=new_bucket, keep_logits=False, unroll_layers=False)


def _sds(shape, dtype, mesh, logical):
    return jax.ShapeDtypeStruct(shape, jnp.dtype(dtype), sharding=NamedSharding(mesh, spec_for(shape, logical, mesh)))


def decode_args(cfg: ModelConfig, mesh: Mesh, batch: int, cache_len: int, dtype="bfloat16", spec=None,
                quantize: str | None = None) -> tuple:
    """generate.decode's arguments after (cfg, spec), as sharded `ShapeDtypeStruct`s: the state is what
    generate.prefill returns (traced, not compiled) for a `[batch, cache_len − new_bucket]` prompt. The KV
    cache follows CACHE_AXES, every `[B, ...]` leaf is split over the batch axes, the rest is replicated.
    `quantize="int8"`: the params are the int8 dict (quant/int8.py), its other leaves in `dtype`."""
    from prisma_jax.quant import int8 as Q
    from prisma_jax.infer import generate as G
    from prisma_jax.infer.sampling import SamplingParams

    spec = spec or decode_spec()
    p = cache_len - spec.new_bucket
    if p < 1:
        raise ValueError(f"--cache-len {cache_len} must exceed the decode output bucket {spec.new_bucket}")
    rep = NamedSharding(mesh, P())
    scalar = lambda dt: jax.ShapeDtypeStruct((), jnp.dtype(dt), sharding=rep)   # noqa: E731
    params = (abstract_sharded_params(cfg, mesh, dtype) if Q.check_mode(quantize) is None else
              Q.abstract_params(cfg, dtype, mesh))
    row = ("batch", None)
    prompt = M.Batch(_sds((batch, p), jnp.int32, mesh, row), _sds((batch, p), bool, mesh, row),
                     _sds((batch, p), jnp.int32, mesh, row), _sds((3, batch, p), jnp.int32, mesh, (None,) + row))
    sp = SamplingParams(scalar(jnp.float32), scalar(jnp.int32), scalar(jnp.float32), scalar(jnp.float32))
    eos = jax.ShapeDtypeStruct((4,), jnp.int32, sharding=rep)
    key = jax.eval_shape(lambda: jax.random.key(0))
    with jax.set_mesh(mesh):
        state = jax.eval_shape(functools.partial(G.prefill, cfg, spec), params, prompt,
                               _sds((batch,), jnp.int32, mesh, ("batch",)), sp, eos, scalar(jnp.int32),
                               jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=rep))

    def place(x, logical=None):
        if logical is None:
            logical = ("batch",) + (None,) * (x.ndim - 1) if x.ndim and x.shape[0] == batch else (None,) * x.ndim
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, spec_for(x.shape, logical, mesh)))
    cache = state.state.cache.shardings(mesh)
    state = jax.tree.map(place, state)
    state = state.replace(state=state.state.replace(cache=jax.tree.map(
        lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), state.state.cache, cache)))
    return params, state, sp, eos, scalar(jnp.int32), scalar(jnp.int32)


def lower_decode(cfg: ModelConfig, mesh: Mesh, batch: int, cache_len: int, dtype="bfloat16", spec=None, args=None):
    """generate.py's jitted decode program (the `lax.while_loop` that `generate` runs, the state donated)
    lowered on `mesh` from `decode_args` (or the given `args`)."""
    from prisma_jax.infer import generate as G

    spec = spec or decode_spec()
    args = args or decode_args(cfg, mesh, batch, cache_len, dtype, spec)
    with jax.set_mesh(mesh):
        return G.decode.lower(cfg, spec, *args)


# a model-only YAML plans this many images per row at this size (448² → a 28 × 28 patch grid, 196 merged tokens)
PLAN_IMAGES, PLAN_IMAGE_SIZE = 1, 448


def train_config(path: str, batch: int | None, seq: int | None, overrides=(), images: int | None = None,
                 image_size: int | None = None, default_batch: int = 1):
    """train/config.py's Config from a YAML; a model-only YAML gets a planning `train:` section (bfloat16
    compute, full remat) and `data:` section (PLAN_IMAGES image slots a row of PLAN_IMAGE_SIZE²). `batch` /
    `seq` override train.batch_size / train.seq_len (else `default_batch` rows when the YAML names none),
    `images` / `image_size` data.max_images / data.image_size."""
    from train.config import apply_overrides, config_from_raw

    own = read_yaml(path)
    raw = apply_overrides(own, list(overrides))
    if "train" not in own:                        # a model-only YAML (overrides such as train.lora keep it one)
        data = dict(raw.get("data") or {})
        data.setdefault("max_images", PLAN_IMAGES)
        data.setdefault("image_size", PLAN_IMAGE_SIZE)
        raw["data"] = data
    tr = dict(raw.get("train") or {})
    tr.setdefault("steps", 1)
    tr.setdefault("compute_dtype", "bfloat16")
    tr.setdefault("remat", "full")
    tr.setdefault("seq_len", 4096)
    if batch is not None:
        tr["batch_size"] = int(batch)
    if seq is not None:
        tr["seq_len"] = int(seq)
    tr.setdefault("batch_size", default_batch)
    raw["train"] = tr
    if images is not None or image_size is not None:
        raw["data"] = dict(raw.get("data") or {})
        if images is not None:
            raw["data"]["max_images"] = images
        if image_size is not None:
            raw["data"]["image_size"] = image_size
    cfg = config_from_raw(raw)
    d = cfg.data
    per_row = image_tokens(cfg)
    if per_row >= cfg.train.seq_len:
        raise ValueError(f"{d.max_images} image(s) of {d.image_size}² take {per_row} tokens a row, not fewer than "
                         f"train.seq_len {cfg.train.seq_len}")
    return cfg


def image_tokens(tcfg) -> int:
    """Merged vision tokens one row's image slots take (data.max_images images of data.image_size²)."""
    d, v = tcfg.data, tcfg.model.vision
    return d.max_images * (d.image_size // v.patch_size) ** 2 // v.spatial_merge_size ** 2


def abstract_train_state(tcfg, mesh: Mesh):
    """(the training state as sharded `ShapeDtypeStruct`s: float32 master weights, AdamW state sharded like
    the params, replicated step and RNG; with `train.lora` the trained leaves only, and the frozen base in the
    compute dtype, else None)."""
    from train.step import TrainState, is_trained, make_optimizer, partition

    rep = NamedSharding(mesh, P())
    params = abstract_sharded_params(tcfg.model, mesh, jnp.float32, tcfg.train.lora)
    base = None
    if tcfg.train.lora is not None:
        params, base = partition(params, lambda p: is_trained(tcfg, p))
        dt = jnp.dtype(tcfg.train.compute_dtype)
        base = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, dt, sharding=a.sharding), base)
    opt_shapes = jax.eval_shape(make_optimizer(tcfg, params).init, params)
    opt_sh = opt_state_shardings(opt_shapes, jax.tree.map(lambda a: a.sharding, params), mesh)
    opt_abs = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), opt_shapes, opt_sh)
    return TrainState(jax.ShapeDtypeStruct((), jnp.int32, sharding=rep), params, opt_abs,
                      jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=rep)), base


def abstract_train_batch(tcfg, mesh: Mesh):
    """The global TrainBatch the trainer feeds its step, as sharded `ShapeDtypeStruct`s: train/data.py's
    `Collate` of a whole batch of text rows (so its `data.max_images` image slots a row of `data.image_size`²,
    zero pixels and vision geometry, exactly as training builds them), each field laid out like
    train/sharded.py's `put_batch` (row fields over the batch axes, the rest replicated)."""
    from train import sharded
    from train.data import Collate

    s, rows = tcfg.train.seq_len, tcfg.train.batch_size
    text_row = {"ids": np.zeros(s, np.int32), "mask": np.ones(s, bool), "supervised": np.ones(s, bool),
                "pixels": None}
    host = Collate(tcfg, rows)([text_row] * rows)
    rep = NamedSharding(mesh, P())

    def place(name, x):
        dt = jax.dtypes.canonicalize_dtype(x.dtype)
        if name not in sharded.ROW_AXIS:
            return jax.ShapeDtypeStruct(x.shape, dt, sharding=rep)
        logical = tuple("batch" if i == sharded.ROW_AXIS[name] else None for i in range(x.ndim))
        return _sds(x.shape, dt, mesh, logical)
    return type(host)(*(None if x is None else jax.tree.map(functools.partial(place, name), x)
                        for name, x in zip(host._fields, host)))


def lower_train(tcfg, mesh: Mesh):
    """train/step.py's training step lowered on `mesh`: float32 master weights and AdamW state sharded like the
    params, the batch of `abstract_train_batch` (text `[A, b, S]` over the batch axes, the image slots), the
    state donated."""
    from train.step import make_train_step

    state, base = abstract_train_state(tcfg, mesh)
    batch = abstract_train_batch(tcfg, mesh)
    state_sh = jax.tree.map(lambda x: x.sharding, state)
    fn = jax.jit(make_train_step(tcfg, state.params), donate_argnums=0,
                 out_shardings=(state_sh, NamedSharding(mesh, P())))
    with jax.set_mesh(mesh):
        return fn.lower(state, batch, *([] if base is None else [base]))


# ------------------------------------------------------------------------------------------------ analysis

@dataclasses.dataclass
class Memory:
    arguments: int
    outputs: int
    aliased: int
    temporaries: int
    code: int

    @property
    def total(self) -> int:   # peak estimate: live inputs + outputs not aliased to inputs + scratch
        return self.arguments + self.outputs - self.aliased + self.temporaries + self.code


def memory(compiled) -> Memory:
    m = compiled.memory_analysis()
    return Memory(m.argument_size_in_bytes, m.output_size_in_bytes, m.alias_size_in_bytes, m.temp_size_in_bytes,
                  m.generated_code_size_in_bytes)


_AG = re.compile(r"=\s*(\(?[^=]*?)\s+all-gather(?:-start)?\(")
_SHAPE = re.compile(r"([a-z]+[0-9]*)\[([0-9,]*)\]")


def all_gathers(hlo_text: str) -> list[tuple[str, tuple[int, ...]]]:
    """(dtype, dims) of every array an all-gather produces in compiled HLO text."""
    out = []
    for line in hlo_text.splitlines():
        m = _AG.search(line)
        if m:
            for dt, dims in _SHAPE.findall(m.group(1)):
                out.append((dt, tuple(int(d) for d in dims.split(",") if d)))
    return out


def forbidden_gathers(hlo_text: str, cfg: ModelConfig, batch: int) -> list[tuple[str, tuple[int, ...]]]:
    """All-gathers whose result is a whole table ([V, D], [D, V], [L, D]) or whole logits ([B, V], [B, 1, V])."""
    v, d, lv = cfg.text.vocab_size, cfg.text.hidden_size, cfg.n_levels
    bad = {(v, d), (d, v), (lv, d), (batch, v), (batch, 1, v)}
    return [g for g in all_gathers(hlo_text) if g[1] in bad]


def kv_bytes_per_token(cfg: ModelConfig, dtype="bfloat16") -> int:
    t = cfg.text
    return 2 * t.num_hidden_layers * t.num_key_value_heads * t.head_dim * jnp.dtype(dtype).itemsize


def bytes_per_device(tree) -> int:
    """Bytes one device holds of an abstract tree of sharded ShapeDtypeStructs."""
    return int(sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(tree)))


# ------------------------------------------------------------------------------------------------ the plan

def _gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB"


def _mesh_str(mesh: Mesh) -> str:
    return " ".join(f"{k}={v}" for k, v in mesh.shape.items())


_OOM = re.compile(r"Ran out of memory.*?required for (.*?) \(([0-9.]+)([KMGT]?)\) exceeds available HBM \(([0-9.]+)([KMGT]?)\)")


def compiler_oom(e: Exception) -> str | None:
    """The TPU compiler's own "does not fit" (it refuses to compile a program larger than HBM), else None."""
    m = _OOM.search(str(e))
    return None if m is None else f"{m.group(1)} need {m.group(2)} {m.group(3)}iB > HBM {m.group(4)} {m.group(5)}iB"


def _train_plan_head(tcfg, mesh: Mesh) -> dict:
    """What every training-plan result names, compiled or not: mesh, batch, sequence and analytic FLOPs."""
    tr = tcfg.train
    return {"mesh": _mesh_str(mesh), "batch": tr.batch_size, "seq": tr.seq_len,
            "flops": step_flops(tcfg)}


_KERNEL = re.compile(r'kernel_name\s*=\s*"([A-Za-z0-9_]+)"')


def pallas_kernels(lowered_text: str) -> list[str]:
    """Names of the Pallas TPU kernels (`tpu_custom_call`s) a lowered program calls."""
    return sorted(set(_KERNEL.findall(lowered_text)))


def attention_used(kernels: list[str]) -> str:
    """The attention implementation a program runs, from its Pallas kernels: "pallas (splash)", "pallas (paged)"
    (jax's paged decode kernel, attention.py) or "xla"."""
    used = [name for name in ("splash", "paged") if any(k.startswith(name) for k in kernels)]
    return f"pallas ({', '.join(used)})" if used else "xla"


def plan_train(tcfg, p: Preset, devices) -> dict:
    mesh = make_mesh(p.train, devices)
    out = _train_plan_head(tcfg, mesh)
    t0 = time.time()
    lowered = lower_train(tcfg, mesh)
    out["attention"] = attention_used(pallas_kernels(lowered.as_text()))
    try:
        compiled = lowered.compile()
    except Exception as e:     # the TPU compiler refuses what cannot fit: that is the answer, not an error
        oom = compiler_oom(e)
        if oom is None:
            raise
        return {**out, "memory": None, "oom": f"the TPU compiler refused it ({oom})", "fits": False,
                "seconds": time.time() - t0}
    mem = memory(compiled)
    return {**out, "memory": mem, "fits": None if p.hbm_gib is None else mem.total <= p.hbm_gib * GiB,
            "seconds": time.time() - t0}


def plan_decode(cfg: ModelConfig, p: Preset, devices, batch: int, cache_len: int, dtype="bfloat16",
                quantize: str | None = None) -> dict:
    mesh = make_mesh(p.generate, devices)
    t0 = time.time()
    spec = decode_spec()
    args = decode_args(cfg, mesh, batch, cache_len, dtype, spec, quantize)
    lowered = lower_decode(cfg, mesh, batch, cache_len, dtype, spec, args)
    compiled = lowered.compile()
    mem = memory(compiled)
    weights, cache = bytes_per_device(args[0]), bytes_per_device(args[1].state.cache)
    out = {"mesh": _mesh_str(mesh), "batch": batch, "cache_len": cache_len, "new_bucket": spec.new_bucket,
           "quantize": quantize, "attention": attention_used(pallas_kernels(lowered.as_text())),
           "memory": mem, "weights": weights, "cache": cache, "seconds": time.time() - t0,
           "bad_gathers": forbidden_gathers(compiled.as_text(), cfg, batch),
           "fits": None if p.hbm_gib is None else mem.total <= p.hbm_gib * GiB}
    if p.hbm_gib is not None:   # what is left for the cache, as tokens (batch × length) over the whole mesh
        scratch = mem.total - weights - cache
        free = p.hbm_gib * GiB - weights - scratch
        out["kv_budget_tokens"] = max(0, int(free * p.n_devices // kv_bytes_per_token(cfg, dtype)))
    return out


def search_train_batch(make_cfg, p: Preset, devices, seq: int, min_seq: int = 512,
                       log=None) -> tuple[int, dict]:
    """Largest global batch (a multiple of the batch shards) whose training step fits at `seq`: two compiles
    fix the affine memory model, a third checks its prediction (stepping down while it does not fit). When
    not even one row per batch shard fits, the sequence is halved (down to `min_seq`) until it does: the
    result's `seq` says which length was planned. `log(result)` sees every compile. Returns (batch, result of
    the largest fitting compile, or of the last one tried when nothing fits)."""
    mesh = make_mesh(p.train, devices)

    def plan_train_logged(tcfg):
        r = plan_train(tcfg, p, devices)
        if log is not None:
            log(r)
        return r

    unit = mesh.shape["data"] * mesh.shape["fsdp"]
    cfg = make_cfg(unit, seq)
    state = bytes_per_device(abstract_train_state(cfg, mesh))     # trained state and frozen base
    if p.hbm_gib is not None and state > p.hbm_gib * GiB:     # no compile can fit: say why without one
        return 0, {**_train_plan_head(cfg, mesh), "memory": None, "fits": False, "seconds": 0.0,
                   "oom": f"the float32 weights + AdamW state alone are {_gib(state)} a device"}
    r1 = plan_train_logged(cfg)
    while not r1["fits"] and seq // 2 >= min_seq:
        seq //= 2
        r1 = plan_train_logged(make_cfg(unit, seq))
    if not r1["fits"]:
        return 0, r1
    r2 = plan_train_logged(make_cfg(2 * unit, seq))
    if not r2["fits"]:
        return unit, r1
    slope = max(r2["memory"].total - r1["memory"].total, 1)
    k = max(2, int((p.hbm_gib * GiB - r1["memory"].total) // slope) + 1)
    best = (2 * unit, r2)
    for k in (k, k - 1, k // 2):
        if k <= 2:
            break
        r = plan_train_logged(make_cfg(k * unit, seq))
        if r["fits"]:
            best = (k * unit, r)
            break
    return best


def format_train(r: dict, p: Preset, tcfg) -> str:
    m, f = r["memory"], r["flops"]
    hbm = "simulated" if p.hbm_gib is None else f"{p.hbm_gib:g} GiB"
    verdict = "" if r["fits"] is None else (": fits" if r["fits"] else ": DOES NOT FIT")
    tr = tcfg.train
    d = tcfg.data
    imgs = (f"{d.max_images} image slot(s) a row of {d.image_size}² ({image_tokens(tcfg)} tokens)" if d.max_images
            else "no image slots")
    state = ("params + AdamW float32" if tr.lora is None else
             f"LoRA rank {tr.lora.rank}: trained leaves + AdamW float32, frozen base bfloat16")
    chunk = f"{tr.logits_chunk} tokens" if 0 < tr.logits_chunk < tr.seq_len else "off (whole sequence)"
    lines = [f"training step  mesh {r['mesh']}; batch {r['batch']} × seq {r['seq']}, {imgs} (grad_accum "
             f"{tr.grad_accum}, introspection passes {tr.introspection_passes}); {state}, compute {tr.compute_dtype}, "
             f"remat {tr.remat}, logits chunk {chunk}",
             f"  per device: arguments {_gib(m.arguments)}, outputs {_gib(m.outputs)} (aliased {_gib(m.aliased)}), "
             f"temporaries {_gib(m.temporaries)} → {_gib(m.total)} of {hbm}{verdict}" if m is not None else
             f"  per device: {r['oom']}{verdict}",
             f"  model FLOPs/step (train/flops.py): text {f['text']:.3e} + attention {f['attention']:.3e} + vision "
             f"{f['vision']:.3e} + introspection {f['introspection']:.3e} = {f['total']:.3e} "
             f"({f['total'] / p.n_devices:.3e} per device)"]
    if "attention" in r:       # not when the search ruled the step out without lowering it
        lines.append(f"  attention: {r['attention']} (model.attention={tcfg.model.attention})")
    peak = chip_peak(p)
    if peak is not None:
        lines.append(f"  at 100% of the {p.topology.split(':')[0]} bf16 peak: "
                     f"{f['total'] / p.n_devices / (peak * 1e12):.2f} s/step")
    lines.append(f"  compiled in {r['seconds']:.0f} s")
    return "\n".join(lines)


def format_decode(r: dict, p: Preset, cfg: ModelConfig) -> str:
    m = r["memory"]
    hbm = "simulated" if p.hbm_gib is None else f"{p.hbm_gib:g} GiB"
    verdict = "" if r["fits"] is None else (": fits" if r["fits"] else ": DOES NOT FIT")
    lines = [f"decode loop    generate.decode (greedy); mesh {r['mesh']}; batch {r['batch']}, cache {r['cache_len']} "
             f"slots ({r['cache_len'] - r['new_bucket']} prompt + {r['new_bucket']} new), bfloat16"
             + (f", {r['quantize']} kernels" if r.get("quantize") else ""),
             f"  per device: weights {_gib(r['weights'])}, arguments {_gib(m.arguments)}, temporaries "
             f"{_gib(m.temporaries)} → {_gib(m.total)} of {hbm}{verdict}",
             f"  attention: {r['attention']} (model.attention={cfg.attention})"]
    if "kv_budget_tokens" in r:
        lines.append(f"  KV-cache budget: {r['kv_budget_tokens']:,} tokens (batch × length) over the mesh")
    bad = r["bad_gathers"]
    lines.append("  whole-table / [B, V] all-gathers: " + (", ".join(f"{d}{list(s)}" for d, s in bad) if bad else "none"))
    lines.append(f"  compiled in {r['seconds']:.0f} s")
    return "\n".join(lines)


def run(args) -> int:
    p = preset(args.mesh)
    if args.quantize and args.search:
        raise ValueError("--search plans training, and int8 params (--quantize) cannot be trained")
    if p.topology is None and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   f" --xla_force_host_platform_device_count={p.n_devices}").strip()
    devices = plan_devices(p)
    shards = batch_shards(make_mesh(p.train, devices))   # the default batch: one row per batch shard
    overrides = list(args.set) + ([f"model.attention={args.attention}"] if args.attention else [])
    cfg_of = lambda b, s: train_config(args.config, b, s, overrides, args.images, args.image_size,  # noqa: E731
                                       default_batch=shards)
    tcfg = cfg_of(args.batch, args.seq)
    print(f"prisma plan: {args.config} on {p.name} ({p.topology or 'simulated CPU'}, {p.n_devices} devices"
          + (f", {p.hbm_gib:g} GiB HBM each)" if p.hbm_gib else ")"))
    if args.search:
        def log(r):   # each compile as it finishes (a search takes minutes)
            m = r["memory"]
            print(f"  tried batch {r['batch']} × seq {r['seq']}: "
                  + (r["oom"] if m is None else f"{_gib(m.total)} a device") + f" ({r['seconds']:.0f} s)",
                  file=sys.stderr, flush=True)
        best, r = search_train_batch(cfg_of, p, devices, tcfg.train.seq_len, log=log)
        print(format_train(r, p, cfg_of(r["batch"], r["seq"])))
        if best and r["seq"] == tcfg.train.seq_len:
            print(f"  largest batch that fits at seq {r['seq']}: {best}")
        elif best:
            print(f"  nothing fits at seq {tcfg.train.seq_len}; largest that fits: batch {best} × seq {r['seq']}")
        else:
            print(f"  nothing fits, even one row per batch shard at seq {r['seq']}")
    elif args.quantize:
        print(f"training step  not planned: {args.quantize} params are for generation only")
    elif not args.no_train:
        print(format_train(plan_train(tcfg, p, devices), p, tcfg))
    if args.no_decode:
        return 0
    gen_mesh = make_mesh(p.generate, devices)
    gb = args.gen_batch or gen_mesh.shape["data"] * gen_mesh.shape["fsdp"]
    r = plan_decode(tcfg.model, p, devices, gb, args.cache_len or tcfg.train.seq_len, quantize=args.quantize)
    print(format_decode(r, p, tcfg.model))
    return 0


def add_parser(sub):
    ap = sub.add_parser("plan", help="ahead-of-time compile the training step and decode loop for a TPU slice "
                                     "(memory per device, fits or not, FLOPs)")
    ap.add_argument("--config", required=True, help="model (+ training) YAML, e.g. configs/prisma_vl_8b.yaml")
    ap.add_argument("--mesh", required=True, help=f"preset: {', '.join(PRESETS)}")
    ap.add_argument("--batch", type=int, help="global training batch (default: train.batch_size, or one row per batch shard)")
    ap.add_argument("--seq", type=int, help="training sequence length (default: train.seq_len or 4096)")
    ap.add_argument("--images", type=int, help="image slots a training row (data.max_images; default: the "
                    f"YAML's data section, or {PLAN_IMAGES} for a model-only YAML)")
    ap.add_argument("--image-size", type=int, help="training image side in pixels (data.image_size; default: the "
                    f"YAML's, or {PLAN_IMAGE_SIZE} for a model-only YAML: {PLAN_IMAGE_SIZE}² = "
                    f"{(PLAN_IMAGE_SIZE // 16) ** 2 // 4} merged tokens at patch 16, merge 2)")
    ap.add_argument("--gen-batch", type=int, help="decode batch (default: one row per batch shard)")
    ap.add_argument("--cache-len", type=int, help="decode KV-cache slots, prompt + 16 new (default: the training seq)")
    ap.add_argument("--attention", choices=("auto", "xla", "pallas"),
                    help="attention kernels of the planned programs (model.attention; default: the YAML's, else "
                         "auto): auto and pallas = splash attention's Pallas kernels for training and prefill on "
                         "TPU, and the paged decode kernel for bf16 caches of head dim 128·k; xla = the einsum path. "
                         "Each program prints the one it used ('attention: pallas (splash)')")
    ap.add_argument("--search", action="store_true", help="find the largest training batch that fits")
    ap.add_argument("--no-train", action="store_true", help="only the decode loop")
    ap.add_argument("--no-decode", action="store_true", help="only the training step")
    from prisma_jax.quant.int8 import MODES

    ap.add_argument("--quantize", choices=MODES, help="plan the decode loop on int8 weights (quant/int8.py); "
                    "no training step")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="config override, e.g. train.remat=dots (repeatable)")
    ap.set_defaults(func=run)
