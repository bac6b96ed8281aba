"""Low-rank adapters on the stacked layers' dense modules (Flax's `nnx.LoRA`, its params `nnx.LoRAParam`s).

A target dense module `W [in, out]` becomes  y = x·W + (alpha / rank) · (x·A)·B  with A [in, rank] (He-uniform)
and B [rank, out] (zeros), stacked with their layers like W: `.../q_proj/lora/{lora_a, lora_b}` of shapes
[layers, in, rank] and [layers, rank, out] in the param dict. Targets are named by module: the text layers'
`q_proj k_proj v_proj o_proj gate_proj up_proj down_proj` and the vision blocks' `qkv proj fc1 fc2`.

`merge` folds the adapters into the kernels (what `prisma convert train-to-hf --merge-lora` writes);
`peft_tensors` names them as `peft` does for Qwen3-VL (`base_model.model.<hf module>.lora_A.weight`, [rank, in]).
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

TEXT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
VISION_TARGETS = ("qkv", "proj", "fc1", "fc2")
TARGETS = TEXT_TARGETS + VISION_TARGETS


@dataclasses.dataclass(frozen=True)
class LoraSpec:
    rank: int = 16
    alpha: float = 32.0
    targets: tuple[str, ...] = TEXT_TARGETS
    dropout: float = 0.0

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def check(self, where: str = "train.lora") -> "LoraSpec":
        """A ValueError naming the key of the first bad value."""
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank <= 0:
            raise ValueError(f"{where}.rank must be a positive integer, got {self.rank!r}")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) or not self.alpha > 0:
            raise ValueError(f"{where}.alpha must be > 0, got {self.alpha!r}")
        if not self.targets:
            raise ValueError(f"{where}.targets must name at least one module of {list(TARGETS)}")
        unknown = [t for t in self.targets if t not in TARGETS]
        if unknown:
            raise ValueError(f"{where}.targets: unknown module(s) {unknown}; targets are {list(TARGETS)}")
        if self.dropout != 0.0:
            raise ValueError(f"{where}.dropout must be 0.0 (adapter dropout is not implemented), got {self.dropout!r}")
        return self

    def for_module(self, name: str) -> "LoraSpec | None":
        return self if name in self.targets else None


def is_adapter(path: tuple[str, ...]) -> bool:
    return "lora" in path


def adapters(params: dict) -> list[tuple[tuple[str, ...], dict]]:
    """(path of the dense module, its {"lora_a", "lora_b"}) for every adapter in a param dict."""
    out = []

    def walk(tree, prefix):
        for k, v in tree.items():
            if k == "lora":
                out.append((prefix, v))
            elif isinstance(v, dict):
                walk(v, prefix + (k,))
    walk(params, ())
    return out


def merge(params: dict, spec: LoraSpec) -> dict:
    """The plain param dict (no adapter leaves) whose kernels are W + scale · A·B, in float32."""
    def fold(tree):
        out = {}
        for k, v in tree.items():
            if k == "lora":
                continue
            out[k] = fold(v) if isinstance(v, dict) else v
        if "lora" in tree:
            a = jnp.asarray(tree["lora"]["lora_a"], jnp.float32)
            b = jnp.asarray(tree["lora"]["lora_b"], jnp.float32)
            w = jnp.asarray(tree["kernel"], jnp.float32)
            out["kernel"] = (w + jnp.float32(spec.scale) * jnp.einsum("...ir,...ro->...io", a, b,
                                                                      precision="highest")).astype(tree["kernel"].dtype)
        return out
    return fold(params)


def peft_tensors(params: dict, cfg, spec: LoraSpec) -> dict[str, np.ndarray]:
    """The adapters under peft's names for Qwen3-VL: lora_A [rank, in], lora_B [out, rank] per layer."""
    from .params import hf_names

    by_path = {(n.path, n.index): n.hf for n in hf_names(cfg) if n.path[-1] == "kernel"}
    out = {}
    for path, ab in adapters(params):
        a, b = np.asarray(ab["lora_a"], np.float32), np.asarray(ab["lora_b"], np.float32)
        for i in range(a.shape[0]):
            hf = by_path[(path + ("kernel",), i)]
            stem = "base_model.model." + hf[: -len(".weight")]
            out[f"{stem}.lora_A.weight"] = np.ascontiguousarray(a[i].T)
            out[f"{stem}.lora_B.weight"] = np.ascontiguousarray(b[i].T)
    return out


def peft_config(tensors: dict, spec: LoraSpec, base: str | None) -> dict:
    """adapter_config.json for `peft.PeftModel.from_pretrained`; `target_modules` is a regex matching exactly
    the adapted modules (a bare name like `fc1` would also match the vision mergers)."""
    import re

    modules = {re.sub(r"\.\d+\.", r".\\d+.", k[len("base_model.model."):-len(".lora_A.weight")])
               for k in tensors if k.endswith(".lora_A.weight")}
    pattern = "|".join(sorted(m.replace(".", r"\.").replace(r"\\d+", r"\d+") for m in modules))
    return {"peft_type": "LORA", "task_type": None, "base_model_name_or_path": base, "r": spec.rank,
            "lora_alpha": spec.alpha, "lora_dropout": spec.dropout, "bias": "none", "fan_in_fan_out": False,
            "target_modules": f"({pattern})", "inference_mode": True, "use_rslora": False,
            "init_lora_weights": True, "modules_to_save": None}
