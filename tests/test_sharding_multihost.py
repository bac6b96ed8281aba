"""Two processes × 4 CPU devices on localhost (`jax.distributed.initialize`): a sharded training step with each
host feeding its own rows, an Orbax save from both hosts, and a restore in two fresh processes give the
numbers of one process on one device."""
import json
import os
import socket
import subprocess
import sys

import jax
import numpy as np

HERE = os.path.dirname(__file__)
sys.path.insert(0, HERE)
import sharding_worker as W  # noqa: E402


def _port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _two_processes(mode: str, d: str) -> list[dict]:
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    port = _port()
    outs = [os.path.join(d, f"{mode}{i}.json") for i in range(2)]
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "sharding_worker.py"), mode, str(port), str(i),
                               outs[i]], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    errs = [p.communicate(timeout=2400)[1] for p in procs]
    for p, e in zip(procs, errs):
        assert p.returncode == 0, e[-3000:]
    res = []
    for o in outs:
        with open(o) as f:
            res.append(json.load(f))
    return res


def _reference():
    """One process, one device: train/step.py's step on the same batch and initial params; also how far
    that step moved the params."""
    from train.step import TrainBatch, init_state, make_train_step

    tcfg = W.tiny_train_cfg()
    initial = W.host_params(tcfg)
    state, metrics = jax.jit(make_train_step(tcfg))(init_state(tcfg, initial),
                                                    TrainBatch(*W.train_batch_np(tcfg.model)))
    ref = W.flat(state.params)
    moved = W.max_abs_diff(ref, W.flat(initial))
    return float(metrics["loss"]), ref, moved


def test_two_hosts_train_save_restore_match_one_process(tmp_path):
    d = str(tmp_path)
    trained = _two_processes("mh_train", d)
    restored = _two_processes("mh_restore", d)
    loss, ref, moved = _reference()
    assert abs(trained[0]["loss"] - loss) <= 1e-5 and trained[0]["loss"] == trained[1]["loss"]
    assert all(r["restored_specs_match"] for r in restored)
    after_train = np.load(os.path.join(d, "mh_train0.json.npz"))
    after_restore = np.load(os.path.join(d, "mh_restore0.json.npz"))
    assert set(after_train.files) == set(ref)
    # Adam's first step is ≈ lr·sign(g): where |g| ≈ eps, the round-off of a different reduction order moves a
    # weight by a visible fraction of lr, so the bound is relative to the update (as in test_sharding_mesh).
    assert moved > 1e-4
    for k, v in ref.items():
        assert np.max(np.abs(after_train[k] - v)) <= 0.05 * moved, k
        np.testing.assert_array_equal(after_restore[k], after_train[k], err_msg=k)
