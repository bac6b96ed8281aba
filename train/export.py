"""A training run's checkpoint → a Hugging Face checkpoint directory (`prisma convert train-to-hf`).

    WORKDIR/checkpoints/<step>/{state, meta}  →  DST/{model.safetensors (or ≤ 5 GB shards + index), config.json,
                                                     generation_config.json, + the tokenizer/processor files}

Only the params of the chosen step (default: the latest) are read, never the optimizer state: one leaf at a
time, each an Orbax partial restore of that one array, turned into its Hugging Face tensors (the same name
table as every other conversion, `params.hf_names`) and streamed into its shard in row blocks. Peak memory is
the largest leaf (a layer-stacked kernel, as stored) plus a block, whatever the model's total size
(docs/benchmarks.md). The model config is the one the checkpoint recorded (`meta.model`). Written in a staging
directory, fsynced and swapped in at the end (conversion/staging.py).

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

from conversion import orbax_layout as L
from conversion.orbax_to_hf import MAX_SHARD_BYTES
from conversion.staging import Staging, check_destination, copy_side_files
from prisma_jax.config import ModelConfig, config_from_dict, config_to_hf
from prisma_jax.params import get_path, hf_names, set_path
from prisma_jax.safetensors_io import INDEX_NAME, SINGLE_NAME, plan_shards, write_streaming


def checkpoint_leaves(workdir: str, step: int | None = None):
    """(a function leaf path → that param as a NumPy array, the model config recorded, the step, close) for a
    `prisma train` run; each call restores that one array of the step's params (Orbax partial restore)."""
    import orbax.checkpoint as ocp

    from .loop import CHECKPOINT_ITEMS, checkpoint_dir

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
    except BaseException:
        mngr.close()
        raise
    cfg = config_from_dict(meta["model"])

    def leaf(path: tuple[str, ...]) -> np.ndarray:
        item, args = {}, {}
        set_path(item, ("params", *path), 0)   # structure only: partial_restore reads just this array
        set_path(args, ("params", *path), ocp.RestoreArgs(restore_type=np.ndarray))
        got = mngr.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
            item=item, restore_args=args, partial_restore=True)))
        return get_path(got["state"]["params"], path)

    return leaf, cfg, step, mngr.close


def write_hf(params, cfg: ModelConfig, dst: str, processor_dir: str | None = None,
             generation: dict | None = None, overwrite: bool = False, max_shard_bytes: int = MAX_SHARD_BYTES) -> None:
    """Params → a Hugging Face checkpoint at `dst` (float32; one `model.safetensors`, or shards of at most
    `max_shard_bytes` with an index), with `generation`'s eos/pad ids in config.json and generation_config.json,
    and the tokenizer files of `processor_dir`. `params` is a pytree, or a function leaf path → array called
    once per leaf (so only one leaf need be in memory)."""
    generation = {k: v for k, v in (generation or {}).items() if v is not None}
    leaf = params if callable(params) else (lambda p: get_path(params, p))
    names = hf_names(cfg)
    rank = {p: i for i, p in enumerate(dict.fromkeys(n.path for n in names))}
    names = sorted(names, key=lambda n: rank[n.path])   # grouped by leaf (a stable sort): each leaf read once
    by_name = {n.hf: n for n in names}
    shards = plan_shards([(n.hf, n.hf_shape, np.float32) for n in names], max_shard_bytes)
    files = ([SINGLE_NAME] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    held: dict = {}

    def blocks(hf: str):
        n = by_name[hf]
        if n.path not in held:
            held.clear()   # drop the previous leaf before reading the next
            held[n.path] = leaf(n.path)
        x = held[n.path]
        for r0, r1 in L.row_blocks(n, 4):
            yield n.to_hf(np.asarray(x[L.leaf_region(n, r0, r1)], np.float32))

    with Staging(dst, overwrite) as tmp:
        weight_map = {}
        for f, shard in zip(files, shards):
            write_streaming(os.path.join(tmp, f), [(k, by_name[k].hf_shape, np.float32) for k in shard], blocks,
                            metadata={"format": "pt"})
            weight_map.update({k: f for k in shard})
        held.clear()
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
    """`checkpoint_leaves` then `write_hf` (a LoRA run: merged or adapters only); returns the step exported."""
    check_destination(dst, overwrite)
    leaf, cfg, step, close = checkpoint_leaves(workdir, step)
    generation = {"eos_token_id": eos_token_id, "pad_token_id": pad_token_id}
    try:
        tcfg, base = _run_config(workdir, step)
        if tcfg.train.lora is None and (merge_lora or adapters):
            raise ValueError(f"{workdir}: not a LoRA run (train.lora is null): export it without --merge-lora "
                             "or --lora-adapters")
        if tcfg.train.lora is None:
            write_hf(leaf, cfg, dst, processor_dir, generation, overwrite, max_shard_bytes)
        elif merge_lora == adapters:
            raise ValueError(f"{workdir} is a LoRA run: choose --merge-lora (the merged model) or --lora-adapters "
                             "(the adapters alone, peft's layout)")
        else:
            trained = _trained_leaves(tcfg, leaf)
            if adapters:
                _write_adapters(tcfg, trained, base, dst, overwrite)
            else:
                write_hf(_merged(tcfg, trained, base), cfg, dst, processor_dir, generation, overwrite,
                         max_shard_bytes)
    finally:
        close()
    return step


def _run_config(workdir: str, step: int):
    """(the run's training Config, its base identity or None), as its checkpoint's meta recorded them."""
    import orbax.checkpoint as ocp

    from .config import config_from_raw
    from .loop import CHECKPOINT_ITEMS, checkpoint_dir

    mngr = ocp.CheckpointManager(checkpoint_dir(workdir), item_names=CHECKPOINT_ITEMS)
    try:
        meta = mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    finally:
        mngr.close()
    return config_from_raw(meta["config"]), meta.get("base")


def _trained_leaves(tcfg, leaf) -> dict:
    from prisma_jax.params import flatten, param_shapes

    from .step import is_trained

    out: dict = {}
    for path, _ in flatten(param_shapes(tcfg.model, tcfg.train.lora)):
        if is_trained(tcfg, path):
            set_path(out, path, leaf(path))
    return out


def _merged(tcfg, trained: dict, base: dict) -> dict:
    """The base (checked against the run's record) with the trained table and the adapters folded in."""
    import jax

    from prisma_jax.lora import merge
    from prisma_jax.params import init_params

    from .loop import _initial_params, base_identity
    from .step import combine, partition

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

    from prisma_jax.lora import peft_config, peft_tensors
    from prisma_jax.params import TABLE_PATH, UNCERTAINTY_KEY

    tensors = peft_tensors(trained, tcfg.model, tcfg.train.lora)
    with Staging(dst, overwrite) as tmp:
        save_file(tensors, os.path.join(tmp, "adapter_model.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(tmp, "adapter_config.json"), "w") as f:
            json.dump(peft_config(tensors, tcfg.train.lora, base.get("path")), f, indent=2)
        table = get_path_or_none(trained, TABLE_PATH)
        if table is not None:
            save_file({UNCERTAINTY_KEY: np.ascontiguousarray(np.asarray(table, np.float32))},
                      os.path.join(tmp, "uncertainty_table.safetensors"), metadata={"format": "pt"})
