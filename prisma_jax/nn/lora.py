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


def adapter(spec: "LoraSpec | None", name: str) -> "LoraSpec | None":
    """The adapter spec of the dense module `name` (None: no LoRA, or not a target)."""
    return None if spec is None else spec.for_module(name)


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


