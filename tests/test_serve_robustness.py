"""`prisma serve` under trouble: a full queue (429), a client that leaves mid-stream (its slot is freed), an
exception inside the engine (500 for the requests it concerns, the rest served and equal to `generate`),
and SIGTERM (in-flight requests finish, new connections are refused, exit 0)."""
import concurrent.futures as cf
import json
import os
import signal
import subprocess
import sys

import httpx
import pytest

from prisma_jax import PrismaVL
from prisma_jax.host.processing import Processor
from serve_helpers import agreement, free_port, pieces_of, make_checkpoint, solo, start, wait_until as _wait

MSGS = [{"role": "user", "content": "w1 w2 w3"}]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = make_checkpoint(str(tmp_path_factory.mktemp("serve")))
    return d, PrismaVL.from_pretrained(d), Processor.from_pretrained(d)


def _chat(url, max_tokens=8, stream=False, **kw):
    return httpx.post(url + "/v1/chat/completions", timeout=120,
                      json={"model": "tiny", "messages": MSGS, "max_tokens": max_tokens, "temperature": 0,
                            "stream": stream, **kw})


def test_full_queue_429_and_a_disconnect_frees_the_slot(ckpt):
    _, model, proc = ckpt
    server, engine = start(model, proc, slots=1, max_len=1024, steps=2, max_queue=0)
    try:
        with httpx.Client(timeout=120) as c:
            with c.stream("POST", server.url + "/v1/chat/completions",
                          json={"model": "tiny", "messages": MSGS, "max_tokens": 1000, "temperature": 0,
                                "stream": True}) as r:
                assert r.status_code == 200
                lines = r.iter_lines()
                assert next(lines).startswith("data: {")               # the one slot is busy
                busy = _chat(server.url)                               # and nothing may wait: 429
                assert busy.status_code == 429 and busy.json()["error"]["code"] == "rate_limit_exceeded"
                assert engine.load()["busy"] == 1
            # the client left after one chunk: the slot is free long before 1000 tokens
        _wait(lambda: engine.load()["busy"] == 0)
        load = engine.load()
        assert load["cancelled"] == 1 and load["finished"] == 0 and load["rounds"] < 1000 // 2 // 2
        r = _chat(server.url, max_tokens=8)
        assert r.status_code == 200
        assert r.json()["choices"][0]["uncertainty"]["codes"] == solo(model, proc, MSGS, max_tokens=8)[1]
    finally:
        server.close()


def test_an_engine_exception_fails_only_the_requests_it_concerns(ckpt):
    _, model, proc = ckpt
    server, engine = start(model, proc, slots=2, max_len=96, steps=2)
    admit, advance = engine._admit, engine._advance
    faults = {"admit": 0, "advance": 0}

    def bad_admit(cfg, spec, params, slots, i, batch, *rest):
        if batch.input_ids.shape[1] > 32 and faults["admit"] == 0:      # the one long prompt fails at prefill
            faults["admit"] += 1
            raise RuntimeError("injected prefill fault")
        return admit(cfg, spec, params, slots, i, batch, *rest)

    def bad_advance(*args):
        if faults["advance"] == 1:
            faults["advance"] += 1
            raise RuntimeError("injected decode fault")
        return advance(*args)

    engine._admit, engine._advance = bad_admit, bad_advance
    try:
        long_msgs = [{"role": "user", "content": "w5 " * 40}]
        with cf.ThreadPoolExecutor(3) as pool:
            failing = pool.submit(lambda: httpx.post(server.url + "/v1/chat/completions", timeout=120, json={
                "model": "tiny", "messages": long_msgs, "max_tokens": 4, "temperature": 0}))
            fine = [pool.submit(_chat, server.url, 6) for _ in range(2)]
            r = failing.result()
            assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
            assert r.json()["error"]["code"] == "engine_error" and "injected" not in r.text   # details: the log
            ref = solo(model, proc, MSGS, max_tokens=6)[1]
            for f in fine:
                assert f.result().status_code == 200 and f.result().json()["choices"][0]["uncertainty"]["codes"] == ref
        # a decode step fails: every request live in that step gets a 500, then the engine serves on
        faults["advance"] = 1
        with cf.ThreadPoolExecutor(2) as pool:
            hit = [pool.submit(_chat, server.url, 6) for _ in range(2)]
            codes = [f.result().status_code for f in hit]
        assert 500 in codes and set(codes) <= {200, 500} and faults["advance"] == 2
        after = _chat(server.url, max_tokens=6)
        assert after.status_code == 200 and after.json()["choices"][0]["uncertainty"]["codes"] == ref
        assert httpx.get(server.url + "/health").json()["failed"] == 1 + codes.count(500)
    finally:
        server.close()


def test_sigterm_drains_in_flight_requests_and_exits_0(ckpt):
    d, model, proc = ckpt
    # the prompt whose greedy answer runs longest without an end token (the request must still be decoding
    # when SIGTERM comes)
    prompts = [[{"role": "user", "content": f"w{i} w{i + 1}"}] for i in range(1, 40, 7)]
    msgs, ref = max(((m, solo(model, proc, m, max_tokens=100)) for m in prompts), key=lambda mr: len(mr[1][0]))
    assert len(ref[0]) > 50
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "prisma_jax.apps.cli", "serve", "--model", d, "--port", str(port), "--slots", "1",
           "--max-len", "128", "--steps", "1", "--served-model-name", "tiny", "--drain-timeout", "60",
           "--log-level", "warning"]
    server = subprocess.Popen(cmd, env={**os.environ, "JAX_PLATFORMS": "cpu"}, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT)
    try:
        def up():
            assert server.poll() is None, server.stdout.read().decode()
            try:
                return httpx.get(url + "/health", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False
        _wait(up, 120)
        with httpx.Client(timeout=120) as c, c.stream("POST", url + "/v1/chat/completions", json={
                "model": "tiny", "messages": msgs, "max_tokens": 100, "temperature": 0, "stream": True,
                "logprobs": True}) as r:
            lines = r.iter_lines()
            first = next(lines)
            assert httpx.get(url + "/health", timeout=5).json()["busy"] == 1        # still decoding
            server.send_signal(signal.SIGTERM)

            def refused():             # the listening socket closes at once (a connection in its backlog is reset)
                try:
                    httpx.get(url + "/health", timeout=1)
                    return False
                except (httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError):
                    return True
            _wait(refused, 10)
            rest = [x for x in lines if x.startswith("data: ")]
        chunks = [json.loads(x[6:]) for x in [first] + rest[:-1]]
        assert rest[-1] == "data: [DONE]" and chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
        codes = [x for ch in chunks for x in ch["choices"][0]["uncertainty"]["codes"]]
        pieces = [e["token"] for ch in chunks for e in ch["choices"][0]["logprobs"]["content"]]
        assert len(codes) == len(pieces) > 50                           # the in-flight request finished in full
        agreement(pieces_of(proc, ref[0]), ref[1], ref[2], pieces, codes)
        assert server.wait(60) == 0
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


@pytest.mark.parametrize("argv,message", [(["--slots", "0"], "--slots must be ≥ 1"),
                                          (["--max-len", "0"], "--max-len must be ≥ 1"),
                                          (["--image-root", "/no/such/dir"], "not a directory")])
def test_serve_cli_bad_arguments_are_one_line(ckpt, capsys, argv, message):
    from prisma_jax.apps.cli import main

    assert main(["serve", "--model", ckpt[0], *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("prisma serve: error:") and message in err and "\n" not in err
