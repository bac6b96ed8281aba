"""Reading and writing Hugging Face safetensors checkpoints, one tensor at a time, without torch.

The format is an 8-byte little-endian header length, a JSON header (`name -> {dtype, shape, data_offsets}`),
then raw little-endian bytes. Files are memory-mapped, so reading a tensor touches only its bytes; bfloat16
comes through `ml_dtypes` bit for bit. Every structural problem (truncated file, bad header, offsets past the
end, a shard named by the index that is missing) is a `CheckpointError` naming the file.
Pickle checkpoints (`*.bin`, `*.pt`) are refused, never opened.
"""
from __future__ import annotations

import glob
import json
import math
import mmap
import os
import struct
from typing import Callable, Iterable, Iterator

import ml_dtypes
import numpy as np

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"

_DTYPES = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "I64": np.dtype(np.int64), "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16), "I8": np.dtype(np.int8), "U8": np.dtype(np.uint8), "U16": np.dtype(np.uint16),
    "U32": np.dtype(np.uint32), "U64": np.dtype(np.uint64), "BOOL": np.dtype(np.bool_),
}
_NAMES = {v: k for k, v in _DTYPES.items()}


class CheckpointError(ValueError):
    """A checkpoint on disk is missing, malformed or inconsistent; the message names the file or key."""


def _no_duplicates(pairs):
    """json object_pairs_hook: a JSON object that repeats a key is refused (json.loads would keep the last)."""
    obj = {}
    for k, v in pairs:
        if k in obj:
            raise _Duplicate(k)
        obj[k] = v
    return obj


class _Duplicate(Exception):
    pass


def _no_constant(name):
    raise ValueError(f"{name} is not JSON")


def parse_json(blob, what: str):
    """`blob` (bytes or str) as JSON, refusing repeated keys, NaN/Infinity and absurd nesting: CheckpointError
    naming `what` (the file) and the defect."""
    try:
        return json.loads(blob, object_pairs_hook=_no_duplicates, parse_constant=_no_constant)
    except _Duplicate as e:
        raise CheckpointError(f"{what}: the name {e.args[0]!r} appears twice in the JSON header") from None
    except (ValueError, UnicodeDecodeError, RecursionError):   # JSONDecodeError is a ValueError
        raise CheckpointError(f"{what}: not valid JSON") from None


def shown(name: str) -> str:
    """A name from a file as it may appear in a one-line message: itself when printable, else its repr."""
    return name if name.isprintable() else repr(name)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


class SafetensorsFile:
    """One memory-mapped .safetensors file, checked as the reference implementation checks it (and more): the
    header is a JSON object without repeated names; `__metadata__`, when present, maps strings to strings;
    every tensor has a known dtype, a shape of non-negative integers and two integer offsets whose span is
    exactly shape × dtype size (computed without overflow); and the tensors tile the data section exactly —
    no overlap, no gap, nothing past the end, nothing after the last one. Anything else is a
    `CheckpointError` naming the file and the defect."""

    def __init__(self, path: str):
        self.path = path
        self._mm = None
        try:
            self._f = open(path, "rb")
        except OSError as e:
            raise CheckpointError(f"cannot open {path}: {e.strerror}") from None
        try:
            self._parse(path)
        except BaseException:
            self._f.close()
            raise

    def _parse(self, path: str) -> None:
        size = os.fstat(self._f.fileno()).st_size
        if size < 8:
            raise CheckpointError(f"{path}: truncated safetensors file ({size} bytes)")
        (n,) = struct.unpack("<Q", self._f.read(8))
        if n > size - 8:
            raise CheckpointError(f"{path}: corrupt or truncated safetensors header (header length {n} "
                                  f"runs past the end of the {size}-byte file)")
        if n > 100_000_000:
            raise CheckpointError(f"{path}: corrupt safetensors header (header length {n} > 100 MB)")
        header = parse_json(self._f.read(n), f"{path}: corrupt safetensors header")
        if not isinstance(header, dict):
            raise CheckpointError(f"{path}: corrupt safetensors header (a JSON {type(header).__name__}, "
                                  "not an object)")
        meta = header.pop("__metadata__", None)
        if meta is None:
            meta = {}
        if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
            raise CheckpointError(f"{path}: corrupt safetensors header (__metadata__ must map strings to "
                                  "strings)")
        self.metadata = meta
        self._base = 8 + n
        data = size - self._base
        self.entries: dict[str, tuple[np.dtype, tuple[int, ...], int, int]] = {}
        for name, e in header.items():
            bad = f"{path}: corrupt entry for tensor {name!r}"
            if not isinstance(e, dict):
                raise CheckpointError(f"{bad} (not a JSON object)")
            if not isinstance(e.get("dtype"), str):
                raise CheckpointError(f"{bad} (no dtype)")
            if e["dtype"] not in _DTYPES:
                raise CheckpointError(f"{bad} (unknown dtype {e['dtype']!r})")
            dt, shape, offsets = _DTYPES[e["dtype"]], e.get("shape"), e.get("data_offsets")
            if not isinstance(shape, list) or not all(_is_int(s) and s >= 0 for s in shape):
                raise CheckpointError(f"{bad} (shape {shape!r} is not a list of non-negative integers)")
            if (not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_int(x) for x in offsets)
                    or not 0 <= offsets[0] <= offsets[1]):
                raise CheckpointError(f"{bad} (data_offsets {offsets!r} are not two integers 0 ≤ begin ≤ end)")
            a, b = offsets
            want = math.prod(shape) * dt.itemsize   # Python integers: a product cannot wrap around
            if b - a != want:
                raise CheckpointError(f"{path}: tensor {name!r} has inconsistent size (data_offsets span "
                                      f"{b - a} bytes; shape {shape} of {e['dtype']} needs {want})")
            if b > data:
                raise CheckpointError(f"{path}: truncated (tensor {name!r} ends past the end of the file)")
            self.entries[name] = (dt, tuple(shape), a, b)
        at, prev = 0, None
        for name, (_, _, a, b) in sorted(self.entries.items(), key=lambda kv: (kv[1][2], kv[1][3])):
            if a < at:
                raise CheckpointError(f"{path}: tensors {prev!r} and {name!r} overlap (bytes {a}..{at} of the "
                                      "data are claimed by both)")
            if a > at:
                raise CheckpointError(f"{path}: corrupt safetensors file (bytes {at}..{a} of the data belong to "
                                      f"no tensor, before {name!r})")
            at, prev = b, name
        if at != data:
            raise CheckpointError(f"{path}: corrupt safetensors file ({data - at} bytes after the last tensor)")
        self._mm = mmap.mmap(self._f.fileno(), 0, access=mmap.ACCESS_READ) if size > 0 else None

    def get(self, name: str) -> np.ndarray:
        """A read-only view of the tensor's bytes (no copy)."""
        dt, shape, a, b = self.entries[name]
        return np.frombuffer(self._mm, dtype=dt, count=(b - a) // dt.itemsize, offset=self._base + a).reshape(shape)

    def release(self, name: str) -> None:
        """Drop the tensor's pages from this process's resident set (the OS page cache keeps them)."""
        if self._mm is None:
            return
        _, _, a, b = self.entries[name]
        start = (self._base + a) // mmap.PAGESIZE * mmap.PAGESIZE
        if self._base + b > start:
            self._mm.madvise(mmap.MADV_DONTNEED, start, self._base + b - start)

    def close(self):
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:  # a caller still holds a view; the map closes when that view is freed
                pass
        self._f.close()


def _read_index(index: str) -> dict[str, str]:
    """The index's weight_map (tensor name → shard file name), every value a string: else CheckpointError."""
    try:
        with open(index, "rb") as f:
            blob = f.read()
    except OSError as e:
        raise CheckpointError(f"cannot read {index}: {e.strerror}") from None
    doc = parse_json(blob, f"{index}: malformed index")
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{index}: malformed index (no weight_map object)")
    bad = sorted(k for k, v in weight_map.items() if not isinstance(v, str) or not v)
    if bad:
        raise CheckpointError(f"{index}: malformed index (weight_map value of {bad[0]!r} is "
                              f"{weight_map[bad[0]]!r}, not a shard file name)")
    return weight_map


def _confined(directory: str, name: str, index: str) -> None:
    """Refuse a shard name that leaves the checkpoint directory: an absolute path, `..`, or a path through a
    symlinked directory that resolves outside it. The shard file itself may be a symlink (a Hugging Face cache
    snapshot links each file to its blob); the name is what is confined."""
    root = os.path.realpath(directory)
    where = os.path.realpath(os.path.dirname(os.path.join(root, name)))
    if (os.path.isabs(name) or "\0" in name or os.path.basename(name) in ("", ".", "..")
            or (where != root and not where.startswith(root + os.sep))):
        raise CheckpointError(f"{index}: shard name {name!r} is outside the checkpoint directory")


class Checkpoint:
    """All tensors of a Hugging Face checkpoint directory: one `model.safetensors` or shards with an index."""

    def __init__(self, directory: str):
        self.directory = directory
        if not os.path.isdir(directory):
            raise CheckpointError(f"{directory}: not a directory")
        index = os.path.join(directory, INDEX_NAME)
        single = os.path.join(directory, SINGLE_NAME)
        if os.path.isfile(index):
            weight_map = _read_index(index)
            files = sorted(set(weight_map.values()))
            for f in files:
                _confined(directory, f, index)
            missing = [f for f in files if not os.path.isfile(os.path.join(directory, f))]
            if missing:
                raise CheckpointError(f"{directory}: shard(s) named by the index are missing: "
                                      f"{', '.join(map(shown, missing))}")
        elif os.path.isfile(single):
            files, weight_map = [SINGLE_NAME], None
        else:
            files = sorted(os.path.basename(p) for p in glob.glob(os.path.join(directory, "*.safetensors")))
            pickles = [os.path.basename(p) for pat in ("*.bin", "*.pt", "*.pth", "*.ckpt")
                       for p in glob.glob(os.path.join(directory, pat))]
            if not files and pickles:
                raise CheckpointError(
                    f"{directory}: only pickle checkpoints found ({', '.join(sorted(pickles))}); prisma-jax reads "
                    "safetensors only and never unpickles. Convert with transformers' save_pretrained("
                    "safe_serialization=True) first.")
            if not files:
                raise CheckpointError(f"{directory}: no model.safetensors or {INDEX_NAME}")
            weight_map = None
        self.files: dict[str, SafetensorsFile] = {}
        self.where: dict[str, str] = {}
        try:
            for f in files:
                self.files[f] = sf = SafetensorsFile(os.path.join(directory, f))
                for name in sf.entries:
                    if name in self.where:
                        raise CheckpointError(f"{directory}: tensor {name!r} is in two shards, {self.where[name]} "
                                              f"and {f}")
                    self.where[name] = f
            self._check_index(directory, weight_map)
        except BaseException:
            self.close()
            raise

    def _check_index(self, directory: str, weight_map: dict | None) -> None:
        if weight_map is not None:
            absent = sorted(k for k, f in weight_map.items() if self.where.get(k) != f)
            if absent:
                raise CheckpointError(f"{directory}: tensors listed in the index but not in their shard: "
                                      f"{', '.join(map(shown, absent[:10]))}")

    def keys(self) -> list[str]:
        return sorted(self.where)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.files[self.where[name]].entries[name][1]

    def dtype(self, name: str) -> np.dtype:
        return self.files[self.where[name]].entries[name][0]

    def get(self, name: str) -> np.ndarray:
        return self.files[self.where[name]].get(name)

    def release(self, name: str) -> None:
        self.files[self.where[name]].release(name)

    def close(self):
        for f in self.files.values():
            f.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def write_file(path: str, tensors: Iterable[tuple[str, np.ndarray]], metadata: dict | None = None) -> None:
    """Write one .safetensors file, streaming tensor bytes (the header is computed from shapes first)."""
    tensors = dict(tensors)
    write_streaming(path, [(k, a.shape, a.dtype) for k, a in tensors.items()], lambda k: [tensors[k]], metadata)


def _header(specs: list[tuple[str, tuple[int, ...], np.dtype]], metadata: dict | None) -> tuple[dict, bytes]:
    """(header dict, the encoded header: 8-byte length + JSON padded to 8 bytes) of a file holding `specs`."""
    header: dict = {"__metadata__": {str(k): str(v) for k, v in (metadata or {}).items()}} if metadata else {}
    off = 0
    for name, shape, dt in specs:
        n = int(np.prod(shape, dtype=np.int64)) * np.dtype(dt).itemsize
        header[name] = {"dtype": _NAMES[np.dtype(dt)], "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    return header, struct.pack("<Q", len(blob)) + blob


def write_streaming(path: str, specs: list[tuple[str, tuple[int, ...], np.dtype]],
                    blocks: Callable[[str], Iterable[np.ndarray]], metadata: dict | None = None) -> None:
    """Write one .safetensors file whose tensors arrive in pieces: `blocks(name)` yields C-order consecutive
    row blocks of that tensor (so no whole tensor, let alone a whole shard, needs to be in memory)."""
    header, blob = _header(specs, metadata)
    with open(path, "wb") as f:
        f.write(blob)
        for name, shape, dt in specs:
            want, got = header[name]["data_offsets"][1] - header[name]["data_offsets"][0], 0
            for a in blocks(name):
                a = np.ascontiguousarray(a, dtype=dt)
                f.write(memoryview(a.reshape(-1).view(np.uint8)))
                got += a.nbytes
            if got != want:
                raise ValueError(f"{path}: tensor {name!r} produced {got} bytes, expected {want}")


class PieceWriter:
    """One .safetensors file whose tensors arrive in pieces in any order, written in place (the same bytes
    `write_streaming` writes): `put(name, block, index)` places `block` at `index` (a tuple of slices, one per
    axis) of tensor `name`; `close()` checks coverage: every element of every tensor written exactly once (a
    piece written twice, or two pieces that overlap, is an error even when the byte count adds up, since it
    hides a hole; a tensor left short is an error), each naming the tensor. A piece that
    spans whole rows (every axis after the first in full) is one `pwrite`; any other goes through a mapping of
    its rows only, so what the process holds is the piece and its rows, never the tensor."""

    def __init__(self, path: str, specs: list[tuple[str, tuple[int, ...], np.dtype]], metadata: dict | None = None):
        header, blob = _header(specs, metadata)
        self.path = path
        self.tensors = {name: (tuple(shape), np.dtype(dt), len(blob) + header[name]["data_offsets"][0])
                        for name, shape, dt in specs}
        self.filled = dict.fromkeys(self.tensors, 0)
        self.pieces: dict[str, list[tuple[tuple[int, int], ...]]] = {name: [] for name in self.tensors}
        self.f = open(path, "wb+")
        self.f.write(blob)
        self.f.truncate(len(blob) + sum(h["data_offsets"][1] - h["data_offsets"][0]
                                        for k, h in header.items() if k != "__metadata__"))

    def put(self, name: str, block: np.ndarray, index: tuple) -> None:
        if name not in self.tensors:
            raise ValueError(f"{self.path}: no tensor {name!r} in this file")
        shape, dt, off = self.tensors[name]
        block = np.asarray(block, dtype=dt)
        if not block.flags.c_contiguous:   # (np.ascontiguousarray would make a scalar 1-d)
            block = block.copy(order="C")
        index = tuple(index)
        if len(index) > len(shape) or not all(isinstance(sl, slice) and sl.step in (None, 1) for sl in index):
            raise ValueError(f"{self.path}: tensor {name!r}: index {index} is not one unit-step slice per axis "
                             f"of shape {shape}")
        index = index + (slice(None),) * (len(shape) - len(index))
        ranges = [sl.indices(n)[:2] for sl, n in zip(index, shape)]
        if tuple(b - a for a, b in ranges) != block.shape or any(b < a for a, b in ranges):
            raise ValueError(f"{self.path}: tensor {name!r}: a block of shape {block.shape} at {ranges}")
        row = int(np.prod(shape[1:], dtype=np.int64)) * dt.itemsize
        if not shape or all(a == 0 and b == n for (a, b), n in zip(ranges[1:], shape[1:])):
            data, at = memoryview(block.reshape(-1).view(np.uint8)), off + (ranges[0][0] * row if shape else 0)
            while len(data):
                n = os.pwrite(self.f.fileno(), data, at)
                data, at = data[n:], at + n
        else:
            r0, r1 = ranges[0]
            rows = np.memmap(self.f, dt, "r+", offset=off + r0 * row, shape=(r1 - r0, *shape[1:]))
            rows[(slice(None), *index[1:])] = block
            rows.flush()
            del rows
        self.filled[name] += block.nbytes
        if block.size:
            self.pieces[name].append(tuple(ranges))

    def close(self) -> None:
        self.f.close()
        for name, (shape, dt, _) in self.tensors.items():
            twice = _overlap(self.pieces[name])
            if twice is not None:
                a, b = ([f"{lo}:{hi}" for lo, hi in r] for r in twice)
                raise ValueError(f"{self.path}: tensor {name!r}: pieces [{', '.join(a)}] and [{', '.join(b)}] "
                                 "overlap (part of the tensor written twice, so another part may never be)")
            want = math.prod(shape) * dt.itemsize
            if self.filled[name] != want:   # disjoint pieces inside the tensor: fewer bytes = a hole
                raise ValueError(f"{self.path}: tensor {name!r} received {self.filled[name]} bytes, expected {want}"
                                 " (part of it never written)")


def _overlap(boxes: list[tuple[tuple[int, int], ...]]):
    """Two of the boxes (per axis [lo, hi) ranges, all non-empty) that share an element, or None: a sweep
    along the first axis compares a box only with the boxes still open there."""
    if not boxes or not boxes[0]:
        return (boxes[0], boxes[1]) if len(boxes) > 1 else None   # a scalar: any second write overlaps
    order = sorted(boxes, key=lambda r: r[0])
    open_: list = []
    for box in order:
        open_ = [o for o in open_ if o[0][1] > box[0][0]]
        for o in open_:
            if all(max(p[0], q[0]) < min(p[1], q[1]) for p, q in zip(o[1:], box[1:])):
                return o, box
        open_.append(box)
    return None


def plan_shards(items: Iterable[tuple[str, tuple[int, ...], np.dtype]], max_bytes: int) -> list[list[str]]:
    """Group tensor names into shards of at most `max_bytes` (a single larger tensor gets its own shard)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, shape, dt in items:
        n = int(np.prod(shape, dtype=np.int64)) * np.dtype(dt).itemsize
        if shards[-1] and size + n > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n
    return [s for s in shards if s]


def iter_dir_tensors(directory: str) -> Iterator[tuple[str, np.ndarray]]:
    with Checkpoint(directory) as ck:
        for k in ck.keys():
            yield k, ck.get(k)
