"""`prisma serve`: the model behind an OpenAI-compatible HTTP API (app.py), with continuous batching (engine.py).

    prisma serve --model DIR [--host 127.0.0.1] [--port 8000] [--slots 8] [--max-len 4096]

The tokenizer, chat template and image processor come from DIR, as for `prisma generate`. SIGTERM (or
Ctrl-C) stops accepting connections, lets in-flight requests finish for up to --drain-timeout seconds, and
exits 0.
"""
from __future__ import annotations

import argparse
import os
import signal


def add_parser(subparsers) -> None:
    from prisma_jax.infer.serve.engine import DEFAULT_STEPS

    p = subparsers.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="checkpoint directory (weights, tokenizer, preprocessor)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--slots", type=int, default=8, help="requests decoded at once")
    p.add_argument("--max-len", type=int, default=4096, help="prompt + generated tokens per request (KV cache rows)")
    p.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="decode steps per host round trip (K)")
    p.add_argument("--max-queue", type=int, default=64, help="requests that may wait for a slot; more get 429")
    p.add_argument("--served-model-name", default=None, help="the `model` clients name (default: DIR's name)")
    p.add_argument("--image-root", default=None, help="allow image paths under this directory (no other files)")
    p.add_argument("--drain-timeout", type=float, default=30.0, help="seconds in-flight requests get on SIGTERM")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--no-verify", dest="verify", action="store_false",
                   help="an Orbax --model: skip checking the crc32s its conversion recorded")
    p.add_argument("--compilation-cache", default=None, metavar="DIR",
                   help="persist compiled programs here across runs")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.set_defaults(func=run)


def run(args) -> int:
    for name in ("slots", "max_len", "steps", "port"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be ≥ 1, got {getattr(args, name)}")
    if args.image_root is not None and not os.path.isdir(args.image_root):
        raise ValueError(f"--image-root {args.image_root}: not a directory")
    import uvicorn

    from prisma_jax.api import PrismaVL
    from prisma_jax.infer.generate import enable_compilation_cache
    from prisma_jax.host.processing import Processor
    from prisma_jax.infer.serve.app import create_app
    from prisma_jax.infer.serve.engine import Engine

    proc = Processor.from_pretrained(args.model)
    if args.compilation_cache:
        enable_compilation_cache(args.compilation_cache)
    model = PrismaVL.from_pretrained(args.model, dtype=args.dtype, verify=args.verify)
    engine = Engine(model, slots=args.slots, max_len=args.max_len, steps=args.steps, max_queue=args.max_queue)
    name = args.served_model_name or os.path.basename(os.path.normpath(args.model))
    app = create_app(engine.start(), proc, name, args.image_root, args.drain_timeout)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=args.drain_timeout)
    # uvicorn drains on SIGTERM / SIGINT, then raises the signal again once its own handlers are gone: these
    # make that a no-op, so that a drained server exits 0.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    uvicorn.Server(config).run()
    return 0
