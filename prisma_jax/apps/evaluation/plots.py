"""`prisma eval`'s plots (matplotlib, Agg backend), each of one or more named metric sets (`summarize`'s dicts):
`prisma eval` draws its one model, the demo both arms side by side.

    reliability.png     per set: accuracy against mean confidence in each bin, bin counts annotated; the
                        diagonal is perfect calibration
    risk_coverage.png   all sets on one axes: the risk (error rate) of the answers kept against their coverage,
                        abstaining above a code threshold; the area under each step curve is its AURC
"""
from __future__ import annotations

import math


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _finite(x) -> bool:
    return x is not None and not math.isnan(x)


def _fmt(x) -> str:
    return f"{x:.3f}" if _finite(x) else "—"


def plot_reliability(named: dict[str, dict], path: str) -> None:
    plt = _plt()
    fig, axes = plt.subplots(1, len(named), figsize=(4.2 * len(named), 4.0), dpi=80, squeeze=False)
    for ax, (name, m) in zip(axes[0], named.items()):
        rel = m["reliability"]
        edges = rel["edges"]
        width = edges[1] - edges[0]
        centers = [e + width / 2 for e in edges[:-1]]
        acc = [a if _finite(a) else 0.0 for a in rel["accuracy"]]
        ax.bar(centers, acc, width=width * 0.9, color="#4c72b0", edgecolor="black", label="accuracy")
        pts = [(x, c) for x, c in zip(centers, rel["confidence"]) if _finite(c)]
        ax.plot([x for x, _ in pts], [c for _, c in pts], "o", color="#dd8452", label="mean confidence")
        ax.plot([0, 1], [0, 1], "--", color="gray", label="perfect calibration")
        for x, a, n in zip(centers, acc, rel["count"]):
            if n:
                ax.text(x, min(a + 0.02, 0.97), str(n), ha="center", fontsize=7)
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1)
        ax.set_xlabel("confidence (probability of the answer)")
        ax.set_ylabel("accuracy")
        ax.set_title(f"{name}\nECE {_fmt(m['ece'])}  (n = {m['n']})".strip(), fontsize=9)
        ax.legend(loc="upper left", fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_risk_coverage(named: dict[str, dict], path: str) -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(5.0, 4.0), dpi=80)
    for name, m in named.items():
        curve = m["risk_coverage"]
        cov = [0.0] + [p["coverage"] for p in curve]
        risk = [curve[0]["risk"]] + [p["risk"] for p in curve]
        # risk_k holds on (coverage_{k−1}, coverage_k]: the area under these steps is metrics.aurc
        line, = ax.step(cov, risk, where="pre", label=f"{name} AURC {_fmt(m['aurc'])}".strip())
        ax.fill_between(cov, risk, step="pre", alpha=0.15, color=line.get_color())
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.set_xlabel("coverage (share answered: code ≤ τ)")
    ax.set_ylabel("risk (error rate of the answers kept)")
    ax.set_title("risk–coverage, abstaining when the answer's code > τ", fontsize=9)
    ax.legend(loc="upper left", fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
