"""`prisma serve` that one bad request cannot take down (docs/serve.md, "Limits"), in-process: the event loop
answers while the image processor is blocked, no compile after `--warmup` for any image size, faults in the
release path, a hung engine (watchdog: 503s, `on_fatal`), timeouts, disconnects before the stream, the gate
(API key, content type, Host, body size), bounded fields, and incremental detokenization against whole-text
decoding. Waits are on events and counters, each with a deadline against a hang."""
import concurrent.futures as cf
import logging
import signal
import threading

import httpx
import jax
import numpy as np
import openai
import pytest

from prisma_jax import PrismaVL
from prisma_jax.host.processing import Processor
from prisma_jax.infer.serve.app import ServeLimits
from prisma_jax.infer.serve.engine import Tokens
from prisma_jax.infer.serve.output import Output
from serve_helpers import data_url, make_checkpoint, solo, start, wait_until as _wait

MSGS = [{"role": "user", "content": "w1 w2 w3"}]
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = make_checkpoint(str(tmp_path_factory.mktemp("serve")))
    return d, PrismaVL.from_pretrained(d), Processor.from_pretrained(d)


def _chat(url, messages=MSGS, max_tokens=4, timeout=120, **kw):
    return httpx.post(url + "/v1/chat/completions", timeout=timeout,
                      json={"model": "tiny", "messages": messages, "max_tokens": max_tokens, "temperature": 0, **kw})


def _png(h, w, seed=0) -> str:
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 255, (h, w, 3), np.uint8)).save(buf, "PNG")
    return data_url(buf.getvalue())


def _image_msgs(url):
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": "w1 w2"}]}]


def test_the_event_loop_answers_while_the_image_processor_is_blocked(ckpt):
    _, model, proc = ckpt
    server, engine = start(model, proc, slots=2, max_len=96, steps=2)
    srv = server.app.state.server
    gate, inside = threading.Event(), threading.Event()
    encode = srv.encode_chat

    def blocked(messages):
        inside.set()
        assert gate.wait(120)
        return encode(messages)

    srv.encode_chat = blocked
    try:
        with httpx.Client(timeout=60) as c, cf.ThreadPoolExecutor(1) as pool:
            with c.stream("POST", server.url + "/v1/completions",
                          json={"model": "tiny", "prompt": "w1 w2", "max_tokens": 60, "temperature": 0,
                                "stream": True}) as stream:
                lines = stream.iter_lines()
                assert next(lines).startswith("data: {")
                pending = pool.submit(_chat, server.url, _image_msgs(_png(40, 50)))
                assert inside.wait(60)                  # the image request sits in the blocked processor ...
                assert c.get(server.url + "/health").json()["status"] == "ok"      # ... and /health answers
                got = [next(lines) for _ in range(6)]   # ... and the running stream goes on
                assert sum(x.startswith("data: {") for x in got) >= 3
                assert not pending.done()
                gate.set()
                assert pending.result(120).status_code == 200
    finally:
        gate.set()
        server.close()


def test_no_compile_after_warmup_for_16_image_sizes(ckpt):
    _, model, proc = ckpt
    server, engine = start(model, proc, slots=2, max_len=96, steps=2,
                           app_kw={"warmup": True, "limits": ServeLimits(max_images=1)})
    compiles = []
    try:
        assert httpx.get(server.url + "/health").status_code == 200           # alive while warming up
        _wait(lambda: httpx.get(server.url + "/ready").status_code == 200, 600)
        jax.monitoring.register_event_duration_secs_listener(
            lambda event, *a, **k: compiles.append(event) if event == COMPILE_EVENT else None)
        sizes = [(20 + 9 * i, 200 - 9 * i) for i in range(16)]                 # aspect ratios 0.1 ... 2.4
        for i, (h, w) in enumerate(sizes):
            r = _chat(server.url, _image_msgs(_png(h, w, i)), max_tokens=3, logprobs=bool(i % 2),
                      top_logprobs=2 if i % 2 else None)
            assert r.status_code == 200, r.text
        r = _chat(server.url, [{"role": "user", "content": " ".join(f"w{i}" for i in range(40))}], max_tokens=3)
        assert r.status_code == 200
        assert compiles == []
    finally:
        jax.monitoring.clear_event_listeners()
        server.close()


def test_a_fault_in_the_release_path_fails_only_the_live_requests(ckpt):
    _, model, proc = ckpt
    server, engine = start(model, proc, slots=2, max_len=512, steps=2)
    release, calls = engine._release, []

    def bad_release(slots, i):
        calls.append(int(i))
        if len(calls) == 1:
            raise RuntimeError("injected release fault")
        return release(slots, i)

    engine._release = bad_release
    try:
        with httpx.Client(timeout=60) as c:
            with c.stream("POST", server.url + "/v1/completions",
                          json={"model": "tiny", "prompt": "w1", "max_tokens": 400, "temperature": 0,
                                "stream": True}) as kept:
                kept_lines = kept.iter_lines()
                assert next(kept_lines).startswith("data: {")
                with c.stream("POST", server.url + "/v1/completions",
                              json={"model": "tiny", "prompt": "w2", "max_tokens": 400, "temperature": 0,
                                    "stream": True}) as left:
                    assert next(left.iter_lines()).startswith("data: {")
                # the second client left: releasing its slot fails, so the live one fails with it, loudly
                rest = [x for x in kept_lines if x]
                assert any('"engine_error"' in x for x in rest) and rest[-1] == "data: [DONE]"
        _wait(lambda: engine.load()["busy"] == 0, 60)
        assert calls and engine.alive
        r = _chat(server.url)                           # and the engine serves on
        assert r.status_code == 200
        assert r.json()["choices"][0]["uncertainty"]["codes"] == solo(model, proc, MSGS, max_tokens=4)[1]
    finally:
        server.close()


def test_a_hung_engine_fails_every_request_and_says_so(ckpt):
    _, model, proc = ckpt
    fatal, hang = [], threading.Event()
    server, engine = start(model, proc, slots=1, max_len=128, steps=2, max_queue=4, on_fatal=fatal.append)
    advance = engine._advance

    def hung(*args):
        hang.wait(300)
        return advance(*args)

    try:
        assert _chat(server.url, MSGS, 20).status_code == 200        # compiled (the default allows for compiles)
        engine.stall_timeout, engine._advance = 1.0, hung
        with cf.ThreadPoolExecutor(3) as pool:
            futures = [pool.submit(_chat, server.url, MSGS, 20) for _ in range(3)]   # one in flight, two queued
            answers = [f.result(120) for f in futures]
        assert [a.status_code for a in answers] == [503] * 3
        assert all(a.json()["error"]["code"] == "server_unavailable" for a in answers)
        assert len(fatal) == 1 and "no progress" in fatal[0]
        h = httpx.get(server.url + "/health")
        assert h.status_code == 503 and h.json()["status"] == "dead"
        assert httpx.get(server.url + "/ready").status_code == 503
        assert _chat(server.url).status_code == 503
    finally:
        hang.set()
        server.close()


def test_timeouts_and_a_disconnect_before_the_stream_free_the_slot(ckpt):
    _, model, proc = ckpt
    server, engine = start(model, proc, slots=1, max_len=128, steps=2,
                           app_kw={"limits": ServeLimits(request_timeout=2.0)})
    admit, hold = engine._admit, threading.Event()

    def slow_admit(*args):
        hold.wait(120)
        return admit(*args)

    engine._admit = slow_admit
    try:
        r = _chat(server.url)                                       # waits past --request-timeout: 504
        assert r.status_code == 504 and r.json()["error"]["code"] == "timeout"
        with pytest.raises(httpx.ReadTimeout):                      # a client that leaves before its first chunk
            with httpx.stream("POST", server.url + "/v1/chat/completions", timeout=1.0,
                              json={"model": "tiny", "messages": MSGS, "max_tokens": 50, "stream": True}) as s:
                next(s.iter_lines())
        hold.set()
        _wait(lambda: engine.load()["busy"] == 0 and engine.load()["queued"] == 0, 60)
        assert _chat(server.url).status_code == 200
        assert engine.load()["busy"] == 0
    finally:
        hold.set()
        server.close()


def test_the_gate_and_the_bounds(ckpt):
    _, model, proc = ckpt
    server, engine = start(model, proc, slots=1, max_len=128, steps=2,
                           app_kw={"api_key": "sesame", "loopback_only": True,
                                   "limits": ServeLimits(max_body=200_000, max_images=1)})
    url, key = server.url, {"Authorization": "Bearer sesame"}

    def post(json_body=None, headers=key, path="/v1/chat/completions", **kw):
        return httpx.post(url + path, json=json_body, headers=headers, timeout=60, **kw)

    body = {"model": "tiny", "messages": MSGS, "max_tokens": 2, "temperature": 0}
    try:
        # the official client, with and without the key
        ok = openai.OpenAI(base_url=url + "/v1", api_key="sesame", max_retries=0).chat.completions.create(
            model="tiny", messages=MSGS, max_tokens=2, temperature=0)
        assert ok.choices[0].message.content is not None
        with pytest.raises(openai.AuthenticationError) as e:
            openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).chat.completions.create(
                model="tiny", messages=MSGS, max_tokens=2)
        assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
        assert post(body, headers={}).status_code == 401
        assert httpx.get(url + "/health").status_code == 200                # probes need no key
        # the content type, the Host, the body size
        r = httpx.post(url + "/v1/chat/completions", data={"a": "b"}, headers=key)
        assert r.status_code == 415
        r = post(body, headers={**key, "Host": "evil.example:8000"})
        assert r.status_code == 403 and r.json()["error"]["code"] == "invalid_host"
        assert post(body, headers={**key, "Host": "localhost:1234"}).status_code == 200
        r = post({**body, "pad": "x" * 300_000})
        assert r.status_code == 413 and "--max-body" in r.json()["error"]["message"]
        # depth, ranges, token ids, images
        deep = "[" * 100_000 + "]" * 100_000
        r = httpx.post(url + "/v1/completions", content=deep, headers={**key, "content-type": "application/json"})
        assert r.status_code == 413 or (r.status_code == 400 and "nested" in r.json()["error"]["message"])
        r = httpx.post(url + "/v1/completions", content="[" * 50 + "]" * 50,
                       headers={**key, "content-type": "application/json"})
        assert r.status_code == 400 and "nested deeper than 32" in r.json()["error"]["message"]
        for field, value in (("top_k", 2**31), ("seed", 2**63), ("max_tokens", 2**40)):
            r = post({**body, field: value})
            assert r.status_code == 400 and r.json()["error"]["param"] == field, (field, r.text)
        for prompt in ([2**63], [127, 128], [-1]):
            r = post({"model": "tiny", "prompt": prompt, "max_tokens": 2}, path="/v1/completions")
            assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", (prompt, r.text)
        two = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": _png(32, 32)}}] * 2}]
        r = post({**body, "messages": two})
        assert r.status_code == 400 and "--max-images" in r.json()["error"]["message"]
        # request ids: the header, the error body, distinct per request; no exception text in a 500
        r = post({**body, "temperature": -1})
        assert r.status_code == 400 and r.json()["error"]["request_id"] == r.headers["x-request-id"]
        srv = server.app.state.server
        srv.encode_chat = lambda m: (_ for _ in ()).throw(KeyError("secret internals"))
        r = post(body)
        assert r.status_code == 500 and "secret" not in r.text and r.json()["error"]["message"] == "internal error"
        assert r.json()["error"]["request_id"] == r.headers["x-request-id"]
        assert engine.load()["busy"] == 0
    finally:
        server.close()


def test_a_full_queue_is_429_before_any_tokenization(ckpt):
    _, model, proc = ckpt
    server, engine = start(model, proc, slots=1, max_len=1024, steps=2, max_queue=0)
    srv = server.app.state.server
    encoded = []
    encode = srv.encode_chat
    srv.encode_chat = lambda m: encoded.append(1) or encode(m)
    try:
        with httpx.Client(timeout=60) as c:
            with c.stream("POST", server.url + "/v1/completions",
                          json={"model": "tiny", "prompt": "w1", "max_tokens": 900, "stream": True,
                                "temperature": 0}) as s:
                assert next(s.iter_lines()).startswith("data: {")
                r = _chat(server.url, _image_msgs(_png(64, 96)))
                assert r.status_code == 429 and encoded == []
        _wait(lambda: engine.load()["busy"] == 0, 60)
    finally:
        server.close()


@pytest.mark.parametrize("stop", [[], ["w3 w4"], ["4 w5", "w9"], ["w1"]])
def test_incremental_detokenization_equals_decoding_the_whole_text(ckpt, stop):
    """Output.add, token by token in uneven events, against decoding every id at once and cutting at the first
    stop string (what the server did before it detokenized incrementally)."""
    _, _, proc = ckpt
    rng = np.random.default_rng(len(stop))
    ids = rng.integers(9, 128, 80).tolist()
    ids[30:35] = proc.tokenizer("w3 w4 w5", add_special_tokens=False)["input_ids"] + [2, 7]   # specials too
    decode = lambda t: proc.tokenizer.decode(t, skip_special_tokens=True)                 # noqa: E731
    out, shown, cuts = Output(decode, stop), "", [0, 3, 4, 11, 12, 30, 33, 34, 50, 80]
    for a, b in zip(cuts, cuts[1:]):
        n = b - a
        piece = out.add(Tokens(ids[a:b], [0] * n, [0.0] * n, [0.0] * n, [], "length" if b == 80 else None))
        shown += piece.text
        if out.finish:
            break
    whole = decode(ids)
    cut = min((i for i in (whole.find(s) for s in stop) if i >= 0), default=-1)
    assert out.text == shown == (whole if cut < 0 else whole[:cut])
    assert out.finish == ("stop" if cut >= 0 else "length")
    if cut >= 0:                               # the arrays end at the token that completed the stop string
        k = len(out.ids)
        assert any(x in decode(ids[:k]) for x in stop) and not any(x in decode(ids[:k - 1]) for x in stop)


def test_max_len_defaults_to_the_model(ckpt, capsys):
    """--max-len (and Engine's max_len) default to min(4096, max_position_embeddings): a model of 2,048
    positions serves without a flag."""
    import dataclasses

    from prisma_jax.infer.serve.engine import Engine, default_max_len

    _, model, _ = ckpt
    assert Engine(model).max_len == min(4096, model.config.text.max_position_embeddings)
    short = dataclasses.replace(model.config, text=dataclasses.replace(model.config.text,
                                                                       max_position_embeddings=2048))
    long = dataclasses.replace(model.config, text=dataclasses.replace(model.config.text,
                                                                      max_position_embeddings=32768))
    assert default_max_len(short) == 2048 and default_max_len(long) == 4096
    with pytest.raises(ValueError, match="exceeds the model's max_position_embeddings"):
        Engine(model, max_len=model.config.text.max_position_embeddings + 1)


def test_prisma_serve_exits_1_when_the_engine_dies(ckpt, monkeypatch, capsys):
    """`prisma serve`'s wiring: the engine's on_fatal stops uvicorn and the command returns 1 (a supervisor
    restarts it). uvicorn is replaced by a stand-in whose serving lets the engine die, as the watchdog does
    (uvicorn's own Config would reconfigure this process's logging)."""
    import threading as th

    import uvicorn

    from prisma_jax.apps.cli import main
    from prisma_jax.infer.serve import engine as E

    d, _, _ = ckpt
    seen = {}

    class Server:
        def __init__(self, config):
            self.should_exit = False

        def run(self):
            seen["before"] = self.should_exit
            seen["engine"]._die("a device call made no progress for 600 s")
            seen["after"] = self.should_exit

    real_start = E.Engine.start

    def start(self):
        seen["engine"] = self
        return real_start(self)

    monkeypatch.setattr(uvicorn, "Config", lambda *a, **k: None)
    monkeypatch.setattr(uvicorn, "Server", Server)
    monkeypatch.setattr(E.Engine, "start", start)
    monkeypatch.setattr(th, "Timer", lambda *a, **k: type("T", (), {"start": lambda self: None})())
    monkeypatch.setattr(signal, "signal", lambda *a: None)          # this process keeps its own handlers ...
    monkeypatch.setattr(logging, "basicConfig", lambda **k: None)   # ... and its logging
    try:
        assert main(["serve", "--model", d, "--port", "1", "--slots", "1"]) == 1
    finally:
        if "engine" in seen:
            seen["engine"].stop(5)
    assert seen["before"] is False and seen["after"] is True
    assert "the engine died (a device call made no progress for 600 s); exiting 1" in capsys.readouterr().out
