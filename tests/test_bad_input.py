"""Bad input → one ValueError naming the problem, raised on the host before any device work."""
import json
import os

import numpy as np
import pytest

import prisma_jax.api as api
from hf_tiny import build_model, image_tokens, random_pixels, save_checkpoint, tiny_hf_config
from prisma_jax import PrismaVL
from prisma_jax.checkpoint.safetensors import CheckpointError

ROOT = os.path.dirname(os.path.dirname(__file__))


@pytest.fixture(scope="module")
def model():
    return PrismaVL.from_config(os.path.join(ROOT, "configs", "tiny.yaml"))


@pytest.fixture(autouse=True)
def no_device_work(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("reached the device")
    monkeypatch.setattr(api, "_forward", boom)


GRID = [[1, 4, 6]]
IDS = np.array([[10, 11, *image_tokens((1, 4, 6)), 12]])


@pytest.mark.parametrize("case, match", [
    (dict(input_ids=np.array([[1, 2, 128]])), "outside the vocabulary"),
    (dict(input_ids=np.array([[1, -2, 3]])), "outside the vocabulary"),
    (dict(input_ids=np.array([1, 2, 3])), "2 dimensions"),
    (dict(input_ids=np.array([[1.5, 2]])), "integer"),
    (dict(input_ids=np.array([[1, 2, 3]]), attention_mask=np.ones((1, 4))), "attention_mask shape"),
    (dict(input_ids=np.array([[1, 2, 3]]), attention_mask=np.array([[0, 2, 1]])), "only 0 and 1"),
    (dict(input_ids=IDS, pixel_values=random_pixels(GRID), image_grid_thw=[[1, 4, 8]]),
     "image_grid_thw needs"),
    (dict(input_ids=IDS[:, :-3], pixel_values=random_pixels(GRID), image_grid_thw=GRID), "placeholder"),
    (dict(input_ids=IDS, pixel_values=random_pixels(GRID)[:-1], image_grid_thw=GRID), "pixel_values has shape"),
    (dict(input_ids=IDS, pixel_values=random_pixels(GRID)), "together"),
    (dict(input_ids=IDS, pixel_values=random_pixels([[1, 4, 3]]), image_grid_thw=[[1, 4, 3]]), "multiples"),
    (dict(input_ids=IDS), "image placeholder tokens"),
    (dict(input_ids=np.array([[1, 2, 3]]), codes_in=np.array([[0, 256, 1]])), r"outside \[-1, 256\)"),
    (dict(input_ids=np.array([[1, 2, 3]]), codes_in=np.array([[0, -2, 1]])), "outside"),
    (dict(input_ids=np.array([[1, 2, 3]]), codes_in=np.array([[0, 1]])), "codes_in shape"),
    (dict(input_ids=np.array([[1, 6, 3]])), "video"),
])
def test_bad_inputs_raise_named_value_errors(model, case, match):
    with pytest.raises(ValueError, match=match):
        model.forward(**case)


def test_two_images_without_text_between_are_rejected(model):
    ids = np.array([[10, *([5] * 6), *([5] * 6), 11]])
    grids = [[1, 4, 6], [1, 4, 6]]
    with pytest.raises(ValueError, match="runs"):
        model.forward(ids, pixel_values=random_pixels(grids), image_grid_thw=grids)


def test_checkpoint_contradicting_its_config(tmp_path):
    path = save_checkpoint(build_model(tiny_hf_config()), str(tmp_path))
    cfg = json.load(open(os.path.join(path, "config.json")))
    cfg["text_config"]["intermediate_size"] = 128
    json.dump(cfg, open(os.path.join(path, "config.json"), "w"))
    with pytest.raises(CheckpointError, match=r"mlp.gate_proj.weight has shape \[96, 64\]"):
        PrismaVL.from_pretrained(path)


def test_pickle_only_checkpoint_is_refused(tmp_path):
    tiny_hf_config().save_pretrained(tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(b"not opened")
    with pytest.raises(CheckpointError, match="safetensors"):
        PrismaVL.from_pretrained(str(tmp_path))
