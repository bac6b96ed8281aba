"""The training configuration: strict dataclasses for the YAML sections and `key=value` overrides.

A training YAML holds the model (`model:`, prisma_jax/core/config.py's schema) and four sections of ours:

    train:      steps, batch size, sequence length, accumulation, introspection passes, dtype, remat, freezing,
                LoRA (`lora: {rank, alpha, targets, dropout}`: adapters on a frozen base; prisma_jax/nn/lora.py),
                `logits_chunk` (the head and loss over sequence chunks: train/step.py `head_xent`), `max_bad_steps`
                (non-finite steps are skipped, this many in a row stop the run: train/step.py `skip_nonfinite`)
    optimizer:  AdamW + warmup-cosine + global-norm clipping; weight decay on kernels and embedding tables
                (token embedding, position embedding, uncertainty table), never on norm scales or biases
    data:       source (jsonl | synthetic | tiny_sft), processor directory, image size, bad-input policies,
                `packing` (several conversations a row, train/data.py `pack`)
    checkpoint: how often, how many kept (the last `keep`, and every `keep_period`-th step for good), asynchronous
                or not

Every section is validated strictly: an unknown key is an error naming it (`train.stepz`), as is a value of
the wrong type or outside its range. Overrides `section.key=value` (value parsed as YAML) are applied to the
raw mapping before validation, so they pass the same checks. Nothing here touches JAX.
"""
from __future__ import annotations

import dataclasses
import os
import typing

import yaml

from prisma_jax.core.config import ConfigError, ModelConfig, config_from_dict, read_yaml
from prisma_jax.nn.lora import LoraSpec
from prisma_jax.parallel.mesh import MeshSpec

FREEZE_GROUPS = ("vision", "embed", "layers", "text", "lm_head", "uncertainty")
REMAT_POLICIES = ("none", "full", "dots")


@dataclasses.dataclass(frozen=True)
class TrainSection:
    steps: int
    batch_size: int                     # global batch (rows), split into grad_accum micro-batches
    seq_len: int
    grad_accum: int = 1
    introspection_passes: int = 2       # P of docs/introspection-contract.md §4
    seed: int = 0
    compute_dtype: str = "float32"      # float32 | bfloat16 (master weights and optimizer stay float32)
    remat: str = "none"                 # none | full | dots (what the backward pass may keep)
    freeze: tuple[str, ...] = ()        # parameter groups left unchanged (FREEZE_GROUPS)
    init: str | None = None             # None: random init from `seed`; else a Hugging Face checkpoint dir
    log_every: int = 1
    mesh: object = None                 # None: one device; a preset name or {data, fsdp, tensor} (→ MeshSpec)
    lora: object = None                 # None: full fine-tuning; {rank, alpha, targets, dropout} (→ LoraSpec)
    logits_chunk: int = 0               # tokens a chunk of the head + loss (train/step.py `head_xent`); 0 = whole S
    unroll_layers: bool | None = None   # decoder layers unrolled, not scanned; null = on CPU without remat (step.py)
    fused_loss: bool | None = None      # head + loss gradients computed chunk by chunk in the forward; null = on CPU
    max_bad_steps: int | None = 8       # non-finite steps skipped, the run failing after this many in a row; null = off


@dataclasses.dataclass(frozen=True)
class OptimizerSection:
    lr: float = 1e-4
    warmup_steps: int = 0
    end_lr_ratio: float = 0.1           # cosine decays to lr·end_lr_ratio at the last step
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0           # decoupled; kernels and embedding tables only (train/step.py)
    clip_norm: float | None = 1.0       # global-norm clipping; null = off


@dataclasses.dataclass(frozen=True)
class DataSection:
    source: str = "synthetic"           # synthetic | jsonl | tiny_sft (generated into WORKDIR/tiny_sft_data)
    path: str | None = None             # JSONL file (source jsonl)
    processor: str | None = None        # tokenizer + preprocessor_config.json directory (source jsonl)
    image_size: int = 64                # every image is resized to image_size × image_size (one compile)
    max_images: int = 1                 # image slots per row; unused slots hold zero pixels
    overlong: str = "truncate"          # truncate | drop: samples longer than seq_len, counted either way
    on_malformed: str = "error"         # error | skip: malformed JSONL lines and missing images
    shuffle: bool = True
    num_threads: int = 2                # grain read threads (image decoding)
    image_cache_mb: int = 0             # keep recently read records' processed pixels, up to this many MiB
    packing: bool = False               # several conversations a row (first-fit), told apart by segment ids
    workers: int = 0                    # grain worker processes reading and decoding records (0: in this process)


@dataclasses.dataclass(frozen=True)
class CheckpointSection:
    every: int = 100
    keep: int = 3
    keep_period: int | None = None      # also keep for good every checkpoint whose step is a multiple; null = off
    asynchronous: bool = True


@dataclasses.dataclass(frozen=True)
class Config:
    model: ModelConfig
    train: TrainSection
    optimizer: OptimizerSection
    data: DataSection
    checkpoint: CheckpointSection

    def to_dict(self) -> dict:
        d = {k: dataclasses.asdict(getattr(self, k)) for k in ("train", "optimizer", "data", "checkpoint")}
        d["train"]["freeze"] = list(self.train.freeze)
        if self.train.lora is not None:
            d["train"]["lora"] = {**d["train"]["lora"], "targets": list(self.train.lora.targets)}
        return {"model": self.model.to_dict(), **d}


SECTIONS = {"train": TrainSection, "optimizer": OptimizerSection, "data": DataSection,
            "checkpoint": CheckpointSection}


def _coerce(value, tp, where: str):
    """Check `value` against a field annotation (int, float, str, bool, Optional, tuple[str, ...])."""
    if tp is object:                    # validated by _check
        return value
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        if value is None and type(None) in args:
            return None
        tp = next(a for a in args if a is not type(None))
        return _coerce(value, tp, where)
    if origin is tuple:
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        return tuple(_coerce(v, args[0], where) for v in value)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true/false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        return value
    raise TypeError(tp)


def _section(cls, raw, name: str):
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{name}: expected a mapping, got {type(raw).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        raise ConfigError(f"unknown config key(s) {', '.join(f'{name}.{k}' for k in unknown)}")
    missing = [f"{name}.{n}" for n, f in fields.items() if n not in raw and f.default is dataclasses.MISSING]
    if missing:
        raise ConfigError(f"missing config key(s) {', '.join(missing)}")
    return cls(**{k: _coerce(v, hints[k], f"{name}.{k}") for k, v in raw.items()})


def _check(c: Config) -> Config:
    t, o, d, k = c.train, c.optimizer, c.data, c.checkpoint
    problems = []

    def need(ok, msg):
        if not ok:
            problems.append(msg)

    need(t.steps >= 1, f"train.steps must be ≥ 1, got {t.steps}")
    need(t.batch_size >= 1, f"train.batch_size must be ≥ 1, got {t.batch_size}")
    need(t.grad_accum >= 1 and t.batch_size % t.grad_accum == 0,
         f"train.batch_size {t.batch_size} must be a multiple of train.grad_accum {t.grad_accum}")
    need(t.seq_len >= 2, f"train.seq_len must be ≥ 2, got {t.seq_len}")
    need(t.introspection_passes >= 1, f"train.introspection_passes must be ≥ 1, got {t.introspection_passes}")
    need(t.compute_dtype in ("float32", "bfloat16"), f"train.compute_dtype must be float32 or bfloat16, "
         f"got {t.compute_dtype!r}")
    need(t.remat in REMAT_POLICIES, f"train.remat must be one of {REMAT_POLICIES}, got {t.remat!r}")
    need(t.logits_chunk >= 0, f"train.logits_chunk must be ≥ 0 (0 = no chunks), got {t.logits_chunk}")
    need(t.unroll_layers in (None, True, False), f"train.unroll_layers must be true, false or null, "
         f"got {t.unroll_layers!r}")
    need(t.fused_loss in (None, True, False), f"train.fused_loss must be true, false or null, got {t.fused_loss!r}")
    need(not (t.unroll_layers is True and t.remat != "none"),
         f"train.unroll_layers: true needs train.remat: none (remat applies to the scanned layers), got {t.remat!r}")
    bad = [g for g in t.freeze if g not in FREEZE_GROUPS]
    need(not bad, f"train.freeze: unknown group(s) {bad}; groups are {FREEZE_GROUPS}")
    if t.mesh is not None:
        try:
            c = dataclasses.replace(c, train=dataclasses.replace(t, mesh=MeshSpec.parse(t.mesh)))
        except ValueError as e:
            problems.append(f"train.{e}" if str(e).startswith("mesh") else f"train.mesh: {e}")
    if t.lora is not None:
        try:
            c = dataclasses.replace(c, train=dataclasses.replace(c.train, lora=_lora(t.lora)))
        except ValueError as e:
            problems.append(str(e))
    need(t.max_bad_steps is None or t.max_bad_steps >= 1,
         f"train.max_bad_steps must be ≥ 1 or null (no check), got {t.max_bad_steps}")
    need(t.log_every >= 1, f"train.log_every must be ≥ 1, got {t.log_every}")
    need(o.lr > 0, f"optimizer.lr must be > 0, got {o.lr}")
    need(o.warmup_steps >= 0, f"optimizer.warmup_steps must be ≥ 0, got {o.warmup_steps}")
    need(0 <= o.end_lr_ratio <= 1, f"optimizer.end_lr_ratio must be in [0, 1], got {o.end_lr_ratio}")
    need(o.clip_norm is None or o.clip_norm > 0, f"optimizer.clip_norm must be > 0 or null, got {o.clip_norm}")
    need(d.source in ("synthetic", "jsonl", "tiny_sft"),
         f"data.source must be synthetic, jsonl or tiny_sft, got {d.source!r}")
    need(d.source != "jsonl" or (d.path and d.processor), "data.source jsonl needs data.path and data.processor")
    m = c.model.vision.patch_size * c.model.vision.spatial_merge_size
    need(d.image_size >= m and d.image_size % m == 0,
         f"data.image_size must be a positive multiple of patch_size·merge = {m}, got {d.image_size}")
    need(d.image_cache_mb >= 0, f"data.image_cache_mb must be ≥ 0 (0 = no cache), got {d.image_cache_mb}")
    need(d.max_images >= 0, f"data.max_images must be ≥ 0, got {d.max_images}")
    need(d.overlong in ("truncate", "drop"), f"data.overlong must be truncate or drop, got {d.overlong!r}")
    need(d.on_malformed in ("error", "skip"), f"data.on_malformed must be error or skip, got {d.on_malformed!r}")
    need(d.num_threads >= 0, f"data.num_threads must be ≥ 0, got {d.num_threads}")
    need(d.workers >= 0, f"data.workers must be ≥ 0, got {d.workers}")
    need(not d.packing or d.source != "synthetic", "data.packing needs conversations (data.source jsonl or "
         "tiny_sft): synthetic records already fill train.seq_len")
    need(k.every >= 1 and k.keep >= 1, f"checkpoint.every and checkpoint.keep must be ≥ 1, got {k.every}, {k.keep}")
    need(k.keep_period is None or k.keep_period >= 1,
         f"checkpoint.keep_period must be ≥ 1 or null, got {k.keep_period}")
    if problems:
        raise ConfigError("; ".join(problems))
    return c


def _lora(raw) -> LoraSpec:
    if isinstance(raw, LoraSpec):
        return raw.check()
    if not isinstance(raw, dict):
        raise ValueError(f"train.lora must be a mapping {{rank, alpha, targets, dropout}} or null, got {raw!r}")
    unknown = sorted(set(raw) - {f.name for f in dataclasses.fields(LoraSpec)})
    if unknown:
        raise ValueError(f"unknown config key(s) {', '.join('train.lora.' + k for k in unknown)}")
    targets = raw.get("targets", LoraSpec.targets)
    if isinstance(targets, str) or not isinstance(targets, (list, tuple)):
        raise ValueError(f"train.lora.targets must be a list of module names, got {targets!r}")
    return LoraSpec(**{**raw, "targets": tuple(targets)}).check()


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    """`section.key=value` (nested keys with dots, value parsed as YAML) applied to a copy of `raw`."""
    import copy
    raw = copy.deepcopy(raw)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r}: expected section.key=value")
        key, value = item.split("=", 1)
        parts = key.strip().split(".")
        if len(parts) < 2 or not all(parts):
            raise ConfigError(f"override {item!r}: expected section.key=value")
        if parts[0] not in ("model", *SECTIONS):
            raise ConfigError(f"override {item!r}: unknown section {parts[0]!r}")
        node = raw
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r}: {p!r} is not a section")
        node[parts[-1]] = yaml.safe_load(value)
    return raw


def config_from_raw(raw: dict) -> Config:
    if not isinstance(raw, dict):
        raise ConfigError("training config: expected a mapping")
    unknown = sorted(set(raw) - {"model", *SECTIONS})
    if unknown:
        raise ConfigError(f"unknown config section(s) {', '.join(repr(k) for k in unknown)}")
    if "model" not in raw:
        raise ConfigError("missing config section 'model'")
    if "train" not in raw:
        raise ConfigError("missing config section 'train'")
    model = config_from_dict(raw["model"])
    secs = {name: _section(cls, raw.get(name), name) for name, cls in SECTIONS.items()}
    return _check(Config(model=model, **secs))


def load_train_config(path: str | os.PathLike, overrides: list[str] = ()) -> tuple[Config, dict]:
    """(validated Config, the raw mapping after overrides) from a YAML file."""
    if not os.path.isfile(path):
        raise ConfigError(f"{path}: no such config file")
    raw = apply_overrides(read_yaml(path), list(overrides))
    return config_from_raw(raw), raw
