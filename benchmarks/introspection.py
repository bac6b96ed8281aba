"""The seed's claim measured across seeds: the demo task trained with and without the uncertainty feedback, k
seeds per arm, scored by `prisma eval`, compared seed by seed; and the self-labelled confidence experiment, where
the feedback has work to do that the input alone cannot do (docs/introspection.md: design and hypothesis).

    .venv/bin/python benchmarks/introspection.py --seeds 5 --out introspection_out
        [--first-seed 0] [--steps N] [--label-steps 1000] [--label-lr 3e-4] [--label-questions N]
        [--train-images 20000] [--heldout-images 400] [--questions-per-image 1] [section.key=value ...]

Per seed s (data, initial weights and batch order all from s; the same in both arms):
  1. the demo's dataset, tokenizer and initial checkpoints (prisma_jax/apps/demo/run.py); both arms' `prisma train`
     at once, as `prisma demo` runs them (feedback: the table trained; no feedback: `train.freeze=[uncertainty]`),
     `prisma convert train-to-hf`, then `prisma eval` (prisma_jax.apps.evaluation.evaluate) on the held-out questions.
  2. self-labelled confidence (prisma_jax/apps/demo/selflabel.py): each arm's QA model answers the training questions
     (`prisma eval`); its answers, each followed by "sure" (right) or "unsure" (wrong), become a fine-tuning set
     in which only that word is learned (`"loss": false` on the rest: its codes still flow); `prisma train` from
     the QA checkpoint for `--label-steps`; on the held-out questions the fine-tuned model answers and says its
     word, scored by AUROC of P("unsure") → wrong and the word's accuracy.
Then per metric: each arm's mean ± 95 % CI (t), the per-seed differences (feedback − no feedback) with their CI,
a paired t-test and an exact sign-flip permutation test (prisma_jax/apps/evaluation/stats.py).

Output: OUT/introspection.md (the tables, ready to paste), OUT/results.json (everything), OUT/seed_<s>/ (each
seed's data, runs, checkpoints, eval directories; written aside and renamed when the seed is done). Rerunning with
the same OUT and settings skips the seeds already done. Not in `make test`: hours on a 2-core machine.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from prisma_jax.apps.demo.report import fmt  # noqa: E402
from prisma_jax.apps.evaluation.metrics import json_safe  # noqa: E402

ARM_TITLES = {"feedback": "feedback", "no_feedback": "no feedback"}
# (key, label, better): the QA model on the held-out questions (`prisma eval`; accuracy: the demo's answerable kind)
QA_METRICS = (("accuracy", "accuracy (answerable)", "↑"), ("ece", "ECE", "↓"),
              ("auroc", "AUROC(code → wrong)", "↑"), ("aurc", "AURC", "↓"))
# the self-labelled model's word after its stage-1 answers to the held-out questions (selflabel.word_rows/metrics)
WORD_METRICS = (("word_auroc", "AUROC(P(unsure) → wrong)", "↑"), ("word_accuracy", "accuracy of the word", "↑"),
                ("unsure_share", "share of \"unsure\"", ""), ("mean_p_words", "P(sure) + P(unsure)", ""))
LABEL_PASSES = 4        # ≥ the longest reply chain + 1 (2-token answer, word): training sees generation's codes


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="output directory (seeds already in it are kept)")
    ap.add_argument("--seeds", type=int, default=5, help="seeds per arm (k)")
    ap.add_argument("--first-seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=None, help="QA training steps per arm (default: the config's)")
    ap.add_argument("--label-steps", type=int, default=1000, help="self-label fine-tuning steps per arm")
    ap.add_argument("--label-lr", type=float, default=3e-4, help="self-label fine-tuning peak learning rate")
    ap.add_argument("--label-questions", type=int, default=None,
                    help="training questions answered for self-labels (default: all of them)")
    ap.add_argument("--config", default=None, help="training YAML (default: the demo's)")
    ap.add_argument("--train-images", type=int, default=None, help="default: the demo's")
    ap.add_argument("--heldout-images", type=int, default=None, help="default: the demo's")
    ap.add_argument("--questions-per-image", type=int, default=None, help="default: the demo's")
    ap.add_argument("overrides", nargs="*", metavar="section.key=value", help="training config overrides (both stages)")
    args = ap.parse_args(argv)
    for name in ("seeds", "steps", "label_steps", "label_questions", "train_images", "heldout_images",
                 "questions_per_image"):
        v = getattr(args, name)
        if v is not None and v < 1:
            ap.error(f"--{name.replace('_', '-')} must be ≥ 1, got {v}")
    if args.seeds < 2:
        ap.error("--seeds must be ≥ 2: a confidence interval needs two seeds")
    if not args.label_lr > 0:
        ap.error(f"--label-lr must be > 0, got {args.label_lr}")
    return args


def settings(args) -> dict:
    """What a seed's numbers depend on: a rerun into the same --out must match it."""
    from prisma_jax.apps.demo import dataset as D
    from prisma_jax.apps.demo import run as R
    return {"config": os.path.abspath(args.config or R.DEFAULT_CONFIG), "steps": args.steps,
            "label_steps": args.label_steps, "label_lr": args.label_lr, "label_questions": args.label_questions,
            "train_images": args.train_images or D.TRAIN_IMAGES,
            "heldout_images": args.heldout_images or D.HELDOUT_IMAGES,
            "questions_per_image": args.questions_per_image or D.QUESTIONS_PER_IMAGE, "overrides": list(args.overrides)}


# ------------------------------------------------------------------------------------------------ one seed

def run_seed(seed: int, st: dict, directory: str, prog) -> dict:
    """Both stages for one seed inside `directory`; returns the seed's numbers (also `directory/seed.json`)."""
    from prisma_jax import PrismaVL
    from prisma_jax.apps.demo import dataset as D
    from prisma_jax.apps.demo import run as R
    from prisma_jax.apps.demo import selflabel as SL
    from prisma_jax.apps.evaluation import evaluate
    from prisma_jax.host.processing import Processor
    from train.config import load_train_config

    t0 = time.perf_counter()
    overrides = [*st["overrides"], f"train.seed={seed}"]
    cfg, _ = load_train_config(st["config"], overrides)
    steps = st["steps"] or cfg.train.steps
    data_dir, tok_dir, ck = (os.path.join(directory, n) for n in ("data", "tokenizer", "checkpoints"))
    prog.stage(f"seed {seed}: dataset, tokenizer, initial checkpoints")
    info = D.build_dataset(data_dir, st["train_images"], st["heldout_images"], st["questions_per_image"], seed)
    ids = R.build_tokenizer_dir(tok_dir, cfg.model)
    eos, pad = ids["eos_token_id"], ids["pad_token_id"]
    inits = R.initial_checkpoints(cfg.model, seed, ck, tok_dir, eos, pad)
    heldout = os.path.join(data_dir, "heldout_eval.jsonl")
    D.write_jsonl(heldout, [D.eval_item(r) for r in D.read_jsonl(info["heldout"])])

    def train(stage, stage_steps, data, init, extra=()):
        workdirs = {arm: os.path.join(directory, "runs", f"{stage}_{arm}") for arm in R.ARMS}
        commands = {arm: R.train_command(st["config"], workdirs[arm], stage_steps, data[arm], tok_dir, init[arm],
                                         arm, (*overrides, *extra)) for arm in R.ARMS}
        took = R.train_arms(commands, workdirs, os.path.join(directory, "runs", stage), stage_steps, prog)
        return {arm: R.export_hf(workdirs[arm], os.path.join(ck, f"{stage}_{arm}"), tok_dir, eos, pad)
                for arm in R.ARMS}, took

    def ev(model_dir, data, name):
        out = os.path.join(directory, name)
        m = evaluate(model_dir, data, out, batch=R.GEN_BATCH, max_new_tokens=R.MAX_NEW_TOKENS,
                     abstain_text=D.UNKNOWN, progress=False)
        return m, D.read_jsonl(os.path.join(out, "answers.jsonl"))

    prog.stage(f"seed {seed}: QA training, both arms at once, {steps} steps each")
    qa_ck, qa_time = train("qa", steps, {arm: info["train"] for arm in R.ARMS}, inits)
    qa, qa_rows = {}, {}
    for arm in R.ARMS:
        m, qa_rows[arm] = ev(qa_ck[arm], heldout, f"eval_qa_{arm}")
        qa[arm] = {k: v for k, v in R.arm_summary(m, qa_rows[arm]).items()
                   if k not in ("reliability", "risk_coverage")}
        prog.note(f"[{arm}] " + "  ".join(f"{label} {fmt(qa[arm][k])}" for k, label, _ in QA_METRICS))

    prog.stage(f"seed {seed}: self-labels (each arm answers the training questions) and fine-tuning")
    label_items = os.path.join(data_dir, "label_items.jsonl")
    n_label = SL.label_items(info["train"], label_items, st["label_questions"])
    items = D.read_jsonl(label_items)
    label_data, labels = {}, {}
    for arm in R.ARMS:
        _, rows = ev(qa_ck[arm], label_items, f"eval_train_{arm}")
        label_data[arm] = os.path.join(data_dir, f"selflabel_{arm}.jsonl")
        D.write_jsonl(label_data[arm], SL.self_label_records(items, rows))
        labels[arm] = {"n": n_label, "unsure_share": sum(not r["correct"] for r in rows) / len(rows)}
        prog.note(f"[{arm}] {n_label} training questions answered, {labels[arm]['unsure_share']:.3f} labelled unsure")
    sl_ck, sl_time = train("selflabel", st["label_steps"], label_data, qa_ck,
                           (f"optimizer.lr={st['label_lr']}", f"train.introspection_passes={LABEL_PASSES}"))
    words = {}
    held = D.read_jsonl(heldout)
    score_cfg, _ = load_train_config(st["config"], [*overrides, f"data.path={heldout}", f"data.processor={tok_dir}",
                                                    f"train.introspection_passes={LABEL_PASSES}", "train.grad_accum=1"])
    proc = Processor.from_pretrained(tok_dir)
    for arm in R.ARMS:
        forced = os.path.join(data_dir, f"heldout_selflabel_{arm}.jsonl")     # its stage-1 answers, then the word
        D.write_jsonl(forced, SL.self_label_records(held, qa_rows[arm]))
        params = PrismaVL.from_pretrained(sl_ck[arm]).params
        rows = SL.word_rows(score_cfg, params, proc, forced, qa_rows[arm], R.GEN_BATCH)
        D.write_jsonl(os.path.join(directory, f"words_{arm}.jsonl"), rows)
        words[arm] = SL.word_metrics(rows)
        prog.note(f"[{arm}] " + "  ".join(f"{label} {fmt(words[arm][k])}" for k, label, _ in WORD_METRICS))
        del params
    result = {"seed": seed, "steps": steps, "qa": qa, "labels": labels, "selflabel": words,
              "train_time_s": {"qa": qa_time, "selflabel": sl_time}, "wall_time_s": time.perf_counter() - t0}
    with open(os.path.join(directory, "seed.json"), "w") as f:
        json.dump(json_safe(result), f, indent=2)
    return result


# ------------------------------------------------------------------------------------------------ summary

def summarize(results: list[dict]) -> dict:
    """Per metric: `stats.compare` of the feedback arm against the other over the seeds, and the per-seed values."""
    from prisma_jax.apps.evaluation import stats
    out = {}
    for part, metrics in (("qa", QA_METRICS), ("selflabel", WORD_METRICS)):
        for key, _, _ in metrics:
            vals = {arm: [r[part][arm][key] for r in results] for arm in ARM_TITLES}
            out[f"{part}.{key}"] = {**stats.compare(vals["feedback"], vals["no_feedback"]), "values": vals}
    return out


def _ci(c: dict) -> str:
    return f"{fmt(c['mean'])} ± {fmt(c['half'])}"


def markdown(results: list[dict], summary: dict, st: dict, command: str, started: str) -> str:
    """OUT/introspection.md: the comparison table, the per-seed table and how they were made."""
    seeds = [r["seed"] for r in results]
    k = len(seeds)
    wall = sum(r["wall_time_s"] for r in results)                # the seeds' own times, resumed runs included
    lines = [f"{started}, `{command}`: {k} seeds ({', '.join(map(str, seeds))}) per arm, "
             f"{results[0]['steps']} QA steps and {st['label_steps']} self-label steps (lr {st['label_lr']}) per arm, "
             f"{st['train_images']} training images, {st['heldout_images']} held-out; "
             f"{wall / 60:.0f} min of seed runs.",
             "",
             f"| metric | better | feedback (mean ± 95 % CI) | no feedback | feedback − no feedback | paired t p | "
             f"sign-flip p (min {2 / 2 ** k:.3f}) |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for part, metrics, title in (("qa", QA_METRICS, "QA"), ("selflabel", WORD_METRICS, "self-label")):
        for key, label, better in metrics:
            c = summary[f"{part}.{key}"]
            lines.append(f"| {title}: {label} | {better} | {_ci(c['a'])} | {_ci(c['b'])} | {_ci(c['diff'])} | "
                         f"{fmt(c['paired_t']['p'])} | {fmt(c['sign_flip']['p'])} |")
    lines += ["", "Per seed (feedback / no feedback):", "",
              "| seed | " + " | ".join(label for _, label, _ in QA_METRICS + WORD_METRICS) + " | unsure labels |",
              "| --- " * (len(QA_METRICS) + len(WORD_METRICS) + 2) + "|"]
    for r in results:
        cells = [f"{fmt(r[p]['feedback'][k_])} / {fmt(r[p]['no_feedback'][k_])}"
                 for p, ms in (("qa", QA_METRICS), ("selflabel", WORD_METRICS)) for k_, _, _ in ms]
        share = "/".join(fmt(r["labels"][arm]["unsure_share"]) for arm in ARM_TITLES)
        lines.append(f"| {r['seed']} | " + " | ".join(cells) + f" | {share} |")
    lines += ["", "Means ± half-widths of 95 % t intervals over the seeds; the difference column is the mean and "
              "interval of the per-seed differences; p-values are two-sided. QA: `prisma eval` of each arm's "
              "QA model on the held-out questions. Self-label: the model fine-tuned to say \"sure\"/\"unsure\" "
              "after its own answer, on the held-out questions (docs/introspection.md).", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse(argv)
    from prisma_jax.apps.demo import run as R
    st = settings(args)
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    stamp = os.path.join(out, "settings.json")
    if os.path.exists(stamp):
        with open(stamp) as f:
            old = json.load(f)
        if old != st:
            raise SystemExit(f"{out} holds seeds run with other settings ({stamp}); give another --out")
    else:
        with open(stamp, "w") as f:
            json.dump(st, f, indent=2)
    command = "python benchmarks/introspection.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    started = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    seeds = list(range(args.first_seed, args.first_seed + args.seeds))
    prog = R.Progress(3 * len(seeds) + 1)
    t0 = time.perf_counter()
    results = []
    for seed in seeds:
        final = os.path.join(out, f"seed_{seed}")
        if os.path.isfile(os.path.join(final, "seed.json")):
            with open(os.path.join(final, "seed.json")) as f:
                results.append(json.load(f))
            prog.i += 3
            prog.note(f"seed {seed}: done before, kept ({final})")
            continue
        tmp = tempfile.mkdtemp(prefix=f"seed_{seed}.tmp-", dir=out)
        try:
            results.append(run_seed(seed, st, tmp, prog))
            if os.path.exists(final):
                shutil.rmtree(final)
            os.replace(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    prog.stage("summary: introspection.md, results.json")
    summary = summarize(results)
    md = markdown(results, summary, st, command, started)
    for name, text in (("introspection.md", md), ("results.json", json.dumps(json_safe(
            {"settings": st, "command": command, "started": started, "summary": summary, "seeds": results}),
            indent=2))):
        with open(os.path.join(out, name + ".tmp"), "w") as f:
            f.write(text)
        os.replace(os.path.join(out, name + ".tmp"), os.path.join(out, name))
    print("\n" + md)
    print(f"wrote {out}/introspection.md and {out}/results.json in {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
