"""The training step: a pure `train_step(state, batch) -> (state, metrics)`, jit-able, no host work.

    for each micro-batch (lax.scan over grad_accum):
        codes ← prompt rule;  P−1 stop-gradient passes: codes ← shift_codes(code(logits))   (INTROSPECTION §4)
        last pass with gradients: logits → cross-entropy over learned targets (sum; NO_LOSS feeds codes only)
        (every pass's head + loss/entropy: `head_xent`, in sequence chunks of `train.logits_chunk`; the last
         pass's on CPU: `fused_head_xent`, its gradients computed chunk by chunk in the forward)
    grads / (learned tokens of the whole batch) → clip by global norm → AdamW (warmup + cosine)
    loss or gradient norm not finite → the update is not applied (`skip_nonfinite`; train.max_bad_steps: null = off)

Weight decay (decoupled, AdamW's) applies to kernels and embedding tables (the uncertainty table included),
never to norm scales or biases, chosen by leaf name (`decay_mask`), so stacked layers change nothing.

Master weights and optimizer state are float32; `compute_dtype` bfloat16 casts a copy of the params for the
forward and backward (gradients arrive in float32 through the cast). Frozen groups are stop-gradient'd in
the forward and get `optax.set_to_zero` updates, so they do not move by a single bit. `remat` picks what the
scanned decoder layers keep for the backward pass.

With `train.lora` the state holds only the trained leaves — the adapters, and the uncertainty table unless
`train.freeze` names it — and their optimizer state; the frozen base is a separate argument of the step
(`train_step(state, batch, base)`), held once in the compute dtype, never differentiated or saved.

Not here: data, checkpoints, logging (train/data.py, train/loop.py).
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from prisma_jax.nn.lora import is_adapter
from prisma_jax.nn.model import Batch, bind, head_logits
from prisma_jax.nn.params import TABLE_PATH, init_params
from prisma_jax.quant.int8 import refuse_training
from prisma_jax.core.partitioning import constrain
from prisma_jax.nn.text import unroll_default
from prisma_jax.nn.uncertainty import codes_from_entropy, entropy_parts, shift_codes
from prisma_jax.nn.vision import VisionGeometry

from train.config import Config

LOW, HIGH = 0.25, 0.75   # code summary thresholds, as fractions of the code range [0, L−1]
# Target values that are not a token id. IGNORE: the position is not supervised (prompt, padding): no loss, and its
# logits' code is not fed to the next position (the prompt rule stays there). NO_LOSS: the next token is part of a
# reply but not learned (`"loss": false` in the data, train/data.py): no loss and no gradient, yet its code is fed
# to the next position as generation would feed it (docs/introspection-contract.md §4).
IGNORE, NO_LOSS = -1, -2


def feeds_code(targets: jax.Array) -> jax.Array:
    """Where a position's code reaches the next position in passes ≥ 2: a learned target or NO_LOSS."""
    return (targets >= 0) | (targets == NO_LOSS)


class TrainBatch(NamedTuple):
    """One global (per-host) batch split into A = grad_accum micro-batches of b rows."""
    input_ids: jax.Array        # [A, b, S] int32
    attention_mask: jax.Array   # [A, b, S] bool, or int32 segment ids (`data.packing`: 1, 2, ... per conversation)
    codes: jax.Array            # [A, b, S] int32 prompt-rule codes (−1 = none), per segment when packed
    positions: jax.Array        # [A, 3, b, S] int32 M-RoPE positions, restarting in every segment
    targets: jax.Array          # [A, b, S] int32 next-token target of each position: IGNORE (−1) = not
    #                             supervised (a segment's last token too), NO_LOSS (−2) = not learned but its
    #                             code fed on (`feeds_code`)
    pixel_values: jax.Array | None = None   # [A, b, max_images·patches, C·T·P·P] each row's image slots
    geometry: VisionGeometry | None = None  # of one row's slots: the same for every row, micro-batch and host


class TrainState(NamedTuple):
    step: jax.Array             # int32 scalar: optimizer steps taken
    params: dict                # float32 master weights
    opt_state: optax.OptState
    rng: jax.Array              # uint32 [2]; advanced every step (the model itself draws nothing)


# ---------------------------------------------------------------------------------------------- optimizer

def schedule(cfg: Config) -> optax.Schedule:
    o, steps = cfg.optimizer, cfg.train.steps
    warm = min(o.warmup_steps, steps - 1) if steps > 1 else 0
    return optax.warmup_cosine_decay_schedule(0.0 if warm else o.lr, o.lr, warm, max(steps, warm + 1),
                                              end_value=o.lr * o.end_lr_ratio)


def frozen_mask(cfg: Config, params: dict) -> dict:
    """Same tree as params, True where the leaf belongs to a frozen group."""
    groups = set(cfg.train.freeze)

    def is_frozen(path, _):
        keys = [getattr(k, "key", None) for k in path]
        top, sub = keys[0], keys[1] if len(keys) > 1 else None
        return bool(top in groups or (top == "text" and ("text" in groups or
                    (sub == "embed" and "embed" in groups) or (sub in ("layers", "norm") and "layers" in groups))))
    return jax.tree_util.tree_map_with_path(is_frozen, params)


DECAYED, NOT_DECAYED = ("kernel", "embedding", "lora_a", "lora_b"), ("scale", "bias")   # leaf names


def decay_mask(params: dict) -> dict:
    """Same tree as params, True where weight decay applies: chosen by leaf name, not rank — kernels and
    embedding tables decay, norm scales and biases never (stacked per-layer ones are 2-D, yet still not)."""
    def decayed(path, _):
        name = getattr(path[-1], "key", None)
        if name not in DECAYED + NOT_DECAYED:
            raise ValueError(f"no weight-decay rule for parameter {jax.tree_util.keystr(path)} (leaf name "
                             f"{name!r}; decayed: {DECAYED}, not decayed: {NOT_DECAYED})")
        return name in DECAYED
    return jax.tree_util.tree_map_with_path(decayed, params)


def make_optimizer(cfg: Config, params: dict) -> optax.GradientTransformation:
    refuse_training(params)                                       # int8 params are for generation only
    o = cfg.optimizer
    tx = optax.adamw(schedule(cfg), o.b1, o.b2, o.eps, weight_decay=o.weight_decay, mask=decay_mask)
    if o.clip_norm is not None:
        tx = optax.chain(optax.clip_by_global_norm(o.clip_norm), tx)
    labels = jax.tree.map(lambda f: "frozen" if f else "train", frozen_mask(cfg, params))
    return optax.multi_transform({"train": tx, "frozen": optax.set_to_zero()}, labels)


# ---------------------------------------------------------------------------------------------- LoRA

def is_trained(cfg: Config, path: tuple) -> bool:
    """With LoRA: the adapters, and the table unless frozen."""
    return is_adapter(path) or (path == TABLE_PATH and "uncertainty" not in cfg.train.freeze)


def partition(tree: dict, keep, prefix: tuple = ()) -> tuple[dict, dict]:
    """(the leaves whose path `keep` accepts, the others), both as nested dicts without empty branches."""
    a, b = {}, {}
    for k, v in tree.items():
        if isinstance(v, dict):
            x, y = partition(v, keep, prefix + (k,))
            if x:
                a[k] = x
            if y:
                b[k] = y
        else:
            (a if keep(prefix + (k,)) else b)[k] = v
    return a, b


def combine(a: dict, b: dict) -> dict:
    """The union of two disjoint nested dicts (`partition`'s inverse)."""
    out = dict(b)
    for k, v in a.items():
        out[k] = combine(v, b[k]) if isinstance(v, dict) and k in b else v
    return out


def lora_init(cfg: Config, key: jax.Array, base: dict | None = None) -> tuple[dict, dict]:
    """(trained leaves in float32, frozen base in the compute dtype) at step 0 (traceable). The base is `base`
    (train.init) or random from fold_in(key, 1), as without LoRA; the adapters come from fold_in(key, 2)."""
    if base is None:
        base = init_params(cfg.model, jax.random.fold_in(key, 1), jnp.float32)
    full = init_params(cfg.model, jax.random.fold_in(key, 2), jnp.float32, lora=cfg.train.lora)
    adapters, _ = partition(full, is_adapter)
    trained, frozen = partition(combine(adapters, base), lambda p: is_trained(cfg, p))
    dt = jnp.dtype(cfg.train.compute_dtype)
    return (jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), trained),
            jax.tree.map(lambda x: jnp.asarray(x, dt), frozen))


def fresh_state(cfg: Config, key: jax.Array, params: dict | None = None) -> TrainState:
    """The step-0 state (traceable, so a mesh can create it in its shardings: train/sharded.py): float32
    params (random from `key` unless given), the optimizer's initial state, `key` as the training RNG."""
    if params is None:
        params = (lora_init(cfg, key)[0] if cfg.train.lora is not None else
                  init_params(cfg.model, jax.random.fold_in(key, 1), jnp.float32))
    params = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), params)
    return TrainState(jnp.zeros((), jnp.int32), params, make_optimizer(cfg, params).init(params), key)


@functools.lru_cache(maxsize=8)
def _init_params_fn(model):
    """One compiled init program per model config (threefry programs are slow to compile on CPU)."""
    return jax.jit(lambda k: init_params(model, jax.random.fold_in(k, 1), jnp.float32))


def init_state(cfg: Config, params: dict | None = None) -> TrainState:
    """`fresh_state` from train.seed on the default device (with LoRA: see `init_lora`)."""
    key = jax.random.PRNGKey(cfg.train.seed)
    if cfg.train.lora is not None:
        return init_lora(cfg, params)[0]
    if params is None:
        params = _init_params_fn(cfg.model)(key)
    return jax.jit(fresh_state, static_argnums=0)(cfg, key, params)


def init_lora(cfg: Config, base: dict | None = None) -> tuple[TrainState, dict]:
    """(the step-0 state of the trained leaves, the frozen base) from train.seed; `base`: train.init's params."""
    key = jax.random.PRNGKey(cfg.train.seed)
    trained, frozen = jax.jit(lora_init, static_argnums=0)(cfg, key, base)
    return jax.jit(fresh_state, static_argnums=0)(cfg, key, trained), frozen


# ---------------------------------------------------------------------------------------------- forward + loss

def remat_policy(name: str):
    return {"none": None, "full": jax.checkpoint_policies.nothing_saveable,
            "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable}[name]


def micro(batch: TrainBatch, i) -> tuple[Batch, jax.Array]:
    """Micro-batch i as a model `Batch` and its targets."""
    pv = None if batch.pixel_values is None else batch.pixel_values[i]
    return (Batch(batch.input_ids[i], batch.attention_mask[i], batch.codes[i], batch.positions[i], pv,
                  batch.geometry), batch.targets[i])


def unrolled(cfg: Config) -> bool:
    """`train.unroll_layers`, null resolved: unrolled when the step targets the CPU and nothing is rematerialised
    (XLA:CPU runs the `bench_58m` step in 15 % less time with its layers unrolled, docs/benchmarks.md; a scan compiles
    one layer, which TPU and GPU programs keep)."""
    u = cfg.train.unroll_layers
    return unroll_default(None) and cfg.train.remat == "none" if u is None else u


def _bind(cfg: Config, params: dict):
    """The model on `params`, its decoder layers unrolled when `unrolled(cfg)` (text.py's two layouts compute
    the same)."""
    return bind(cfg.model, params, cfg.train.lora, unroll=unrolled(cfg))


def _last_pass(cfg: Config, params: dict, mb: Batch, targets: jax.Array, remat: str = "none"):
    """(the bound model, final hidden states [b, S, D] of the last introspection pass, the codes it was fed).

    Passes 1..P−1 see stop-gradient params; pass k feeds each position whose predecessor is supervised (a
    learned target or NO_LOSS: `feeds_code`) and in the same segment (packed rows: no code crosses from one
    conversation into the next) the code of pass k−1's head there (`shift_codes`), every other position keeps
    the prompt rule. A pass's codes come from `head_xent`'s entropies, in chunks of
    `train.logits_chunk` like the loss. The vision tower runs once for all passes (its features do not depend
    on the codes; passes 1..P−1 take them stop-gradient'd): about 10 % off the demo's jitted step.
    """
    m = cfg.model
    supervised = feeds_code(targets)
    codes = mb.codes
    model = _bind(cfg, params)
    feats = None
    if cfg.train.introspection_passes > 1:
        fixed = _bind(cfg, jax.lax.stop_gradient(params))     # outside the scan: unrolled layers sliced once
        if mb.pixel_values is not None:
            feats = model.vision_features(mb.pixel_values, mb.geometry, remat_policy(remat) is not None)
        fixed_feats = jax.lax.stop_gradient(feats)

        def one_pass(c, _):
            h, _ = fixed.hidden(mb._replace(codes=c), features=fixed_feats)
            ent = head_xent(fixed, h, targets, cfg.train.logits_chunk)[1]
            return shift_codes(mb.codes, codes_from_entropy(ent, m.text.vocab_size, m.n_bits), supervised,
                               mb.attention_mask), None
        codes, _ = jax.lax.scan(one_pass, codes, None, length=cfg.train.introspection_passes - 1)
    h, _ = model.hidden(mb._replace(codes=codes), remat_policy=remat_policy(remat), features=feats)
    return model, h, codes


def training_logits(cfg: Config, params: dict, mb: Batch, targets: jax.Array, remat: str = "none"):
    """Logits [b, S, V] (float32) of the last introspection pass, and the codes it was fed (for inspection and
    tests: the step itself never holds these logits whole when `train.logits_chunk` is set)."""
    model, h, codes = _last_pass(cfg, params, mb, targets, remat)
    return model.head(h).astype(jnp.float32), codes


@jax.custom_vjp
def xent_and_entropy(logits: jax.Array, targets: jax.Array):
    """Per-position cross-entropy [b, S] (0 where targets < 0: IGNORE and NO_LOSS) and entropy [b, S] (no
    gradient) of float32 logits [b, S, V], from one exp pass over the vocabulary (`entropy_parts`); the backward
    reuses that pass's softmax instead of recomputing it. Plain autodiff of logsumexp plus a separate entropy made
    XLA:CPU run three exp passes over [b, S, V] per step."""
    return _xent_fwd(logits, targets)[0]


def _xent_fwd(logits, targets):
    h, m, e, s = entropy_parts(logits)
    tgt = jnp.take_along_axis(logits, jnp.maximum(targets, 0)[..., None], axis=-1)[..., 0]
    loss = jnp.where(targets >= 0, m + jnp.log(s) - tgt, 0.0)
    return (loss, h), (e, s, targets)


def _xent_bwd(res, g):
    e, s, targets = res
    g_loss = jnp.where(targets >= 0, g[0], 0.0)
    onehot = jnp.arange(e.shape[-1]) == jnp.maximum(targets, 0)[..., None]
    return (e / s[..., None] - onehot) * g_loss[..., None], None


xent_and_entropy.defvjp(_xent_fwd, _xent_bwd)


def head_xent(model, h: jax.Array, targets: jax.Array, chunk: int = 0):
    """The LM head and its per-position cross-entropy and entropy, [b, S] each (`xent_and_entropy` of the
    float32 logits of `model.head(h)`, h [b, S, D]): what the loss and every introspection pass's codes take.

    `chunk` > 0 and < S: the sequence is cut into chunks of `chunk` positions (the last one padded with zero
    hidden states and target IGNORE, its padding dropped from the result) and a `lax.map` runs the head and the
    loss chunk by chunk, each chunk under `jax.checkpoint`: no pass, forward or backward, holds more than
    `[b, chunk, V]` logits (MaxText's vocabulary tiling, along the sequence); the backward recomputes each
    chunk's logits (one more head matmul) instead of keeping its softmax. Each position's logits, loss and
    entropy are computed as without chunks (on XLA:CPU the codes and losses come out bit for bit); gradients
    differ by the order in which the head's is summed (tests/test_logits_chunk.py: within 1e-6 relative).
    """
    def one(h, t):
        return xent_and_entropy(model.head(h).astype(jnp.float32), t)

    if not chunk or chunk >= targets.shape[1]:
        return one(h, targets)
    hs, ts, unchunk = _chunks(h, targets, chunk)
    out = jax.lax.map(lambda x: jax.checkpoint(one, prevent_cse=False)(*x), (hs, ts))
    return tuple(map(unchunk, out))


def _chunks(h: jax.Array, targets: jax.Array, chunk: int):
    """h [b, S, D] and targets [b, S] cut into n sequence chunks of `chunk` positions, chunk-major ([n, b, chunk,
    ...]; the last chunk padded with zero hidden states and target IGNORE), and `unchunk`, which maps a per-chunk
    result [n, b, chunk, ...] back to [b, S, ...] (padding dropped)."""
    b, s, d = h.shape
    n = -(-s // chunk)
    pad = n * chunk - s
    hs = jnp.pad(h, ((0, 0), (0, pad), (0, 0))).reshape(b, n, chunk, d).swapaxes(0, 1)
    ts = jnp.pad(targets, ((0, 0), (0, pad)), constant_values=IGNORE).reshape(b, n, chunk).swapaxes(0, 1)

    def unchunk(y):
        return y.swapaxes(0, 1).reshape(b, n * chunk, *y.shape[3:])[:, :s]
    return constrain(hs, (None, "batch", "seq", "embed")), ts, unchunk


FUSED_TOKENS = 512   # tokens (rows × positions) a chunk of the fused loss takes when `train.logits_chunk` is 0


def fused(cfg: Config) -> bool:
    """`train.fused_loss`, null resolved: on when the step targets the CPU (docs/training.md, "The fused loss")."""
    f = cfg.train.fused_loss
    return unroll_default(None) if f is None else f


def _chunked(head, params, h, targets, chunk: int, live=None):
    """`fused_head_xent`'s loop: a `lax.scan` over sequence chunks of `chunk` positions (`_chunks`) → (Σ loss,
    entropy [b, S]) and, when `live` (a bool per leaf of `params`: the leaves differentiated) is given, the
    gradients of Σ loss: the live leaves' summed over chunks in float32 (None for the others), h's."""
    hs, ts, unchunk = _chunks(h, targets, chunk)
    leaves, tree = jax.tree.flatten(params)
    on = [i for i, x in enumerate(jax.tree.leaves(live)) if x] if live is not None else []

    def head_of_live(vals, x):                           # the head as a function of the live leaves only
        full = list(leaves)
        for i, v in zip(on, vals):
            full[i] = v
        return head(jax.tree.unflatten(tree, full), x)

    def body(carry, x):
        hc, tc = x
        if live is None:
            loss, ent = xent_and_entropy(head(params, hc), tc)
            return carry + jnp.sum(loss), (ent,)
        logits, pull = jax.vjp(head_of_live, [leaves[i] for i in on], hc)
        (loss, ent), res = _xent_fwd(logits, tc)
        d_live, d_h = pull(_xent_bwd(res, (jnp.ones_like(loss), None))[0])
        total, acc = carry
        return (total + jnp.sum(loss), [a + g.astype(jnp.float32) for a, g in zip(acc, d_live)]), (ent, d_h)

    zero = jnp.zeros((), jnp.float32)
    carry = zero if live is None else (zero, [jnp.zeros(leaves[i].shape, jnp.float32) for i in on])
    carry, ys = jax.lax.scan(body, carry, (hs, ts))
    if live is None:
        return carry, unchunk(ys[0])
    total, d_live = carry
    grads = [None] * len(leaves)
    for i, g in zip(on, d_live):
        grads[i] = g.astype(leaves[i].dtype)
    return total, unchunk(ys[0]), jax.tree.unflatten(tree, grads), unchunk(ys[1])


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 4))
def fused_head_xent(head, params, h: jax.Array, targets: jax.Array, chunk: int):
    """(Σ cross-entropy over learned targets, entropy [b, S] (no gradient)) of the float32 logits `head(params, h)`,
    h [b, S, D], over sequence chunks of `chunk` positions: `head_xent` summed, with its gradients computed in the
    forward pass. Each chunk's logits give its loss, entropy and softmax, and at once the gradients of the loss
    with respect to the head's params (summed over chunks in float32; only the params that are differentiated:
    a frozen or LoRA base head costs no weight gradient) and to the chunk's hidden states; the backward pass only
    scales those by the loss's cotangent. No `[b, S, V]` array is ever held and no head matmul is recomputed (the
    fused linear cross-entropy of Liger-Kernel, MaxText's vocabulary tiling without its recompute). Per position
    the numbers are `head_xent`'s; the head's gradient is summed chunk by chunk (tests/test_logits_chunk.py)."""
    return _chunked(head, params, h, targets, chunk)


def _fused_fwd(head, params, h, targets, chunk):
    value = lambda x: x.value                                                          # noqa: E731
    is_primal = lambda x: isinstance(x, jax.custom_derivatives.CustomVJPPrimal)         # noqa: E731
    live = jax.tree.map(lambda x: x.perturbed, params, is_leaf=is_primal)
    total, ent, d_params, d_h = _chunked(head, jax.tree.map(value, params, is_leaf=is_primal), h.value,
                                         targets.value, chunk, live)
    return (total, ent), (d_params, d_h)


def _fused_bwd(head, chunk, res, g):
    d_params, d_h = res
    scale = lambda x: (g[0] * x).astype(x.dtype)                                        # noqa: E731
    return jax.tree.map(scale, d_params), scale(d_h), None


fused_head_xent.defvjp(_fused_fwd, _fused_bwd, symbolic_zeros=True)


def loss_and_entropy(cfg: Config, model, h: jax.Array, targets: jax.Array):
    """(Σ cross-entropy over learned targets, entropy [b, S]) of the loss pass: `fused_head_xent` when
    `fused(cfg)`, in chunks of `train.logits_chunk` positions or else of `FUSED_TOKENS` tokens; `head_xent`
    otherwise."""
    chunk = cfg.train.logits_chunk
    if not fused(cfg):
        loss, ent = head_xent(model, h, targets, chunk)
        return jnp.sum(loss), ent
    graphdef, params = nnx.split(model.head_module())

    def head(p, x):
        return head_logits(nnx.merge(graphdef, p), x).astype(jnp.float32)
    return fused_head_xent(head, params, h, targets, min(chunk or max(1, FUSED_TOKENS // h.shape[0]), h.shape[1]))


def _micro_loss(params, cfg: Config, mb: Batch, targets):
    """Summed cross-entropy over learned targets (≥ 0: not IGNORE, not NO_LOSS), and code statistics (sums) of
    the last pass."""
    model, h, _ = _last_pass(cfg, params, mb, targets, cfg.train.remat)
    sup = targets >= 0
    loss_sum, ent = loss_and_entropy(cfg, model, h, targets)
    frac = codes_from_entropy(jax.lax.stop_gradient(ent), cfg.model.text.vocab_size, cfg.model.n_bits)
    frac = frac.astype(jnp.float32) / (cfg.model.n_levels - 1)
    s = sup.astype(jnp.float32)
    stats = {"code_sum": jnp.sum(frac * s), "code_low": jnp.sum((frac < LOW) * s),
             "code_high": jnp.sum((frac > HIGH) * s)}
    return loss_sum, stats


def compute_params(cfg: Config, params: dict, frozen: dict) -> dict:
    """The params the forward sees: frozen leaves stop-gradient'd, all cast to the compute dtype."""
    dt = jnp.dtype(cfg.train.compute_dtype)
    return jax.tree.map(lambda p, f: (jax.lax.stop_gradient(p) if f else p).astype(dt), params, frozen)


def grads_and_stats(cfg: Config, params: dict, batch: TrainBatch, base: dict | None = None):
    """Mean-over-tokens loss gradients (float32) of `params` accumulated over the micro-batches, and summed
    statistics; with LoRA `params` are the trained leaves and `base` the rest (no gradient)."""
    frozen = frozen_mask(cfg, params)
    n_tok = jnp.sum(batch.targets >= 0).astype(jnp.float32)

    def f(p, mb, tg):
        p = compute_params(cfg, p, frozen)
        return _micro_loss(p if base is None else combine(p, base), cfg, mb, tg)

    def body(carry, i):
        g_acc, l_acc, st_acc = carry
        mb, tg = micro(batch, i)
        (l, st), g = jax.value_and_grad(f, has_aux=True)(params, mb, tg)
        return (jax.tree.map(jnp.add, g_acc, g), l_acc + l, jax.tree.map(jnp.add, st_acc, st)), None

    zeros = jax.tree.map(jnp.zeros_like, params)
    st0 = {k: jnp.zeros((), jnp.float32) for k in ("code_sum", "code_low", "code_high")}
    (g, loss_sum, st), _ = jax.lax.scan(body, (zeros, jnp.zeros((), jnp.float32), st0),
                                        jnp.arange(batch.input_ids.shape[0]))
    denom = jnp.maximum(n_tok, 1.0)
    g = jax.tree.map(lambda x: x / denom, g)
    return g, loss_sum / denom, n_tok, st


def skip_nonfinite(loss, grad_norm, new: tuple, old: tuple, metrics: dict):
    """(params, optimizer state) = `new` if the loss and the gradient norm are finite, else `old`, chosen on the
    device (a select per leaf, fused into the update: no host sync, no branch), and the metrics with `skipped`
    (int32 0/1) and `param_norm` (the global norm of the params returned, which the loop checks before saving).

    A NaN or inf anywhere in the gradients makes their global norm non-finite, so this one scalar guards every
    leaf. The whole optimizer state is kept (Adam's moments and its count, hence the schedule's position too),
    as `optax.apply_if_finite` does, without its extra state: checkpoints keep their tree. The step counter and
    the RNG still advance (train_step), so data, RNG and resume stay aligned with the step number."""
    ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    params, opt_state = jax.tree.map(lambda a, b: jnp.where(ok, a, b), new, old)
    return params, opt_state, {**metrics, "skipped": (~ok).astype(jnp.int32),
                               "param_norm": optax.tree.norm(params)}


def make_train_step(cfg: Config, params_like: dict | None = None):
    """`train_step(state, batch) -> (state, metrics)` for this config (pure; jit it, donating the state)."""
    tx = None if params_like is None else make_optimizer(cfg, params_like)
    sched = schedule(cfg)

    def train_step(state: TrainState, batch: TrainBatch, base: dict | None = None):
        opt = tx or make_optimizer(cfg, state.params)
        g, loss, n_tok, st = grads_and_stats(cfg, state.params, batch, base)
        trainable = jax.tree.map(lambda x, f: jnp.zeros_like(x) if f else x, g, frozen_mask(cfg, g))
        updates, opt_state = opt.update(g, state.opt_state, state.params)
        params = jax.tree.map(lambda new, old, f: old if f else new, optax.apply_updates(state.params, updates),
                              state.params, frozen_mask(cfg, state.params))
        n = jnp.maximum(n_tok, 1.0)
        grad_norm = optax.global_norm(trainable)
        metrics = {"loss": loss, "grad_norm": grad_norm, "lr": sched(state.step),
                   "tokens": n_tok, "code_mean": st["code_sum"] / n, "code_low": st["code_low"] / n,
                   "code_high": st["code_high"] / n}
        if cfg.train.max_bad_steps is not None:     # null: the program is the one without the check
            params, opt_state, metrics = skip_nonfinite(loss, grad_norm, (params, opt_state),
                                                        (state.params, state.opt_state), metrics)
        rng, _ = jax.random.split(state.rng)
        return TrainState(state.step + 1, params, opt_state, rng), metrics

    return train_step
