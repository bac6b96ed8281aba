"""`data.on_malformed`: bad data never kills a `skip` run, and stops an `error` run with one error naming file:line.

Index time (train/data.py `index_jsonl`): a line that is not UTF-8 or not JSON. Load time (`LoadImages`, in grain's
read threads or worker processes): a truncated JPEG, a decompression bomb (a PNG whose header claims 30000², PIL
refuses it before decoding), a file PIL cannot identify. Skipped records are counted, named in the skip log (one
{"file", "line", "why"} line each), and a record bad at load time becomes a fully masked row: same batch shape,
no attention, no target."""
import json
import struct
import zlib

import numpy as np
import pytest

from test_train_loop import GOOD, SHORT, jsonl_cfg, write_jsonl


def bad_images(d):
    """truncated.jpg, bomb.png, junk.png in folder `d`."""
    from PIL import Image
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 255, (64, 64, 3), dtype=np.uint8)).save(d / "full.jpg", quality=90)
    data = (d / "full.jpg").read_bytes()
    (d / "truncated.jpg").write_bytes(data[:len(data) // 2])

    def chunk(kind, body):
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
    ihdr = struct.pack(">IIBBBBB", 30000, 30000, 8, 2, 0, 0, 0)            # 30000² RGB: 900 M pixels
    (d / "bomb.png").write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr)
                                 + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b""))
    (d / "junk.png").write_bytes(b"this is not an image at all\n" * 4)


def skips(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


# ------------------------------------------------------------------------------------------------ index time

def index_lines(tmp_path):
    """line 2: invalid UTF-8, line 3: not JSON; lines 1 and 4 good."""
    path, proc = write_jsonl(tmp_path, [GOOD, "@@", "{not json", SHORT])
    with open(path, "rb") as f:
        data = f.read()
    with open(path, "wb") as f:
        f.write(data.replace(b"@@", b'{"messages": "caf\xe9 \xff"}'))
    return path, proc


def test_invalid_utf8_line_is_one_error_naming_file_and_line(tmp_path):
    from train.data import build
    path, proc = index_lines(tmp_path)
    with pytest.raises(ValueError, match=rf"^{path}:2: invalid UTF-8 \(byte 0xe9 at byte 18 of the line\)$"):
        build(jsonl_cfg(path, proc), str(tmp_path / "wd"))
    with open(path, "rb") as f:                                          # line 2 fixed: line 3 is next
        lines = f.read().split(b"\n")
    lines[1] = SHORT.encode()
    with open(path, "wb") as f:
        f.write(b"\n".join(lines))
    with pytest.raises(ValueError, match=rf"^{path}:3: malformed JSON"):
        build(jsonl_cfg(path, proc), str(tmp_path / "wd"))


def test_invalid_utf8_and_bad_json_lines_are_skipped_counted_and_logged(tmp_path):
    from train.data import build
    path, proc = index_lines(tmp_path)
    log = tmp_path / "wd" / "skipped.jsonl"
    ds, info = build(jsonl_cfg(path, proc, on_malformed="skip", shuffle=False), str(tmp_path / "wd"),
                     skip_log=str(log))
    assert (info.records, info.skipped_malformed) == (2, 2)
    got = skips(log)
    assert [(s["file"], s["line"]) for s in got] == [(path, 2), (path, 3)]
    assert got[0]["why"].startswith("invalid UTF-8") and got[1]["why"].startswith("malformed JSON")
    b = next(iter(ds))
    assert b.input_ids.shape == (1, 2, 24) and (b.attention_mask.sum(-1) > 0).all()
    # host 1 of 2 indexes the same file but leaves the index-time skips to host 0
    build(jsonl_cfg(path, proc, on_malformed="skip"), str(tmp_path / "wd"), host=1, hosts=2, skip_log=str(log))
    assert not (tmp_path / "wd" / "skipped.process_1.jsonl").exists()


# ------------------------------------------------------------------------------------------------- load time

BAD = {2: "truncated.jpg", 3: "bomb.png", 4: "junk.png"}


def load_lines(tmp_path):
    """6 records: 1 good image, 2-4 bad images (BAD), 5 text only, 6 good image."""
    (tmp_path / "data").mkdir()
    bad_images(tmp_path / "data")
    lines = [GOOD] + [GOOD.replace("red.png", BAD[i]) for i in (2, 3, 4)] + [SHORT, GOOD]
    return write_jsonl(tmp_path, lines)


@pytest.mark.parametrize("workers", [0, 1])
def test_bad_images_become_masked_rows_counted_and_logged(tmp_path, workers):
    from train.data import build
    path, proc = load_lines(tmp_path)
    log = tmp_path / "wd" / "skipped.jsonl"
    cfg = jsonl_cfg(path, proc, on_malformed="skip", shuffle=False, num_threads=2)
    ds, info = build(cfg, str(tmp_path / "wd"), skip_log=str(log), workers=workers)
    assert (info.records, info.skipped_malformed) == (6, 0)               # all bad only when read
    it = iter(ds)
    rows = []                                                             # (mask, targets, pixels) per row
    for _ in range(6):                                                    # two epochs of 3 batches of 2
        b = next(it)
        assert b.input_ids.shape == (1, 2, 24) and b.pixel_values.shape == (1, 2, 16, 1536)
        rows += [(b.attention_mask[0, j], b.targets[0, j], b.pixel_values[0, j], b.input_ids[0, j]) for j in range(2)]
    assert info.skipped_at_load == 6                                      # 3 bad records, read twice
    for k, (mask, tg, px, ids) in enumerate(rows):
        line = k % 6 + 1
        if line in BAD:                                                   # fully masked: nothing attends, no loss
            assert not mask.any() and (tg < 0).all() and not px.any() and not ids.any()
        else:
            assert mask.sum() > 0 and (tg >= 0).sum() > 0
            assert px.any() == (line != 5)
    got = skips(log)                                                      # once each, in this one process
    assert sorted((s["file"], s["line"]) for s in got) == [(path, 2), (path, 3), (path, 4)]
    why = {s["line"]: s["why"] for s in got}
    assert "truncated.jpg" in why[2] and "truncated" in why[2]
    assert "DecompressionBomb" in why[3] and "bomb.png" in why[3]
    assert "junk.png" in why[4] and "cannot identify" in why[4]


@pytest.mark.parametrize("workers", [0, 1])
@pytest.mark.parametrize("line", sorted(BAD))
def test_bad_image_with_on_malformed_error_is_one_error_naming_file_and_line(tmp_path, workers, line):
    from train.data import build
    path, proc = load_lines(tmp_path)
    with open(path) as f:
        lines = f.read().splitlines()
    keep = [lines[0], lines[line - 1]]                                    # the bad record is line 2 now
    with open(path, "w") as f:
        f.write("\n".join(keep) + "\n")
    ds, _ = build(jsonl_cfg(path, proc, shuffle=False), str(tmp_path / "wd"), workers=workers)
    with pytest.raises(Exception) as e:
        next(iter(ds))
    msg = str(e.value)
    assert f"{path}:2: cannot read image" in msg and BAD[line] in msg, msg
    assert msg.count(f"{path}:2:") == 1


def test_packed_row_keeps_its_good_conversations(tmp_path):
    """data.packing: the bad record leaves its row; the row's other conversations keep their segments."""
    from train.data import build
    path, proc = load_lines(tmp_path)
    cfg = jsonl_cfg(path, proc, on_malformed="skip", shuffle=False, packing=True, max_images=2)
    import dataclasses
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, seq_len=48, batch_size=1))
    ds, info = build(cfg, str(tmp_path / "wd"), skip_log=str(tmp_path / "skipped.jsonl"))
    it = iter(ds)
    masks = [next(it).attention_mask[0, 0] for _ in range(info.rows)]
    assert info.skipped_at_load == 3 and len(skips(tmp_path / "skipped.jsonl")) == 3
    n_seg = sum(len(set(m[m > 0].tolist())) for m in masks)
    assert n_seg == 3                                                     # lines 1, 5, 6
    for m in masks:                                                       # segments 1, 2, ... contiguous
        segs = [s for s in dict.fromkeys(m.tolist()) if s]
        assert segs == list(range(1, len(segs) + 1))
