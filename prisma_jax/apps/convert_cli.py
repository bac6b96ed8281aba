"""`prisma convert hf-to-orbax|orbax-to-hf|train-to-hf`: argument parsing only; the work is in hf_to_orbax,
orbax_to_hf and train/export.py."""
from __future__ import annotations

from conversion.staging import human_bytes, parse_bytes


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("convert", help="convert checkpoints: Hugging Face safetensors <-> Orbax")
    sub = p.add_subparsers(dest="direction", required=True)

    a = sub.add_parser("hf-to-orbax", help="a Qwen3-VL / Prisma-VL safetensors directory -> an Orbax directory")
    a.add_argument("src", metavar="SRC")
    a.add_argument("dst", metavar="DST")
    a.add_argument("--dtype", default="keep", choices=["keep", "bfloat16", "float32", "float16"],
                   help="dtype of the stored arrays (default: keep the source's)")
    a.add_argument("--init-uncertainty", default="zeros", choices=["zeros", "normal"],
                   help="table for a plain Qwen3-VL source: zeros (reproduces Qwen3-VL) or normal(0, 0.02)")
    a.add_argument("--seed", type=int, default=0, help="seed of --init-uncertainty normal")
    a.add_argument("--overwrite", action="store_true", help="replace DST if it exists")
    a.add_argument("--dry-run", action="store_true", help="validate SRC, print what would be written and the "
                   "expected peak memory; write nothing")
    a.set_defaults(func=_hf_to_orbax)

    b = sub.add_parser("orbax-to-hf", help="an Orbax directory from hf-to-orbax -> safetensors shards")
    b.add_argument("src", metavar="SRC")
    b.add_argument("dst", metavar="DST")
    b.add_argument("--max-shard-size", default="5GB", help="largest shard (default 5GB)")
    b.add_argument("--overwrite", action="store_true", help="replace DST if it exists")
    b.add_argument("--dry-run", action="store_true", help="print what would be written and the expected peak "
                   "memory; write nothing")
    b.set_defaults(func=_orbax_to_hf)

    c = sub.add_parser("train-to-hf", help="a `prisma train` checkpoint (its params) -> a safetensors directory")
    c.add_argument("workdir", metavar="WORKDIR", help="the run's --workdir")
    c.add_argument("dst", metavar="DST")
    c.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
    c.add_argument("--processor", default=None, help="copy the tokenizer/processor files of this directory")
    c.add_argument("--eos-token-id", type=int, default=None)
    c.add_argument("--pad-token-id", type=int, default=None)
    c.add_argument("--max-shard-size", default="5GB", help="largest shard (default 5GB; one file if it all fits)")
    c.add_argument("--overwrite", action="store_true", help="replace DST if it exists")
    c.add_argument("--merge-lora", action="store_true", help="a LoRA run: its adapters folded into its base")
    c.add_argument("--lora-adapters", action="store_true", help="a LoRA run: the adapters alone, in peft's layout")
    c.set_defaults(func=_train_to_hf)


def _hf_to_orbax(args) -> int:
    from conversion.hf_to_orbax import convert
    meta = convert(args.src, args.dst, dtype=args.dtype, init_uncertainty=args.init_uncertainty, seed=args.seed,
                   overwrite=args.overwrite, dry_run=args.dry_run)
    if not args.dry_run:
        n = sum(1 for _ in meta["tensors"])
        print(f"wrote {args.dst}: {n} tensors, n_bits={meta['n_bits']}, uncertainty table: {meta['uncertainty']}")
    return 0


def _orbax_to_hf(args) -> int:
    from conversion.orbax_to_hf import export
    index = export(args.src, args.dst, overwrite=args.overwrite, dry_run=args.dry_run,
                   max_shard_bytes=parse_bytes(args.max_shard_size))
    if not args.dry_run:
        files = sorted(set(index["weight_map"].values()))
        print(f"wrote {args.dst}: {len(index['weight_map'])} tensors, {human_bytes(index['metadata']['total_size'])}"
              f" in {len(files)} shard(s)")
    return 0


def _train_to_hf(args) -> int:
    from train.export import export
    step = export(args.workdir, args.dst, args.step, args.processor, args.eos_token_id, args.pad_token_id,
                  args.overwrite, parse_bytes(args.max_shard_size), args.merge_lora, args.lora_adapters)
    print(f"wrote {args.dst}: the params of step {step} of {args.workdir}")
    return 0
