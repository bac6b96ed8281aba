"""Checkpoints written by the plain-JAX model that preceded the Flax NNX modules (tests/data/legacy/, made by
tests/make_legacy_fixtures.py) still load: the same logits from the safetensors and the Orbax directory, and
a `prisma train` workdir resumes to the same metrics and the same params as the run that wrote it.

"The same" is up to float32 rounding (1e-5 relative): the code that wrote them ran its matmuls as XLA:CPU kernels
of another shape (`layers.token_matmul`), which round differently in the last bits. A checkpoint read wrongly
(a transposed kernel, a missing table, a wrong step) is off by far more. Within one version resuming is bit for
bit (tests/test_train_loop.py)."""
import json
import os
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file

from make_legacy_fixtures import OUT, ROOT, batch
from prisma_jax import PrismaVL
from prisma_jax.apps.cli import main as cli
from prisma_jax.core.trees import flatten
from prisma_jax.nn.params import param_shapes

EXPECTED = load_file(os.path.join(OUT, "expected.safetensors"))


@pytest.mark.parametrize("name", ["hf", "orbax"])
def test_old_checkpoint_gives_the_old_logits(name):
    ids, pixels, grid = batch()
    logits = PrismaVL.from_pretrained(os.path.join(OUT, name)).forward(ids, pixel_values=pixels,
                                                                      image_grid_thw=grid)
    np.testing.assert_allclose(np.asarray(logits), EXPECTED[f"logits_{name}"], rtol=1e-5, atol=1e-6)


def test_old_training_run_resumes_to_the_same_metrics_and_params(tmp_path):
    work = str(tmp_path / "train")
    shutil.copytree(os.path.join(OUT, "train"), work)
    with open(os.path.join(OUT, "expected.json")) as f:
        want = json.load(f)
    cfg = os.path.join(ROOT, "configs", "tiny_sft.yaml")
    assert cli(["train", "--config", cfg, "--workdir", work, "--no-progress", *want["train_overrides"]]) == 0
    with open(os.path.join(work, "metrics.jsonl")) as f:
        got = [json.loads(line) for line in f][2:]
    assert len(got) == len(want["metrics"])
    for m, w in zip(got, want["metrics"]):
        assert {k: m[k] for k in w} == pytest.approx(w, rel=1e-5)

    from train.export import checkpoint_leaves
    leaf, model_cfg, step, close = checkpoint_leaves(work)
    try:
        assert step == 4
        for path, _ in flatten(param_shapes(model_cfg)):
            np.testing.assert_allclose(leaf(path), EXPECTED["params/" + "/".join(path)], rtol=1e-5, atol=1e-6,
                                       err_msg=str(path))
    finally:
        close()
