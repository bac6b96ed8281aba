"""LoRA fine-tuning (`train.lora`): only the adapters and the table train, the base stays as it was bit for bit,
the run resumes bit-exactly, the merged export gives the adapted model's logits, and peft + transformers
read the adapter export to the same logits."""
import json
import os

import jax
import numpy as np
import pytest
import torch
import yaml

from hf_tiny import build_model, reference_logits, save_checkpoint, tiny_hf_config
from prisma_jax import PrismaVL
from prisma_jax.apps.cli import main as cli
from prisma_jax.core.config import ConfigError
from prisma_jax.nn.lora import is_adapter
from prisma_jax.nn.model import bind
from prisma_jax.core.trees import flatten
from train.config import config_from_raw
from train.export import checkpoint_leaves
from train.loop import run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SFT = os.path.join(ROOT, "configs", "tiny_sft.yaml")
LORA = {"rank": 4, "alpha": 8.0, "targets": ["q_proj", "v_proj", "down_proj", "qkv"]}
IDS = np.random.default_rng(0).integers(7, 128, (2, 11))


def raw_config(**train):
    raw = yaml.safe_load(open(SFT))
    raw["train"].update(steps=6, batch_size=2, seq_len=40, grad_accum=1, lora=LORA, **train)
    raw["optimizer"].update(lr=2e-2, warmup_steps=0)
    raw["checkpoint"].update(every=3, asynchronous=False)
    return raw


def metrics(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A tiny Prisma-VL checkpoint of configs/tiny_sft.yaml's model (8-bit table) to adapt."""
    path = str(tmp_path_factory.mktemp("base") / "hf")
    table = (0.02 * np.random.default_rng(1).standard_normal((256, 64))).astype(np.float32)
    save_checkpoint(build_model(tiny_hf_config(), seed=4), path, table=table)
    return path


@pytest.fixture(scope="module")
def runs(base, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    cfg = config_from_raw(raw_config(init=base))
    straight, resumed = str(root / "straight"), str(root / "resumed")
    run(cfg, straight, progress=False, log=lambda *_: None)
    run(cfg, resumed, stop_at=3, progress=False, log=lambda *_: None)
    run(cfg, resumed, progress=False, log=lambda *_: None)
    return cfg, straight, resumed, root


def test_bad_lora_values_name_the_key():
    for bad, key in [({"rank": 0}, "train.lora.rank"), ({"alpha": 0}, "train.lora.alpha"),
                     ({"targets": ["q_proj", "wq"]}, "train.lora.targets"), ({"ranks": 4}, "train.lora.ranks")]:
        raw = raw_config()
        raw["train"]["lora"] = {**LORA, **bad}
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            config_from_raw(raw)


def test_only_adapters_and_table_train_and_resume_is_bit_exact(runs, base):
    cfg, straight, resumed, _ = runs
    a, b = metrics(straight), metrics(resumed)
    assert [m["step"] for m in a] == [m["step"] for m in b] == list(range(1, 7))
    for k in ("loss", "grad_norm", "code_mean"):
        assert [m[k] for m in a] == [m[k] for m in b], k
    assert a[-1]["loss"] < a[0]["loss"] - 0.1

    import orbax.checkpoint as ocp
    from train.loop import CHECKPOINT_ITEMS, checkpoint_dir
    mngr = ocp.CheckpointManager(checkpoint_dir(straight), item_names=CHECKPOINT_ITEMS)
    try:
        state = mngr.restore(mngr.latest_step(), args=ocp.args.Composite(state=ocp.args.StandardRestore()))["state"]
    finally:
        mngr.close()
    saved = {tuple(str(getattr(k, "key", k)) for k in p): np.asarray(x)
             for p, x in jax.tree_util.tree_flatten_with_path(state["params"])[0]}
    assert all(is_adapter(p) or p == ("uncertainty", "embedding") for p in saved), list(saved)
    assert len(saved) == 2 * 4 + 1                           # lora_a, lora_b of four targets, and the table
    n_trained = sum(x.size for x in saved.values())
    n_opt = sum(np.asarray(x).size for x in jax.tree.leaves(state["opt_state"]))
    assert 2 * n_trained <= n_opt < 2 * n_trained + 8        # Adam's mu and nu of the trained leaves, and counts
    src = PrismaVL.from_pretrained(base)                     # the table moved; B moved from its zero init
    table = ("uncertainty", "embedding")
    assert np.abs(saved[table] - np.asarray(src.params["uncertainty"]["embedding"])).max() > 1e-4
    assert np.abs(saved[("text", "layers", "attn", "q_proj", "lora", "lora_b")]).max() > 1e-4


def _adapted_logits(cfg, workdir, base):
    """Our logits of the adapted model: the checkpoint's trained leaves over the base, bound with the adapters."""
    from train.export import _trained_leaves
    from train.step import combine, partition
    leaf, _, _, close = checkpoint_leaves(workdir)
    try:
        trained = _trained_leaves(cfg, leaf)
    finally:
        close()
    src = PrismaVL.from_pretrained(base)
    _, rest = partition(src.params, lambda p: p == ("uncertainty", "embedding"))
    params = jax.tree.map(np.asarray, combine(trained, rest))
    b = src.prepare(IDS)
    def forward(p, bt):
        model = bind(cfg.model, p, cfg.train.lora)
        return model.head(model.hidden(bt)[0])
    with jax.default_matmul_precision("highest"):
        logits = jax.jit(forward)(params, b)
    return np.asarray(logits), trained, b


def test_merged_export_gives_the_adapted_logits(runs, base):
    cfg, straight, _, root = runs
    dst = str(root / "merged")
    assert cli(["convert", "train-to-hf", straight, dst, "--merge-lora"]) == 0
    want, _, _ = _adapted_logits(cfg, straight, base)
    got = np.asarray(PrismaVL.from_pretrained(dst).forward(IDS))
    assert np.abs(want).max() > 0.1
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    # the frozen leaves are the base's, bit for bit
    merged, src = PrismaVL.from_pretrained(dst).params, PrismaVL.from_pretrained(base).params
    for path, x in flatten(src):
        if path[-1] != "kernel" and path != ("uncertainty", "embedding"):
            np.testing.assert_array_equal(np.asarray(_get(merged, path)), np.asarray(x), err_msg=str(path))


def _get(tree, path):
    for k in path:
        tree = tree[k]
    return tree


def test_peft_reads_the_adapter_export_to_the_same_logits(runs, base, capsys):
    from peft import PeftModel
    from safetensors.numpy import load_file
    from transformers import Qwen3VLForConditionalGeneration

    cfg, straight, _, root = runs
    dst = str(root / "adapters")
    assert cli(["convert", "train-to-hf", straight, dst, "--lora-adapters"]) == 0
    assert cli(["convert", "train-to-hf", straight, str(root / "x")]) == 2     # a LoRA run: choose one
    assert "choose --merge-lora" in capsys.readouterr().err and not os.path.exists(root / "x")
    want, trained, b = _adapted_logits(cfg, straight, base)
    hf = Qwen3VLForConditionalGeneration.from_pretrained(base, dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(hf, dst).eval()
    n_lora = sum(1 for n, _ in peft_model.named_parameters() if "lora_A" in n)
    assert n_lora == 3 * 3 + 3                            # q, v, down in 3 text layers; qkv in 3 vision blocks
    table = load_file(os.path.join(dst, "uncertainty_table.safetensors"))["model.uncertainty_embeddings.weight"]
    ref = reference_logits(peft_model.merge_and_unload(), IDS, table=table, codes_in=np.asarray(b.codes))
    np.testing.assert_allclose(ref, want, atol=1e-4, rtol=0)


def test_a_lora_run_is_tied_to_its_base(runs, base, tmp_path):
    """Resuming on another base (another directory, or the same files changed) is refused by name."""
    import dataclasses
    import shutil

    from train.loop import base_identity

    cfg, straight, _, _ = runs
    other = str(tmp_path / "base")
    shutil.copytree(base, other)
    moved = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, init=other))
    before = base_identity(moved)
    assert before["crc32"] == base_identity(cfg)["crc32"] and before["path"] != base_identity(cfg)["path"]
    with open(os.path.join(other, "model.safetensors"), "r+b") as f:     # one byte of a weight
        f.seek(-3, os.SEEK_END)
        f.write(b"\x07")
    assert base_identity(moved)["crc32"]["model.safetensors"] != before["crc32"]["model.safetensors"]
    work = str(tmp_path / "run")
    shutil.copytree(straight, work)
    with pytest.raises(ValueError, match="trained on another base"):
        run(moved, work, progress=False, log=lambda *_: None)
