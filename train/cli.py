"""`prisma train --config CONFIG.yaml [--steps N] [--workdir DIR] [section.key=value ...]`.

Runs (or resumes, when DIR holds checkpoints) the loop of train/loop.py; prints one summary line at the end.
Exit codes: 0 done (or stopped by SIGTERM, saved), 2 a user error (config, data, workdir), 3 stopped because
training went non-finite (`train.max_bad_steps` skipped steps in a row, or non-finite params; nothing non-finite
saved): a pod job can tell "fix the run" from "fix the input".
"""
from __future__ import annotations

import os
import sys

NONFINITE_EXIT = 3   # the run went non-finite (train.loop.NonFiniteError); 2 is a user error (prisma_jax/apps/cli.py)


def _run(args) -> int:
    from train.config import load_train_config
    from train.loop import NonFiniteError, run

    cfg, _ = load_train_config(args.config, args.overrides)
    workdir = args.workdir or os.path.join("runs", os.path.splitext(os.path.basename(args.config))[0])
    try:
        last = run(cfg, workdir, stop_at=args.steps, progress=not args.no_progress)
    except NonFiniteError as e:
        print(f"prisma train: error: {e}", file=sys.stderr)
        return NONFINITE_EXIT
    if last:
        print(f"step {last['step']}: loss {last['loss']:.4f}, {last['tokens_per_sec']:.0f} tokens/s "
              f"(metrics in {os.path.join(workdir, 'metrics.jsonl')})")
    return 0


def add_parser(sub):
    p = sub.add_parser("train", help="fine-tune with introspection (optax, grain, Orbax); resumes from --workdir")
    p.add_argument("--config", required=True, help="training YAML (model/train/optimizer/data/checkpoint)")
    p.add_argument("--steps", type=int, default=None,
                   help="stop after global step N (default train.steps; the schedule is train.steps')")
    p.add_argument("--workdir", default=None, help="checkpoints + metrics (default runs/<config name>)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("overrides", nargs="*", metavar="section.key=value", help="config overrides")
    p.set_defaults(func=_run)
