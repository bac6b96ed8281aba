"""`prisma generate`: chat prompts (and images) in, answers and their uncertainty codes out.

    prisma generate --model DIR --prompt "Describe this image." --image cat.png [--prompt ...] [--json]
                    [--quantize int8] [--mesh v5p-8 | data=2,fsdp=1,tensor=4]
                    [--abstain-above TAU [--abstain-text TEXT]]

The tokenizer, chat template and image processor come from DIR (offline, processing.py); several `--prompt`s
make one left-padded batch; each `--image` belongs to the `--prompt` before it (the first if none precedes).
Everything is checked (files, images, sampling values, lengths, TAU) before anything is compiled.
`--abstain-above TAU`: a prompt whose answer reaches a token with code > TAU stops there and is answered with
`--abstain-text` (docs/generation.md#abstention); `--json` says which (`abstained`, `abstain_step`).
"""
from __future__ import annotations

import argparse
import json
import re
import sys


MESH_HELP = ("shard the model over devices: a preset (its generation mesh: sharding.PRESETS) or axis sizes "
             "such as data=2,tensor=4 (axes left out are 1, but fsdp takes the remaining devices); default one device")


def parse_mesh(text: str | None):
    """`--mesh` (of `prisma generate` and `prisma eval`) → a `sharding.MeshSpec`, or None for one device: a
    preset name gives its generation mesh, `data=2,fsdp=1,tensor=4` the sizes named (`MeshSpec.parse` fills
    the rest)."""
    from prisma_jax.parallel.mesh import PRESETS, MeshSpec

    if text is None:
        return None
    if text in PRESETS:
        return PRESETS[text].generate
    sizes = {}
    for part in text.split(","):
        k, eq, v = part.partition("=")
        if not eq or not re.fullmatch(r"\s*-?\d+\s*", v):
            raise ValueError(f"--mesh {text!r}: expected a preset ({', '.join(PRESETS)}) or axis sizes such as "
                             "data=2,fsdp=1,tensor=4")
        sizes[k.strip()] = int(v)
    return MeshSpec.parse(sizes)


class _ImageAction(argparse.Action):
    def __call__(self, parser, ns, value, option_string=None):
        owner = max(len(getattr(ns, "prompt", None) or []) - 1, 0)
        ns.image = (ns.image or []) + [(owner, value)]


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("generate", help="generate answers with per-token uncertainty codes",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="checkpoint directory (weights, tokenizer, preprocessor)")
    p.add_argument("--prompt", action="append", required=True, help="a user message; repeat for a batch")
    p.add_argument("--image", action=_ImageAction, default=[], help="an image file for the preceding --prompt")
    p.add_argument("--system", default=None, help="a system message for every prompt")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--uncertainty-power", type=float, default=0.0,
                   help="temperature × (1 − previous code/(L−1))**power: sample less after uncertain steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    from prisma_jax.quant.int8 import MODES

    p.add_argument("--quantize", default=None, choices=MODES,
                   help="int8 weight-only kernels (the decoder's projections and lm_head; quant/int8.py)")
    p.add_argument("--mesh", default=None, help=MESH_HELP)
    p.add_argument("--attention", default="auto", choices=["auto", "xla", "pallas"],
                   help="attention kernels: auto = splash on TPU, cuDNN on GPU, XLA on CPU (prisma_jax/nn/attention.py)")
    p.add_argument("--no-verify", dest="verify", action="store_false",
                   help="an Orbax --model: skip checking the crc32s its conversion recorded")
    p.add_argument("--compilation-cache", default=None, metavar="DIR",
                   help="persist compiled programs here across runs")
    from prisma_jax.infer.generate import ABSTAIN_TEXT

    p.add_argument("--abstain-above", type=int, default=None, metavar="TAU",
                   help="stop a row at its first token whose code exceeds TAU (0 ≤ TAU < 2**n_bits) and "
                        "answer it with --abstain-text")
    p.add_argument("--abstain-text", default=None,
                   help=f"an abstaining row's answer (default {ABSTAIN_TEXT!r}); needs --abstain-above")
    p.add_argument("--json", action="store_true",
                   help="print tokens, text, codes, entropies and abstained / abstain_step as JSON")
    p.set_defaults(func=run)


def run(args) -> int:
    from prisma_jax.infer.generate import ABSTAIN_TEXT, enable_compilation_cache
    from prisma_jax.host.processing import Processor, load_image
    from prisma_jax.infer.sampling import check_sampling

    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be ≥ 1, got {args.max_new_tokens}")
    if args.abstain_text is not None and args.abstain_above is None:
        raise ValueError("--abstain-text needs --abstain-above TAU (without it no row abstains)")
    check_sampling(args.temperature, args.top_k, args.top_p, args.uncertainty_power)
    mesh = parse_mesh(args.mesh)
    proc = Processor.from_pretrained(args.model)
    per_prompt: list[list] = [[] for _ in args.prompt]
    for owner, path in args.image:
        per_prompt[owner].append(load_image(path))          # unreadable files fail here, before any compile
    convs = []
    for text, images in zip(args.prompt, per_prompt):
        content = [{"type": "image", "image": im} for im in images] + [{"type": "text", "text": text}]
        msgs = ([{"role": "system", "content": args.system}] if args.system else []) + \
               [{"role": "user", "content": content}]
        convs.append(msgs)
    enc = proc(messages=convs)

    from prisma_jax.api import PrismaVL
    if args.compilation_cache:
        enable_compilation_cache(args.compilation_cache)
    model = PrismaVL.from_pretrained(args.model, dtype=args.dtype, verify=args.verify, quantize=args.quantize,
                                     mesh=mesh, attention=args.attention)
    eos = model.generation_config.get("eos_token_id", proc.ids["eos_token_id"])
    pad = model.generation_config.get("pad_token_id", proc.pad_token_id)
    res = model.generate(enc["input_ids"], enc["attention_mask"], enc.get("pixel_values"), enc.get("image_grid_thw"),
                         max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                         top_p=args.top_p, seed=args.seed, eos_token_id=eos, pad_token_id=pad,
                         uncertainty_power=args.uncertainty_power, return_entropies=True,
                         abstain_above=args.abstain_above, abstain_text=args.abstain_text or ABSTAIN_TEXT)
    out = []
    for i, (prompt, text) in enumerate(zip(args.prompt, res.texts(proc))):
        n = int(res.lengths[i])
        out.append({"prompt": prompt, "text": text, "tokens": res.tokens[i, :n].tolist(),
                    "codes": res.codes[i, :n].tolist(),
                    "entropies": [round(float(x), 6) for x in res.entropies[i, :n]],
                    "abstained": bool(res.abstained[i]), "abstain_step": int(res.abstain_step[i])})
    if args.json:
        json.dump(out if len(out) > 1 else out[0], sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        for o in out:
            print(o["text"])
    return 0
