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

# Not in `make test` yet: never seen passing in the session that wrote it (machine overloaded);
# run with `pytest -m unverified` and see the issue notes for what remains.
import pytest  # noqa: E402

pytestmark = pytest.mark.unverified


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
    errs = [p.communicate(timeout=1200)[1] for p in procs]
    for p, e in zip(procs, errs):
        assert p.returncode == 0, e[-3000:]
    res = []
    for o in outs:
        with open(o) as f:
            res.append(json.load(f))
    return res


def _reference():
    """One process, one device: train/step.py's step on the same batch and initial params."""
    from train.step import TrainBatch, init_state, make_train_step

    tcfg = W.tiny_train_cfg()
    state, metrics = jax.jit(make_train_step(tcfg))(init_state(tcfg, W.host_params(tcfg)),
                                                    TrainBatch(*W.train_batch_np(tcfg.model)))
    return float(metrics["loss"]), W.flat(state.params)


def test_two_hosts_train_save_restore_match_one_process(tmp_path):
    d = str(tmp_path)
    trained = _two_processes("mh_train", d)
    restored = _two_processes("mh_restore", d)
    loss, ref = _reference()
    assert abs(trained[0]["loss"] - loss) <= 1e-5 and trained[0]["loss"] == trained[1]["loss"]
    assert all(r["restored_specs_match"] for r in restored)
    after_train = np.load(os.path.join(d, "mh_train0.json.npz"))
    after_restore = np.load(os.path.join(d, "mh_restore0.json.npz"))
    assert set(after_train.files) == set(ref)
    for k, v in ref.items():
        np.testing.assert_allclose(after_train[k], v, atol=1e-5, rtol=0, err_msg=k)
        np.testing.assert_array_equal(after_restore[k], after_train[k], err_msg=k)
