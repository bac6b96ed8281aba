"""`prisma eval`: a checkpoint's greedy answers to a JSONL file of questions, scored for accuracy, calibration
and selective prediction by the answers' uncertainty codes (docs/eval.md).

    items.py     the JSONL item format, read and checked on the host
    answers.py   greedy answers in batches of one shape, each with its per-token trace (tokens, codes, probabilities)
    metrics.py   exact match, ECE and reliability bins, AUROC and Pearson of code against error, risk–coverage
                 and AURC (NumPy only)
    plots.py     reliability.png and risk_coverage.png
    stats.py     across runs: mean ± t interval, paired t-test, exact sign-flip test (benchmarks/introspection.py)
    run.py       `evaluate(...)`: all of it into one output directory
    cli.py       the `prisma eval` subcommand

The demo (prisma_jax/demo) scores its two arms with `evaluate`.
"""
from prisma_jax.apps.evaluation.run import evaluate

__all__ = ["evaluate"]
