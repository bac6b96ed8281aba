"""Multi-device scenarios for tests/test_sharding*.py, each run in its own process so that the pytest process
stays single-device. The parent sets XLA_FLAGS (device count) before this imports JAX.

    python sharding_worker.py mesh CKPT OUT           # one process, 8 CPU devices: sharded vs one device
    python sharding_worker.py mh_train PORT PID OUT   # one of two processes × 4 devices: tiny_sft steps + save
    python sharding_worker.py mh_restore PORT PID OUT # one of two fresh processes: restore + check
    python sharding_worker.py tpu OUT                 # tiny-model TPU ahead-of-time compiles (v5p:2x2x1)
    python sharding_worker.py table CKPT SEED OUT     # 8 CPU devices: fresh tables on the mesh, batch rules

Results go to OUT (JSON + .npz); the tests assert on them against the single-device numbers.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
BATCH, SEQ = 8, 16
MESH = {"data": 2, "fsdp": 2, "tensor": 2}


def tiny_train_cfg():
    from prisma_jax.core.config import read_yaml
    from train.config import config_from_raw

    raw = read_yaml(os.path.join(ROOT, "configs", "tiny.yaml"))
    raw["train"] = dict(steps=10, batch_size=BATCH, seq_len=SEQ, compute_dtype="float32", remat="none",
                        introspection_passes=2)
    raw["optimizer"] = dict(lr=1e-2, clip_norm=1.0, weight_decay=0.01)
    return config_from_raw(raw)


SFT_STEPS = 3


def sft_train_cfg(mesh=None):
    """configs/tiny_sft.yaml (conversations with images, 2 micro-batches of 4 rows) for `SFT_STEPS` steps."""
    import dataclasses

    from prisma_jax.parallel.mesh import MeshSpec
    from train.config import load_train_config

    cfg, _ = load_train_config(os.path.join(ROOT, "configs", "tiny_sft.yaml"), [f"train.steps={SFT_STEPS}"])
    return cfg if mesh is None else dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, mesh=MeshSpec(**mesh)))


def sft_batches(cfg, workdir, host=None, hosts=None) -> list:
    """The first `SFT_STEPS` per-host batches of the tiny_sft pipeline (train/data.py), data in `workdir`."""
    from train import data

    it = iter(data.build(cfg, workdir, host, hosts)[0])
    return [next(it) for _ in range(SFT_STEPS)]


def train_batch_np(cfg, rows=slice(None)):
    """A fixed text batch (left padding in row 1) as TrainBatch fields in NumPy, rows selected."""
    from prisma_jax.host.inputs import prepare

    rng = np.random.default_rng(0)
    ids = rng.integers(7, cfg.text.vocab_size, (BATCH, SEQ))
    mask = np.ones((BATCH, SEQ), bool)
    mask[1, :3] = False
    b = prepare(cfg, ids, mask)
    tgt = np.full((BATCH, SEQ), -1, np.int64)
    tgt[:, :-1] = np.where(mask[:, 1:], ids[:, 1:], -1)
    tgt[:, : SEQ // 2] = -1                      # supervise the second half only
    pos = np.asarray(b.positions)[:, rows]
    return (np.asarray(b.input_ids)[rows][None], np.asarray(b.attention_mask)[rows][None],
            np.asarray(b.codes)[rows][None], pos[None], tgt[rows].astype(np.int32)[None])


def host_params(tcfg) -> dict:
    """Initial float32 params drawn on the host (no threefry compile), identical in every process."""
    from prisma_jax.nn.params import init_params_numpy

    return init_params_numpy(tcfg.model, seed=tcfg.train.seed)


def sharded_state(tcfg, mesh):
    """train/step.py's fresh state from `host_params`, every leaf placed shard by shard in its sharding."""
    from train import sharded
    from train.step import init_state

    return sharded.put_state(init_state(tcfg, host_params(tcfg)), sharded.state_shardings(tcfg, mesh))


def flat(tree) -> dict:
    import jax

    return {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def max_abs_diff(a: dict, b: dict) -> float:
    """The largest |a − b| over every leaf of two `flat` trees."""
    return max(float(np.max(np.abs(a[k] - b[k]))) for k in a)


# ------------------------------------------------------------------------------------------------ scenarios

def scenario_mesh(ckpt: str, out: str) -> None:
    import jax

    from prisma_jax.api import PrismaVL
    from prisma_jax.apps.plan import all_gathers, forbidden_gathers, lower_decode
    from train import loop, sharded
    from train.step import TrainBatch, init_state, make_train_step

    assert len(jax.devices()) == 8
    res: dict = {}
    one = PrismaVL.from_pretrained(ckpt)
    sh = PrismaVL.from_pretrained(ckpt, mesh=MESH)
    res["shards"] = {jax.tree_util.keystr(p): [list(x.shape), [list(s.data.shape) for s in x.addressable_shards],
                                               len({s.device for s in x.addressable_shards})]
                     for p, x in jax.tree_util.tree_flatten_with_path(sh.params)[0]}
    ids = np.random.default_rng(1).integers(7, one.config.text.vocab_size, (4, 12))
    mask = np.ones_like(ids)
    mask[2, :4] = 0
    l1, l8 = one.forward(ids, mask), sh.forward(ids, mask)
    orbax_dir = os.path.join(os.path.dirname(out), "orbax")       # written by the test from CKPT
    ob = PrismaVL.from_pretrained(orbax_dir, mesh=MESH)
    res["orbax_specs_equal"] = all(a.sharding.spec == b.sharding.spec
                                   for a, b in zip(jax.tree.leaves(ob.params), jax.tree.leaves(sh.params)))
    res["orbax_forward_max_diff"] = float(np.max(np.abs(np.asarray(l1) - np.asarray(ob.forward(ids, mask)))))
    res["logits_sharding"] = str(l8.sharding.spec)
    res["forward_max_diff"] = float(np.max(np.abs(np.asarray(l1) - np.asarray(l8))))
    res["codes_equal"] = bool(np.array_equal(one.uncertainty_codes(l1), sh.uncertainty_codes(l8)))
    if hasattr(PrismaVL, "generate"):
        g1 = one.generate(ids[:, 4:], max_new_tokens=6)
        g8 = sh.generate(ids[:, 4:], max_new_tokens=6)
        res["generate_tokens_equal"] = bool(np.array_equal(g1.tokens, g8.tokens))
        res["generate_codes_equal"] = bool(np.array_equal(g1.codes, g8.codes))

    # compiled decode step on the CPU mesh: what does it all-gather?
    hlo = lower_decode(sh.config, sh.mesh, batch=4, cache_len=32, dtype="float32").compile().as_text()
    res["decode_gathers"] = [[d, list(s)] for d, s in all_gathers(hlo)]
    res["decode_forbidden"] = [[d, list(s)] for d, s in forbidden_gathers(hlo, sh.config, 4)]

    # one training step: one device vs the 2x2x2 mesh, same initial params and batch
    tcfg = tiny_train_cfg()
    step = jax.jit(make_train_step(tcfg))
    tb = TrainBatch(*train_batch_np(tcfg.model))
    s1, m1 = step(init_state(tcfg, host_params(tcfg)), tb)
    mesh = sh.mesh
    with jax.set_mesh(mesh):
        s8, m8 = step(sharded_state(tcfg, mesh), sharded.put_batch(tb, mesh))
    res["train_loss_one"], res["train_loss_mesh"] = float(m1["loss"]), float(m8["loss"])
    p1, p8 = flat(s1.params), flat(s8.params)
    res["train_param_max_diff"] = max_abs_diff(p1, p8)
    res["train_param_moved"] = max_abs_diff(p1, flat(host_params(tcfg)))

    # the training loop with `train.mesh` (synthetic data, 3 steps, starting from CKPT: no random-init program
    # to compile) against the same loop on one device
    import dataclasses

    from prisma_jax.parallel.mesh import MeshSpec
    lcfg = dataclasses.replace(tcfg, train=dataclasses.replace(tcfg.train, steps=3, init=ckpt))
    mcfg = dataclasses.replace(lcfg, train=dataclasses.replace(lcfg.train, mesh=MeshSpec(2, 2, 2)))
    work = os.path.dirname(out)
    quiet = dict(progress=False, log=lambda *a: None)
    loop.run(lcfg, os.path.join(work, "loop1"), **quiet)
    loop.run(mcfg, os.path.join(work, "loop8"), stop_at=2, **quiet)
    loop.run(mcfg, os.path.join(work, "loop8"), **quiet)         # resumed on the mesh from step 2
    losses = lambda d: [json.loads(x)["loss"] for x in open(os.path.join(work, d, "metrics.jsonl"))]  # noqa: E731
    res["loop_losses_one"], res["loop_losses_mesh"] = losses("loop1"), losses("loop8")

    # LoRA on the mesh: the same losses as on one device; adapters sharded like their kernels
    from prisma_jax.nn.lora import LoraSpec
    lora = LoraSpec(rank=4, alpha=8.0, targets=("q_proj", "down_proj", "fc1"))
    l1 = dataclasses.replace(lcfg, train=dataclasses.replace(lcfg.train, lora=lora))
    l8 = dataclasses.replace(l1, train=dataclasses.replace(l1.train, mesh=MeshSpec(2, 2, 2)))
    loop.run(l1, os.path.join(work, "lora1"), **quiet)
    loop.run(l8, os.path.join(work, "lora8"), stop_at=2, **quiet)
    loop.run(l8, os.path.join(work, "lora8"), **quiet)
    res["lora_losses_one"], res["lora_losses_mesh"] = losses("lora1"), losses("lora8")
    state, base = sharded.init_state(l8, sharded.mesh_of(l8))
    res["lora_shards"] = {jax.tree_util.keystr(k): sorted({tuple(x.data.shape) for x in v.addressable_shards})
                          for k, v in jax.tree_util.tree_flatten_with_path(state.params)[0]}
    res["lora_base_leaves"] = len(jax.tree.leaves(base))
    np.savez(out + ".npz", **p1)
    with open(out, "w") as f:
        json.dump(res, f)


def scenario_multihost(mode: str, port: str, pid: str, out: str) -> None:
    import jax

    from prisma_jax.parallel import multihost

    multihost.initialize(f"localhost:{port}", 2, int(pid))
    import jax.numpy as jnp
    from jax.experimental import multihost_utils

    from prisma_jax.parallel.placement import abstract_sharded_params
    from train import sharded

    assert jax.process_count() == 2 and len(jax.devices()) == 8 and len(jax.local_devices()) == 4
    tcfg = sft_train_cfg(MESH)
    mesh = sharded.mesh_of(tcfg)
    ckdir = os.path.join(os.path.dirname(out), "orbax_params")
    res: dict = {"process": jax.process_index()}
    if mode == "mh_train":
        # this host's rows of tiny_sft (records process_index::2, images in per-row slots), the loop's step
        from train.loop import compiled_step

        state = sharded_state(tcfg, mesh)
        step = compiled_step(tcfg, state.params, mesh)
        res["losses"] = []
        for local in sft_batches(tcfg, os.path.dirname(out)):
            with jax.set_mesh(mesh):
                state, metrics = step(state, sharded.put_batch(local, mesh))
            res["losses"].append(float(np.asarray(metrics["loss"].addressable_data(0))))
        params = state.params
        multihost.save(ckdir, params)
        res["loop"] = multihost_loop(tcfg, os.path.dirname(out))
    else:
        target = abstract_sharded_params(tcfg.model, mesh, jnp.float32)
        params = multihost.restore(ckdir, target)
        res["restored_specs_match"] = all(
            a.sharding.spec == b.sharding.spec for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(target)))
    full = multihost_utils.process_allgather(params, tiled=True)
    if jax.process_index() == 0:
        np.savez(out + ".npz", **flat(full))
    with open(out, "w") as f:
        json.dump(res, f)
    jax.distributed.shutdown()


def multihost_loop(tcfg, d: str) -> dict:
    """train/loop.py on both processes (the config and compiled step above): a straight run of `SFT_STEPS`
    steps, a run stopped after step 1 then resumed to the end, and a run that process 1 alone gets a SIGTERM
    in, in workdirs both processes share. Returns this process's view: each run's metrics lines (only process
    0 writes them), the per-process data states of each run's checkpoints, and the preempted run's last step."""
    import jax
    from jax.experimental import multihost_utils

    from train import loop

    out: dict = {}
    quiet = dict(progress=False, log=lambda *a: None)
    for name, stops in (("straight", [None]), ("resumed", [1, None])):
        wd = _shared_workdir(d, f"loop_{name}")
        for stop in stops:
            loop.run(tcfg, wd, stop_at=stop, **quiet)
        with open(os.path.join(wd, "metrics.jsonl")) as f:
            out[name] = [json.loads(line) for line in f]
        out[f"{name}_data_states"] = _data_states(wd)
    # a SIGTERM to process 1 alone, once process 0 has logged two steps: both processes stop after one common
    # step (JAX's preemption sync point) and save it together, each its own data position
    wd = _shared_workdir(d, "loop_preempted")
    if jax.process_index() == 1:
        threading.Thread(target=_sigterm_after_two_logged_steps, args=(os.path.join(wd, "metrics.jsonl"),),
                         daemon=True).start()
    out["preempted_last"] = loop.run(tcfg, wd, stop_at=PREEMPT_STEPS, **quiet)["step"]
    multihost_utils.sync_global_devices("preempted run saved")
    out["preempted_data_states"] = _data_states(wd)
    return out


PREEMPT_STEPS = 400


def _shared_workdir(d: str, name: str) -> str:
    import jax
    from jax.experimental import multihost_utils

    wd = os.path.join(d, name)
    if jax.process_index() == 0:   # the data the test generated (train/tiny_sft.py finds it there)
        os.makedirs(wd, exist_ok=True)
        os.symlink(os.path.join(d, "tiny_sft_data"), os.path.join(wd, "tiny_sft_data"))
    multihost_utils.sync_global_devices(f"workdir {name}")
    return wd


def _data_states(wd: str) -> dict:
    """{step: {file name: JSON}} of each checkpoint's per-process data positions."""
    ck = os.path.join(wd, "checkpoints")
    return {step: {n: json.load(open(os.path.join(ck, step, "data", n))) for n in sorted(os.listdir(
        os.path.join(ck, step, "data"))) if n.endswith(".json")} for step in os.listdir(ck) if step.isdigit()}


def _sigterm_after_two_logged_steps(metrics: str) -> None:
    while not (os.path.isfile(metrics) and len(open(metrics).readlines()) >= 2):
        time.sleep(0.05)
    os.kill(os.getpid(), signal.SIGTERM)


def scenario_tpu(out: str) -> None:
    from prisma_jax.core.config import load_config
    from prisma_jax.apps.plan import (abstract_train_batch, all_gathers, bytes_per_device, forbidden_gathers, lower_decode,
                                 lower_train, memory, pallas_kernels, plan_devices, train_config)
    from prisma_jax.parallel.mesh import PRESETS, make_mesh, preset

    cfg = load_config(os.path.join(ROOT, "configs", "tiny.yaml"))
    topology_devices = {q.name: len(plan_devices(q)) for q in PRESETS.values() if q.topology}
    p = preset("v5p-8")
    devices = plan_devices(p)
    mesh = make_mesh({"data": 1, "fsdp": 2, "tensor": 2}, devices)
    compiled = lower_decode(cfg, mesh, batch=4, cache_len=32).compile()
    hlo = compiled.as_text()
    m = memory(compiled)
    res = {"platform": devices[0].platform, "n_devices": len(devices), "memory_total": m.total,
           "arguments": m.arguments, "gathers": [[d, list(s)] for d, s in all_gathers(hlo)],
           "forbidden": [[d, list(s)] for d, s in forbidden_gathers(hlo, cfg, 4)],
           "hlo_has_tpu_layout": ":T(" in hlo, "hlo_has_while": " while(" in hlo,
           "topology_devices": topology_devices}
    # the decode loop at head dim 128 (bf16 cache): the paged decode kernel under "auto", compiled; none under "xla"
    import dataclasses
    wide = cfg.replace(text=dataclasses.replace(cfg.text, head_dim=128, mrope_section=(24, 20, 20)))
    res["decode_kernels"] = {}
    for impl in ("auto", "xla"):
        lowered = lower_decode(wide.replace(attention=impl), mesh, batch=4, cache_len=64)
        lowered.compile()
        res["decode_kernels"][impl] = pallas_kernels(lowered.as_text())
    # the planned training step with and without image slots: what the slots add per device
    tmesh = make_mesh({"data": 1, "fsdp": 4, "tensor": 1}, devices)
    yaml = os.path.join(ROOT, "configs", "tiny.yaml")
    res["train"] = {}
    for images in (0, 2):
        tcfg = train_config(yaml, 8, 64, images=images, image_size=64)
        mt = memory(lower_train(tcfg, tmesh).compile())
        batch = abstract_train_batch(tcfg, tmesh)
        res["train"][images] = {"arguments": mt.arguments, "temporaries": mt.temporaries,
                                "pixel_shape": None if batch.pixel_values is None else list(batch.pixel_values.shape),
                                "pixel_bytes": bytes_per_device(batch.pixel_values)}
    with open(out, "w") as f:
        json.dump(res, f)


def scenario_table(ckpt: str, seed: str, out: str) -> None:
    """CKPT: a plain Qwen3-VL checkpoint (no table). The fresh tables that the mesh paths create for SEED, how
    they are split, and what the batch rules say at each boundary (forward, generation, training)."""
    import dataclasses

    import jax

    from prisma_jax.parallel import multihost
    from prisma_jax.api import PrismaVL
    from prisma_jax.parallel.mesh import MeshSpec
    from train import loop

    assert len(jax.devices()) == 8
    seed = int(seed)
    res: dict = {}
    fc = PrismaVL.from_config(ckpt, seed=seed, mesh=MESH)
    hf = PrismaVL.from_pretrained(ckpt, uncertainty_init="normal", seed=seed, mesh=MESH)
    tables = {"from_config_mesh": fc.params["uncertainty"]["embedding"],
              "hf_mesh": hf.params["uncertainty"]["embedding"]}
    res["table_shards"] = {k: [list(t.shape), sorted({tuple(s.data.shape) for s in t.addressable_shards}),
                               len(t.addressable_shards)] for k, t in tables.items()}

    def error(fn):
        try:
            fn()
        except ValueError as e:
            return str(e)
        return None

    ids = np.random.default_rng(1).integers(7, hf.config.text.vocab_size, (3, 10))
    one = PrismaVL.from_pretrained(ckpt, uncertainty_init="normal", seed=seed)
    res["forward_odd_batch"] = error(lambda: hf.forward(ids))
    res["forward_odd_batch_equal"] = bool(np.allclose(np.asarray(hf.forward(ids)), np.asarray(one.forward(ids)),
                                                      rtol=1e-5, atol=1e-5))
    res["forward_even_batch"] = error(lambda: hf.forward(np.concatenate([ids, ids[:1]])))
    g1, g8 = one.generate(ids, max_new_tokens=5), hf.generate(ids, max_new_tokens=5)
    res["generate_odd_batch_shape"] = list(g8.tokens.shape)
    res["generate_odd_batch_equal"] = bool(np.array_equal(g1.tokens, g8.tokens) and np.array_equal(g1.codes, g8.codes)
                                           and np.array_equal(g1.lengths, g8.lengths))
    mesh = hf.mesh
    res["host_batch_odd_rows"] = error(lambda: multihost.host_batch(np.zeros((1, 6, 4), np.int32), mesh, batch_axis=1))
    res["host_rows_odd_batch"] = error(lambda: multihost.host_rows(mesh, 6))
    tcfg = tiny_train_cfg()
    bad = dataclasses.replace(tcfg, train=dataclasses.replace(tcfg.train, batch_size=12, grad_accum=2,
                                                              mesh=MeshSpec(2, 2, 2)))
    res["train_odd_micro_batch"] = error(lambda: loop.run(bad, os.path.join(os.path.dirname(out), "loop"),
                                                          progress=False, log=lambda *a: None))
    np.savez(out + ".npz", **{k: np.asarray(t) for k, t in tables.items()})
    with open(out, "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "mesh":
        scenario_mesh(sys.argv[2], sys.argv[3])
    elif mode in ("mh_train", "mh_restore"):
        scenario_multihost(mode, *sys.argv[2:5])
    elif mode == "tpu":
        scenario_tpu(sys.argv[2])
    elif mode == "table":
        scenario_table(*sys.argv[2:5])
    else:
        raise SystemExit(f"unknown scenario {mode}")
