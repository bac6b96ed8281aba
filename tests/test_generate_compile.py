"""The decode loop is one compiled program: compilations and host round trips do not grow with
max_new_tokens, prompt lengths in one bucket share a program, and bad input fails before any compile."""
import numpy as np
import pytest

from hf_tiny import build_model, save_checkpoint, tiny_hf_config
from prisma_jax import PrismaVL
from prisma_jax.infer import generate as G


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    hf = build_model(tiny_hf_config(text_layers=2, vision_depth=2, deepstack=(1,)), seed=4)
    return PrismaVL.from_pretrained(save_checkpoint(hf, str(tmp_path_factory.mktemp("c"))))


def _ids(n, b=2, seed=0):
    return np.random.default_rng(seed).integers(7, 128, (b, n))


def test_one_program_per_bucket_and_no_growth_with_max_new_tokens(model, monkeypatch):
    calls = {"prefill": 0, "decode": 0}
    prefill, decode = G.prefill, G.decode       # the jitted programs (their compile caches are counted)
    for name in calls:
        fn = getattr(G, name)

        def counted(*a, _fn=fn, _name=name, **k):
            calls[_name] += 1
            return _fn(*a, **k)
        monkeypatch.setattr(G, name, counted)

    def run(n, new):
        before = (prefill._cache_size(), decode._cache_size())
        calls.update(prefill=0, decode=0)
        r = model.generate(_ids(n), max_new_tokens=new, prompt_floor=8, new_floor=8)
        assert r.tokens.shape == (2, new)      # no eos: every row runs to max_new_tokens
        after = (prefill._cache_size(), decode._cache_size())
        # one dispatch of each program per call, whatever the number of tokens
        assert calls == {"prefill": 1, "decode": 1}
        return after[0] - before[0], after[1] - before[1]

    assert run(9, 2) == (1, 1)                 # prompt bucket 16, new bucket 8: compiles both programs
    assert run(13, 8) == (0, 0)                # same buckets, 4× the tokens: nothing new
    assert run(16, 5) == (0, 0)
    assert run(11, 32) == (1, 1)               # new bucket 32: one more of each, not one per token
    assert run(10, 20) == (0, 0)
    assert run(17, 2) == (1, 1)                # prompt bucket 32


BAD = [
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(max_new_tokens=2.5), "max_new_tokens"),
    (dict(max_new_tokens=4090), "maximum length"),      # 9 + 4090 > 4096 = max_position_embeddings
    (dict(temperature=-0.1), "temperature"),
    (dict(temperature=1.0, top_p=0.0), "top_p"),
    (dict(temperature=1.0, top_p=1.5), "top_p"),
    (dict(temperature=1.0, top_k=-1), "top_k"),
    (dict(eos_token_id=[3, 500]), "eos_token_id"),
    (dict(input_ids=np.array([[1, 2, 300]])), "outside the vocabulary"),
    (dict(input_ids=np.array([[1, 2, 3]]), attention_mask=np.array([[1, 1, 0]])), "left-padded"),
    (dict(input_ids=np.array([[1, 2, 3, 4]]), attention_mask=np.array([[1, 0, 1, 1]])), "left-padded"),   # a gap
]


@pytest.mark.parametrize("kw,match", BAD, ids=[b[1] + str(i) for i, b in enumerate(BAD)])
def test_bad_input_fails_before_compiling(model, kw, match):
    kw = {"input_ids": _ids(9, b=1), **kw}
    before = (G.prefill._cache_size(), G.decode._cache_size())
    with pytest.raises(ValueError, match=match):
        model.generate(**kw)
    assert (G.prefill._cache_size(), G.decode._cache_size()) == before


def test_bucket():
    assert [G.bucket(n, 16) for n in (1, 16, 17, 100, 128, 129)] == [16, 16, 32, 128, 128, 256]


def test_plan_lowers_the_decode_program_generate_runs(model, monkeypatch):
    """`prisma plan` compiles generate.decode itself, on arguments shaped and typed like the ones `generate`
    passes it after a real prefill."""
    import jax

    from prisma_jax.apps import plan as PL
    from prisma_jax.parallel.mesh import make_mesh

    cfg = model.config
    p = G.request(cfg, G.Inputs(_ids(9)), options=G.Options(max_new_tokens=4, prompt_floor=8, new_floor=8, unroll_layers=False))
    state = G.prefill(cfg, p.spec, model.params, p.batch, p.next_pos, p.sp, p.eos, p.pad, jax.random.key(0))
    real = (model.params, state, p.sp, p.eos, p.pad, p.max_new)
    mesh = make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, jax.devices()[:1])
    b, slots = state.tokens.shape[0], state.state.cache.k.shape[3]   # 2 rows, 16 prompt + 8 new slots
    planned = PL.decode_args(cfg, mesh, b, slots, "float32", p.spec)
    kind = lambda x: (tuple(np.shape(x)), str(x.dtype))      # noqa: E731
    assert jax.tree.structure(planned) == jax.tree.structure(real)
    assert jax.tree.leaves(jax.tree.map(kind, planned)) == jax.tree.leaves(jax.tree.map(kind, real))

    lowered = []

    class Spy:                                                # generate.decode, recording what is lowered
        def lower(self, *a):
            lowered.append(a[:2])
            return decode.lower(*a)
    decode = G.decode
    monkeypatch.setattr(G, "decode", Spy())
    hlo = PL.lower_decode(cfg, mesh, b, slots, "float32", p.spec).as_text()
    assert lowered == [(cfg, p.spec)] and "while" in hlo
