"""Writes tests/data/legacy/: checkpoints of every kind that the pre-NNX code wrote, and what that code computed
from them, so that tests/test_legacy_checkpoints.py can check that today's code loads them unchanged.

    .venv/bin/python tests/make_legacy_fixtures.py      # run once, at commit 56ca9b8 (plain-JAX model)

  hf/          a tiny Prisma-VL safetensors checkpoint (transformers' save_pretrained + the 8-bit table)
  orbax/       `prisma convert hf-to-orbax hf/ orbax/`
  train/       a `prisma train` workdir (configs/tiny_sft.yaml, small), checkpointed at step 2 of 4
  expected.safetensors   logits of hf/ and orbax/ on one text + image batch; the params after step 4
  expected.json          the losses and metrics of steps 3 and 4 of the uninterrupted run
"""
from __future__ import annotations

import json
import os
import shutil
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [ROOT, HERE]
OUT = os.path.join(HERE, "data", "legacy")

# the train run: configs/tiny_sft.yaml at a quarter of its size (one image per row)
TRAIN_OVERRIDES = ["train.steps=4", "train.batch_size=2", "train.seq_len=40", "train.grad_accum=1",
                   "checkpoint.every=2", "checkpoint.keep=1", "checkpoint.asynchronous=false"]


def batch():
    """One text row and one row with a 64² image (grid 1×4×4 → 4 image tokens)."""
    from hf_tiny import IMAGE, VEND, VSTART
    rng = np.random.default_rng(7)
    ids = rng.integers(7, 128, (2, 12)).astype(np.int64)
    ids[1, 2:8] = [VSTART, IMAGE, IMAGE, IMAGE, IMAGE, VEND]
    pixels = rng.standard_normal((16, 3 * 2 * 16 * 16)).astype(np.float32)
    return ids, pixels, np.array([[1, 4, 4]], np.int64)


def main():
    import torch
    from safetensors.numpy import save_file

    from hf_tiny import build_model, save_checkpoint, tiny_hf_config
    from prisma_jax import PrismaVL
    from prisma_jax.apps.cli import main as cli
    from prisma_jax.core.trees import flatten

    if os.path.exists(OUT):
        shutil.rmtree(OUT)
    os.makedirs(OUT)
    torch.manual_seed(0)
    table = (0.02 * np.random.default_rng(3).standard_normal((256, 64))).astype(np.float32)
    save_checkpoint(build_model(tiny_hf_config(), seed=5), os.path.join(OUT, "hf"), table=table)
    assert cli(["convert", "hf-to-orbax", os.path.join(OUT, "hf"), os.path.join(OUT, "orbax")]) == 0

    ids, pixels, grid = batch()
    expected = {}
    for name in ("hf", "orbax"):
        m = PrismaVL.from_pretrained(os.path.join(OUT, name))
        expected[f"logits_{name}"] = np.asarray(m.forward(ids, pixel_values=pixels, image_grid_thw=grid))

    cfg = os.path.join(ROOT, "configs", "tiny_sft.yaml")
    work = os.path.join(OUT, "train")
    full = os.path.join(OUT, "_full")
    args = ["train", "--config", cfg, "--no-progress", *TRAIN_OVERRIDES]
    assert cli([*args, "--workdir", work, "--steps", "2"]) == 0
    assert cli([*args, "--workdir", full]) == 0
    from prisma_jax.nn.params import param_shapes
    from train.export import checkpoint_leaves
    leaf, model_cfg, step, close = checkpoint_leaves(full)
    assert step == 4
    for path, _ in flatten(param_shapes(model_cfg)):
        expected["params/" + "/".join(path)] = np.asarray(leaf(path))
    close()
    with open(os.path.join(full, "metrics.jsonl")) as f:
        metrics = [json.loads(line) for line in f][2:]
    shutil.rmtree(full)
    shutil.rmtree(os.path.join(work, "tb"), ignore_errors=True)
    save_file(expected, os.path.join(OUT, "expected.safetensors"))
    keep = ("step", "loss", "grad_norm", "lr", "code_mean", "code_low", "code_high", "tokens")
    with open(os.path.join(OUT, "expected.json"), "w") as f:
        json.dump({"train_overrides": TRAIN_OVERRIDES,
                   "metrics": [{k: m[k] for k in keep} for m in metrics]}, f, indent=1)


if __name__ == "__main__":
    main()
