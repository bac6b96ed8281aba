"""The training loop end to end: straight vs interrupted-and-resumed runs (bit for bit), SIGTERM, the data
pipeline on conversations with images, and every bad input of issue 6 (one clear error, nothing lost)."""
import json
import os
import pickle
import signal
import subprocess
import sys
import time

import numpy as np
import jax
import pytest
import yaml

from prisma_jax.apps.cli import main as cli_main
from prisma_jax.core.config import ConfigError
from train.flops import step_flops
from train.config import config_from_raw, load_train_config
from train.loop import run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SFT = os.path.join(ROOT, "configs", "tiny_sft.yaml")


def small(**over):
    raw = yaml.safe_load(open(SFT))
    raw["train"].update(steps=8, batch_size=4, seq_len=40)
    raw["checkpoint"].update(every=2)
    for k, v in over.items():
        sec, key = k.split("__")
        raw[sec][key] = v
    return config_from_raw(raw)


def losses(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_resume_reproduces_the_straight_run_bit_for_bit(tmp_path):
    cfg = small()
    straight = str(tmp_path / "straight")
    run(cfg, straight, progress=False, log=lambda *_: None)
    resumed = str(tmp_path / "resumed")
    run(cfg, resumed, stop_at=4, progress=False, log=lambda *_: None)
    assert [m["step"] for m in losses(resumed)] == [1, 2, 3, 4]
    with open(os.path.join(resumed, "metrics.jsonl"), "a") as f:    # a step logged after checkpoint 4, then killed
        f.write(json.dumps({"step": 5, "loss": 1.0, "step_time": 2.5}) + "\n")
    logged = []
    run(cfg, resumed, progress=False, log=logged.append)
    a, b = losses(straight), losses(resumed)
    assert [m["step"] for m in a] == [m["step"] for m in b] == list(range(1, 9))
    for k in ("loss", "grad_norm", "lr", "code_mean", "code_low", "code_high", "tokens"):
        assert [m[k] for m in a] == [m[k] for m in b], k
    assert a[-1]["loss"] < a[0]["loss"]
    for m in a:
        assert {"step", "loss", "grad_norm", "lr", "tokens_per_sec", "code_mean", "code_low", "code_high"} <= set(m)
    assert sorted(d for d in os.listdir(os.path.join(straight, "checkpoints")) if d.isdigit()) == ["6", "8"]
    assert any(f.startswith("events") for f in os.listdir(os.path.join(straight, "tb")))
    # model TFLOP/s a device (train/flops.py over the step time; no MFU on a CPU), and the goodput split
    flops = step_flops(cfg)["total"]
    for m in a:
        assert m["tflops"] == pytest.approx(flops / m["step_time"] / jax.device_count() / 1e12, rel=1e-9)
        assert "mfu" not in m
    with open(os.path.join(resumed, "goodput.json")) as f:
        g = json.load(f)
    assert g["lost_to_restarts_s"] == 2.5 and 0 < g["goodput"] < 1 and g["compile_s"] > 0
    assert g["productive_s"] + g["compile_s"] + g["data_wait_s"] + g["checkpoint_s"] <= g["wall_s"] * 1.01
    assert any(line.startswith("goodput ") and "lost to restarts" in line for line in logged)


def test_sigterm_saves_a_restorable_checkpoint_and_exits_0(tmp_path):
    wd = str(tmp_path / "run")
    cmd = [sys.executable, "-m", "prisma_jax.apps.cli", "train", "--config", SFT, "--workdir", wd, "--no-progress",
           "train.steps=400", "train.batch_size=2", "train.seq_len=16", "train.grad_accum=1",
           "data.source=synthetic", "data.max_images=0", "checkpoint.every=1000"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    path = os.path.join(wd, "metrics.jsonl")
    deadline = time.time() + 1200
    while time.time() < deadline and proc.poll() is None:
        if os.path.isfile(path) and len(open(path).readlines()) >= 2:
            break
        time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-2000:]
    last = losses(wd)[-1]["step"]
    assert 2 <= last < 400 and f"SIGTERM: saved step {last}" in out + err
    # the newest checkpoint is the SIGTERM one (Orbax also keeps its first-step save)
    assert max(int(d) for d in os.listdir(os.path.join(wd, "checkpoints")) if d.isdigit()) == last
    r = subprocess.run(cmd + ["--steps", str(last + 1)], cwd=ROOT, capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"resuming from step {last}" in r.stdout
    assert [m["step"] for m in losses(wd)] == list(range(1, last + 2))


def test_sigterm_during_a_save_call_stops_after_the_next_step_and_saves_it(tmp_path, monkeypatch):
    """The loop reads the preemption flag once a step: a SIGTERM that lands inside step 2's (skipped) save call
    is acted on after step 3, which is saved, and never reported as a save of step 2 that did not happen."""
    import orbax.checkpoint as ocp
    original = ocp.CheckpointManager.save

    def save(self, step, *a, **k):
        if step == 2:
            os.kill(os.getpid(), signal.SIGTERM)       # the handler runs here, inside the save call
        return original(self, step, *a, **k)

    monkeypatch.setattr(ocp.CheckpointManager, "save", save)
    cfg = small(train__batch_size=2, train__seq_len=16, checkpoint__every=1000)
    wd = str(tmp_path / "run")
    said, before = [], signal.getsignal(signal.SIGTERM)
    last = run(cfg, wd, progress=False, log=said.append)
    assert last["step"] == 3 and [m["step"] for m in losses(wd)] == [1, 2, 3]
    assert said[-2:-1] == ["SIGTERM: saved step 3, exiting"] and said[-1].startswith("goodput ")
    assert sorted(d for d in os.listdir(os.path.join(wd, "checkpoints")) if d.isdigit()) == ["1", "3"]
    assert signal.getsignal(signal.SIGTERM) is before      # the caller's handler is back


# ------------------------------------------------------------------------------------------- bad inputs


def write_jsonl(tmp_path, lines, image=True):
    from PIL import Image
    from prisma_jax.host.processing import build_tokenizer
    from train.tiny_sft import WORDS
    d = tmp_path / "data"
    d.mkdir(exist_ok=True)
    if image:
        Image.new("RGB", (40, 30), (200, 10, 10)).save(d / "red.png")
    proc = str(d / "proc")
    build_tokenizer(proc, WORDS, min_pixels=64 * 64, max_pixels=128 * 128)
    with open(d / "train.jsonl", "w") as f:
        f.write("\n".join(lines) + "\n")
    return str(d / "train.jsonl"), proc


GOOD = json.dumps({"messages": [
    {"role": "user", "content": [{"type": "image", "image": "red.png"}, {"type": "text", "text": "what is this ?"}]},
    {"role": "assistant", "content": "a red square ."}]})
SHORT = json.dumps({"messages": [{"role": "user", "content": "count to two"},
                                 {"role": "assistant", "content": "one two"}]})
LONG = json.dumps({"messages": [{"role": "user", "content": "count to six " * 6},
                                {"role": "assistant", "content": "one two three four five six"}]})


def jsonl_cfg(path, proc, **data):
    raw = yaml.safe_load(open(SFT))
    raw["train"].update(steps=2, batch_size=2, seq_len=24, grad_accum=1)
    raw["data"] = {"source": "jsonl", "path": path, "processor": proc, "image_size": 64, "max_images": 1, **data}
    return config_from_raw(raw)


def test_jsonl_pipeline_targets_images_and_overlong_policy(tmp_path):
    from prisma_jax.host.processing import Processor
    from train.data import build, index_jsonl
    path, proc = write_jsonl(tmp_path, [GOOD, LONG, SHORT])
    processor = Processor.from_pretrained(proc)
    recs, info = index_jsonl(jsonl_cfg(path, proc), path, processor)
    assert (info.records, info.truncated) == (3, 1) and len(recs[1].ids) == 24
    recs, info = index_jsonl(jsonl_cfg(path, proc, overlong="drop"), path, processor)
    assert (info.records, info.dropped_overlong) == (2, 1)
    ds, _ = build(jsonl_cfg(path, proc, overlong="drop", shuffle=False), str(tmp_path / "wd"))
    b = next(iter(ds))
    ids, tg = b.input_ids[0, 0], b.targets[0, 0]
    tok = processor.tokenizer.convert_tokens_to_ids
    # supervised: the assistant answer and its <|im_end|>, each target the next token
    want = [tok(w) for w in "a red square .".split()] + [tok("<|im_end|>")]
    assert list(tg[tg >= 0]) == want and list(ids[1:][tg[:-1] >= 0]) == want
    assert b.pixel_values.shape == (1, 2, 16, 1536) and np.abs(b.pixel_values[0, 0]).sum() > 0
    assert not b.pixel_values[0, 1].any()                          # the text-only row's slot is zeros
    assert (ids == 5).sum() == 4


def test_image_cache_gives_the_same_batches_and_processes_each_image_once(tmp_path, monkeypatch):
    """data.image_cache_mb: over three epochs of 4 images the batches equal the uncached pipeline's bit for bit;
    with room for all, each image is processed once; with room for one, the cache stays within its budget; a
    pickled cache (grain worker processes) starts empty."""
    from PIL import Image

    from train import data
    lines = []
    (tmp_path / "data").mkdir()
    for i, rgb in enumerate([(200, 10, 10), (10, 200, 10), (10, 10, 200), (90, 90, 20)]):
        Image.new("RGB", (64, 64), rgb).save(tmp_path / "data" / f"im{i}.png")
        lines.append(GOOD.replace("red.png", f"im{i}.png"))
    path, proc = write_jsonl(tmp_path, lines, image=False)
    calls = []
    real = data.LoadImages._pixels
    monkeypatch.setattr(data.LoadImages, "_pixels", lambda self, rec: calls.append(rec.images) or real(self, rec))

    def batches(**over):
        calls.clear()
        ds, _ = data.build(jsonl_cfg(path, proc, num_threads=0, **over), str(tmp_path / "wd"))
        it = iter(ds)
        return [next(it) for _ in range(6)], len(calls)                  # 12 rows: 3 epochs of 4 records

    plain, n_plain = batches()
    cached, n_cached = batches(image_cache_mb=1)
    assert (n_plain, n_cached) == (12, 4)
    for a, b in zip(plain, cached):
        for x, y in zip(a[:6], b[:6]):
            np.testing.assert_array_equal(x, y)
    one = data.PixelCache(16 * 1536 * 4)                                  # room for one image's pixels
    for k in range(3):
        px = one.get(k, lambda: np.full((16, 1536), k, np.float32))
        assert px[0, 0] == k and not px.flags.writeable
    assert list(one.items) == [2] and one.used == px.nbytes
    copy = pickle.loads(pickle.dumps(one))                                # for grain worker processes: empty
    assert copy.budget == one.budget and not copy.items and copy.used == 0


def test_malformed_line_names_file_and_line_or_is_skipped(tmp_path):
    from prisma_jax.host.processing import Processor
    from train.data import index_jsonl
    path, proc = write_jsonl(tmp_path, [GOOD, "{not json", GOOD])
    processor = Processor.from_pretrained(proc)
    with pytest.raises(ValueError, match=rf"{path}:2: malformed JSON"):
        index_jsonl(jsonl_cfg(path, proc), path, processor)
    recs, info = index_jsonl(jsonl_cfg(path, proc, on_malformed="skip"), path, processor)
    assert (info.records, info.skipped_malformed) == (2, 1)
    # a run names it in WORKDIR/skipped.jsonl and trains on
    wd = str(tmp_path / "run")
    last = run(jsonl_cfg(path, proc, on_malformed="skip"), wd, progress=False, log=lambda *_: None)
    assert last["step"] == 2 and last["data_skipped"] == 0
    with open(os.path.join(wd, "skipped.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    assert [(r["file"], r["line"]) for r in rows] == [(path, 2)] and "malformed JSON" in rows[0]["why"]


def test_missing_image_is_a_clear_error(tmp_path):
    from prisma_jax.host.processing import Processor
    from train.data import index_jsonl
    path, proc = write_jsonl(tmp_path, [GOOD, GOOD.replace("red.png", "gone.png")])
    with pytest.raises(ValueError, match=r"train.jsonl:2: image not found: .*gone.png"):
        index_jsonl(jsonl_cfg(path, proc), path, Processor.from_pretrained(proc))


def test_unknown_config_keys_are_rejected_by_name(tmp_path, capsys):
    with pytest.raises(ConfigError, match=r"train.stepz"):
        load_train_config(SFT, ["train.stepz=3"])
    with pytest.raises(ConfigError, match=r"optimizer.learning_rate"):
        load_train_config(SFT, ["optimizer.learning_rate=3"])
    with pytest.raises(ConfigError, match=r"train.steps: expected an integer"):
        load_train_config(SFT, ["train.steps=many"])
    assert cli_main(["train", "--config", SFT, "--workdir", str(tmp_path), "data.sauce=x"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "data.sauce" in err[0]


def test_workdir_of_a_different_model_is_refused_and_kept(tmp_path):
    wd = str(tmp_path / "run")
    cfg = small(train__steps=2, checkpoint__every=1, data__source="synthetic", data__max_images=0)
    run(cfg, wd, progress=False, log=lambda *_: None)
    before = sorted(os.listdir(os.path.join(wd, "checkpoints")))
    raw = yaml.safe_load(open(SFT))
    raw["model"]["text"]["intermediate_size"] = 128
    raw["train"].update(steps=4, batch_size=4, seq_len=40)
    raw["data"].update(source="synthetic", max_images=0)
    with pytest.raises(ValueError, match=r"different model.*intermediate_size"):
        run(config_from_raw(raw), wd, progress=False, log=lambda *_: None)
    assert sorted(os.listdir(os.path.join(wd, "checkpoints"))) == before
    assert [m["step"] for m in losses(wd)] == [1, 2]


def test_train_to_hf_exports_a_checkpoints_params(tmp_path, capsys, monkeypatch):
    """`prisma convert train-to-hf`: the chosen step's params, read back through the Hugging Face loader, equal
    the ones Orbax holds for that step; bad steps, workdirs and destinations are refused by name."""
    import orbax.checkpoint as ocp

    from prisma_jax.checkpoint.loading import load_hf

    wd = str(tmp_path / "run")
    cfg = small(train__steps=2, checkpoint__every=1, data__source="synthetic", data__max_images=0)
    run(cfg, wd, progress=False, log=lambda *_: None)
    mngr = ocp.CheckpointManager(os.path.join(wd, "checkpoints"), item_names=("state", "data", "meta"))
    want = {s: mngr.restore(s, args=ocp.args.Composite(state=ocp.args.StandardRestore()))["state"]["params"]
            for s in (1, 2)}
    mngr.close()
    for step in (1, 2):
        dst = str(tmp_path / f"hf{step}")
        assert cli_main(["convert", "train-to-hf", wd, dst, "--step", str(step), "--eos-token-id", "2"]) == 0
        got, got_cfg = load_hf(dst, dtype="float32")
        assert got_cfg == cfg.model
        flat_w, flat_g = jax_leaves(want[step]), jax_leaves(got)
        assert len(flat_w) == len(flat_g)
        for (pw, w), (pg, g) in zip(flat_w, flat_g):
            assert pw == pg
            np.testing.assert_array_equal(np.asarray(w), g, err_msg=pw)
        assert json.load(open(os.path.join(dst, "generation_config.json")))["eos_token_id"] == 2
    assert not np.array_equal(want[1]["lm_head"]["kernel"], want[2]["lm_head"]["kernel"])
    capsys.readouterr()
    bad = [([wd, str(tmp_path / "x"), "--step", "7"], "no checkpoint at step 7"),
           ([str(tmp_path / "nowhere"), str(tmp_path / "y")], "no checkpoints/ directory"),
           ([wd, str(tmp_path / "hf1")], "already exists")]
    for args, msg in bad:
        assert cli_main(["convert", "train-to-hf", *args]) != 0
        assert msg in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "x") and not os.path.exists(tmp_path / "y")
    assert not [n for n in os.listdir(tmp_path) if ".tmp-" in n]

    # benchmarks/convert_memory.py writes a training checkpoint leaf by leaf and chunk by chunk: written from
    # step 2's params in small chunks (many a leaf), Orbax's tree metadata is the loop's, Orbax restores the
    # params, and train-to-hf (in regions of a few chunks: rows written whole and in part) gives the same bytes
    import filecmp
    import importlib.util

    from prisma_jax.core.trees import get_path
    from train import export as export_mod

    spec = importlib.util.spec_from_file_location("convert_memory", os.path.join(ROOT, "benchmarks", "convert_memory.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    written = str(tmp_path / "written")
    params = {k: np.asarray(v) for k, v in jax_leaves(want[2])}
    info = bench.write_train_checkpoint(written, cfg, lambda p, i: get_path(want[2], p)[i], step=2, chunk_bytes=2048)
    assert info["params"] == sum(v.nbytes for v in params.values()) and info["largest_chunk"] <= 2048
    meta = [json.load(open(os.path.join(w, "checkpoints", "2", "state", "_METADATA"))) for w in (wd, written)]
    assert meta[0] == meta[1]
    mngr = ocp.CheckpointManager(os.path.join(written, "checkpoints"), item_names=("state", "data", "meta"))
    back = mngr.restore(2, args=ocp.args.Composite(state=ocp.args.StandardRestore()))["state"]["params"]
    mngr.close()
    assert [k for k, _ in jax_leaves(back)] == list(params)
    for (k, v) in jax_leaves(back):
        np.testing.assert_array_equal(np.asarray(v), params[k], err_msg=k)
    monkeypatch.setattr(export_mod, "REGION_BYTES", 6144)
    assert cli_main(["convert", "train-to-hf", written, str(tmp_path / "hf_written"), "--eos-token-id", "2"]) == 0
    assert filecmp.cmp(tmp_path / "hf2" / "model.safetensors", tmp_path / "hf_written" / "model.safetensors",
                       shallow=False)
    export_mod.write_hf(want[2], cfg.model, str(tmp_path / "hf_tree"))      # params in memory (the demo's path)
    assert filecmp.cmp(tmp_path / "hf2" / "model.safetensors", tmp_path / "hf_tree" / "model.safetensors",
                       shallow=False)
    os.remove(os.path.join(written, "checkpoints", "2", "state", "_METADATA"))
    capsys.readouterr()
    assert cli_main(["convert", "train-to-hf", written, str(tmp_path / "z")]) != 0
    assert "no readable Orbax _METADATA" in capsys.readouterr().err and not os.path.exists(tmp_path / "z")


def test_piece_writer_writes_the_streaming_writers_bytes_and_refuses_gaps(tmp_path):
    """safetensors_io.PieceWriter: pieces in any order (whole rows, parts of rows) give write_streaming's file;
    a misshapen piece or a tensor left short is an error naming it."""
    from prisma_jax.checkpoint.safetensors import PieceWriter, write_streaming

    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((6, 5)).astype(np.float32), rng.standard_normal(7).astype(np.float32)
    specs = [("a", a.shape, np.float32), ("b", b.shape, np.float32)]
    write_streaming(str(tmp_path / "ref"), specs, lambda k: [{"a": a, "b": b}[k]], {"format": "pt"})
    w = PieceWriter(str(tmp_path / "pieces"), specs, {"format": "pt"})
    w.put("b", b[3:], (slice(3, 7),))
    w.put("a", a[2:4, 1:], (slice(2, 4), slice(1, 5)))
    w.put("a", a[4:], (slice(4, 6),))
    w.put("a", a[:2], (slice(0, 2), slice(0, 5)))
    w.put("a", a[2:4, :1], (slice(2, 4), slice(0, 1)))
    w.put("b", b[:3], (slice(0, 3),))
    w.close()
    assert open(tmp_path / "ref", "rb").read() == open(tmp_path / "pieces", "rb").read()
    w = PieceWriter(str(tmp_path / "short"), specs)
    with pytest.raises(ValueError, match=r"tensor 'a': a block of shape \(2, 5\)"):
        w.put("a", a[:2], (slice(0, 3),))
    w.put("a", a, ())
    w.put("b", b[:6], (slice(0, 6),))
    with pytest.raises(ValueError, match=r"tensor 'b' received 24 bytes, expected 28"):
        w.close()


def jax_leaves(tree):
    import jax
    return [(jax.tree_util.keystr(p), x) for p, x in jax.tree_util.tree_leaves_with_path(tree)]


def test_a_conversation_without_an_assistant_reply_is_a_clear_error(tmp_path):
    from prisma_jax.host.processing import Processor
    from train.data import index_jsonl
    path, proc = write_jsonl(tmp_path, [GOOD, json.dumps({"messages": [{"role": "user", "content": "count to two"}]})])
    with pytest.raises(ValueError, match=r"train.jsonl:2: no assistant message \(nothing to supervise\)"):
        index_jsonl(jsonl_cfg(path, proc), path, Processor.from_pretrained(proc))
