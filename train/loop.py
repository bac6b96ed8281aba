"""The training loop: data → jitted step → metrics, checkpoints, preemption.

Workdir layout::

    DIR/checkpoints/<step>/state                 Orbax: TrainState (params, optimizer, step, RNG), each process
                                                 writing its own shards
    DIR/checkpoints/<step>/data/process_<i>-of-<n>.json   each process's grain iterator position (grain's
                                                 Orbax handler): process i resumes from its own records
    DIR/checkpoints/<step>/meta                  the model and run config (the model is checked on resume);
                                                 with LoRA (the state then holds the trained leaves only) the
                                                 base's identity: train.init's path and crc32s, or the seed
    DIR/metrics.jsonl                            one JSON object per logged step, written by process 0 only
    DIR/tb/                                      the same scalars for TensorBoard (tensorboardX), process 0 only

Running again with the same DIR resumes from its latest checkpoint; with the same config the losses equal
those of an uninterrupted run bit for bit (the step is deterministic, the state and the iterator position
are restored exactly). `stop_at` (the CLI's `--steps N`) ends the run after global step N without touching
the schedule, which `train.steps` defines. SIGTERM (a TPU preemption notice) lets the current step finish,
saves, and returns normally (exit 0); on several processes a SIGTERM to any of them stops all of them after
one common step (JAX's preemption sync point), which each saves.

On several processes (one per host) every process runs this loop on its own rows (`process_index::process_count`
of the records): the metrics are the mesh's global values, so process 0 alone writes them (and shows the
progress bar), as MaxText does. Each process saves and restores its own iterator position; a checkpoint is
resumed with the process count that saved it (the records are dealt to hosts by that count), else an error says
so.
"""
from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
import zlib

import grain.checkpoint
import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from prisma_jax.core.partitioning import batch_shards

from train import data as data_mod, sharded
from train.config import Config
from train.step import TrainState, init_lora, init_state, make_train_step


class _Preemption:
    """When to save and stop early; `reached` is asked once per step, after the step. One process: a SIGTERM
    handler sets a flag. Several processes: JAX's preemption sync manager (started by `jax.distributed.initialize`,
    with its own SIGTERM handler, which a Python one would replace) names one step, the same on every process, once
    any of them is signalled; every process then saves that step, so their collectives and Orbax's barriers stay
    paired. It is asked with this run's own step count (1, 2, ...): a notice that comes before the first step (during
    a restore or the compile) names step 1, whatever step the run resumed from."""

    def __init__(self, start: int):
        self.shared, self.start, self.flag = jax.process_count() > 1, start, False
        self.old = None if self.shared else signal.signal(signal.SIGTERM, self._signalled)

    def _signalled(self, signum, frame):
        self.flag = True

    def reached(self, step: int) -> bool:
        return multihost_utils.reached_preemption_sync_point(step - self.start) if self.shared else self.flag

    def close(self):
        if not self.shared:
            signal.signal(signal.SIGTERM, self.old)


CHECKPOINT_ITEMS = ("state", "data", "meta")


def checkpoint_dir(workdir: str) -> str:
    return os.path.join(os.path.abspath(workdir), "checkpoints")


class _Manager(ocp.CheckpointManager):
    """Orbax's manager without its own questions to JAX's preemption sync manager (it asks in `should_save`, `save`
    and its finalize thread, with checkpoint step numbers, which would move the sync point): the loop alone asks,
    once a step (`_Preemption`), and forces that step's save."""

    def reached_preemption(self, step: int) -> bool:
        return False


def _manager(cfg: Config, workdir: str) -> ocp.CheckpointManager:
    k = cfg.checkpoint
    opts = ocp.CheckpointManagerOptions(save_interval_steps=k.every, max_to_keep=k.keep,
                                        enable_async_checkpointing=k.asynchronous)
    return _Manager(checkpoint_dir(workdir), options=opts, item_names=CHECKPOINT_ITEMS)


class _Position:
    """A recorded iterator state, saved by grain's handler as the iterator's own would be (`get_state`: the
    JSON bytes). The loop records the position after the batch of the step being saved, while the iterator
    itself has already moved on to the next batch."""

    def __init__(self, state: dict):
        self.state = state

    def get_state(self) -> bytes:
        return json.dumps(self.state, indent=4).encode()


def _restore_data(mngr: ocp.CheckpointManager, step: int, iterator) -> None:
    """Set `iterator` to this process's saved position of checkpoint `step`."""
    directory = os.path.join(str(mngr.directory), str(step), "data")
    n, i = jax.process_count(), jax.process_index()
    names = os.listdir(directory) if os.path.isdir(directory) else []
    if f"process_{i}-of-{n}.json" not in names:
        if n == 1 and "metadata" in names:   # saved before per-process states: the JSON item of one process
            old = ocp.CheckpointManager(mngr.directory, item_names=("data",))   # keeps `mngr`'s grain handler
            try:
                iterator.set_state(old.restore(step, args=ocp.args.Composite(data=ocp.args.JsonRestore()))["data"])
            finally:
                old.close()
            return
        saved = sorted({int(m.group(1)) for m in map(re.compile(r"process_\d+-of-(\d+)\.json$").match, names) if m})
        raise ValueError(f"{mngr.directory}: the data state of step {step} was saved by "
                         f"{' or '.join(map(str, saved)) or 'no'} process(es), this run has {n}: resume with the "
                         f"process count that saved it (the records are dealt to hosts by it)")
    mngr.restore(step, args=ocp.args.Composite(data=grain.checkpoint.CheckpointRestore(iterator)))


def _diff(a: dict, b: dict, prefix="") -> list[str]:
    out = []
    for k in sorted(set(a) | set(b)):
        va, vb = a.get(k), b.get(k)
        if isinstance(va, dict) and isinstance(vb, dict):
            out += _diff(va, vb, f"{prefix}{k}.")
        elif va != vb:
            out.append(f"{prefix}{k}: checkpoint {va!r}, config {vb!r}")
    return out


def _as_dict(state: TrainState) -> dict:
    return {"step": state.step, "params": state.params, "opt_state": state.opt_state, "rng": state.rng}


def _initial_params(cfg: Config):
    if cfg.train.init is None:
        return None
    from prisma_jax.checkpoint.loading import load_hf
    params, mcfg = load_hf(cfg.train.init, dtype="float32")
    mcfg = mcfg.replace(attention=cfg.model.attention)         # the kernels are the run's choice, not the model's
    if mcfg != cfg.model:
        raise ValueError(f"train.init {cfg.train.init}: its model differs from the config's model: "
                         + "; ".join(_diff(mcfg.to_dict(), cfg.model.to_dict())[:4]))
    return params


def base_identity(cfg: Config) -> dict:
    """What a LoRA run's frozen base is: train.init's directory and the crc32 of each of its files, or the
    seed of a random base."""
    if cfg.train.init is None:
        return {"random_seed": cfg.train.seed}
    path = os.path.abspath(cfg.train.init)
    crcs = {}
    for name in sorted(os.listdir(path)):
        if name.endswith((".safetensors", ".json")) and os.path.isfile(os.path.join(path, name)):
            crc = 0
            with open(os.path.join(path, name), "rb") as f:
                while chunk := f.read(1 << 24):
                    crc = zlib.crc32(chunk, crc)
            crcs[name] = f"{crc:08x}"
    return {"path": path, "crc32": crcs}


def restore_or_init(cfg: Config, mngr: ocp.CheckpointManager, iterator, mesh=None):
    """(the latest checkpoint in the manager's directory (checked to hold this model), or a fresh state; with
    LoRA the frozen base, else None). On `mesh`, created or restored directly in its shardings."""
    latest = mngr.latest_step()
    base = None
    if latest is None:
        if mesh is not None:
            return sharded.init_state(cfg, mesh)
        if cfg.train.lora is not None:
            return init_lora(cfg, _initial_params(cfg))
        return init_state(cfg, _initial_params(cfg)), None
    meta = mngr.restore(latest, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    saved = {k: v for k, v in meta.get("model", {}).items() if k != "attention"}     # a run may switch kernels
    diff = _diff(saved, {k: v for k, v in json.loads(json.dumps(cfg.model.to_dict())).items() if k != "attention"})
    if diff:
        raise ValueError(f"{mngr.directory} holds a checkpoint (step {latest}) of a different model ("
                         + "; ".join(diff[:4]) + "): use another --workdir")
    if (cfg.train.lora is None) != (meta.get("base") is None):
        raise ValueError(f"{mngr.directory} holds a {'full' if meta.get('base') is None else 'LoRA'} fine-tuning "
                         f"checkpoint (step {latest}); this config is {'full' if cfg.train.lora is None else 'LoRA'} "
                         "fine-tuning: use another --workdir")
    if cfg.train.lora is not None:
        if meta["base"] != base_identity(cfg):
            raise ValueError(f"{mngr.directory}: the LoRA checkpoint (step {latest}) was trained on another base "
                             f"({meta['base'].get('path', meta['base'])}) than train.init now gives; its files or "
                             "seed differ")
        base = init_lora(cfg, _initial_params(cfg))[1] if mesh is None else sharded.init_state(cfg, mesh)[1]
    shapes = jax.eval_shape(lambda: _as_dict(init_state(cfg)))
    if mesh is None:
        dev = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=dev), shapes)
    else:
        target = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes,
                              _as_dict(sharded.state_shardings(cfg, mesh)))
    s = mngr.restore(latest, args=ocp.args.Composite(state=ocp.args.StandardRestore(target)))["state"]
    _restore_data(mngr, latest, iterator)
    return TrainState(s["step"], s["params"], s["opt_state"], s["rng"]), base


_STEPS: dict = {}


def compiled_step(cfg: Config, params, mesh=None):
    """The jitted step for this config, one per process (a resumed run in the same process reuses it). On a
    mesh the new state keeps the state's shardings and the metrics are replicated."""
    if cfg not in _STEPS:
        out = None
        if mesh is not None:
            out = (sharded.state_shardings(cfg, mesh), jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
        _STEPS[cfg] = jax.jit(make_train_step(cfg, params), donate_argnums=0,
                              **({} if out is None else {"out_shardings": out}))
    return _STEPS[cfg]


def _trim_metrics(path: str, upto: int) -> None:
    """Drop metric lines past the restored step (written after the checkpoint, before an interruption)."""
    if not os.path.isfile(path):
        return
    with open(path) as f:
        keep = [ln for ln in f if ln.strip() and json.loads(ln)["step"] <= upto]
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.writelines(keep)
    os.replace(tmp, path)


def run(cfg: Config, workdir: str, stop_at: int | None = None, progress: bool = True, log=print) -> dict:
    """Train until global step `stop_at` (default train.steps) or SIGTERM; returns the last metrics."""
    os.makedirs(workdir, exist_ok=True)
    stop_at = cfg.train.steps if stop_at is None else stop_at
    if stop_at < 1:
        raise ValueError(f"--steps must be ≥ 1, got {stop_at}")
    mesh = sharded.mesh_of(cfg)
    if mesh is not None:
        t, n = cfg.train, batch_shards(mesh)
        if (t.batch_size // t.grad_accum) % n:
            raise ValueError(f"train.batch_size {t.batch_size} / train.grad_accum {t.grad_accum} = "
                             f"{t.batch_size // t.grad_accum} rows per micro-batch is not a multiple of the mesh's "
                             f"{n} batch shards (data × fsdp of {dict(mesh.shape)})")
    if jax.process_count() > 1 and not jax.config.jax_enable_preemption_service:
        raise ValueError("training on several processes needs JAX's preemption service (jax_enable_preemption_service, "
                         "on by default), so that a SIGTERM stops every process after the same step")
    dataset, info = data_mod.build(cfg, workdir)
    iterator = iter(dataset)
    mngr = _manager(cfg, workdir)
    try:
        state, base = restore_or_init(cfg, mngr, iterator, mesh)
        start = int(state.step)
        where = "" if mesh is None else f" on mesh {dict(mesh.shape)}"
        log(f"data: {info.line() if info.records >= 0 else 'synthetic'}; "
            f"{'resuming from step ' + str(start) if start else 'starting from scratch'} in {workdir}{where}")
        return _loop(cfg, workdir, mngr, iterator, state, start, stop_at, progress, log, mesh, base)
    finally:
        mngr.close()


def _loop(cfg, workdir, mngr, iterator, state, start, stop_at, progress, log, mesh=None, base=None):
    from tensorboardX import SummaryWriter
    from tqdm import tqdm

    chief = jax.process_index() == 0      # the one process that writes metrics
    metrics_path = os.path.join(workdir, "metrics.jsonl")
    if chief:
        _trim_metrics(metrics_path, start)
    meta = {"model": cfg.model.to_dict(), "config": cfg.to_dict()}
    if base is not None:
        meta["base"] = base_identity(cfg)
    step_fn = compiled_step(cfg, state.params, mesh)
    writer = SummaryWriter(os.path.join(workdir, "tb")) if chief else None
    bar = tqdm(total=stop_at, initial=start, disable=not (progress and chief), file=sys.stderr, desc="train",
               unit="step")
    last: dict = {}
    step = start

    def save(step, st, data_state, force=False):
        mngr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(_as_dict(st)),
                                                data=grain.checkpoint.CheckpointSave(_Position(data_state)),
                                                meta=ocp.args.JsonSave(meta)), force=force)

    def fetch():
        b = next(iterator)
        return b, iterator.get_state()                 # position after this batch = after its step

    preemption = _Preemption(start)
    try:
        with open(metrics_path if chief else os.devnull, "a") as mf:
            batch, next_data_state = fetch()
            while step < stop_at:
                t0 = time.perf_counter()
                data_state = next_data_state
                n_in = int(np.sum(batch.attention_mask > 0)) * jax.process_count()   # real tokens
                if mesh is not None:
                    with jax.set_mesh(mesh):
                        state, m = step_fn(state, sharded.put_batch(batch, mesh), *([] if base is None else [base]))
                else:
                    state, m = step_fn(state, batch, *([] if base is None else [base]))
                if step + 1 < stop_at:   # the step runs asynchronously: build the next batch meanwhile
                    batch, next_data_state = fetch()
                m = jax.device_get(m)
                dt = time.perf_counter() - t0
                step += 1
                last = {"step": step, **{k: float(v) for k, v in m.items()}, "tokens_per_sec": n_in / dt,
                        "step_time": dt}
                if chief and (step % cfg.train.log_every == 0 or step == stop_at):
                    mf.write(json.dumps(last) + "\n")
                    mf.flush()
                    for k, v in last.items():
                        if k != "step":
                            writer.add_scalar(f"train/{k}", v, step)
                bar.update(1)
                bar.set_postfix(loss=f"{last['loss']:.4f}", tok_s=f"{last['tokens_per_sec']:.0f}")
                stop = preemption.reached(step)   # read once: the save below and the exit agree
                save(step, state, data_state, force=stop or step == stop_at)
                if stop:
                    log(f"SIGTERM: saved step {step}, exiting")
                    break
        mngr.wait_until_finished()
    finally:
        preemption.close()
        bar.close()
        if writer is not None:
            writer.close()
    return last
