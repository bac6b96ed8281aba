"""The demo's outputs beside each arm's `prisma eval` directory: `metrics.json`, `report.md` and PNG plots
(matplotlib, Agg backend).

    reliability.png     reliability diagrams of both arms side by side (prisma_jax.apps.evaluation.plots)
    risk_coverage.png   both arms' risk–coverage curves on one axes (prisma_jax.apps.evaluation.plots)
    traces.png          per-token uncertainty codes of a few held-out answers, right and wrong, both arms
    codes.png           distribution of the answer code for right vs wrong answers, both arms

Not here: computing the metrics (prisma_jax.apps.evaluation) or running anything (run.py).
"""
from __future__ import annotations

import json
import math
import os

from prisma_jax.apps.evaluation import plots
from prisma_jax.apps.evaluation.metrics import json_safe

ARMS = (("feedback", "with feedback (table trained)"), ("no_feedback", "no feedback (table frozen at 0)"))


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot_traces(examples: dict, n_levels: int, path: str) -> None:
    """`examples[arm]`: a list of {question, answer, label, correct, tokens: [str], codes: [int]}."""
    plt = _plt()
    rows = max(len(v) for v in examples.values()) or 1
    fig, axes = plt.subplots(rows, len(ARMS), figsize=(4.6 * len(ARMS), 1.5 * rows + 0.6), dpi=80,
                             squeeze=False)
    for j, (arm, title) in enumerate(ARMS):
        for i in range(rows):
            ax = axes[i][j]
            if i >= len(examples.get(arm, [])):
                ax.axis("off")
                continue
            ex = examples[arm][i]
            h = [c / (n_levels - 1) for c in ex["codes"]]
            ax.bar(range(len(h)), h, width=0.6, color="#55a868" if ex["correct"] else "#c44e52")
            ax.set_xlim(-0.6, max(len(h), 4) - 0.4)
            ax.set_xticks(range(len(h)))
            ax.set_xticklabels(ex["tokens"], fontsize=7)
            ax.set_ylim(0, 1)
            ax.set_ylabel("code/(L−1)", fontsize=7)
            mark = "right" if ex["correct"] else f"wrong (label {ex['label']})"
            ax.set_title(f"{ex['question']} → {ex['answer']}  [{mark}]", fontsize=7)
            if i == 0:
                ax.text(0.99, 0.9, title, transform=ax.transAxes, ha="right", fontsize=7, style="italic")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_code_hist(rows: dict, n_levels: int, path: str) -> None:
    plt = _plt()
    fig, axes = plt.subplots(1, len(ARMS), figsize=(4.2 * len(ARMS), 3.0), dpi=80, squeeze=False)
    for ax, (arm, title) in zip(axes[0], ARMS):
        right = [r["code"] / (n_levels - 1) for r in rows[arm] if r["correct"]]
        wrong = [r["code"] / (n_levels - 1) for r in rows[arm] if not r["correct"]]
        bins = [i / 20 for i in range(21)]
        for values, color, name in ((right, "#55a868", "right"), (wrong, "#c44e52", "wrong")):
            if values:       # an empty histogram with density=True divides by zero
                ax.hist(values, bins=bins, alpha=0.6, color=color, label=f"{name} ({len(values)})", density=True)
        ax.set_xlabel("answer code (largest of its tokens') / (L−1)  (normalised entropy)")
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def fmt(x, digits=3) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "—"
    return f"{x:.{digits}f}"


def table(summaries: dict) -> str:
    """The Markdown table of both arms (also printed by `prisma demo` and summarised in the README)."""
    lines = ["| arm | accuracy (answerable) | 'unknown' when unanswerable | a right answer when ambiguous | "
             "ECE | corr(code, error) | AUROC(code → wrong) | AURC |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for arm, title in ARMS:
        s = summaries[arm]
        lines.append(f"| {title} | {fmt(s['accuracy'])} | {fmt(s['accuracy_unanswerable'])} | "
                     f"{fmt(s['accuracy_ambiguous'])} | {fmt(s['ece'])} | {fmt(s['code_error_corr'])} | "
                     f"{fmt(s['auroc'])} | {fmt(s['aurc'])} |")
    return "\n".join(lines)


def flat_metrics(summaries: dict, extra: dict) -> dict:
    """metrics.json: the headline numbers flat (feedback arm unsuffixed, the other `_no_feedback`), then
    each arm's full summary."""
    out = {}
    keys = ("accuracy", "ece", "code_error_corr", "auroc", "aurc", "accuracy_unanswerable",
            "accuracy_ambiguous", "accuracy_all", "mean_confidence")
    for arm, suffix in (("feedback", ""), ("no_feedback", "_no_feedback")):
        for k in keys:
            out[k + suffix] = summaries[arm][k]
    out.update(extra)
    out["arms"] = summaries
    return out


def write_report(directory: str, summaries: dict, rows: dict, examples: dict, n_levels: int, extra: dict,
                 samples_text: str = "") -> dict:
    """metrics.json + report.md + PNGs into `directory`; returns the flat metrics."""
    os.makedirs(directory, exist_ok=True)
    metrics = flat_metrics(summaries, extra)
    with open(os.path.join(directory, "metrics.json"), "w") as f:
        json.dump(json_safe(metrics), f, indent=2, sort_keys=False)
    titled = {title: summaries[arm] for arm, title in ARMS}
    plots.plot_reliability(titled, os.path.join(directory, "reliability.png"))
    plots.plot_risk_coverage(titled, os.path.join(directory, "risk_coverage.png"))
    plot_traces(examples, n_levels, os.path.join(directory, "traces.png"))
    plot_code_hist(rows, n_levels, os.path.join(directory, "codes.png"))
    s = summaries["feedback"]
    md = [
        "# Prisma-VL demo: calibration report",
        "",
        f"A tiny Prisma-VL trained from scratch on a synthetic visual QA task (coloured shapes on a 2×2 grid), "
        f"evaluated on {s['n']} held-out questions with greedy decoding. Two arms with the same data, seed and "
        f"steps: the uncertainty table trained (the Prisma mechanism) and frozen at zero (plain Qwen3-VL).",
        "",
        table(summaries),
        "",
        "Each arm is one `prisma eval` run (`eval_<arm>/`: answers.jsonl with every answer's per-token trace, "
        "metrics.json, plots); docs/eval.md defines the metrics.",
        "",
        "- *accuracy (answerable)*: exact answer on questions the scene determines (the goal is ≥ 0.90).",
        "- *confidence*: the probability the model gave its whole answer (product over its tokens); "
        "*ECE*: expected calibration error over all held-out questions, 10 equal-width bins, "
        "where an answer is right when it equals the question's label (for ambiguous questions the label is "
        "one right answer drawn at random, so 1/k is the calibrated confidence).",
        "- *corr(code, error)*: Pearson correlation between the answer's code (the largest among its tokens) "
        "and error (positive: high codes go with wrong answers); *AUROC*: how well the code alone "
        "separates wrong answers from right ones (0.5 = not at all); *AURC*: area under the risk–coverage "
        "curve when the model abstains above a code threshold (lower is better).",
        "",
        f"Wall time {extra.get('wall_time_s', float('nan')):.0f} s "
        f"(training {extra.get('train_time_s', {}).get('feedback', float('nan')):.0f} s + "
        f"{extra.get('train_time_s', {}).get('no_feedback', float('nan')):.0f} s, "
        f"{extra.get('steps', '?')} steps each).",
        "",
        "## Reliability diagrams",
        "",
        "![reliability](reliability.png)",
        "",
        "## Risk–coverage (abstaining when the answer's code is above τ)",
        "",
        "![risk-coverage](risk_coverage.png)",
        "",
        "## Per-token uncertainty traces (green: right answer, red: wrong)",
        "",
        "![traces](traces.png)",
        "",
        "## Answer codes, right vs wrong",
        "",
        "![codes](codes.png)",
        "",
    ]
    if samples_text:
        md += ["## Sample answers", "", "```", samples_text, "```", ""]
    with open(os.path.join(directory, "report.md"), "w") as f:
        f.write("\n".join(md))
    return metrics
