"""LoRA adapters in peft's format for Qwen3-VL: tensor names and adapter_config.json (train/export.py)."""
from __future__ import annotations

import numpy as np

from prisma_jax.checkpoint.hf_names import hf_names
from prisma_jax.nn.lora import LoraSpec, adapters


def peft_tensors(params: dict, cfg, spec: LoraSpec) -> dict[str, np.ndarray]:
    """The adapters under peft's names for Qwen3-VL: lora_A [rank, in], lora_B [out, rank] per layer."""
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
