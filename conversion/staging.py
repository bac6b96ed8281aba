"""Where a conversion writes: a temporary sibling of DST, swapped in for DST only once everything is written.

A failed or interrupted conversion (an exception, Ctrl-C, or SIGTERM/SIGHUP, which become SystemExit while
the staging directory exists) removes its temporary directory, so DST is left exactly as it was (absent,
or the previous checkpoint when --overwrite was given). At the end every file and directory written is
fsynced, then the new directory replaces DST in one step — `renameat2(RENAME_EXCHANGE)` where the kernel and
filesystem have it, else DST → a backup sibling, new → DST, backup removed — and the parent is fsynced.
SIGTERM/SIGHUP during that step are deferred until it completes, and a process killed outright (SIGKILL,
power loss) between the two renames of the fallback leaves the backup, which the next conversion to DST
puts back (`recover`), so DST is at every moment the old checkpoint or the new one, complete.
Whether DST may be replaced is decided at the swap, not only at the start: a DST absent at the start is
renamed onto with `renameat2(RENAME_NOREPLACE)` (else an existence check and a rename), so one that appeared
meanwhile is replaced only with --overwrite. A temporary directory is named `.DST.tmp-HOST-PID-XXXXXXXX`;
the next conversion to DST removes those of this host whose process is gone (`remove_stale`), which is all a
SIGKILL can leave behind. Signal handlers are put back on every path out.
Also: copying the side files (config, tokenizer, processor, chat template) and the pieces both directions
share (byte sizes, the dry-run report).
"""
from __future__ import annotations

import ctypes
import errno
import fnmatch
import os
import re
import shutil
import signal
import socket
import sys
import tempfile
import threading
import zlib

WEIGHT_PATTERNS = ("*.safetensors", "*.safetensors.index.json", "*.bin", "*.bin.index.json", "*.pt", "*.pth",
                   "*.ckpt", "*.msgpack", "*.h5", "*.npz")


class Staging:
    """`with Staging(dst, overwrite, src) as tmp:` write into `tmp`; on a clean exit it becomes `dst`."""

    def __init__(self, dst: str, overwrite: bool = False, src: str | None = None):
        check_destination(dst, overwrite, src)
        self.dst = os.path.abspath(dst)
        self.overwrite = overwrite
        self.tmp = None
        self.handlers = {}
        self.deferred = None

    def __enter__(self) -> str:
        parent, base = os.path.split(self.dst)
        try:
            if threading.current_thread() is threading.main_thread():
                for sig in (signal.SIGTERM, signal.SIGHUP):
                    self.handlers[sig] = signal.signal(sig, _exit_on_signal)
            os.makedirs(parent, exist_ok=True)
            remove_stale(self.dst)
            self.tmp = tempfile.mkdtemp(prefix=_tmp_prefix(base), dir=parent)
            umask = os.umask(0o22)
            os.umask(umask)
            os.chmod(self.tmp, 0o777 & ~umask)   # DST gets a directory's usual mode, not mkdtemp's 0700
        except BaseException:
            self._restore_handlers()
            if self.tmp is not None:
                shutil.rmtree(self.tmp, ignore_errors=True)
            raise
        return self.tmp

    def _defer(self, signum, frame):
        self.deferred = signum

    def __exit__(self, exc_type, exc, tb):
        try:
            if exc_type is not None:
                shutil.rmtree(self.tmp, ignore_errors=True)
                return False
            try:
                if self.handlers:   # from here on SIGTERM/SIGHUP/SIGINT wait until DST is the old or the new one
                    self.handlers.setdefault(signal.SIGINT, signal.getsignal(signal.SIGINT))
                    for sig in self.handlers:
                        signal.signal(sig, self._defer)
                _at("fsync")
                fsync_tree(self.tmp)
                _at("swap")
                if self.deferred is not None:   # signalled before the swap began: keep the old DST
                    _raise_for(self.deferred)
                _swap(self.tmp, self.dst, self.overwrite)
            except BaseException:
                shutil.rmtree(self.tmp, ignore_errors=True)
                raise
        finally:
            self._restore_handlers()
        if self.deferred is not None:   # the new DST is in place; now act on the signal
            _raise_for(self.deferred)
        return False

    def _restore_handlers(self):
        handlers, self.handlers = self.handlers, {}
        for sig, old in handlers.items():
            if old is not None:   # None: a handler not installed from Python, which cannot be put back
                signal.signal(sig, old)


def _host() -> str:
    """This host's name as it goes into a file name: other characters as `_`, a long one shortened with a
    hash of the whole (so two hosts never share a tag)."""
    name = socket.gethostname()
    tag = re.sub(r"[^A-Za-z0-9_.-]", "_", name) or "host"
    if len(tag) > 64 or tag != name:
        tag = f"{tag[:48]}~{zlib.crc32(name.encode()):08x}"
    return tag


def _tmp_prefix(base: str) -> str:
    """`.DST.tmp-HOST-PID-`: mkdtemp appends 8 random characters. The host and process id say whose it is, so
    a later run can tell debris (its process gone) from a conversion still running."""
    return f".{base}.tmp-{_host()}-{os.getpid()}-"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):   # someone else's live process, or not a pid at all
        return True
    return True


def remove_stale(dst: str) -> list[str]:
    """Remove the temporary siblings of DST that a killed conversion left (SIGKILL, power loss, or a kill while
    the replaced checkpoint was being removed): only directories named exactly as this module names them, made
    on this host, whose process no longer exists. Those of another host (a shared filesystem) or of a live
    process are left alone. Returns the names removed."""
    parent, base = os.path.split(os.path.abspath(dst))
    pattern = re.compile(re.escape(f".{base}.tmp-{_host()}-") + r"(\d{1,10})-[a-z0-9_]{8}")
    removed = []
    try:
        names = os.listdir(parent)
    except OSError:
        return removed
    for name in names:
        m = pattern.fullmatch(name)
        if not m or int(m.group(1)) == os.getpid() or _alive(int(m.group(1))):
            continue
        path = os.path.join(parent, name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(name)
    return removed


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


_RENAME_NOREPLACE, _RENAME_EXCHANGE, _AT_FDCWD = 1, 2, -100
_UNSUPPORTED = (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EPERM)


def _renameat2(a: str, b: str, flags: int) -> int | None:
    """Linux renameat2(a, b, flags): 0, or the errno; None where the platform, libc, kernel or filesystem
    does not have it (the caller falls back)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), flags) == 0:
        return 0
    err = ctypes.get_errno()
    return None if err in _UNSUPPORTED else err


def _exchange(a: str, b: str) -> bool:
    """Atomically exchange the paths a and b (Linux renameat2); False where the kernel, libc or filesystem
    cannot, so the caller falls back to two renames."""
    err = _renameat2(a, b, _RENAME_EXCHANGE)
    if err is None:
        return False
    if err:
        raise OSError(err, os.strerror(err), b)
    return True


def _rename_noreplace(a: str, b: str) -> bool:
    """Rename a to b unless b exists: True when renamed, False when b exists (and nothing was done). Atomic
    with renameat2(RENAME_NOREPLACE); where that is missing, an existence check then os.rename (a b created
    between the two would be replaced only if it is an empty directory; os.rename refuses any other)."""
    err = _renameat2(a, b, _RENAME_NOREPLACE)
    if err is None:
        if os.path.lexists(b):
            return False
        os.rename(a, b)
        return True
    if err == errno.EEXIST:
        return False
    if err:
        raise OSError(err, os.strerror(err), b)
    return True


def _backup_name(dst: str) -> str:
    parent, base = os.path.split(dst)
    return os.path.join(parent, f".{base}.old")


def _swap(new: str, dst: str, overwrite: bool = True) -> None:
    """Put the directory `new` at `dst`. An absent DST is never replaced by anything but `new`: a DST that
    appeared while the conversion ran is an error without `overwrite` (it is left as it is) and is replaced
    with it. DST is never absent except, in the two-rename fallback, between its renames, where `recover`
    finds the backup."""
    parent = os.path.dirname(dst)
    if not os.path.lexists(dst):
        _at("rename")
        if _rename_noreplace(new, dst):
            fsync_dir(parent)
            return
    if not overwrite:
        raise ValueError(f"{dst} appeared while converting and is left as it is; pass --overwrite "
                         "(overwrite=True) to replace it")
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
