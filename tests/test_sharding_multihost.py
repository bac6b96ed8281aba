"""Two processes × 4 CPU devices on localhost (`jax.distributed.initialize`): training steps on tiny_sft
(conversations with images) with each host feeding its own rows and their images, an Orbax save from both
hosts, and a restore in two fresh processes give the numbers of one process on one device fed the same rows;
the training loop on both processes writes one metrics line a step, resumes each host's data position, and
stops both processes after one common step, which both save, when one of them gets a SIGTERM."""
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
    try:
        errs = [p.communicate(timeout=1200)[1] for p in procs]
    finally:                 # a hung pair (say, hosts that stopped at different steps) is killed, not left running
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, e in zip(procs, errs):
        assert p.returncode == 0, e[-3000:]
    res = []
    for o in outs:
        with open(o) as f:
            res.append(json.load(f))
    return res


def _global_batch(host_batches):
    """The hosts' batches as one: rows concatenated host after host on each field's row axis (host_batch's
    layout); the geometry (one row's image slots) is the same on every host."""
    from train.sharded import ROW_AXIS
    from train.step import TrainBatch

    first = host_batches[0]
    for b in host_batches[1:]:
        assert all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(b.geometry), jax.tree.leaves(first.geometry)))
    return TrainBatch(**{k: np.concatenate([getattr(b, k) for b in host_batches], axis=ROW_AXIS[k])
                         for k in ROW_AXIS}, geometry=first.geometry)


def _reference(d):
    """One process, one device: train/step.py's step on the same global batches (both hosts' rows of the
    pipeline) from the same initial params; also how far the steps moved the params."""
    from train.step import init_state, make_train_step

    tcfg = W.sft_train_cfg()
    per_host = [W.sft_batches(tcfg, d, host=h, hosts=2) for h in range(2)]
    # both hosts feed images, and not only in their first row (the per-row image index matters)
    for batches in per_host:
        has_image = np.stack([np.abs(b.pixel_values).sum(axis=(2, 3)) > 0 for b in batches])   # [steps, A, b]
        assert has_image.any() and has_image[..., 1:].any()
    initial = W.host_params(tcfg)
    step = jax.jit(make_train_step(tcfg))
    state, losses = init_state(tcfg, initial), []
    for hb in zip(*per_host):
        state, metrics = step(state, _global_batch(hb))
        losses.append(float(metrics["loss"]))
    ref = W.flat(state.params)
    return losses, ref, W.max_abs_diff(ref, W.flat(initial))


def test_two_hosts_train_save_restore_match_one_process(tmp_path):
    from train.tiny_sft import generate

    d = str(tmp_path)
    generate(os.path.join(d, "tiny_sft_data"))        # once, before the hosts read it
    trained = _two_processes("mh_train", d)
    restored = _two_processes("mh_restore", d)
    losses, ref, moved = _reference(d)
    assert len(losses) == W.SFT_STEPS and trained[0]["losses"] == trained[1]["losses"]
    # the mesh adds its tensor-parallel sums in another order: the bound of the text-only step before
    dloss = float(np.max(np.abs(np.subtract(trained[0]["losses"], losses))))
    print(f"two hosts vs one device: max |Δloss| {dloss:.3g} over {len(losses)} steps (bound 1e-5)")
    np.testing.assert_allclose(trained[0]["losses"], losses, rtol=0, atol=1e-5, err_msg=f"max |Δloss| {dloss:.3g}")
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
    # train/loop.py on both processes: process 0 alone writes metrics.jsonl (one line a step), each process saves
    # its own data position, and a run stopped after step 1 and resumed gives the straight run's losses
    lp = trained[0]["loop"]
    for name in ("straight", "resumed"):
        assert [m["step"] for m in lp[name]] == list(range(1, W.SFT_STEPS + 1)), name
        states = lp[f"{name}_data_states"]
        assert str(W.SFT_STEPS) in states and (name == "straight" or "1" in states), states.keys()
        rows = W.sft_train_cfg().train.batch_size // 2            # each host's rows a step
        for step, files in states.items():
            assert files == {f"process_{i}-of-2.json": {"next_index": rows * int(step)} for i in range(2)}, step
    assert [m["loss"] for m in lp["resumed"]] == [m["loss"] for m in lp["straight"]]
    # SIGTERM to process 1 alone: both stop after the same step and save it, each process its own data position
    last = lp["preempted_last"]
    assert trained[1]["loop"]["preempted_last"] == last and 2 <= last < W.PREEMPT_STEPS
    states = lp["preempted_data_states"]
    assert max(map(int, states)) == last
    assert states[str(last)] == {f"process_{i}-of-2.json": {"next_index": rows * last} for i in range(2)}
    assert lp["straight"][-1]["loss"] < lp["straight"][0]["loss"]
