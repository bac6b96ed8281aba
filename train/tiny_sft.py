"""The tiny SFT set of `configs/tiny_sft.yaml`, generated at start (deterministic, a few KB).

48 conversations over a 40-word vocabulary (+ specials and roles): 32 ask about a 64×64 PNG (a coloured shape on a coloured
background; the answer names both), 16 are text-only (counting, opposites). The word-level tokenizer and
the image-processor config come from `prisma_jax.host.processing.build_tokenizer`, so the ids match
`configs/tiny.yaml` (image 5, video 6, vision start 3, end 4). Written to a temporary sibling directory and
renamed, so a directory that exists is complete.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile

import numpy as np

COLORS = {"red": (220, 40, 40), "green": (40, 200, 60), "blue": (40, 70, 220), "yellow": (230, 220, 40)}
SHAPES = ("square", "circle", "bar", "cross")
NUMBERS = ("one", "two", "three", "four", "five", "six")
OPPOSITES = {"up": "down", "big": "small", "hot": "cold", "left": "right"}
WORDS = [*COLORS, *SHAPES, *NUMBERS, *OPPOSITES, *OPPOSITES.values(), "a", "on", "what", "is", "this", "?",
         "count", "to", "opposite", "of", "the", "image", "shows", "background", "."]


def _draw(color, shape, bg, size=64):
    from PIL import Image, ImageDraw
    im = Image.new("RGB", (size, size), COLORS[bg])
    d = ImageDraw.Draw(im)
    c, r = size // 2, size // 4
    if shape == "square":
        d.rectangle([c - r, c - r, c + r, c + r], fill=COLORS[color])
    elif shape == "circle":
        d.ellipse([c - r, c - r, c + r, c + r], fill=COLORS[color])
    elif shape == "bar":
        d.rectangle([4, c - r // 2, size - 4, c + r // 2], fill=COLORS[color])
    else:
        d.rectangle([c - r // 3, 4, c + r // 3, size - 4], fill=COLORS[color])
        d.rectangle([4, c - r // 3, size - 4, c + r // 3], fill=COLORS[color])
    return im


def _conversations(img_dir: str) -> list[dict]:
    rng = np.random.default_rng(0)
    out = []
    colors = list(COLORS)
    for i in range(32):
        color, shape = colors[i % 4], SHAPES[(i // 4) % 4]
        bg = colors[(i % 4 + 1 + int(rng.integers(0, 3))) % 4]
        name = f"{i:03d}.png"
        _draw(color, shape, bg).save(os.path.join(img_dir, name))
        out.append({"messages": [
            {"role": "user", "content": [{"type": "image", "image": f"images/{name}"},
                                         {"type": "text", "text": "what is this ?"}]},
            {"role": "assistant", "content": f"the image shows a {color} {shape} on {bg} background ."}]})
    for i in range(16):
        if i % 2 == 0:
            n = 2 + (i // 2) % 5
            out.append({"messages": [{"role": "user", "content": f"count to {NUMBERS[n - 1]}"},
                                     {"role": "assistant", "content": " ".join(NUMBERS[:n])}]})
        else:
            w = list(OPPOSITES)[(i // 2) % 4]
            out.append({"messages": [{"role": "user", "content": f"what is the opposite of {w} ?"},
                                     {"role": "assistant", "content": f"the opposite of {w} is {OPPOSITES[w]} ."}]})
    return out


def generate(directory: str) -> tuple[str, str]:
    """(JSONL path, processor directory), creating them under `directory` unless already there."""
    from prisma_jax.host.processing import build_tokenizer

    jsonl, proc = os.path.join(directory, "train.jsonl"), os.path.join(directory, "processor")
    if os.path.isfile(jsonl) and os.path.isdir(proc):
        return jsonl, proc
    parent = os.path.dirname(os.path.abspath(directory))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tiny_sft_", dir=parent)
    try:
        os.makedirs(os.path.join(tmp, "images"))
        convs = _conversations(os.path.join(tmp, "images"))
        with open(os.path.join(tmp, "train.jsonl"), "w") as f:
            for c in convs:
                f.write(json.dumps(c) + "\n")
        build_tokenizer(os.path.join(tmp, "processor"), WORDS, min_pixels=64 * 64, max_pixels=128 * 128)
        os.rename(tmp, directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return jsonl, proc
