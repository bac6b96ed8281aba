"""train/flops.py's model FLOPs against XLA's own count of the compiled program on CPU (`cost_analysis`), and
the device peaks. The text layers are compiled unrolled (a scanned body is counted once); what XLA counts
beyond the model FLOPs (norms, softmax, the loss, the optimizer) keeps the ratio a little under 1."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from prisma_jax.infer import core
from prisma_jax.nn.params import init_params_numpy
from prisma_jax.nn.vision import vision_geometry
from train import step as S
from train.config import load_train_config
from train.flops import device_peak, step_flops, vision_forward_flops


def _xla_flops(compiled) -> float:
    ca = compiled.cost_analysis()
    return (ca[0] if isinstance(ca, list) else ca)["flops"]


@pytest.mark.parametrize("passes", [1, 2])
def test_step_flops_match_the_compiled_step(passes):
    cfg, _ = load_train_config("configs/bench_58m.yaml", ["train.batch_size=2", "train.seq_len=64",
                                                          "train.unroll_layers=true", "model.text.num_hidden_layers=3",
                                                          f"train.introspection_passes={passes}"])
    state = jax.eval_shape(lambda: S.fresh_state(cfg, jax.random.PRNGKey(0)))
    sd = jax.ShapeDtypeStruct
    batch = S.TrainBatch(sd((1, 2, 64), jnp.int32), sd((1, 2, 64), bool), sd((1, 2, 64), jnp.int32),
                         sd((1, 3, 2, 64), jnp.int32), sd((1, 2, 64), jnp.int32))
    xla = _xla_flops(jax.jit(S.make_train_step(cfg, state.params)).lower(state, batch).compile())
    ours = step_flops(cfg)
    assert ours["introspection"] == (0 if passes == 1 else ours["text"] / 3 + ours["attention"] / 3)
    assert 0.88 < ours["total"] / xla < 1.0, (ours, xla)


def test_vision_flops_match_the_compiled_tower():
    cfg, _ = load_train_config("configs/bench_58m.yaml")          # a one-block tower: nothing scanned twice
    m = cfg.model
    side = 64 // m.vision.patch_size
    params = jax.tree.map(jnp.asarray, init_params_numpy(m, 0))
    geo = vision_geometry(m.vision, np.array([[1, side, side]]))
    pv = jnp.zeros((side * side, m.vision.patch_dim), jnp.float32)
    xla = _xla_flops(jax.jit(lambda p, x, g: core.bind(m, p).vision(x, g)).lower(params, pv, geo).compile())
    assert 0.9 < vision_forward_flops(m, 64) / xla <= 1.0


def test_frozen_weights_count_no_weight_gradients():
    cfg, _ = load_train_config("configs/bench_58m.yaml", ["data.max_images=1"])
    full, lora = step_flops(cfg), step_flops(cfg, {"text": False, "vision": False})
    assert lora["text"] * 3 == full["text"] * 2 and lora["vision"] * 3 == full["vision"] > 0
    assert full["attention"] == lora["attention"]


def test_device_peaks():
    assert device_peak("TPU v5p") == 459.0 and device_peak("TPU v5 lite") == 197.0
    assert device_peak("TPU v6 lite") == 918.0 and device_peak("TPU v4") == 275.0
    assert device_peak("NVIDIA H100 80GB HBM3") == 989.0 and device_peak("NVIDIA H200") == 989.0
    assert device_peak("cpu") is None and device_peak("AMD EPYC") is None
