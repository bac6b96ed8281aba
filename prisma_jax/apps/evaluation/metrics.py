"""The metrics of `prisma eval` (and so of the demo), in NumPy: accuracy, calibration of the answer's probability,
and how well the answer's uncertainty code predicts its errors. docs/eval.md defines each one.

Inputs are per item: `correct` (bool: the normalised answer equals the normalised reference), `answerable`
(bool), `confidence` (the probability the model gave its whole answer: the product of its tokens'
probabilities) and `code` (the answer's code: the largest code among its tokens).

    normalize      lower-case, punctuation removed, whitespace collapsed: what exact match compares
    ece            Σ_b (n_b / N) · |accuracy_b − mean confidence_b| over equal-width confidence bins
    auroc          P(code of a wrong answer > code of a right one), ties ½ (Mann–Whitney)
    correlation    Pearson correlation (code against error: positive = high codes go with wrong answers)
    risk_coverage  abstain when code > τ, τ swept over every distinct code: coverage and risk (error rate)
                   of the answers kept
    aurc           area under that curve, a step function of coverage

Not here: generating the answers (answers.py), plotting (plots.py).
"""
from __future__ import annotations

import math
import re
import unicodedata

import numpy as np

N_BINS = 10


def normalize(text: str) -> str:
    """Exact match's normal form: lower-case (Unicode casefold), every punctuation character (Unicode category
    P*) deleted, runs of whitespace made one space, ends stripped. "I don't know." → "i dont know"."""
    text = "".join(ch for ch in unicodedata.normalize("NFKC", text).casefold()
                   if not unicodedata.category(ch).startswith("P"))
    return re.sub(r"\s+", " ", text).strip()


def reliability_bins(confidence, correct, n_bins: int = N_BINS) -> dict:
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


def ece(confidence, correct, n_bins: int = N_BINS) -> float:
    b = reliability_bins(confidence, correct, n_bins)
    n = np.asarray(b["count"], np.float64)
    if n.sum() == 0:
        return float("nan")
    gap = np.abs(np.nan_to_num(np.asarray(b["accuracy"]) - np.asarray(b["confidence"])))
    return float(np.sum(n / n.sum() * gap))


def correlation(x, y) -> float:
    """Pearson correlation of x and y; NaN when either is constant."""
    x = np.asarray(x, np.float64)
    y = np.asarray(y, np.float64)
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


def risk_coverage(code, correct) -> list[dict]:
    """One point per distinct code τ, ascending: answering only when code ≤ τ (abstaining above it), the share
    of items answered (`coverage`) and the error rate among them (`risk`). The last point answers everything."""
    x = np.asarray(code, np.float64)
    wrong = ~np.asarray(correct, bool)
    taus = np.unique(x)
    order = np.argsort(x, kind="stable")
    kept = np.searchsorted(x[order], taus, side="right")            # items with code ≤ τ
    errors = np.concatenate([[0], np.cumsum(wrong[order])])[kept]
    return [{"tau": float(t), "coverage": float(k / len(x)), "risk": float(e / k)}
            for t, k, e in zip(taus, kept, errors)]


def aurc(curve: list[dict]) -> float:
    """Area under the risk–coverage curve: Σ_k (coverage_k − coverage_{k−1}) · risk_k, coverage_0 = 0 — each
    group of equal codes enters with the risk of the answers kept once it is in. Without ties this is the usual
    (1/N) Σ_i risk of the i lowest-code answers. NaN for an empty curve."""
    if not curve:
        return float("nan")
    cov = np.array([0.0] + [p["coverage"] for p in curve])
    risk = np.array([p["risk"] for p in curve])
    return float(np.sum(np.diff(cov) * risk))


def summarize(correct, answerable, confidence, code, group=None, n_bins: int = N_BINS) -> dict:
    """metrics.json's numbers from per-item arrays (`group`: an optional label per item, None = no group)."""
    correct = np.asarray(correct, bool)
    answerable = np.asarray(answerable, bool)
    conf = np.asarray(confidence, np.float64)
    code = np.asarray(code, np.float64)

    def share(mask, values):
        return float(values[mask].mean()) if mask.any() else float("nan")

    curve = risk_coverage(code, correct)
    out = {
        "n": int(len(correct)),
        "n_answerable": int(answerable.sum()),
        "accuracy": share(answerable, correct),
        "accuracy_all": share(np.ones(len(correct), bool), correct),
        "accuracy_unanswerable": share(~answerable, correct),
        "ece": ece(conf, correct, n_bins),
        "auroc": auroc(code, correct),
        "code_error_corr": correlation(code, ~correct),
        "aurc": aurc(curve),
        "mean_confidence": share(np.ones(len(conf), bool), conf),
        "mean_code_right": share(correct, code),
        "mean_code_wrong": share(~correct, code),
        "reliability": reliability_bins(conf, correct, n_bins),
        "risk_coverage": curve,
    }
    if group is not None and any(g is not None for g in group):
        group = np.array(["" if g is None else str(g) for g in group], object)
        out["by_group"] = {g: {"n": int((group == g).sum()), "accuracy": share(group == g, correct)}
                           for g in sorted(set(group))}
    return out


def json_safe(x):
    """`x` with every NaN or infinity made None (JSON null): metrics.json stays standard JSON."""
    if isinstance(x, dict):
        return {k: json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_safe(v) for v in x]
    if isinstance(x, float) and (math.isnan(x) or math.isinf(x)):
        return None
    return x
