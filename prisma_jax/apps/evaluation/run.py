"""`evaluate`: a checkpoint's greedy answers to a JSONL file of items, scored, written to one directory.

    items (items.py) → Processor + PrismaVL.from_pretrained (HF or Orbax, any mesh) → answers (answers.py)
    → metrics (metrics.py) → answers.jsonl, metrics.json, reliability.png, risk_coverage.png (plots.py)

Everything the user gives is checked before the model is loaded; the outputs are written to a temporary
sibling of `out_dir` and renamed to it at the end, so a failed run leaves no output directory.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
import time

from prisma_jax.apps.evaluation import metrics as MET
from prisma_jax.apps.evaluation import plots
from prisma_jax.apps.evaluation.answers import answer_items
from prisma_jax.apps.evaluation.items import read_items
from prisma_jax.infer.generate import ABSTAIN_TEXT

BATCH = 8
MAX_NEW_TOKENS = 32


def check_out_dir(out_dir: str) -> str:
    """The absolute output path; it must not exist (an empty directory is replaced)."""
    out = os.path.abspath(out_dir)
    if os.path.exists(out) and not (os.path.isdir(out) and not os.listdir(out)):
        raise ValueError(f"--out {out_dir} exists; give a new directory")
    return out


def evaluate(model_dir: str, data_path: str, out_dir: str, batch: int = BATCH, max_new_tokens: int = MAX_NEW_TOKENS,
             mesh=None, abstain_text: str = ABSTAIN_TEXT, progress: bool = True, dtype: str = "float32",
             verify: bool = True, n_bins: int = MET.N_BINS) -> dict:
    """Answer every item of `data_path` greedily with the checkpoint `model_dir` (its tokenizer and image
    processor included), score the answers and write `out_dir`; returns the metrics (metrics.json).

    `mesh`: None (one device), a `parallel.mesh.MeshSpec`, a dict of axis sizes, a preset name or a `Mesh`, as
    `PrismaVL.from_pretrained` takes it. `abstain_text`: the expected answer of `"answerable": false` items."""
    for name, v in (("batch", batch), ("max-new-tokens", max_new_tokens)):
        if isinstance(v, bool) or int(v) != v or v < 1:
            raise ValueError(f"--{name} must be an integer ≥ 1, got {v}")
    if not MET.normalize(abstain_text):
        raise ValueError(f"--abstain-text {abstain_text!r} is empty once normalised (docs/eval.md)")
    if isinstance(mesh, str):              # a preset means its generation mesh, as `--mesh` does
        from prisma_jax.apps.generate_cli import parse_mesh
        mesh = parse_mesh(mesh)
    out = check_out_dir(out_dir)
    from prisma_jax.api import PrismaVL
    from prisma_jax.host.processing import Processor

    t0 = time.perf_counter()
    processor = Processor.from_pretrained(model_dir)      # cheap: its special tokens check the items up front
    items = read_items(data_path, abstain_text, processor.special_texts)
    model = PrismaVL.from_pretrained(model_dir, dtype=dtype, mesh=mesh, verify=verify)
    parent = os.path.dirname(out)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=os.path.basename(out) + ".tmp-", dir=parent)
    try:
        from tqdm import tqdm
        with tqdm(total=len(items), desc="prisma eval", unit="item", disable=not progress) as bar:
            rows = answer_items(model, processor, items, int(batch), int(max_new_tokens), bar)
        with open(os.path.join(tmp, "answers.jsonl"), "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
        metrics = metrics_of_rows(rows, n_bins)
        metrics["run"] = {"model": os.path.abspath(model_dir), "data": os.path.abspath(data_path),
                          "batch": int(batch), "max_new_tokens": int(max_new_tokens), "abstain_text": abstain_text,
                          "mesh": None if model.mesh is None else dict(model.mesh.shape), "dtype": dtype,
                          "wall_time_s": time.perf_counter() - t0}
        metrics = MET.json_safe(metrics)
        with open(os.path.join(tmp, "metrics.json"), "w") as f:
            json.dump(metrics, f, indent=2)
        plots.plot_reliability({"": metrics}, os.path.join(tmp, "reliability.png"))
        plots.plot_risk_coverage({"": metrics}, os.path.join(tmp, "risk_coverage.png"))
        os.replace(tmp, out)
        tmp = None
        return metrics
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)


def metrics_of_rows(rows: list[dict], n_bins: int = MET.N_BINS) -> dict:
    """`metrics.summarize` of answers.jsonl rows."""
    return MET.summarize([r["correct"] for r in rows], [r["answerable"] for r in rows],
                         [r["confidence"] for r in rows], [r["code"] for r in rows], [r["group"] for r in rows],
                         n_bins)
