"""benchmarks/introspection.py's pieces: the cross-seed statistics (prisma_jax/apps/evaluation/stats.py) against
hand-computed values, statistical tables and scipy; the self-labelled confidence data (prisma_jax/apps/demo/selflabel.py)
through the real training pipeline — right answers → "sure", wrong → "unsure", and only that word learned."""
import math

import numpy as np
import pytest
from scipy import stats as sps

from prisma_jax.apps.demo import dataset as D
from prisma_jax.apps.demo import run as R
from prisma_jax.apps.demo import selflabel as SL
from prisma_jax.apps.evaluation import stats as ST
from train.config import load_train_config
from train.data import Collate, LoadImages, index_jsonl
from train.step import IGNORE, NO_LOSS

# five seeds of two arms: d = a − b = [0.02, 0, 0.04, −0.01, 0.04]
A = [0.95, 0.94, 0.96, 0.93, 0.97]
B = [0.93, 0.94, 0.92, 0.94, 0.93]


# ------------------------------------------------------------------------------------------------ statistics

def test_t_distribution_against_tables_and_scipy():
    # two-sided 95 % critical values of Student's t (any statistics table)
    for df, crit in [(1, 12.706), (2, 4.303), (4, 2.776), (9, 2.262), (30, 2.042)]:
        assert ST.t_ppf(0.975, df) == pytest.approx(crit, abs=5e-4)
        assert ST._t_ppf(0.975, df) == pytest.approx(crit, abs=5e-4)
    # the scipy-free fallback (incomplete beta by continued fraction) against scipy
    for df in (1, 2, 3, 4, 7.5, 30, 200):
        for t in (-8.0, -2.5, -0.3, 0.0, 0.7, 1.76505, 4.0, 40.0):
            assert ST._t_cdf(t, df) == pytest.approx(sps.t.cdf(t, df), abs=1e-12)
        for q in (0.01, 0.3, 0.5, 0.9, 0.975, 0.999):
            assert ST._t_ppf(q, df) == pytest.approx(sps.t.ppf(q, df), rel=1e-9, abs=1e-12)
    assert ST.betainc(2.0, 3.0, 0.4) == pytest.approx(0.5248, abs=1e-12)   # 1 − Σ_{j<2} C(4,j)·0.4^j·0.6^(4−j)


@pytest.mark.parametrize("with_scipy", [True, False])
def test_mean_ci_by_hand(monkeypatch, with_scipy):
    if not with_scipy:                                   # the module's own t distribution
        monkeypatch.setattr(ST, "_scipy_t", lambda: None)
    ci = ST.mean_ci(A)
    sd = math.sqrt(sum((x - 0.95) ** 2 for x in A) / 4)                   # 0.015811…
    assert ci["mean"] == pytest.approx(0.95) and ci["sd"] == pytest.approx(sd) and ci["n"] == 5
    assert ci["half"] == pytest.approx(2.7764451 * sd / math.sqrt(5), rel=1e-7)   # t_{0.975, 4}
    assert (ci["lo"], ci["hi"]) == pytest.approx((0.95 - ci["half"], 0.95 + ci["half"]))
    # NaN / None (a metric undefined on a seed) are left out; one value has no interval
    assert ST.mean_ci([*A, float("nan"), None])["n"] == 5
    assert math.isnan(ST.mean_ci([0.5])["half"])


@pytest.mark.parametrize("with_scipy", [True, False])
def test_paired_t_by_hand_and_against_scipy(monkeypatch, with_scipy):
    if not with_scipy:
        monkeypatch.setattr(ST, "_scipy_t", lambda: None)
    r = ST.paired_t(A, B)
    d = [0.02, 0.0, 0.04, -0.01, 0.04]
    sd = math.sqrt(sum((x - 0.018) ** 2 for x in d) / 4)                  # √(2.08e-3 / 4)
    assert r["mean_diff"] == pytest.approx(0.018) and r["df"] == 4
    assert r["t"] == pytest.approx(0.018 / (sd / math.sqrt(5)), rel=1e-9)   # 1.76505
    assert r["t"] == pytest.approx(1.76505, abs=1e-5)
    ref = sps.ttest_rel(A, B)
    assert r["t"] == pytest.approx(ref.statistic, rel=1e-9) and r["p"] == pytest.approx(ref.pvalue, rel=1e-9)
    assert r["p"] == pytest.approx(0.1523, abs=1e-3)
    assert ST.paired_t([1, 2, 3], [0, 1, 2])["p"] == 0.0                  # constant non-zero differences
    assert ST.paired_t([1, 2, 3], [1, 2, 3])["p"] == 1.0


def test_sign_flip_by_hand_and_against_scipy():
    """d = [.02, 0, .04, −.01, .04], Σ = .09. Flipping the signs of a set F gives .09 − 2·Σ_F, at least .09 in size
    iff Σ_F ≤ 0 or Σ_F ≥ .09: F ⊆ {0, −.01} (4 sets) or their complements (4), 8 of 32 patterns → p = 1/4."""
    r = ST.sign_flip(A, B)
    assert r["p"] == 0.25 and r["n"] == 5 and r["mean_diff"] == pytest.approx(0.018)
    ref = sps.permutation_test((np.array(A), np.array(B)), lambda x, y, axis: np.mean(x - y, axis=axis),
                               permutation_type="samples", alternative="two-sided", n_resamples=np.inf)
    assert r["p"] == pytest.approx(ref.pvalue)
    assert ST.sign_flip([1, 2, 3, 4, 5], [0, 0, 0, 0, 0])["p"] == 2 / 32   # the smallest p with five pairs
    assert ST.sign_flip([1, float("nan")], [0, 0])["n"] == 1
    c = ST.compare(A, B)
    assert c["diff"]["mean"] == pytest.approx(0.018) and c["diff"]["n"] == 5
    assert c["paired_t"] == ST.paired_t(A, B) and c["sign_flip"] == r and c["a"] == ST.mean_ci(A)
    with pytest.raises(ValueError, match="equal lengths"):
        ST.paired_t([1, 2], [1])


# ------------------------------------------------------------------------------------------------ self-labels

@pytest.fixture(scope="module")
def demo_data(tmp_path_factory):
    d = tmp_path_factory.mktemp("selflabel")
    info = D.build_dataset(str(d / "data"), 12, 2, questions_per_image=1, seed=5)
    cfg, _ = load_train_config(R.DEFAULT_CONFIG, [f"data.path={info['train']}", f"data.processor={d / 'tok'}"])
    R.build_tokenizer_dir(str(d / "tok"), cfg.model)
    return d, info, cfg


def test_self_label_data_supervises_only_the_word(demo_data):
    """Answers alternately right and wrong (and one empty) → conversations whose targets, through index_jsonl and
    Collate, are NO_LOSS on the answer and the end token, the word's id ("sure" iff right) at the position before
    the word, IGNORE on the prompt — re-derived from the word-level vocabulary, not from encode_supervised."""
    from prisma_jax.host.processing import Processor
    d, info, cfg = demo_data
    n = SL.label_items(info["train"], str(d / "data" / "label_items.jsonl"))
    items = D.read_jsonl(str(d / "data" / "label_items.jsonl"))
    assert n == len(items) and 0 < n < 12                     # captions left out
    assert all(it["messages"][0]["content"][-1]["text"] != "describe the image ?" for it in items)
    preds = ["red", "top left", "", "2", "unknown", "no"]
    rows = [{"index": i, "prediction": preds[i % len(preds)], "correct": i % 2 == 0} for i in range(n)]
    recs = SL.self_label_records(items, rows)
    D.write_jsonl(str(d / "data" / "selflabel.jsonl"), recs)

    proc = Processor.from_pretrained(str(d / "tok"))
    records, _ = index_jsonl(cfg, str(d / "data" / "selflabel.jsonl"), proc)
    batch = Collate(cfg, n)([LoadImages(cfg, proc.image_processor)(r) for r in records])
    vocab = proc.tokenizer.get_vocab()
    for i, row in enumerate(rows):
        ids, tg = batch.input_ids[0, i], batch.targets[0, i]
        start = int(np.flatnonzero(ids == vocab["assistant"])[-1]) + 2      # after "assistant", "\n"
        answer = [vocab[w] for w in row["prediction"].split()]
        word = vocab["sure" if row["correct"] else "unsure"]
        reply = answer + [word, vocab["<|im_end|>"]]
        np.testing.assert_array_equal(ids[start:start + len(reply)], reply)
        want = np.full(len(ids), IGNORE)
        want[start - 1:start - 1 + len(reply)] = NO_LOSS                   # target of position p = token p + 1
        want[start - 1 + len(answer)] = word
        np.testing.assert_array_equal(tg, want, err_msg=str(row))
    assert (batch.targets >= 0).sum() == n                                  # one learned token a conversation


def test_confidence_reply_and_word_metrics_by_hand():
    assert SL.confidence_reply("top left", True) == {
        "role": "assistant", "loss": False, "content": [{"type": "text", "text": "top left"},
                                                        {"type": "text", "text": " sure", "loss": True}]}
    assert SL.confidence_reply("", False)["content"] == [{"type": "text", "text": "unsure", "loss": True}]
    rows = [{"correct": c, "p_unsure": p, "word": w, "p_words": 1.0, "code": k}
            for c, p, w, k in [(True, 0.1, "sure", 10), (True, 0.6, "unsure", 30), (False, 0.7, "unsure", 20),
                               (False, 0.2, "sure", None), (True, 0.2, "sure", 5)]]
    m = SL.word_metrics(rows)
    # wrong {.7, .2} vs right {.1, .6, .2}: pairs won .7>all (3), .2>.1 (1), .2=.2 (½) → 4.5 / 6
    assert m["word_auroc"] == pytest.approx(4.5 / 6)
    assert m["word_accuracy"] == pytest.approx(3 / 5)                      # rows 1, 3 and 5
    assert m["answer_accuracy"] == pytest.approx(3 / 5) and m["unsure_share"] == pytest.approx(2 / 5)
    assert m["code_auroc"] == pytest.approx(2 / 3)                         # wrong code 20 vs right 10, 30, 5
