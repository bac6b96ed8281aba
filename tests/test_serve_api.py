"""`prisma serve` through the official `openai` client, against `PrismaVL.generate` on each request alone: chat
with an image (non-streaming and streaming), text completions, 32 concurrent requests of mixed lengths and
sampling parameters, and every kind of bad request."""
import concurrent.futures as cf

import httpx
import numpy as np
import openai
import pytest

from prisma_jax import PrismaVL
from prisma_jax.host.processing import Processor
from serve_helpers import agreement, data_url, make_checkpoint, pieces_of, png_bytes, solo, start

EOS = 2          # <|im_end|>, the checkpoint's end token


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    d = make_checkpoint(str(tmp_path_factory.mktemp("serve")))
    model, proc = PrismaVL.from_pretrained(d), Processor.from_pretrained(d)
    server, engine = start(model, proc, slots=4, max_len=96, steps=4, max_queue=64)
    yield model, proc, server, engine
    server.close()


def _client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _check(proc, ref, text, codes, entropies, finish, pieces) -> bool:
    """The served answer against the solo run (serve_helpers.agreement); True when equal to the end."""
    tokens = ref[0]
    n = agreement(pieces_of(proc, tokens), ref[1], ref[2], pieces, codes)
    np.testing.assert_allclose(entropies[:n], ref[2][:n], atol=1e-5, rtol=0)
    if n < len(tokens):
        return False
    assert text == proc.decode(tokens)
    assert finish == ("stop" if tokens[-1] == EOS else "length")
    return True


def test_chat_with_an_image_streaming_or_not_equals_generate(served):
    model, proc, server, _ = served
    png = png_bytes(0)
    url = data_url(png)
    messages = [{"role": "system", "content": "w7 w8"},
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": "w1 w2 w3"}]}]
    ref = solo(model, proc, messages, images={url: png}, max_tokens=12)
    client = _client(server)
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0,
                                       logprobs=True, top_logprobs=3)
    ch = r.choices[0]
    unc = ch.model_extra["uncertainty"]
    _check(proc, ref, ch.message.content, unc["codes"], unc["entropies"], ch.finish_reason,
           [e.token for e in ch.logprobs.content])
    assert r.usage.completion_tokens == len(ref[0]) and r.usage.prompt_tokens == ref[3]
    assert r.usage.total_tokens == ref[3] + len(ref[0])
    for e in ch.logprobs.content:                  # greedy: the chosen token is the most likely one
        assert [t.token for t in e.top_logprobs][0] == e.token and len(e.top_logprobs) == 3
        assert e.logprob == pytest.approx(e.top_logprobs[0].logprob) and e.logprob <= 0
        assert np.all(np.diff([t.logprob for t in e.top_logprobs]) <= 0)

    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0,
                                                 logprobs=True, stream=True, stream_options={"include_usage": True}))
    choices = [c.choices[0] for c in chunks if c.choices]
    assert choices[0].delta.role == "assistant" and len(choices) >= 12 // 4     # one chunk per round of K = 4
    text = "".join(c.delta.content or "" for c in choices)
    codes = [x for c in choices for x in c.model_extra["uncertainty"]["codes"]]
    ents = [x for c in choices for x in c.model_extra["uncertainty"]["entropies"]]
    pieces = [e.token for c in choices for e in c.logprobs.content]
    _check(proc, ref, text, codes, ents, choices[-1].finish_reason, pieces)
    assert all(c.finish_reason is None for c in choices[:-1])
    assert chunks[-1].usage.completion_tokens == len(ref[0]) and not chunks[-1].choices


def test_text_completions_models_and_health(served):
    model, proc, server, _ = served
    client = _client(server)
    ref = solo(model, proc, prompt="w3 w4 w5 w6", max_tokens=9)
    r = client.completions.create(model="tiny", prompt="w3 w4 w5 w6", max_tokens=9, temperature=0, logprobs=2)
    ch = r.choices[0]
    _check(proc, ref, ch.text, ch.model_extra["uncertainty"]["codes"], ch.model_extra["uncertainty"]["entropies"],
           ch.finish_reason, ch.logprobs.tokens)
    assert [len(t) for t in ch.logprobs.top_logprobs] == [2] * len(ref[0])
    chunks = list(client.completions.create(model="tiny", prompt="w3 w4 w5 w6", max_tokens=9, temperature=0,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks) == ch.text        # the same engine run twice: the same bits
    assert [x for c in chunks for x in c.choices[0].model_extra["uncertainty"]["codes"]] == \
        ch.model_extra["uncertainty"]["codes"]
    assert [m.id for m in client.models.list().data] == ["tiny"]
    health = httpx.get(server.url + "/health").json()
    assert health["status"] == "ok" and health["slots"] == 4 and health["busy"] == 0


def test_stop_strings_and_stop_token_ids(served):
    model, proc, server, _ = served
    client = _client(server)
    msgs = [{"role": "user", "content": "w9 w10 w11"}]
    free = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=16, temperature=0, logprobs=True)
    pieces = [e.token for e in free.choices[0].logprobs.content]
    codes = free.choices[0].model_extra["uncertainty"]["codes"]
    ids = proc.tokenizer.convert_tokens_to_ids(pieces)
    assert len(ids) == 16 and EOS not in ids
    # an end id the answer meets at its 5th token: it ends there, as `generate` with that end token
    r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=16, temperature=0,
                                       extra_body={"stop_token_ids": [ids[4]]})
    n = ids.index(ids[4]) + 1
    got = r.choices[0].model_extra["uncertainty"]["codes"]
    assert r.choices[0].finish_reason == "stop" and got == codes[:n] and r.usage.completion_tokens == n
    ref = solo(model, proc, msgs, max_tokens=16, eos_token_id=[EOS, ids[4]])
    if agreement(ref[0], ref[1], ref[2], ids[:n], got) == n:
        assert len(ref[0]) == n
    # a stop string: the text ends before it, the trace at the token that completed it
    word = pieces[3]
    full = proc.decode(ids)
    k = next(j for j in range(len(ids)) if word in proc.decode(ids[:j + 1]))
    for stream in (False, True):
        r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=16, temperature=0, stop=[word],
                                           stream=stream)
        choices = [c.choices[0] for c in r] if stream else r.choices
        text = "".join(c.delta.content or "" for c in choices) if stream else choices[0].message.content
        assert choices[-1].finish_reason == "stop" and text == full[:full.find(word)]
        assert [x for c in choices for x in c.model_extra["uncertainty"]["codes"]] == codes[:k + 1]


def _request(i: int, rng) -> dict:
    """Request i of the concurrent mix: chat (some with an image) or text completion; 1–16 tokens; greedy or
    sampled (temperature, top-p, top-k, seed, uncertainty_power)."""
    words = " ".join(f"w{x}" for x in rng.integers(0, 115, int(rng.integers(1, 12))))
    kw = dict(max_tokens=int(rng.integers(1, 17)), temperature=0.0)
    if i % 2:
        kw.update(temperature=float(rng.choice([0.7, 1.3])), top_p=float(rng.choice([0.9, 1.0])), seed=1000 + i)
        kw["extra_body"] = {"top_k": int(rng.choice([0, 5])), "uncertainty_power": float(rng.choice([0.0, 2.0]))}
    kind = "text" if i % 7 == 3 else "image" if i % 5 == 1 else "chat"
    return dict(kind=kind, words=words, png=png_bytes(100 + i) if kind == "image" else None, stream=i % 3 == 0, **kw)


def _send(client, q: dict):
    """(text, per-token strings, codes) of request q as the server answers it."""
    args = {k: v for k, v in q.items() if k not in ("kind", "words", "png", "stream")}
    unc = lambda c: c.model_extra["uncertainty"]["codes"]                              # noqa: E731
    if q["kind"] == "text":
        if q["stream"]:
            ch = [c.choices[0] for c in client.completions.create(model="tiny", prompt=q["words"], stream=True,
                                                                   logprobs=0, **args)]
            return "".join(c.text for c in ch), [t for c in ch for t in c.logprobs.tokens], sum(map(unc, ch), [])
        c = client.completions.create(model="tiny", prompt=q["words"], logprobs=0, **args).choices[0]
        return c.text, c.logprobs.tokens, unc(c)
    msgs = _messages(q)
    if q["stream"]:
        ch = [c.choices[0] for c in client.chat.completions.create(model="tiny", messages=msgs, stream=True,
                                                                    logprobs=True, **args)]
        return ("".join(c.delta.content or "" for c in ch), [e.token for c in ch for e in c.logprobs.content],
                sum(map(unc, ch), []))
    c = client.chat.completions.create(model="tiny", messages=msgs, logprobs=True, **args).choices[0]
    return c.message.content, [e.token for e in c.logprobs.content], unc(c)


def _messages(q: dict) -> list[dict]:
    content = [{"type": "text", "text": q["words"]}]
    if q["png"] is not None:
        content.insert(0, {"type": "image_url", "image_url": {"url": data_url(q["png"])}})
    return [{"role": "user", "content": content}]


def test_32_concurrent_mixed_requests_each_equal_their_solo_run(served):
    model, proc, server, engine = served
    rng = np.random.default_rng(0)
    reqs = [_request(i, rng) for i in range(32)]
    before = engine.load()
    client = _client(server)
    with cf.ThreadPoolExecutor(32) as pool:
        results = list(pool.map(lambda q: _send(client, q), reqs))
    after = engine.load()
    assert after["admitted"] - before["admitted"] == 32 and after["busy"] == 0 and after["queued"] == 0
    assert after["max_busy"] >= 2                     # the slots were shared
    parted = 0
    for q, (text, pieces, codes) in zip(reqs, results):
        sampling = {k: q[k] for k in ("temperature", "top_p", "seed") if k in q}
        sampling.update({k: v for k, v in q.get("extra_body", {}).items()})
        if q["kind"] == "text":
            ref = solo(model, proc, prompt=q["words"], max_tokens=q["max_tokens"], **sampling)
        else:
            url_png = {data_url(q["png"]): q["png"]} if q["png"] is not None else {}
            ref = solo(model, proc, _messages(q), images=url_png, max_tokens=q["max_tokens"], **sampling)
        n = agreement(pieces_of(proc, ref[0]), ref[1], ref[2], pieces, codes)
        if n == len(ref[0]):
            assert text == proc.decode(ref[0]), q
        parted += n < len(ref[0])
    assert parted <= 2, parted                   # a level-boundary tie is rare: the rest are equal to the end


def _post(server, path, body=None, raw=None):
    r = httpx.post(server.url + path, json=body, content=raw, timeout=60,
                   headers={"content-type": "application/json"})
    return r.status_code, r.json()


@pytest.mark.parametrize("body,param,code", [
    (b"{'model': 'tiny',", None, None),                                                    # malformed JSON
    ({"model": "tiny", "messages": "w1"}, "messages", None),
    ({"model": "tiny", "messages": [{"role": "user", "content": "w1"}], "temperature": "hot"}, "temperature", None),
    ({"model": "tiny", "messages": [{"role": "user", "content": "w1"}], "max_tokens": 2.5}, "max_tokens", None),
    ({"model": "tiny", "messages": [{"role": "robot", "content": "w1"}]}, "messages", None),
    ({"model": "tiny", "messages": [{"role": "user", "content": "w1"}], "n": 2}, "n", None),
    ({"model": "gpt-4o", "messages": [{"role": "user", "content": "w1"}]}, "model", "model_not_found"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "w1 " * 70}], "max_tokens": 20}, "messages",
     "context_length_exceeded"),
    ({"model": "tiny", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,aGVsbG8gd29ybGQ="}}]}]}, "messages", None),
    ({"model": "tiny", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}]}]}, "messages", None),
    ({"model": "tiny", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "/etc/passwd"}}]}]}, "messages", None),
    ({"model": "tiny", "prompt": ["w1", "w2"]}, "prompt", None),
    ({"model": "tiny", "prompt": "w1", "max_tokens": 0}, "max_tokens", None),
], ids=["malformed-json", "messages-type", "temperature-type", "max-tokens-float", "bad-role", "n=2",
        "unknown-model", "over-max-len", "undecodable-image", "remote-image", "local-path-without-root",
        "two-prompts", "max-tokens-0"])
def test_bad_requests_get_400_with_an_openai_error(served, body, param, code):
    _, _, server, engine = served
    path = "/v1/completions" if isinstance(body, dict) and "prompt" in body else "/v1/chat/completions"
    before = engine.load()["admitted"]
    status, out = _post(server, path, raw=body) if isinstance(body, bytes) else _post(server, path, body)
    assert status == 400, out
    err = out["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["code"] == code
    assert isinstance(err["message"], str) and err["message"]
    assert engine.load()["admitted"] == before                 # nothing reached the engine


def test_the_openai_client_raises_bad_request(served):
    _, _, server, _ = served
    with pytest.raises(openai.BadRequestError) as e:
        _client(server).chat.completions.create(model="tiny", messages=[{"role": "user", "content": "w1"}],
                                                top_p=1.5)
    assert e.value.status_code == 400 and e.value.param == "top_p"
