"""The independent side of the generation tests: a plain sequential greedy loop in PyTorch (transformers in
float64, full recompute every step, no cache), with docs/introspection-contract.md §2–4 written out in NumPy float64."""
from __future__ import annotations

import math

import numpy as np
import torch

from hf_tiny import reference_logits


def code64(logits: np.ndarray, n_bits: int) -> tuple[int, float]:
    """§2 in float64: (code, h·(L−1)) of one row of logits."""
    z = np.asarray(logits, np.float64)
    m = z.max()
    e = np.exp(z - m)
    s = e.sum()
    h = (m + math.log(s)) - (e * z).sum() / s
    x = min(max(h / math.log(len(z)), 0.0), 1.0) * (2**n_bits - 1)
    return int(math.floor(x)), x


def reference_greedy(hf, prompt, steps: int, table, n_bits: int, pixel_values=None, image_grid_thw=None):
    """One unpadded prompt → (tokens [steps], codes [steps], h·(L−1) [steps]) by full recompute.

    Prompt rule: first token none, the rest neutral; each generated token enters with the code of the
    distribution it was drawn from.
    """
    hf = hf.double()
    try:
        seq = [int(t) for t in prompt]
        codes = [-1] + [2 ** (n_bits - 1)] * (len(seq) - 1)
        toks, cs, xs = [], [], []
        for _ in range(steps):
            with torch.no_grad():
                z = reference_logits(hf, np.array([seq]), pixel_values=pixel_values, image_grid_thw=image_grid_thw,
                                     table=table, codes_in=np.array([codes]))[0, -1]
            tok = int(np.argmax(z))
            c, x = code64(z, n_bits)
            toks.append(tok), cs.append(c), xs.append(x)
            seq.append(tok), codes.append(c)
        return np.array(toks), np.array(cs), np.array(xs)
    finally:
        hf.float()
