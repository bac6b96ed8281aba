"""The OpenAI request bodies `prisma serve` accepts, checked field by field.

`parse_chat(body)` and `parse_completion(body)` return the prompt (chat messages, or text / token ids) and the
generation parameters, or raise `APIError` — an HTTP status and an OpenAI-style error object naming the field:

    {"error": {"message": "...", "type": "invalid_request_error", "param": "temperature", "code": null}}

Every integer field has a range (seeds: [0, 2^63); token ids, top_k, max_tokens: < 2^31), and the body nests at
most MAX_JSON_DEPTH levels. Supported beyond OpenAI's fields: `top_k` (0 = off), `uncertainty_power` (sampling.py: temperature ×
(1 − previous code/(L−1))**power) and `stop_token_ids` (end tokens besides the checkpoint's). Unknown fields are ignored; known ones with values this server cannot honour
(`n` ≠ 1, `echo`, tools) are refused.

Not here: images (images.py), the engine, responses (app.py).
"""
from __future__ import annotations

import dataclasses
import json
import secrets

from prisma_jax.infer.serve.slots import MAX_TOP_LOGPROBS


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type

    def body(self, request_id: str | None = None) -> dict:
        """OpenAI's error object, with the request's id (the `X-Request-Id` header) when given."""
        err = {"message": self.message, "type": self.type, "param": self.param, "code": self.code}
        return {"error": err | ({"request_id": request_id} if request_id else {})}


def bad(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param, code)


@dataclasses.dataclass
class Params:
    model: str
    max_tokens: int | None            # None: whatever fits in --max-len
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop: list[str]
    stream: bool
    include_usage: bool
    logprobs: bool
    top_logprobs: int
    uncertainty_power: float
    stop_token_ids: list[int]


MAX_JSON_DEPTH = 32          # arrays / objects nested in the body, the body itself included
INT64 = (-(1 << 63), (1 << 63) - 1)
INT32_MAX = (1 << 31) - 1


def load_json(raw: bytes) -> dict:
    """The request body as a JSON object nested at most MAX_JSON_DEPTH deep, without NaN / Infinity (Python's
    parser takes them; JSON has none) and without lone UTF-16 surrogates (valid JSON escapes, invalid text);
    400 otherwise."""
    try:
        body = json.loads(raw, parse_constant=_no_constant)
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise bad("the request body holds a lone UTF-16 surrogate (\\ud800-\\udfff): not valid text") from None
    except RecursionError:
        raise bad(f"the request body is nested deeper than {MAX_JSON_DEPTH} levels") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise bad(f"the request body is not valid JSON ({e})") from None
    level = [body] if isinstance(body, (dict, list)) else []
    for _ in range(MAX_JSON_DEPTH):
        level = [v for x in level for v in (x.values() if isinstance(x, dict) else x)
                 if isinstance(v, (dict, list))]
    if level:
        raise bad(f"the request body is nested deeper than {MAX_JSON_DEPTH} levels")
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    return body


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


_TYPES = {int: "an integer", float: "a number", bool: "a boolean", str: "a string", list: "an array",
          dict: "an object"}


def field(body: dict, name: str, kind: type, default=None, lo=None, hi=None, lo_open: bool = False):
    """body[name] checked against `kind` (int also passes as float; bool never passes as a number) and the
    range [lo, hi] ((lo, hi] with lo_open); absent or null → default."""
    v = body.get(name)
    if v is None:
        return default
    ok = isinstance(v, kind) and not (isinstance(v, bool) and kind is not bool)
    if kind is float and isinstance(v, int) and not isinstance(v, bool):
        ok, v = True, float(v)
    if not ok:
        raise bad(f"'{name}' must be {_TYPES[kind]}, got {json.dumps(v)[:40]}", name)
    if lo is not None and (v <= lo if lo_open else v < lo) or hi is not None and v > hi:
        rng = f"{'(' if lo_open else '['}{lo if lo is not None else '-inf'}, {hi if hi is not None else 'inf'}]"
        raise bad(f"'{name}' must be in {rng}, got {v}", name)
    return v


def _common(body: dict, default_max_tokens: int | None, token_limit: str) -> Params:
    model = field(body, "model", str)
    if model is None:
        raise bad("'model' is required", "model")
    if field(body, "n", int, 1) != 1:
        raise bad("only n = 1 is supported", "n")
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > 4:
        raise bad("'stop' must be a non-empty string or an array of at most 4 of them", "stop")
    opts = field(body, "stream_options", dict, {})
    stream = field(body, "stream", bool, False)
    include_usage = opts.get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise bad("'stream_options.include_usage' must be a boolean", "stream_options")
    seed = field(body, "seed", int, lo=0, hi=INT64[1])
    stop_ids = field(body, "stop_token_ids", list, [])
    if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= INT32_MAX for t in stop_ids) \
            or len(stop_ids) > 8:
        raise bad("'stop_token_ids' must be an array of at most 8 token ids", "stop_token_ids")
    return Params(model=model, max_tokens=field(body, token_limit, int, default_max_tokens, lo=1, hi=INT32_MAX),
                  temperature=field(body, "temperature", float, 1.0, lo=0.0, hi=2.0),
                  top_p=field(body, "top_p", float, 1.0, lo=0.0, hi=1.0, lo_open=True),
                  top_k=field(body, "top_k", int, 0, lo=0, hi=INT32_MAX),
                  seed=secrets.randbits(31) if seed is None else seed, stop=stop, stream=stream,
                  include_usage=include_usage, logprobs=False, top_logprobs=0,
                  uncertainty_power=field(body, "uncertainty_power", float, 0.0, lo=0.0, hi=1e6),
                  stop_token_ids=stop_ids)


def parse_chat(body: dict) -> tuple[list[dict], Params]:
    """/v1/chat/completions → (messages with content as lists of {"type": "text"|"image_url", ...}, Params)."""
    limit = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    p = _common(body, None, limit)
    p.logprobs = field(body, "logprobs", bool, False)
    p.top_logprobs = field(body, "top_logprobs", int, 0, lo=0, hi=MAX_TOP_LOGPROBS)
    if p.top_logprobs and not p.logprobs:
        raise bad("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    if body.get("tools") or body.get("functions"):
        raise bad("tools are not supported", "tools")
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad("'messages' must be a non-empty array", "messages")
    out = []
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(f"{where} must be an object", "messages")
        role = m.get("role")
        if role not in ("system", "user", "assistant"):
            raise bad(f"{where}.role must be 'system', 'user' or 'assistant', got {json.dumps(role)}", "messages")
        content = m.get("content")
        if isinstance(content, str):
            content = [{"type": "text", "text": content}]
        if not isinstance(content, list):
            raise bad(f"{where}.content must be a string or an array of parts", "messages")
        parts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text" and isinstance(part.get("text"), str):
                parts.append({"type": "text", "text": part["text"]})
            elif kind == "image_url":
                url = part.get("image_url")
                url = url.get("url") if isinstance(url, dict) else url
                if not isinstance(url, str):
                    raise bad(f"{where}.content[{j}].image_url.url must be a string", "messages")
                parts.append({"type": "image_url", "url": url})
            else:
                raise bad(f"{where}.content[{j}] must be a text part or an image_url part", "messages")
        out.append({"role": role, "content": parts})
    return out, p


def parse_completion(body: dict) -> tuple[str | list[int], Params]:
    """/v1/completions → (prompt text or token ids, Params). `logprobs`: how many alternatives per token."""
    p = _common(body, 16, "max_tokens")
    n = field(body, "logprobs", int, None, lo=0, hi=MAX_TOP_LOGPROBS)
    p.logprobs, p.top_logprobs = n is not None, n or 0
    if field(body, "echo", bool, False):
        raise bad("'echo' is not supported", "echo")
    if field(body, "suffix", str):
        raise bad("'suffix' is not supported", "suffix")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        return prompt, p
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if not all(0 <= t <= INT32_MAX for t in prompt):
            raise bad("'prompt' token ids must be in [0, 2^31)", "prompt")
        return prompt, p
    raise bad("'prompt' must be a non-empty string or an array of token ids (one prompt)", "prompt")
