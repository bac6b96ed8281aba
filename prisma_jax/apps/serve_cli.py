"""`prisma serve`: the model behind an OpenAI-compatible HTTP API (infer/serve/app.py), with continuous batching
(infer/serve/engine.py).

    prisma serve --model DIR [--host 127.0.0.1] [--port 8000] [--slots 8] [--max-len N] [--api-key KEY] [--warmup]

The tokenizer, chat template and image processor come from DIR, as for `prisma generate`. --max-len defaults
to min(4096, the model's max_position_embeddings). SIGTERM (or Ctrl-C) stops accepting connections, lets
in-flight requests finish for up to --drain-timeout seconds, and exits 0. If the engine dies or stops making
progress, every request ends with an error and the process exits 1, for a supervisor to restart it.
The limits, their flags and their errors: docs/serve.md.
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import threading

from conversion.staging import parse_bytes

API_KEY_ENV = "PRISMA_API_KEY"


def add_parser(subparsers) -> None:
    from prisma_jax.infer.serve.engine import DEFAULT_STEPS

    p = subparsers.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="checkpoint directory (weights, tokenizer, preprocessor)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--slots", type=int, default=8, help="requests decoded at once")
    p.add_argument("--max-len", type=int, default=None,
                   help="prompt + generated tokens per request (KV cache rows); default min(4096, the model's "
                        "max_position_embeddings)")
    p.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="decode steps per host round trip (K)")
    p.add_argument("--max-queue", type=int, default=64, help="requests that may wait for a slot; more get 429")
    p.add_argument("--served-model-name", default=None, help="the `model` clients name (default: DIR's name)")
    p.add_argument("--image-root", default=None, help="allow image paths under this directory (no other files)")
    p.add_argument("--drain-timeout", type=float, default=30.0, help="seconds in-flight requests get on SIGTERM")
    p.add_argument("--api-key", default=os.environ.get(API_KEY_ENV),
                   help=f"require 'Authorization: Bearer KEY' on /v1/ (default: ${API_KEY_ENV}; none: no auth)")
    p.add_argument("--max-body", type=parse_bytes, default="64MiB", help="largest request body (413 above)")
    p.add_argument("--max-images", type=int, default=8, help="images per request")
    p.add_argument("--max-image-bytes", type=parse_bytes, default="32MiB", help="bytes per image (files and data: URLs)")
    p.add_argument("--max-image-pixels", type=int, default=None,
                   help="decoded width × height per image, checked from its header (default 4 × the processor's "
                        "max_pixels)")
    p.add_argument("--image-tokens", type=int, default=1024,
                   help="tokens per served image: every image is resized to one of a few grids of this size "
                        "(at most the processor's max_pixels), so no image size compiles anything")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds a request may wait for the engine")
    p.add_argument("--stall-timeout", type=float, default=600.0,
                   help="seconds one device call may take (compiles included) before the engine counts as hung")
    p.add_argument("--warmup", action="store_true",
                   help="compile every request shape before /ready answers 200 (a new request then compiles nothing)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--no-verify", dest="verify", action="store_false",
                   help="an Orbax --model: skip checking the crc32s its conversion recorded")
    p.add_argument("--compilation-cache", default=None, metavar="DIR",
                   help="persist compiled programs here across runs")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.set_defaults(func=run)


def run(args) -> int:
    for name in ("slots", "steps", "port", "max_images", "image_tokens"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be ≥ 1, got {getattr(args, name)}")
    for name in ("max_len", "max_image_pixels"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be ≥ 1, got {getattr(args, name)}")
    for name in ("request_timeout", "stall_timeout", "drain_timeout"):
        if not getattr(args, name) > 0:
            raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")
    if args.image_root is not None and not os.path.isdir(args.image_root):
        raise ValueError(f"--image-root {args.image_root}: not a directory")
    if args.api_key is not None and not args.api_key.strip():
        raise ValueError(f"--api-key (or ${API_KEY_ENV}) is empty")
    import uvicorn

    from prisma_jax.api import PrismaVL
    from prisma_jax.host.processing import Processor
    from prisma_jax.infer.generate import enable_compilation_cache
    from prisma_jax.infer.serve.app import ServeLimits, create_app, is_loopback
    from prisma_jax.infer.serve.engine import Engine

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    proc = Processor.from_pretrained(args.model)
    if args.compilation_cache:
        enable_compilation_cache(args.compilation_cache)
    model = PrismaVL.from_pretrained(args.model, dtype=args.dtype, verify=args.verify)
    fatal: list[str] = []
    server = None

    def on_fatal(reason: str) -> None:          # the engine is dead: stop serving, exit 1 (a supervisor restarts)
        fatal.append(reason)
        if server is not None:
            server.should_exit = True
        threading.Timer(args.drain_timeout + 5.0, os._exit, (1,)).start()   # if the shutdown itself hangs

    engine = Engine(model, slots=args.slots, max_len=args.max_len, steps=args.steps, max_queue=args.max_queue,
                    stall_timeout=args.stall_timeout, on_fatal=on_fatal)
    name = args.served_model_name or os.path.basename(os.path.normpath(args.model))
    limits = ServeLimits(max_body=args.max_body, max_images=args.max_images, max_image_bytes=args.max_image_bytes,
                         max_image_pixels=args.max_image_pixels, image_tokens=args.image_tokens,
                         request_timeout=args.request_timeout)
    app = create_app(engine.start(), proc, name, args.image_root, args.drain_timeout, limits, args.api_key,
                     loopback_only=is_loopback(args.host), warmup=args.warmup)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=args.drain_timeout)
    # uvicorn drains on SIGTERM / SIGINT, then raises the signal again once its own handlers are gone: these
    # make that a no-op, so that a drained server exits 0.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    server = uvicorn.Server(config)
    server.run()
    if fatal:
        print(f"prisma serve: the engine died ({fatal[0]}); exiting 1", flush=True)
        return 1
    return 0
