"""A corpus of malformed safetensors checkpoints, written byte by byte: each is refused by both
`prisma convert hf-to-orbax` (exit 2, one line `prisma convert: error: ...` naming the file and the defect,
nothing written) and `PrismaVL.from_pretrained` (a `CheckpointError` naming the file and the defect).

Every case starts from a valid checkpoint (transformers' save_pretrained of the tiny model, as
test_convert_bad_input.py builds it) and corrupts a copy: the file is rebuilt from its parts, an 8-byte
little-endian header length, the JSON header, then the data.
"""
import json
import os
import shutil
import struct

import numpy as np
import pytest

from hf_tiny import build_model, save_checkpoint, tiny_hf_config
from prisma_jax.apps.cli import main as cli
from prisma_jax.checkpoint.safetensors import INDEX_NAME, SINGLE_NAME, Checkpoint, CheckpointError, PieceWriter

SHARD = "model-00001-of-00001.safetensors"


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    save_checkpoint(build_model(tiny_hf_config(), seed=4), str(root / "single"))
    return root / "single"


def _parts(path):
    blob = open(path, "rb").read()
    (n,) = struct.unpack("<Q", blob[:8])
    return json.loads(blob[8:8 + n]), blob[8 + n:]


def _pack(header, data, length=None) -> bytes:
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(text) if length is None else length) + text + data


def _by_offset(header):
    return sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"])


def _same_size_pair(header):
    """Two tensors of the same dtype and shape, the first one earlier in the data."""
    names = _by_offset(header)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            if header[a]["shape"] == header[b]["shape"] and header[a]["dtype"] == header[b]["dtype"]:
                return a, b
    raise AssertionError("no pair")


# ---------------------------------------------------------------- single-file defects: (header, data) → bytes

def _truncated_to_5(h, d):
    return _pack(h, d)[:5]


def _empty(h, d):
    return b""


def _data_cut(h, d):
    return _pack(h, d[:-100])


def _length_past_end(h, d):
    blob = _pack(h, d)
    return struct.pack("<Q", len(blob) * 2) + blob[8:]


def _length_huge(h, d):
    return _pack(h, d, length=2**63 + 5)


def _not_json(h, d):
    return _pack(b"{this is not json" + b" " * 7, d)


def _not_utf8(h, d):
    return _pack(b"{\"\xff\xfe\": 1}", d)


def _nan(h, d):
    first = _by_offset(h)[0]
    text = json.dumps(h).replace(f'"{first}": {{"dtype"', f'"{first}": {{"x": NaN, "dtype"', 1)
    return _pack(text.encode(), d)


def _not_object(h, d):
    return _pack(json.dumps([h]).encode(), d)


def _entry_not_object(h, d):
    h[_by_offset(h)[0]] = "F32"
    return _pack(h, d)


def _size_mismatch(h, d):      # shape × dtype size ≠ the span of data_offsets
    e = h[_by_offset(h)[0]]
    e["shape"] = [e["shape"][0] + 1, *e["shape"][1:]]
    return _pack(h, d)


def _dtype_mismatch(h, d):     # the same shape read as a 2-byte dtype: half the span
    h[_by_offset(h)[0]]["dtype"] = "BF16"
    return _pack(h, d)


def _offsets_reversed(h, d):
    e = h[_by_offset(h)[3]]
    e["data_offsets"] = e["data_offsets"][::-1]
    return _pack(h, d)


def _offsets_negative(h, d):
    e = h[_by_offset(h)[0]]
    a, b = e["data_offsets"]
    e["data_offsets"] = [a - 8, b - 8]
    return _pack(h, d)


def _offsets_three(h, d):
    h[_by_offset(h)[0]]["data_offsets"].append(0)
    return _pack(h, d)


def _offsets_float(h, d):
    e = h[_by_offset(h)[0]]
    e["data_offsets"] = [float(x) for x in e["data_offsets"]]
    return _pack(h, d)


def _offsets_beyond(h, d):     # the last tensor's span moved past the end of the data
    e = h[_by_offset(h)[-1]]
    e["data_offsets"] = [x + 64 for x in e["data_offsets"]]
    return _pack(h, d)


def _gap(h, d):                # every tensor after the first shifted: 16 bytes belong to no tensor
    for k in _by_offset(h)[1:]:
        h[k]["data_offsets"] = [x + 16 for x in h[k]["data_offsets"]]
    first = _by_offset(h)[0]
    a, b = h[first]["data_offsets"]
    return _pack(h, d[:b] + b"\0" * 16 + d[b:])


def _trailing(h, d):
    return _pack(h, d + b"\0" * 24)


def _unknown_dtype(h, d):
    h[_by_offset(h)[0]]["dtype"] = "F7"
    return _pack(h, d)


def _dtype_not_string(h, d):
    h[_by_offset(h)[0]]["dtype"] = 4
    return _pack(h, d)


def _negative_shape(h, d):
    e = h[_by_offset(h)[0]]
    e["shape"] = [-e["shape"][0], -1, *e["shape"][1:]]
    return _pack(h, d)


def _float_shape(h, d):
    e = h[_by_offset(h)[0]]
    e["shape"] = [float(s) for s in e["shape"]]
    return _pack(h, d)


def _string_shape(h, d):
    e = h[_by_offset(h)[0]]
    e["shape"] = [str(s) for s in e["shape"]]
    return _pack(h, d)


def _bool_shape(h, d):
    e = h[_by_offset(h)[0]]
    e["shape"] = [True] * len(e["shape"])
    return _pack(h, d)


def _overflow(h, d):           # 2**32 × 2**32 elements: 0 in int64 arithmetic, an exabyte-size tensor in fact
    h["model.evil.weight"] = {"dtype": "F32", "shape": [2**32, 2**32], "data_offsets": [0, 0]}
    return _pack(h, d)


def _overflow_wrap(h, d):      # 3 × 6148914691236517206 = 2**64 + 2: int64 arithmetic makes it 2 elements
    h["model.evil.weight"] = {"dtype": "F32", "shape": [3, 6148914691236517206],
                              "data_offsets": [len(d), len(d) + 8]}
    return _pack(h, d + b"\0" * 8)


def _overlap(h, d):
    a, b = _same_size_pair(h)
    h[b]["data_offsets"] = list(h[a]["data_offsets"])
    return _pack(h, d)


def _duplicate_name(h, d):     # json.loads would silently keep the second entry
    first = _by_offset(h)[0]
    text = json.dumps(h)[:-1] + f', "{first}": ' + json.dumps(h[first]) + "}"
    return _pack(text.encode(), d)


def _duplicate_inner_key(h, d):
    first = _by_offset(h)[0]
    text = json.dumps(h).replace(f'"{first}": {{"dtype": "F32"', f'"{first}": {{"dtype": "F16", "dtype": "F32"', 1)
    assert text != json.dumps(h)
    return _pack(text.encode(), d)


def _metadata_list(h, d):
    h["__metadata__"] = ["format", "pt"]
    return _pack(h, d)


def _metadata_value_not_str(h, d):
    h["__metadata__"] = {"format": "pt", "step": 3}
    return _pack(h, d)


def _metadata_nested(h, d):
    h["__metadata__"] = {"format": {"pt": "yes"}}
    return _pack(h, d)


FILE_CASES = [   # (id, rewrite, words the message must hold besides the file's path)
    ("truncated to 5 bytes", _truncated_to_5, ["truncated"]),
    ("empty file", _empty, ["truncated"]),
    ("data cut short", _data_cut, ["truncated", "ends past the end of the file"]),
    ("header length past the end", _length_past_end, ["header length", "past the end"]),
    ("header length 2**63", _length_huge, ["header length", "past the end"]),
    ("header not JSON", _not_json, ["corrupt safetensors header", "not valid JSON"]),
    ("header not UTF-8", _not_utf8, ["corrupt safetensors header", "not valid JSON"]),
    ("NaN in the header", _nan, ["corrupt safetensors header", "not valid JSON"]),
    ("header a list", _not_object, ["corrupt safetensors header", "not an object"]),
    ("entry not an object", _entry_not_object, ["corrupt entry for tensor", "not a JSON object"]),
    ("shape/size mismatch", _size_mismatch, ["inconsistent size"]),
    ("dtype/size mismatch", _dtype_mismatch, ["inconsistent size", "BF16"]),
    ("offsets reversed", _offsets_reversed, ["data_offsets", "begin ≤ end"]),
    ("offsets negative", _offsets_negative, ["data_offsets", "begin ≤ end"]),
    ("three offsets", _offsets_three, ["data_offsets"]),
    ("float offsets", _offsets_float, ["data_offsets"]),
    ("offsets beyond the data", _offsets_beyond, ["ends past the end of the file"]),
    ("gap between tensors", _gap, ["belong to no tensor"]),
    ("bytes after the last tensor", _trailing, ["24 bytes after the last tensor"]),
    ("unknown dtype", _unknown_dtype, ["unknown dtype 'F7'"]),
    ("dtype not a string", _dtype_not_string, ["no dtype"]),
    ("negative shape", _negative_shape, ["not a list of non-negative integers"]),
    ("float shape", _float_shape, ["not a list of non-negative integers"]),
    ("string shape", _string_shape, ["not a list of non-negative integers"]),
    ("bool shape", _bool_shape, ["not a list of non-negative integers"]),
    ("shape product overflows int64", _overflow, ["model.evil.weight", "inconsistent size"]),
    ("shape product wraps to 2 in int64", _overflow_wrap, ["model.evil.weight", "inconsistent size"]),
    ("overlapping tensors", _overlap, ["overlap"]),
    ("duplicate tensor name", _duplicate_name, ["appears twice"]),
    ("duplicate key in an entry", _duplicate_inner_key, ["'dtype' appears twice"]),
    ("__metadata__ a list", _metadata_list, ["__metadata__ must map strings to strings"]),
    ("__metadata__ value not a string", _metadata_value_not_str, ["__metadata__ must map strings to strings"]),
    ("__metadata__ nested", _metadata_nested, ["__metadata__ must map strings to strings"]),
]


# ------------------------------------------------------------------------------- index and directory defects

def _as_shards(src, h, d, weight_of=None):
    """src as a one-shard checkpoint with an index; `weight_of(name) -> value` overrides weight_map values."""
    os.rename(src / SINGLE_NAME, src / SHARD)
    wm = {k: SHARD for k in h if k != "__metadata__"}
    if weight_of:
        wm = {k: weight_of(k, v) for k, v in wm.items()}
    (src / INDEX_NAME).write_text(json.dumps({"metadata": {"total_size": len(d)}, "weight_map": wm}))
    return src / INDEX_NAME


def _value_int(src, h, d):
    first = _by_offset(h)[0]
    return _as_shards(src, h, d, lambda k, v: 3 if k == first else v)


def _value_null(src, h, d):
    first = _by_offset(h)[0]
    return _as_shards(src, h, d, lambda k, v: None if k == first else v)


def _value_list(src, h, d):
    return _as_shards(src, h, d, lambda k, v: [v])


def _escape_parent(src, h, d):     # the shard exists, outside the checkpoint: it must not be opened
    shutil.copy(src / SINGLE_NAME, src.parent / "x.safetensors")
    return _as_shards(src, h, d, lambda k, v: "../x.safetensors")


def _escape_absolute(src, h, d):
    shutil.copy(src / SINGLE_NAME, src.parent / "abs.safetensors")
    return _as_shards(src, h, d, lambda k, v: str(src.parent / "abs.safetensors"))


def _escape_symlinked_dir(src, h, d):
    (src.parent / "elsewhere").mkdir()
    shutil.copy(src / SINGLE_NAME, src.parent / "elsewhere" / SHARD)
    os.symlink(src.parent / "elsewhere", src / "sub")
    return _as_shards(src, h, d, lambda k, v: "sub/" + SHARD)


def _index_not_json(src, h, d):
    index = _as_shards(src, h, d)
    index.write_text("{\"weight_map\": ")
    return index


def _index_weight_map_list(src, h, d):
    index = _as_shards(src, h, d)
    index.write_text(json.dumps({"weight_map": [SHARD]}))
    return index


def _index_duplicate_name(src, h, d):
    index = _as_shards(src, h, d)
    first = _by_offset(h)[0]
    text = index.read_text()
    index.write_text(text[:-2] + f', "{first}": "{SHARD}"' + text[-2:])
    assert json.loads(index.read_text())   # plain json.loads takes it
    return index


def _tensor_in_two_shards(src, h, d):
    index = _as_shards(src, h, d)
    shutil.copy(src / SHARD, src / "model-extra.safetensors")
    wm = json.loads(index.read_text())["weight_map"]
    wm[_by_offset(h)[0]] = "model-extra.safetensors"
    index.write_text(json.dumps({"weight_map": wm}))
    return src


INDEX_CASES = [   # (id, rewrite returning the file the message names, words of the message)
    ("weight_map value an int", _value_int, ["malformed index", "not a shard file name"]),
    ("weight_map value null", _value_null, ["malformed index", "not a shard file name"]),
    ("weight_map value a list", _value_list, ["malformed index", "not a shard file name"]),
    ("shard name ../x.safetensors", _escape_parent, ["'../x.safetensors'", "outside the checkpoint directory"]),
    ("shard name absolute", _escape_absolute, ["abs.safetensors", "outside the checkpoint directory"]),
    ("shard through a symlinked directory", _escape_symlinked_dir, ["outside the checkpoint directory"]),
    ("index not JSON", _index_not_json, ["malformed index", "not valid JSON"]),
    ("weight_map a list", _index_weight_map_list, ["malformed index", "no weight_map object"]),
    ("duplicate name in the index", _index_duplicate_name, ["appears twice"]),
    ("tensor in two shards", _tensor_in_two_shards, ["is in two shards", SHARD, "model-extra.safetensors"]),
]


def _refused(capsys, src, tmp_path, needles):
    capsys.readouterr()
    dst = tmp_path / "out"
    before = sorted(os.listdir(tmp_path))
    rc = cli(["convert", "hf-to-orbax", str(src), str(dst)])
    err = capsys.readouterr().err.strip()
    assert rc == 2, err
    assert err.startswith("prisma convert: error: ") and "\n" not in err and "Traceback" not in err, err
    for n in needles:
        assert n in err, (n, err)
    assert not os.path.lexists(dst) and sorted(os.listdir(tmp_path)) == before   # nothing written
    return err


def _from_pretrained_refuses(src, needles):
    from prisma_jax import PrismaVL

    with pytest.raises(CheckpointError) as info:
        PrismaVL.from_pretrained(str(src))
    msg = str(info.value)
    assert "\n" not in msg
    for n in needles:
        assert n in msg, (n, msg)


def test_checkpoint_error_is_a_one_line_user_error():
    assert issubclass(CheckpointError, ValueError)   # the CLI prints ValueErrors as one line, exit 2


@pytest.mark.parametrize("rewrite,needles", [c[1:] for c in FILE_CASES], ids=[c[0] for c in FILE_CASES])
def test_a_malformed_file_is_refused(base, tmp_path, capsys, rewrite, needles):
    src = tmp_path / "src"
    shutil.copytree(base, src)
    header, data = _parts(src / SINGLE_NAME)
    (src / SINGLE_NAME).write_bytes(rewrite(header, data))
    named = [str(src / SINGLE_NAME), *needles]
    _refused(capsys, src, tmp_path, named)
    _from_pretrained_refuses(src, named)


@pytest.mark.parametrize("rewrite,needles", [c[1:] for c in INDEX_CASES], ids=[c[0] for c in INDEX_CASES])
def test_a_malformed_index_is_refused(base, tmp_path, capsys, rewrite, needles, monkeypatch):
    src = tmp_path / "src"
    shutil.copytree(base, src)
    header, data = _parts(src / SINGLE_NAME)
    named = [str(rewrite(src, header, data)), *needles]
    opened = []
    real_open = open

    def watch(path, *a, **k):   # a shard outside the directory is never opened
        opened.append(os.path.realpath(path))
        return real_open(path, *a, **k)

    import prisma_jax.checkpoint.safetensors as st
    monkeypatch.setattr(st, "open", watch, raising=False)
    _refused(capsys, src, tmp_path, named)
    _from_pretrained_refuses(src, named)
    root = os.path.realpath(src)
    assert all(p.startswith(root + os.sep) for p in opened), opened


def test_the_valid_base_and_its_variants_load(base, tmp_path):
    """The checks refuse nothing valid: the base, the base as an indexed shard, a shard that is a symlink to a
    file outside the directory (a Hugging Face cache snapshot), and empty / null __metadata__."""
    with Checkpoint(str(base)) as ck:
        ref = {k: np.array(ck.get(k)) for k in ck.keys()}
    src = tmp_path / "snap"
    shutil.copytree(base, src)
    header, data = _parts(src / SINGLE_NAME)
    _as_shards(src, header, data)
    (tmp_path / "blobs").mkdir()
    os.rename(src / SHARD, tmp_path / "blobs" / "sha256-abc")
    os.symlink(os.path.join("..", "blobs", "sha256-abc"), src / SHARD)
    with Checkpoint(str(src)) as ck:
        assert ck.keys() == sorted(ref) and all(np.array_equal(ck.get(k), ref[k]) for k in ref)
    for meta in (None, {}):
        other = tmp_path / f"meta{meta}"
        shutil.copytree(base, other)
        header["__metadata__"] = meta
        (other / SINGLE_NAME).write_bytes(_pack(header, data))
        with Checkpoint(str(other)) as ck:
            assert ck.keys() == sorted(ref)


# ----------------------------------------------------------------------------- PieceWriter checks coverage

def test_piece_writer_refuses_a_duplicated_piece_that_hides_a_hole(tmp_path):
    a = np.arange(24, dtype=np.float32).reshape(6, 4)
    specs = [("a", a.shape, np.float32), ("s", (), np.float32)]
    w = PieceWriter(str(tmp_path / "dup"), specs)
    w.put("s", np.float32(1), ())
    w.put("a", a[:3], (slice(0, 3),))
    w.put("a", a[2:5], (slice(2, 5),))        # row 2 twice ...
    w.put("a", a[5:, :2], (slice(5, 6), slice(0, 2)))
    w.put("a", a[5:, 1:3], (slice(5, 6), slice(1, 3)))   # ... and [5, 1] twice: 24 elements, [5, 3] never
    with pytest.raises(ValueError, match=r"dup: tensor 'a': pieces \[.*\] and \[.*\] overlap"):
        w.close()
    w = PieceWriter(str(tmp_path / "scalar"), specs)
    w.put("a", a, ())
    w.put("s", np.float32(1), ())
    w.put("s", np.float32(2), ())
    with pytest.raises(ValueError, match=r"tensor 's': pieces \[\] and \[\] overlap"):
        w.close()
    w = PieceWriter(str(tmp_path / "gap"), specs)
    w.put("s", np.float32(1), ())
    w.put("a", a[:, :3], (slice(0, 6), slice(0, 3)))
    with pytest.raises(ValueError, match=r"tensor 'a' received 72 bytes, expected 96 \(part of it never written\)"):
        w.close()
    w = PieceWriter(str(tmp_path / "bad"), specs)
    with pytest.raises(ValueError, match="no tensor 'b'"):
        w.put("b", a, ())
    with pytest.raises(ValueError, match="not one unit-step slice per axis"):
        w.put("a", a[::2], (slice(0, 6, 2),))
    with pytest.raises(ValueError, match="not one unit-step slice per axis"):
        w.put("a", a[:1, :1], (slice(0, 1), slice(0, 1), slice(0, 1)))
    w.f.close()


def test_piece_writer_accepts_an_exact_tiling_in_any_order(tmp_path):
    from prisma_jax.checkpoint.safetensors import write_streaming

    rng = np.random.default_rng(1)
    a = rng.standard_normal((7, 5, 3)).astype(np.float32)
    specs = [("a", a.shape, np.float32), ("z", (0, 4), np.float32)]
    write_streaming(str(tmp_path / "ref"), specs, lambda k: [a if k == "a" else np.zeros((0, 4), np.float32)])
    w = PieceWriter(str(tmp_path / "tiles"), specs)
    tiles = [(slice(r, min(r + 2, 7)), slice(c, min(c + 3, 5)), slice(0, 3)) for r in range(0, 7, 2)
             for c in range(0, 5, 3)]
    for t in reversed(tiles):
        w.put("a", a[t], t)
    w.close()
    assert open(tmp_path / "ref", "rb").read() == open(tmp_path / "tiles", "rb").read()
