"""The training loop: data → jitted step → metrics, checkpoints, preemption.

Workdir layout::

    DIR/checkpoints/<step>/state                 Orbax: TrainState (params, optimizer, step, RNG), each process
                                                 writing its own shards
    DIR/checkpoints/<step>/data/process_<i>-of-<n>.json   each process's grain iterator position (grain's
                                                 Orbax handler): process i resumes from its own records
    DIR/checkpoints/<step>/meta                  the model and run config (the model is checked on resume);
                                                 with LoRA (the state then holds the trained leaves only) the
                                                 base's identity: train.init's path and crc32s, or the seed
    DIR/metrics.jsonl                            one JSON object per logged step (and every skipped one),
                                                 written by process 0 only
    DIR/tb/                                      the same scalars for TensorBoard (tensorboardX), process 0 only

Running again with the same DIR resumes from its latest checkpoint; with the same config the losses equal
those of an uninterrupted run bit for bit (the step is deterministic, the state and the iterator position
are restored exactly). `stop_at` (the CLI's `--steps N`) ends the run after global step N without touching
the schedule, which `train.steps` defines. SIGTERM (a TPU preemption notice) lets the current step finish,
saves, and returns normally (exit 0); on several processes a SIGTERM to any of them stops all of them after
one common step (JAX's preemption sync point), which each saves.

A step whose loss or gradient norm is not finite is skipped on the device (train/step.py `skip_nonfinite`): the
loop counts and logs it, and after `train.max_bad_steps` in a row raises `NonFiniteError` (`prisma train` exits
3). The counts travel in each checkpoint's meta, so a resumed run goes on counting. Nothing non-finite is saved:
a step whose params' global norm is not finite raises before its save.

On several processes (one per host) every process runs this loop on its own rows (`process_index::process_count`
of the records): the metrics are the mesh's global values, so process 0 alone writes them (and shows the
progress bar), as MaxText does. Each process saves and restores its own iterator position; a checkpoint is
resumed with the process count that saved it (the records are dealt to hosts by that count), else an error says
so.
"""
from __future__ import annotations

import json
import math
import os
import re
import signal
import sys
import time
import warnings
import zlib

import grain.checkpoint
import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from prisma_jax.core.partitioning import batch_shards

from train import data as data_mod, sharded
from train.config import Config
from train.flops import device_peak, step_flops
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


class NonFiniteError(RuntimeError):
    """The run cannot go on: too many non-finite steps in a row, or params that are not finite (nothing saved)."""


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
    opts = ocp.CheckpointManagerOptions(save_interval_steps=k.every, max_to_keep=k.keep, keep_period=k.keep_period,
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


def _trim_metrics(path: str, upto: int) -> float:
    """Drop metric lines past the restored step (written after the checkpoint, before an interruption), and with
    a warning any line that is not a JSON object with a step: the torn last line of a run killed mid-write or
    stopped by a full disk, which would otherwise fail every resume. Returns the step time of the dropped
    steps: work lost to the restart (goodput)."""
    lost = 0.0
    if not os.path.isfile(path):
        return lost
    keep = []
    with open(path, errors="replace") as f:
        for i, ln in enumerate(f, 1):
            if not ln.strip():
                continue
            try:
                step = json.loads(ln)["step"]
            except (ValueError, KeyError, TypeError):
                warnings.warn(f"{path}:{i}: not a complete metrics line (torn by an interrupted write?), dropped: "
                              f"{ln.strip()[:80]!r}", stacklevel=2)
                continue
            if step <= upto:
                keep.append(ln.rstrip("\n") + "\n")
            else:
                lost += float(json.loads(ln).get("step_time", 0.0))
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.writelines(keep)
    os.replace(tmp, path)
    return lost


class Goodput:
    """Where a run's wall time went: productive steps, the first step's compile (its time over the median step),
    waiting for data (the first batch, and the host time building the next batch in steps whose device work
    was already done when it was ready: an upper bound), checkpoint saves (their blocking part), and steps lost
    to a restart (the step times of the metrics lines a resume drops: work done again). Measured on the host
    of process 0; `ml-goodput-measurement` (what MaxText uses) records to Google Cloud Logging, which a run off
    GCP (and this project's tests) does not have, so the same split is kept here."""

    def __init__(self, lost: float = 0.0):
        self.t0 = time.perf_counter()
        self.steps: list[float] = []
        self.data = self.save = self.fetched = 0.0
        self.lost = lost

    def summary(self) -> dict:
        wall = time.perf_counter() - self.t0
        typical = float(np.median(self.steps[1:])) if len(self.steps) > 1 else 0.0
        compile_s = max(0.0, self.steps[0] - typical) if self.steps else 0.0
        productive = max(0.0, sum(self.steps) - compile_s - self.data)
        return {"wall_s": wall, "productive_s": productive, "compile_s": compile_s, "data_wait_s": self.data,
                "checkpoint_s": self.save, "lost_to_restarts_s": self.lost,
                "goodput": productive / (wall + self.lost) if wall + self.lost > 0 else 0.0}

    def line(self) -> str:
        g = self.summary()
        return (f"goodput {100 * g['goodput']:.1f} %: {g['productive_s']:.1f} s of productive steps in "
                f"{g['wall_s']:.1f} s (+ {g['lost_to_restarts_s']:.1f} s lost to restarts); compile "
                f"{g['compile_s']:.1f} s, data wait {g['data_wait_s']:.1f} s, checkpoint saves {g['checkpoint_s']:.1f} s")


def _skip_counts(mngr: ocp.CheckpointManager, start: int) -> tuple[int, int]:
    """(skipped steps in all, in a row) up to the restored checkpoint, from its meta; (0, 0) from scratch or from
    a checkpoint saved before they were counted."""
    if not start:
        return 0, 0
    meta = mngr.restore(mngr.latest_step(), args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    s = meta.get("skipped") or {}
    return int(s.get("total", 0)), int(s.get("in_a_row", 0))


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
    dataset, info = data_mod.build(cfg, workdir, skip_log=os.path.join(workdir, "skipped.jsonl"))
    iterator = iter(dataset)
    mngr = _manager(cfg, workdir)
    try:
        state, base = restore_or_init(cfg, mngr, iterator, mesh)
        start = int(state.step)
        where = "" if mesh is None else f" on mesh {dict(mesh.shape)}"
        log(f"data: {info.line() if info.records >= 0 else 'synthetic'}; "
            f"{'resuming from step ' + str(start) if start else 'starting from scratch'} in {workdir}{where}")
        return _loop(cfg, workdir, mngr, iterator, state, start, stop_at, progress, log, mesh, base,
                     _skip_counts(mngr, start), info)
    finally:
        mngr.close()


def _loop(cfg, workdir, mngr, iterator, state, start, stop_at, progress, log, mesh=None, base=None, skips=(0, 0),
          info=None):
    from tensorboardX import SummaryWriter
    from tqdm import tqdm

    chief = jax.process_index() == 0      # the one process that writes metrics
    metrics_path = os.path.join(workdir, "metrics.jsonl")
    goodput = Goodput(_trim_metrics(metrics_path, start) if chief else 0.0)
    flops = step_flops(cfg)["total"]          # model FLOPs a step (train/flops.py), for TFLOP/s and MFU
    n_dev, peak = jax.device_count(), device_peak(jax.devices()[0].device_kind)
    meta = {"model": cfg.model.to_dict(), "config": cfg.to_dict()}
    if base is not None:
        meta["base"] = base_identity(cfg)
    step_fn = compiled_step(cfg, state.params, mesh)
    writer = SummaryWriter(os.path.join(workdir, "tb")) if chief else None
    bar = tqdm(total=stop_at, initial=start, disable=not (progress and chief), file=sys.stderr, desc="train",
               unit="step")
    last: dict = {}
    step = start
    checked = cfg.train.max_bad_steps is not None
    total, in_a_row = skips                            # skipped steps: in all, and the current run of them

    def save(step, st, data_state, force=False):
        t = time.perf_counter()
        _save(step, st, data_state, force)
        goodput.save += time.perf_counter() - t

    def _save(step, st, data_state, force):
        mngr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(_as_dict(st)),
                                                data=grain.checkpoint.CheckpointSave(_Position(data_state)),
                                                meta=ocp.args.JsonSave({**meta, "skipped": {
                                                    "total": total, "in_a_row": in_a_row}})), force=force)

    def fetch():
        t = time.perf_counter()
        b = next(iterator)
        goodput.fetched = time.perf_counter() - t
        return b, iterator.get_state()                 # position after this batch = after its step

    preemption = _Preemption(start)
    try:
        with open(metrics_path if chief else os.devnull, "a") as mf:
            batch, next_data_state = fetch()
            goodput.data += goodput.fetched                  # nothing to overlap the first batch with
            while step < stop_at:
                t0 = time.perf_counter()
                data_state = next_data_state
                n_in = int(np.sum(batch.attention_mask > 0)) * jax.process_count()   # real tokens
                if mesh is not None:
                    with jax.set_mesh(mesh):
                        state, m = step_fn(state, sharded.put_batch(batch, mesh), *([] if base is None else [base]))
                else:
                    state, m = step_fn(state, batch, *([] if base is None else [base]))
                goodput.fetched = 0.0
                if step + 1 < stop_at:   # the step runs asynchronously: build the next batch meanwhile
                    batch, next_data_state = fetch()
                t_get = time.perf_counter()
                m = jax.device_get(m)
                if time.perf_counter() - t_get < 1e-3:    # the device was done first: the step waited on data
                    goodput.data += goodput.fetched
                dt = time.perf_counter() - t0
                goodput.steps.append(dt)
                step += 1
                tflops = flops / dt / n_dev / 1e12        # model TFLOP/s a device
                last = {"step": step, **{k: float(v) for k, v in m.items()}, "tokens_per_sec": n_in / dt,
                        "step_time": dt, "tflops": tflops, **({} if peak is None else {"mfu": tflops / peak})}
                if info is not None and info.records >= 0:    # records found bad when loaded (train/data.py)
                    last["data_skipped"] = info.skipped_at_load
                skipped = checked and bool(m["skipped"])
                if checked:
                    total, in_a_row = total + skipped, in_a_row + 1 if skipped else 0
                    last.update(skipped=int(skipped), skipped_total=total)
                if chief and (step % cfg.train.log_every == 0 or step == stop_at or skipped):
                    mf.write(json.dumps(last) + "\n")
                    mf.flush()
                    for k, v in last.items():
                        if k != "step":
                            writer.add_scalar(f"train/{k}", v, step)
                bar.update(1)
                bar.set_postfix(loss=f"{last['loss']:.4f}", tok_s=f"{last['tokens_per_sec']:.0f}")
                if skipped:
                    log(f"step {step}: loss {last['loss']}, grad_norm {last['grad_norm']}: not finite, update "
                        f"skipped ({in_a_row} in a row, {total} in all)")
                    if in_a_row >= cfg.train.max_bad_steps:
                        raise NonFiniteError(
                            f"step {step}: {in_a_row} steps in a row had a non-finite loss or gradient norm "
                            f"(train.max_bad_steps {cfg.train.max_bad_steps}; {total} skipped in all): stopping; "
                            "none of their updates was applied, so the latest checkpoint holds the params from before them")
                if checked and not math.isfinite(last["param_norm"]):
                    raise NonFiniteError(f"step {step}: the params' global norm is {last['param_norm']}: "
                                         "not saving a non-finite checkpoint; stopping")
                stop = preemption.reached(step)   # read once: the save below and the exit agree
                save(step, state, data_state, force=stop or step == stop_at)
                if stop:
                    log(f"SIGTERM: saved step {step}, exiting")
                    break
        t = time.perf_counter()
        mngr.wait_until_finished()
        goodput.save += time.perf_counter() - t
    finally:
        preemption.close()
        bar.close()
        if chief and goodput.steps:
            g = goodput.summary()
            log(goodput.line())
            _write_json(os.path.join(workdir, "goodput.json"), g)
            if writer is not None:
                for k, v in g.items():
                    writer.add_scalar(f"goodput/{k}", v, step)
        if writer is not None:
            writer.close()
    return last


def _write_json(path: str, obj) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(tmp, path)
