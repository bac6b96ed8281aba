"""A training run's checkpoint → a Hugging Face checkpoint directory (`prisma convert train-to-hf`).

    WORKDIR/checkpoints/<step>/{state, meta}  →  DST/{model.safetensors, config.json, generation_config.json,
                                                     + the tokenizer/processor files of --processor}

The params of the chosen step (default: the latest) are restored on the host, the model config is the one the
checkpoint recorded (`meta.model`), and the tensors go through the same name table as every other conversion
(`params.hf_names`). Written in a staging directory and renamed at the end (conversion/staging.py).
"""
from __future__ import annotations

import json
import os

import numpy as np

from conversion.staging import Staging, copy_side_files
from prisma_jax.config import ModelConfig, config_from_dict, config_to_hf
from prisma_jax.params import get_path, hf_names
from prisma_jax.safetensors_io import write_file


def checkpoint_params(workdir: str, step: int | None = None) -> tuple[dict, ModelConfig, int]:
    """(params as NumPy float32, the model config recorded with them, the step) of a `prisma train` run."""
    import jax
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
        got = mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(),
                                                          meta=ocp.args.JsonRestore()))
    finally:
        mngr.close()
    cfg = config_from_dict(got["meta"]["model"])
    return jax.tree.map(lambda a: np.asarray(a, np.float32), got["state"]["params"]), cfg, step


def write_hf(params: dict, cfg: ModelConfig, dst: str, processor_dir: str | None = None,
             generation: dict | None = None, overwrite: bool = False) -> None:
    """A params pytree → a one-file Hugging Face checkpoint at `dst` (float32), with `generation`'s
    eos/pad ids in config.json and generation_config.json, and the tokenizer files of `processor_dir`."""
    generation = {k: v for k, v in (generation or {}).items() if v is not None}

    def tensors():
        for n in hf_names(cfg):
            x = np.asarray(get_path(params, n.path), np.float32)
            yield n.hf, n.to_hf(x if n.index is None else x[n.index])

    with Staging(dst, overwrite) as tmp:
        write_file(os.path.join(tmp, "model.safetensors"), list(tensors()), metadata={"format": "pt"})
        if processor_dir is not None:
            copy_side_files(processor_dir, tmp)
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump({**config_to_hf(cfg), **generation, "dtype": "float32"}, f, indent=2)
        if generation:
            with open(os.path.join(tmp, "generation_config.json"), "w") as f:
                json.dump(generation, f, indent=2)


def export(workdir: str, dst: str, step: int | None = None, processor_dir: str | None = None,
           eos_token_id=None, pad_token_id=None, overwrite: bool = False) -> int:
    """`checkpoint_params` then `write_hf`; returns the step exported."""
    params, cfg, step = checkpoint_params(workdir, step)
    write_hf(params, cfg, dst, processor_dir, {"eos_token_id": eos_token_id, "pad_token_id": pad_token_id},
             overwrite)
    return step
