"""`prisma serve`: continuous batching behind an OpenAI-compatible HTTP API, with each token's uncertainty.

    slots.py     the device side: decode slots, admit / advance / release programs
    engine.py    the host loop: queue, admission, rounds of K steps, events per request
    protocol.py  OpenAI request bodies, checked; error objects
    images.py    image URLs (data: or under --image-root) → PIL, no network
    output.py    tokens → text, stop strings, the per-token arrays
    app.py       FastAPI routes, SSE streaming, disconnects
    cli.py       `prisma serve` (uvicorn, SIGTERM drain)
    local.py     the same app in a background thread on a free loopback port (tests, benchmarks)

docs/serve.md describes the API and the engine.
"""
from prisma_jax.infer.serve.engine import Closed, Engine, Failed, QueueFull, Tokens

__all__ = ["Closed", "Engine", "Failed", "QueueFull", "Tokens"]
