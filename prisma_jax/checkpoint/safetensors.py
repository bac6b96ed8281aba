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


class SafetensorsFile:
    """One memory-mapped .safetensors file."""

    def __init__(self, path: str):
        self.path = path
        try:
            self._f = open(path, "rb")
        except OSError as e:
            raise CheckpointError(f"cannot open {path}: {e.strerror}") from None
        size = os.fstat(self._f.fileno()).st_size
        if size < 8:
            raise CheckpointError(f"{path}: truncated safetensors file ({size} bytes)")
        (n,) = struct.unpack("<Q", self._f.read(8))
        if n > size - 8 or n > 100_000_000:
            raise CheckpointError(f"{path}: corrupt safetensors header (length {n}, file {size} bytes)")
        try:
            header = json.loads(self._f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise CheckpointError(f"{path}: corrupt safetensors header (not JSON)") from None
        if not isinstance(header, dict):
            raise CheckpointError(f"{path}: corrupt safetensors header")
        self.metadata = header.pop("__metadata__", {}) or {}
        self._base = 8 + n
        self.entries: dict[str, tuple[np.dtype, tuple[int, ...], int, int]] = {}
        for name, e in header.items():
            try:
                dt = _DTYPES[e["dtype"]]
                shape = tuple(int(s) for s in e["shape"])
                a, b = (int(x) for x in e["data_offsets"])
            except (KeyError, TypeError, ValueError):
                raise CheckpointError(f"{path}: corrupt entry for tensor {name!r}") from None
            if b - a != int(np.prod(shape, dtype=np.int64)) * dt.itemsize or a < 0:
                raise CheckpointError(f"{path}: tensor {name!r} has inconsistent size")
            if self._base + b > size:
                raise CheckpointError(f"{path}: truncated (tensor {name!r} ends past the end of the file)")
            self.entries[name] = (dt, shape, a, b)
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


class Checkpoint:
    """All tensors of a Hugging Face checkpoint directory: one `model.safetensors` or shards with an index."""

    def __init__(self, directory: str):
        self.directory = directory
        if not os.path.isdir(directory):
            raise CheckpointError(f"{directory}: not a directory")
        index = os.path.join(directory, INDEX_NAME)
        single = os.path.join(directory, SINGLE_NAME)
        if os.path.isfile(index):
            try:
                with open(index) as f:
                    weight_map = json.load(f)["weight_map"]
            except (OSError, json.JSONDecodeError, KeyError, TypeError):
                raise CheckpointError(f"{index}: malformed index (no weight_map)") from None
            files = sorted(set(weight_map.values()))
            missing = [f for f in files if not os.path.isfile(os.path.join(directory, f))]
            if missing:
                raise CheckpointError(f"{directory}: shard(s) named by the index are missing: {', '.join(missing)}")
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
        self.files = {f: SafetensorsFile(os.path.join(directory, f)) for f in files}
        self.where: dict[str, str] = {}
        for fname, sf in self.files.items():
            for name in sf.entries:
                self.where[name] = fname
        if weight_map is not None:
            absent = sorted(k for k, f in weight_map.items() if self.where.get(k) != f)
            if absent:
                raise CheckpointError(f"{directory}: tensors listed in the index but not in their shard: "
                                      f"{', '.join(absent[:10])}")

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
    axis) of tensor `name`; `close()` checks that every tensor received exactly its size in bytes. A piece that
    spans whole rows (every axis after the first in full) is one `pwrite`; any other goes through a mapping of
    its rows only, so what the process holds is the piece and its rows, never the tensor."""

    def __init__(self, path: str, specs: list[tuple[str, tuple[int, ...], np.dtype]], metadata: dict | None = None):
        header, blob = _header(specs, metadata)
        self.path = path
        self.tensors = {name: (tuple(shape), np.dtype(dt), len(blob) + header[name]["data_offsets"][0])
                        for name, shape, dt in specs}
        self.filled = dict.fromkeys(self.tensors, 0)
        self.f = open(path, "wb+")
        self.f.write(blob)
        self.f.truncate(len(blob) + sum(h["data_offsets"][1] - h["data_offsets"][0]
                                        for k, h in header.items() if k != "__metadata__"))

    def put(self, name: str, block: np.ndarray, index: tuple) -> None:
        shape, dt, off = self.tensors[name]
        block = np.ascontiguousarray(block, dtype=dt)
        index = tuple(index) + (slice(None),) * (len(shape) - len(index))
        ranges = [sl.indices(n)[:2] for sl, n in zip(index, shape)]
        if tuple(b - a for a, b in ranges) != block.shape:
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

    def close(self) -> None:
        self.f.close()
        for name, (shape, dt, _) in self.tensors.items():
            want = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
            if self.filled[name] != want:
                raise ValueError(f"{self.path}: tensor {name!r} received {self.filled[name]} bytes, expected {want}")


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
