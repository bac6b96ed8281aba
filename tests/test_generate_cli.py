"""`prisma generate`: an offline tokenizer + tiny checkpoint in one directory; the CLI's tokens and codes
equal `PrismaVL.generate` on the processor's inputs; bad input is one line and a non-zero exit."""
import json

import numpy as np
import pytest
from PIL import Image

from hf_tiny import build_model, save_checkpoint, tiny_hf_config
from prisma_jax import PrismaVL
from prisma_jax.apps.cli import main
from prisma_jax.host.processing import Processor, build_tokenizer


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("cli"))
    ids = build_tokenizer(d, [f"w{i}" for i in range(115)], min_pixels=64 * 64, max_pixels=64 * 96)
    assert ids["vocab_size"] == 128 and ids["image_token_id"] == 5          # the tiny config's ids
    hf = build_model(tiny_hf_config(text_layers=2, vision_depth=2, deepstack=(1,)), seed=6)
    save_checkpoint(hf, d, table=np.random.default_rng(0).normal(0, 0.3, (256, 64)).astype(np.float32))
    img = tmp_path_factory.mktemp("img") / "a.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (64, 96, 3), np.uint8)).save(img)
    return d, str(img)


@pytest.mark.parametrize("attention", ["auto", "pallas"])
def test_cli_json_matches_the_api(ckpt, capsys, attention):
    """The CLI (with the splash kernel in interpret mode too) against the API's default (XLA on this CPU)."""
    d, img = ckpt
    argv = ["generate", "--model", d, "--prompt", "w1 w2 w3", "--image", img, "--prompt", "w4",
            "--max-new-tokens", "6", "--json", "--attention", attention]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert [o["prompt"] for o in out] == ["w1 w2 w3", "w4"]

    proc = Processor.from_pretrained(d)
    conv = lambda t, im: [{"role": "user", "content": ([{"type": "image", "image": im}] if im else [])  # noqa: E731
                           + [{"type": "text", "text": t}]}]
    enc = proc(messages=[conv("w1 w2 w3", img), conv("w4", None)])
    assert (enc["input_ids"] == 5).sum() == 6                                  # 64×96 → grid 4×6 → 6 tokens
    ref = PrismaVL.from_pretrained(d).generate(enc["input_ids"], enc["attention_mask"], enc["pixel_values"],
                                               enc["image_grid_thw"], max_new_tokens=6, eos_token_id=2,
                                               return_entropies=True)
    for i, o in enumerate(out):
        n = int(ref.lengths[i])
        assert o["tokens"] == ref.tokens[i, :n].tolist()
        assert o["codes"] == ref.codes[i, :n].tolist()
        assert o["text"] == proc.decode(ref.tokens[i, :n])
        np.testing.assert_allclose(o["entropies"], ref.entropies[i, :n], atol=1e-5)


@pytest.mark.parametrize("extra,match", [
    (["--image", "MISSING"], "cannot read image"),
    (["--temperature", "-1"], "temperature"),
    (["--max-new-tokens", "0"], "max-new-tokens"),
    (["--top-p", "0"], "top_p"),
    (["--mesh", "bogus"], "--mesh 'bogus': expected a preset"),
    (["--mesh", "data=0"], "axis 'data' must be a positive integer"),
    (["--mesh", "data=--2"], "--mesh 'data=--2': expected a preset"),
    (["--abstain-text", "no idea"], "--abstain-text needs --abstain-above"),
])
def test_cli_bad_input_is_one_line(ckpt, capsys, extra, match, tmp_path):
    d, _ = ckpt
    extra = [str(tmp_path / "missing.png") if e == "MISSING" else e for e in extra]
    assert main(["generate", "--model", d, "--prompt", "w1", *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and match in err[0] and err[0].startswith("prisma generate: error:")


def test_cli_prints_nothing_on_stderr_on_a_machine_without_a_tpu(ckpt):
    """libtpu (installed for `prisma plan`) initialises silently here: a run's stderr is empty."""
    import os
    import subprocess
    import sys
    d, _ = ckpt
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TPU_", "JAX_PLATFORMS"))}
    run = subprocess.run([sys.executable, "-m", "prisma_jax.apps.cli", "generate", "--model", d, "--prompt", "w1 w2",
                          "--max-new-tokens", "3"], env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() and run.stderr == "", run.stderr
