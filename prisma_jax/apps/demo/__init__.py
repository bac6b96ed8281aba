"""The embedded demo (`prisma demo`): a synthetic visual QA task that trains a tiny Prisma-VL end to end on a
CPU and measures whether the uncertainty feedback improves calibration.

    dataset.py   scenes of coloured shapes, rendered with PIL; questions with answers correct by construction
    report.py    metrics.json, report.md and the matplotlib plots of both arms
    run.py       the orchestration and the `prisma demo` subcommand; each arm is scored by `prisma eval`'s
                 `prisma_jax.apps.evaluation.evaluate`

It composes the project's public commands (`prisma train`, `prisma convert`) and APIs (`build_tokenizer`,
`Processor`, `PrismaVL.generate`); it trains and generates with nothing of its own.
"""
