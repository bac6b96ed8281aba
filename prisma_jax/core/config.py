"""Model configuration: dataclasses, the YAML schema, and reading Hugging Face `config.json`.

One frozen dataclass per tower plus `ModelConfig` on top. Two sources:

* our YAML (`configs/*.yaml`, section `model:`), strict: unknown or missing keys are errors naming the key;
* a Hugging Face Qwen3-VL / Prisma-VL `config.json` in the 4.57 spelling (`rope_theta` + `rope_scaling`) or
  the 5.x spelling (`rope_parameters`), tied or untied head. Keys transformers itself writes but that do not
  change the math (dtype, architectures, ...) are accepted and ignored; anything else is an error.

Nothing here touches JAX: configs are plain data, hashable, usable as static arguments of `jax.jit`.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any

import yaml


class ConfigError(ValueError):
    """A configuration file or dict is malformed; the message names the offending key."""


@dataclasses.dataclass(frozen=True)
class VisionConfig:
    depth: int
    hidden_size: int
    num_heads: int
    intermediate_size: int
    out_hidden_size: int
    num_position_embeddings: int
    deepstack_visual_indexes: tuple[int, ...]
    patch_size: int = 16
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    in_channels: int = 3
    hidden_act: str = "gelu_pytorch_tanh"
    rope_theta: float = 10000.0
    layer_norm_eps: float = 1e-6  # hard-coded in transformers, a field here

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:  # length of one pixel_values row: C * T_p * P * P
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @property
    def pos_grid(self) -> int:  # side of the learned position-embedding grid
        return int(math.isqrt(self.num_position_embeddings))


@dataclasses.dataclass(frozen=True)
class TextConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_theta: float = 5_000_000.0
    mrope_section: tuple[int, int, int] = (24, 20, 20)
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 262144
    hidden_act: str = "silu"


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    text: TextConfig
    vision: VisionConfig
    image_token_id: int = 151655
    video_token_id: int = 151656
    vision_start_token_id: int = 151652
    vision_end_token_id: int = 151653
    tie_word_embeddings: bool = False
    attention: str = "auto"  # auto | xla | pallas: the attention kernels (prisma_jax/nn/attention.py)
    n_bits: int = 16  # uncertainty code width: table rows L = 2**n_bits (docs/introspection-contract.md §1)

    @property
    def n_levels(self) -> int:
        return 2**self.n_bits

    @property
    def neutral_code(self) -> int:
        return 2 ** (self.n_bits - 1)

    def replace(self, **kw) -> "ModelConfig":
        return dataclasses.replace(self, **kw)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        for section in ("text", "vision"):
            d[section] = {k: list(v) if isinstance(v, tuple) else v for k, v in d[section].items()}
        return d


# ---------------------------------------------------------------------------------------------- validation


def _build(cls, d: dict, where: str):
    if not isinstance(d, dict):
        raise ConfigError(f"{where}: expected a mapping, got {type(d).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - set(fields))
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(repr(k) for k in unknown)}")
    missing = [n for n, f in fields.items()
               if n not in d and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ConfigError(f"{where}: missing key(s) {', '.join(repr(k) for k in missing)}")
    kw = {}
    for k, v in d.items():
        if k in ("deepstack_visual_indexes", "mrope_section"):
            v = tuple(int(x) for x in v)
        kw[k] = v
    return cls(**kw)


def _check(cfg: ModelConfig) -> ModelConfig:
    t, v = cfg.text, cfg.vision
    problems = []
    if t.num_attention_heads % t.num_key_value_heads:
        problems.append("text.num_attention_heads must be a multiple of text.num_key_value_heads")
    if t.head_dim % 2:
        problems.append("text.head_dim must be even")
    if sum(t.mrope_section) != t.head_dim // 2:
        problems.append(f"text.mrope_section {list(t.mrope_section)} must sum to head_dim/2 = {t.head_dim // 2}")
    if v.hidden_size % v.num_heads or v.head_dim % 4:
        problems.append("vision.hidden_size / vision.num_heads must be a multiple of 4")
    if v.pos_grid**2 != v.num_position_embeddings:
        problems.append("vision.num_position_embeddings must be a perfect square")
    if v.out_hidden_size != t.hidden_size:
        problems.append(f"vision.out_hidden_size {v.out_hidden_size} != text.hidden_size {t.hidden_size}")
    if list(v.deepstack_visual_indexes) != sorted(set(v.deepstack_visual_indexes)) or any(
            not 0 <= i < v.depth for i in v.deepstack_visual_indexes):
        problems.append("vision.deepstack_visual_indexes must be sorted, distinct and in [0, depth)")
    if len(v.deepstack_visual_indexes) > t.num_hidden_layers:
        problems.append("more DeepStack indexes than text layers")
    if cfg.attention not in ("auto", "xla", "pallas"):
        problems.append(f"attention must be one of auto, xla, pallas, got {cfg.attention!r}")
    if not 1 <= cfg.n_bits <= 16:
        problems.append(f"n_bits must be in [1, 16] (codes are uint16), got {cfg.n_bits}")
    if problems:
        raise ConfigError("; ".join(problems))
    return cfg


def config_from_dict(d: dict) -> ModelConfig:
    """Our schema: {text: {...}, vision: {...}, <top-level fields>}."""
    if not isinstance(d, dict):
        raise ConfigError("model config: expected a mapping")
    d = dict(d)
    for k in ("text", "vision"):
        if k not in d:
            raise ConfigError(f"model config: missing key '{k}'")
    text = _build(TextConfig, d.pop("text"), "model.text")
    vision = _build(VisionConfig, d.pop("vision"), "model.vision")
    return _check(_build(ModelConfig, {**d, "text": text, "vision": vision}, "model"))


def read_yaml(path: str | os.PathLike) -> dict:
    with open(path) as f:
        data = yaml.safe_load(f)
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a YAML mapping at top level")
    return data


def load_yaml_config(path: str | os.PathLike) -> ModelConfig:
    """The `model:` section of one of our YAML files."""
    data = read_yaml(path)
    if "model" not in data:
        raise ConfigError(f"{path}: missing key 'model'")
    return config_from_dict(data["model"])


# ------------------------------------------------------------------------------------- Hugging Face config.json

# Keys that transformers writes into Qwen3-VL configs but that do not change the forward math.
_HF_IGNORED = {
    "architectures", "model_type", "transformers_version", "dtype", "torch_dtype", "initializer_range",
    "attention_dropout", "attention_bias", "use_cache", "bos_token_id", "eos_token_id", "pad_token_id",
    "output_hidden_states", "output_attentions", "return_dict", "chunk_size_feed_forward", "is_encoder_decoder",
    "id2label", "label2id", "problem_type", "tokenizer_class", "prefix", "sep_token_id", "decoder_start_token_id",
    "task_specific_params", "finetuning_task", "cross_attention_hidden_size", "add_cross_attention",
    "is_decoder", "tie_encoder_decoder", "pruned_heads", "torchscript", "use_bfloat16", "tf_legacy_loss",
    "use_return_dict", "_name_or_path", "_attn_implementation_autoset", "layer_types", "sliding_window",
    "use_sliding_window", "max_window_layers", "rope_type", "name_or_path", "base_model_tp_plan",
    "base_model_pp_plan", "vision_config", "text_config", "_commit_hash", "quantization_config",
}
_HF_TEXT = {"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings", "hidden_act"}
_HF_VISION = {"depth", "hidden_size", "num_heads", "intermediate_size", "out_hidden_size", "num_position_embeddings",
              "deepstack_visual_indexes", "patch_size", "temporal_patch_size", "spatial_merge_size", "in_channels",
              "hidden_act"}
_HF_TOP = {"image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id"}


def _hf_section(src: dict, wanted: set[str], extra: set[str], where: str) -> dict:
    unknown = sorted(set(src) - wanted - extra - _HF_IGNORED)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(repr(k) for k in unknown)}")
    return {k: src[k] for k in wanted if k in src}


def config_from_hf(hf: dict, n_bits: int | None = None) -> ModelConfig:
    """Read a transformers Qwen3-VL / Prisma-VL config dict (4.57 or 5.x spelling)."""
    for k in ("text_config", "vision_config"):
        if k not in hf:
            raise ConfigError(f"config.json: missing key '{k}'")
    tc, vc = hf["text_config"], hf["vision_config"]
    rope_keys = {"rope_theta", "rope_scaling", "rope_parameters", "tie_word_embeddings"}
    text = _hf_section(tc, _HF_TEXT, rope_keys, "config.json text_config")
    rope = dict(tc.get("rope_parameters") or {})
    rope.update({k: v for k, v in (tc.get("rope_scaling") or {}).items() if v is not None})
    if "rope_theta" in tc:
        rope.setdefault("rope_theta", tc["rope_theta"])
    if rope.get("rope_type", "default") not in ("default", "mrope"):
        raise ConfigError(f"config.json text_config: unsupported rope_type {rope.get('rope_type')!r}")
    if "rope_theta" not in rope:
        raise ConfigError("config.json text_config: missing key 'rope_theta' (or rope_parameters.rope_theta)")
    text["rope_theta"] = float(rope["rope_theta"])
    text["mrope_section"] = tuple(rope.get("mrope_section", (24, 20, 20)))
    vrope = {"rope_theta", "rope_parameters", "initializer_range"}
    vision = _hf_section(vc, _HF_VISION, vrope, "config.json vision_config")
    vision["rope_theta"] = float((vc.get("rope_parameters") or {}).get("rope_theta", vc.get("rope_theta", 10000.0)))
    top = _hf_section(hf, _HF_TOP, {"tie_word_embeddings", "prisma_n_bits", "uncertainty_n_bits"}, "config.json")
    tie = hf.get("tie_word_embeddings", tc.get("tie_word_embeddings", False))
    bits = n_bits or hf.get("uncertainty_n_bits") or hf.get("prisma_n_bits") or 16
    return _check(ModelConfig(text=_build(TextConfig, text, "config.json text_config"),
                              vision=_build(VisionConfig, vision, "config.json vision_config"),
                              tie_word_embeddings=bool(tie), n_bits=int(bits), **top))


def config_to_hf(cfg: ModelConfig) -> dict:
    """A transformers-loadable config.json (5.x spelling), recording the table size."""
    t, v = cfg.text, cfg.vision
    return {
        "architectures": ["Qwen3VLForConditionalGeneration"],
        "model_type": "qwen3_vl",
        "image_token_id": cfg.image_token_id, "video_token_id": cfg.video_token_id,
        "vision_start_token_id": cfg.vision_start_token_id, "vision_end_token_id": cfg.vision_end_token_id,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "uncertainty_n_bits": cfg.n_bits,
        "text_config": {
            "model_type": "qwen3_vl_text", "vocab_size": t.vocab_size, "hidden_size": t.hidden_size,
            "intermediate_size": t.intermediate_size, "num_hidden_layers": t.num_hidden_layers,
            "num_attention_heads": t.num_attention_heads, "num_key_value_heads": t.num_key_value_heads,
            "head_dim": t.head_dim, "rms_norm_eps": t.rms_norm_eps, "hidden_act": t.hidden_act,
            "max_position_embeddings": t.max_position_embeddings, "attention_bias": False,
            "rope_parameters": {"rope_type": "default", "rope_theta": t.rope_theta,
                                "mrope_section": list(t.mrope_section), "mrope_interleaved": True},
            "tie_word_embeddings": cfg.tie_word_embeddings,
        },
        "vision_config": {
            "model_type": "qwen3_vl_vision", "depth": v.depth, "hidden_size": v.hidden_size,
            "num_heads": v.num_heads, "intermediate_size": v.intermediate_size,
            "out_hidden_size": v.out_hidden_size, "num_position_embeddings": v.num_position_embeddings,
            "deepstack_visual_indexes": list(v.deepstack_visual_indexes), "patch_size": v.patch_size,
            "temporal_patch_size": v.temporal_patch_size, "spatial_merge_size": v.spatial_merge_size,
            "in_channels": v.in_channels, "hidden_act": v.hidden_act,
        },
    }


def load_hf_config(directory: str | os.PathLike, n_bits: int | None = None) -> ModelConfig:
    path = os.path.join(directory, "config.json")
    if not os.path.isfile(path):
        raise ConfigError(f"{directory}: no config.json")
    with open(path) as f:
        try:
            hf = json.load(f)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: not valid JSON ({e})") from None
    return config_from_hf(hf, n_bits=n_bits)


def load_config(path: str | os.PathLike) -> ModelConfig:
    """A YAML file of ours, or a checkpoint directory holding a Hugging Face config.json."""
    if os.path.isdir(path):
        return load_hf_config(path)
    if str(path).endswith((".yaml", ".yml")):
        return load_yaml_config(path)
    if str(path).endswith(".json"):
        with open(path) as f:
            return config_from_hf(json.load(f))
    raise ConfigError(f"{path}: expected a .yaml config or a checkpoint directory")
