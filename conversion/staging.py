"""Where a conversion writes: a temporary sibling of DST, swapped in for DST only once everything is written.

A failed or interrupted conversion (an exception, Ctrl-C, or SIGTERM/SIGHUP, which become SystemExit while
the staging directory exists) removes its temporary directory, so DST is left exactly as it was (absent,
or the previous checkpoint when --overwrite was given). At the end every file and directory written is
fsynced, then the new directory replaces DST in one step — `renameat2(RENAME_EXCHANGE)` where the kernel and
filesystem have it, else DST → a backup sibling, new → DST, backup removed — and the parent is fsynced.
SIGTERM/SIGHUP during that step are deferred until it completes, and a process killed outright (SIGKILL,
power loss) between the two renames of the fallback leaves the backup, which the next conversion to DST
puts back (`recover`), so DST is at every moment the old checkpoint or the new one, complete.
Also: copying the side files (config, tokenizer, processor, chat template) and the pieces both directions
share (byte sizes, the dry-run report).
"""
from __future__ import annotations

import ctypes
import errno
import fnmatch
import os
import shutil
import signal
import sys
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
        self.deferred = None

    def __enter__(self) -> str:
        parent, base = os.path.split(self.dst)
        os.makedirs(parent, exist_ok=True)
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGHUP):
                self.handlers[sig] = signal.signal(sig, _exit_on_signal)
        self.tmp = tempfile.mkdtemp(prefix=f".{base}.tmp-", dir=parent)
        umask = os.umask(0o22)
        os.umask(umask)
        os.chmod(self.tmp, 0o777 & ~umask)   # DST gets a directory's usual mode, not mkdtemp's 0700
        return self.tmp

    def _defer(self, signum, frame):
        self.deferred = signum

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None:
            self._restore_handlers()
            shutil.rmtree(self.tmp, ignore_errors=True)
            return False
        if self.handlers:   # from here on SIGTERM/SIGHUP/SIGINT wait until DST is the old or the new one
            self.handlers[signal.SIGINT] = signal.getsignal(signal.SIGINT)
            for sig in self.handlers:
                signal.signal(sig, self._defer)
        try:
            _at("fsync")
            fsync_tree(self.tmp)
            _at("swap")
            if self.deferred is not None:   # signalled before the swap began: keep the old DST
                _raise_for(self.deferred)
            _swap(self.tmp, self.dst)
        except BaseException:
            self._restore_handlers()
            shutil.rmtree(self.tmp, ignore_errors=True)
            raise
        self._restore_handlers()
        if self.deferred is not None:   # the new DST is in place; now act on the signal
            _raise_for(self.deferred)
        return False

    def _restore_handlers(self):
        for sig, old in self.handlers.items():
            signal.signal(sig, old)
        self.handlers = {}


def _at(point: str) -> None:
    """A named point of the swap (a no-op; tests replace it to pause or kill the process there)."""


def _exit_on_signal(signum, frame):
    raise SystemExit(128 + signum)


def _raise_for(signum: int):
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    raise SystemExit(128 + signum)


def fsync_tree(root: str) -> None:
    """fsync every regular file under `root`, then every directory, deepest first (so the names are durable)."""
    for d, _, files in os.walk(root, topdown=False):
        for f in files:
            p = os.path.join(d, f)
            if os.path.isfile(p) and not os.path.islink(p):
                fd = os.open(p, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
        fsync_dir(d)


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_RENAME_EXCHANGE, _AT_FDCWD = 2, -100


def _exchange(a: str, b: str) -> bool:
    """Atomically exchange the paths a and b (Linux renameat2); False where the kernel, libc or filesystem
    cannot, so the caller falls back to two renames."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EPERM):
        return False
    raise OSError(err, os.strerror(err), b)


def _backup_name(dst: str) -> str:
    parent, base = os.path.split(dst)
    return os.path.join(parent, f".{base}.old")


def _swap(new: str, dst: str) -> None:
    """Put the directory `new` at `dst`, replacing what is there; DST is never absent except, in the fallback,
    between two renames, where `recover` finds the backup."""
    parent = os.path.dirname(dst)
    if not os.path.lexists(dst):
        _at("rename")
        os.rename(new, dst)
        fsync_dir(parent)
        return
    if _exchange(new, dst):   # `new` now holds the old DST
        fsync_dir(parent)
        _at("remove")
        shutil.rmtree(new, ignore_errors=True)
        return
    backup = _backup_name(dst)
    shutil.rmtree(backup, ignore_errors=True)
    os.rename(dst, backup)
    _at("between")
    try:
        os.rename(new, dst)
    except BaseException:
        os.rename(backup, dst)
        raise
    fsync_dir(parent)
    _at("remove")
    shutil.rmtree(backup, ignore_errors=True)


def recover(dst: str) -> None:
    """Finish a fallback swap killed between its two renames: put the backup back when DST is absent, drop it
    when DST is there."""
    backup = _backup_name(os.path.abspath(dst))
    if os.path.isdir(backup) and not os.path.islink(backup):
        if os.path.lexists(dst):
            shutil.rmtree(backup, ignore_errors=True)
        else:
            os.rename(backup, dst)
            fsync_dir(os.path.dirname(os.path.abspath(dst)))


def check_destination(dst: str, overwrite: bool, src: str | None = None) -> None:
    """Refuse an existing DST without overwrite, and any DST that is, holds or sits inside SRC (after putting
    back a DST that a killed swap left as its backup)."""
    recover(dst)
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
