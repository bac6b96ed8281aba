"""A server in a background thread of this process, on a free 127.0.0.1 port: for tests, benchmarks and
notebooks (`prisma serve` runs uvicorn in the main thread instead, where it can catch SIGTERM).

    server = LocalServer.start(model, processor, name="tiny", slots=4, max_len=512)   # Engine keywords
    server.url, server.engine
    server.close()                       # drains like SIGTERM: in-flight requests finish, the engine stops
"""
from __future__ import annotations

import socket
import threading
import time


class LocalServer:
    def __init__(self, app, engine=None, drain_timeout: float = 30.0):
        import uvicorn

        self.app, self.engine = app, engine
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=drain_timeout))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the server did not start")
            time.sleep(0.02)

    @classmethod
    def start(cls, model, processor, name: str = "model", image_root: str | None = None, app_kw: dict | None = None,
              **engine_kw):
        """An Engine over `model` (a PrismaVL; `engine_kw`: slots, max_len, steps, max_queue, ...) behind the
        app, serving `name` (`app_kw`: create_app's limits, api_key, loopback_only, warmup)."""
        from prisma_jax.infer.serve.app import create_app
        from prisma_jax.infer.serve.engine import Engine

        engine = Engine(model, **engine_kw).start()
        return cls(create_app(engine, processor, name, image_root, **(app_kw or {})), engine)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(120)
        self.sock.close()
        if self.thread.is_alive():
            raise RuntimeError("the server did not stop")
