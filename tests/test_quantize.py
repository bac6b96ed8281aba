"""int8 weight-only generation (prisma_jax/quant/int8.py) against independent references: the int8 values and
scales re-derived in NumPy and by qwix's own `quantize_model` on a lone dense layer; greedy tokens and codes
against the sequential PyTorch loop (tests/gen_reference.py) on a transformers model holding the dequantized
weights; the CLI flag against the API; bad modes and training refused with one clear error."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import qwix
import torch
import yaml
from flax import nnx

from gen_reference import reference_greedy
from hf_tiny import build_model, image_tokens, random_pixels, save_checkpoint, tiny_hf_config
from prisma_jax import PrismaVL
from prisma_jax.apps import plan as PL
from prisma_jax.apps.cli import main
from prisma_jax.nn.layers import Dense
from prisma_jax.core.trees import flatten
from prisma_jax.parallel.mesh import make_mesh

BITS = 16
STEPS = 16
GRID = (1, 4, 6)
PROJ = {"attn": ("q_proj", "k_proj", "v_proj", "o_proj"), "mlp": ("gate_proj", "up_proj", "down_proj")}
HF_PREFIX = {"attn": "self_attn", "mlp": "mlp"}
# max |Δlogit| int8 vs float32 measured on this fixture's 5-row text+image batch: 0.0072 (logits max |x| 0.57,
# std 0.15), 2026-12-02; the bound leaves ~3× headroom
LOGIT_BOUND = 0.02


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    hf = build_model(tiny_hf_config(deepstack=(0, 2)), seed=3)
    table = np.random.default_rng(1).normal(0, 0.5, (2**BITS, 64)).astype(np.float32)   # codes change tokens
    path = save_checkpoint(hf, str(tmp_path_factory.mktemp("q")), table=table)
    return hf, table, path, PrismaVL.from_pretrained(path), PrismaVL.from_pretrained(path, quantize="int8")


def _quantized_kernels(params):
    """{path: (qvalue, scale)} of every `{"array": {"qvalue", "scale"}}` leaf group."""
    out = {}
    for path, leaf in flatten(params):
        if path[-1] == "qvalue":
            arr = params
            for k in path[:-1]:
                arr = arr[k]
            out[path[:-3]] = (np.asarray(arr["qvalue"]), np.asarray(arr["scale"]))
    return out


def _get(tree, path):
    for k in path:
        tree = tree[k]
    return tree


def test_kernels_are_int8_and_equal_numpy_and_qwix(models):
    _, _, _, f, q = models
    kernels = _quantized_kernels(q.params)
    assert set(kernels) == {("text", "layers", g, p) for g, ps in PROJ.items() for p in ps} | {("lm_head",)}
    assert q.quantized == "int8" and f.quantized is None
    for path, (qv, sc) in kernels.items():
        w = np.asarray(_get(f.params, path)["kernel"])
        assert qv.dtype == np.int8 and qv.shape == w.shape
        assert sc.dtype == np.float32 and sc.shape == w.shape[:-2] + (1, w.shape[-1])
        # symmetric absmax over the input axis: scale = max|w| / 127.5 (XLA multiplies by the reciprocal: 1 ulp),
        # q = round-half-even(w / scale) clipped to int8; where w / scale is a tie (the channel's max |w| lands
        # on ±127.5), XLA's division may round the other way
        np.testing.assert_allclose(sc, np.abs(w).max(axis=-2, keepdims=True) / np.float32(127.5), rtol=1.2e-7, atol=0)
        x = w / sc
        ref = np.clip(np.round(x), -128, 127)
        off = qv != ref
        assert np.all(np.abs(np.abs(x[off]) - 127.5) < 1e-4) and np.all(np.abs(qv[off] - ref[off]) == 1)
        assert off.sum() <= sc.size                                        # at most one a channel
        assert np.abs(qv).max() >= 127                                     # the full int8 range is used
    # everything else is the float model's own leaf, bit for bit (table, embedding, vision, norms)
    flat_f = dict(flatten(f.params))
    others = [(p, x) for p, x in flatten(q.params) if "array" not in p]
    assert len(others) == len(flat_f) - len(kernels)
    for p, x in others:
        assert x.dtype == flat_f[p].dtype
        np.testing.assert_array_equal(np.asarray(x), np.asarray(flat_f[p]))

    # qwix's own PTQ path (quantize_model + PtqProvider on a lone dense layer) gives layer 1's q_proj
    w1 = np.asarray(f.params["text"]["layers"]["attn"]["q_proj"]["kernel"][1])
    dense = Dense(*w1.shape, ("hidden", "heads"), bias=False, rngs=nnx.Rngs(0))
    dense.kernel[...] = jnp.asarray(w1)
    rule = qwix.QuantizationRule(module_path=".*", weight_qtype=jnp.int8)
    qd = qwix.quantize_model(dense, qwix.PtqProvider([rule]), jnp.ones((1, w1.shape[0])))
    qv, sc = kernels[("text", "layers", "attn", "q_proj")]
    np.testing.assert_array_equal(np.asarray(qd.kernel.array.qvalue[...]), qv[1])
    np.testing.assert_array_equal(np.asarray(qd.kernel.array.scale[...]), sc[1])


def _batch():
    rng = np.random.default_rng(0)
    rows = [list(rng.integers(7, 128, 9)), [20, 21, *image_tokens(GRID), 22], list(rng.integers(7, 128, 4)),
            [30, *image_tokens(GRID), 31, 32, 33], list(rng.integers(7, 128, 13))]
    s = max(len(r) for r in rows)
    ids, mask = np.zeros((len(rows), s), np.int64), np.zeros((len(rows), s), np.int64)
    for i, r in enumerate(rows):
        ids[i, s - len(r):], mask[i, s - len(r):] = r, 1
    return ids, mask, random_pixels([GRID, GRID], seed=5), [GRID, GRID]


def test_logits_close_to_float_and_equal_the_dequantized_model(models):
    _, _, _, f, q = models
    batch = _batch()
    zf, zq = np.asarray(f.forward(*batch)), np.asarray(q.forward(*batch))
    mask = batch[1].astype(bool)
    delta = np.abs(zq - zf)[mask].max()
    assert 1e-4 < delta < LOGIT_BOUND, delta                # really quantized, and close
    # weight-only: the int8 model computes what the float model computes with the dequantized weights
    deq = PrismaVL(f.config, jax.tree.map(jnp.asarray, _dequantized(f.params, q.params)))
    np.testing.assert_allclose(zq, np.asarray(deq.forward(*batch)), atol=1e-5, rtol=0)
    # in bfloat16, each weight is dequantized in float32 and rounded once (not through a bfloat16 scale)
    fb = PrismaVL(f.config, jax.tree.map(lambda a: a.astype(jnp.bfloat16), f.params))
    qb = fb.quantize("int8")
    ref = jax.tree.map(lambda a: jnp.asarray(a, jnp.bfloat16), _dequantized(fb.params, qb.params))
    np.testing.assert_array_equal(np.asarray(qb.forward(*batch), np.float32),
                                  np.asarray(PrismaVL(f.config, ref).forward(*batch), np.float32))


def _dequantized(float_params, qparams):
    """The float param tree with every quantized kernel replaced by qvalue · scale, in NumPy float32."""
    out = jax.tree.map(np.asarray, float_params)
    for path, (qv, sc) in _quantized_kernels(qparams).items():
        _get(out, path)["kernel"] = qv.astype(np.float32) * sc
    return out


def _hf_with(hf, params, layers: int):
    """A copy of the transformers model holding `params`' decoder projections and lm_head (torch [out, in])."""
    sd = {k: v.clone() for k, v in hf.state_dict().items()}
    for g, ps in PROJ.items():
        for p in ps:
            k = np.asarray(params["text"]["layers"][g][p]["kernel"])
            for i in range(layers):
                sd[f"model.language_model.layers.{i}.{HF_PREFIX[g]}.{p}.weight"] = torch.from_numpy(k[i].T.copy())
    sd["lm_head.weight"] = torch.from_numpy(np.asarray(params["lm_head"]["kernel"]).T.copy())
    out = build_model(hf.config, seed=3)
    out.load_state_dict(sd)
    return out.eval()


@pytest.mark.parametrize("kind", ["text", "image"])
def test_greedy_equals_pytorch_reference_on_dequantized_weights(models, kind):
    hf, table, _, f, q = models
    ref_model = _hf_with(hf, _dequantized(f.params, q.params), f.config.text.num_hidden_layers)
    prompt = [9, 44, 17, 101, 63, 8, 90] if kind == "text" else [20, 21, *image_tokens(GRID), 22]
    kw = dict(pixel_values=random_pixels([GRID], seed=2), image_grid_thw=[GRID]) if kind == "image" else {}
    r = q.generate(np.array([prompt]), max_new_tokens=STEPS, return_entropies=True, **kw)
    ref_t, ref_c, ref_x = reference_greedy(ref_model, prompt, STEPS, table, BITS, **kw)
    np.testing.assert_array_equal(r.tokens[0], ref_t)
    diff = r.codes[0].astype(np.int64) - ref_c                # a code may round the other way on a boundary only
    boundary = np.abs(ref_x - np.round(ref_x)) < 0.05
    assert np.all((diff == 0) | ((np.abs(diff) == 1) & boundary)), (r.codes[0], ref_c)
    # the reference tells int8 from float: the float model's codes are not these
    rf = f.generate(np.array([prompt]), max_new_tokens=STEPS, **kw)
    assert (rf.codes[0] != r.codes[0]).any() or (rf.tokens[0] != r.tokens[0]).any()


def test_bad_modes_and_training_are_refused(models):
    _, _, path, f, q = models
    with pytest.raises(ValueError, match=r"quantize must be one of \('int8',\)"):
        PrismaVL.from_pretrained(path, quantize="int4")
    with pytest.raises(ValueError, match="quantize must be one of"):
        f.quantize("int4")
    with pytest.raises(ValueError, match="already quantized"):
        q.quantize("int8")

    from train import step as S
    from train.config import config_from_raw

    raw = yaml.safe_load(open("configs/tiny.yaml"))
    cfg = config_from_raw({"model": raw["model"], "train": {"steps": 2, "batch_size": 2, "seq_len": 16},
                           "data": {"source": "synthetic", "image_size": 64, "max_images": 1}})
    for start in (lambda: S.init_state(cfg, q.params), lambda: S.make_train_step(cfg, q.params)):
        with pytest.raises(ValueError, match="int8-quantized .* generation only and cannot be trained"):
            start()


def test_plan_decode_args_are_the_int8_params(models):
    """`prisma plan --quantize int8` plans the decode program on exactly the int8 tree (shapes, dtypes), and
    it compiles; its weights take fewer bytes than bfloat16's."""
    _, _, _, f, q = models
    mesh = make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, jax.devices()[:1])
    qb = PrismaVL(f.config, jax.tree.map(lambda a: a.astype(jnp.bfloat16), f.params)).quantize("int8")
    args = PL.decode_args(f.config, mesh, 2, 48, "bfloat16", quantize="int8")
    shapes = lambda t: jax.tree.map(lambda a: (a.shape, a.dtype), t)   # noqa: E731
    assert shapes(args[0]) == shapes(qb.params)
    assert shapes(PL.decode_args(f.config, mesh, 2, 48, "float32", quantize="int8")[0]) == shapes(q.params)
    PL.lower_decode(f.config, mesh, 2, 48, "bfloat16", args=args).compile()
    i8, bf16 = PL.bytes_per_device(args[0]), PL.bytes_per_device(PL.decode_args(f.config, mesh, 2, 48, "bfloat16")[0])
    assert i8 == sum(x.nbytes for x in jax.tree.leaves(qb.params)) < bf16


def test_cli_quantize_flag(models, tmp_path, capsys):
    from prisma_jax.host.processing import Processor, build_tokenizer

    d = str(tmp_path)
    build_tokenizer(d, [f"w{i}" for i in range(115)], min_pixels=64 * 64, max_pixels=64 * 96)
    hf = build_model(tiny_hf_config(text_layers=2, vision_depth=2, deepstack=(1,)), seed=6)
    save_checkpoint(hf, d, table=np.random.default_rng(0).normal(0, 0.3, (256, 64)).astype(np.float32))
    argv = ["generate", "--model", d, "--prompt", "w1 w2 w3", "--prompt", "w4", "--max-new-tokens", "6", "--json"]
    assert main(argv + ["--quantize", "int8"]) == 0
    out = json.loads(capsys.readouterr().out)
    proc = Processor.from_pretrained(d)
    enc = proc(messages=[[{"role": "user", "content": [{"type": "text", "text": t}]}] for t in ("w1 w2 w3", "w4")])
    ref = PrismaVL.from_pretrained(d, quantize="int8").generate(enc["input_ids"], enc["attention_mask"],
                                                                max_new_tokens=6, eos_token_id=2)
    for i, o in enumerate(out):
        n = int(ref.lengths[i])
        assert o["tokens"] == ref.tokens[i, :n].tolist() and o["codes"] == ref.codes[i, :n].tolist()

    with pytest.raises(SystemExit) as e:
        main(argv + ["--quantize", "int4"])
    assert e.value.code == 2 and "invalid choice: 'int4'" in capsys.readouterr().err
    # plan: --quantize plans no training, so --search (a training search) is refused in one line
    assert main(["plan", "--config", "configs/tiny.yaml", "--mesh", "cpu-8", "--quantize", "int8", "--search"]) == 2
    assert "cannot be trained" in capsys.readouterr().err
