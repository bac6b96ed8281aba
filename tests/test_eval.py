"""The demo's calibration metrics against hand-computed values."""
import math

import numpy as np

from prisma_jax.demo import metrics as M


def test_ece_by_hand():
    # bin [0.9, 1]: confidences 0.95, 0.95, accuracy 1/2 → gap 0.45; bin [0.2, 0.3): 0.25, accuracy 0 → 0.25
    conf = [0.95, 0.95, 0.25]
    correct = [True, False, False]
    assert math.isclose(M.ece(conf, correct), 2 / 3 * 0.45 + 1 / 3 * 0.25, rel_tol=1e-12)
    # confidence 1.0 falls in the last bin, not outside
    b = M.reliability_bins([1.0, 0.0], [True, False])
    assert b["count"][-1] == 1 and b["count"][0] == 1
    assert M.ece([1.0, 0.0], [True, False]) == 0.0


def test_perfectly_calibrated_bins_have_zero_ece():
    conf = [0.55] * 20 + [0.85] * 20
    correct = [True] * 11 + [False] * 9 + [True] * 17 + [False] * 3
    assert math.isclose(M.ece(conf, correct), 0.0, abs_tol=1e-12)


def test_correlation_and_auroc_by_hand():
    code = [10, 20, 200, 250]
    correct = [True, True, False, False]
    # point-biserial by its own formula: (m1 − m0)/s · sqrt(p q)
    x, y = np.array(code, float), np.array(correct, float)
    m1, m0 = x[y == 1].mean(), x[y == 0].mean()
    expected = (m1 - m0) / x.std() * math.sqrt(0.5 * 0.5)
    assert math.isclose(M.correlation(code, correct), expected, rel_tol=1e-12)
    assert M.auroc(code, correct) == 1.0
    assert M.auroc([5, 5], [True, False]) == 0.5
    assert M.auroc([1, 3, 2], [True, True, False]) == 0.5     # wrong (2) beats 1, loses to 3
    assert math.isnan(M.correlation([1, 1, 1], [True, False, True]))
    assert math.isnan(M.auroc([1, 2], [True, True]))


def test_summarize_splits_by_kind():
    rows = [
        {"kind": "answerable", "correct": True, "right": True, "confidence": 0.9, "code": 10},
        {"kind": "answerable", "correct": False, "right": False, "confidence": 0.6, "code": 100},
        {"kind": "unanswerable", "correct": True, "right": True, "confidence": 0.8, "code": 20},
        {"kind": "ambiguous", "correct": False, "right": True, "confidence": 0.5, "code": 150},
    ]
    s = M.summarize(rows)
    assert s["accuracy"] == 0.5
    assert s["accuracy_unanswerable"] == 1.0
    assert s["accuracy_ambiguous"] == 1.0          # a right answer, though not the drawn label
    assert s["accuracy_all"] == 0.5
    assert math.isclose(s["ece"], M.ece([0.9, 0.6, 0.8, 0.5], [1, 0, 1, 0]))
    assert s["mean_code_right"] == 15 and s["mean_code_wrong"] == 125
