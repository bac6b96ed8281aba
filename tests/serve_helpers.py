"""What the `prisma serve` tests share: a tiny checkpoint with an offline tokenizer, an in-process server on a
free 127.0.0.1 port, and the independent reference — `PrismaVL.generate` on the same prompt alone."""
from __future__ import annotations

import base64
import io
import json
import os
import socket
import time

import numpy as np
from PIL import Image

from hf_tiny import build_model, save_checkpoint, tiny_hf_config
from prisma_jax.host.processing import build_tokenizer

WORDS = [f"w{i}" for i in range(115)]          # + 13 specials/roles = the tiny config's 128 rows
IMAGE_SIZE = (64, 96)                           # → grid 4×6 → 6 image tokens


def make_checkpoint(directory: str, seed: int = 6) -> str:
    """Tokenizer + tiny Prisma-VL with a large 16-bit table (a wrong code changes the next tokens)."""
    ids = build_tokenizer(directory, WORDS, min_pixels=64 * 64, max_pixels=64 * 96)
    assert ids["vocab_size"] == 128 and ids["image_token_id"] == 5
    hf = build_model(tiny_hf_config(text_layers=2, vision_depth=2, deepstack=(1,)), seed=seed)
    table = np.random.default_rng(1).normal(0, 0.5, (2**16, 64)).astype(np.float32)
    save_checkpoint(hf, directory, table=table)
    with open(os.path.join(directory, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": ids["eos_token_id"], "pad_token_id": ids["pad_token_id"]}, f)
    return directory


def png_bytes(seed: int) -> bytes:
    h, w = IMAGE_SIZE
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 255, (h, w, 3), np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def data_url(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()


def wait_until(cond, seconds: float = 30.0, what: str = "condition") -> None:
    """Poll `cond` every 20 ms until it holds; fail after `seconds` (a deadline, not a measurement)."""
    deadline = time.monotonic() + seconds
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(model, proc, name: str = "tiny", image_root=None, app_kw=None, **engine_kw):
    """(server, engine): prisma_jax.infer.serve's app on a free 127.0.0.1 port, in a thread of this process."""
    from prisma_jax.infer.serve.local import LocalServer

    server = LocalServer.start(model, proc, name, image_root, app_kw, **engine_kw)
    return server, server.engine


def served_image(png: bytes, proc):
    """The image a server with `proc` feeds the model: resized to its bucket grid (docs/serve.md, "Limits")."""
    from prisma_jax.infer.serve.app import served_image_grids
    from prisma_jax.infer.serve.images import bucket_image

    grids, patch, _ = served_image_grids(proc)
    return bucket_image(Image.open(io.BytesIO(png)).convert("RGB"), grids, patch)


def to_processor_messages(messages: list[dict], images: dict[str, bytes], proc=None) -> list[dict]:
    """OpenAI messages → the Processor's format (image_url parts → the PIL images they name, bucketed as the
    server does when `proc` is given)."""
    out = []
    for m in messages:
        content = m["content"]
        if isinstance(content, str):
            content = [{"type": "text", "text": content}]
        parts = []
        for p in content:
            if p["type"] == "text":
                parts.append(p)
            else:
                png = images[p["image_url"]["url"]]
                parts.append({"type": "image", "image": served_image(png, proc) if proc is not None else
                              Image.open(io.BytesIO(png)).convert("RGB")})
        out.append({"role": m["role"], "content": parts})
    return out


def solo(model, proc, messages=None, prompt=None, images=None, max_tokens=16, **kw):
    """`PrismaVL.generate` on this one request: (tokens, codes, entropies, prompt length) of its row."""
    if messages is not None:
        enc = proc(messages=[to_processor_messages(messages, images or {}, proc)])
    else:
        ids = proc.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        enc = {"input_ids": np.asarray([ids]), "attention_mask": np.ones((1, len(ids)), np.int64)}
    r = model.generate(enc["input_ids"], enc["attention_mask"], enc.get("pixel_values"), enc.get("image_grid_thw"),
                       max_new_tokens=max_tokens, return_entropies=True, **kw)
    n = int(r.lengths[0])
    return r.tokens[0, :n].tolist(), r.codes[0, :n].tolist(), r.entropies[0, :n], enc["input_ids"].shape[1]


def pieces_of(proc, ids) -> list[str]:
    """Each token's own text, as the server's logprobs entries name it."""
    return [proc.tokenizer.decode([int(t)], skip_special_tokens=False) for t in ids]


def agreement(ref_tokens, ref_codes, ref_entropies, tokens, codes, n_bits: int = 16, vocab: int = 128) -> int:
    """How many steps of a served answer (`tokens`, `codes`) equal a solo run's (`ref_*`).

    Every step must be equal — token and code — up to the first one, if any, whose code differs by one where
    the solo run's entropy lies on a level boundary (within 0.05 of an integer on the code scale): the float32
    round-off of a differently shaped program (slots, cache window) may land either side of it, and from there
    on the two runs feed different codes and legitimately part (tests/test_generate.py uses the same rule for
    batch rows). Without such a step the answers must be equal to the end. Returns the steps compared."""
    x = np.clip(np.asarray(ref_entropies, np.float64) / np.log(vocab), 0, 1) * (2**n_bits - 1)
    for t, (a, b) in enumerate(zip(codes, ref_codes)):
        if a != b:
            assert abs(a - b) == 1 and abs(x[t] - np.round(x[t])) < 0.05, (t, a, b, x[t])
            return t
        assert tokens[t] == ref_tokens[t], (t, tokens[t], ref_tokens[t])
    assert len(codes) == len(ref_codes) and len(tokens) == len(ref_tokens), (len(codes), len(ref_codes))
    return len(codes)
