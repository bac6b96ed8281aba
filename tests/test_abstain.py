"""Abstention at generation (`abstain_above=τ`) and `return_logprobs`, against the same model's run without
abstention: a row stops at its first token whose code exceeds τ (that token kept as its last, like an end
token), everything before it and every other row unchanged bit for bit; τ is data; the CLI flags; bad τ."""
import json

import jax
import numpy as np
import pytest
import torch

from hf_tiny import build_model, save_checkpoint, tiny_hf_config
from prisma_jax import PrismaVL
from prisma_jax.infer import generate as G
from prisma_jax.apps.cli import main
from prisma_jax.host.processing import Processor, build_tokenizer

STEPS = 16
LEVELS = 256     # the checkpoint's 8-bit table
PROMPTS = ["w1 w2 w3", "w4", "w7 w9", "w10 w11 w12 w13", "w20 w3"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A tiny checkpoint with its offline tokenizer; lm_head × 30 makes its distributions peaked and its codes
    spread over the levels (a random head's are all ≈ 254, so no τ would separate the rows)."""
    d = str(tmp_path_factory.mktemp("abstain"))
    build_tokenizer(d, [f"w{i}" for i in range(115)])
    hf = build_model(tiny_hf_config(text_layers=2, vision_depth=2, deepstack=(1,)), seed=6)
    with torch.no_grad():
        hf.lm_head.weight.mul_(30.0)
    save_checkpoint(hf, d, table=np.random.default_rng(0).normal(0, 0.3, (LEVELS, 64)).astype(np.float32))
    proc = Processor.from_pretrained(d)
    enc = proc(messages=[[{"role": "user", "content": [{"type": "text", "text": t}]}] for t in PROMPTS])
    return d, PrismaVL.from_pretrained(d), proc, enc


def _generate(ckpt, **kw):
    _, m, _, enc = ckpt
    return m.generate(enc["input_ids"], enc["attention_mask"], max_new_tokens=STEPS,
                      **{"return_entropies": True, "return_logprobs": True, **kw})


@pytest.fixture(scope="module")
def free(ckpt):
    """The reference: no abstention, no end token (every row runs STEPS tokens)."""
    r = _generate(ckpt)
    assert r.lengths.tolist() == [STEPS] * len(PROMPTS)
    assert not r.abstained.any() and (r.abstain_step == -1).all()
    return r


def _first_above(codes, lengths, tau):
    """Per row, the first step whose code exceeds τ within its length, else −1."""
    out = []
    for c, n in zip(codes, lengths):
        hit = np.flatnonzero(c[:n].astype(int) > tau)
        out.append(int(hit[0]) if len(hit) else -1)
    return np.array(out)


def _split_tau(ref):
    """A τ that some rows never exceed while others do, after their first step: the smallest row maximum
    that another row's codes exceed."""
    for tau in sorted({int(c[:n].max()) for c, n in zip(ref.codes, ref.lengths)}):
        first = _first_above(ref.codes, ref.lengths, tau)
        if (first == -1).any() and (first > 0).any():
            return tau, first
    raise AssertionError(f"no τ separates these rows: {ref.codes}")


def _taus(free):
    tau, _ = _split_tau(free)
    assert 1 <= free.codes[:, 0].min()
    return {"some-rows": tau, "first-step": int(free.codes[:, 0].min()) - 1, "never": LEVELS - 1}


@pytest.mark.parametrize("which", ["some-rows", "first-step", "never"])
def test_rows_stop_at_their_first_code_above_tau(ckpt, free, which):
    tau = _taus(free)[which]
    r = _generate(ckpt, abstain_above=tau)
    first = _first_above(free.codes, free.lengths, tau)
    assert r.abstained.tolist() == (first >= 0).tolist() and r.abstain_step.tolist() == first.tolist()
    if which == "some-rows":
        assert (first == -1).any() and (first > 0).any()
    if which == "first-step":
        assert (first == 0).any()                              # decided in prefill, before the loop
    for i, k in enumerate(first):
        n = STEPS if k < 0 else k + 1                          # the abstaining token is the row's last
        assert r.lengths[i] == n
        for name in ("tokens", "codes", "entropies", "logprobs"):   # bit for bit up to and including it
            np.testing.assert_array_equal(getattr(r, name)[i, :n], getattr(free, name)[i, :n], err_msg=name)
            assert (getattr(r, name)[i, n:] == 0).all(), name     # pad id 0 (no end token), code 0, ...
    assert r.tokens.shape[1] == r.lengths.max()
    if which == "never":                                       # τ = L − 1: the run without abstention
        for name in ("tokens", "codes", "lengths", "entropies", "logprobs", "abstained", "abstain_step"):
            np.testing.assert_array_equal(getattr(r, name), getattr(free, name), err_msg=name)


def test_tau_is_data_not_a_program(ckpt, free):
    taus = list(_taus(free).values())
    _generate(ckpt, abstain_above=taus[0])
    before = (G.prefill._cache_size(), G.decode._cache_size())
    for tau in taus[1:]:
        _generate(ckpt, abstain_above=tau)
    assert (G.prefill._cache_size(), G.decode._cache_size()) == before


def test_texts_put_the_abstention_text_in_place(ckpt, free):
    _, _, proc, _ = ckpt
    tau, first = _split_tau(free)
    for kw, text in [({}, "I don't know"), ({"abstain_text": "no idea"}, "no idea")]:
        r = _generate(ckpt, abstain_above=tau, **kw)
        assert r.texts(proc) == [text if k >= 0 else proc.decode(free.tokens[i]) for i, k in enumerate(first)]
    assert free.texts(proc) == proc.batch_decode(free.tokens)


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_logprobs_are_the_log_softmax_of_the_logits(ckpt, free, temperature):
    """Each token's log-probability under the logits it was drawn from (not the sampling distribution)."""
    r = _generate(ckpt, abstain_above=_split_tau(free)[0], return_logits=True, temperature=temperature, seed=3)
    z = r.logits.astype(np.float64)
    ref = np.take_along_axis(z - np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1, keepdims=True))
                             - z.max(-1, keepdims=True), r.tokens[..., None], -1)[..., 0]
    for i, n in enumerate(r.lengths):
        np.testing.assert_allclose(r.logprobs[i, :n], ref[i, :n], atol=2e-5, rtol=0)
        assert (r.logprobs[i, n:] == 0).all()
    assert r.abstained.any() and np.all(r.logprobs <= 0)
    assert _generate(ckpt, return_logprobs=False).logprobs is None


def test_cli_flags_match_the_api(ckpt, capsys):
    d, m, proc, enc = ckpt
    eos = proc.ids["eos_token_id"]
    ref = m.generate(enc["input_ids"], enc["attention_mask"], max_new_tokens=STEPS, eos_token_id=eos)
    tau, _ = _split_tau(ref)
    api = m.generate(enc["input_ids"], enc["attention_mask"], max_new_tokens=STEPS, eos_token_id=eos,
                     abstain_above=tau, abstain_text="no idea")
    assert api.abstained.any() and not api.abstained.all()
    argv = ["generate", "--model", d, *[a for p in PROMPTS for a in ("--prompt", p)],
            "--max-new-tokens", str(STEPS), "--abstain-above", str(tau), "--abstain-text", "no idea"]
    assert main([*argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [o["text"] for o in out] == api.texts(proc)
    assert [o["abstained"] for o in out] == api.abstained.tolist()
    assert [o["abstain_step"] for o in out] == api.abstain_step.tolist()
    assert [o["tokens"] for o in out] == [t[:n].tolist() for t, n in zip(api.tokens, api.lengths)]
    assert main(argv) == 0
    assert capsys.readouterr().out.splitlines() == api.texts(proc)
    assert main(argv[:-4] + ["--json"]) == 0                     # without the flags: nobody abstains
    assert all(not o["abstained"] and o["abstain_step"] == -1 for o in json.loads(capsys.readouterr().out))


BAD = [(dict(abstain_above=LEVELS), r"integer code in \[0, 255\]"), (dict(abstain_above=-1), "abstain_above"),
       (dict(abstain_above=2.5), "abstain_above"), (dict(abstain_above=True), "abstain_above"),
       (dict(abstain_above=3, introspection=False), "introspection"), (dict(abstain_text=3), "abstain_text")]


@pytest.mark.parametrize("kw,match", BAD, ids=[str(b[0]) for b in BAD])
def test_bad_abstention_fails_before_compiling(ckpt, kw, match):
    _, m, _, enc = ckpt
    before = (G.prefill._cache_size(), G.decode._cache_size())
    with pytest.raises(ValueError, match=match):
        m.generate(enc["input_ids"], enc["attention_mask"], **kw)
    assert (G.prefill._cache_size(), G.decode._cache_size()) == before


@pytest.mark.parametrize("tau", ["256", "-1"])
def test_cli_bad_tau_is_one_line(ckpt, capsys, tau):
    d = ckpt[0]
    assert main(["generate", "--model", d, "--prompt", "w1", "--abstain-above", tau]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "abstain_above" in err[0] and err[0].startswith("prisma generate: error:")


def test_abstention_off_adds_nothing_to_the_program(ckpt):
    """Without `abstain_above` the decode program carries no abstention state and no logprobs buffer."""
    _, m, _, enc = ckpt
    p = G.request(m.config, G.Inputs(enc["input_ids"], enc["attention_mask"]))
    assert not p.spec.abstain and not p.spec.keep_logprobs and p.abstain_above is None
    state = jax.eval_shape(lambda prm, b: G.prefill(m.config, p.spec, prm, b, p.next_pos, p.sp, p.eos, p.pad,
                                                    jax.random.key(0)), m.params, p.batch)
    assert state.abstain_step is None and state.logprobs is None
