"""`prisma convert` refuses bad input: non-zero exit, one line on stderr naming the problem, DST untouched
(absent, or the previous checkpoint byte for byte) and no temporary directory left behind."""
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from hf_tiny import build_model, save_checkpoint, tiny_hf_config
from prisma_jax.apps.cli import main as cli
from prisma_jax.checkpoint.safetensors import Checkpoint, CheckpointError, write_file


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    """A single-file fp32 source, a 7-shard source, and the Orbax conversion of the first."""
    root = tmp_path_factory.mktemp("bad")
    model = build_model(tiny_hf_config(), seed=4)
    save_checkpoint(model, str(root / "single"))
    model.save_pretrained(root / "sharded", max_shard_size="100KB")
    assert cli(["convert", "hf-to-orbax", str(root / "single"), str(root / "orbax")]) == 0
    return root


def _snapshot(path):
    if not os.path.lexists(path):
        return None
    if os.path.isfile(path):
        return hashlib.sha256(open(path, "rb").read()).hexdigest()
    return {os.path.relpath(os.path.join(d, f), path): hashlib.sha256(open(os.path.join(d, f), "rb").read()).hexdigest()
            for d, _, fs in os.walk(path) for f in fs}


def _refused(capsys, argv, *needles):
    """Run the CLI expecting a refusal; DST must be exactly as before. Returns the message."""
    dst = argv[3]
    before = _snapshot(dst)
    parent = os.path.dirname(os.path.abspath(dst))
    siblings = set(os.listdir(parent)) if os.path.isdir(parent) else set()
    capsys.readouterr()
    rc = cli(argv)
    err = capsys.readouterr().err.strip()
    assert rc != 0
    assert err.startswith("prisma convert: error:") and "\n" not in err and "Traceback" not in err, err
    for n in needles:
        assert n in err, (n, err)
    assert _snapshot(dst) == before
    if os.path.isdir(parent):
        assert set(os.listdir(parent)) == siblings   # no temporary sibling left behind
    return err


def _copy(good, name, tmp_path, what="single"):
    shutil.copytree(good / what, tmp_path / name)
    return tmp_path / name


def test_missing_shard(good, tmp_path, capsys):
    src = _copy(good, "s", tmp_path, "sharded")
    shard = sorted(set(json.load(open(src / "model.safetensors.index.json"))["weight_map"].values()))[1]
    os.remove(src / shard)
    _refused(capsys, ["convert", "hf-to-orbax", str(src), str(tmp_path / "out")], "missing", shard)


def test_truncated_file(good, tmp_path, capsys):
    src = _copy(good, "s", tmp_path)
    f = src / "model.safetensors"
    os.truncate(f, os.path.getsize(f) // 2)
    _refused(capsys, ["convert", "hf-to-orbax", str(src), str(tmp_path / "out")], "truncated")


def test_corrupt_header(good, tmp_path, capsys):
    src = _copy(good, "s", tmp_path)
    with open(src / "model.safetensors", "r+b") as f:
        f.seek(8)
        f.write(b"\x00\xff garbage \xfe" * 4)
    _refused(capsys, ["convert", "hf-to-orbax", str(src), str(tmp_path / "out")], "corrupt")


def test_shapes_that_contradict_config(good, tmp_path, capsys):
    src = _copy(good, "s", tmp_path)
    cfg = json.load(open(src / "config.json"))
    cfg["text_config"]["intermediate_size"] = 80
    json.dump(cfg, open(src / "config.json", "w"))
    _refused(capsys, ["convert", "hf-to-orbax", str(src), str(tmp_path / "out")],
             "model.language_model.layers.0.mlp.gate_proj.weight has shape [96, 64]", "config.json implies [80, 64]")


def _rewrite(src, drop=(), add=None):
    with Checkpoint(str(src)) as ck:
        tensors = [(k, np.array(ck.get(k))) for k in ck.keys() if k not in drop]
    tensors += list((add or {}).items())
    write_file(str(src / "model.safetensors"), tensors, metadata={"format": "pt"})


def test_missing_and_unexpected_keys_are_named(good, tmp_path, capsys):
    src = _copy(good, "s", tmp_path)
    _rewrite(src, drop=("model.language_model.layers.1.self_attn.k_proj.weight",),
             add={"model.extra_head.weight": np.zeros((2, 2), np.float32)})
    _refused(capsys, ["convert", "hf-to-orbax", str(src), str(tmp_path / "out")],
             "missing tensors: model.language_model.layers.1.self_attn.k_proj.weight",
             "unexpected tensors: model.extra_head.weight")


def test_pickle_only_checkpoint_is_refused_unopened(good, tmp_path, capsys):
    src = tmp_path / "pickled"
    src.mkdir()
    shutil.copy(good / "single" / "config.json", src / "config.json")
    (src / "pytorch_model.bin").write_bytes(b"\x80\x04 not opened: unpickling this would be unsafe")
    _refused(capsys, ["convert", "hf-to-orbax", str(src), str(tmp_path / "out")], "pytorch_model.bin",
             "safetensors only", "never unpickles")


def test_existing_destination_without_overwrite(good, tmp_path, capsys):
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "keep.txt").write_text("precious")
    _refused(capsys, ["convert", "hf-to-orbax", str(good / "single"), str(dst)], "already exists", "--overwrite")
    _refused(capsys, ["convert", "orbax-to-hf", str(good / "orbax"), str(dst)], "already exists")


def test_overwrite_keeps_the_old_destination_when_the_conversion_fails(good, tmp_path, capsys):
    src = _copy(good, "s", tmp_path)
    os.truncate(src / "model.safetensors", os.path.getsize(src / "model.safetensors") - 100)
    dst = tmp_path / "previous"
    shutil.copytree(good / "orbax", dst)
    _refused(capsys, ["convert", "hf-to-orbax", str(src), str(dst), "--overwrite"], "truncated")
    # a failure half-way through writing (a corrupted array found while exporting) leaves DST as it was too
    orb = tmp_path / "orb"
    shutil.copytree(good / "orbax", orb)
    chunk = orb / "text.layers.mlp.down_proj.kernel" / "2.0.0"
    chunk.write_bytes(chunk.read_bytes()[::-1])
    _refused(capsys, ["convert", "orbax-to-hf", str(orb), str(dst), "--overwrite"], "checksum")


def test_unwritable_destination(good, tmp_path, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    _refused(capsys, ["convert", "hf-to-orbax", str(good / "single"), str(blocker / "out")], "not a directory")
    _refused(capsys, ["convert", "orbax-to-hf", str(good / "orbax"), str(blocker / "sub" / "out")], "not a directory")


def test_destination_inside_source(good, tmp_path, capsys):
    src = _copy(good, "s", tmp_path)
    _refused(capsys, ["convert", "hf-to-orbax", str(src), str(src / "orbax")], "must not be")


def test_export_of_a_corrupted_orbax_array_names_the_tensor(good, tmp_path, capsys):
    orb = tmp_path / "orb"
    shutil.copytree(good / "orbax", orb)
    chunk = orb / "text.layers.mlp.up_proj.kernel" / "1.0.0"
    data = bytearray(chunk.read_bytes())
    data[100] ^= 0x40
    chunk.write_bytes(bytes(data))
    _refused(capsys, ["convert", "orbax-to-hf", str(orb), str(tmp_path / "out")],
             "model.language_model.layers.1.mlp.up_proj.weight", "checksum")


def test_export_of_a_directory_that_is_not_a_conversion(good, tmp_path, capsys):
    _refused(capsys, ["convert", "orbax-to-hf", str(good / "single"), str(tmp_path / "out")],
             "not a checkpoint written by `prisma convert hf-to-orbax`")


def _tied_with_head(good, tmp_path, head_of):
    """A tied checkpoint that also stores lm_head.weight (as some exporters do)."""
    src = tmp_path / "tied"
    src.mkdir()
    model = build_model(tiny_hf_config(tie=True), seed=6)
    save_checkpoint(model, str(src))
    with Checkpoint(str(src)) as ck:
        tensors = {k: np.array(ck.get(k)) for k in ck.keys()}
    tensors["lm_head.weight"] = head_of(tensors["model.language_model.embed_tokens.weight"])
    write_file(str(src / "model.safetensors"), tensors.items())
    return src


def test_tied_source_with_an_equal_lm_head_converts(good, tmp_path, capsys):
    src = _tied_with_head(good, tmp_path, lambda e: e.copy())
    assert cli(["convert", "hf-to-orbax", str(src), str(tmp_path / "out")]) == 0
    meta = json.load(open(tmp_path / "out" / "prisma_checkpoint.json"))
    assert "lm_head.weight" not in meta["tensors"] and meta["tie_word_embeddings"] is True


def test_tied_source_with_a_different_lm_head_is_refused(good, tmp_path, capsys):
    src = _tied_with_head(good, tmp_path, lambda e: e + np.float32(1e-3))
    _refused(capsys, ["convert", "hf-to-orbax", str(src), str(tmp_path / "out")],
             "lm_head.weight differs", "tie_word_embeddings")


def test_sigterm_mid_conversion_leaves_nothing_behind(good, tmp_path):
    """SIGTERM while the arrays are being written: exit 143, no DST and no temporary sibling."""
    dst = tmp_path / "out"
    code = ("import sys, time\n"
            "from prisma_jax.checkpoint import orbax as L\n"
            "def stall(*a, **k):\n"
            "    print('writing', flush=True); time.sleep(120)\n"
            "L.write_tree_metadata = stall\n"
            "from prisma_jax.apps.cli import main\n"
            f"sys.exit(main(['convert', 'hf-to-orbax', {str(good / 'single')!r}, {str(dst)!r}]))\n")
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert proc.stdout.readline().strip() == "writing", proc.stderr.read()
    assert any(n.startswith(".out.tmp-") for n in os.listdir(tmp_path))
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 143
    assert os.listdir(tmp_path) == []


# ------------------------------------------------------------------------ restore checks the recorded crc32s

def _flip(orb, leaf, key, at=100):
    """Flip one bit of a stored value: the chunk still decodes, to a different number."""
    chunk = orb / leaf / key
    data = bytearray(chunk.read_bytes())
    data[at] ^= 0x40
    chunk.write_bytes(bytes(data))


def test_restore_checks_the_recorded_crc32s_and_names_the_tensor(good, tmp_path):
    from prisma_jax.checkpoint import orbax as L
    from conversion import restore_params
    from prisma_jax import PrismaVL

    orb = tmp_path / "orb"
    shutil.copytree(good / "orbax", orb)
    ref, _ = restore_params(str(orb))
    _flip(orb, "text.layers.mlp.up_proj.kernel", "1.0.0")
    named = r"tensor model\.language_model\.layers\.1\.mlp\.up_proj\.weight does not match its recorded checksum"
    with pytest.raises(CheckpointError, match=named + r" \(chunk text\.layers\.mlp\.up_proj\.kernel/1\.0\.0"):
        restore_params(str(orb))
    with pytest.raises(CheckpointError, match=named):
        PrismaVL.from_pretrained(str(orb))
    got, _ = restore_params(str(orb), verify=False)      # skipping the check loads the altered value
    differs = ref["text"]["layers"]["mlp"]["up_proj"]["kernel"] != got["text"]["layers"]["mlp"]["up_proj"]["kernel"]
    assert differs.sum() == 1 and differs[1].sum() == 1
    assert PrismaVL.from_pretrained(str(orb), verify=False).config.n_bits == 16
    # a conversion that recorded no chunk crc32s is checked tensor by tensor (its Hugging Face crc32s)
    meta = json.load(open(orb / L.META_NAME))
    del meta["chunk_crc32"]
    L.write_meta(str(orb), meta)
    with pytest.raises(CheckpointError, match=named + r" \(crc32 [0-9a-f]{8} != [0-9a-f]{8}\)"):
        restore_params(str(orb))
    restore_params(str(orb), verify=False)


class _Layers:
    """A sharding of which this process holds the given rows of every array (along its first axis)."""

    def __init__(self, *rows):
        self.rows = rows

    def addressable_devices_indices_map(self, shape):
        return {i: (slice(r, r + 1),) + (slice(None),) * (len(shape) - 1) for i, r in enumerate(self.rows)}


def test_a_sharded_restore_checks_exactly_the_chunks_its_shards_read(good, tmp_path):
    from prisma_jax.checkpoint import orbax as L

    orb = tmp_path / "orb"
    shutil.copytree(good / "orbax", orb)
    _flip(orb, "text.layers.mlp.up_proj.kernel", "2.0.0")   # layer 2's chunk
    meta, cfg = L.read_meta(str(orb))
    leaves = [tuple(k.split("/")) for k in meta["leaf_dtypes"]]
    L.verify_chunks(str(orb), meta, cfg, {p: _Layers(0, 1) for p in leaves})     # never reads layer 2
    with pytest.raises(CheckpointError, match=r"tensor model\.language_model\.layers\.2\.mlp\.up_proj\.weight "
                                              r"does not match"):
        L.verify_chunks(str(orb), meta, cfg, {p: _Layers(2) for p in leaves})
    os.remove(orb / "text.layers.mlp.up_proj.kernel" / "0.0.0")
    with pytest.raises(CheckpointError, match=r"layers\.0\.mlp\.up_proj\.weight: chunk "
                                              r"text\.layers\.mlp\.up_proj\.kernel/0\.0\.0 is missing"):
        L.verify_chunks(str(orb), meta, cfg, {p: _Layers(0) for p in leaves})


# ------------------------------------------------------------- fsync, and --overwrite swapping DST atomically

@pytest.fixture(scope="module")
def other(good):
    """An Orbax conversion of a different model: the "old" DST that --overwrite replaces."""
    save_checkpoint(build_model(tiny_hf_config(), seed=7), str(good / "single7"))
    assert cli(["convert", "hf-to-orbax", str(good / "single7"), str(good / "orbax7")]) == 0
    return good / "orbax7"


_STAMPED = ("prisma_checkpoint.json", "_CHECKPOINT_METADATA")   # hold a creation time


def _which(dst, old_snapshot, new_ref):
    """'old' (byte for byte), 'new' (every file of a fresh conversion of the new source, same bytes but for
    the timestamps), 'absent', or 'broken'."""
    got = _snapshot(dst)
    if got is None:
        return "absent"
    if got == old_snapshot:
        return "old"
    ref = _snapshot(new_ref)
    if got.keys() == ref.keys() and all(got[k] == ref[k] for k in ref if k not in _STAMPED):
        return "new"
    return "broken"


@pytest.mark.parametrize("swap", ["fresh", "exchange", "two renames"])
def test_everything_written_is_fsynced_before_the_rename(good, other, tmp_path, monkeypatch, swap):
    from conversion import staging

    events = []
    real_fsync, real_rename, real_exchange, real_renameat2 = os.fsync, os.rename, staging._exchange, staging._renameat2

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def rename(a, b):
        events.append(("rename", os.fspath(a), os.fspath(b)))
        real_rename(a, b)

    def renameat2(a, b, flags):   # RENAME_NOREPLACE (a fresh DST) or RENAME_EXCHANGE
        err = real_renameat2(a, b, flags)
        if err == 0:
            events.append(("rename", a, b))
        return err

    def exchange(a, b):
        return swap == "exchange" and real_exchange(a, b)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", rename)
    monkeypatch.setattr(staging, "_renameat2", renameat2)
    monkeypatch.setattr(staging, "_exchange", exchange)
    dst = tmp_path / "out"
    if swap != "fresh":
        shutil.copytree(other, dst)
    assert cli(["convert", "hf-to-orbax", str(good / "single"), str(dst), "--overwrite"]) == 0
    into = [i for i, e in enumerate(events) if e[0] == "rename" and e[2] == str(dst)]
    assert len(into) == 1, events
    tmp = events[into[0]][1]
    assert os.path.basename(tmp).startswith(".out.tmp-")
    synced_before = {e[1] for e in events[:into[0]] if e[0] == "fsync"}
    written = [os.path.join(tmp, os.path.relpath(os.path.join(d, f), dst)) for d, _, fs in os.walk(dst) for f in fs]
    dirs = [os.path.normpath(os.path.join(tmp, os.path.relpath(d, dst))) for d, _, _ in os.walk(dst)]
    assert len(written) > 20 and not set(written + dirs) - synced_before, set(written + dirs) - synced_before
    assert ("fsync", str(tmp_path)) in events[into[0] + 1:]            # the parent, after the rename
    assert _which(dst, None, good / "orbax") == "new"
    assert sorted(os.listdir(tmp_path)) == ["out"]                     # no temporary or backup sibling left


_KILL_AT = r"""
import os, sys, time
from conversion import staging
from prisma_jax.checkpoint import orbax as L
point, exchange, src, dst = sys.argv[1], sys.argv[2] == "1", sys.argv[3], sys.argv[4]
def at(p):
    if p == point:
        print("at", p, flush=True)
        while not os.path.exists(dst + ".go"):   # the test signals, then lets the process go on
            time.sleep(0.02)
staging._at = at
if not exchange:
    staging._exchange = lambda a, b: False
write_tree_metadata = L.write_tree_metadata
def writing(*a):
    at("write")
    write_tree_metadata(*a)
L.write_tree_metadata = writing
from prisma_jax.apps.cli import main
sys.exit(main(["convert", "hf-to-orbax", src, dst, "--overwrite"]))
"""


@pytest.mark.parametrize("point,exchange,sig,expect", [
    ("write", True, signal.SIGTERM, "old"),         # while the arrays are written
    ("fsync", True, signal.SIGTERM, "old"),         # after writing, before the swap: deferred, then abandoned
    ("swap", False, signal.SIGTERM, "old"),
    ("between", False, signal.SIGTERM, "new"),      # between the fallback's two renames: deferred, completed
    ("remove", True, signal.SIGTERM, "new"),        # swapped, the old one being removed
    ("between", False, signal.SIGKILL, "old"),      # killed outright: the next conversion to DST puts it back
    ("remove", True, signal.SIGKILL, "new"),
])
def test_a_signal_at_any_point_of_overwrite_leaves_the_old_or_the_new(good, other, tmp_path, point, exchange,
                                                                      sig, expect):
    from conversion.staging import check_destination

    dst = tmp_path / "out"
    shutil.copytree(other, dst)
    old = _snapshot(dst)
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.Popen([sys.executable, "-c", _KILL_AT, point, str(int(exchange)), str(good / "single"),
                             str(dst)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            cwd=os.path.dirname(os.path.dirname(__file__)))
    assert proc.stdout.readline().strip() == f"at {point}", proc.stderr.read()
    proc.send_signal(sig)
    time.sleep(0.2)
    (tmp_path / "out.go").touch()
    assert proc.wait(120) == (143 if sig == signal.SIGTERM else -9), proc.stderr.read()[-2000:]
    os.remove(tmp_path / "out.go")
    state = _which(dst, old, good / "orbax")
    if sig == signal.SIGTERM:
        assert state == expect
        assert sorted(os.listdir(tmp_path)) == ["out"]
    else:
        assert state == ("absent" if point == "between" else expect)   # renamed away; the backup holds it
        check_destination(str(dst), overwrite=True)
        assert _which(dst, old, good / "orbax") == expect
        assert not [n for n in os.listdir(tmp_path) if n.endswith(".old")]


# ------------------------------------- SIGKILL at seeded points of `hf-to-orbax --overwrite`, then a clean run

_INSTRUMENT = r"""
import os, shutil
from conversion import staging
from prisma_jax.checkpoint import orbax as L

def install(tick, exchange):
    '''Call tick(label) before each step a kill could fall before: each block written (its chunk crc), the
    tree metadata and the metadata file, every fsync, rename, renameat2 and rmtree, and each named point of
    the swap. Returns what to put back.'''
    undo = []
    def wrap(obj, name, label):
        real = getattr(obj, name)
        def f(*a, **k):
            tick(label(*a) if callable(label) else label)
            return real(*a, **k)
        undo.append((obj, name, real))
        setattr(obj, name, f)
    for name in ("chunk_crc", "write_tree_metadata", "write_meta"):
        wrap(L, name, "write")
    wrap(staging, "_at", lambda p: "at:" + p)
    wrap(os, "fsync", "fsync")
    wrap(staging, "_renameat2", "renameat2")
    wrap(os, "rename", "rename")
    wrap(shutil, "rmtree", "rmtree")
    if not exchange:
        undo.append((staging, "_exchange", staging._exchange))
        staging._exchange = lambda a, b: False
    return undo
"""

_KILL_SERVER = _INSTRUMENT + r"""
import json, signal, sys
from prisma_jax.apps.cli import main
import conversion.hf_to_orbax   # imported once; each conversion runs in a fork, killed at its k-th step
for line in sys.stdin:
    k, exchange, src, dst = json.loads(line)
    pid = os.fork()
    if pid == 0:
        try:
            n = [0]
            def tick(label):
                n[0] += 1
                if n[0] == k:
                    os.kill(os.getpid(), signal.SIGKILL)
            install(tick, exchange)
            sys.stdout = open(os.devnull, "w")
            os._exit(main(["convert", "hf-to-orbax", src, dst, "--overwrite"]))
        except BaseException:
            os._exit(70)
    _, status = os.waitpid(pid, 0)   # reaped: its pid is gone, as a killed job's is
    print(os.waitstatus_to_exitcode(status), flush=True)
"""


def _events(src, dst, exchange):
    """The labels of the instrumented steps of one conversion, run here (the killed runs repeat them)."""
    ns: dict = {}
    exec(_INSTRUMENT, ns)
    events: list = []
    undo = ns["install"](events.append, exchange)
    try:
        assert cli(["convert", "hf-to-orbax", str(src), str(dst), "--overwrite"]) == 0
    finally:
        for obj, name, real in reversed(undo):
            setattr(obj, name, real)
    return events


def _kill_points(events, rng):
    """Seeded kill points (1-based event numbers) in every phase: 2 while writing, 1 while fsyncing, 3 in
    the swap (few steps, each of which matters)."""
    fsync, swap = events.index("at:fsync"), events.index("at:swap")
    phases = [(range(0, fsync), 2), (range(fsync, swap), 1), (range(swap, len(events)), 3)]
    return sorted(i + 1 for r, n in phases for i in rng.sample(r, min(n, len(r))))


def test_sigkill_at_seeded_points_of_overwrite_leaves_old_or_new_and_the_next_run_cleans_up(good, other, tmp_path):
    """12 SIGKILLs at seeded points of `hf-to-orbax --overwrite` (exchange and two-rename swaps; each run in
    its own directory, forked from one process that imported everything once, so a kill costs a conversion,
    not an interpreter start): after each, DST (once `recover` has put back a fallback's backup, as
    the next run does first) is the old checkpoint or the new one and restores with its crc32s checked; the
    next, completed run leaves no debris."""
    import random

    from conversion import restore_params
    from conversion.staging import recover

    rng = random.Random(20240611)
    runs = []   # (exchange, k, event label, dst)
    for exchange in (True, False):
        probe = tmp_path / f"probe{int(exchange)}" / "out"
        shutil.copytree(other, probe)
        events = _events(good / "single", probe, exchange)
        assert os.listdir(probe.parent) == ["out"]
        for k in _kill_points(events, rng):
            dst = tmp_path / f"kill{len(runs)}" / "out"
            shutil.copytree(other, dst)
            runs.append((exchange, k, events[k - 1], dst))
    old = _snapshot(runs[0][3])
    server = subprocess.Popen([sys.executable, "-c", _KILL_SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=dict(os.environ, JAX_PLATFORMS="cpu"),
                              cwd=os.path.dirname(os.path.dirname(__file__)))
    states, debris = [], 0
    try:
        for exchange, k, label, dst in runs:
            where = f"killed before step {k} ({label}, exchange={exchange})"
            server.stdin.write(json.dumps([k, exchange, str(good / "single"), str(dst)]) + "\n")
            server.stdin.flush()
            rc = server.stdout.readline().strip()
            assert rc == "-9", (where, rc, server.stderr.read()[-2000:] if not rc else "")
            if not os.path.lexists(dst):   # between the fallback's two renames: the backup holds the old one
                assert not exchange and os.path.isdir(dst.parent / ".out.old"), where
                recover(str(dst))
            state = _which(dst, old, good / "orbax")
            assert state in ("old", "new"), (where, state)
            restore_params(str(dst))   # loadable, every chunk's crc32 checked
            states.append(state)
            debris += any(".tmp-" in n for n in os.listdir(dst.parent))
            assert cli(["convert", "hf-to-orbax", str(good / "single"), str(dst), "--overwrite"]) == 0
            assert _which(dst, None, good / "orbax") == "new"
            assert os.listdir(dst.parent) == ["out"], where   # no .out.tmp-* or .out.old left
    finally:
        server.stdin.close()
        server.wait(60)
    assert len(states) == 12 and {"old", "new"} <= set(states) and debris, (states, debris)


# ---------------------------------------------------------------------------------------- staging details

def test_a_destination_that_appears_meanwhile_is_replaced_only_with_overwrite(tmp_path, monkeypatch):
    from conversion import staging
    from conversion.staging import Staging

    for fallback in (False, True):
        if fallback:   # no renameat2: an existence check, then os.rename
            monkeypatch.setattr(staging, "_renameat2", lambda a, b, flags: None)
        dst = tmp_path / f"out{int(fallback)}"
        with pytest.raises(ValueError, match="appeared while converting and is left as it is"):
            with Staging(str(dst), overwrite=False) as tmp:
                open(os.path.join(tmp, "new.txt"), "w").write("new")
                dst.mkdir()
                (dst / "theirs.txt").write_text("theirs")
        assert os.listdir(dst) == ["theirs.txt"] and (dst / "theirs.txt").read_text() == "theirs"
        shutil.rmtree(dst)
        with Staging(str(dst), overwrite=True) as tmp:   # with --overwrite it is replaced
            open(os.path.join(tmp, "new.txt"), "w").write("new")
            dst.mkdir()
            (dst / "theirs.txt").write_text("theirs")
        assert os.listdir(dst) == ["new.txt"]
    assert sorted(os.listdir(tmp_path)) == ["out0", "out1"]


def test_stale_temporaries_of_dead_processes_of_this_host_are_removed(good, tmp_path):
    from conversion.staging import _host

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    host = _host()
    names = {f".out.tmp-{host}-{dead.pid}-abcd_123": False,       # ours, its process gone: removed
             f".out.tmp-{host}-{os.getpid()}-abcdefgh": True,      # a live process (this one)
             f".out.tmp-{host}-{os.getppid()}-abcdefgh": True,     # a live process
             f".out.tmp-other-host-{dead.pid}-abcdefgh": True,     # another host (a shared filesystem)
             f".out.tmp-{host}-{dead.pid}-abc": True,              # not our naming
             f".out.tmp-{host}-{dead.pid}-abcdefgh.keep": True,
             f".other.tmp-{host}-{dead.pid}-abcdefgh": True}       # another destination's
    for n in names:
        (tmp_path / n).mkdir()
        (tmp_path / n / "x").write_text("x")
    (tmp_path / f".out.tmp-{host}-{dead.pid}-filefile").write_text("a file, not a directory: kept")
    assert cli(["convert", "hf-to-orbax", str(good / "single"), str(tmp_path / "out")]) == 0
    left = set(os.listdir(tmp_path))
    assert left == {n for n, kept in names.items() if kept} | {"out", f".out.tmp-{host}-{dead.pid}-filefile"}


def test_signal_handlers_are_restored_on_every_path(tmp_path, monkeypatch):
    import tempfile

    from conversion.staging import Staging

    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)}

    def now():
        return {s: signal.getsignal(s) for s in before}

    def no_tmp(*a, **k):
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as m:
        m.setattr(tempfile, "mkdtemp", no_tmp)
        with pytest.raises(OSError, match="No space left"):
            with Staging(str(tmp_path / "a")):
                pass
    assert now() == before and os.listdir(tmp_path) == []
    with pytest.raises(RuntimeError):
        with Staging(str(tmp_path / "b")):
            raise RuntimeError
    assert now() == before and os.listdir(tmp_path) == []
    with Staging(str(tmp_path / "c")):
        pass
    assert now() == before and os.listdir(tmp_path) == ["c"]
    with pytest.raises(ValueError, match="appeared while converting"):
        with Staging(str(tmp_path / "d")):
            (tmp_path / "d").mkdir()
    assert now() == before and sorted(os.listdir(tmp_path)) == ["c", "d"]
