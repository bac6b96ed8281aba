"""`data.packing`: several conversations share a training row, told apart by segment ids. The reference is each
conversation alone in its own padded row (the unpacked path, itself checked against transformers in
tests/test_train_step.py): a packed batch gives the same mean loss over the same learned tokens and the same
gradients, each segment's positions and codes (every introspection pass) are its conversation's own, and no code
or target crosses a segment boundary."""
import dataclasses
import json

import jax
import numpy as np
import pytest
import yaml

from prisma_jax.nn.params import init_params_numpy
from prisma_jax.nn.uncertainty import prompt_codes, segment_starts
from train import step as S
from train.config import config_from_raw
from train.data import Record, build, pack

from test_train_loop import SFT

S_LEN = 48


def conversations(tmp_path):
    """(JSONL path, processor dir): 5 conversations of mixed lengths, three with a 64×64 image (4 tokens)."""
    from PIL import Image
    from prisma_jax.host.processing import build_tokenizer
    from train.tiny_sft import WORDS
    d = tmp_path / "data"
    d.mkdir()
    Image.new("RGB", (64, 64), (200, 10, 10)).save(d / "red.png")
    Image.new("RGB", (64, 64), (10, 10, 200)).save(d / "blue.png")
    proc = str(d / "proc")
    build_tokenizer(proc, WORDS, min_pixels=64 * 64, max_pixels=128 * 128)

    def img(name, q, a):
        return {"messages": [{"role": "user", "content": [{"type": "image", "image": name},
                                                           {"type": "text", "text": q}]},
                             {"role": "assistant", "content": a}]}

    def txt(q, a, loss=True):
        return {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a, "loss": loss}]}
    lines = [img("red.png", "what is this ?", "a red square ."),
             img("blue.png", "what is the background ?", "blue"),
             txt("count to three", "one two three"),
             txt("opposite of up", "down", loss=False),
             img("red.png", "what is this image ?", "the image shows a red square on a red background .")]
    with open(d / "train.jsonl", "w") as f:
        f.write("\n".join(json.dumps(x) for x in lines) + "\n")
    return str(d / "train.jsonl"), proc


def cfg_for(path, proc, packing, batch_size, passes=3, attention="xla"):
    raw = yaml.safe_load(open(SFT))
    raw["model"]["attention"] = attention
    raw["train"].update(steps=2, batch_size=batch_size, seq_len=S_LEN, grad_accum=1, introspection_passes=passes)
    raw["data"] = {"source": "jsonl", "path": path, "processor": proc, "image_size": 64, "max_images": 2,
                   "shuffle": False, "packing": packing}
    return config_from_raw(raw)


@pytest.fixture(scope="module")
def batches(tmp_path_factory):
    """(packed cfg, packed batch, padded cfg, padded batch, the packed rows as record indices)."""
    from prisma_jax.host.processing import Processor
    from train.data import index_jsonl
    tmp = tmp_path_factory.mktemp("packing")
    path, proc = conversations(tmp)
    padded_cfg = cfg_for(path, proc, False, 5)
    records, _ = index_jsonl(padded_cfg, path, Processor.from_pretrained(proc))
    rows = pack(records, S_LEN, 2)
    packed_cfg = cfg_for(path, proc, True, len(rows))
    packed = next(iter(build(packed_cfg, str(tmp / "wd_packed"))[0]))
    padded = next(iter(build(padded_cfg, str(tmp / "wd_padded"))[0]))
    return packed_cfg, packed, padded_cfg, padded, rows


def with_passes(cfg, p):
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, introspection_passes=p))


def segments_of(batch, rows):
    """(packed row, segment id, padded row = record index, length) of every conversation."""
    out = []
    for r, row in enumerate(rows):
        for k, rec in enumerate(row):
            out.append((r, k + 1, rec, int(np.sum(batch.attention_mask[0, r] == k + 1))))
    return out


def test_first_fit_packs_in_order_within_tokens_and_image_slots():
    def rec(n, imgs):
        return Record(np.zeros(n, np.int32), np.zeros(n, bool), ["x"] * imgs)
    recs = [rec(30, 1), rec(30, 0), rec(15, 1), rec(10, 1), rec(20, 0), rec(5, 0), rec(40, 2), rec(1, 0)]
    # first-fit by hand: 30→row0; 30→row1; 15(img)→row0 (45, 2 imgs); 10(img)→row1 (40, row0 has no slot);
    # 20→row2; 5→row0 (50); 40(2 imgs)→row3; 1→row0 (51)
    rows = pack(recs, 51, 2)
    assert rows == [[0, 2, 5, 7], [1, 3], [4], [6]]
    with pytest.raises(ValueError, match="do not fit a row"):
        pack([rec(52, 0)], 51, 2)
    assert pack(recs, 51, 2) == rows                                   # deterministic


def test_packed_batch_layout_positions_codes_and_targets(batches):
    packed_cfg, packed, _, padded, rows = batches
    m = packed_cfg.model
    assert rows == [[0, 1], [2, 3], [4]] and packed.attention_mask.dtype == np.int32   # row 0: two images
    for r, seg, rec, n in segments_of(packed, rows):
        where = packed.attention_mask[0, r] == seg
        assert n == int(padded.attention_mask[0, rec].sum())
        # the conversation's tokens, positions (3-D, images included), prompt-rule codes and targets are its own
        np.testing.assert_array_equal(packed.input_ids[0, r, where], padded.input_ids[0, rec, :n])
        np.testing.assert_array_equal(packed.positions[0][:, r, where], padded.positions[0][:, rec, :n])
        np.testing.assert_array_equal(packed.codes[0, r, where], padded.codes[0, rec, :n])
        np.testing.assert_array_equal(packed.targets[0, r, where], padded.targets[0, rec, :n])
        first = np.flatnonzero(where)[0]
        assert packed.codes[0, r, first] == -1 and packed.targets[0, r, np.flatnonzero(where)[-1]] == -1
    # positions restart at 0 in every segment; the image run of a conversation: (t, row, col) from its offset
    starts = segment_starts(packed.attention_mask[0])
    assert (packed.positions[0][:, starts] == 0).all()
    ids, mask = packed.input_ids[0], packed.attention_mask[0]
    r, i = np.argwhere(ids == m.image_token_id)[0]
    off = packed.positions[0][0, r, i - 1] + 1
    np.testing.assert_array_equal(packed.positions[0][:, r, i:i + 4],
                                  off + np.array([[0, 0, 0, 0], [0, 0, 1, 1], [0, 1, 0, 1]]))
    # an independent re-derivation of the prompt rule: −1 at each segment's first token and at padding
    want = np.where(mask > 0, 2 ** (m.n_bits - 1), -1)
    want[starts] = -1
    np.testing.assert_array_equal(packed.codes[0], want)
    np.testing.assert_array_equal(prompt_codes(mask, m.n_bits), want)
    # each row's image slots hold its conversations' images in row order
    for r, row in enumerate(rows):
        pix = [padded.pixel_values[0, rec, :16] for rec in row if (padded.input_ids[0, rec] == m.image_token_id).any()]
        for k, p in enumerate(pix):
            np.testing.assert_array_equal(packed.pixel_values[0, r, 16 * k:16 * (k + 1)], p)


def test_codes_of_every_pass_stay_in_their_segment(batches):
    """Pass by pass (P = 1, 2, 3, 4): the codes the last pass is fed are, segment by segment, those the
    conversation alone is fed, and each segment's first token has none."""
    packed_cfg, packed, padded_cfg, padded, rows = batches
    params = init_params_numpy(packed_cfg.model, seed=3)
    for p in (1, 2, 3, 4):
        pc, uc = with_passes(packed_cfg, p), with_passes(padded_cfg, p)
        mb, tg = S.micro(packed, 0)
        _, codes_p = jax.jit(lambda q, b, t: S.training_logits(pc, q, b, t))(params, mb, tg)
        mb, tg = S.micro(padded, 0)
        _, codes_u = jax.jit(lambda q, b, t: S.training_logits(uc, q, b, t))(params, mb, tg)
        codes_p, codes_u = np.asarray(codes_p), np.asarray(codes_u)
        assert (codes_p[segment_starts(packed.attention_mask[0])] == -1).all()
        fed = 0
        for r, seg, rec, n in segments_of(packed, rows):
            got = codes_p[r, packed.attention_mask[0, r] == seg]
            np.testing.assert_array_equal(got, codes_u[rec, :n], err_msg=f"P={p} conversation {rec}")
            fed += int(np.sum((got >= 0) & (got != 2 ** (packed_cfg.model.n_bits - 1))))
        assert (fed > 0) == (p > 1)                                    # passes ≥ 2 feed real codes


def test_packed_loss_and_gradients_equal_each_conversation_alone(batches):
    """float32, P = 3: mean loss over the same learned tokens and its gradients, packed vs padded."""
    packed_cfg, packed, padded_cfg, padded, _ = batches
    params = init_params_numpy(packed_cfg.model, seed=1)
    gp, lp, np_, _ = jax.jit(lambda q, b: S.grads_and_stats(packed_cfg, q, b))(params, packed)
    gu, lu, nu, _ = jax.jit(lambda q, b: S.grads_and_stats(padded_cfg, q, b))(params, padded)
    assert float(np_) == float(nu) > 0
    np.testing.assert_allclose(float(lp), float(lu), rtol=2e-6)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(gp), jax.tree.leaves(gu)):
        a, b = np.asarray(a), np.asarray(b)
        assert np.max(np.abs(a - b)) <= 1e-5 * max(np.max(np.abs(b)), 1e-6), jax.tree_util.keystr(path)
    assert np.max(np.abs(np.asarray(gu["vision"]["patch_embed"]["kernel"]))) > 0     # images reach the loss


def test_packed_loss_under_pallas_attention_equals_xla(batches):
    """Splash attention (Pallas interpret mode off TPU) takes the same segment ids: the same packed loss."""
    packed_cfg, packed, _, _, rows = batches
    pallas = dataclasses.replace(packed_cfg, model=dataclasses.replace(packed_cfg.model, attention="pallas"))
    params = init_params_numpy(packed_cfg.model, seed=2)

    def loss(cfg, one_segment=False):
        mb, tg = S.micro(packed, 0)
        if one_segment:                                                # attention across the conversations
            mb = mb._replace(attention_mask=mb.attention_mask > 0)
        return float(jax.jit(lambda q, b, t: S._micro_loss(q, cfg, b, t)[0])(params, mb, tg))
    xla, splash = loss(packed_cfg), loss(pallas)
    crossed = loss(pallas, one_segment=True)
    np.testing.assert_allclose(splash, xla, rtol=2e-6)
    assert abs(crossed - xla) > 100 * abs(splash - xla)             # the segment ids are what keeps them apart


def test_packing_config_and_segment_ids_are_checked():
    from prisma_jax.core.config import ConfigError
    from prisma_jax.host.inputs import prepare
    raw = yaml.safe_load(open(SFT))
    raw["data"] = {"source": "synthetic", "packing": True}
    with pytest.raises(ConfigError, match="data.packing needs conversations"):
        config_from_raw(raw)
    raw["data"] = {"source": "tiny_sft", "packing": "yes"}
    with pytest.raises(ConfigError, match="data.packing: expected true/false"):
        config_from_raw(raw)
    m = cfg_for("x.jsonl", "proc", True, 2).model
    ids = np.full((1, 6), 20)
    with pytest.raises(ValueError, match="one contiguous run"):
        prepare(m, ids, np.array([[1, 1, 2, 2, 1, 0]]), segments=True)
    with pytest.raises(ValueError, match="only 0 and 1"):               # segment ids only where asked for
        prepare(m, ids, np.array([[1, 1, 2, 2, 0, 0]]))
    b = prepare(m, ids, np.array([[1, 1, 2, 2, 2, 0]]), segments=True)
    assert b.attention_mask.dtype == np.int32
    np.testing.assert_array_equal(b.positions[0], [[0, 1, 0, 1, 2, 0]])
    np.testing.assert_array_equal(b.codes, [[-1, 128, -1, 128, 128, -1]])
