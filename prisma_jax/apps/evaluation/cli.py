"""`prisma eval`: a checkpoint's greedy answers to a JSONL file of questions, scored (docs/eval.md).

    prisma eval --model DIR --data FILE.jsonl --out DIR [--batch N] [--max-new-tokens N] [--mesh MESH]
                [--abstain-text TEXT]

Writes DIR/{answers.jsonl, metrics.json, reliability.png, risk_coverage.png}; DIR must not exist yet.
"""
from __future__ import annotations

import argparse

from prisma_jax.apps.evaluation.run import ABSTAIN_TEXT, BATCH, MAX_NEW_TOKENS


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("eval", help="score greedy answers: accuracy, ECE, AUROC and AURC of the codes",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="checkpoint directory, HF or Orbax (weights, tokenizer, processor)")
    p.add_argument("--data", required=True, help="JSONL items: messages, answer, answerable (docs/eval.md)")
    p.add_argument("--out", required=True, help="output directory (must not exist)")
    p.add_argument("--batch", type=int, default=BATCH, help=f"items generated at once (default {BATCH}; the last batch is padded)")
    p.add_argument("--max-new-tokens", type=int, default=MAX_NEW_TOKENS, help=f"per answer (default {MAX_NEW_TOKENS})")
    p.add_argument("--abstain-text", default=ABSTAIN_TEXT,
                   help="the expected answer of items with \"answerable\": false")
    from prisma_jax.apps.generate_cli import MESH_HELP
    p.add_argument("--mesh", default=None, help=MESH_HELP)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--no-verify", dest="verify", action="store_false",
                   help="an Orbax --model: skip checking the crc32s its conversion recorded")
    p.add_argument("--compilation-cache", default=None, metavar="DIR",
                   help="persist compiled programs here across runs")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    p.set_defaults(func=run)


def run(args) -> int:
    from prisma_jax.infer.generate import enable_compilation_cache
    from prisma_jax.apps.generate_cli import parse_mesh
    from prisma_jax.apps.evaluation.run import evaluate

    mesh = parse_mesh(args.mesh)
    if args.compilation_cache:
        enable_compilation_cache(args.compilation_cache)
    m = evaluate(args.model, args.data, args.out, batch=args.batch, max_new_tokens=args.max_new_tokens, mesh=mesh,
                 abstain_text=args.abstain_text, progress=args.progress, dtype=args.dtype, verify=args.verify)
    f = lambda x: "—" if x is None else f"{x:.3f}"                      # noqa: E731
    print(f"{m['n']} items ({m['n_answerable']} answerable): accuracy {f(m['accuracy'])}, all {f(m['accuracy_all'])}, "
          f"ECE {f(m['ece'])}, AUROC(code → wrong) {f(m['auroc'])}, corr(code, error) {f(m['code_error_corr'])}, "
          f"AURC {f(m['aurc'])}")
    print(f"wrote {args.out}/: answers.jsonl, metrics.json, reliability.png, risk_coverage.png")
    return 0
