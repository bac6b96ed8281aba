"""`prisma demo` end to end on a reduced scale (a few steps, a few scenes): every stage runs — dataset,
tokenizer, `prisma train` for both arms, `prisma convert`, batch generation, metrics, report — and the
reported numbers agree with an independent recomputation from the per-question answers."""
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

import eval_reference as REF
from prisma_jax.apps.demo import run as R
from train.config import load_train_config


def test_demo_config_matches_demo_tokenizer(tmp_path):
    cfg, _ = load_train_config(R.DEFAULT_CONFIG)
    ids = R.build_tokenizer_dir(str(tmp_path), cfg.model)       # raises when they disagree
    assert ids["vocab_size"] == cfg.model.text.vocab_size
    bad = cfg.model.replace(image_token_id=cfg.model.image_token_id + 1)
    with pytest.raises(ValueError, match="image_token_id"):
        R.build_tokenizer_dir(str(tmp_path / "x"), bad)


def test_reduced_demo_end_to_end(tmp_path):
    out = tmp_path / "demo_out"
    m = R.run_demo(str(out), steps=3, train_images=24, heldout_images=8, questions_per_image=2,
                   progress_bar=False, overrides=("train.batch_size=8",))
    for name in ("metrics.json", "report.md", "reliability.png", "risk_coverage.png", "traces.png", "codes.png"):
        assert (out / name).is_file(), name
    assert not [p for p in os.listdir(tmp_path) if ".tmp-" in p]        # the staging directory was renamed
    saved = json.loads((out / "metrics.json").read_text())
    for k in ("accuracy", "ece", "accuracy_no_feedback", "ece_no_feedback", "code_error_corr",
              "code_error_corr_no_feedback", "auroc", "aurc_no_feedback", "wall_time_s"):
        assert k in saved, k
    assert saved["steps"] == 3 and saved["n_heldout"] == 16

    # each arm is one `prisma eval` run on the held-out questions written as eval items
    items = [json.loads(line) for line in (out / "data" / "heldout_eval.jsonl").read_text().splitlines()]
    held = [json.loads(line) for line in (out / "data" / "heldout.jsonl").read_text().splitlines()]
    assert [it["answer"] for it in items] == [h["label"] for h in held]
    assert [it["answerable"] for it in items] == [h["kind"] != "unanswerable" for h in held]
    for arm, suffix in (("feedback", ""), ("no_feedback", "_no_feedback")):
        d = out / f"eval_{arm}"
        assert sorted(os.listdir(d)) == ["answers.jsonl", "metrics.json", "reliability.png", "risk_coverage.png"]
        rs = [json.loads(line) for line in (d / "answers.jsonl").read_text().splitlines()]
        assert len(rs) == 16 and [r["id"] for r in rs] == [h["id"] for h in held]
        for r, h in zip(rs, held):
            assert math.isclose(r["confidence"], float(np.prod(r["probs"])), rel_tol=1e-9)
            assert r["code"] == max(r["codes"])
            assert all(0 <= c < 256 for c in r["codes"])
            assert r["correct"] == (REF.normalize(r["prediction"]) == REF.normalize(h["label"]))
        conf = [r["confidence"] for r in rs]
        correct = [r["correct"] for r in rs]
        code = [r["code"] for r in rs]
        assert math.isclose(saved["ece" + suffix], REF.ece(conf, correct), abs_tol=1e-12)
        assert json.loads((d / "metrics.json").read_text())["ece"] == saved["ece" + suffix]
        if 0 < sum(correct) < len(correct):
            assert math.isclose(saved["auroc" + suffix], REF.auroc(code, correct), abs_tol=1e-12)
        assert math.isclose(saved["aurc" + suffix], REF.aurc(code, correct), abs_tol=1e-12)
        answerable = [c for c, h in zip(correct, held) if h["kind"] == "answerable"]
        assert math.isclose(saved["accuracy" + suffix], sum(answerable) / len(answerable), abs_tol=1e-12)
        ambiguous = [REF.normalize(r["prediction"]) in h["answers"] for r, h in zip(rs, held) if h["kind"] == "ambiguous"]
        if ambiguous:
            assert math.isclose(saved["accuracy_ambiguous" + suffix], sum(ambiguous) / len(ambiguous))
    report = (out / "report.md").read_text()
    assert "| arm |" in report and "reliability.png" in report
    assert m["accuracy"] == saved["accuracy"]


def test_cli_rejects_bad_arguments_in_one_line(tmp_path):
    r = subprocess.run([sys.executable, "-m", "prisma_jax.apps.cli", "demo", "--steps", "0", "--out", str(tmp_path / "o")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == ["prisma demo: error: --steps must be ≥ 1, got 0"]
    assert not (tmp_path / "o").exists()


def test_a_failing_arm_stops_the_demo_with_its_log(tmp_path):
    """Both arms train at once in subprocesses: one that fails ends the demo with its exit code and the end of its
    log, the other is stopped, and nothing is left behind."""
    missing = tmp_path / "no_such_checkpoint"
    with pytest.raises(ValueError, match=r"`prisma train` \[(no_)?feedback\] failed \(exit code 2\)") as e:
        R.run_demo(str(tmp_path / "o"), steps=2, train_images=8, heldout_images=4, progress_bar=False,
                   overrides=("train.batch_size=8", f"train.init={missing}"))
    assert str(missing) in str(e.value)
    assert os.listdir(tmp_path) == []
