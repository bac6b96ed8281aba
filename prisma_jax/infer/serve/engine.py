"""Continuous batching: requests join and leave a fixed set of decode slots between rounds of K steps.

    engine = Engine(model, slots=8, max_len=4096, steps=K)      # model: a PrismaVL
    engine.start()
    handle = engine.submit(input_ids, sink=callback, max_new_tokens=64, temperature=0.0, ...)
    ...                                                        # callback(Tokens) per round, then Finished/Failed
    handle.cancel()                                            # frees the slot before the next round
    engine.stop(timeout)                                       # finish what is in flight, then end the thread

One thread owns the device. Each turn it drops cancelled requests, prefills waiting requests into free slots
(one at a time, with the request's own prompt bucket: `slots.admit`), then runs `slots.advance` — K steps of
every slot in one program and one host round trip — and hands each request the tokens its slot drew. A
request's tokens and codes are what `PrismaVL.generate` gives for it alone (greedy, or sampled with the same
seed): the same model calls and choices per row; float32 round-off differs with the shapes (slots, cache
window), which can move a code that lies on a level boundary by one (tests/test_serve_api.py).

The queue of waiting requests is bounded (`QueueFull`); after `stop` begins, `submit` raises `Closed`.
An exception in a device call fails the requests it concerns — the one being admitted, every live slot for a
step, the slot being released — with `Failed`, and the engine goes on (with fresh slots when the old ones
were lost). A watchdog thread checks that the engine thread is alive and that no device call has run longer
than `stall_timeout` (which allows for a call that compiles): otherwise the engine is dead — `failure` says
why, every queued and in-flight request gets `Failed` at once, `submit` raises `Dead`, and `on_fatal(reason)`
is called (`prisma serve` exits non-zero there, so that a supervisor restarts it).
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from typing import Callable

import jax
import numpy as np

from prisma_jax.infer import generate as G
from prisma_jax.nn.text import split_layers, unroll_default
from prisma_jax.infer.serve import slots as S

DEFAULT_STEPS = 4          # K: decode steps per host round trip (docs/benchmarks.md, "Serving")
WINDOW_FLOOR = 64          # smallest attention window of a round (a power of two)
MAX_LEN = 4096             # the default --max-len, or the model's max_position_embeddings if smaller
STALL_TIMEOUT = 600.0      # seconds one device call may take (a compile of the 8B included) before the engine is dead

log = logging.getLogger(__name__)


class QueueFull(RuntimeError):
    """The queue of waiting requests is at its bound."""


class Closed(RuntimeError):
    """The engine is stopping: no new requests."""


class Dead(RuntimeError):
    """The engine thread died or stopped making progress: no new requests (`Engine.failure` says why)."""


def default_max_len(cfg) -> int:
    """min(MAX_LEN, the model's max_position_embeddings)."""
    return min(MAX_LEN, cfg.text.max_position_embeddings)


@dataclasses.dataclass
class Tokens:
    """What one request's slot drew since the last event (per token: ids, codes, entropies in nats, logprobs,
    and the top alternatives' ids and logprobs when asked for). `finish`: None, "stop" (an end token) or
    "length" (max_new_tokens)."""
    ids: list[int]
    codes: list[int]
    entropies: list[float]
    logprobs: list[float]
    top: list[list[tuple[int, float]]]
    finish: str | None = None


@dataclasses.dataclass
class Failed:
    error: BaseException


@dataclasses.dataclass
class _Request:
    plan: G.Request
    top_logprobs: int
    sink: Callable
    shift: int = 0
    cancelled: bool = False
    slot: int | None = None
    count: int = 0
    ended: bool = False          # its last event (the finish, or Failed) was sent


class Handle:
    def __init__(self, engine: "Engine", req: _Request):
        self._engine, self._req = engine, req

    def cancel(self) -> None:
        """Stop this request: it leaves the queue, or frees its slot before the next round. Idempotent."""
        self._engine._cancel(self._req)


class Engine:
    def __init__(self, model, slots: int = 8, max_len: int | None = None, steps: int = DEFAULT_STEPS,
                 max_queue: int = 64, prompt_floor: int = 32, new_floor: int = 16, unroll_layers: bool | None = None,
                 introspection: bool = True, stall_timeout: float = STALL_TIMEOUT,
                 on_fatal: Callable[[str], None] | None = None):
        max_len = default_max_len(model.config) if max_len is None else max_len
        if slots < 1 or max_len < 2 or steps < 1 or max_queue < 0 or not stall_timeout > 0:
            raise ValueError(f"need slots ≥ 1, max_len ≥ 2, steps ≥ 1, max_queue ≥ 0; got {slots}, {max_len}, "
                             f"{steps}, {max_queue}")
        if max_len > model.config.text.max_position_embeddings:
            raise ValueError(f"max_len {max_len} exceeds the model's max_position_embeddings "
                             f"{model.config.text.max_position_embeddings}")
        self.model, self.cfg = model, model.config
        self.n_slots, self.max_len, self.steps, self.max_queue = int(slots), int(max_len), int(steps), int(max_queue)
        self.prompt_floor, self.new_floor = prompt_floor, new_floor
        unroll = unroll_default(unroll_layers)
        self.spec = S.ServeSpec(introspection=introspection, unroll_layers=unroll)
        # unrolled decode (CPU): the decoder layers as separate arrays, a copy made once (slots.advance)
        self._layers = split_layers(model.params) if unroll else None
        gc = model.generation_config
        self.default_eos = gc.get("eos_token_id")
        self.pad_id = gc.get("pad_token_id")
        self._cv = threading.Condition()
        self._queue: collections.deque[_Request] = collections.deque()
        self._live: dict[int, _Request] = {}
        self._closing = False
        self._thread: threading.Thread | None = None
        self._slots = None
        self.stall_timeout, self.on_fatal = float(stall_timeout), on_fatal
        self.failure: str | None = None         # why the engine is dead (None while it is alive)
        self._call_since: float | None = None   # when the device call in progress began
        self._admitting: _Request | None = None  # the request whose prefill is in progress
        self._stopped = threading.Event()
        self.stats = collections.Counter({k: 0 for k in ("admitted", "finished", "cancelled", "failed", "rounds",
                                                          "max_busy")})
        # the device programs (a test may wrap them to inject a fault)
        self._admit, self._advance, self._release = S.admit, S.advance, S.release

    # ------------------------------------------------------------------------------------------ public
    def start(self) -> "Engine":
        self._slots = self._fresh_slots()
        self._thread = threading.Thread(target=self._run, name="prisma-serve-engine", daemon=True)
        self._thread.start()
        threading.Thread(target=self._watch, name="prisma-serve-watchdog", daemon=True).start()
        return self

    @property
    def alive(self) -> bool:
        return self.failure is None

    @property
    def closing(self) -> bool:
        return self._closing

    def can_accept(self) -> bool:
        """Whether `submit` would take one more request now (checked before any tokenization or image work;
        `submit` decides again)."""
        with self._cv:
            return (self.failure is None and not self._closing
                    and len(self._queue) < self.max_queue + self.n_slots - len(self._live))

    def stop(self, timeout: float | None = None) -> bool:
        """Refuse new requests, let the queued and live ones finish (cancelled after `timeout` seconds), end
        the thread. True when everything finished in time."""
        with self._cv:
            self._closing = True
            self._cv.notify_all()
        if self._thread is None:
            return True
        self._thread.join(timeout)
        if self._thread.is_alive():
            with self._cv:
                for r in [*self._queue, *self._live.values()]:
                    r.cancelled = True
                self._cv.notify_all()
            self._thread.join(None if self.failure is None else 1.0)   # a hung device call is not waited for
            self._stopped.set()
            return False
        self._stopped.set()
        return True

    def load(self) -> dict:
        with self._cv:
            return {"slots": self.n_slots, "busy": len(self._live), "queued": len(self._queue),
                    **{k: int(v) for k, v in self.stats.items()}}

    # ------------------------------------------------------------------------------------------ watchdog
    def _watch(self) -> None:
        period = min(1.0, self.stall_timeout / 4)
        while not self._stopped.wait(period):
            since = self._call_since
            if self._thread is not None and not self._thread.is_alive() and not self._closing:   # (stop ends it)
                self._die("the engine thread ended unexpectedly")
            elif since is not None and time.monotonic() - since > self.stall_timeout:
                self._die(f"a device call made no progress for {self.stall_timeout:g} s")
            if self.failure is not None:
                return

    def _die(self, reason: str) -> None:
        """The engine cannot go on: fail every queued and in-flight request now, refuse new ones, tell the
        owner (`on_fatal`)."""
        with self._cv:
            if self.failure is not None:
                return
            self.failure = reason
            doomed = [*self._queue, *self._live.values(), *([self._admitting] if self._admitting else [])]
            self._queue.clear()
            self._live.clear()
            self._cv.notify_all()
        log.error("engine dead: %s; failing %d request(s)", reason, len(doomed))
        for r in doomed:
            self.stats["failed"] += 1
            self._emit(r, Failed(Dead(reason)))
        if self.on_fatal is not None:
            self.on_fatal(reason)

    def _device(self, fn, *args, fetch: bool = True):
        """A device call, timed by the watchdog: `fn(*args)` → (slots, what it emitted, fetched to the host), or
        the slots alone without `fetch`."""
        self._call_since = time.monotonic()
        try:
            if not fetch:
                return fn(*args)
            slots, out = fn(*args)
            return slots, jax.device_get(out)
        finally:
            self._call_since = None

    def check(self, input_ids, pixel_values=None, image_grid_thw=None, max_new_tokens: int = 16,
              temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
              uncertainty_power: float = 0.0, extra_eos=()) -> G.Request:
        """Validate a request (ValueError naming the problem) and plan it as `generate` would plan it alone,
        with the checkpoint's end tokens and `extra_eos`."""
        ids = np.asarray(input_ids)
        if ids.ndim != 1:
            raise ValueError(f"input_ids must be one prompt (1-D), got shape {ids.shape}")
        if isinstance(max_new_tokens, bool) or int(max_new_tokens) != max_new_tokens or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer ≥ 1, got {max_new_tokens}")
        if len(ids) + int(max_new_tokens) > self.max_len:
            raise ValueError(f"prompt length {len(ids)} + max_new_tokens {int(max_new_tokens)} exceeds the "
                             f"server's maximum length {self.max_len} (--max-len)")
        eos = [] if self.default_eos is None else list(np.ravel(self.default_eos))
        eos += [int(t) for t in extra_eos if int(t) not in eos]
        plan = G.request(self.cfg, G.Inputs(ids[None], None, pixel_values, image_grid_thw),
                         G.SamplingParams(temperature, top_k, top_p, uncertainty_power),
                         G.Options(max_new_tokens, seed, eos, self.pad_id, prompt_floor=self.prompt_floor,
                                   new_floor=self.new_floor, unroll_layers=self.spec.unroll_layers))
        if int((plan.eos >= 0).sum()) > S.MAX_END_IDS:
            raise ValueError(f"at most {S.MAX_END_IDS} end token ids per request")
        return plan

    def submit(self, plan: G.Request, sink: Callable, top_logprobs: int = 0) -> Handle:
        """Queue a checked request. `sink(event)` is called on the engine thread: `Tokens` per round (the last
        with `finish` set) or `Failed`. Raises QueueFull or Closed."""
        if not 0 <= top_logprobs <= S.MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs must be in [0, {S.MAX_TOP_LOGPROBS}], got {top_logprobs}")
        req = _Request(plan, int(top_logprobs), sink)
        p = plan.batch.input_ids.shape[1]
        req.shift = p - int(np.asarray(plan.batch.attention_mask)[0].sum())   # the prompt's left padding
        with self._cv:
            if self.failure is not None:
                raise Dead(f"the engine is dead: {self.failure}")
            if self._closing:
                raise Closed("the server is shutting down")
            if len(self._queue) >= self.max_queue + self.n_slots - len(self._live):
                raise QueueFull(f"the queue is full ({self.max_queue} requests wait for a slot)")
            self._queue.append(req)
            self._cv.notify_all()
        return Handle(self, req)

    # ------------------------------------------------------------------------------------------ engine thread
    def _fresh_slots(self):
        self._slots = None                     # the old buffers go before the new ones are made
        return S.init_slots(self.cfg, self.spec, self.n_slots, self.max_len, self.model.dtype)

    def _cancel(self, req: _Request) -> None:
        with self._cv:
            req.cancelled = True
            self._cv.notify_all()

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as e:     # noqa: BLE001 — whatever ends the thread ends the engine, loudly
            log.exception("the engine thread failed")
            self._die(f"the engine thread failed ({type(e).__name__})")

    def _loop(self) -> None:
        with self.model._precision(), self.model._on_mesh():
            while True:
                with self._cv:
                    while not (self._queue or self._live or self._closing or self.failure):
                        self._cv.wait()
                    if self.failure is not None:
                        return
                    self._queue = collections.deque(r for r in self._queue if not self._drop_cancelled(r))
                    cancelled = [r for r in self._live.values() if r.cancelled]
                    if self._closing and not self._queue and not self._live:
                        return
                for r in cancelled:
                    self._free(r, "cancelled")
                    try:
                        self._slots = self._device(self._release, self._slots, np.int32(r.slot), fetch=False)
                    except Exception as e:      # noqa: BLE001 — the slots may be lost: fail what they held
                        log.exception("releasing slot %d failed", r.slot)
                        self._fail_live(e)
                while self._queue and len(self._live) < self.n_slots:
                    with self._cv:
                        req = self._queue.popleft()
                    self._admit_one(req)
                if self._live:
                    self._round()

    def _drop_cancelled(self, r: _Request) -> bool:
        if r.cancelled:
            self.stats["cancelled"] += 1
        return r.cancelled

    def _free(self, r: _Request, outcome: str) -> None:
        with self._cv:
            self._live.pop(r.slot, None)
            self.stats[outcome] += 1

    def _spec(self) -> S.ServeSpec:
        want = any(r.top_logprobs for r in self._live.values())
        return self.spec._replace(top_logprobs=S.MAX_TOP_LOGPROBS if want else 0)

    def _admit_one(self, req: _Request) -> None:
        slot = next(i for i in range(self.n_slots) if i not in self._live)
        p = req.plan
        eos = np.full((S.MAX_END_IDS,), -1, np.int32)
        ids = p.eos[p.eos >= 0]
        eos[:len(ids)] = ids
        spec = self.spec._replace(top_logprobs=S.MAX_TOP_LOGPROBS if req.top_logprobs else 0)
        self._admitting = req
        try:
            self._slots, out = self._device(self._admit, self.cfg, spec, self.model.params, self._slots,
                                            np.int32(slot), p.batch, p.next_pos, p.sp, eos, p.max_new,
                                            jax.random.key(p.seed), np.int32(req.shift))
        except Exception as e:          # noqa: BLE001 — the request fails, the engine goes on
            log.exception("admitting a request failed")
            self.stats["failed"] += 1
            self._emit(req, Failed(e))
            self._recover()
            return
        finally:
            self._admitting = None
        if self.failure is not None:    # the watchdog gave up on this call meanwhile: the request has failed
            return
        req.slot = slot
        with self._cv:
            self._live[slot] = req
            self.stats["admitted"] += 1
            self.stats["max_busy"] = max(self.stats["max_busy"], len(self._live))
        self._deliver(req, out, 0)

    def _recover(self) -> None:
        """After a failed device call: if the slots' buffers were donated and lost, every live request fails
        and the slots start afresh."""
        if self._slots is not None and not any(getattr(x, "is_deleted", lambda: False)()
                                               for x in jax.tree.leaves(self._slots)):
            return
        self._fail_live(RuntimeError("the engine lost its decode state"))

    def _fail_live(self, error: BaseException) -> None:
        """Every live request fails with `error`; the slots start afresh."""
        for r in list(self._live.values()):
            self._free(r, "failed")
            self._emit(r, Failed(error))
        self._slots = self._fresh_slots()

    def _window(self) -> int:
        need = max(r.plan.batch.input_ids.shape[1] - r.shift + r.count - 1 + self.steps
                   for r in self._live.values())
        return min(self.max_len, G.bucket(need, WINDOW_FLOOR))

    def _round(self) -> None:
        try:
            self._slots, out = self._device(self._advance, self.cfg, self._spec(), self._window(), self.steps,
                                            self.model.params, self._layers, self._slots)
        except Exception as e:          # noqa: BLE001 — the live requests fail, the engine goes on
            log.exception("a decode round failed")
            self._fail_live(e)
            return
        if self.failure is not None:
            return
        self.stats["rounds"] += 1
        for slot, req in list(self._live.items()):
            self._deliver(req, out, slot)

    def _deliver(self, req: _Request, out: S.Emitted, row: int) -> None:
        live = np.asarray(out.live[row])
        n = int(live.sum())
        if n == 0 or req.cancelled:
            return
        sel = lambda a: np.asarray(a[row])[live]           # noqa: E731
        ids = sel(out.token).tolist()
        req.count += n
        p = req.plan
        finish = None
        if ids[-1] in p.eos[p.eos >= 0].tolist():
            finish = "stop"
        elif req.count >= int(p.max_new):
            finish = "length"
        top = []
        if req.top_logprobs:
            k = req.top_logprobs
            top = [list(zip(i[:k].tolist(), lp[:k].tolist())) for i, lp in zip(sel(out.top_ids), sel(out.top_logprobs))]
        if finish:
            self._free(req, "finished")
        self._emit(req, Tokens(ids, sel(out.code).tolist(), sel(out.entropy).tolist(), sel(out.logprob).tolist(),
                               top, finish))

    def _emit(self, req: _Request, event) -> None:
        if req.ended:                   # after a watchdog's Failed, a late round's tokens go nowhere
            return
        req.ended = isinstance(event, Failed) or bool(getattr(event, "finish", None))
        try:
            req.sink(event)
        except Exception:               # noqa: BLE001 — a receiver that is gone does not stop the engine
            req.cancelled = True
