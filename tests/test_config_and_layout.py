"""Configs (our YAML, Hugging Face config.json in both spellings) and the 8B parameter layout."""
import json
import os

import pytest

from hf_tiny import tiny_hf_config
from prisma_jax.core.config import ConfigError, config_from_hf, load_config, load_yaml_config
from prisma_jax.apps.counts import param_counts
from prisma_jax.checkpoint.hf_names import UNCERTAINTY_KEY, hf_names

ROOT = os.path.dirname(os.path.dirname(__file__))
KEYS_TSV = os.path.join(ROOT, "tests", "data", "qwen3_vl_8b_keys.tsv")   # the 8B checkpoint's keys and shapes


def test_8b_layout_equals_reference_key_list_plus_table():
    cfg = load_yaml_config(os.path.join(ROOT, "configs", "prisma_vl_8b.yaml"))
    ours = {n.hf: list(n.hf_shape) for n in hf_names(cfg)}
    ref = {}
    with open(KEYS_TSV) as f:
        for line in f:
            key, shape = line.rstrip("\n").split("\t")
            ref[key] = json.loads(shape)
    assert ours.pop(UNCERTAINTY_KEY) == [65536, 4096]
    assert ours == ref


def test_8b_parameter_counts():
    cfg = load_yaml_config(os.path.join(ROOT, "configs", "prisma_vl_8b.yaml"))
    c = param_counts(cfg)
    assert c == {"vision": 576_388_336, "text": 7_568_405_504, "lm_head": 622_329_856,
                 "uncertainty": 268_435_456, "total": 9_035_559_152}


def test_prisma_inspect_cli_prints_the_total(capsys):
    from prisma_jax.apps.cli import main
    assert main(["inspect", os.path.join(ROOT, "configs", "prisma_vl_8b.yaml")]) == 0
    assert "9,035,559,152" in capsys.readouterr().out


@pytest.mark.parametrize("style", ["4.57", "5.x"])
@pytest.mark.parametrize("tie", [False, True])
def test_hf_config_both_spellings(style, tie, tmp_path):
    hf = tiny_hf_config(tie=tie, rope_style=style)
    hf.save_pretrained(tmp_path)                      # what transformers itself writes
    cfg = load_config(str(tmp_path))
    assert cfg.text.rope_theta == 5e6 and cfg.text.mrope_section == (6, 5, 5)
    assert cfg.tie_word_embeddings is tie
    assert cfg.vision.deepstack_visual_indexes == (0, 2)
    raw = hf.to_dict()
    assert config_from_hf(raw) == cfg


def test_hf_4_57_spelling_by_hand():
    raw = tiny_hf_config().to_dict()
    t = raw["text_config"]
    rp = t.pop("rope_parameters")
    t["rope_theta"] = rp.pop("rope_theta")
    t["rope_scaling"] = rp
    assert config_from_hf(raw).text.rope_theta == 5e6


def test_unknown_and_missing_keys_are_named(tmp_path):
    raw = tiny_hf_config().to_dict()
    raw["text_config"]["frobnicate"] = 1
    with pytest.raises(ConfigError, match="frobnicate"):
        config_from_hf(raw)
    raw = tiny_hf_config().to_dict()
    del raw["text_config"]["num_hidden_layers"]
    with pytest.raises(ConfigError, match="num_hidden_layers"):
        config_from_hf(raw)
    y = tmp_path / "c.yaml"
    y.write_text(open(os.path.join(ROOT, "configs", "tiny.yaml")).read().replace("head_dim: 32", "head_dims: 32"))
    with pytest.raises(ConfigError, match="head_dims"):
        load_yaml_config(y)


def test_bench_1p7b_text_model_is_qwen3_1p7b_sized():
    """configs/bench_1p7b.yaml (benchmarks/gpu.py): its text model has as many parameters as transformers'
    Qwen3ForCausalLM with Qwen3-1.7B's dimensions (built on the meta device), 1,720,574,976, head tied."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from train.config import load_train_config
    cfg = load_train_config(os.path.join(ROOT, "configs", "bench_1p7b.yaml"))[0].model
    t = cfg.text
    hc = Qwen3Config(vocab_size=t.vocab_size, hidden_size=t.hidden_size, intermediate_size=t.intermediate_size,
                     num_hidden_layers=t.num_hidden_layers, num_attention_heads=t.num_attention_heads,
                     num_key_value_heads=t.num_key_value_heads, head_dim=t.head_dim,
                     tie_word_embeddings=cfg.tie_word_embeddings)
    with torch.device("meta"):
        ref = sum(p.numel() for p in Qwen3ForCausalLM(hc).parameters())
    c = param_counts(cfg)
    assert c["text"] + c["lm_head"] == ref == 1_720_574_976
