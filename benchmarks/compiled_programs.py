"""The compiled programs of this tree, as comparable text: XLA's optimized HLO of the `bench_58m` training step
(batch 2 × 64), of the tiny model's `generate.prefill` and unrolled `generate.decode`, and of the serve engine's
`admit` and `advance` (4 slots, unrolled as on CPU), one instruction a line,
debug metadata (source lines, function names, stack frames) removed. Two trees whose files `diff` equal run the
same programs, so any speed difference between them is noise.

    PYTHONPATH=TREE .venv/bin/python benchmarks/compiled_programs.py OUT.txt
"""
from __future__ import annotations

import os
import re
import sys

import numpy as np

# this folder's train.py would shadow the `train` package of the tree under test (PYTHONPATH, or the install)
sys.path = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402


def instructions(compiled) -> list[str]:
    lines = [ln for ln in compiled.as_text().splitlines() if " = " in ln]
    lines = [re.sub(r", metadata=\{[^}]*\}", "", ln) for ln in lines]
    lines = [re.sub(r"(, )?stack_frame_id=[0-9]*", "", ln) for ln in lines]
    # parameters are named after their argument's pytree path: number them in order instead, so that moving a
    # field into a nested dataclass (the same leaves in the same order) compares equal
    names = [m.group(1) for ln in lines if (m := re.match(r"\s*(?:ROOT )?%(\S+) = .* parameter\(\d+\)", ln))]
    rename = {n: f"param.{i}" for i, n in enumerate(names)}
    if not rename:
        return lines
    pattern = re.compile(r"%(" + "|".join(map(re.escape, sorted(rename, key=len, reverse=True))) + r")(?![\w.])")
    return [pattern.sub(lambda m: "%" + rename[m.group(1)], ln) for ln in lines]


def train_step() -> list[str]:
    from train import step as S
    from train.config import load_train_config

    cfg, _ = load_train_config("configs/bench_58m.yaml", ["train.batch_size=2", "train.seq_len=64"])
    state = jax.eval_shape(lambda: S.fresh_state(cfg, jax.random.PRNGKey(0)))
    a, b, s = cfg.train.grad_accum, cfg.train.batch_size // cfg.train.grad_accum, cfg.train.seq_len
    sd = jax.ShapeDtypeStruct
    batch = S.TrainBatch(sd((a, b, s), jnp.int32), sd((a, b, s), bool), sd((a, b, s), jnp.int32),
                         sd((a, 3, b, s), jnp.int32), sd((a, b, s), jnp.int32))
    return instructions(jax.jit(S.make_train_step(cfg, state.params)).lower(state, batch).compile())


def generation() -> list[str]:
    from prisma_jax.infer import generate as G
    from prisma_jax.core.config import load_config
    from prisma_jax.nn.params import init_params_numpy

    cfg = load_config("configs/tiny.yaml")
    params = jax.tree.map(jnp.asarray, init_params_numpy(cfg, 0))
    p = G.request(cfg, G.Inputs(np.random.default_rng(0).integers(7, 100, (2, 9))),
                  options=G.Options(max_new_tokens=8, unroll_layers=True))
    args = (cfg, p.spec, params, p.batch, p.next_pos, p.sp, p.eos, p.pad, jax.random.key(0))
    state = G.prefill(*args)
    return (instructions(G.prefill.lower(*args).compile())
            + instructions(G.decode.lower(cfg, p.spec, params, state, p.sp, p.eos, p.pad, p.max_new).compile()))


def serving() -> list[str]:
    from prisma_jax.infer import generate as G
    from prisma_jax.core.config import load_config
    from prisma_jax.nn.params import init_params_numpy
    from prisma_jax.infer.serve import slots as S
    from prisma_jax.nn.text import split_layers

    cfg = load_config("configs/tiny.yaml")
    params = jax.tree.map(jnp.asarray, init_params_numpy(cfg, 0))
    spec = S.ServeSpec(unroll_layers=True)
    slots = S.init_slots(cfg, spec, 4, 64, jnp.float32)
    p = G.request(cfg, G.Inputs(np.random.default_rng(0).integers(7, 100, (1, 9))),
                  options=G.Options(max_new_tokens=8, unroll_layers=True))
    eos = np.full((S.MAX_END_IDS,), -1, np.int32)
    admit = S.admit.lower(cfg, spec, params, slots, np.int32(0), p.batch, p.next_pos, p.sp, eos, p.max_new,
                          jax.random.key(0), np.int32(23)).compile()
    advance = S.advance.lower(cfg, spec, 64, 4, params, split_layers(params), slots).compile()
    return instructions(admit) + instructions(advance)


if __name__ == "__main__":
    import prisma_jax
    print(f"tree: {os.path.dirname(os.path.dirname(prisma_jax.__file__))}")
    lines = train_step() + generation() + serving()
    with open(sys.argv[1], "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"{len(lines)} instructions → {sys.argv[1]}")
