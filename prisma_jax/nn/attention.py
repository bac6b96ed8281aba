"""Attention: one entry point for the text decoder and the vision tower, choosing its kernel by platform.

`attention(q, k, v, mask, impl)` with q [B, Sq, H, hd], k/v [B, Sk, KV, hd] (grouped-query: H a multiple of KV).
Which keys a query sees is a `Mask`: segment ids plus an optional causal offset, the form the Pallas kernels
take, so one description serves every implementation:

    query i may see key j  ⇔  q_segment[i] == kv_segment[j]  and (no causality, or j ≤ i + causal_start)

Segment 0 is padding (padded queries see only padded keys, so no row is empty and nothing is NaN); real tokens
carry segment 1, or 1, 2, ... for the conversations packed into one training row. In a cached call the keys are
the cache's slots and `causal_start` is the slot of query 0 (`write_pos`; `[B]`, each row's own, in a decode step
of generate.py). A decode step whose rows hold their keys in slots `[0, kv_len)` says so with `Mask.kv_len`: the
ragged form the paged decode kernel takes.

`cached_attention(q, k_cache, v_cache, mask, impl)` attends over a KV cache in its own layout, `[B, KV, S, hd]`
(text.py): per row and head, the slots are contiguous, so the paged kernel reads them as pages without a copy.

Implementations (`ModelConfig.attention`: "auto" | "xla" | "pallas"; docs/design.md "Attention"):
* "xla": the einsums below, scores `[B, KV, G, Sq, Sk]` in float32. What CPU runs under "auto" for fewer than
  `BLOCKED_MIN` queries and for decode steps; from `BLOCKED_MIN` queries on, "auto" on CPU runs the same function
  in blocks with an online softmax and a recomputing backward (attention_blocked.py; docs/attention-cpu.md:
  0.55× the einsums' time at 512 tokens, 0.24× at 2,048, forward + backward).
* "pallas" on TPU: jax's splash attention (`jax.experimental.pallas.ops.tpu.splash_attention`) for training,
  prefill and the vision tower: segment ids for padding and packing, a static causal mask, GQA as one MQA
  kernel per key/value head, inside a `shard_map` over the batch and head axes of the active mesh. On
  another platform "pallas" runs the same kernel in Pallas interpret mode (what the tests compare with "xla").
  A decode step over a bfloat16 cache with `Mask.kv_len` runs jax's paged attention kernel
  (`jax.experimental.pallas.ops.tpu.paged_attention`): each row's keys are read in blocks of up to
  `BLOCK_SLOTS` slots, as many blocks as cover its `kv_len`, where "xla" reads every slot. The kernel casts
  keys and values to bfloat16 and takes head dims in whole lanes (128), so a float32 cache, a head dim of
  another size and a step without `kv_len` (Tunix, whose rows stay left-padded) run "xla".
  "auto" on TPU is "pallas".
* "auto" on GPU: `jax.nn.dot_product_attention` with cuDNN's fused kernel for bf16/fp16 (the mask as its bias),
  XLA's for float32 or where cuDNN refuses the shape; a decode step runs "xla" (one query: the einsums read the
  cache in its own layout, where `dot_product_attention` would take a transposed copy of it).

A dense `[B, Sq, Sk]` boolean mask (Tunix brings its own, prisma_jax/integrations/tunix.py) always runs "xla".
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import functools

import jax
import jax.numpy as jnp

from prisma_jax.core.partitioning import constrain, spec_for
from prisma_jax.core.platform import platform
from prisma_jax.nn.mask import Mask, causal, segments_in_order  # noqa: F401 (re-exported with the kernels)

IMPLS = ("auto", "xla", "pallas")
BLOCK = 128          # splash tiles: sequences padded to a multiple (padding is segment 0)
LANES = 128          # head dims padded to a multiple on the kernel path (zeros change no score, no output)
BLOCKED_MIN = 256    # "auto" on CPU: queries from which the blocked path beats the einsums (docs/attention-cpu.md)
PAGE_MULTIPLE = 16   # paged decode kernel: its pages are 16·k slots (bf16 tiles), so the cache length is too
PAGE_MAX = 128       # its largest page, in slots
BLOCK_SLOTS = 512    # its largest block of keys per kernel step, in slots: a row reads whole blocks


def resolve(impl: str, mask, n_query: int, cache: jax.Array | None = None) -> str:
    """The implementation that runs: "xla", "blocked", "splash", "paged" or "gpu". `cache`: the keys of a
    cached call, [B, KV, S, hd] (their dtype and head dim decide the decode kernel)."""
    if impl not in IMPLS:
        raise ValueError(f"attention must be one of {IMPLS}, got {impl!r}")
    if not isinstance(mask, Mask) or impl == "xla":
        return "xla"
    decode = not isinstance(mask.causal_start, (int, type(None)))        # a traced write slot
    where = platform()
    if impl == "pallas" or where == "tpu":
        if not decode:
            return "splash"
        paged = (n_query == 1 and mask.kv_len is not None and cache is not None and cache.dtype == jnp.bfloat16
                 and cache.shape[2] % PAGE_MULTIPLE == 0 and cache.shape[3] % LANES == 0)
        return "paged" if paged else "xla"
    if where == "gpu":
        return "xla" if decode else "gpu"             # a decode step reads the cache in its layout, no transpose
    return "blocked" if not decode and n_query >= BLOCKED_MIN else "xla"


def attention(q: jax.Array, k: jax.Array, v: jax.Array, mask, impl: str = "auto",
              batch_axis: str = "batch") -> jax.Array:
    """Grouped-query attention → [B, Sq, H, hd]. `mask`: a `Mask`, or a dense bool [B, Sq, Sk] (True = may
    attend). `batch_axis`: the logical name of B (the vision tower's frames are "frames", sharding.LOGICAL_RULES).
    """
    how = resolve(impl, mask, q.shape[1])
    if how == "splash":
        out = _splash(q, k, v, mask, batch_axis)
    elif how == "blocked":
        from prisma_jax.nn.attention_blocked import blocked_attention
        out = blocked_attention(q, k, v, mask)
    elif how == "gpu":
        out = _gpu(q, k, v, mask.dense())
    else:
        out = _xla(q, k, v, mask.dense() if isinstance(mask, Mask) else mask)
    return constrain(out, (batch_axis, "seq", "heads", None))


def cached_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, mask, impl: str = "auto") -> jax.Array:
    """`attention` with the keys and values of a cache in its layout, k/v_cache [B, KV, S, hd] → [B, Sq, H, hd]."""
    how = resolve(impl, mask, q.shape[1], k_cache)
    if how == "paged":
        out = _paged(q, k_cache, v_cache, mask.kv_len)
    elif how == "xla":
        out = _xla(q, k_cache, v_cache, mask.dense() if isinstance(mask, Mask) else mask, kv_first=True)
    else:
        return attention(q, k_cache.swapaxes(1, 2), v_cache.swapaxes(1, 2), mask, impl)
    return constrain(out, ("batch", "seq", "heads", None))


def write_cache(cache: jax.Array, new: jax.Array, write_pos) -> jax.Array:
    """new [B, s, KV, hd] into cache [B, KV, S, hd] at slots [write_pos, write_pos + s): `write_pos` one slot
    for every row, or [B] each row's own."""
    new = new.swapaxes(1, 2).astype(cache.dtype)
    if jnp.ndim(write_pos) == 0:
        return jax.lax.dynamic_update_slice_in_dim(cache, new, write_pos, axis=2)
    return jax.vmap(lambda c, x, w: jax.lax.dynamic_update_slice_in_dim(c, x, w, axis=1))(cache, new, write_pos)


def _xla(q, k, v, mask, kv_first: bool = False):
    """Scores and softmax in float32; the weights cast back to v's dtype before the value product. k/v
    [B, Sk, KV, hd], or [B, KV, Sk, hd] (a cache's layout) with `kv_first`."""
    b, sq, h, hd = q.shape
    kv = k.shape[1 if kv_first else 2]
    keys = "bksd" if kv_first else "bskd"
    q = q.reshape(b, sq, kv, h // kv, hd)
    scores = jnp.einsum(f"bqkgd,{keys}->bkgqs", q, k, preferred_element_type=jnp.float32) * (hd ** -0.5)
    scores = jnp.where(mask[:, None, None], scores, jnp.finfo(jnp.float32).min)
    w = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    return jnp.einsum(f"bkgqs,{keys}->bqkgd", w, v).reshape(b, sq, h, hd)


def _gpu(q, k, v, mask):
    """cuDNN's fused attention for bf16/fp16 (the mask as its bias), else XLA's, both through
    `jax.nn.dot_product_attention` (whose default implementation is XLA's)."""
    if q.dtype in (jnp.bfloat16, jnp.float16):
        try:
            return jax.nn.dot_product_attention(q, k, v, mask=mask[:, None], implementation="cudnn")
        except (NotImplementedError, ValueError, RuntimeError):    # a shape, dtype or cuDNN version it refuses
            pass
    return jax.nn.dot_product_attention(q, k, v, mask=mask[:, None], implementation="xla")


def _pad_to(x, axis: int, multiple: int):
    extra = -x.shape[axis] % multiple
    if not extra:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths)


def _splash_kernel(groups: int, sq: int, sk: int, causal_start, interpret: bool):
    """The MQA kernel for one key/value head's `groups` query heads. Its block-mask tables are arrays: built
    eagerly (constants of the program), so that no tracer of the calling trace is kept in them, and in a thread
    of their own, outside the caller's mesh (an ahead-of-time TPU topology's devices cannot run an eager op)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk_lib
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as mask_lib
    one = (mask_lib.FullMask((sq, sk)) if causal_start is None
           else mask_lib.CausalMask((sq, sk), offset=causal_start))
    build = functools.partial(sk_lib.make_splash_mqa, mask_lib.MultiHeadMask([one] * groups), head_shards=1,
                              q_seq_shards=1, interpret=interpret)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(build).result()


def _splash(q, k, v, mask: Mask, batch_axis: str):
    """Splash attention per key/value head (an MQA kernel over its G query heads), per row, inside a shard_map
    over the batch and head axes. Sequences are padded to whole tiles with segment 0, head dims with zeros."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk_lib
    b, sq, h, hd = q.shape
    kvh = k.shape[2]
    g = h // kvh
    dtype = q.dtype
    q = (q.astype(jnp.float32) * hd ** -0.5).astype(dtype).reshape(b, sq, kvh, g, hd)
    q, k, v = (_pad_to(_pad_to(a, -1, LANES), 1, BLOCK) for a in (q, k, v))
    qs = _pad_to(mask.q_segment.astype(jnp.int32), 1, BLOCK)
    ks = _pad_to(mask.kv_segment.astype(jnp.int32), 1, BLOCK)
    sq_p, sk_p = q.shape[1], k.shape[1]
    interpret = platform() != "tpu"

    def local(q, k, v, qs, ks):
        kernel = _splash_kernel(q.shape[3], sq_p, sk_p, mask.causal_start, interpret)

        def one_head(qh, kh, vh, seg):          # qh [G, Sq, hd], kh/vh [Sk, hd]
            return kernel(qh, kh, vh, segment_ids=seg)

        def one_row(q, k, v, qs, ks):           # q [Sq, KV, G, hd] → [Sq, KV, G, hd]
            seg = sk_lib.SegmentIds(qs, ks)
            out = jax.vmap(one_head, in_axes=(0, 0, 0, None))(q.transpose(1, 2, 0, 3), k.transpose(1, 0, 2),
                                                              v.transpose(1, 0, 2), seg)
            return out.transpose(2, 0, 1, 3)

        return jax.vmap(one_row)(q, k, v, qs, ks)

    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty:
        q_spec = spec_for(q.shape, (batch_axis, None, "kv_heads", None, None), mesh)
        kv_spec = spec_for(k.shape, (batch_axis, None, "kv_heads", None), mesh)
        seg_spec = spec_for(qs.shape, (batch_axis, None), mesh)
        local = jax.shard_map(local, in_specs=(q_spec, kv_spec, kv_spec, seg_spec, seg_spec), out_specs=q_spec,
                              check_vma=False)
    out = local(q, k, v, qs, ks)
    return out[:, :sq, :, :, :hd].reshape(b, sq, h, hd)


def _divisor(n: int, most: int, step: int = 1) -> int:
    """The largest multiple of `step` that divides n and is ≤ most."""
    return max(d for d in range(step, min(n, most) + 1, step) if n % d == 0)


def _paged(q, k_cache, v_cache, kv_len):
    """One query per row through jax's paged attention kernel, inside a shard_map over the batch and key/value
    heads of the active mesh. Each (row, key/value head) is one of the kernel's sequences, an MQA over that
    head's G query heads, its pages the row's slots of that head: `[B, KV, S, hd]` is the kernel's
    `[1, B·KV·S/page, page, hd]` without a copy, and q `[B, 1, H, hd]` its `[B·KV, G, hd]`."""
    from jax.experimental.pallas import tpu as pltpu
    from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention
    b, _, h, hd = q.shape
    kvh, s = k_cache.shape[1], k_cache.shape[2]
    page = _divisor(s, PAGE_MAX, PAGE_MULTIPLE)
    block = _divisor(s // page, BLOCK_SLOTS // page)
    dtype = q.dtype
    q = (q.astype(jnp.float32) * hd ** -0.5).reshape(b, kvh, h // kvh, hd)         # the kernel takes q in float32
    interpret = platform() != "tpu"

    def local(q, k, v, lengths):
        rows, heads = k.shape[:2]
        n = rows * heads
        pages = jnp.arange(n * (s // page), dtype=jnp.int32).reshape(n, s // page)
        as_pages = lambda c: c.reshape(1, n * (s // page), page, hd)                      # noqa: E731
        with pltpu.force_tpu_interpret_mode() if interpret else contextlib.nullcontext():
            out = paged_attention(q.reshape(n, -1, hd), as_pages(k), as_pages(v),
                                  jnp.repeat(lengths.astype(jnp.int32), heads), pages, pages_per_compute_block=block)
        return out.reshape(q.shape)

    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty:
        spec = spec_for(k_cache.shape, ("batch", "kv_heads", None, None), mesh)
        local = jax.shard_map(local, in_specs=(spec_for(q.shape, ("batch", "kv_heads", None, None), mesh), spec, spec,
                                               spec_for(kv_len.shape, ("batch",), mesh)),
                              out_specs=spec_for(q.shape, ("batch", "kv_heads", None, None), mesh), check_vma=False)
    return local(q, k_cache, v_cache, kv_len).reshape(b, 1, h, hd).astype(dtype)
