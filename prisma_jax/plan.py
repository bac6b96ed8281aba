"""`prisma plan`: ahead-of-time compiles of the training step and the decode step for a TPU slice, from a
CPU host, with the real TPU compiler (libtpu from the `[tpu]` extra) — nothing is materialised.

    prisma plan --config configs/prisma_vl_8b.yaml --mesh v5p-8 [--batch B --seq S] [--search]

`jax.experimental.topologies.get_topology_desc` gives abstract TPU devices for the preset's topology
(sharding.PRESETS); every input is a `ShapeDtypeStruct` carrying its sharding (sharding.py's rules). For each
step we print per-device bytes from `memory_analysis()` against the chip's HBM ("fits" / "does not fit"),
the analytic FLOPs (6·N·tokens + attention; XLA's cost analysis counts a scanned layer body once), and any
all-gather in the compiled HLO that materialises a whole table or `[B, V]` logits. `--mesh cpu-8` compiles
for 8 simulated CPU devices instead. The training step is train/step.py's `make_train_step`; the decode step
is `decode_step` below: one cached token through the model, its code and the greedy next token.
"""
from __future__ import annotations

import dataclasses
import math
import os
import re
import time

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from . import model as M
from .config import ModelConfig, read_yaml
from .sharding import (PRESETS, Preset, abstract_sharded_params, make_mesh, opt_state_shardings,
                       param_shardings, preset, spec_for, CACHE_AXES)
from .uncertainty import codes_from_logits

GiB = 2**30
PEAK_BF16_TFLOPS = {"v5e": 197.0, "v5p": 459.0, "v4": 275.0}   # per chip, vendor figures


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

def decode_step(cfg: ModelConfig, params: dict, cache: dict, token, code, position, key_valid, slot):
    """One generated token: token [B] int32 with its incoming code [B] uint16 at M-RoPE position [B], written
    to cache slot `slot` → (next greedy token [B], its code [B] uint16, cache, key_valid)."""
    b = token.shape[0]
    key_valid = jax.lax.dynamic_update_slice(key_valid, jnp.ones((b, 1), bool), (0, slot))
    step = M.Batch(token[:, None], jnp.ones((b, 1), bool), code.astype(jnp.int32)[:, None],
                   jnp.broadcast_to(position[None, :, None], (3, b, 1)))
    h, cache = M.hidden(cfg, params, step, cache, slot, key_valid)
    logits = M.head(cfg, params, h[:, 0])                                   # [B, V], vocab-sharded
    new_code = codes_from_logits(logits, cfg.n_bits)
    return jnp.argmax(logits, axis=-1).astype(jnp.int32), new_code, cache, key_valid


def _sds(shape, dtype, mesh, logical):
    return jax.ShapeDtypeStruct(shape, jnp.dtype(dtype), sharding=NamedSharding(mesh, spec_for(shape, logical, mesh)))


def lower_decode(cfg: ModelConfig, mesh: Mesh, batch: int, cache_len: int, dtype="bfloat16"):
    """The jitted decode step lowered on `mesh` from abstract, sharded inputs (the cache is donated)."""
    t = cfg.text
    params = abstract_sharded_params(cfg, mesh, dtype)
    shape = (t.num_hidden_layers, batch, cache_len, t.num_key_value_heads, t.head_dim)
    cache = {"k": _sds(shape, dtype, mesh, CACHE_AXES), "v": _sds(shape, dtype, mesh, CACHE_AXES)}
    args = (params, cache, _sds((batch,), jnp.int32, mesh, ("batch",)), _sds((batch,), jnp.uint16, mesh, ("batch",)),
            _sds((batch,), jnp.int32, mesh, ("batch",)), _sds((batch, cache_len), bool, mesh, ("batch", None)),
            jax.ShapeDtypeStruct((), jnp.int32, sharding=NamedSharding(mesh, P())))
    fn = jax.jit(decode_step, static_argnums=0, donate_argnums=2)
    with jax.set_mesh(mesh):
        return fn.lower(cfg, *args)


def train_config(path: str, batch: int | None, seq: int | None, overrides=()):
    """train/config.py's Config from a YAML; a model-only YAML gets a planning `train:` section (bfloat16
    compute, full remat). `batch` / `seq` override train.batch_size / train.seq_len."""
    from train.config import apply_overrides, config_from_raw

    raw = apply_overrides(read_yaml(path), list(overrides))
    tr = dict(raw.get("train") or {})
    tr.setdefault("steps", 1)
    tr.setdefault("compute_dtype", "bfloat16")
    tr.setdefault("remat", "full")
    tr.setdefault("seq_len", 4096)
    if batch is not None:
        tr["batch_size"] = int(batch)
    if seq is not None:
        tr["seq_len"] = int(seq)
    tr.setdefault("batch_size", 1)
    raw["train"] = tr
    return config_from_raw(raw)


def abstract_train_state(tcfg, mesh: Mesh):
    """The training state as sharded `ShapeDtypeStruct`s: float32 master weights, AdamW state sharded like
    the params, replicated step and RNG."""
    from train.step import TrainState, make_optimizer

    rep = NamedSharding(mesh, P())
    params = abstract_sharded_params(tcfg.model, mesh, jnp.float32)
    opt_shapes = jax.eval_shape(make_optimizer(tcfg, params).init, params)
    opt_sh = opt_state_shardings(opt_shapes, param_shardings(tcfg.model, mesh), mesh)
    opt_abs = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), opt_shapes, opt_sh)
    return TrainState(jax.ShapeDtypeStruct((), jnp.int32, sharding=rep), params, opt_abs,
                      jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=rep))


def lower_train(tcfg, mesh: Mesh):
    """train/step.py's training step lowered on `mesh`: float32 master weights and AdamW state sharded like the
    params, the batch `[A, b, S]` over the batch axes, the state donated."""
    from train.step import TrainBatch, make_train_step

    state = abstract_train_state(tcfg, mesh)
    a = tcfg.train.grad_accum
    b, s = tcfg.train.batch_size // a, tcfg.train.seq_len
    row = (None, "batch", None)
    batch = TrainBatch(_sds((a, b, s), jnp.int32, mesh, row), _sds((a, b, s), bool, mesh, row),
                       _sds((a, b, s), jnp.int32, mesh, row), _sds((a, 3, b, s), jnp.int32, mesh, (None, None, "batch", None)),
                       _sds((a, b, s), jnp.int32, mesh, row))
    state_sh = jax.tree.map(lambda x: x.sharding, state)
    fn = jax.jit(make_train_step(tcfg, state.params), donate_argnums=0,
                 out_shardings=(state_sh, NamedSharding(mesh, P())))
    with jax.set_mesh(mesh):
        return fn.lower(state, batch)


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


def matmul_params(cfg: ModelConfig) -> int:
    """Parameters that multiply activations in the text stack (layers + lm_head); lookups are free."""
    t = cfg.text
    q, kv = t.num_attention_heads * t.head_dim, t.num_key_value_heads * t.head_dim
    per_layer = t.hidden_size * (2 * q + 2 * kv) + 3 * t.hidden_size * t.intermediate_size
    return t.num_hidden_layers * per_layer + t.hidden_size * t.vocab_size


def train_flops(cfg: ModelConfig, batch: int, seq: int, passes: int = 1) -> dict:
    """Analytic FLOPs of one step: 6·N·tokens + attention (QKᵀ and AV, 4·S²·H·hd a layer forward, counted
    fully, ×3 for the backward) + (passes − 1) gradient-free introspection forwards."""
    t = cfg.text
    tokens = batch * seq
    attn_fwd = 4 * batch * seq * seq * t.num_attention_heads * t.head_dim * t.num_hidden_layers
    dense_fwd = 2 * matmul_params(cfg) * tokens
    out = {"6N_tokens": 3 * dense_fwd, "attention": 3 * attn_fwd, "introspection": (passes - 1) * (dense_fwd + attn_fwd)}
    out["total"] = sum(out.values())
    return out


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
            "flops": train_flops(tcfg.model, tr.batch_size, tr.seq_len, tr.introspection_passes)}


def plan_train(tcfg, p: Preset, devices) -> dict:
    mesh = make_mesh(p.train, devices)
    out = _train_plan_head(tcfg, mesh)
    t0 = time.time()
    try:
        compiled = lower_train(tcfg, mesh).compile()
    except Exception as e:     # the TPU compiler refuses what cannot fit: that is the answer, not an error
        oom = compiler_oom(e)
        if oom is None:
            raise
        return {**out, "memory": None, "oom": f"the TPU compiler refused it ({oom})", "fits": False,
                "seconds": time.time() - t0}
    mem = memory(compiled)
    return {**out, "memory": mem, "fits": None if p.hbm_gib is None else mem.total <= p.hbm_gib * GiB,
            "seconds": time.time() - t0}


def plan_decode(cfg: ModelConfig, p: Preset, devices, batch: int, cache_len: int, dtype="bfloat16") -> dict:
    mesh = make_mesh(p.generate, devices)
    t0 = time.time()
    compiled = lower_decode(cfg, mesh, batch, cache_len, dtype).compile()
    mem = memory(compiled)
    weights = bytes_per_device(abstract_sharded_params(cfg, mesh, dtype))
    cache = 2 * math.prod(NamedSharding(mesh, spec_for(
        (cfg.text.num_hidden_layers, batch, cache_len, cfg.text.num_key_value_heads, cfg.text.head_dim),
        CACHE_AXES, mesh)).shard_shape((cfg.text.num_hidden_layers, batch, cache_len, cfg.text.num_key_value_heads,
                                        cfg.text.head_dim))) * jnp.dtype(dtype).itemsize
    out = {"mesh": _mesh_str(mesh), "batch": batch, "cache_len": cache_len, "memory": mem, "weights": weights,
           "seconds": time.time() - t0, "bad_gathers": forbidden_gathers(compiled.as_text(), cfg, batch),
           "fits": None if p.hbm_gib is None else mem.total <= p.hbm_gib * GiB}
    if p.hbm_gib is not None:   # what is left for the cache, as tokens (batch × length) over the whole mesh
        scratch = mem.total - weights - cache
        free = p.hbm_gib * GiB - weights - scratch
        out["kv_budget_tokens"] = max(0, int(free * p.n_devices // kv_bytes_per_token(cfg, dtype)))
    return out


def search_train_batch(make_cfg, p: Preset, devices, seq: int, min_seq: int = 512) -> tuple[int, dict]:
    """Largest global batch (a multiple of the batch shards) whose training step fits at `seq`: two compiles
    fix the affine memory model, a third checks its prediction (stepping down while it does not fit). When
    not even one row per batch shard fits, the sequence is halved (down to `min_seq`) until it does: the
    result's `seq` says which length was planned. Returns (batch, result of the largest fitting compile, or
    of the last one tried when nothing fits)."""
    mesh = make_mesh(p.train, devices)
    unit = mesh.shape["data"] * mesh.shape["fsdp"]
    cfg = make_cfg(unit, seq)
    state = bytes_per_device(abstract_train_state(cfg, mesh))
    if p.hbm_gib is not None and state > p.hbm_gib * GiB:     # no compile can fit: say why without one
        return 0, {**_train_plan_head(cfg, mesh), "memory": None, "fits": False, "seconds": 0.0,
                   "oom": f"the float32 weights + AdamW state alone are {_gib(state)} a device"}
    r1 = plan_train(cfg, p, devices)
    while not r1["fits"] and seq // 2 >= min_seq:
        seq //= 2
        r1 = plan_train(make_cfg(unit, seq), p, devices)
    if not r1["fits"]:
        return 0, r1
    r2 = plan_train(make_cfg(2 * unit, seq), p, devices)
    if not r2["fits"]:
        return unit, r1
    slope = max(r2["memory"].total - r1["memory"].total, 1)
    k = max(2, int((p.hbm_gib * GiB - r1["memory"].total) // slope) + 1)
    best = (2 * unit, r2)
    for k in (k, k - 1, k // 2):
        if k <= 2:
            break
        r = plan_train(make_cfg(k * unit, seq), p, devices)
        if r["fits"]:
            best = (k * unit, r)
            break
    return best


def format_train(r: dict, p: Preset, tcfg) -> str:
    m, f = r["memory"], r["flops"]
    hbm = "simulated" if p.hbm_gib is None else f"{p.hbm_gib:g} GiB"
    verdict = "" if r["fits"] is None else (": fits" if r["fits"] else ": DOES NOT FIT")
    tr = tcfg.train
    lines = [f"training step  mesh {r['mesh']}; batch {r['batch']} × seq {r['seq']} (grad_accum {tr.grad_accum}, "
             f"introspection passes {tr.introspection_passes}); params + AdamW float32, compute {tr.compute_dtype}, "
             f"remat {tr.remat}",
             f"  per device: arguments {_gib(m.arguments)}, outputs {_gib(m.outputs)} (aliased {_gib(m.aliased)}), "
             f"temporaries {_gib(m.temporaries)} → {_gib(m.total)} of {hbm}{verdict}" if m is not None else
             f"  per device: {r['oom']}{verdict}",
             f"  FLOPs/step: 6·N·tokens {f['6N_tokens']:.3e} + attention {f['attention']:.3e} + introspection "
             f"{f['introspection']:.3e} = {f['total']:.3e} ({f['total'] / p.n_devices:.3e} per device)"]
    chip = (p.topology or "").split(":")[0]
    if chip in PEAK_BF16_TFLOPS:
        lines.append(f"  at 100% of the {chip} bf16 peak: {f['total'] / p.n_devices / (PEAK_BF16_TFLOPS[chip] * 1e12):.2f}"
                     " s/step")
    lines.append(f"  compiled in {r['seconds']:.0f} s")
    return "\n".join(lines)


def format_decode(r: dict, p: Preset) -> str:
    m = r["memory"]
    hbm = "simulated" if p.hbm_gib is None else f"{p.hbm_gib:g} GiB"
    verdict = "" if r["fits"] is None else (": fits" if r["fits"] else ": DOES NOT FIT")
    lines = [f"decode step    mesh {r['mesh']}; batch {r['batch']}, cache {r['cache_len']} slots, bfloat16",
             f"  per device: weights {_gib(r['weights'])}, arguments {_gib(m.arguments)}, temporaries "
             f"{_gib(m.temporaries)} → {_gib(m.total)} of {hbm}{verdict}"]
    if "kv_budget_tokens" in r:
        lines.append(f"  KV-cache budget: {r['kv_budget_tokens']:,} tokens (batch × length) over the mesh")
    bad = r["bad_gathers"]
    lines.append("  whole-table / [B, V] all-gathers: " + (", ".join(f"{d}{list(s)}" for d, s in bad) if bad else "none"))
    lines.append(f"  compiled in {r['seconds']:.0f} s")
    return "\n".join(lines)


def run(args) -> int:
    p = preset(args.mesh)
    if p.topology is None and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   f" --xla_force_host_platform_device_count={p.n_devices}").strip()
    devices = plan_devices(p)
    tcfg = train_config(args.config, args.batch, args.seq, args.set)
    print(f"prisma plan: {args.config} on {p.name} ({p.topology or 'simulated CPU'}, {p.n_devices} devices"
          + (f", {p.hbm_gib:g} GiB HBM each)" if p.hbm_gib else ")"))
    if args.search:
        best, r = search_train_batch(lambda b, s: train_config(args.config, b, s, args.set), p, devices,
                                     tcfg.train.seq_len)
        print(format_train(r, p, train_config(args.config, r["batch"], r["seq"], args.set)))
        if best and r["seq"] == tcfg.train.seq_len:
            print(f"  largest batch that fits at seq {r['seq']}: {best}")
        elif best:
            print(f"  nothing fits at seq {tcfg.train.seq_len}; largest that fits: batch {best} × seq {r['seq']}")
        else:
            print(f"  nothing fits, even one row per batch shard at seq {r['seq']}")
    elif not args.no_train:
        print(format_train(plan_train(tcfg, p, devices), p, tcfg))
    gen_mesh = make_mesh(p.generate, devices)
    gb = args.gen_batch or gen_mesh.shape["data"] * gen_mesh.shape["fsdp"]
    r = plan_decode(tcfg.model, p, devices, gb, args.cache_len or tcfg.train.seq_len)
    print(format_decode(r, p))
    return 0


def add_parser(sub):
    ap = sub.add_parser("plan", help="ahead-of-time compile the training and decode steps for a TPU slice "
                                     "(memory per device, fits or not, FLOPs)")
    ap.add_argument("--config", required=True, help="model (+ training) YAML, e.g. configs/prisma_vl_8b.yaml")
    ap.add_argument("--mesh", required=True, help=f"preset: {', '.join(PRESETS)}")
    ap.add_argument("--batch", type=int, help="global training batch (default: train.batch_size or 1)")
    ap.add_argument("--seq", type=int, help="training sequence length (default: train.seq_len or 4096)")
    ap.add_argument("--gen-batch", type=int, help="decode batch (default: one row per batch shard)")
    ap.add_argument("--cache-len", type=int, help="decode KV-cache slots (default: the training seq)")
    ap.add_argument("--search", action="store_true", help="find the largest training batch that fits")
    ap.add_argument("--no-train", action="store_true", help="only the decode step")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="config override, e.g. train.remat=dots (repeatable)")
    ap.set_defaults(func=run)
