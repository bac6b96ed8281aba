"""Asynchronous checkpoints: the step time while Orbax saves in the background, against synchronous saves.

    .venv/bin/python benchmarks/checkpoint.py [--steps 13] [--every 4] [overrides of configs/bench_58m.yaml]

Runs `prisma train`'s loop (train/loop.py) twice on `configs/bench_58m.yaml` (synthetic data), in fresh work
directories, with `checkpoint.asynchronous` true (the default) and false, saving every `--every` steps. From each
run's metrics.jsonl and goodput.json it reports: the median time of the steps that ran while a save was in
flight (the step after each save) and of the other steps (the first, which compiles, left out), and the time
the loop spent blocked in saves. A checkpoint of the 58M model with AdamW is ~700 MB.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import numpy as np

sys.path = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]
import prisma_jax  # noqa: E402,F401  first: the host-allocator settings


def one(asynchronous: bool, steps: int, every: int, overrides: list[str]) -> dict:
    from train.config import load_train_config
    from train.loop import run

    cfg, _ = load_train_config("configs/bench_58m.yaml", [f"train.steps={steps}", f"checkpoint.every={every}",
                                                          f"checkpoint.asynchronous={str(asynchronous).lower()}",
                                                          f"checkpoint.keep={steps}", *overrides])
    with tempfile.TemporaryDirectory() as wd:
        run(cfg, wd, progress=False, log=lambda *_: None)
        with open(os.path.join(wd, "metrics.jsonl")) as f:
            times = {m["step"]: m["step_time"] for m in map(json.loads, f)}
        with open(os.path.join(wd, "goodput.json")) as f:
            goodput = json.load(f)
        size = sum(os.path.getsize(os.path.join(d, n)) for d, _, ns in os.walk(os.path.join(wd, "checkpoints"))
                   for n in ns) / len([s for s in range(1, steps + 1) if s % every == 0 or s == steps])
    after_save = [t for s, t in times.items() if s > 1 and (s - 1) % every == 0]
    other = [t for s, t in times.items() if s > 1 and (s - 1) % every != 0]
    return {"asynchronous": asynchronous, "step_after_save_s": float(np.median(after_save)),
            "other_steps_s": float(np.median(other)), "blocked_in_saves_s": goodput["checkpoint_s"],
            "saves": len([s for s in times if s % every == 0]), "checkpoint_mb": size / 1e6, "step_times": times}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=13)
    ap.add_argument("--every", type=int, default=4)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    rows = [one(a, args.steps, args.every, args.overrides) for a in (True, False)]
    print("| saves | step while a save runs (s) | other steps (s) | blocked in saves, whole run (s) | checkpoint MB |")
    print("| --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {'asynchronous' if r['asynchronous'] else 'synchronous'} | {r['step_after_save_s']:.2f} | "
              f"{r['other_steps_s']:.2f} | {r['blocked_in_saves_s']:.2f} | {r['checkpoint_mb']:.0f} |")
    print(json.dumps({"args": vars(args), "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
