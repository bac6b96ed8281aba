"""Where a conversion writes: a temporary sibling of DST, renamed over DST only once everything is written.

A failed or interrupted conversion (an exception, Ctrl-C, or SIGTERM/SIGHUP, which become SystemExit while
the staging directory exists) removes its temporary directory, so DST is left exactly as it was (absent,
or the previous checkpoint when --overwrite was given). Also: copying the side files (config, tokenizer,
processor, chat template) and the pieces both directions share (byte sizes, the dry-run report).
"""
from __future__ import annotations

import fnmatch
import os
import shutil
import signal
import tempfile
import threading

WEIGHT_PATTERNS = ("*.safetensors", "*.safetensors.index.json", "*.bin", "*.bin.index.json", "*.pt", "*.pth",
                   "*.ckpt", "*.msgpack", "*.h5", "*.npz")


class Staging:
    """`with Staging(dst, overwrite, src) as tmp:` write into `tmp`; on a clean exit it becomes `dst`."""

    def __init__(self, dst: str, overwrite: bool = False, src: str | None = None):
        check_destination(dst, overwrite, src)
        self.dst = os.path.abspath(dst)
        self.tmp = None
        self.handlers = {}

    def __enter__(self) -> str:
        parent, base = os.path.split(self.dst)
        os.makedirs(parent, exist_ok=True)
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGHUP):
                self.handlers[sig] = signal.signal(sig, _exit_on_signal)
        self.tmp = tempfile.mkdtemp(prefix=f".{base}.tmp-", dir=parent)
        return self.tmp

    def __exit__(self, exc_type, exc, tb):
        for sig, old in self.handlers.items():
            signal.signal(sig, old)
        if exc_type is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            return False
        parent, base = os.path.split(self.dst)
        old = None
        if os.path.lexists(self.dst):
            old = tempfile.mkdtemp(prefix=f".{base}.old-", dir=parent)
            os.rename(self.dst, os.path.join(old, base))
        try:
            os.rename(self.tmp, self.dst)
        except BaseException:
            if old is not None:
                os.rename(os.path.join(old, base), self.dst)
            shutil.rmtree(self.tmp, ignore_errors=True)
            raise
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        return False


def _exit_on_signal(signum, frame):
    raise SystemExit(128 + signum)


def check_destination(dst: str, overwrite: bool, src: str | None = None) -> None:
    """Refuse an existing DST without overwrite, and any DST that is, holds or sits inside SRC."""
    if os.path.lexists(dst) and not overwrite:
        raise ValueError(f"{dst} already exists; pass --overwrite (overwrite=True) to replace it")
    if src is not None:
        s, d = os.path.realpath(src), os.path.realpath(dst)
        if s == d or d.startswith(s + os.sep) or s.startswith(d + os.sep):
            raise ValueError(f"destination {dst} must not be, contain or lie inside the source {src}")
    parent = os.path.dirname(os.path.abspath(dst))
    probe = parent
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        raise ValueError(f"cannot write {dst}: {probe} is not a directory")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise ValueError(f"cannot write {dst}: {probe} is not writable")


def copy_side_files(src: str, dst: str, skip=()) -> list[str]:
    """Copy every top-level regular file of SRC that is not a weight file (config, generation config,
    tokenizer, processor, chat template, README, ...)."""
    copied = []
    for name in sorted(os.listdir(src)):
        p = os.path.join(src, name)
        if (not os.path.isfile(p) or name in skip or name.startswith(".")
                or any(fnmatch.fnmatch(name, pat) for pat in WEIGHT_PATTERNS)):
            continue
        shutil.copy2(p, os.path.join(dst, name))
        copied.append(name)
    return copied


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return f"{n} B"


def parse_bytes(s: str) -> int:
    """'5GB', '500MB', '200KB', '123' → bytes (decimal units, as transformers' max_shard_size)."""
    t = str(s).strip().upper()
    for unit, mult in (("GIB", 1 << 30), ("MIB", 1 << 20), ("KIB", 1 << 10), ("GB", 10**9), ("MB", 10**6),
                       ("KB", 10**3), ("B", 1)):
        if t.endswith(unit):
            t, m = t[: -len(unit)], mult
            break
    else:
        m = 1
    try:
        v = int(float(t) * m)
    except ValueError:
        raise ValueError(f"cannot read size {s!r} (expected e.g. 5GB, 500MB)") from None
    if v <= 0:
        raise ValueError(f"size must be positive, got {s!r}")
    return v


def progress_bar(total: int, desc: str, enabled: bool | None = None):
    """A tqdm bar in bytes on stderr (shown only on a terminal unless `enabled`)."""
    from tqdm import tqdm
    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1000, leave=False,
                disable=None if enabled is None else not enabled, mininterval=0.5)
