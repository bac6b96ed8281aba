"""The `prisma` command line. Each subcommand lives in the module that owns its concern and registers itself
through `add_parser(subparsers)`; this file only dispatches and turns user errors into one clear line.
"""
from __future__ import annotations

import argparse
import importlib
import sys

# module paths, each with `add_parser(subparsers)` that sets `func` on its parser
COMMANDS = [
    "prisma_jax.apps.counts",
    "prisma_jax.apps.convert_cli",
    "train.cli",
    "prisma_jax.apps.plan",
    "prisma_jax.apps.demo.run",
    "prisma_jax.apps.generate_cli",
    "prisma_jax.apps.evaluation.cli",
    "prisma_jax.apps.serve_cli",
]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="prisma", description="Prisma-VL in JAX")
    sub = parser.add_subparsers(dest="command", required=True)
    for mod in COMMANDS:
        importlib.import_module(mod).add_parser(sub)
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, OSError, KeyError) as e:   # user errors: one line, no traceback
        msg = e.args[0] if isinstance(e, KeyError) and e.args else e
        print(f"prisma {args.command}: error: {msg}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
