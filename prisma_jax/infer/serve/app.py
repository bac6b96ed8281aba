"""The HTTP side of `prisma serve`: OpenAI's chat and text completion endpoints on FastAPI, over the engine.

    POST /v1/chat/completions   messages (text and image_url parts), stream, logprobs / top_logprobs, usage
    POST /v1/completions        prompt (text or token ids), stream, logprobs (alternatives per token), usage
    GET  /v1/models             the one model served
    GET  /health                {"status": "ok", "slots", "busy", "queued", admitted, finished, ...}

Every choice, and every stream chunk's choice, carries `uncertainty: {"codes": [...], "entropies": [...]}` beside
`logprobs`: for each token it carries, the uint16 code of the distribution the token was drawn from and that
distribution's entropy in nats (docs/introspection-contract.md §2, §5; docs/serve.md).

Errors are OpenAI error objects: 400 for a bad request (the field named in `param`), 429 when the queue is full,
503 while shutting down, 500 when the engine failed this request. A client that disconnects cancels its request
(its slot is free for the next round). Tokenizer and image processor run in worker threads, one at a time.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
import uuid

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from prisma_jax.infer.serve.engine import Closed, Engine, Failed, QueueFull
from prisma_jax.infer.serve.images import load_image_url
from prisma_jax.infer.serve.output import Output, Piece
from prisma_jax.infer.serve.protocol import APIError, Params, bad, load_json, parse_chat, parse_completion


class _Disconnected(Exception):
    pass


class _Job:
    """One request between the engine thread (which calls `sink`) and its handler (which awaits `next`)."""

    def __init__(self, request: Request, output: Output):
        self.request, self.output = request, output
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.watch: asyncio.Task | None = None
        self.handle = None

    def sink(self, event) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, event)

    async def _disconnect(self) -> None:
        while (await self.request.receive())["type"] != "http.disconnect":
            pass

    async def next(self):
        """The next engine event; raises _Disconnected (and cancels the request) if the client leaves first."""
        if self.watch is None:
            self.watch = asyncio.ensure_future(self._disconnect())
        get = asyncio.ensure_future(self.queue.get())
        await asyncio.wait({get, self.watch}, return_when=asyncio.FIRST_COMPLETED)
        if get.done():
            return get.result()
        get.cancel()
        self.handle.cancel()
        raise _Disconnected

    def unwatch(self) -> None:
        if self.watch is not None:
            self.watch.cancel()
            self.watch = None


class Server:
    def __init__(self, engine: Engine, processor, model_name: str, image_root: str | None = None):
        self.engine, self.proc, self.model_name, self.image_root = engine, processor, model_name, image_root
        self.created = int(time.time())
        self._tok_lock = threading.Lock()       # a fast tokenizer must not be used from two threads at once

    # ------------------------------------------------------------------------------------------ inputs
    def check_model(self, p: Params) -> None:
        if p.model != self.model_name:
            raise bad(f"the model {p.model!r} does not exist; this server serves {self.model_name!r}", "model",
                      "model_not_found")

    def encode_chat(self, messages: list[dict]):
        conv = []
        for i, m in enumerate(messages):
            parts = []
            for j, part in enumerate(m["content"]):
                if part["type"] == "text":
                    parts.append(part)
                else:
                    img = load_image_url(part["url"], self.image_root, f"messages[{i}].content[{j}]")
                    parts.append({"type": "image", "image": img})
            conv.append({"role": m["role"], "content": parts})
        try:
            with self._tok_lock:
                enc = self.proc(messages=[conv])
        except ValueError as e:
            raise bad(str(e), "messages") from None
        return enc["input_ids"][0], enc.get("pixel_values"), enc.get("image_grid_thw")

    def encode_text(self, prompt):
        if isinstance(prompt, list):
            return np.asarray(prompt, np.int64), None, None
        with self._tok_lock:
            ids = self.proc.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        if not ids:
            raise bad("the prompt has no tokens", "prompt")
        return np.asarray(ids, np.int64), None, None

    def plan(self, ids, pv, grid, p: Params, param: str):
        n, limit = len(ids), self.engine.max_len
        max_new = p.max_tokens if p.max_tokens is not None else limit - n
        if n + max_new > limit or max_new < 1:
            raise bad(f"the prompt has {n} tokens and max_tokens is {max_new}: more than this server's maximum "
                      f"length {limit} (--max-len)", param, "context_length_exceeded")
        try:
            return self.engine.check(ids, pv, grid, max_new, p.temperature, p.top_k, p.top_p, p.seed,
                                     p.uncertainty_power, p.stop_token_ids)
        except ValueError as e:
            raise bad(str(e), "stop_token_ids" if "eos_token_id" in str(e) else param) from None

    # ------------------------------------------------------------------------------------------ text
    def decode(self, ids) -> str:
        with self._tok_lock:
            return self.proc.decode(ids)

    def token_text(self, tid: int) -> str:
        with self._tok_lock:
            return self.proc.tokenizer.decode([int(tid)], skip_special_tokens=False)

    def _entry(self, tid: int, lp: float) -> dict:
        s = self.token_text(tid)
        return {"token": s, "logprob": lp, "bytes": list(s.encode())}

    def logprobs(self, kind: str, piece: Piece, p: Params, offset: int):
        if not p.logprobs:
            return None
        if kind == "chat":
            return {"content": [{**self._entry(t, lp), "top_logprobs": [self._entry(i, x) for i, x in top]}
                                for t, lp, top in zip(piece.ids, piece.logprobs, piece.top or [[]] * len(piece.ids))]}
        tokens = [self.token_text(t) for t in piece.ids]
        offsets = list(np.cumsum([offset] + [len(s) for s in tokens])[:-1].tolist())
        tops = ([{self.token_text(i): x for i, x in top} for top in piece.top] if p.top_logprobs
                else None)
        return {"tokens": tokens, "token_logprobs": piece.logprobs, "top_logprobs": tops, "text_offset": offsets}

    # ------------------------------------------------------------------------------------------ responses
    def choice(self, kind: str, piece: Piece, p: Params, offset: int, stream: bool, first: bool) -> dict:
        c: dict = {"index": 0}
        if kind == "chat":
            if stream:
                c["delta"] = ({"role": "assistant"} if first else {}) | ({"content": piece.text} if piece.text else {})
            else:
                c["message"] = {"role": "assistant", "content": piece.text}
        else:
            c["text"] = piece.text
        c["logprobs"] = self.logprobs(kind, piece, p, offset)
        c["finish_reason"] = piece.finish
        c["uncertainty"] = {"codes": piece.codes, "entropies": piece.entropies}
        return c

    def envelope(self, kind: str, rid: str, stream: bool) -> dict:
        obj = {"chat": "chat.completion", "text": "text_completion"}[kind] + (".chunk" if stream and kind == "chat"
                                                                          else "")
        return {"id": rid, "object": obj, "created": int(time.time()), "model": self.model_name}

    async def run(self, request: Request, kind: str, enc, p: Params, param: str):
        plan = await run_in_threadpool(self.plan, *enc, p, param)
        job = _Job(request, Output(self.decode, p.stop))
        try:
            job.handle = self.engine.submit(plan, job.sink, p.top_logprobs)
        except QueueFull as e:
            raise APIError(429, str(e), None, "rate_limit_exceeded", "rate_limit_error") from None
        except Closed as e:
            raise APIError(503, str(e), None, "server_shutting_down", "server_error") from None
        n_prompt = len(enc[0])
        rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
        try:
            first = await job.next()
        except _Disconnected:
            return Response(status_code=499)
        if isinstance(first, Failed):
            raise _engine_error(first)
        if p.stream:
            job.unwatch()                      # StreamingResponse watches for the disconnect from here on
            return StreamingResponse(self._sse(kind, rid, job, first, p, n_prompt), media_type="text/event-stream")
        event = first
        try:
            while True:
                if isinstance(event, Failed):
                    raise _engine_error(event)
                job.output.add(event)
                if job.output.finish or event.finish:
                    break
                event = await job.next()
        except _Disconnected:
            return Response(status_code=499)
        finally:
            job.unwatch()
            job.handle.cancel()                # a stop string ended it early: the slot is freed
        out = job.output
        whole = Piece(out.ids, out.codes, out.entropies, out.logprobs, out.top, out.text,
                      out.finish or event.finish)
        body = self.envelope(kind, rid, False) | {"choices": [self.choice(kind, whole, p, 0, False, True)],
                                                  "usage": _usage(n_prompt, len(out.ids))}
        return JSONResponse(body)

    async def _sse(self, kind: str, rid: str, job: _Job, event, p: Params, n_prompt: int):
        data = lambda obj: f"data: {json.dumps(obj)}\n\n"                # noqa: E731
        first, offset = True, 0
        try:
            while True:
                if isinstance(event, Failed):
                    yield data(_engine_error(event).body())
                    break
                piece = job.output.add(event)
                finish = piece.finish or event.finish
                piece.finish = finish
                yield data(self.envelope(kind, rid, True) | {"choices": [self.choice(kind, piece, p, offset, True,
                                                                                     first)]})
                offset += len(piece.text)
                first = False
                if finish:
                    if p.include_usage:
                        yield data(self.envelope(kind, rid, True) | {"choices": [],
                                                                     "usage": _usage(n_prompt, len(job.output.ids))})
                    break
                event = await job.queue.get()
            yield "data: [DONE]\n\n"
        finally:
            job.handle.cancel()                # the client left, or a stop string ended it: free the slot


def _usage(n_prompt: int, n_out: int) -> dict:
    return {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out}


def _engine_error(ev: Failed) -> APIError:
    return APIError(500, f"the engine failed on this request: {type(ev.error).__name__}: {ev.error}", None,
                    "engine_error", "server_error")


def create_app(engine: Engine, processor, model_name: str, image_root: str | None = None,
               drain_timeout: float = 30.0) -> FastAPI:
    """The FastAPI app over a started engine; shutting the app down stops the engine (in-flight requests get
    `drain_timeout` seconds to finish)."""
    server = Server(engine, processor, model_name, image_root)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        await run_in_threadpool(engine.stop, drain_timeout)

    app = FastAPI(title="prisma serve", lifespan=lifespan)
    app.state.server = server

    @app.exception_handler(APIError)
    async def api_error(request, e: APIError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(HTTPException)
    async def http_error(request, e: HTTPException):
        return JSONResponse(APIError(e.status_code, str(e.detail), type="invalid_request_error").body(),
                            status_code=e.status_code)

    @app.exception_handler(Exception)
    async def internal_error(request, e: Exception):
        err = APIError(500, f"internal error: {type(e).__name__}: {e}", type="server_error")
        return JSONResponse(err.body(), status_code=500)

    @app.get("/health")
    async def health():
        return {"status": "ok", **engine.load()}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": server.created,
                                            "owned_by": "prisma-jax"}]}

    def endpoint(kind: str, parse, encode, param: str):
        async def handle(request: Request):
            prompt, p = parse(load_json(await request.body()))
            server.check_model(p)
            enc = await run_in_threadpool(encode, prompt)
            return await server.run(request, kind, enc, p, param)
        return handle

    app.post("/v1/chat/completions")(endpoint("chat", parse_chat, server.encode_chat, "messages"))
    app.post("/v1/completions")(endpoint("text", parse_completion, server.encode_text, "prompt"))
    return app
