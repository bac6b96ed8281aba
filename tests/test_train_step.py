"""The train step against independent references: a sequential teacher-forced loop over transformers (the
introspection semantics), the one-big-batch gradient (accumulation), bit-unchanged frozen groups, and a loss
that falls on a memorisation set."""
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import yaml

from hf_tiny import IMAGE, VEND, VSTART, build_model, image_tokens, random_pixels, reference_logits, \
    save_checkpoint, tiny_hf_config
from prisma_jax.host.inputs import prepare
from prisma_jax.checkpoint.loading import load_hf
from prisma_jax.nn.params import init_params_numpy
from train import step as S
from train.config import ConfigError, config_from_raw
from train.data import Collate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = yaml.safe_load(open(os.path.join(ROOT, "configs", "tiny.yaml")))["model"]


def make_cfg(**train):
    t = {"steps": 10, "batch_size": 8, "seq_len": 24, **train}
    return config_from_raw({"model": TINY, "train": t, "optimizer": {"lr": 1e-2, "warmup_steps": 0},
                            "data": {"source": "synthetic", "image_size": 64, "max_images": 1}})


def samples(n=8, s=24, seed=0):
    """Rows with a 64×64 image (4 tokens) in every other row and an assistant span to supervise."""
    rng = np.random.default_rng(seed)
    out = []
    for r in range(n):
        ids = list(rng.integers(10, 128, 3))
        pixels = None
        if r % 2 == 0:
            ids += image_tokens((1, 4, 4))
            pixels = rng.uniform(-1, 1, (16, 1536)).astype(np.float32)
        ids += list(rng.integers(10, 128, 4 + r % 5))
        n_ids = len(ids)
        row = np.zeros(s, np.int32)
        row[:n_ids] = ids
        sup = np.zeros(s, bool)
        sup[n_ids - 4 - r % 3:n_ids] = True
        out.append({"ids": row, "mask": np.arange(s) < n_ids, "supervised": sup, "pixels": pixels})
    return out


def test_grad_accumulation_equals_one_big_batch():
    cfg1, cfg4 = make_cfg(grad_accum=1), make_cfg(grad_accum=4)
    sm = samples()
    b1, b4 = Collate(cfg1, 8)(sm), Collate(cfg4, 8)(sm)
    assert b4.input_ids.shape == (4, 2, 24) and b1.input_ids.shape == (1, 8, 24)
    params = init_params_numpy(cfg1.model, seed=0)
    g1, l1, n1, _ = jax.jit(lambda p, b: S.grads_and_stats(cfg1, p, b))(params, b1)
    g4, l4, n4, _ = jax.jit(lambda p, b: S.grads_and_stats(cfg4, p, b))(params, b4)
    assert float(n1) == float(n4) == sum(int(x["supervised"][1:].sum()) for x in sm)
    np.testing.assert_allclose(l1, l4, rtol=1e-6)
    # the gradients of the step (what the optimizer sees), equal to float32 round-off of the summation order
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g4)):
        assert np.max(np.abs(np.asarray(a) - np.asarray(b))) <= 1e-5 * max(np.max(np.abs(np.asarray(a))), 1e-3)


def test_unrolled_layers_and_remat_equal_the_scanned_stack():
    """train.unroll_layers (null: unrolled on CPU without remat) and train.remat change how the layers run, not
    what they compute: a P = 2 step with images (its vision features computed once, rematerialised with the
    layers) gives the scanned stack's loss and gradients; true with remat is refused."""
    assert S.unrolled(make_cfg()) and not S.unrolled(make_cfg(remat="dots"))
    cfgs = {"unrolled": make_cfg(unroll_layers=True), "scanned": make_cfg(unroll_layers=False),
            "remat full": make_cfg(remat="full"), "remat dots": make_cfg(remat="dots")}
    b = Collate(cfgs["unrolled"], 8)(samples())
    params = init_params_numpy(cfgs["unrolled"].model, seed=0)
    out = {u: jax.jit(lambda p, b, c=c: S.grads_and_stats(c, p, b))(params, b) for u, c in cfgs.items()}
    for name in ("scanned", "remat full", "remat dots"):
        np.testing.assert_allclose(out["unrolled"][1], out[name][1], rtol=1e-6)
        for a, c in zip(jax.tree.leaves(out["unrolled"][0]), jax.tree.leaves(out[name][0])):
            assert np.max(np.abs(np.asarray(a) - np.asarray(c))) <= 1e-5 * max(np.max(np.abs(np.asarray(a))), 1e-3)
    with pytest.raises(ConfigError, match="unroll_layers: true needs train.remat: none"):
        make_cfg(unroll_layers=True, remat="full")


def test_loss_falls_on_memorisation_set_and_frozen_groups_do_not_move():
    """One compiled step (P = 2, 2 micro-batches, vision and table frozen) run 15 times on the same batch."""
    freeze = ("vision", "uncertainty")
    cfg = make_cfg(grad_accum=2, introspection_passes=2, freeze=list(freeze))
    batch = Collate(cfg, 8)(samples())
    fn = jax.jit(S.make_train_step(cfg))
    st = S.init_state(cfg)
    before = jax.tree.map(np.array, st.params)
    losses = []
    for _ in range(15):
        st, m = fn(st, batch)
        losses.append(float(m["loss"]))
    assert losses[-1] < 0.5 * losses[0], losses
    assert 0 <= float(m["code_mean"]) <= 1 and 0 <= float(m["code_low"]) + float(m["code_high"]) <= 1
    for g in ("vision", "text", "lm_head", "uncertainty"):
        same = all(np.array_equal(x, np.asarray(y))
                   for x, y in zip(jax.tree.leaves(before[g]), jax.tree.leaves(st.params[g])))
        assert same == (g in freeze), g


def test_fused_cross_entropy_and_entropy_equal_torch():
    """`xent_and_entropy` (one exp pass, custom backward) against torch's cross-entropy, its autograd gradient
    and a float64 entropy, with unsupervised positions (target −1) and per-position loss weights."""
    rng = np.random.default_rng(0)
    z = rng.normal(size=(2, 5, 37)).astype(np.float32) * 3
    t = rng.integers(-1, 37, (2, 5)).astype(np.int32)
    w = rng.normal(size=(2, 5)).astype(np.float32)
    loss, h = S.xent_and_entropy(jnp.asarray(z), jnp.asarray(t))
    grad = jax.grad(lambda x: jnp.sum(jnp.asarray(w) * S.xent_and_entropy(x, jnp.asarray(t))[0]))(jnp.asarray(z))
    zt = torch.tensor(z, requires_grad=True)
    ce = torch.nn.functional.cross_entropy(zt.reshape(-1, 37), torch.tensor(t.reshape(-1)).long().clamp(min=0),
                                           reduction="none").reshape(2, 5) * torch.tensor(t >= 0)
    (ce * torch.tensor(w)).sum().backward()
    p = torch.softmax(torch.tensor(z, dtype=torch.float64), -1)
    h_ref = -(p * torch.log(p)).sum(-1).numpy()
    np.testing.assert_allclose(np.asarray(loss), ce.detach().numpy(), atol=1e-5)
    np.testing.assert_allclose(np.asarray(grad), zt.grad.numpy(), atol=1e-6)
    np.testing.assert_allclose(np.asarray(h), h_ref, atol=1e-5)
    assert (np.asarray(loss)[t < 0] == 0).all()


def test_freeze_groups_select_their_leaves():
    """`train.freeze: [vision, text, lm_head]` = everything but the table; `embed` / `layers` are parts of text."""
    params = init_params_numpy(make_cfg().model, seed=0)
    for freeze, trained in [(["vision", "text", "lm_head"], {"uncertainty"}),
                            (["embed"], {"vision", "layers", "norm", "lm_head", "uncertainty"}),
                            (["layers"], {"vision", "embed", "lm_head", "uncertainty"})]:
        mask = S.frozen_mask(make_cfg(freeze=freeze), params)
        for path, frozen in jax.tree_util.tree_flatten_with_path(mask)[0]:
            keys = [k.key for k in path]
            group = keys[1] if keys[0] == "text" else keys[0]
            assert frozen == (group not in trained), (freeze, keys)


def test_weight_decay_by_name_with_zero_gradient():
    """No supervised token → a zero gradient, so an AdamW step is its decoupled decay alone: kernels and
    embeddings become p − lr·(wd·p) in float32 (optax's order: (0 + wd·p), times −lr, added to p), norm scales
    and biases — 2-D once stacked per layer — stay bit-identical. Warmup 2: the first step's lr is 0 (nothing
    moves), the second's is the linear warmup at count 1, (0 − lr)·½ + lr, exact in float32."""
    lr, wd = 1e-2, 0.1
    cfg = config_from_raw({"model": TINY, "train": {"steps": 10, "batch_size": 2, "seq_len": 8,
                                                    "introspection_passes": 1},
                           "optimizer": {"lr": lr, "warmup_steps": 2, "weight_decay": wd},
                           "data": {"source": "synthetic", "max_images": 0}})
    rng = np.random.default_rng(0)
    params = init_params_numpy(cfg.model, seed=0)
    for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:     # scales ≠ 1 and biases ≠ 0, so decay shows
        if path[-1].key in ("scale", "bias"):
            x[...] = (path[-1].key == "scale") + 0.1 * rng.standard_normal(x.shape, np.float32)
    assert params["text"]["layers"]["input_norm"]["scale"].ndim == 2          # stacked: what ndim ≥ 2 decayed
    assert params["vision"]["blocks"]["norm1"]["bias"].ndim == 2
    rows = [{"ids": np.arange(10, 18, dtype=np.int32), "mask": np.ones(8, bool), "supervised": np.zeros(8, bool),
             "pixels": None} for _ in range(2)]
    batch = Collate(cfg, 2)(rows)
    assert (batch.targets < 0).all()
    fn = jax.jit(S.make_train_step(cfg))
    st = S.init_state(cfg, params)
    for _ in range(2):
        st, m = fn(st, batch)
    assert float(m["grad_norm"]) == 0.0
    lr1 = np.float32(-lr) * np.float32(1 - 1 / 2) + np.float32(lr)     # optax linear warmup at count 1
    assert lr1 == np.float32(lr) / 2
    decayed = 0
    for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
        got = _leaf(st.params, path)
        name = path[-1].key
        if name in ("scale", "bias"):
            np.testing.assert_array_equal(got, x, err_msg=jax.tree_util.keystr(path))
        else:
            assert name in ("kernel", "embedding")
            want = x + np.float32(-lr1) * (np.float32(wd) * x)
            # XLA folds −lr·wd into one scalar and fuses the multiply-add: at most one rounding (1 ulp of p,
            # ~1e-7 relative) from optax's literal order; the decay itself is lr·wd = 5e-4 relative
            np.testing.assert_array_max_ulp(got, want, maxulp=1)
            assert not np.array_equal(got, x)
            decayed += 1
    assert decayed == 17 + 3       # the kernels, and the token / vision-position / uncertainty tables


def _leaf(tree, path):
    for k in path:
        tree = tree[k.key]
    return np.asarray(tree)


# ----------------------------------------------------------------- the introspection semantics, sequentially


def np_code(logits, n_bits):
    """INTROSPECTION §2 in float64 NumPy."""
    z = logits.astype(np.float64)
    m = z.max(-1, keepdims=True)
    e = np.exp(z - m)
    s = e.sum(-1)
    h = np.log(s) + m[..., 0] - (e * z).sum(-1) / s
    return np.floor(np.clip(h / np.log(z.shape[-1]), 0, 1) * (2**n_bits - 1)).astype(np.int64)


def sequential_setup(tmp_path, s=20):
    """A transformers model with peaked next-token distributions (so that codes differ from position to position),
    its checkpoint loaded, and two rows (one with an image) of 20 tokens."""
    hf = build_model(tiny_hf_config(), seed=1)
    with torch.no_grad():
        hf.lm_head.weight.mul_(40.0)
    table = np.random.default_rng(2).normal(0, 0.5, (256, 64)).astype(np.float32)
    params, mcfg = load_hf(save_checkpoint(hf, str(tmp_path / "ck"), table), dtype="float32")
    rng = np.random.default_rng(3)
    ids = np.zeros((2, s), np.int64)
    mask = np.zeros((2, s), np.int64)
    row0 = [7, 11] + image_tokens((1, 4, 4)) + list(rng.integers(10, 128, 12))
    row1 = list(rng.integers(10, 128, 15))
    ids[0, :len(row0)], mask[0, :len(row0)] = row0, 1
    ids[1, :len(row1)], mask[1, :len(row1)] = row1, 1
    assert VSTART in row0 and VEND in row0
    pv, grid = random_pixels([(1, 4, 4)], seed=4), np.array([[1, 4, 4]])
    return hf, table, params, mcfg, ids, mask, pv, grid


def span_targets(ids, spans, no_loss=()):
    """targets[r, i] = ids[r, i+1] on each (row, a, b) span; S.NO_LOSS at the (row, i) in `no_loss`."""
    targets = np.full(ids.shape, S.IGNORE, np.int64)
    for r, a, b in spans:
        targets[r, a:b] = ids[r, a + 1:b + 1]
    for r, i in no_loss:
        targets[r, i] = S.NO_LOSS
    return targets


def sequential_codes(hf, table, n_bits, ids, mask, pv, grid, codes, feeds):
    """§4 by transformers, step by step: position t takes the code of logits[t − 1] wherever `feeds[:, t − 1]`."""
    codes = np.array(codes, np.int64)
    for t in range(1, ids.shape[1]):
        if feeds[:, t - 1].any():
            ref = reference_logits(hf, ids, mask, pv, grid, table=table, codes_in=codes)
            codes[:, t] = np.where(feeds[:, t - 1], np_code(ref[:, t - 1], n_bits), codes[:, t])
    return codes


def test_training_logits_equal_sequential_teacher_forcing(tmp_path):
    """With enough passes the last pass equals feeding each position the code computed (by transformers, step
    by step) from its predecessor's logits wherever that predecessor is supervised. "Enough" is the longest
    causal chain of supervised positions + 1: with one span per row that is the span length + 1
    (docs/introspection-contract.md §4), but a later span attends to the codes of the earlier ones, so two spans of a row
    chain together: here 5 + 4 supervised positions → P = 10."""
    hf, table, params, mcfg, ids, mask, pv, grid = sequential_setup(tmp_path)
    s = ids.shape[1]
    # two supervised spans per row: 8 and 9 positions
    targets = span_targets(ids, [(0, 9, 13), (0, 15, 19), (1, 3, 8), (1, 10, 14)])
    assert not (ids == IMAGE)[targets >= 0].any()
    batch = prepare(mcfg, ids, mask, pv, grid)

    cfg = config_from_raw({"model": mcfg.to_dict(), "train": {"steps": 1, "batch_size": 2, "seq_len": s,
                                                              "introspection_passes": 10},
                           "data": {"max_images": 1}})
    logits, codes = jax.jit(lambda p, b, t: S.training_logits(cfg, p, b, t))(
        jax.tree.map(jnp.asarray, params), jax.tree.map(jnp.asarray, batch), jnp.asarray(targets))

    ref_codes = sequential_codes(hf, table, mcfg.n_bits, ids, mask, pv, grid, batch.codes, targets >= 0)
    ref = reference_logits(hf, ids, mask, pv, grid, table=table, codes_in=ref_codes)
    np.testing.assert_array_equal(np.asarray(codes), ref_codes)
    valid = mask.astype(bool)
    np.testing.assert_allclose(np.asarray(logits)[valid], ref[valid], atol=2e-4)
    # fewer passes than the span needs give different codes: the property is not vacuous
    cfg2 = config_from_raw({**cfg.to_dict(), "train": {**cfg.to_dict()["train"], "introspection_passes": 2}})
    _, codes2 = jax.jit(lambda p, b, t: S.training_logits(cfg2, p, b, t))(
        jax.tree.map(jnp.asarray, params), jax.tree.map(jnp.asarray, batch), jnp.asarray(targets))
    assert not np.array_equal(np.asarray(codes2), ref_codes)


def test_no_loss_targets_feed_codes_but_give_no_loss_or_gradient(tmp_path):
    """`"loss": false` tokens (target NO_LOSS): the code of the distribution each is drawn from still feeds the
    next position, exactly as for a learned token (transformers, step by step), yet the loss and its gradient
    are those of the learned positions alone: torch's summed cross-entropy over them, and its autograd gradient
    of `lm_head`, the token embeddings and the vision tower, through the model fed those codes."""
    hf, table, params, mcfg, ids, mask, pv, grid = sequential_setup(tmp_path)
    s = ids.shape[1]
    # row 0: an answer of 3 tokens not learned, then 2 learned; row 1: learned, 2 not learned, learned
    targets = span_targets(ids, [(0, 9, 14), (1, 3, 9)], no_loss=[(0, 9), (0, 10), (0, 11), (1, 5), (1, 6)])
    learned, feeds = targets >= 0, targets != S.IGNORE
    assert learned.sum() == 6 and (feeds & ~learned).sum() == 5
    batch = prepare(mcfg, ids, mask, pv, grid)
    cfg = config_from_raw({"model": mcfg.to_dict(), "train": {"steps": 1, "batch_size": 2, "seq_len": s,
                                                              "introspection_passes": 7},
                           "data": {"max_images": 1}})
    p, b, t = jax.tree.map(jnp.asarray, params), jax.tree.map(jnp.asarray, batch), jnp.asarray(targets)
    _, codes = jax.jit(lambda p, b, t: S.training_logits(cfg, p, b, t))(p, b, t)
    (loss, _), g = jax.jit(jax.value_and_grad(lambda p, b, t: S._micro_loss(p, cfg, b, t), has_aux=True))(p, b, t)

    ref_codes = sequential_codes(hf, table, mcfg.n_bits, ids, mask, pv, grid, batch.codes, feeds)
    np.testing.assert_array_equal(np.asarray(codes), ref_codes)
    # the NO_LOSS positions' codes matter: fed as IGNORE instead, the codes after them would be the prompt rule
    ignored = np.where(targets == S.NO_LOSS, S.IGNORE, targets)
    _, codes_ign = jax.jit(lambda p, b, t: S.training_logits(cfg, p, b, t))(p, b, jnp.asarray(ignored))
    assert not np.array_equal(np.asarray(codes_ign), ref_codes)

    hf.zero_grad()
    logits_t = reference_logits(hf, ids, mask, pv, grid, table=table, codes_in=ref_codes, grad=True)
    ce = torch.nn.functional.cross_entropy(logits_t[torch.tensor(learned)],
                                           torch.tensor(targets[learned]).long(), reduction="sum")
    ce.backward()
    np.testing.assert_allclose(float(loss), ce.item(), rtol=1e-5)
    for got, want in [(g["lm_head"]["kernel"], hf.lm_head.weight.grad.numpy().T),
                      (g["text"]["embed"]["embedding"], hf.model.language_model.embed_tokens.weight.grad.numpy()),
                      # the vision tower runs once for all passes (its features do not depend on the codes)
                      (g["vision"]["patch_embed"]["bias"], hf.model.visual.patch_embed.proj.bias.grad.numpy())]:
        assert np.abs(want).max() > 0
        np.testing.assert_allclose(np.asarray(got), want, atol=1e-4 * np.abs(want).max())
