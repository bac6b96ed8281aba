"""`prisma eval`: its metrics against plain-Python re-derivations (tests/eval_reference.py) and hand-computed
values; end to end on a tiny random checkpoint, its answers equal `PrismaVL.generate` run directly on the same
batches, metrics.json is what its answers.jsonl gives, one program serves every batch, an Orbax copy and a
two-device mesh answer the same; bad input is one line and leaves no output directory."""
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

import eval_reference as REF
from hf_tiny import build_model, save_checkpoint, tiny_hf_config
from prisma_jax.apps.evaluation import metrics as M

KEYS = ("n", "accuracy", "accuracy_all", "accuracy_unanswerable", "ece", "auroc", "code_error_corr", "aurc",
        "mean_confidence", "reliability", "risk_coverage")


# ------------------------------------------------------------------------------------------------ metrics


def test_normalize_by_hand():
    assert M.normalize("  I don't   KNOW. ") == "i dont know"
    assert M.normalize("Top-left!") == "topleft"
    assert M.normalize("red\ncircle\t") == "red circle"
    assert M.normalize("«Ça» va ?") == "ça va"
    for s in ("I don't know", "a, b; c", "¿Qué?", "x\u00a0y"):
        assert M.normalize(s) == REF.normalize(s)


def test_ece_by_hand():
    # bin [0.9, 1]: confidences 0.95, 0.95, accuracy 1/2 → gap 0.45; bin [0.2, 0.3): 0.25, accuracy 0 → 0.25
    conf = [0.95, 0.95, 0.25]
    correct = [True, False, False]
    assert math.isclose(M.ece(conf, correct), 2 / 3 * 0.45 + 1 / 3 * 0.25, rel_tol=1e-12)
    # confidence 1.0 falls in the last bin, not outside
    b = M.reliability_bins([1.0, 0.0], [True, False])
    assert b["count"][-1] == 1 and b["count"][0] == 1
    assert M.ece([1.0, 0.0], [True, False]) == 0.0


def test_perfectly_calibrated_bins_have_zero_ece():
    conf = [0.55] * 20 + [0.85] * 20
    correct = [True] * 11 + [False] * 9 + [True] * 17 + [False] * 3
    assert math.isclose(M.ece(conf, correct), 0.0, abs_tol=1e-12)


def test_correlation_and_auroc_by_hand():
    code = [10, 20, 200, 250]
    wrong = [False, False, True, True]
    # point-biserial by its own formula: (m1 − m0)/s · sqrt(p q)
    x, y = np.array(code, float), np.array(wrong, float)
    m1, m0 = x[y == 1].mean(), x[y == 0].mean()
    assert math.isclose(M.correlation(code, wrong), (m1 - m0) / x.std() * math.sqrt(0.5 * 0.5), rel_tol=1e-12)
    correct = [not w for w in wrong]
    assert M.auroc(code, correct) == 1.0
    assert M.auroc([5, 5], [True, False]) == 0.5
    assert M.auroc([1, 3, 2], [True, True, False]) == 0.5     # wrong (2) beats 1, loses to 3
    assert math.isnan(M.correlation([1, 1, 1], [True, False, True]))
    assert math.isnan(M.auroc([1, 2], [True, True]))


def test_risk_coverage_and_aurc_by_hand():
    code, correct = [1, 2, 2, 3], [True, False, True, False]
    curve = M.risk_coverage(code, correct)
    assert curve == [{"tau": 1.0, "coverage": 0.25, "risk": 0.0}, {"tau": 2.0, "coverage": 0.75, "risk": 1 / 3},
                     {"tau": 3.0, "coverage": 1.0, "risk": 0.5}]
    assert math.isclose(M.aurc(curve), 0.25 * 0 + 0.5 * (1 / 3) + 0.25 * 0.5, rel_tol=1e-12)


def test_aurc_without_ties_is_the_mean_risk_of_the_lowest_code_prefixes():
    rng = np.random.default_rng(1)
    code = rng.permutation(50).tolist()
    correct = (rng.random(50) < 0.6).tolist()
    order = np.argsort(code)
    wrong = ~np.array(correct)[order]
    prefix_risk = [wrong[:i].mean() for i in range(1, 51)]
    assert math.isclose(M.aurc(M.risk_coverage(code, correct)), float(np.mean(prefix_risk)), rel_tol=1e-12)


@pytest.mark.parametrize("seed", range(4))
def test_metrics_equal_the_plain_python_references(seed):
    rng = np.random.default_rng(seed)
    n = 60
    code = rng.integers(0, 12, n).tolist()                           # many ties
    correct = (rng.random(n) < 0.5).tolist()
    conf = np.where(rng.random(n) < 0.1, 1.0, rng.random(n)).tolist()
    answerable = (rng.random(n) < 0.8).tolist()
    s = M.summarize(correct, answerable, conf, code)
    assert math.isclose(s["ece"], REF.ece(conf, correct), abs_tol=1e-12)
    assert math.isclose(s["auroc"], REF.auroc(code, correct), abs_tol=1e-12)
    assert math.isclose(s["code_error_corr"], REF.pearson(code, [not c for c in correct]), abs_tol=1e-12)
    ref_curve = REF.risk_coverage(code, correct)
    for got, want in zip(s["risk_coverage"], ref_curve, strict=True):
        assert got["tau"] == want["tau"] and math.isclose(got["coverage"], want["coverage"])
        assert math.isclose(got["risk"], want["risk"], abs_tol=1e-12)
    assert math.isclose(s["aurc"], REF.aurc(code, correct), abs_tol=1e-12)
    acc = [c for c, a in zip(correct, answerable) if a]
    assert s["accuracy"] == sum(acc) / len(acc) and s["n"] == n
    assert math.isclose(s["mean_confidence"], sum(conf) / n)


def test_summarize_splits_answerable_and_groups():
    s = M.summarize([True, False, True, False], [True, True, False, True], [0.9, 0.6, 0.8, 0.5], [10, 100, 20, 150],
                    ["a", "a", None, "b"])
    assert s["accuracy"] == 1 / 3 and s["accuracy_unanswerable"] == 1.0 and s["accuracy_all"] == 0.5
    assert s["by_group"] == {"": {"n": 1, "accuracy": 1.0}, "a": {"n": 2, "accuracy": 0.5},
                             "b": {"n": 1, "accuracy": 0.0}}
    assert s["mean_code_right"] == 15 and s["mean_code_wrong"] == 125
    assert math.isnan(M.summarize([True], [True], [0.5], [3])["accuracy_unanswerable"])


# ------------------------------------------------------------------------------------------------ end to end

BATCH, NEW, N_ITEMS = 3, 5, 7       # 7 items in batches of 3: the last batch is padded


def _conv(image, text):
    return [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": text}]}]


def _direct(model, proc, convs):
    """`PrismaVL.generate` on the batches eval makes: BATCH at a time, the last padded with its last item."""
    from prisma_jax.host.processing import Processor  # noqa: F401  (proc is one)
    out = []
    for s in range(0, len(convs), BATCH):
        chunk = convs[s:s + BATCH]
        enc = proc(messages=chunk + [chunk[-1]] * (BATCH - len(chunk)))
        r = model.generate(enc["input_ids"], enc["attention_mask"], enc["pixel_values"], enc["image_grid_thw"],
                           max_new_tokens=NEW, eos_token_id=2, return_logits=True)
        for i in range(len(chunk)):
            n = int(r.lengths[i])
            out.append((r.tokens[i, :n], r.codes[i, :n], r.logits[i, :n]))
    return out


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A tiny checkpoint, 7 items (each with a 64×96 image), the direct generation, and `prisma eval` on them."""
    from prisma_jax import PrismaVL
    from prisma_jax.infer import generate as G
    from prisma_jax.apps.cli import main
    from prisma_jax.host.processing import Processor, build_tokenizer

    d = tmp_path_factory.mktemp("eval")
    ckpt = str(d / "ckpt")
    ids = build_tokenizer(ckpt, [f"w{i}" for i in range(115)], min_pixels=64 * 64, max_pixels=64 * 96)
    assert ids["vocab_size"] == 128 and ids["eos_token_id"] == 2
    hf = build_model(tiny_hf_config(text_layers=2, vision_depth=2, deepstack=(1,)), seed=6)
    save_checkpoint(hf, ckpt, table=np.random.default_rng(0).normal(0, 0.3, (256, 64)).astype(np.float32))
    os.makedirs(d / "data" / "img")
    texts = []
    for i in range(N_ITEMS):
        Image.fromarray(np.random.default_rng(i).integers(0, 255, (64, 96, 3), np.uint8)).save(d / f"data/img/{i}.png")
        texts.append(" ".join(f"w{(7 * i + k) % 115}" for k in range(1 + i % 3)))
    model, proc = PrismaVL.from_pretrained(ckpt), Processor.from_pretrained(ckpt)
    direct = _direct(model, proc, [_conv(str(d / f"data/img/{i}.png"), t) for i, t in enumerate(texts)])
    pred = [proc.decode(t[:-1] if t[-1] == 2 else t).strip() for t, _, _ in direct]
    abstain = pred[5] if M.normalize(pred[5]) else "w3"
    items = []
    for i, t in enumerate(texts):
        item = {"id": f"q{i}", "messages": _conv(f"img/{i}.png", t), "group": "even" if i % 2 == 0 else "odd",
                "note": [i]}
        if i >= 5:                                   # unanswerable: the expected answer is the abstention text
            item["answerable"] = False
        else:                                        # right when the reference is the model's own answer
            item["answer"] = pred[i] if i % 2 == 0 and M.normalize(pred[i]) else "w114 w113"
        items.append(item)
    data = d / "data" / "items.jsonl"
    data.write_text("".join(json.dumps(it) + "\n" for it in items))
    out = d / "out"
    before = G.prefill._cache_size(), G.decode._cache_size()
    rc = main(["eval", "--model", ckpt, "--data", str(data), "--out", str(out), "--batch", str(BATCH),
               "--max-new-tokens", str(NEW), "--abstain-text", abstain, "--no-progress"])
    assert rc == 0
    programs = G.prefill._cache_size() - before[0], G.decode._cache_size() - before[1]
    rows = [json.loads(line) for line in (out / "answers.jsonl").read_text().splitlines()]
    return dict(d=d, ckpt=ckpt, data=str(data), out=out, items=items, direct=direct, rows=rows, abstain=abstain,
                programs=programs, proc=proc)


def test_answers_equal_generate_run_directly(run):
    rows, proc = run["rows"], run["proc"]
    assert [r["id"] for r in rows] == [f"q{i}" for i in range(N_ITEMS)] and [r["index"] for r in rows] == list(range(7))
    for r, (toks, codes, logits), item in zip(rows, run["direct"], run["items"], strict=True):
        assert r["token_ids"] == toks.tolist() and r["codes"] == codes.tolist()
        assert r["tokens"] == proc.tokenizer.convert_ids_to_tokens(toks.tolist())
        z = logits.astype(np.float64)
        p = np.exp(z - z.max(-1, keepdims=True))
        p = (p / p.sum(-1, keepdims=True))[np.arange(len(toks)), toks]
        np.testing.assert_allclose(r["probs"], p, rtol=1e-5)     # float32 log-softmax in the loop vs float64 here
        assert math.isclose(r["confidence"], float(np.prod(r["probs"])), rel_tol=1e-12)
        assert math.isclose(r["confidence"], float(np.prod(p)), rel_tol=1e-4) and r["code"] == max(codes.tolist())
        assert r["ended"] == (toks[-1] == 2)
        assert r["prediction"] == proc.decode(toks[:-1] if r["ended"] else toks).strip()
        ref = item.get("answer", run["abstain"])
        assert r["reference"] == ref and r["answerable"] == ("answer" in item)
        assert r["correct"] == (REF.normalize(r["prediction"]) == REF.normalize(ref))
        assert r["group"] == item["group"] and r["meta"] == {"note": item["note"]}
    assert 0 < sum(r["correct"] for r in rows) < len(rows)               # both right and wrong answers


def test_metrics_json_is_what_the_answers_give(run):
    out, rows = run["out"], run["rows"]
    assert sorted(os.listdir(out)) == ["answers.jsonl", "metrics.json", "reliability.png", "risk_coverage.png"]
    for png in ("reliability.png", "risk_coverage.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not [p for p in os.listdir(run["d"]) if ".tmp-" in p]
    m = json.loads((out / "metrics.json").read_text())
    assert all(k in m for k in KEYS)
    correct = [r["correct"] for r in rows]
    conf = [r["confidence"] for r in rows]
    code = [r["code"] for r in rows]
    ans = [c for c, r in zip(correct, rows) if r["answerable"]]
    una = [c for c, r in zip(correct, rows) if not r["answerable"]]
    assert m["n"] == N_ITEMS and m["accuracy"] == sum(ans) / len(ans) and m["accuracy_unanswerable"] == sum(una) / 2
    assert m["accuracy_all"] == sum(correct) / N_ITEMS
    assert math.isclose(m["ece"], REF.ece(conf, correct), abs_tol=1e-12)
    assert math.isclose(m["auroc"], REF.auroc(code, correct), abs_tol=1e-12)
    wrong = [not c for c in correct]
    if np.std(code) > 0:
        assert math.isclose(m["code_error_corr"], REF.pearson(code, wrong), abs_tol=1e-12)
    assert math.isclose(m["aurc"], REF.aurc(code, correct), abs_tol=1e-12)
    assert m["risk_coverage"] == json.loads(json.dumps(REF.risk_coverage([float(c) for c in code], correct)))
    assert math.isclose(m["mean_confidence"], sum(conf) / N_ITEMS)
    assert sum(m["reliability"]["count"]) == N_ITEMS
    assert m["by_group"]["even"]["n"] == 4 and m["run"]["batch"] == BATCH


def test_one_program_serves_every_batch(run):
    """Three batches, the last padded to the same shape: at most one prefill and one decode program compiled
    (none when an earlier test in this process compiled the same shapes)."""
    assert run["programs"][0] <= 1 and run["programs"][1] <= 1, run["programs"]


def _same_answers(a, b):
    for x, y in zip(a, b, strict=True):
        assert x["token_ids"] == y["token_ids"] and x["codes"] == y["codes"] and x["correct"] == y["correct"]
        np.testing.assert_allclose(x["probs"], y["probs"], rtol=1e-5)


def test_an_orbax_checkpoint_answers_the_same(run):
    from prisma_jax.apps.cli import main
    d = run["d"]
    assert main(["convert", "hf-to-orbax", run["ckpt"], str(d / "orbax")]) == 0
    m = __import__("prisma_jax.apps.evaluation", fromlist=["evaluate"]).evaluate(
        str(d / "orbax"), run["data"], str(d / "out_orbax"), batch=BATCH, max_new_tokens=NEW,
        abstain_text=run["abstain"], progress=False)
    rows = [json.loads(line) for line in (d / "out_orbax" / "answers.jsonl").read_text().splitlines()]
    _same_answers(rows, run["rows"])
    assert m["accuracy"] == json.loads((run["out"] / "metrics.json").read_text())["accuracy"]


def test_a_two_device_mesh_answers_the_same(run):
    d = run["d"]
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
    p = subprocess.run([sys.executable, "-m", "prisma_jax.apps.cli", "eval", "--model", run["ckpt"], "--data", run["data"],
                        "--out", str(d / "out_mesh"), "--batch", str(BATCH), "--max-new-tokens", str(NEW),
                        "--abstain-text", run["abstain"], "--mesh", "data=2", "--no-progress"],
                       env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = [json.loads(line) for line in (d / "out_mesh" / "answers.jsonl").read_text().splitlines()]
    _same_answers(rows, run["rows"])
    m = json.loads((d / "out_mesh" / "metrics.json").read_text())
    assert m["run"]["mesh"] == {"data": 2, "fsdp": 1, "tensor": 1}


# ------------------------------------------------------------------------------------------------ bad input


def _item(**kw):
    return json.dumps({"messages": _conv("img/0.png", "w1"), "answer": "w2", **kw})


@pytest.mark.parametrize("lines,extra,match", [
    (None, [], "items.jsonl: no such file"),
    ([_item(), "", "{not json"], [], "items.jsonl:3: malformed JSON"),
    ([_item(), json.dumps({"messages": _conv("img/0.png", "w1")})], [], "items.jsonl:2: no 'answer'"),
    ([_item(answerable=False)], [], "expects the abstention text \"I don't know\", but its 'answer' is 'w2'"),
    ([_item(answerable="no")], [], "'answerable' must be true or false"),
    ([json.dumps({"messages": _conv("img/0.png", "w1") + [{"role": "assistant", "content": "w2"}], "answer": "w2"})],
     [], "items.jsonl:1: the last message is the assistant's"),
    ([json.dumps({"messages": _conv("img/missing.png", "w1"), "answer": "w2"})], [], "image not found"),
    ([_item(answer="?!")], [], "is empty once normalised"),
    ([], [], "no items"),
    ([_item()], ["--batch", "0"], "--batch must be an integer ≥ 1, got 0"),
    ([_item()], ["--mesh", "data:2"], "--mesh 'data:2': expected a preset"),
    ([_item()], ["--mesh", "data=3"], "1 devices are not a multiple of 3"),
    ([_item()], ["OUT_EXISTS"], "exists; give a new directory"),
])
def test_bad_input_is_one_line_and_leaves_no_output(run, tmp_path, capsys, lines, extra, match):
    from prisma_jax.apps.cli import main
    data = run["d"] / "data" / "items.jsonl" if lines is None else None
    if lines is not None:
        data = tmp_path / "items.jsonl"
        data.write_text("\n".join(lines) + ("\n" if lines else ""))
        os.symlink(run["d"] / "data" / "img", tmp_path / "img")
    else:
        data = tmp_path / "items.jsonl"                                   # missing
    out = tmp_path / "out"
    if extra == ["OUT_EXISTS"]:
        out.mkdir()
        (out / "keep").write_text("x")
        extra = []
    before = sorted(os.listdir(tmp_path))
    assert main(["eval", "--model", run["ckpt"], "--data", str(data), "--out", str(out), "--no-progress", *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("prisma eval: error:") and match in err[0], err
    assert sorted(os.listdir(tmp_path)) == before                       # no output, no staging directory left
