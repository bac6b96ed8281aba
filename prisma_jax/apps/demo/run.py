"""`prisma demo`: the whole system on a laptop CPU, end to end, with a calibration report.

    dataset (dataset.py) → tokenizer (processing.build_tokenizer)
    → `prisma train` (configs/demo.yaml) for both arms at once (`train_arms`: a subprocess each) → for each arm:
        `prisma convert train-to-hf` → `prisma convert hf-to-orbax`
        → `prisma_jax.apps.evaluation.evaluate` on the held-out questions, written as eval items (greedy answers with
          per-token codes and probabilities, the metrics; `eval_<arm>/`)
    → both arms' metrics side by side: metrics.json, report.md and plots (report.py)

The two arms start from the same random weights and see the same batches: "feedback" trains the uncertainty
table (the Prisma mechanism); "no_feedback" starts it at zero and freezes it (`train.freeze=[uncertainty]`),
which is plain Qwen3-VL. Everything is written under a temporary sibling of `--out` and renamed at the end.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import tempfile
import time

import numpy as np

from prisma_jax.apps.evaluation import evaluate
from prisma_jax.apps.evaluation.metrics import normalize
from prisma_jax.apps.demo import dataset as D
from prisma_jax.apps.demo import report as R

ARMS = ("feedback", "no_feedback")
DEFAULT_CONFIG = os.path.join(os.path.dirname(__file__), "..", "..", "..", "configs", "demo.yaml")
MAX_NEW_TOKENS = 4          # longest answer ("top left") + the end token, plus one
GEN_BATCH = 100
# The vision tower's position table is drawn at unit scale, not normal(0, 0.02): the language model then finds
# "top left" among the four image tokens by their content (docs/demo.md: routing by position).
POS_EMBED_STD = 1.0


class Progress:
    """Stage lines with elapsed wall time, and notes under them (the training steps of both arms)."""

    def __init__(self, n_stages: int, out=sys.stdout):
        self.n, self.i, self.t0, self.out = n_stages, 0, time.perf_counter(), out

    def stage(self, text: str) -> None:
        self.i += 1
        print(f"[{self.i}/{self.n} {self.elapsed():6.1f}s] {text}", file=self.out, flush=True)

    def note(self, text: str) -> None:
        print(f"    {text}", file=self.out, flush=True)

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0


# ------------------------------------------------------------------------------------------------ pieces


def build_tokenizer_dir(directory: str, model_cfg) -> dict:
    """The demo tokenizer + image processor (64×64 images kept at 64×64); its ids must match the config."""
    from prisma_jax.host.processing import build_tokenizer
    n = D.IMAGE_SIZE * D.IMAGE_SIZE
    ids = build_tokenizer(directory, list(D.VOCABULARY), min_pixels=n, max_pixels=n)
    want = {"vocab_size": model_cfg.text.vocab_size, "image_token_id": model_cfg.image_token_id,
            "video_token_id": model_cfg.video_token_id, "vision_start_token_id": model_cfg.vision_start_token_id,
            "vision_end_token_id": model_cfg.vision_end_token_id}
    bad = {k: (ids[k], v) for k, v in want.items() if ids[k] != v}
    if bad:
        raise ValueError("the demo config does not match the demo tokenizer: "
                         + ", ".join(f"{k} tokenizer {a} vs config {b}" for k, (a, b) in bad.items()))
    return ids


def demo_init(model_cfg, seed: int, pos_embed_std: float = POS_EMBED_STD) -> dict:
    """The default random init (NumPy), with the vision position table redrawn at `pos_embed_std`."""
    from prisma_jax.nn.params import init_params_numpy
    params = init_params_numpy(model_cfg, seed, np.float32, uncertainty_init="normal")
    shape = params["vision"]["pos_embed"]["embedding"].shape
    pe = np.random.default_rng([seed, 1]).normal(0, pos_embed_std, shape).astype(np.float32)
    return {**params, "vision": {**params["vision"], "pos_embed": {"embedding": pe}}}


def initial_checkpoints(model_cfg, seed: int, directory: str, tok_dir: str, eos_id: int, pad_id: int) -> dict:
    """One random init (`demo_init`), written twice as a Hugging Face checkpoint: with a normal(0, 0.02) table
    (feedback) and with a zero table (no feedback). Both arms train from these (`train.init`)."""
    from train.export import write_hf
    params = demo_init(model_cfg, seed)
    out = {}
    for arm in ARMS:
        p = params
        if arm == "no_feedback":
            p = {**params, "uncertainty": {"embedding": np.zeros_like(params["uncertainty"]["embedding"])}}
        out[arm] = os.path.join(directory, f"init_{arm}")
        write_hf(p, model_cfg, out[arm], tok_dir, {"eos_token_id": eos_id, "pad_token_id": pad_id})
    return out


def train_command(config: str, workdir: str, steps: int, data: str, tok_dir: str, init: str, arm: str,
                  overrides=()) -> list[str]:
    """One arm's `prisma train` argv (for `train_arms`): the training config on `data` with the demo tokenizer,
    from the checkpoint `init`; the no-feedback arm freezes the uncertainty table (`train.freeze=[uncertainty]`,
    after the overrides, so that nothing undoes it)."""
    argv = ["train", "--config", config, "--workdir", workdir, "--steps", str(steps), "--no-progress",
            f"data.path={data}", f"data.processor={tok_dir}", f"train.init={init}", f"train.steps={steps}",
            *overrides]
    return argv + (["train.freeze=[uncertainty]"] if arm == "no_feedback" else [])


def export_hf(workdir: str, hf_dir: str, tok_dir: str, eos_id: int, pad_id: int) -> str:
    """`prisma convert train-to-hf` of a finished run, the demo tokenizer included: a Hugging Face checkpoint that
    `PrismaVL.from_pretrained`, `prisma eval` and `train.init` all take. Returns `hf_dir`."""
    cli(["convert", "train-to-hf", workdir, hf_dir, "--processor", tok_dir, "--eos-token-id", str(eos_id),
         "--pad-token-id", str(pad_id)])
    return hf_dir


# Both arms train at once, one process each with one XLA thread on its share of the cores: the tiny model's ops
# do not split well over cores, and on 2 cores two such runs take 65 ms a step each where one two-threaded run
# takes 44 ms (docs/benchmarks.md) — 8,000 steps per arm in the time of 5,900 one after the other.
ONE_THREAD = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"


def train_arms(commands: dict[str, list[str]], workdirs: dict[str, str], log_dir: str, steps: int,
               progress=None) -> dict[str, float]:
    """Run `prisma <command>` for every arm at once (logs in `log_dir/train_<arm>.log`), print their progress from
    the metrics files in their `workdirs`, and return each arm's wall time; a failed arm raises with the end of
    its log."""
    import subprocess
    env = {**os.environ, "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} {ONE_THREAD}".strip()}
    t0, procs, took, shown = time.perf_counter(), {}, {}, 0.0
    os.makedirs(log_dir, exist_ok=True)
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    for i, (arm, argv) in enumerate(commands.items()):
        log = open(os.path.join(log_dir, f"train_{arm}.log"), "w")
        proc = subprocess.Popen([sys.executable, "-m", "prisma_jax.apps.cli", *argv], stdout=log,
                                stderr=subprocess.STDOUT, env=env)
        if len(cores) >= len(commands):   # a share of the cores each (set before the child starts its threads)
            with contextlib.suppress(ProcessLookupError):
                os.sched_setaffinity(proc.pid, cores[i::len(commands)])
        procs[arm] = (proc, log)
    try:
        while procs.keys() - took.keys():
            time.sleep(2)
            for arm, (proc, log) in procs.items():
                if arm not in took and proc.poll() is not None:
                    took[arm] = time.perf_counter() - t0
                    log.close()
                    if proc.returncode:
                        with open(log.name) as f:
                            tail = "".join(f.readlines()[-5:])
                        raise ValueError(f"`prisma train` [{arm}] failed (exit code {proc.returncode}):\n{tail}")
            if progress and time.perf_counter() - shown >= 15:
                shown = time.perf_counter()
                done = {arm: _last_step(workdirs[arm]) for arm in commands}
                progress.note(f"{time.perf_counter() - t0:6.0f}s  "
                              + "  ".join(f"{arm} {n}/{steps}" for arm, n in done.items()))
    finally:
        for proc, log in procs.values():
            if proc.poll() is None:
                proc.kill()
            log.close()
    return took


def _last_step(workdir: str) -> int:
    """The last logged step in a `prisma train` workdir's metrics.jsonl (0 before the first)."""
    try:
        with open(os.path.join(workdir, "metrics.jsonl"), "rb") as f:
            lines = f.read().splitlines()
        return json.loads(lines[-1])["step"] if lines else 0
    except (OSError, ValueError, KeyError):
        return 0


def cli(argv: list[str]) -> None:
    """Run one `prisma` subcommand in this process (no second JAX start-up); non-zero exit → error."""
    from prisma_jax.apps.cli import main
    rc = main(argv)
    if rc:
        raise ValueError(f"`prisma {' '.join(argv[:2])}` failed (exit code {rc})")


# ------------------------------------------------------------------------------------------------ generation


def arm_summary(metrics: dict, rows: list[dict]) -> dict:
    """One arm's eval metrics plus the demo's own split by question kind (eval's `group`): `accuracy` on the
    questions the scene determines (kind "answerable"; eval's `accuracy` also counts the ambiguous ones against
    their drawn label) and `accuracy_ambiguous`, the share of ambiguous questions given any right answer."""
    amb = [normalize(r["prediction"]) in {normalize(a) for a in r["meta"]["answers"]}
           for r in rows if r["group"] == "ambiguous"]
    groups = metrics.get("by_group", {})
    return {**metrics, "accuracy_eval": metrics["accuracy"],
            "accuracy": groups.get("answerable", {}).get("accuracy", float("nan")),
            "accuracy_ambiguous": float(np.mean(amb)) if amb else float("nan")}


def pick_examples(rows_by_arm: dict, n_right: int = 3, n_wrong: int = 3) -> dict:
    """The same questions for both arms: the first wrong answers of the feedback arm (else of the other),
    then the first right ones."""
    fb = rows_by_arm["feedback"]
    wrong = [i for i, r in enumerate(fb) if not r["correct"]][:n_wrong]
    if len(wrong) < n_wrong:
        wrong += [i for i, r in enumerate(rows_by_arm["no_feedback"]) if not r["correct"] and i not in wrong]
        wrong = wrong[:n_wrong]
    right = [i for i, r in enumerate(fb) if r["correct"] and i not in wrong][:n_right]
    chosen = sorted(wrong + right)

    def ex(r):
        return {"question": r["meta"]["question"], "answer": r["prediction"], "label": r["reference"],
                "correct": r["correct"], "tokens": [t.replace("<|im_end|>", "<end>") for t in r["tokens"]],
                "codes": r["codes"]}
    return {arm: [ex(rows[i]) for i in chosen] for arm, rows in rows_by_arm.items()}


def format_samples(rows: list[dict], n: int = 8) -> str:
    lines = []
    for r in rows[:n]:
        toks = " ".join(f"{t.replace('<|im_end|>', '<end>')}[{c}]" for t, c in zip(r["tokens"], r["codes"]))
        mark = "right" if r["correct"] else f"wrong, label {r['reference']!r}"
        lines.append(f"{r['meta']['question']:<40} → {toks:<34} p={r['confidence']:.2f}  ({r['group']}, {mark})")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ pipeline


def run_demo(out: str = "demo_out", config: str | None = None, steps: int | None = None,
             train_images: int = D.TRAIN_IMAGES, heldout_images: int = D.HELDOUT_IMAGES,
             questions_per_image: int = D.QUESTIONS_PER_IMAGE, seed: int = 0,
             progress_bar: bool = True, overrides: tuple[str, ...] = ()) -> dict:
    """The whole demo; returns the flat metrics (also in `out/metrics.json`)."""
    from train.config import load_train_config

    config = os.path.abspath(config or DEFAULT_CONFIG)
    out = os.path.abspath(out)
    parent = os.path.dirname(out) or "."
    os.makedirs(parent, exist_ok=True)
    cfg, _ = load_train_config(config, list(overrides))
    steps = steps or cfg.train.steps
    prog = Progress(4 + 2 * len(ARMS))
    tmp = tempfile.mkdtemp(prefix=os.path.basename(out) + ".tmp-", dir=parent)
    try:
        data_dir, tok_dir = os.path.join(tmp, "data"), os.path.join(tmp, "tokenizer")
        prog.stage(f"dataset: {train_images} + {heldout_images} scenes × {questions_per_image} questions "
                   f"({D.CAPTION_SHARE:.0%} of the training scenes captioned instead) → {data_dir}")
        info = D.build_dataset(data_dir, train_images, heldout_images, questions_per_image, seed)
        prog.note(f"{info['n_train']} training conversations, {info['n_heldout']} held-out questions "
                  f"{info['heldout_kinds']}")
        prog.stage("tokenizer: word-level, Qwen chat template, image processor (prisma_jax.host.processing)")
        ids = build_tokenizer_dir(tok_dir, cfg.model)
        eos, pad = ids["eos_token_id"], ids["pad_token_id"]
        inits = initial_checkpoints(cfg.model, seed, os.path.join(tmp, "checkpoints"), tok_dir, eos, pad)
        heldout = D.read_jsonl(info["heldout"])
        items = os.path.join(data_dir, "heldout_eval.jsonl")          # the held-out questions as eval items
        D.write_jsonl(items, [D.eval_item(r) for r in heldout])
        workdirs = {arm: os.path.join(tmp, "runs", arm) for arm in ARMS}
        commands = {arm: train_command(config, workdir, steps, info["train"], tok_dir, inits[arm], arm, overrides)
                    for arm, workdir in workdirs.items()}
        prog.stage(f"train both arms at once, {steps} steps each (logs: runs/train_<arm>.log)")
        for arm, args in commands.items():
            shown = " ".join(a if "=" not in a else a.split("=")[0] + "=…" for a in args)
            prog.note(f"[{arm}] prisma {shown}")
        train_time = train_arms(commands, workdirs, os.path.join(tmp, "runs"), steps, prog if progress_bar else None)
        rows, summaries = {}, {}
        for arm, workdir in workdirs.items():
            hf_dir = os.path.join(tmp, "checkpoints", f"{arm}_hf")
            orbax_dir = os.path.join(tmp, "checkpoints", f"{arm}_orbax")
            prog.stage(f"convert [{arm}]: trained params → {os.path.basename(hf_dir)} → prisma convert hf-to-orbax")
            cli(["convert", "hf-to-orbax", export_hf(workdir, hf_dir, tok_dir, eos, pad), orbax_dir])
            prog.stage(f"evaluate [{arm}]: {len(heldout)} held-out questions, greedy, batch {GEN_BATCH} → eval_{arm}/")
            eval_dir = os.path.join(tmp, f"eval_{arm}")
            metrics = evaluate(orbax_dir, items, eval_dir, batch=GEN_BATCH, max_new_tokens=MAX_NEW_TOKENS,
                               abstain_text=D.UNKNOWN, progress=progress_bar)
            rows[arm] = D.read_jsonl(os.path.join(eval_dir, "answers.jsonl"))
            summaries[arm] = s = arm_summary(metrics, rows[arm])
            print(format_samples(rows[arm]), flush=True)
            prog.note(f"accuracy (answerable) {R.fmt(s['accuracy'])}  ECE {R.fmt(s['ece'])}  "
                      f"AUROC(code → wrong) {R.fmt(s['auroc'])}  AURC {R.fmt(s['aurc'])}")
        prog.stage("report: metrics.json, report.md, plots")
        extra = {"wall_time_s": prog.elapsed(), "train_time_s": train_time, "steps": steps,
                 "n_train": info["n_train"], "n_heldout": info["n_heldout"], "heldout_kinds": info["heldout_kinds"],
                 "config": os.path.relpath(config), "seed": seed}
        metrics = R.write_report(tmp, summaries, rows, pick_examples(rows), cfg.model.n_levels, extra,
                                 format_samples(rows["feedback"]))
        # the finished directory replaces any earlier demo output in one rename
        if os.path.exists(out):
            old = tempfile.mkdtemp(prefix=os.path.basename(out) + ".old-", dir=parent)
            os.replace(out, os.path.join(old, "x"))
            os.replace(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out)
        tmp = None
        print("\n" + R.table(summaries))
        print(f"\nwrote {out}/metrics.json and {out}/report.md in {prog.elapsed():.0f} s")
        return metrics
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("demo", help="train a tiny Prisma-VL on a synthetic visual QA task and report "
                              "its calibration, with and without the uncertainty feedback (≈ 10 min on a CPU)")
    p.add_argument("--out", default="demo_out", help="output directory (replaced when the demo finishes)")
    p.add_argument("--config", default=None, help="training YAML (default configs/demo.yaml)")
    p.add_argument("--steps", type=int, default=None, help="training steps per arm (default: the config's)")
    p.add_argument("--train-images", type=int, default=D.TRAIN_IMAGES)
    p.add_argument("--heldout-images", type=int, default=D.HELDOUT_IMAGES)
    p.add_argument("--questions-per-image", type=int, default=D.QUESTIONS_PER_IMAGE)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true", help="no training progress bar")
    p.add_argument("overrides", nargs="*", metavar="section.key=value", help="training config overrides")
    p.set_defaults(func=_run)


def _run(args) -> int:
    for name in ("steps", "train_images", "heldout_images", "questions_per_image"):
        v = getattr(args, name)
        if v is not None and v < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be ≥ 1, got {v}")
    with contextlib.ExitStack():
        run_demo(args.out, args.config, args.steps, args.train_images, args.heldout_images,
                 args.questions_per_image, args.seed, not args.no_progress, tuple(args.overrides))
    return 0
