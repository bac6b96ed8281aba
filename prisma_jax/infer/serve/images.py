"""Image URLs of chat requests → bounded PIL images, with no network access, and size buckets.

Loading (`load_image_url`). Accepted: `data:image/...;base64,...` URLs, and — only when the server was given an
image root (`prisma serve --image-root DIR`) — local paths (`/abs/path.png`, `rel/path.png` relative to the root,
or `file://` URLs) that resolve inside that root. Remote URLs (http, https, anything else) are refused: the server
never fetches. Every image is bounded *before* any expensive work, by `ImageLimits`:

  bytes    a data: URL's decoded size is computed from the base64 length before decoding, a file's from its
           size on disk; over `max_bytes` → refused (`--max-image-bytes`).
  format   `Image.open(..., formats=limits.formats)`, so no other PIL plugin ever looks at the bytes
           (PNG, JPEG, WEBP, GIF by default; animated images give their first frame).
  pixels   width × height is read from the header (lazy `Image.open`) and checked before `load()` / `convert`;
           over `max_pixels` → refused (`--max-image-pixels`). A 20 KB PNG of 17,000×10,000 1-bit pixels would
           otherwise become 510 MB of RGB.

Every failure is an `APIError` 400 naming the message part.

Bucketing (`image_buckets`, `bucket_image`). Every accepted image is resized to one of a few grids (height,
width in patches) that all have the same area, so the vision tower's patch count and the prompt's image-token
count depend only on the number of images, never on their sizes: a new image size never causes a compile.
Both sides are multiples of patch·merge and the area is within the image processor's [min_pixels, max_pixels],
so Qwen2-VL's `smart_resize` leaves a bucketed image as it is and the processor's grid is the bucket.
"""
from __future__ import annotations

import base64
import binascii
import dataclasses
import functools
import io
import math
import os
from urllib.parse import unquote, urlparse

from prisma_jax.infer.serve.protocol import bad

MAX_IMAGE_BYTES = 32 << 20
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ImageLimits:
    """What one request image may be. `max_bytes`: encoded bytes (`--max-image-bytes`); `max_pixels`: decoded
    width × height (`--max-image-pixels`); `formats`: PIL format ids that may decode it."""
    max_bytes: int = MAX_IMAGE_BYTES
    max_pixels: int
    formats: tuple[str, ...] = IMAGE_FORMATS

    def __post_init__(self):
        from PIL import Image
        for name in ("max_bytes", "max_pixels"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"ImageLimits.{name} must be a positive int, got {v!r}")
        formats = (self.formats,) if isinstance(self.formats, str) else tuple(self.formats)
        formats = tuple(str(f).upper() for f in formats)
        Image.init()
        unknown = [f for f in formats if f not in Image.OPEN]
        if not formats or unknown:
            raise ValueError(f"ImageLimits.formats: {unknown or 'empty'}; PIL can open {sorted(Image.OPEN)}")
        object.__setattr__(self, "formats", formats)


def load_image_url(url: str, root: str | None, where: str, limits: ImageLimits):
    """One image_url of a request → an RGB PIL image within `limits`, or `bad(...)` (400) naming `where`."""
    if url.startswith("data:"):
        head, sep, payload = url.partition(",")
        if not sep or not head.endswith(";base64"):
            raise bad(f"{where}: a data: URL must be base64 (data:image/png;base64,...)", "messages")
        size = len(payload) * 3 // 4 - payload.endswith("=") - payload.endswith("==")   # exact, before decoding
        _check_bytes(size, where, limits)
        try:
            source = io.BytesIO(base64.b64decode(payload, validate=True))
        except (binascii.Error, ValueError):
            raise bad(f"{where}: the data: URL is not valid base64", "messages") from None
    else:
        scheme = urlparse(url).scheme.lower()
        if scheme not in ("", "file") and not (len(scheme) == 1 and os.name == "nt"):
            raise bad(f"{where}: remote image URLs ({scheme}://) are not fetched; send the image as a data: URL "
                      "or a path under the server's --image-root", "messages")
        if root is None:
            raise bad(f"{where}: local image paths are refused (the server has no --image-root)", "messages")
        path = unquote(urlparse(url).path) if scheme == "file" else url
        real = os.path.realpath(os.path.join(root, path))
        top = os.path.realpath(root)
        if os.path.commonpath([real, top]) != top:
            raise bad(f"{where}: {path!r} is outside the server's --image-root", "messages")
        if not os.path.isfile(real):
            raise bad(f"{where}: no image file {path!r} under the server's --image-root", "messages")
        _check_bytes(os.path.getsize(real), where, limits)
        source = real
    return _decode(source, where, limits)


def _check_bytes(size: int, where: str, limits: ImageLimits) -> None:
    if size > limits.max_bytes:
        raise bad(f"{where}: the image is {size} bytes, over the server's limit of {limits.max_bytes} bytes "
                  "(--max-image-bytes)", "messages")


def _decode(source, where: str, limits: ImageLimits):
    from PIL import Image

    def too_many(pixels) -> Exception:
        return bad(f"{where}: the image has {pixels} pixels, over the server's limit of {limits.max_pixels} "
                   "pixels (--max-image-pixels)", "messages")

    allowed = ", ".join(limits.formats)
    try:
        im = Image.open(source, formats=list(limits.formats))     # lazy: header only, other plugins never run
    except Image.UnidentifiedImageError:
        raise bad(f"{where}: not an image in an accepted format ({allowed})", "messages") from None
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:   # PIL's own cap (warnings→errors)
        if limits.max_pixels <= Image.MAX_IMAGE_PIXELS:
            raise too_many(f"more than {Image.MAX_IMAGE_PIXELS}") from None
        raise bad(f"{where}: the image is over PIL's decompression-bomb limit ({e})", "messages") from None
    except (OSError, ValueError, SyntaxError, EOFError) as e:
        raise bad(f"{where}: cannot decode the image ({e})", "messages") from None
    with im:
        w, h = im.size
        if w * h > limits.max_pixels:
            raise too_many(f"{w}×{h} = {w * h}")
        try:
            im.load()                                                # first frame only (GIF, animated WEBP)
            return im.convert("RGB")
        except (OSError, ValueError, SyntaxError, EOFError, Image.DecompressionBombError) as e:
            raise bad(f"{where}: cannot decode the image ({e})", "messages") from None


# ------------------------------------------------------------------------------------------------- buckets

def image_buckets(patch_size: int, merge_size: int, max_pixels: int, *, min_pixels: int = 0,
                  max_aspect: int = 4) -> list[tuple[int, int]]:
    """The grids (height, width) in patches that every image is resized to, ordered by height/width.

    All have the same area A patches, sides multiples of `merge_size`, height/width in [1/max_aspect,
    max_aspect], and A·patch² ≤ max_pixels. In merge units K = A/merge², K is the number ≤
    max_pixels / (patch·merge)² with the most (h, w) divisor pairs in that aspect range (ties: the larger K).
    A·patch² < `min_pixels` (the image processor's, which would upscale it) → ValueError.
    """
    return list(_buckets(patch_size, merge_size, max_pixels, min_pixels, max_aspect))


@functools.lru_cache(maxsize=32)
def _buckets(patch_size, merge_size, max_pixels, min_pixels, max_aspect) -> tuple[tuple[int, int], ...]:
    for name, v in (("patch_size", patch_size), ("merge_size", merge_size), ("max_pixels", max_pixels),
                    ("max_aspect", max_aspect)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"image_buckets: {name} must be a positive int, got {v!r}")
    unit = patch_size * merge_size
    kmax = max_pixels // unit ** 2
    if kmax < 1:
        raise ValueError(f"image_buckets: max_pixels {max_pixels} is below one merged patch ({unit}² pixels)")
    pairs = [0] * (kmax + 1)
    for a in range(1, kmax + 1):
        lo, hi = -(-a // max_aspect), min(a * max_aspect, kmax // a)    # b with a/b, b/a ≤ max_aspect, a·b ≤ kmax
        if lo > kmax // a:
            break                                                        # a·ceil(a/max_aspect) only grows
        for b in range(lo, hi + 1):
            pairs[a * b] += 1
    k = max(range(1, kmax + 1), key=lambda n: (pairs[n], n))
    area = k * merge_size ** 2
    if area * patch_size ** 2 < min_pixels:
        raise ValueError(f"image_buckets: the buckets hold {area * patch_size ** 2} pixels ({area} patches of "
                         f"{patch_size}²), below the image processor's min_pixels {min_pixels}, which would "
                         "resize them again; raise max_pixels or lower min_pixels")
    return tuple((a * merge_size, (k // a) * merge_size) for a in range(1, k + 1)
                 if k % a == 0 and a <= max_aspect * (k // a) and k // a <= max_aspect * a)


def bucket_image(img, buckets, patch_size: int):
    """`img` resized (PIL bicubic, RGB) to exactly (w·patch, h·patch) pixels for the bucket (h, w) of
    `buckets` whose log aspect ratio is closest to the image's (ties: the earlier bucket)."""
    from PIL import Image

    if not buckets:
        raise ValueError("bucket_image: no buckets")
    iw, ih = img.size
    target = math.log(ih / iw)
    h, w = min(buckets, key=lambda hw: abs(math.log(hw[0] / hw[1]) - target))
    img = img if img.mode == "RGB" else img.convert("RGB")
    return img.resize((w * patch_size, h * patch_size), Image.Resampling.BICUBIC)
