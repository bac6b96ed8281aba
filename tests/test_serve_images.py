"""serve/images.py: request images bounded before decoding (bytes, format, pixels) and bucketed to equal-area
grids that the image processor keeps as they are. Fast, no model."""
import base64
import io
import warnings

import numpy as np
import pytest
from PIL import Image, ImageFile

from prisma_jax.infer.serve.images import ImageLimits, bucket_image, image_buckets, load_image_url
from prisma_jax.infer.serve.protocol import APIError

WHERE = "messages[0].content[1]"
LIMITS = ImageLimits(max_pixels=4096 * 4096)


def encode(img, fmt="PNG", **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt, **kw)
    return buf.getvalue()


def data_url(raw: bytes, mime="image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(raw).decode()


def refused(url, root=None, limits=LIMITS) -> str:
    with pytest.raises(APIError) as e:
        load_image_url(url, root, WHERE, limits)
    assert e.value.status == 400 and e.value.param == "messages" and e.value.message.startswith(WHERE)
    return e.value.message


def noise(w, h, seed=0):
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


# ------------------------------------------------------------------------------------------------ limits

def test_accepted_formats_load_as_rgb(tmp_path):
    for fmt, mode in (("PNG", "RGBA"), ("JPEG", "L"), ("WEBP", "RGB"), ("GIF", "P")):
        img = load_image_url(data_url(encode(Image.new(mode, (40, 30)), fmt)), None, WHERE, LIMITS)
        assert img.mode == "RGB" and img.size == (40, 30), fmt
    (tmp_path / "a.png").write_bytes(encode(Image.new("RGB", (5, 7), "red")))
    for url in ("a.png", str(tmp_path / "a.png"), (tmp_path / "a.png").as_uri()):
        assert load_image_url(url, str(tmp_path), WHERE, LIMITS).getpixel((0, 0)) == (255, 0, 0)


def test_data_url_over_max_bytes_is_refused_before_decoding(monkeypatch):
    limits = ImageLimits(max_bytes=1000, max_pixels=4096 * 4096)
    over = data_url(bytes(1001))
    exact = data_url(bytes(1000))

    def boom(*a, **k):
        raise AssertionError("base64 decoded a payload over the limit")
    with monkeypatch.context() as m:
        m.setattr(base64, "b64decode", boom)
        msg = refused(over, limits=limits)
    assert "1001 bytes" in msg and "1000 bytes" in msg and "--max-image-bytes" in msg
    # the size computed from the base64 length is exact: 1000 bytes pass the byte check (then fail as no image)
    for n in (998, 999, 1000):
        msg = refused(data_url(bytes(n)), limits=limits)
        assert "--max-image-bytes" not in msg and "accepted format" in msg
    assert "accepted format" in refused(exact, limits=limits)


def test_file_over_max_bytes_is_refused(tmp_path):
    raw = encode(noise(64, 64))
    assert len(raw) > 4000
    (tmp_path / "big.png").write_bytes(raw)
    msg = refused("big.png", str(tmp_path), ImageLimits(max_bytes=4000, max_pixels=4096 * 4096))
    assert f"{len(raw)} bytes" in msg and "4000 bytes" in msg and "--max-image-bytes" in msg
    assert load_image_url("big.png", str(tmp_path), WHERE, LIMITS).size == (64, 64)


def test_pixel_bomb_is_refused_from_its_header(tmp_path, monkeypatch):
    raw = encode(Image.new("1", (17000, 10000)))          # 1-bit zeros: tiny as PNG, 510 MB as RGB
    assert len(raw) < 100_000
    (tmp_path / "bomb.png").write_bytes(raw)

    def boom(*a, **k):
        raise AssertionError("pixels decoded")
    monkeypatch.setattr(ImageFile.ImageFile, "load", boom)
    monkeypatch.setattr(Image.Image, "load", boom)
    monkeypatch.setattr(Image.Image, "convert", boom)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)   # PIL warns above 89 Mpx; we refuse
        for url, root in ((data_url(raw), None), ("bomb.png", str(tmp_path))):
            msg = refused(url, root)
            assert "17000×10000 = 170000000 pixels" in msg and str(4096 * 4096) in msg
            assert "--max-image-pixels" in msg
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)    # PIL's warning as an error: same 400
        assert "--max-image-pixels" in refused(data_url(raw))
    # one pixel over a small limit, also refused; at the limit it passes the check (and only then decodes)
    monkeypatch.undo()
    (tmp_path / "s.png").write_bytes(encode(Image.new("L", (10, 10))))
    assert "--max-image-pixels" in refused("s.png", str(tmp_path), ImageLimits(max_pixels=99))
    assert load_image_url("s.png", str(tmp_path), WHERE, ImageLimits(max_pixels=100)).size == (10, 10)


@pytest.mark.parametrize("fmt", ["BMP", "TIFF", "EPS", "ICO", "PPM"])
def test_other_formats_are_refused_without_running_their_plugin(fmt, tmp_path, monkeypatch):
    Image.init()
    if fmt == "EPS":
        raw = b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 16 16\nshowpage\n%%EOF\n"
    else:
        raw = encode(Image.new("RGB", (16, 16), "red"), fmt)
    for name in ("BMP", "TIFF", "EPS", "ICO", "PPM"):
        factory, _ = Image.OPEN[name]

        def accept(prefix, name=name):
            raise AssertionError(f"the {name} plugin looked at the bytes")
        monkeypatch.setitem(Image.OPEN, name, (factory, accept))
    (tmp_path / f"x.{fmt.lower()}").write_bytes(raw)
    for url, root in ((data_url(raw, "image/x"), None), (f"x.{fmt.lower()}", str(tmp_path))):
        msg = refused(url, root)
        assert "accepted format (PNG, JPEG, WEBP, GIF)" in msg


def test_gif_gives_its_first_frame():
    red, blue = Image.new("RGB", (8, 6), (255, 0, 0)), Image.new("RGB", (8, 6), (0, 0, 255))
    raw = encode(red, "GIF", save_all=True, append_images=[blue], duration=50, loop=0)
    with Image.open(io.BytesIO(raw)) as im:
        assert im.n_frames == 2
    img = load_image_url(data_url(raw, "image/gif"), None, WHERE, LIMITS)
    assert img.mode == "RGB" and img.size == (8, 6) and (np.asarray(img) == (255, 0, 0)).all()


def test_limits_can_narrow_the_formats_and_are_validated():
    only_png = ImageLimits(max_pixels=10_000, formats=("png",))
    assert only_png.formats == ("PNG",)
    assert "accepted format (PNG)" in refused(data_url(encode(Image.new("RGB", (4, 4)), "JPEG")), limits=only_png)
    for bad_kw in (dict(formats=("NOPE",)), dict(formats=()), dict(max_bytes=0), dict(max_pixels=-1),
                   dict(max_pixels=True)):
        with pytest.raises(ValueError):
            ImageLimits(**{"max_pixels": 100, **bad_kw})
    with pytest.raises(TypeError):
        ImageLimits()                                   # max_pixels has no default


def test_remote_and_outside_root_are_still_refused(tmp_path):
    assert "not fetched" in refused("https://example.com/a.png", str(tmp_path))
    assert "no --image-root" in refused("a.png", None)
    assert "outside" in refused("../x.png", str(tmp_path))
    assert "not valid base64" in refused("data:image/png;base64,@@@@")
    assert "must be base64" in refused("data:image/png,abc")


# ----------------------------------------------------------------------------------------------- buckets

def _pairs(k, aspect=4):
    return sum(1 for a in range(1, k + 1) if k % a == 0 and a <= aspect * (k // a) and k // a <= aspect * a)


def test_tiny_processor_buckets():
    b = image_buckets(16, 2, 256 * 256)
    # K = 60 merge units (6 divisor pairs within 1:4..4:1, the most of any K ≤ 64): A = 240 patches, 61440 px
    assert b == [(8, 30), (10, 24), (12, 20), (20, 12), (24, 10), (30, 8)]
    with pytest.raises(ValueError, match="min_pixels"):
        image_buckets(16, 2, 256 * 256, min_pixels=256 * 256)
    with pytest.raises(ValueError, match="below one merged patch"):
        image_buckets(16, 2, 1023)


@pytest.mark.parametrize("patch,merge,max_pixels", [(16, 2, 256 * 256), (14, 2, 1003520), (16, 2, 1 << 20),
                                                    (16, 2, 16777216), (14, 2, 12845056), (16, 1, 65536),
                                                    (16, 2, 1024), (16, 2, 4096), (8, 3, 50_000)])
def test_buckets_share_one_area_within_limits(patch, merge, max_pixels):
    b = image_buckets(patch, merge, max_pixels)
    assert b and len(set(b)) == len(b)
    area = b[0][0] * b[0][1]
    for h, w in b:
        assert h % merge == 0 and w % merge == 0 and h * w == area
        assert 1 / 4 <= h / w <= 4
    assert area * patch ** 2 <= max_pixels
    assert [h / w for h, w in b] == sorted(h / w for h, w in b)
    kmax, k = max_pixels // (patch * merge) ** 2, area // merge ** 2
    assert len(b) == _pairs(k)
    if kmax <= 5000:                                    # K has the most pairs of any K ≤ kmax (ties: the larger)
        assert (_pairs(k), k) == max((_pairs(n), n) for n in range(1, kmax + 1))
    b.append((1, 1))                                    # callers get their own list
    assert image_buckets(patch, merge, max_pixels) == b[:-1]


def test_bucket_image_picks_the_closest_aspect_and_resizes_exactly():
    b = image_buckets(16, 2, 256 * 256)
    cases = {(400, 100): (8, 30), (100, 400): (30, 8), (2000, 800): (10, 24), (480, 640): (20, 12),
             (5000, 1): (8, 30), (1, 5000): (30, 8)}
    for (w, h), (bh, bw) in cases.items():
        out = bucket_image(Image.new("L", (w, h)), b, 16)
        assert out.size == (bw * 16, bh * 16) and out.mode == "RGB", (w, h)
    sq = [bucket_image(Image.new("RGBA", (s, s)), b, 16).size for s in (1, 50, 999)]
    assert len(set(sq)) == 1 and sq[0] in ((320, 192), (192, 320))   # no square bucket: deterministic pick
    with pytest.raises(ValueError):
        bucket_image(Image.new("RGB", (4, 4)), [], 16)


SIZES = [(1, 1), (7, 300), (300, 7), (1000, 10), (200, 500), (640, 480), (480, 640), (1920, 1080), (33, 999),
         (500, 200), (256, 256), (100, 400), (400, 100), (123, 457), (3000, 2000), (64, 2048)]


def test_processor_keeps_every_bucketed_image_on_its_bucket(tmp_path):
    from prisma_jax.host.processing import Processor, build_tokenizer
    d = str(tmp_path / "proc")
    build_tokenizer(d, ["hello"], min_pixels=32 * 32 * 4, max_pixels=256 * 256)
    p = Processor.from_pretrained(d)
    b = image_buckets(16, 2, 256 * 256, min_pixels=32 * 32 * 4)
    assert len(SIZES) == 16 and len(set(SIZES)) == 16
    imgs = [bucket_image(noise(w, h, i), b, 16) for i, (w, h) in enumerate(SIZES)]
    text = "hello" + "<|vision_start|><|image_pad|><|vision_end|>" * len(imgs)
    enc = p(text=text, images=imgs)
    grids = [tuple(int(x) for x in g) for g in enc["image_grid_thw"]]
    assert grids == [(1, im.size[1] // 16, im.size[0] // 16) for im in imgs]
    assert {g[1:] for g in grids} <= set(b) and {g[1] * g[2] for g in grids} == {240}
    assert len({g[1:] for g in grids}) == len(b)         # the sizes above reach every bucket
    assert enc["pixel_values"].shape[0] == 16 * 240
    assert int((enc["input_ids"] == p.image_token_id).sum()) == 16 * 60
    # without buckets the same images give many grids (and patch counts): what bucketing removes
    raw = p(text=text, images=[noise(w, h, i) for i, (w, h) in enumerate(SIZES)])
    assert len({int(g[1] * g[2]) for g in raw["image_grid_thw"]}) > 3
