"""Non-finite steps (train/step.py `skip_nonfinite`, train/loop.py): a step whose loss or gradient norm is NaN
or inf is not applied, counted and logged; `train.max_bad_steps` of them in a row stop the run with
`NonFiniteError` (`prisma train` exits 3); nothing non-finite is saved. Also `checkpoint.keep_period` and a
resume over a torn metrics.jsonl line.

NaN is injected through the data: the pixels of chosen steps' batches are NaN (tiny_sft rows hold images), so
the real jitted step sees a NaN loss, deterministically.

    python tests/test_nonfinite.py mesh WORKDIR OUT   # the 8-device worker (XLA_FLAGS set by the test)
"""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import yaml

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
SFT = os.path.join(ROOT, "configs", "tiny_sft.yaml")


def small(**over):
    from train.config import config_from_raw
    raw = yaml.safe_load(open(SFT))
    raw["train"].update(steps=6, batch_size=4, seq_len=40)
    raw["checkpoint"].update(every=1, keep=10)
    for k, v in over.items():
        sec, key = k.split("__")
        raw[sec][key] = v
    return config_from_raw(raw)


def poison(monkeypatch, bad_steps):
    """Make the data of global steps `bad_steps` (1-based, of a run from scratch) NaN pixels."""
    from train import loop

    real = loop.data_mod.build

    class It:
        def __init__(self, it):
            self.it, self.n = it, 0

        def __next__(self):
            b = next(self.it)
            self.n += 1
            return b._replace(pixel_values=np.full_like(b.pixel_values, np.nan)) if self.n in bad_steps else b

        def get_state(self):
            return self.it.get_state()

        def set_state(self, s):                        # grain's restore hands a non-grain iterator bytes
            return self.it.set_state(json.loads(s) if isinstance(s, bytes) else s)

        def __getattr__(self, name):                   # start_prefetch, ...
            return getattr(self.it, name)

    class Ds:
        def __init__(self, ds):
            self.ds = ds

        def __iter__(self):
            return It(iter(self.ds))

    monkeypatch.setattr(loop.data_mod, "build", lambda *a, **k: (lambda ds, info: (Ds(ds), info))(*real(*a, **k)))


def metrics(wd):
    with open(os.path.join(wd, "metrics.jsonl")) as f:
        return [json.loads(ln) for ln in f]


def states(wd, steps):
    import orbax.checkpoint as ocp
    mngr = ocp.CheckpointManager(os.path.join(wd, "checkpoints"), item_names=("state", "data", "meta"))
    try:
        return {s: mngr.restore(s, args=ocp.args.Composite(state=ocp.args.StandardRestore()))["state"]
                for s in steps}
    finally:
        mngr.close()


def tree_equal(a, b) -> bool:
    import jax
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(la, lb))


def finite(tree) -> bool:
    import jax
    return all(np.all(np.isfinite(np.asarray(x))) for x in jax.tree.leaves(tree))


def test_the_step_skips_a_nan_batch_on_the_device_and_the_check_can_be_off(tmp_path):
    """The jitted step itself: a NaN batch leaves params and optimizer state bit for bit, advances step and RNG,
    says `skipped` 1; a good batch says 0; with train.max_bad_steps null there is no check (no metric)."""
    import jax

    from train import data, step as S
    cfg = small(optimizer__warmup_steps=0)            # (with warmup the first applied step's lr is 0)
    batch = next(iter(data.build(cfg, str(tmp_path))[0]))
    bad = batch._replace(pixel_values=np.full_like(batch.pixel_values, np.nan))
    state = S.init_state(cfg)
    fn = jax.jit(S.make_train_step(cfg, state.params))
    after, m = fn(state, bad)
    assert int(m["skipped"]) == 1 and np.isnan(float(m["loss"])) and np.isfinite(float(m["param_norm"]))
    assert tree_equal(after.params, state.params) and tree_equal(after.opt_state, state.opt_state)
    assert int(after.step) == 1 and not np.array_equal(after.rng, state.rng)
    good, m = fn(after, batch)
    assert int(m["skipped"]) == 0 and np.isfinite(float(m["loss"])) and not tree_equal(good.params, state.params)
    off = small(optimizer__warmup_steps=0, train__max_bad_steps=None)
    _, m = jax.jit(S.make_train_step(off, state.params))(state, batch)
    assert "skipped" not in m and "param_norm" not in m


def test_one_nan_step_is_skipped_counted_and_training_goes_on(tmp_path, monkeypatch):
    from train.loop import run
    poison(monkeypatch, {3})
    wd = str(tmp_path / "run")
    said = []
    last = run(small(), wd, progress=False, log=said.append)
    ms = metrics(wd)
    assert [m["step"] for m in ms] == [1, 2, 3, 4, 5, 6] and last["step"] == 6
    assert [m["skipped"] for m in ms] == [0, 0, 1, 0, 0, 0]
    assert [m["skipped_total"] for m in ms] == [0, 0, 1, 1, 1, 1]
    assert np.isnan(ms[2]["loss"]) and all(np.isfinite(m["loss"]) for i, m in enumerate(ms) if i != 2)
    assert any("step 3:" in s and "update skipped (1 in a row, 1 in all)" in s for s in said)
    st = states(wd, [2, 3, 4])
    assert tree_equal(st[3]["params"], st[2]["params"]) and tree_equal(st[3]["opt_state"], st[2]["opt_state"])
    assert int(st[3]["step"]) == 3 and not tree_equal(st[4]["params"], st[3]["params"])
    assert all(finite(s["params"]) for s in st.values())


def test_nan_again_and_again_stops_with_a_clear_error_and_exit_code_3(tmp_path, monkeypatch, capsys):
    """From step 3 on every batch is NaN: with max_bad_steps 3 the run stops at step 5, exit code 3, the error
    naming the step and the count; the checkpoints (also those written during the bad run) hold step 2's finite
    params; resuming the workdir goes on counting (the counts travel in the checkpoint)."""
    from prisma_jax.apps.cli import main as cli_main
    from train.loop import NonFiniteError, run
    poison(monkeypatch, set(range(3, 100)))
    wd = str(tmp_path / "run")
    args = ["train", "--config", SFT, "--workdir", wd, "--no-progress", "train.steps=6", "train.batch_size=4",
            "train.seq_len=40", "train.max_bad_steps=3", "checkpoint.every=1", "checkpoint.keep=10"]
    assert cli_main(args) == 3
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "step 5: 3 steps in a row had a non-finite loss or gradient norm" in err[0], err
    assert "train.max_bad_steps 3" in err[0]
    ms = metrics(wd)
    assert [(m["step"], m["skipped"], m["skipped_total"]) for m in ms] == [(1, 0, 0), (2, 0, 0), (3, 1, 1),
                                                                           (4, 1, 2), (5, 1, 3)]
    saved = sorted(int(d) for d in os.listdir(os.path.join(wd, "checkpoints")) if d.isdigit())
    assert saved == [1, 2, 3, 4]                                # step 5 (the failing one) is not saved
    st = states(wd, saved)
    assert all(finite(s["params"]) for s in st.values())
    assert tree_equal(st[4]["params"], st[2]["params"])
    # a resume (the data iterator restarts: its steps 1, 2, ... are global 5, 6, ...) fails after one more skip
    poison(monkeypatch, set(range(1, 100)))
    cfg = small(train__max_bad_steps=3)
    with pytest.raises(NonFiniteError, match=r"step 5: 3 steps in a row .* 3 skipped in all"):
        run(cfg, wd, progress=False, log=lambda *_: None)


def test_non_finite_params_are_never_saved(tmp_path):
    """optimizer.lr 1e30: the gradients stay finite but step 2's update overflows the params to inf; the run
    stops there with exit code 3 and step 2 is not saved (the loop checks the params' norm before saving)."""
    from prisma_jax.apps.cli import main as cli_main
    wd = str(tmp_path / "run")
    assert cli_main(["train", "--config", SFT, "--workdir", wd, "--no-progress", "optimizer.lr=1.0e+30",
                     "train.steps=6", "train.batch_size=2", "train.seq_len=16", "train.grad_accum=1",
                     "data.source=synthetic", "data.max_images=0", "checkpoint.every=1"]) == 3
    assert not np.isfinite(metrics(wd)[-1]["param_norm"])
    saved = sorted(int(d) for d in os.listdir(os.path.join(wd, "checkpoints")) if d.isdigit())
    assert saved == [1] and finite(states(wd, saved)[1]["params"])


def test_keep_period_keeps_every_multiple_for_good(tmp_path):
    from train.loop import run
    cfg = small(train__steps=6, train__batch_size=2, train__seq_len=16, train__grad_accum=1,
                data__source="synthetic", data__max_images=0, checkpoint__keep=1, checkpoint__keep_period=2)
    wd = str(tmp_path / "run")
    run(cfg, wd, progress=False, log=lambda *_: None)
    assert sorted(int(d) for d in os.listdir(os.path.join(wd, "checkpoints")) if d.isdigit()) == [2, 4, 6]


def test_config_checks_the_new_keys():
    from prisma_jax.core.config import ConfigError
    from train.config import load_train_config
    with pytest.raises(ConfigError, match=r"train.max_bad_steps must be ≥ 1 or null"):
        load_train_config(SFT, ["train.max_bad_steps=0"])
    with pytest.raises(ConfigError, match=r"checkpoint.keep_period must be ≥ 1 or null"):
        load_train_config(SFT, ["checkpoint.keep_period=0"])
    cfg, _ = load_train_config(SFT, [])
    assert cfg.train.max_bad_steps == 8 and cfg.checkpoint.keep_period is None


def test_a_torn_metrics_line_is_dropped_with_a_warning_on_resume(tmp_path):
    """A run cut mid-write (a full disk) leaves a partial last line: the resume warns, drops it, and writes its
    own lines after complete ones."""
    from train.loop import run
    cfg = small(train__steps=4, train__batch_size=2, train__seq_len=16, train__grad_accum=1,
                data__source="synthetic", data__max_images=0)
    wd = str(tmp_path / "run")
    run(cfg, wd, stop_at=2, progress=False, log=lambda *_: None)
    with open(os.path.join(wd, "metrics.jsonl"), "a") as f:
        f.write('{"step": 3, "code_high": 1.0, "lo')
    with pytest.warns(UserWarning, match=r"metrics.jsonl:3: not a complete metrics line"):
        run(cfg, wd, progress=False, log=lambda *_: None)
    assert [m["step"] for m in metrics(wd)] == [1, 2, 3, 4]


def test_on_the_8_device_mesh_a_nan_step_is_skipped(tmp_path):
    """The same rule on a simulated 2×2×2 CPU mesh (a subprocess with 8 devices): the sharded state's update
    is skipped, the metrics say so, and training goes on."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    out = str(tmp_path / "mesh.json")
    p = subprocess.run([sys.executable, os.path.abspath(__file__), "mesh", str(tmp_path / "run"), out], env=env,
                       capture_output=True, text=True, timeout=2400)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.load(open(out))
    assert res["devices"] == 8
    assert res["skipped"] == [0, 1, 0] and res["skipped_total"] == [0, 1, 1]
    assert res["step2_params_equal_step1"] and not res["step3_params_equal_step2"] and res["all_finite"]


def _mesh_worker(wd: str, out: str) -> None:
    import jax

    class Patch:                                       # pytest's monkeypatch, by hand
        def setattr(self, obj, name, value):
            setattr(obj, name, value)

    from train.loop import run
    poison(Patch(), {2})
    cfg = small(train__steps=3, train__batch_size=8, train__mesh={"data": 2, "fsdp": 2, "tensor": 2})
    run(cfg, wd, progress=False, log=lambda *_: None)
    ms, st = metrics(wd), states(wd, [1, 2, 3])
    json.dump({"devices": jax.device_count(), "skipped": [m["skipped"] for m in ms],
               "skipped_total": [m["skipped_total"] for m in ms],
               "step2_params_equal_step1": tree_equal(st[2]["params"], st[1]["params"]),
               "step3_params_equal_step2": tree_equal(st[3]["params"], st[2]["params"]),
               "all_finite": all(finite(s["params"]) for s in st.values())}, open(out, "w"))


if __name__ == "__main__":
    if sys.argv[1] == "mesh":
        _mesh_worker(sys.argv[2], sys.argv[3])
