"""Image URLs of chat requests → PIL images, with no network access.

Accepted: `data:image/...;base64,...` URLs, and — only when the server was given an image root
(`prisma serve --image-root DIR`) — local paths (`/abs/path.png`, `rel/path.png` relative to the root, or
`file://` URLs) that resolve inside that root. Remote URLs (http, https, anything else) are refused: the server
never fetches. Every failure is an `APIError` 400 naming the message part.
"""
from __future__ import annotations

import base64
import binascii
import io
import os
from urllib.parse import unquote, urlparse

from prisma_jax.infer.serve.protocol import bad

MAX_IMAGE_BYTES = 32 << 20


def load_image_url(url: str, root: str | None, where: str):
    from PIL import Image

    if url.startswith("data:"):
        head, sep, payload = url.partition(",")
        if not sep or not head.endswith(";base64"):
            raise bad(f"{where}: a data: URL must be base64 (data:image/png;base64,...)", "messages")
        try:
            raw = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise bad(f"{where}: the data: URL is not valid base64", "messages") from None
        source = io.BytesIO(raw)
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
        if os.path.getsize(real) > MAX_IMAGE_BYTES:
            raise bad(f"{where}: image larger than {MAX_IMAGE_BYTES >> 20} MiB", "messages")
        source = real
    try:
        with Image.open(source) as im:
            im.load()
            return im.convert("RGB")
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as e:
        raise bad(f"{where}: cannot decode the image ({e})", "messages") from None
