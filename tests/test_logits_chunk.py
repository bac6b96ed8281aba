"""`train.logits_chunk` and `train.fused_loss`: the head and the loss computed over sequence chunks (train/step.py
`head_xent`; `fused_head_xent`, gradients computed in the forward) give the numbers of the whole-sequence logits —
each chunked head against torch, then a train step's codes (bit for bit), loss, code statistics and gradients
against `logits_chunk: 0` without the fused loss (untied and tied heads, LoRA, a chunk that does not divide the
sequence), then a `prisma train` run."""
import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from prisma_jax.core.config import ConfigError
from train.flops import step_flops
from prisma_jax.nn.params import init_params_numpy
from test_train_step import TINY, make_cfg, samples
from train import step as S
from train.config import config_from_raw
from train.data import Collate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Head:
    """The one thing `head_xent` asks of a model: `head(h)` = h · W."""

    def __init__(self, w):
        self.w = w

    def head(self, h):
        return h @ self.w


def test_chunked_head_xent_equals_torch():
    """Per-position cross-entropy, entropy and the gradients of Σ weight·loss with respect to the hidden states and
    the head, in chunks of 5 over 13 positions (the last chunk padded), against torch in float64."""
    rng = np.random.default_rng(0)
    h = rng.normal(size=(2, 13, 16)).astype(np.float32)
    w = (rng.normal(size=(16, 41)) * 0.8).astype(np.float32)
    t = rng.integers(-1, 41, (2, 13)).astype(np.int32)
    wt = rng.normal(size=(2, 13)).astype(np.float32)

    def f(h, w):
        loss, ent = S.head_xent(Head(w), h, jnp.asarray(t), chunk=5)
        return jnp.sum(jnp.asarray(wt) * loss), (loss, ent)
    (_, (loss, ent)), (gh, gw) = jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))(h, w)

    ht, wt_ = (torch.tensor(x, dtype=torch.float64, requires_grad=True) for x in (h, w))
    z = ht @ wt_
    ce = torch.nn.functional.cross_entropy(z.reshape(-1, 41), torch.tensor(t.reshape(-1)).long().clamp(min=0),
                                           reduction="none").reshape(2, 13) * torch.tensor(t >= 0)
    (ce * torch.tensor(wt, dtype=torch.float64)).sum().backward()
    p = torch.softmax(z.detach(), -1)
    np.testing.assert_allclose(np.asarray(loss), ce.detach().numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(ent), -(p * torch.log(p)).sum(-1).numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(gh), ht.grad.numpy(), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.asarray(gw), wt_.grad.numpy(), rtol=1e-4, atol=1e-5)
    assert (np.asarray(loss)[t < 0] == 0).all()


def test_fused_head_xent_equals_torch():
    """`fused_head_xent` (gradients computed in the forward, chunks of 5 over 13 positions, the last padded): the
    summed loss, the entropies and the gradients with respect to the hidden states and the head against torch in
    float64, scaled by a cotangent of 3; without differentiation the same numbers; with the head frozen
    (stop-gradient'd: no weight gradient is computed) the hidden states' gradient is unchanged."""
    rng = np.random.default_rng(1)
    h = rng.normal(size=(2, 13, 16)).astype(np.float32)
    w = (rng.normal(size=(16, 41)) * 0.8).astype(np.float32)
    t = rng.integers(-2, 41, (2, 13)).astype(np.int32)

    def head(p, x):
        return (x @ p["w"]).astype(jnp.float32)

    def f(h, w, frozen=False):
        p = {"w": jax.lax.stop_gradient(w) if frozen else w}
        total, ent = S.fused_head_xent(head, p, h, jnp.asarray(t), 5)
        return 3.0 * total, (total, ent)
    (_, (total, ent)), (gh, gw) = jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))(h, w)
    gh_frozen, gw_frozen = jax.jit(jax.grad(lambda h, w: f(h, w, True)[0], argnums=(0, 1)))(h, w)
    total_nograd, ent_nograd = jax.jit(lambda h, w: f(h, w)[1])(h, w)

    ht, wt_ = (torch.tensor(x, dtype=torch.float64, requires_grad=True) for x in (h, w))
    z = ht @ wt_
    ce = torch.nn.functional.cross_entropy(z.reshape(-1, 41), torch.tensor(t.reshape(-1)).long().clamp(min=0),
                                           reduction="none").reshape(2, 13) * torch.tensor(t >= 0)
    (3.0 * ce.sum()).backward()
    p = torch.softmax(z.detach(), -1)
    np.testing.assert_allclose(float(total), float(ce.sum()), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(ent), -(p * torch.log(p)).sum(-1).numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(gh), ht.grad.numpy(), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.asarray(gw), wt_.grad.numpy(), rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(gh_frozen), np.asarray(gh))
    assert not np.asarray(gw_frozen).any()
    np.testing.assert_allclose(float(total_nograd), float(total), rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(ent_nograd), np.asarray(ent))


def _case_cfg(case: str, chunk: int, fused: bool = False):
    if case == "tied":
        raw = {"model": {**TINY, "tie_word_embeddings": True},
               "train": {"steps": 10, "batch_size": 8, "seq_len": 24, "grad_accum": 2, "logits_chunk": chunk,
                         "fused_loss": fused},
               "optimizer": {"lr": 1e-2}, "data": {"source": "synthetic", "image_size": 64, "max_images": 1}}
        return config_from_raw(raw)
    extra = {"lora": {"rank": 4, "alpha": 8.0, "targets": ["q_proj", "v_proj", "down_proj", "qkv"]}} \
        if case == "lora" else {}
    return make_cfg(grad_accum=2, introspection_passes=3, logits_chunk=chunk, fused_loss=fused, **extra)


def _step_numbers(cfg, batch, params, base):
    """(the codes the last pass of micro-batch 0 is fed, loss, code statistics, gradients) of one step."""
    mb, tg = S.micro(batch, 0)
    merged = params if base is None else S.combine(params, base)
    codes = jax.jit(lambda p, b, t: S.training_logits(cfg, p, b, t)[1])(merged, mb, tg)
    g, loss, _, st = jax.jit(lambda p, b, q: S.grads_and_stats(cfg, p, b, q))(params, batch, base)
    return np.asarray(codes), float(loss), {k: float(v) for k, v in st.items()}, g


@functools.lru_cache(maxsize=1)
def _whole(case):
    """The case's batch, params, base and whole-logits step numbers (shared by both untied chunks)."""
    cfg0 = _case_cfg(case, 0)
    batch = Collate(cfg0, 8)(samples())
    if case == "lora":
        state, base = S.init_lora(cfg0)
        params = state.params
        # adapters' B starts at zero: give it values, so the adapters change the logits and the gradients
        params = jax.tree_util.tree_map_with_path(
            lambda p, x: x + 0.05 if getattr(p[-1], "key", "") == "lora_b" else x, params)
        base = {**base, "lm_head": {"kernel": base["lm_head"]["kernel"] * 40.0}}
    else:
        params, base = init_params_numpy(cfg0.model, seed=0), None
        head = params["text"]["embed"]["embedding"] if case == "tied" else params["lm_head"]["kernel"]
        head *= 4.0 if case == "tied" else 40.0      # tied: the table is the input embedding too
        params = jax.tree.map(jnp.asarray, params)
    return batch, params, base, _step_numbers(cfg0, batch, params, base)


@pytest.mark.parametrize("case,chunk,fused", [
    ("untied", 8, False), ("untied", 7, False), ("tied", 5, False), ("lora", 7, False),
    ("untied", 7, True), ("tied", 5, True), ("lora", 7, True)])
def test_chunked_step_equals_whole_logits(case, chunk, fused):
    """Codes bit for bit (P = 3: the chunked codes of pass 2 feed pass 3), the loss within 1e-6 relative, every
    gradient leaf within 2e-6 relative to the leaf's largest entry (measured up to 1.04e-6, the vision LoRA's B
    on an AVX2 CPU: the hidden states' gradient reaches it through every layer), the code statistics exactly. S = 24: chunks of 8 divide
    it, of 7 and 5 do not (the last chunk is padded). The head is scaled ×40 (a tied one ×4) so that next-token
    distributions are peaked and the codes vary from position to position (random init gives near-uniform ones:
    all L − 2)."""
    batch, params, base, (c0, l0, st0, g0) = _whole(case)
    cc, lc, stc, gc = _step_numbers(_case_cfg(case, chunk, fused), batch, params, base)
    assert (c0 >= 0).sum() > 0 and len(np.unique(c0[c0 >= 0])) > 3        # real, varied codes
    np.testing.assert_array_equal(cc, c0)
    assert abs(lc - l0) <= 1e-6 * abs(l0), (lc, l0)
    assert stc == st0
    leaves = jax.tree_util.tree_flatten_with_path(g0)[0]
    assert len(leaves) == len(jax.tree.leaves(gc))
    nonzero = 0
    for (path, a), b in zip(leaves, jax.tree.leaves(gc)):
        a, b = np.asarray(a), np.asarray(b)
        scale = np.max(np.abs(a))
        nonzero += scale > 0
        assert np.max(np.abs(a - b)) <= 2e-6 * scale, (jax.tree_util.keystr(path), np.max(np.abs(a - b)), scale)
    assert nonzero >= len(leaves) // 2


def test_logits_chunk_must_not_be_negative():
    with pytest.raises(ConfigError, match=r"train\.logits_chunk must be ≥ 0"):
        make_cfg(logits_chunk=-1)
    with pytest.raises(ConfigError, match=r"train\.fused_loss: expected true/false, got 'yes'"):
        make_cfg(fused_loss="yes")


def test_train_loop_with_chunks_equals_whole_logits(tmp_path):
    """`prisma train` on tiny_sft (images, P = 2) for 4 steps, seq 40 in chunks of 16 (the last padded; the fused
    loss, the CPU's default), against the same run on whole logits without it: every logged metric equal within
    1e-6 relative (measured: losses and code statistics bit for bit, grad_norm within 6e-8: the head's gradient
    is summed chunk by chunk)."""
    from prisma_jax.apps.cli import main as cli

    def metrics(chunk):
        wd = str(tmp_path / f"c{chunk}")
        assert cli(["train", "--config", os.path.join(ROOT, "configs", "tiny_sft.yaml"), "--workdir", wd,
                    "--no-progress", "train.steps=4", "train.batch_size=4", "train.seq_len=40",
                    f"train.logits_chunk={chunk}", f"train.fused_loss={'false' if chunk == 0 else 'null'}",
                    "checkpoint.asynchronous=false"]) == 0
        with open(os.path.join(wd, "metrics.jsonl")) as f:
            return [json.loads(line) for line in f]
    a, b = metrics(0), metrics(16)
    assert [m["step"] for m in a] == [m["step"] for m in b] == [1, 2, 3, 4]
    for k in ("loss", "grad_norm", "code_mean", "code_low", "code_high", "tokens", "lr"):
        np.testing.assert_allclose([m[k] for m in b], [m[k] for m in a], rtol=1e-6, err_msg=k)
    assert a[-1]["loss"] < a[0]["loss"]


def test_plan_prints_the_option():
    """`prisma plan`'s training line names the chunk, or says the logits are whole (0, or a chunk ≥ seq)."""
    from prisma_jax.apps import plan
    from prisma_jax.parallel.mesh import MeshSpec, Preset
    p = Preset("fake-1", 1, 95, None, None, MeshSpec(1, 1, 1), MeshSpec(1, 1, 1))
    tiny = os.path.join(ROOT, "configs", "tiny.yaml")
    for chunk, want in [(512, "logits chunk 512 tokens"), (0, "logits chunk off (whole sequence)"),
                        (2048, "logits chunk off (whole sequence)")]:
        cfg = plan.train_config(tiny, 1, 1024, [f"train.logits_chunk={chunk}"], images=0)
        r = {"mesh": "data=1 fsdp=1 tensor=1", "batch": 1, "seq": 1024, "memory": plan.Memory(1, 0, 0, 0, 0),
             "flops": step_flops(cfg), "fits": True, "seconds": 0.0}
        assert want in plan.format_train(r, p, cfg)
