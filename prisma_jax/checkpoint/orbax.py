"""The on-disk layout of a converted checkpoint: an Orbax PyTree checkpoint plus the Hugging Face side files.

    DST/
      _METADATA, _CHECKPOINT_METADATA, _sharding     Orbax's tree metadata (zarr v2, no OCDBT)
      text.layers.mlp.gate_proj.kernel/.zarray, 0.0.0, 0.0.1, ...   one zarr array per leaf of the param tree
      prisma_checkpoint.json                        source, dtypes, n_bits, crc32s, prisma-jax version
      config.json, generation_config.json, tokenizer*, chat_template*, preprocessor_config.json, ...

Arrays are written here with tensorstore, one block at a time, in exactly the layout Orbax's
`PyTreeCheckpointHandler(use_ocdbt=False)` writes, so `orbax.checkpoint.StandardCheckpointer().restore(DST)`
and `PyTreeCheckpointer().restore(DST)` read it as it is. Chunks are one stacked slice split into ≤ 64 MB
blocks (kernels along their output axis), so a sharded restore reads only the chunks each device needs.

`restore_params` is the one reader: whole arrays on one host, or each shard straight onto its device.

Two crc32s are recorded at conversion: `tensors[hf].crc32`, of each Hugging Face tensor's bytes in its own
(torch) layout, which `orbax-to-hf` checks as it streams; and `chunk_crc32[array][chunk]`, of each zarr chunk's
data (the chunk's in-bounds region, C order, stored dtype), which `restore_params` checks before restoring:
each process reads back only the chunk files its own shards overlap, so a sharded restore verifies without
gathering any array and without reading more than it restores. A checkpoint converted before chunk crcs
were recorded is verified tensor by tensor from the tensorstore arrays instead (every process, every tensor).
A mismatch is a CheckpointError naming the tensor (and chunk). `restore_params(..., verify=False)` (on the
command line `prisma generate --no-verify`) skips the check, e.g. for a checkpoint already verified once on
this filesystem; the data is then read only once.
"""
from __future__ import annotations

import json
import os
import time
import zlib

import ml_dtypes
import numpy as np

from prisma_jax.core.config import ModelConfig, load_hf_config
from prisma_jax.core.trees import flatten, set_path
from prisma_jax.nn.params import param_shapes
from prisma_jax.checkpoint.safetensors import CheckpointError

META_NAME = "prisma_checkpoint.json"
FORMAT = "prisma-jax-orbax"
FORMAT_VERSION = 1
ORBAX_FILES = ("_METADATA", "_CHECKPOINT_METADATA", "_sharding", META_NAME)
BLOCK_BYTES = 64 << 20   # largest chunk / largest piece of a tensor held in memory at once

_ZARR_DTYPES = {np.dtype(np.float32): "<f4", np.dtype(np.float16): "<f2", np.dtype(np.float64): "<f8",
                np.dtype(ml_dtypes.bfloat16): "bfloat16"}
DTYPE_NAMES = {np.dtype(np.float32): "float32", np.dtype(np.float16): "float16", np.dtype(np.float64): "float64",
               np.dtype(ml_dtypes.bfloat16): "bfloat16"}
NAMED_DTYPES = {v: k for k, v in DTYPE_NAMES.items()}


def param_name(path: tuple[str, ...]) -> str:
    """Orbax's name for a leaf (its directory): the key path joined by dots."""
    return ".".join(path)


def zarr_spec(directory: str, path: tuple[str, ...], shape=None, dtype=None, chunks=None) -> dict:
    spec = {"driver": "zarr", "kvstore": {"driver": "file", "path": os.path.join(directory, param_name(path))}}
    if shape is not None:
        if np.dtype(dtype) not in _ZARR_DTYPES:
            raise ValueError(f"{param_name(path)}: unsupported dtype {np.dtype(dtype)}")
        spec["metadata"] = {"shape": list(shape), "chunks": list(chunks), "dtype": _ZARR_DTYPES[np.dtype(dtype)],
                            "compressor": None, "fill_value": None, "dimension_separator": ".", "order": "C",
                            "filters": None}
    return spec


_CONTEXT = None


def open_array(directory: str, path, shape=None, dtype=None, chunks=None):
    """A tensorstore handle on one leaf: created (with shape/dtype/chunks) or opened for reading."""
    global _CONTEXT
    import tensorstore as ts
    if _CONTEXT is None:   # one context for all arrays; no fsync per chunk (the final rename publishes DST)
        _CONTEXT = ts.Context({"file_io_sync": False})
    spec = zarr_spec(directory, path, shape, dtype, chunks)
    try:
        if shape is None:
            return ts.open(spec, open=True, read=True, context=_CONTEXT).result()
        return ts.open(spec, create=True, write=True, context=_CONTEXT).result()
    except ValueError as e:
        raise CheckpointError(f"{directory}: cannot open array {param_name(path)}: {str(e).splitlines()[0]}") \
            from None


def write_tree_metadata(directory: str, leaves: dict[tuple[str, ...], tuple[int, ...]]) -> None:
    """Orbax's `_METADATA`, `_sharding` and `_CHECKPOINT_METADATA` for leaves {path: shape}."""
    tree = {str(p): {"key_metadata": [{"key": k, "key_type": 2} for k in p],   # 2 = dict key
                     "value_metadata": {"value_type": "jax.Array", "skip_deserialize": False,
                                        "write_shape": list(s)}}
            for p, s in leaves.items()}
    _dump(directory, "_METADATA", {"tree_metadata": tree, "use_ocdbt": False, "use_zarr3": False,
                                   "store_array_data_equal_to_fill_value": True, "custom_metadata": None})
    # what Orbax itself records for arrays saved from a host: restorable without a target on a CPU host;
    # elsewhere pass a target (restore_params does)
    import base64
    single = json.dumps({"sharding_type": "SingleDeviceSharding", "device_str": "cpu:0"})
    _dump(directory, "_sharding", {base64.b64encode(param_name(p).encode()).decode(): single for p in leaves})
    now = time.time_ns()
    _dump(directory, "_CHECKPOINT_METADATA", {
        "item_handlers": "orbax.checkpoint._src.handlers.pytree_checkpoint_handler.PyTreeCheckpointHandler",
        "metrics": {}, "performance_metrics": {}, "init_timestamp_nsecs": now, "commit_timestamp_nsecs": now,
        "custom_metadata": {}})


def _dump(directory: str, name: str, obj) -> None:
    with open(os.path.join(directory, name), "w") as f:
        json.dump(obj, f, indent=1 if name == META_NAME else None)


def write_meta(directory: str, meta: dict) -> None:
    _dump(directory, META_NAME, meta)


def is_converted(directory) -> bool:
    """True for a directory written by `prisma convert hf-to-orbax`."""
    return os.path.isfile(os.path.join(directory, META_NAME)) and os.path.isfile(os.path.join(directory, "_METADATA"))


def read_meta(directory: str) -> tuple[dict, ModelConfig]:
    """The converter's metadata and the model config, checked against the Orbax tree: CheckpointError if not."""
    if not os.path.isdir(directory):
        raise CheckpointError(f"{directory}: not a directory")
    if not is_converted(directory):
        raise CheckpointError(f"{directory}: not a checkpoint written by `prisma convert hf-to-orbax` "
                              f"(no {META_NAME} / _METADATA)")
    try:
        with open(os.path.join(directory, META_NAME)) as f:
            meta = json.load(f)
        with open(os.path.join(directory, "_METADATA")) as f:
            tree = json.load(f)["tree_metadata"]
        if meta.get("format") != FORMAT:
            raise KeyError("format")
        shapes = {tuple(v["key_metadata"][i]["key"] for i in range(len(v["key_metadata"]))):
                  tuple(v["value_metadata"]["write_shape"]) for v in tree.values()}
        dtypes = {tuple(k.split("/")): NAMED_DTYPES[v] for k, v in meta["leaf_dtypes"].items()}
        n_bits = int(meta["n_bits"])
    except (OSError, json.JSONDecodeError, KeyError, TypeError, AttributeError, ValueError):
        raise CheckpointError(f"{directory}: malformed {META_NAME} or _METADATA") from None
    cfg = load_hf_config(directory, n_bits=n_bits)
    want = dict(flatten(param_shapes(cfg)))
    if shapes != want or set(dtypes) != set(want):
        bad = sorted(param_name(p) for p in set(want) | set(shapes) if want.get(p) != shapes.get(p))
        raise CheckpointError(f"{directory}: arrays do not match config.json: {', '.join(bad[:10])}")
    meta["_dtypes"] = dtypes
    return meta, cfg


def restore_params(directory: str, shardings=None, dtype=None, verify: bool = True):
    """Restore the parameter pytree of a converted checkpoint with Orbax.

    shardings: None → NumPy arrays on the host; otherwise a pytree with the param tree's structure whose
        leaves are `jax.sharding.Sharding`s (e.g. `NamedSharding(mesh, spec)`), a single Sharding for
        every leaf, or a function ModelConfig → such a pytree (the config is read from the checkpoint first,
        e.g. `lambda cfg: sharding.param_shardings(cfg, mesh)`) → `jax.Array`s where each process reads only the chunks of its addressable shards and
        places each shard on its device; no full array is assembled on any host.
    dtype: None keeps the stored dtypes; a name or dtype casts while reading (per shard).
    verify: check the recorded crc32s of the chunks this process reads first (`verify_chunks`); a mismatch
        is a CheckpointError naming the tensor. False skips the check.
    Returns (params, ModelConfig).
    """
    import jax
    import orbax.checkpoint as ocp
    from prisma_jax.checkpoint.loading import resolve_dtype

    meta, cfg = read_meta(directory)
    want = resolve_dtype(dtype)
    shapes = dict(flatten(param_shapes(cfg)))
    if callable(shardings) and not isinstance(shardings, jax.sharding.Sharding):
        shardings = shardings(cfg)
    if isinstance(shardings, jax.sharding.Sharding):
        shardings = {p: shardings for p in shapes}
    elif shardings is not None:
        got = dict(flatten(shardings))
        if set(got) != set(shapes):
            raise ValueError(f"shardings tree does not match the param tree: "
                             f"{sorted(param_name(p) for p in set(got) ^ set(shapes))[:10]}")
        shardings = got
    if verify:
        verify_chunks(directory, meta, cfg, shardings)
    item, args = {}, {}
    for p, shape in shapes.items():
        dt = want or meta["_dtypes"][p]
        if shardings is None:
            set_path(item, p, np.zeros((0,), dt))   # structure only; the values come from restore_args
            set_path(args, p, ocp.RestoreArgs(restore_type=np.ndarray, dtype=dt))
        else:
            sds = jax.ShapeDtypeStruct(shape, dt, sharding=shardings[p])
            set_path(item, p, sds)
            set_path(args, p, ocp.ArrayRestoreArgs(sharding=shardings[p], global_shape=shape, dtype=dt))
    ckptr = ocp.PyTreeCheckpointer()
    params = ckptr.restore(os.path.abspath(directory), args=ocp.args.PyTreeRestore(item=item, restore_args=args))
    return params, cfg


# ------------------------------------------------------------------------------------------ checksums

def chunk_key(region: tuple, chunks) -> str:
    """The zarr key ('i.j.k') of the chunk a block written at `region` (a `leaf_region`) fills."""
    starts = [r if isinstance(r, int) else (r.start or 0) for r in region] + [0] * (len(chunks) - len(region))
    return ".".join(str(s // c) for s, c in zip(starts, chunks)) or "0"


def chunk_crc(block: np.ndarray) -> str:
    return f"{zlib.crc32(np.ascontiguousarray(block).reshape(-1).view(np.uint8)):08x}"


def _chunk_index(key: str, shape, chunks) -> tuple:
    grid = [int(k) for k in key.split(".")] if shape else []
    return tuple(slice(g * c, min((g + 1) * c, s)) for g, c, s in zip(grid, chunks, shape))


def _needed_chunks(shape, chunks, sharding) -> list[str]:
    """Keys of the chunks that the addressable shards of `sharding` (every chunk for None) overlap."""
    import itertools
    if sharding is None:
        ranges = [range(-(-s // c)) for s, c in zip(shape, chunks)]
        return [".".join(map(str, g)) or "0" for g in itertools.product(*ranges)]
    keys = set()
    for index in sharding.addressable_devices_indices_map(tuple(shape)).values():
        ranges = []
        for sl, s, c in zip(index, shape, chunks):
            a, b, _ = sl.indices(s)
            ranges.append(range(a // c, -(-b // c)) if b > a else range(0))
        keys.update(".".join(map(str, g)) or "0" for g in itertools.product(*ranges))
    return sorted(keys)


def verify_chunks(directory: str, meta: dict, cfg: ModelConfig, shardings=None) -> None:
    """Check the recorded crc32 of every chunk this process will read (all of them for shardings=None, else
    those its addressable shards overlap); a mismatch or a missing chunk is a CheckpointError naming the
    Hugging Face tensor. Without recorded chunk crcs (older conversions), every tensor's crc32 is checked."""
    from prisma_jax.checkpoint.hf_names import hf_names
    names = hf_names(cfg)
    recorded = meta.get("chunk_crc32")
    if recorded is None:
        arrays = {}
        for n in names:
            if n.path not in arrays:
                arrays[n.path] = open_array(directory, n.path)
            for _ in hf_blocks(directory, arrays[n.path], n, meta["_dtypes"][n.path], meta["tensors"]):
                pass
        return
    by_leaf: dict[tuple, dict] = {}
    for n in names:
        by_leaf.setdefault(n.path, {})[n.index] = n.hf
    for p, hfs in by_leaf.items():
        name = param_name(p)
        try:
            with open(os.path.join(directory, name, ".zarray")) as f:
                z = json.load(f)
            shape, chunks = tuple(z["shape"]), tuple(z["chunks"])
            want = recorded[name]
        except (OSError, json.JSONDecodeError, KeyError, TypeError):
            raise CheckpointError(f"{directory}: array {name} has no readable .zarray or recorded chunk crc32s") \
                from None
        dt = meta["_dtypes"][p]
        for key in _needed_chunks(shape, chunks, None if shardings is None else shardings[p]):
            index = _chunk_index(key, shape, chunks)
            hf = hfs.get(index[0].start if None not in hfs else None)
            path = os.path.join(directory, name, key)
            try:
                with open(path, "rb") as f:
                    raw = f.read()
                data = np.frombuffer(raw, dt).reshape(chunks)   # zarr v2 stores edge chunks full size
            except (OSError, ValueError):
                raise CheckpointError(f"{directory}: tensor {hf}: chunk {name}/{key} is missing or truncated") \
                    from None
            got = chunk_crc(data[tuple(slice(0, i.stop - i.start) for i in index)])
            if got != want.get(key):
                raise CheckpointError(f"{directory}: tensor {hf} does not match its recorded checksum (chunk "
                                      f"{name}/{key}: crc32 {got} != {want.get(key)}); the array data is corrupt")


def hf_blocks(directory: str, array, n, dt, recorded: dict):
    """The Hugging Face tensor `n` read from its tensorstore `array` in row blocks (torch layout, dtype `dt`);
    after the last block, a CheckpointError naming the tensor if its crc32 differs from `recorded`'s."""
    crc = 0
    for r0, r1 in row_blocks(n, np.dtype(dt).itemsize):
        x = array[leaf_region(n, r0, r1)].read().result()
        block = np.ascontiguousarray(n.to_hf(np.asarray(x, dt)))
        del x
        crc = zlib.crc32(block.reshape(-1).view(np.uint8), crc)
        yield block
    want = (recorded.get(n.hf) or {}).get("crc32")
    if f"{crc:08x}" != want:
        raise CheckpointError(f"{directory}: tensor {n.hf} does not match its recorded checksum "
                              f"(crc32 {crc:08x} != {want}); the array data is corrupt")


# ------------------------------------------------------------------------------- blocks and chunks
# A Hugging Face tensor is streamed in blocks of consecutive rows (its leading axis). `HFName.to_jax` /
# `to_hf` are transposes or identities that act on such a block alone (a row block of a torch [out, in]
# weight is a column block of our [in, out] kernel); the one exception is the patch-embedding reshape,
# which is small and moved whole.

def blockable(n) -> bool:
    return n.path != ("vision", "patch_embed", "kernel")


def block_rows(n, itemsize: int) -> int:
    """Rows of the HF tensor per block: balanced blocks of at most BLOCK_BYTES."""
    rows = n.hf_shape[0]
    if not blockable(n) or len(n.hf_shape) == 0:
        return max(rows, 1)
    total = int(np.prod(n.hf_shape, dtype=np.int64)) * itemsize
    nb = max(1, -(-total // BLOCK_BYTES))
    return max(1, -(-rows // nb))


def row_blocks(n, itemsize: int):
    rb = block_rows(n, itemsize)
    return [(r, min(r + rb, n.hf_shape[0])) for r in range(0, n.hf_shape[0], rb)]


def leaf_region(n, r0: int, r1: int) -> tuple:
    """Index into the leaf of rows r0:r1 of the HF tensor `n`."""
    idx = () if n.index is None else (n.index,)
    if not blockable(n):
        return idx
    if n.path[-1] == "kernel":
        return idx + (slice(None), slice(r0, r1))
    return idx + (slice(r0, r1),)


def chunk_shape(n, leaf_shape: tuple[int, ...], itemsize: int) -> list[int]:
    """Zarr chunks of the leaf of `n`: one stacked slice, split as the blocks are."""
    inner = list(leaf_shape[1:] if n.index is not None else leaf_shape)
    if blockable(n):
        rb = block_rows(n, itemsize)
        if n.path[-1] == "kernel":
            inner[-1] = rb
        else:
            inner[0] = rb
    return ([1] if n.index is not None else []) + inner
