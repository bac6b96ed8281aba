"""Calibration metrics of the demo, in NumPy: accuracy, expected calibration error with its reliability bins,
and how well the uncertainty code separates right from wrong answers.

Inputs are per question: `correct` (bool), `confidence` (the probability the model gave its whole answer:
the product of its tokens' probabilities), and `code` (the mean uncertainty code of the answer's tokens).

    ece          Σ_b (n_b / N) · |accuracy_b − mean confidence_b| over equal-width confidence bins
    correlation  Pearson correlation between code and correctness (point-biserial; negative = the code is
                 high when the answer is wrong)
    auroc        probability that a wrong answer has a higher code than a right one (ties count ½)
"""
from __future__ import annotations

import numpy as np


def reliability_bins(confidence, correct, n_bins: int = 10) -> dict:
    """Equal-width bins over [0, 1] (the last one closed): count, mean confidence and accuracy per bin
    (NaN for empty bins)."""
    conf = np.asarray(confidence, np.float64)
    hit = np.asarray(correct, np.float64)
    idx = np.clip((conf * n_bins).astype(int), 0, n_bins - 1)
    count = np.bincount(idx, minlength=n_bins)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean_conf = np.bincount(idx, conf, n_bins) / count
        acc = np.bincount(idx, hit, n_bins) / count
    return {"edges": np.linspace(0, 1, n_bins + 1).tolist(), "count": count.tolist(),
            "confidence": mean_conf.tolist(), "accuracy": acc.tolist()}


def ece(confidence, correct, n_bins: int = 10) -> float:
    b = reliability_bins(confidence, correct, n_bins)
    n = np.asarray(b["count"], np.float64)
    if n.sum() == 0:
        return float("nan")
    gap = np.abs(np.nan_to_num(np.asarray(b["accuracy"]) - np.asarray(b["confidence"])))
    return float(np.sum(n / n.sum() * gap))


def correlation(code, correct) -> float:
    """Pearson correlation of code and correctness; NaN when either is constant."""
    x = np.asarray(code, np.float64)
    y = np.asarray(correct, np.float64)
    if len(x) < 2 or x.std() == 0 or y.std() == 0:
        return float("nan")
    return float(np.corrcoef(x, y)[0, 1])


def auroc(code, correct) -> float:
    """P(code of a wrong answer > code of a right one), ties ½ (Mann–Whitney); NaN without both classes."""
    x = np.asarray(code, np.float64)
    y = np.asarray(correct, bool)
    wrong, right = x[~y], x[y]
    if len(wrong) == 0 or len(right) == 0:
        return float("nan")
    greater = (wrong[:, None] > right[None, :]).sum()
    ties = (wrong[:, None] == right[None, :]).sum()
    return float((greater + 0.5 * ties) / (len(wrong) * len(right)))


def summarize(rows: list[dict], n_bins: int = 10) -> dict:
    """Metrics of one arm from per-question rows with `kind`, `correct` (answer == label), `right` (answer is
    one of the right answers), `confidence` and `code`."""
    kind = np.array([r["kind"] for r in rows])
    correct = np.array([r["correct"] for r in rows], bool)
    right = np.array([r["right"] for r in rows], bool)
    conf = np.array([r["confidence"] for r in rows], np.float64)
    code = np.array([r["code"] for r in rows], np.float64)

    def share(mask, values):
        return float(values[mask].mean()) if mask.any() else float("nan")

    return {
        "n": len(rows),
        "accuracy": share(kind == "answerable", correct),
        "accuracy_unanswerable": share(kind == "unanswerable", correct),
        "accuracy_ambiguous": share(kind == "ambiguous", right),
        "accuracy_all": share(np.ones(len(rows), bool), correct),
        "ece": ece(conf, correct, n_bins),
        "code_correctness_corr": correlation(code, correct),
        "code_auroc": auroc(code, correct),
        "mean_confidence": float(conf.mean()) if len(conf) else float("nan"),
        "mean_code_right": share(correct, code),
        "mean_code_wrong": share(~correct, code),
        "reliability": reliability_bins(conf, correct, n_bins),
    }
