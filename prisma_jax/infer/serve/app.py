"""The HTTP side of `prisma serve`: OpenAI's chat and text completion endpoints on FastAPI, over the engine.

    POST /v1/chat/completions   messages (text and image_url parts), stream, logprobs / top_logprobs, usage
    POST /v1/completions        prompt (text or token ids), stream, logprobs (alternatives per token), usage
    GET  /v1/models             the one model served
    GET  /health                liveness: 200 {"status": "ok", "slots", "busy", "queued", ...}; 503 once the engine is dead
    GET  /ready                 readiness: 503 while `--warmup` compiles (or the engine is dead), then 200

Every choice, and every stream chunk's choice, carries `uncertainty: {"codes": [...], "entropies": [...]}` beside
`logprobs`: for each token it carries, the uint16 code of the distribution the token was drawn from and that
distribution's entropy in nats (docs/introspection-contract.md §2, §5; docs/serve.md).

One bad request cannot take the server down (docs/serve.md, "Limits"):
- **Bounded before any work.** The gate (`_Gate`, every request) answers a wrong Host (the server bound to
  loopback), a missing or wrong API key, a POST that is not `application/json` and a body over `--max-body`
  before the body is read; then the JSON's depth and every field's range, the number of images and each image's
  bytes, format and pixels are checked before anything is decoded (protocol.py, images.py); a full queue is a
  429 before any tokenization or image work.
- **The event loop never blocks.** Tokenization, image decoding and processing run in a pool of worker threads,
  each with its own `Processor` (a fast tokenizer must not be used from two threads at once), and the event
  loop detokenizes incrementally with its own copy of the tokenizer (output.py).
- **Failures are loud and bounded.** Every wait for the engine has a deadline (`--request-timeout`, 504); a
  request that ends in any way — finished, failed, timed out, cancelled, its client gone — frees its slot; a
  dead engine turns `/health` into 503 and fails every request at once (engine.py's watchdog).
- **Errors never echo internal exception text.** Each response carries `X-Request-Id`; error bodies carry the
  same id, and the details go to the log under it.
- **No compile while serving.** Every image is resized to one of a few grids with the same number of patches
  (`images.image_buckets`), so a request's programs depend only on its prompt bucket and its number of images;
  `--warmup` compiles them all before /ready says yes.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import copy
import dataclasses
import hmac
import ipaddress
import json
import logging
import threading
import time
import uuid

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from prisma_jax.infer.generate import bucket
from prisma_jax.infer.serve import images as IM
from prisma_jax.infer.serve.engine import Closed, Dead, Engine, Failed, QueueFull
from prisma_jax.infer.serve.output import Output, Piece
from prisma_jax.infer.serve.protocol import APIError, Params, bad, load_json, parse_chat, parse_completion

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ServeLimits:
    """What one request may ask for; each limit names its `prisma serve` flag in its error."""
    max_body: int = 64 << 20              # --max-body: bytes of a request body (413 above)
    max_images: int = 8                   # --max-images: images per request
    max_image_bytes: int = IM.MAX_IMAGE_BYTES   # --max-image-bytes: bytes per image (files and data: URLs)
    max_image_pixels: int | None = None   # --max-image-pixels: decoded width × height (None: 4 × the processor's max_pixels)
    image_tokens: int = 1024              # --image-tokens: tokens per served image (its bucket grids' size)
    request_timeout: float = 600.0        # --request-timeout: seconds a request may wait for the engine
    encode_workers: int = 2               # threads that tokenize and process images


class _Disconnected(Exception):
    pass


class _Job:
    """One request between the engine thread (which calls `sink`) and its handler (which awaits `next`)."""

    def __init__(self, request: Request, output: Output, deadline: float):
        self.request, self.output, self.deadline = request, output, deadline
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.watch: asyncio.Task | None = None
        self.handle = None

    def sink(self, event) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, event)

    async def _disconnect(self) -> None:
        while (await self.request.receive())["type"] != "http.disconnect":
            pass

    def _timeout(self) -> APIError:
        return APIError(504, "the request took longer than the server's --request-timeout", None, "timeout",
                        "server_error")

    async def next(self, watch: bool = True):
        """The next engine event. Raises _Disconnected if the client leaves first (`watch`), and a 504 APIError
        past the deadline; the caller frees the slot."""
        if watch and self.watch is None:
            self.watch = asyncio.ensure_future(self._disconnect())
        get = asyncio.ensure_future(self.queue.get())
        left = self.deadline - time.monotonic()
        await asyncio.wait({get} | ({self.watch} if watch else set()), timeout=max(left, 0),
                           return_when=asyncio.FIRST_COMPLETED)
        if get.done():
            return get.result()
        get.cancel()
        if watch and self.watch.done():
            raise _Disconnected
        raise self._timeout()

    def unwatch(self) -> None:
        if self.watch is not None:
            self.watch.cancel()
            self.watch = None

    def cancel(self) -> None:
        self.unwatch()
        if self.handle is not None:
            self.handle.cancel()


class Server:
    def __init__(self, engine: Engine, processor, model_name: str, image_root: str | None = None,
                 limits: ServeLimits = ServeLimits()):
        self.engine, self.proc, self.model_name, self.image_root = engine, processor, model_name, image_root
        self.limits = limits
        self.created = int(time.time())
        self.ready = False                      # /ready: after --warmup
        # each encoding thread has its own Processor; the event loop has its own tokenizer for detokenization
        self._local = threading.local()
        self.pool = concurrent.futures.ThreadPoolExecutor(limits.encode_workers, thread_name_prefix="prisma-encode")
        self._detok = copy.deepcopy(processor.tokenizer)
        self.buckets, self.patch, max_pixels = served_image_grids(processor, limits.image_tokens)
        self.image_limits = IM.ImageLimits(max_bytes=limits.max_image_bytes,
                                           max_pixels=limits.max_image_pixels or 4 * max_pixels)

    def processor(self):
        """This thread's own Processor (a copy per encoding thread)."""
        p = getattr(self._local, "proc", None)
        if p is None:
            p = self._local.proc = copy.deepcopy(self.proc)
        return p

    async def in_pool(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    # ------------------------------------------------------------------------------------------ inputs
    def check_model(self, p: Params) -> None:
        if p.model != self.model_name:
            raise bad(f"the model {p.model!r} does not exist; this server serves {self.model_name!r}", "model",
                      "model_not_found")

    def check_images(self, messages: list[dict]) -> None:
        n = sum(part["type"] == "image_url" for m in messages for part in m["content"])
        if n > self.limits.max_images:
            raise bad(f"the request has {n} images; this server takes at most {self.limits.max_images} "
                      "(--max-images)", "messages")
        if n and self.buckets is None:
            raise bad("this model's checkpoint has no image processor: images are not accepted", "messages")

    def encode_chat(self, messages: list[dict]):
        conv = []
        for i, m in enumerate(messages):
            parts = []
            for j, part in enumerate(m["content"]):
                if part["type"] == "text":
                    parts.append(part)
                else:
                    img = IM.load_image_url(part["url"], self.image_root, f"messages[{i}].content[{j}]",
                                            self.image_limits)
                    parts.append({"type": "image", "image": IM.bucket_image(img, self.buckets, self.patch)})
            conv.append({"role": m["role"], "content": parts})
        try:
            enc = self.processor()(messages=[conv])
        except ValueError as e:
            raise bad(str(e), "messages") from None
        return enc["input_ids"][0], enc.get("pixel_values"), enc.get("image_grid_thw")

    def encode_text(self, prompt):
        vocab = self.engine.cfg.text.vocab_size
        if isinstance(prompt, list):
            if max(prompt) >= vocab:
                raise bad(f"'prompt' token ids must be in [0, {vocab}) (the model's vocabulary)", "prompt")
            return np.asarray(prompt, np.int64), None, None
        ids = self.processor().tokenizer(prompt, add_special_tokens=False)["input_ids"]
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
        return self._detok.decode([int(i) for i in ids], skip_special_tokens=True)

    def token_text(self, tid: int) -> str:
        return self._detok.decode([int(tid)], skip_special_tokens=False)

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

    async def run(self, request: Request, kind: str, enc, p: Params, param: str, rid: str):
        deadline = time.monotonic() + self.limits.request_timeout
        plan = await self.in_pool(self.plan, *enc, p, param)
        job = _Job(request, Output(self.decode, p.stop), deadline)
        try:
            job.handle = self.engine.submit(plan, job.sink, p.top_logprobs)
        except QueueFull as e:
            raise APIError(429, str(e), None, "rate_limit_exceeded", "rate_limit_error") from None
        except (Closed, Dead) as e:
            raise APIError(503, str(e), None, "server_unavailable", "server_error") from None
        n_prompt = len(enc[0])
        cid = ("chatcmpl-" if kind == "chat" else "cmpl-") + rid
        streaming = False
        try:
            first = await job.next()
            if isinstance(first, Failed):
                raise _engine_error(first, rid)
            if p.stream:
                job.unwatch()                  # StreamingResponse watches for the disconnect from here on
                streaming = True
                return StreamingResponse(self._sse(kind, cid, job, first, p, n_prompt, rid),
                                         media_type="text/event-stream")
            event = first
            while True:
                if isinstance(event, Failed):
                    raise _engine_error(event, rid)
                job.output.add(event)
                if job.output.finish or event.finish:
                    break
                event = await job.next()
        except _Disconnected:
            return Response(status_code=499)
        finally:
            if not streaming:
                job.cancel()                   # ended in any way (a stop string, an error, cancelled): free the slot
        out = job.output
        whole = Piece(out.ids, out.codes, out.entropies, out.logprobs, out.top, out.text,
                      out.finish or event.finish)
        body = self.envelope(kind, cid, False) | {"choices": [self.choice(kind, whole, p, 0, False, True)],
                                                  "usage": _usage(n_prompt, len(out.ids))}
        return JSONResponse(body)

    async def _sse(self, kind: str, cid: str, job: _Job, event, p: Params, n_prompt: int, rid: str):
        data = lambda obj: f"data: {json.dumps(obj)}\n\n"                # noqa: E731
        first, offset = True, 0
        try:
            while True:
                if isinstance(event, Failed):
                    yield data(_engine_error(event, rid).body(rid))
                    break
                piece = job.output.add(event)
                finish = piece.finish or event.finish
                piece.finish = finish
                yield data(self.envelope(kind, cid, True) | {"choices": [self.choice(kind, piece, p, offset, True,
                                                                                     first)]})
                offset += len(piece.text)
                first = False
                if finish:
                    if p.include_usage:
                        yield data(self.envelope(kind, cid, True) | {"choices": [],
                                                                     "usage": _usage(n_prompt, len(job.output.ids))})
                    break
                try:
                    event = await job.next(watch=False)
                except APIError as e:
                    log.warning("request %s: %s", rid, e.message)
                    yield data(e.body(rid))
                    break
            yield "data: [DONE]\n\n"
        finally:
            job.cancel()                       # the client left, a stop string ended it, or it timed out

    # ------------------------------------------------------------------------------------------ warm-up
    def warmup(self) -> int:
        """Compile every program a request can need (each prompt bucket × number of images × with and without
        top logprobs; each attention window) by running one tiny request of each shape; then /ready says yes.
        Returns the number of requests run."""
        eng, cfg = self.engine, self.engine.cfg
        filler = next(t for t in range(cfg.text.vocab_size) if t not in (cfg.image_token_id, cfg.video_token_id))
        shapes = []
        for n_img in range(self.limits.max_images + 1 if self.buckets else 1):
            msgs = [{"role": "user", "content": [{"type": "image", "image": _blank(self.buckets[0], self.proc)}
                                                 for _ in range(n_img)] + [{"type": "text", "text": "hi"}]}]
            enc = self.processor()(messages=[msgs])
            ids, pv, grid = enc["input_ids"][0], enc.get("pixel_values"), enc.get("image_grid_thw")
            p = bucket(len(ids), eng.prompt_floor)
            while p <= bucket(eng.max_len, eng.prompt_floor):
                length = min(p, eng.max_len) - max(eng.steps, 2)
                if len(ids) <= length:
                    shapes.append((np.concatenate([np.full(length - len(ids), filler), ids]), pv, grid))
                p *= 2
        done = threading.Semaphore(0)
        for ids, pv, grid in shapes:
            for top in (0, 1):
                plan = eng.check(ids, pv, grid, 2)
                eng.submit(plan, lambda ev: done.release() if isinstance(ev, Failed) or ev.finish else None, top)
                done.acquire()
                if eng.failure is not None:
                    raise RuntimeError(f"warm-up: {eng.failure}")
        self.ready = True
        return 2 * len(shapes)


def _blank(grid: tuple[int, int], proc):
    from PIL import Image

    side = proc.image_processor.patch_size
    return Image.new("RGB", (grid[1] * side, grid[0] * side))


def served_image_grids(processor, image_tokens: int = ServeLimits.image_tokens):
    """(the grids every served image is resized to, the patch size, the processor's max_pixels); (None, None,
    2^24) for a processor without images. The grids hold at most `image_tokens` tokens and the processor's
    max_pixels. A served image is `images.bucket_image(img, grids, patch)`."""
    ip = getattr(processor, "image_processor", None)
    if ip is None:
        return None, None, 1 << 24
    lo, hi = _pixel_range(ip)
    budget = min(hi, image_tokens * (ip.patch_size * ip.merge_size) ** 2)
    return IM.image_buckets(ip.patch_size, ip.merge_size, budget, min_pixels=lo), ip.patch_size, hi


def _pixel_range(ip) -> tuple[int, int]:
    """(min_pixels, max_pixels) of a Qwen2-VL image processor (transformers 5 keeps them in `size` as
    shortest_edge / longest_edge; 4.x as attributes)."""
    size = getattr(ip, "size", None)
    get = (lambda k: size.get(k) if isinstance(size, dict) else getattr(size, k, None))   # noqa: E731
    lo = getattr(ip, "min_pixels", None) or get("shortest_edge") or 0
    hi = getattr(ip, "max_pixels", None) or get("longest_edge")
    return int(lo), int(hi)


def _usage(n_prompt: int, n_out: int) -> dict:
    return {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out}


def _engine_error(ev: Failed, rid: str) -> APIError:
    log.error("request %s: the engine failed: %s: %s", rid, type(ev.error).__name__, ev.error)
    if isinstance(ev.error, Dead):
        return APIError(503, "the engine is down; the server is restarting", None, "server_unavailable",
                        "server_error")
    return APIError(500, "the engine failed on this request", None, "engine_error", "server_error")


def is_loopback(host: str | None) -> bool:
    """Whether a host name or address is loopback (localhost, 127.0.0.0/8, ::1)."""
    if host in ("localhost", None):
        return host is not None
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class _Gate:
    """Every request, before the app reads it: a request id (the `X-Request-Id` header of the response, in its
    error body and its log lines), and the refusals that need no body: a Host that is not loopback when the
    server is bound to loopback (DNS rebinding), a missing or wrong API key (`/v1/`), a POST that is not JSON,
    a body over `--max-body` (by its Content-Length; the endpoint counts a chunked one)."""

    def __init__(self, app, api_key: str | None, loopback_only: bool, max_body: int):
        self.app, self.api_key, self.loopback_only, self.max_body = app, api_key, loopback_only, max_body

    def refuse(self, scope) -> APIError | None:
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        if self.loopback_only:
            host = headers.get("host", "")
            name = (host.rsplit(":", 1)[0] if not host.endswith("]") else host).lower().rstrip(".")
            if not is_loopback(name):
                return APIError(403, f"Host {host!r} refused: this server is bound to loopback and answers only "
                                     "loopback names", None, "invalid_host")
        if self.api_key is not None and scope["path"].startswith("/v1/"):
            auth = headers.get("authorization", "")
            if not auth.startswith("Bearer "):
                return APIError(401, "You didn't provide an API key. Provide it in an Authorization header "
                                     "(Authorization: Bearer YOUR_KEY).", None, "invalid_api_key")
            if not _same(auth[len("Bearer "):], self.api_key):
                return APIError(401, "Incorrect API key provided.", None, "invalid_api_key")
        if scope["method"] == "POST":
            kind = headers.get("content-type", "").split(";")[0].strip().lower()
            if kind != "application/json":
                return APIError(415, f"the body must be application/json, got {kind or 'no content type'!r}",
                                None, "unsupported_media_type")
            length = headers.get("content-length")
            if length is not None and (not length.isdigit() or int(length) > self.max_body):
                return _too_large(self.max_body)
        return None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        rid = uuid.uuid4().hex[:24]
        scope.setdefault("state", {})["rid"] = rid

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), (b"x-request-id", rid.encode())]
            await send(message)

        err = self.refuse(scope)
        if err is not None:
            log.info("request %s: %s %s refused: %d %s", rid, scope["method"], scope["path"], err.status, err.message)
            return await JSONResponse(err.body(rid), status_code=err.status)(scope, receive, send_with_id)
        await self.app(scope, receive, send_with_id)


def _same(a: str, b: str) -> bool:
    return hmac.compare_digest(a.encode(), b.encode())


def _too_large(limit: int) -> APIError:
    return APIError(413, f"the request body is larger than {limit} bytes (--max-body)", None, "request_too_large")


async def _read_body(request: Request, limit: int) -> bytes:
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


def create_app(engine: Engine, processor, model_name: str, image_root: str | None = None,
               drain_timeout: float = 30.0, limits: ServeLimits = ServeLimits(), api_key: str | None = None,
               loopback_only: bool = False, warmup: bool = False):
    """The app over a started engine (an ASGI app: FastAPI behind the gate). Shutting it down stops the engine
    (in-flight requests get `drain_timeout` seconds to finish). `loopback_only`: refuse Host headers that are
    not loopback names (set when the server is bound to loopback). `warmup`: compile every request shape in a
    background thread first; /ready answers 503 until it is done."""
    server = Server(engine, processor, model_name, image_root, limits)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        if warmup:
            def warm():
                try:
                    t0 = time.perf_counter()
                    n = server.warmup()
                    log.info("warm-up: %d requests in %.1f s; ready", n, time.perf_counter() - t0)
                except Exception:       # noqa: BLE001 — /ready stays 503; the log says why
                    log.exception("warm-up failed")
            threading.Thread(target=warm, name="prisma-serve-warmup", daemon=True).start()
        else:
            server.ready = True
        yield
        await asyncio.get_running_loop().run_in_executor(None, engine.stop, drain_timeout)
        server.pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="prisma serve", lifespan=lifespan)
    app.state.server = server

    def rid_of(request) -> str:
        return request.scope.get("state", {}).get("rid", "-")

    @app.exception_handler(APIError)
    async def api_error(request, e: APIError):
        if e.status >= 500:
            log.warning("request %s: %d %s", rid_of(request), e.status, e.message)
        return JSONResponse(e.body(rid_of(request)), status_code=e.status)

    @app.exception_handler(HTTPException)
    async def http_error(request, e: HTTPException):
        return JSONResponse(APIError(e.status_code, str(e.detail), type="invalid_request_error").body(rid_of(request)),
                            status_code=e.status_code)

    @app.exception_handler(Exception)
    async def internal_error(request, e: Exception):
        rid = rid_of(request)
        log.error("request %s: internal error", rid, exc_info=e)
        return JSONResponse(APIError(500, "internal error", type="server_error").body(rid), status_code=500)

    @app.get("/health")
    async def health():
        if not engine.alive:
            return JSONResponse({"status": "dead", "reason": engine.failure}, status_code=503)
        return {"status": "ok", **engine.load()}

    @app.get("/ready")
    async def ready():
        if not engine.alive:
            return JSONResponse({"status": "dead", "reason": engine.failure}, status_code=503)
        if not server.ready:
            return JSONResponse({"status": "warming up"}, status_code=503)
        return {"status": "ready"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": server.created,
                                            "owned_by": "prisma-jax"}]}

    def endpoint(kind: str, parse, encode, param: str):
        async def handle(request: Request):
            rid = rid_of(request)
            prompt, p = parse(load_json(await _read_body(request, limits.max_body)))
            server.check_model(p)
            if kind == "chat":
                server.check_images(prompt)
            if not engine.can_accept():         # before any tokenization or image work
                if not engine.alive or engine.closing:
                    raise APIError(503, "the server is not taking requests", None, "server_unavailable",
                                   "server_error")
                raise APIError(429, f"the queue is full ({engine.max_queue} requests wait for a slot)", None,
                               "rate_limit_exceeded", "rate_limit_error")
            enc = await server.in_pool(getattr(server, encode), prompt)
            t0 = time.perf_counter()
            response = await server.run(request, kind, enc, p, param, rid)
            log.info("request %s: %s, %d prompt tokens, %.3f s", rid, kind, len(enc[0]), time.perf_counter() - t0)
            return response
        return handle

    app.post("/v1/chat/completions")(endpoint("chat", parse_chat, "encode_chat", "messages"))
    app.post("/v1/completions")(endpoint("text", parse_completion, "encode_text", "prompt"))
    gate = _Gate(app, api_key, loopback_only, limits.max_body)
    gate.state, gate.router = app.state, app.router        # what callers read off the app (tests, uvicorn)
    return gate
