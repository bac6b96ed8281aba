"""A training run's checkpoint → a Hugging Face checkpoint directory (`prisma convert train-to-hf`).

    WORKDIR/checkpoints/<step>/{state, meta}  →  DST/{model.safetensors (or ≤ 5 GB shards + index), config.json,
                                                     generation_config.json, + the tokenizer/processor files}

Only the params of the chosen step (default: the latest) are read, never the optimizer state, and never a
whole leaf: each param array is read with tensorstore in regions of whole storage chunks (as Orbax wrote
them, OCDBT or not, zarr v2 or v3, as `state/_METADATA` says), up to `REGION_BYTES` or one chunk, and each
region is cut into row blocks of its Hugging Face tensors (the same name table as every other conversion,
`params.hf_names`), which are written in place into their shard files (`safetensors_io.PieceWriter`). Peak
memory is one chunk read, about 2–2.5 × the largest storage chunk (tensorstore holds the compressed chunk,
the decoded one and the copy it returns; Orbax's chunks are at most 2 GiB on a local filesystem, 400 MiB on
GCS, and at most one shard of a sharded save), plus a block, whatever the model's size or its layer count:
5.0 GB for the full 8B's training checkpoint (docs/benchmarks.md). The model config is the one the checkpoint
recorded (`meta.model`). Written in a staging directory, fsynced and swapped in at the end
(conversion/staging.py).

A LoRA run's checkpoint holds the trained leaves only: `merge_lora=True` folds its adapters into its base
(train.init, checked against the crc32s the run recorded, or the random base of its seed) and writes the
merged model, held once in float32; `adapters=True` writes the adapters alone in peft's layout
(`adapter_model.safetensors`, `adapter_config.json`) and, when the run trained it, the uncertainty table
(`uncertainty_table.safetensors`, the Hugging Face tensor name).
"""
from __future__ import annotations

import json
import os

import numpy as np

from prisma_jax.checkpoint import orbax as L
from conversion.orbax_to_hf import MAX_SHARD_BYTES
from conversion.staging import Staging, check_destination, copy_side_files
from prisma_jax.core.config import ModelConfig, config_from_dict, config_to_hf
from prisma_jax.core.trees import get_path, set_path
from prisma_jax.checkpoint.hf_names import hf_names
from prisma_jax.checkpoint.safetensors import INDEX_NAME, SINGLE_NAME, CheckpointError, PieceWriter, plan_shards

REGION_BYTES = 256 << 20   # the most read at once, unless one storage chunk is larger


class TrainCheckpoint:
    """The params of one step of a `prisma train` run, read region by region (`regions`), never whole.
    `.config` is the model config the run recorded, `.step` the step; close() when done."""

    def __init__(self, workdir: str, step: int | None = None):
        import orbax.checkpoint as ocp

        from train.loop import CHECKPOINT_ITEMS, checkpoint_dir

        directory = checkpoint_dir(workdir)
        if not os.path.isdir(directory):
            raise ValueError(f"{workdir}: no checkpoints/ directory (is this a `prisma train` --workdir?)")
        mngr = ocp.CheckpointManager(directory, item_names=CHECKPOINT_ITEMS)
        try:
            steps = mngr.all_steps()
            if not steps:
                raise ValueError(f"{workdir}: no checkpoint has been saved")
            step = max(steps) if step is None else step
            if step not in steps:
                raise ValueError(f"{workdir}: no checkpoint at step {step} (saved steps: {sorted(steps)})")
            meta = mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        finally:
            mngr.close()
        self.config, self.step = config_from_dict(meta["model"]), step
        self.state = os.path.join(directory, str(step), "state")
        try:
            with open(os.path.join(self.state, "_METADATA")) as f:
                m = json.load(f)
            self.names = {".".join(k["key"] for k in v["key_metadata"]) for v in m["tree_metadata"].values()}
            self.ocdbt, self.zarr3 = bool(m.get("use_ocdbt", False)), bool(m.get("use_zarr3", False))
        except (OSError, json.JSONDecodeError, KeyError, TypeError, AttributeError):
            raise CheckpointError(f"{self.state}: no readable Orbax _METADATA") from None
        self._context = None

    def open(self, path: tuple[str, ...]):
        """A tensorstore handle on the param at `path` (read only)."""
        import tensorstore as ts

        name = ".".join(("params", *path))
        if name not in self.names:
            raise CheckpointError(f"{self.state}: the checkpoint has no array {name}")
        if self._context is None:
            self._context = ts.Context()
        kv = ({"driver": "ocdbt", "base": {"driver": "file", "path": self.state}, "path": name} if self.ocdbt
              else {"driver": "file", "path": os.path.join(self.state, name)})
        spec = {"driver": "zarr3" if self.zarr3 else "zarr", "kvstore": kv,
                "recheck_cached_data": False, "recheck_cached_metadata": False}
        try:
            return ts.open(spec, open=True, read=True, context=self._context).result()
        except ValueError as e:
            raise CheckpointError(f"{self.state}: cannot open array {name}: {str(e).splitlines()[0]}") from None

    def regions(self, path: tuple[str, ...], first_axes: tuple[int, ...] = (), whole: bool = False):
        """(index, array) for regions tiling the param at `path` (index: a slice with start and stop per axis),
        each a block of whole storage chunks of at most REGION_BYTES (or one chunk), grown along `first_axes`
        first, then from the last axis back; with `whole`, the param in one piece."""
        arr = self.open(path)
        shape = tuple(arr.shape)
        grid = shape if whole else region_shape(shape, tuple(arr.chunk_layout.read_chunk.shape),
                                                 arr.dtype.numpy_dtype.itemsize, first_axes)
        for start in np.ndindex(*[-(-n // max(g, 1)) for n, g in zip(shape, grid)]):
            index = tuple(slice(i * g, min((i + 1) * g, n)) for i, g, n in zip(start, grid, shape))
            yield index, arr[index].read().result()

    def close(self):
        self._context = None


def region_shape(shape: tuple[int, ...], chunk: tuple[int, ...], itemsize: int,
                 first_axes: tuple[int, ...] = (), budget: int | None = None) -> tuple[int, ...]:
    """A multiple of the chunk shape (clipped to `shape`) of at most `budget` bytes (default REGION_BYTES), or
    one chunk: grown axis by axis, `first_axes` first, then from the last axis back, each axis grown only while
    the ones before it in that order are whole."""
    budget = REGION_BYTES if budget is None else budget
    region = [min(c, n) for c, n in zip(chunk, shape)]
    order = [a % len(shape) for a in first_axes]
    order += [a for a in reversed(range(len(shape))) if a not in order]
    for a in order:
        rest = int(np.prod(region, dtype=np.int64)) // region[a] * itemsize
        k = max(1, min(-(-shape[a] // region[a]), budget // max(rest * region[a], 1)))
        region[a] = min(region[a] * k, shape[a])
        if region[a] < shape[a]:
            break
    return tuple(region)


class _InMemory:
    """`TrainCheckpoint.regions` over a pytree of arrays: each leaf in one piece."""

    def __init__(self, params):
        self.params = params

    def regions(self, path, first_axes=(), whole=False):
        x = np.asarray(get_path(self.params, path))
        yield tuple(slice(0, n) for n in x.shape), x


def _pieces(n, index: tuple, x: np.ndarray):
    """(HF index, HF block) pieces of the Hugging Face tensor `n` from the region `index` of its leaf, whose
    values (the slice of `n`'s layer, for a stacked leaf) are `x`: row blocks of at most BLOCK_BYTES."""
    if not L.blockable(n):
        yield (), n.to_hf(x)
        return
    inner = index[1:] if n.index is not None else index
    kernel = n.path[-1] == "kernel"
    hf_index = (inner[1], inner[0]) if kernel else inner      # a kernel's HF rows are its output axis
    rows = x.shape[-1] if kernel else x.shape[0]
    step = max(1, L.BLOCK_BYTES // max(x.nbytes // max(rows, 1), 1))
    for a in range(0, rows, step):
        b = min(a + step, rows)
        sub = x[..., a:b] if kernel else x[a:b]
        yield (slice(hf_index[0].start + a, hf_index[0].start + b), *hf_index[1:]), n.to_hf(sub)


def _write_region(layer: dict, index: tuple, data, file_of: dict) -> None:
    """Every piece of the region `index` (values `data`) of one leaf, whose HF tensors by layer are `layer`,
    into its file (no view of `data` outlives the call)."""
    data = np.asarray(data, np.float32)
    stacked = next(iter(layer)) is not None
    for i in range(index[0].start, index[0].stop) if stacked else [None]:
        x = data[i - index[0].start] if stacked else data
        for hf_index, block in _pieces(layer[i], index, x):
            file_of[layer[i].hf].put(layer[i].hf, block, hf_index)


def write_hf(params, cfg: ModelConfig, dst: str, processor_dir: str | None = None,
             generation: dict | None = None, overwrite: bool = False, max_shard_bytes: int = MAX_SHARD_BYTES) -> None:
    """Params → a Hugging Face checkpoint at `dst` (float32; one `model.safetensors`, or shards of at most
    `max_shard_bytes` with an index), with `generation`'s eos/pad ids in config.json and generation_config.json,
    and the tokenizer files of `processor_dir`. `params` is a pytree, or a `TrainCheckpoint` (read region by
    region, so no leaf need be in memory whole)."""
    generation = {k: v for k, v in (generation or {}).items() if v is not None}
    reader = params if isinstance(params, TrainCheckpoint) else _InMemory(params)
    names = hf_names(cfg)
    rank = {p: i for i, p in enumerate(dict.fromkeys(n.path for n in names))}
    names = sorted(names, key=lambda n: rank[n.path])   # grouped by leaf (a stable sort): each leaf read once
    shards = plan_shards([(n.hf, n.hf_shape, np.float32) for n in names], max_shard_bytes)
    files = ([SINGLE_NAME] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    by_leaf: dict = {}
    for n in names:
        by_leaf.setdefault(n.path, {})[n.index] = n

    by_name = {n.hf: n for n in names}
    with Staging(dst, overwrite) as tmp:
        writers, file_of = [], {}
        try:
            for f, shard in zip(files, shards):
                writers.append(PieceWriter(os.path.join(tmp, f), [(k, by_name[k].hf_shape, np.float32) for k in shard],
                                           {"format": "pt"}))
                file_of.update(dict.fromkeys(shard, writers[-1]))
            for path, layer in by_leaf.items():
                any_n = next(iter(layer.values()))
                hf_cols = -2 if path[-1] == "kernel" else -1     # whole HF rows where it can: one write each
                for index, data in reader.regions(path, first_axes=(hf_cols,), whole=not L.blockable(any_n)):
                    _write_region(layer, index, data, file_of)
                    del data        # before the next region is read: nothing else refers to it
        except BaseException:
            for w in writers:
                w.f.close()
            raise
        for w in writers:
            w.close()
        weight_map = {k: f for f, shard in zip(files, shards) for k in shard}
        if len(files) > 1:
            total = sum(int(np.prod(n.hf_shape, dtype=np.int64)) * 4 for n in names)
            with open(os.path.join(tmp, INDEX_NAME), "w") as fh:
                json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, fh, indent=2)
        if processor_dir is not None:
            copy_side_files(processor_dir, tmp)
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump({**config_to_hf(cfg), **generation, "dtype": "float32"}, f, indent=2)
        if generation:
            with open(os.path.join(tmp, "generation_config.json"), "w") as f:
                json.dump(generation, f, indent=2)


def export(workdir: str, dst: str, step: int | None = None, processor_dir: str | None = None,
           eos_token_id=None, pad_token_id=None, overwrite: bool = False,
           max_shard_bytes: int = MAX_SHARD_BYTES, merge_lora: bool = False, adapters: bool = False) -> int:
    """`TrainCheckpoint` then `write_hf` (a LoRA run: merged or adapters only); returns the step exported."""
    check_destination(dst, overwrite)
    ck = TrainCheckpoint(workdir, step)
    generation = {"eos_token_id": eos_token_id, "pad_token_id": pad_token_id}
    try:
        tcfg, base = _run_config(workdir, ck.step)
        if tcfg.train.lora is None and (merge_lora or adapters):
            raise ValueError(f"{workdir}: not a LoRA run (train.lora is null): export it without --merge-lora "
                             "or --lora-adapters")
        if tcfg.train.lora is None:
            write_hf(ck, ck.config, dst, processor_dir, generation, overwrite, max_shard_bytes)
        elif merge_lora == adapters:
            raise ValueError(f"{workdir} is a LoRA run: choose --merge-lora (the merged model) or --lora-adapters "
                             "(the adapters alone, peft's layout)")
        else:
            trained = _trained_leaves(tcfg, checkpoint_reader(ck))
            if adapters:
                _write_adapters(tcfg, trained, base, dst, overwrite)
            else:
                write_hf(_merged(tcfg, trained, base), ck.config, dst, processor_dir, generation, overwrite,
                         max_shard_bytes)
    finally:
        ck.close()
    return ck.step


def checkpoint_reader(ck: "TrainCheckpoint"):
    """A function leaf path → that param of the checkpoint, whole, as a NumPy array."""
    return lambda path: np.asarray(next(ck.regions(path, whole=True))[1])


def checkpoint_leaves(workdir: str, step: int | None = None):
    """(leaf path → that param, the model config recorded, the step, close) of a `prisma train` run."""
    ck = TrainCheckpoint(workdir, step)
    return checkpoint_reader(ck), ck.config, ck.step, ck.close


def _run_config(workdir: str, step: int):
    """(the run's training Config, its base identity or None), as its checkpoint's meta recorded them."""
    import orbax.checkpoint as ocp

    from train.config import config_from_raw
    from train.loop import CHECKPOINT_ITEMS, checkpoint_dir

    mngr = ocp.CheckpointManager(checkpoint_dir(workdir), item_names=CHECKPOINT_ITEMS)
    try:
        meta = mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    finally:
        mngr.close()
    return config_from_raw(meta["config"]), meta.get("base")


def _trained_leaves(tcfg, leaf) -> dict:
    from prisma_jax.core.trees import flatten
    from prisma_jax.nn.params import param_shapes

    from train.step import is_trained

    out: dict = {}
    for path, _ in flatten(param_shapes(tcfg.model, tcfg.train.lora)):
        if is_trained(tcfg, path):
            set_path(out, path, leaf(path))
    return out


def _merged(tcfg, trained: dict, base: dict) -> dict:
    """The base (checked against the run's record) with the trained table and the adapters folded in."""
    import jax

    from prisma_jax.nn.lora import merge
    from prisma_jax.nn.params import init_params

    from train.loop import _initial_params, base_identity
    from train.step import combine, partition

    if base_identity(tcfg) != base:
        raise ValueError(f"the run's base ({base.get('path', base)}) has changed since training: its files' crc32s "
                         "differ from those the run recorded")
    full = _initial_params(tcfg)
    if full is None:
        full = jax.jit(lambda k: init_params(tcfg.model, jax.random.fold_in(k, 1)))(
            jax.random.PRNGKey(tcfg.train.seed))
    _, rest = partition(jax.tree.map(np.asarray, full), lambda p: get_path_or_none(trained, p) is not None)
    return jax.tree.map(np.asarray, merge(combine(trained, rest), tcfg.train.lora))


def get_path_or_none(tree: dict, path):
    for k in path:
        if not isinstance(tree, dict) or k not in tree:
            return None
        tree = tree[k]
    return tree


def _write_adapters(tcfg, trained: dict, base: dict, dst: str, overwrite: bool) -> None:
    from safetensors.numpy import save_file

    from prisma_jax.checkpoint.peft import peft_config, peft_tensors
    from prisma_jax.nn.params import TABLE_PATH
    from prisma_jax.checkpoint.hf_names import UNCERTAINTY_KEY

    tensors = peft_tensors(trained, tcfg.model, tcfg.train.lora)
    with Staging(dst, overwrite) as tmp:
        save_file(tensors, os.path.join(tmp, "adapter_model.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(tmp, "adapter_config.json"), "w") as f:
            json.dump(peft_config(tensors, tcfg.train.lora, base.get("path")), f, indent=2)
        table = get_path_or_none(trained, TABLE_PATH)
        if table is not None:
            save_file({UNCERTAINTY_KEY: np.ascontiguousarray(np.asarray(table, np.float32))},
                      os.path.join(tmp, "uncertainty_table.safetensors"), metadata={"format": "pt"})
