"""Tunix (google-tunix 0.1.7) drives Prisma-VL through `prisma_jax.integrations.tunix.PrismaTunix`, unchanged on Tunix's side:
its `Sampler` against `PrismaVL.generate` (text and image prompts: tokens, and every step's logits, which a
wrong uncertainty code would change), its `PeftTrainer` against `PrismaVL.forward` (the first loss) and against
the params it must not touch (bit equality)."""
import jax
import numpy as np
import optax
import pytest
import tunix

import jax.numpy as jnp
from hf_tiny import image_tokens, random_pixels
from prisma_jax import PrismaVL
from prisma_jax.nn.lora import LoraSpec, is_adapter, merge
from prisma_jax.nn.model import to_params
from prisma_jax.nn.params import TABLE_PATH
from prisma_jax.core.trees import flatten
from prisma_jax.nn.rope import rope_index
from prisma_jax.integrations.tunix import PrismaTunix, loss_fn, model_input_fn, rope_positions
from prisma_jax.nn.uncertainty import codes_from_logits, prompt_codes, shift_codes

PAD, EOS = 0, 1
GRID = (1, 4, 6)
STEPS = 8
LR = 1e-2


class IntTokenizer:
    """Tunix's tokenizer protocol over space-separated ids (no BOS)."""
    def encode(self, s, **_):
        return [int(x) for x in s.split()]

    def decode(self, ids, **_):
        return " ".join(str(int(i)) for i in ids)

    def bos_id(self):
        return None

    def eos_id(self):
        return EOS

    def pad_id(self):
        return PAD


@pytest.fixture(scope="module")
def prisma():
    # the fresh normal(0, 0.02) table: large enough against this tiny model's weights that the codes decide tokens
    return PrismaVL.from_config("configs/tiny.yaml", seed=3)


def _left_pad(rows):
    s = max(len(r) for r in rows)
    ids, mask = np.full((len(rows), s), PAD, np.int64), np.zeros((len(rows), s), np.int64)
    for i, r in enumerate(rows):
        ids[i, s - len(r):], mask[i, s - len(r):] = r, 1
    return ids, mask


def _sampler(model):
    c = model.config
    return tunix.Sampler(model, IntTokenizer(), tunix.CacheConfig(cache_size=64, num_layers=c.num_layers,
                                                                  num_kv_heads=c.num_kv_heads, head_dim=c.head_dim))


def _same_as_generate(out, ref):
    """Tunix's tokens stop before the end token, generate's include it; logits of every step agree."""
    for i, toks in enumerate(out.tokens):
        n = int(ref.lengths[i])
        want = ref.tokens[i, :n]
        want = want[:-1] if want[-1] == EOS else want
        assert np.asarray(toks).tolist() == want.tolist(), (i, toks, want)
        assert PAD not in want.tolist()          # Tunix masks generated pad ids as padding: pick other prompts
        np.testing.assert_allclose(np.asarray(out.logits[i]), ref.logits[i, :len(toks)], atol=1e-5, rtol=0)


def test_sampler_greedy_equals_generate_on_text(prisma):
    rng = np.random.default_rng(0)
    rows = [list(rng.integers(7, 128, n)) for n in (9, 4, 13)]
    model = PrismaTunix.from_prisma(prisma)
    out = _sampler(model)([" ".join(map(str, r)) for r in rows], max_generation_steps=STEPS, eos_tokens=[EOS],
                          return_logits=True)
    ids, mask = _left_pad(rows)
    ref = prisma.generate(ids, mask, max_new_tokens=STEPS, eos_token_id=EOS, pad_token_id=PAD, return_logits=True)
    _same_as_generate(out, ref)
    # the test can see the mechanism: without the carried codes, generation goes elsewhere
    off = prisma.generate(ids, mask, max_new_tokens=STEPS, eos_token_id=EOS, pad_token_id=PAD, introspection=False)
    assert off.tokens.tolist() != ref.tokens.tolist()
    # get_model_input (the dummy input qwix's LoRA takes) runs the model: ones at position 0, no code
    logits, cache = model(**model.get_model_input())
    assert cache is None
    np.testing.assert_allclose(np.asarray(logits), np.asarray(prisma.forward(np.ones((2, 1), np.int64))), atol=1e-6)


def test_sampler_greedy_equals_generate_with_images(prisma):
    rows = [[20, 21, *image_tokens(GRID), 22], [30, *image_tokens(GRID), 31, 32, 33, 34, 40, 41, 42]]
    pv = random_pixels([GRID, GRID], seed=5)
    model = PrismaTunix.from_prisma(prisma, image_grid=GRID)
    out = _sampler(model)([" ".join(map(str, r)) for r in rows], max_generation_steps=STEPS, eos_tokens=[EOS],
                          return_logits=True, images=pv.reshape(2, -1, pv.shape[-1]))   # one image slot per row
    ids, mask = _left_pad(rows)
    ref = prisma.generate(ids, mask, pv, [GRID, GRID], max_new_tokens=STEPS, eos_token_id=EOS, pad_token_id=PAD,
                          return_logits=True)
    _same_as_generate(out, ref)
    # the positions the wrapper computes inside the trace are rope_index's (the host reference)
    pos, delta = rope_positions(prisma.config, jnp.asarray(ids), jnp.asarray(mask, bool), GRID)
    want, want_delta = rope_index(prisma.config, ids, mask, np.asarray([GRID, GRID]))
    np.testing.assert_array_equal(np.asarray(pos), want)
    np.testing.assert_array_equal(np.asarray(delta), want_delta)


def _sft_batch():
    """4 right-padded rows: random prompts, then the same 4-token answer (the loss mask)."""
    rng = np.random.default_rng(7)
    ids = np.full((4, 14), PAD, np.int32)
    loss_mask = np.zeros((4, 14), bool)
    for i, n in enumerate((5, 8, 3, 7)):
        row = [*rng.integers(7, 128, n), 50, 51, 52, 53]
        ids[i, :len(row)] = row
        loss_mask[i, n:len(row)] = True
    return ids, loss_mask


def _reference_loss(prisma, ids, loss_mask):
    """Two introspection passes (docs/introspection-contract.md §4) on PrismaVL.forward, NLL in NumPy."""
    real = ids != PAD
    bits = prisma.config.n_bits
    prev = codes_from_logits(prisma.forward(ids, real), bits)
    supervised = np.pad(loss_mask[:, 1:], ((0, 0), (0, 1)))
    codes = np.asarray(shift_codes(jnp.asarray(prompt_codes(real, bits)), prev, jnp.asarray(supervised)))
    z = np.asarray(prisma.forward(ids, real, codes_in=codes), np.float64)[:, :-1]
    logp = z - np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1, keepdims=True)) - z.max(-1, keepdims=True)
    nll = -np.take_along_axis(logp, ids[:, 1:, None].astype(np.int64), -1)[..., 0]
    w = loss_mask[:, 1:]
    return float((nll * w).sum() / w.sum())


def test_peft_trainer_trains_only_adapters_and_table(prisma):
    spec = LoraSpec(rank=4, alpha=8.0, targets=("q_proj", "v_proj", "down_proj"))
    model = PrismaTunix.from_prisma(prisma, lora=spec, seed=1)
    before = {p: np.array(x) for p, x in flatten(to_params(model.model))}
    ids, loss_mask = _sft_batch()
    gen = model_input_fn(PAD)(tunix.sft.peft_trainer.TrainingInput(input_tokens=ids, input_mask=loss_mask))
    # Tunix's own default loss runs on the wrapper too: one pass, the prompt rule (introspection_passes=1)
    one = PrismaTunix.from_prisma(prisma, introspection_passes=1)
    assert abs(float(tunix.sft.peft_trainer._default_loss_fn(one, **gen)) - float(loss_fn(one, **gen))) < 1e-6
    trainer = tunix.PeftTrainer(model, optax.adam(LR), tunix.TrainingConfig(eval_every_n_steps=1000, max_steps=16))
    trainer = trainer.with_loss_fn(loss_fn).with_gen_model_input_fn(model_input_fn(PAD))
    trainer.train([tunix.sft.peft_trainer.TrainingInput(input_tokens=ids, input_mask=loss_mask)] * 16)
    losses = trainer.metrics_logger.get_metric_history("", "loss", "train")

    assert len(losses) == 16
    # step 1 (B = 0: the adapted model is the base) is the loss of two passes of PrismaVL.forward
    assert abs(float(losses[0]) - _reference_loss(prisma, ids, loss_mask)) < 1e-5
    assert losses[-1] < 0.85 * losses[0], losses    # 0.78: the frozen std-0.02 head bounds the fall

    after = dict(flatten(to_params(model.model)))
    assert after.keys() == before.keys()
    trained = [p for p in before if is_adapter(p) or p == TABLE_PATH]
    assert len(trained) == 1 + 2 * len(spec.targets)
    for p, x in before.items():
        if p in trained:
            assert not np.array_equal(np.asarray(after[p]), x), p
        else:
            assert np.asarray(after[p]).tobytes() == x.tobytes(), p       # bit for bit

    # what Tunix trained is our LoRA: the merged params (lora.merge) give the wrapper's logits
    params = to_params(model.model)
    merged = PrismaVL(prisma.config, jax.tree.map(jnp.asarray, merge(params, spec)))
    logits, _ = model(gen["input_tokens"], gen["positions"], None, gen["attention_mask"])
    real = ids != PAD                                                      # padding rows' masks differ
    np.testing.assert_allclose(np.asarray(logits)[real], np.asarray(merged.forward(ids, real))[real], atol=1e-5)
