"""Independent plain-Python re-derivations of `prisma eval`'s metrics (docs/eval.md), written from their
definitions without NumPy's vectorised tricks: tests compare prisma_jax.apps.evaluation.metrics against these."""
import math
import unicodedata


def normalize(text):
    kept = [ch for ch in unicodedata.normalize("NFKC", text).casefold() if unicodedata.category(ch)[0] != "P"]
    return " ".join("".join(kept).split())


def ece(conf, correct, n_bins=10):
    """Sort into bins by explicit comparison with the edges; the last bin holds 1.0."""
    total, n = 0.0, len(conf)
    for b in range(n_bins):
        lo, hi = b / n_bins, (b + 1) / n_bins
        sel = [i for i, c in enumerate(conf) if lo <= c < hi or (b == n_bins - 1 and c == 1.0)]
        if sel:
            acc = sum(correct[i] for i in sel) / len(sel)
            avg = sum(conf[i] for i in sel) / len(sel)
            total += len(sel) / n * abs(acc - avg)
    return total


def auroc(code, correct):
    """Count every (wrong, right) pair: 1 when the wrong answer's code is higher, ½ on a tie."""
    wins = pairs = 0
    for cw, w in zip(code, correct):
        for cr, r in zip(code, correct):
            if not w and r:
                pairs += 1
                wins += 1.0 if cw > cr else 0.5 if cw == cr else 0.0
    return wins / pairs if pairs else math.nan


def pearson(x, y):
    n = len(x)
    mx, my = sum(x) / n, sum(y) / n
    sxy = sum((a - mx) * (b - my) for a, b in zip(x, y))
    sxx = sum((a - mx) ** 2 for a in x)
    syy = sum((b - my) ** 2 for b in y)
    return sxy / math.sqrt(sxx * syy) if sxx > 0 and syy > 0 else math.nan


def risk_coverage(code, correct):
    out = []
    for tau in sorted(set(code)):
        kept = [i for i in range(len(code)) if code[i] <= tau]
        out.append({"tau": tau, "coverage": len(kept) / len(code),
                    "risk": sum(not correct[i] for i in kept) / len(kept)})
    return out


def aurc(code, correct):
    """Sort the answers by code; walk through each group of equal codes, adding its share of the items times
    the error rate of everything kept once it is in."""
    order = sorted(range(len(code)), key=lambda i: code[i])
    area, kept, errors, i = 0.0, 0, 0, 0
    while i < len(order):
        j = i
        while j < len(order) and code[order[j]] == code[order[i]]:
            errors += not correct[order[j]]
            j += 1
        kept = j
        area += (j - i) / len(code) * errors / kept
        i = j
    return area
