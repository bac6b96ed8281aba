"""The sharding tables and the plan's arithmetic, in-process and single-device (the multi-device runs are in
test_sharding_mesh.py / _multihost.py / _tpu.py, each in subprocesses)."""
import json
import logging
import math
import os

import jax.numpy as jnp
import numpy as np
import pytest

from prisma_jax.apps.cli import main
from prisma_jax.core.config import load_config
from prisma_jax.core.trees import flatten
from prisma_jax.nn.params import param_shapes
from prisma_jax.apps.plan import all_gathers, forbidden_gathers, train_config
from train.flops import step_flops, text_matmul_params
from prisma_jax.core.partitioning import CACHE_AXES, LOGICAL_RULES, MESH_AXES, batch_shards, spec_for, take_rows
from prisma_jax.parallel.mesh import PRESETS, MeshSpec
from prisma_jax.parallel.placement import param_axes, param_specs

ROOT = os.path.dirname(os.path.dirname(__file__))
CFG8 = load_config(os.path.join(ROOT, "configs", "prisma_vl_8b.yaml"))
TINY = load_config(os.path.join(ROOT, "configs", "tiny.yaml"))
# every leaf's logical axes, as reviewed for the 8B layout (docs/sharding.md); the modules must declare these
with open(os.path.join(ROOT, "tests", "data", "param_axes.json")) as f:
    PARAM_AXES = {k: tuple(v) for k, v in json.load(f).items()}


class FakeMesh:
    def __init__(self, **shape):
        self.shape = shape


def test_mesh_spec_parses_dicts_rest_and_presets():
    assert MeshSpec.parse({"data": 2, "fsdp": 2, "tensor": 2}).shape(8) == (2, 2, 2)
    assert MeshSpec.parse({"data": 2, "tensor": -1}).shape(8) == (2, 1, 4)
    assert MeshSpec.parse({}).shape(16) == (1, 16, 1)                  # default: all devices on fsdp
    assert MeshSpec.parse("cpu-8").shape(8) == (2, 2, 2)
    for bad in ({"dat": 2}, {"data": 0}, {"data": -1, "fsdp": -1}, "v9-1024", 3):
        with pytest.raises(ValueError):
            MeshSpec.parse(bad)
    with pytest.raises(ValueError, match="needs 8 devices"):
        MeshSpec.parse({"data": 2, "fsdp": 2, "tensor": 2}).shape(4)


def test_presets_record_devices_hbm_and_topology():
    want = {"cpu-8": (8, None, None), "v5e-8": (8, 16, "v5e:2x4"), "v5e-16": (16, 16, "v5e:4x4"),
            "v5p-8": (4, 95, "v5p:2x2x1"), "v4-32": (16, 32, "v4:2x2x4"), "v5p-64": (32, 95, "v5p:4x4x2")}
    assert set(PRESETS) == set(want)
    for name, (n, hbm, topo) in want.items():
        p = PRESETS[name]
        assert (p.n_devices, p.hbm_gib, p.topology) == (n, hbm, topo)
        if topo:   # chips in the topology name = devices (a v4/v5p chip is one megacore device)
            assert math.prod(int(x) for x in topo.split(":")[1].split("x")) == n
        assert math.prod(p.train.shape(n)) == math.prod(p.generate.shape(n)) == n
        # generation meshes keep the vocabulary and KV heads on `tensor` and nothing on fsdp: no weight gathers
        assert p.generate.shape(n)[1] == 1 or name == "cpu-8"
        assert CFG8.text.num_key_value_heads % p.generate.shape(n)[2] == 0


def test_every_parameter_has_one_rule():
    for cfg in (CFG8, TINY, TINY.replace(tie_word_embeddings=True)):
        leaves = {"/".join(p): s for p, s in flatten(param_shapes(cfg))}
        assert set(leaves) <= set(PARAM_AXES)
        axes = param_axes(cfg)
        for path, shape in flatten(param_shapes(cfg)):
            a = axes
            for k in path:
                a = a[k]
            assert a == PARAM_AXES["/".join(path)] and len(a) == len(shape)
            if path[0] in ("text", "vision") and path[1] in ("layers", "blocks", "deepstack"):
                assert a[0] == "layers" and LOGICAL_RULES["layers"] is None   # stacked axes stay whole


@pytest.mark.parametrize("preset", ["v5p-8", "cpu-8"])
def test_module_partition_specs_equal_the_param_shardings(preset):
    """nnx.get_partition_spec of the abstract 8B module, under the logical rules, is what `param_specs` (used
    to place every checkpoint and the training state) gives on that preset's training mesh."""
    import jax
    from flax import nnx

    from prisma_jax.nn.model import PrismaVLModule

    p = PRESETS[preset]
    mesh = jax.sharding.AbstractMesh(p.train.shape(p.n_devices), MESH_AXES)
    abstract = nnx.eval_shape(lambda: PrismaVLModule(CFG8, rngs=nnx.Rngs(0)))
    with nnx.logical_axis_rules(tuple(LOGICAL_RULES.items())):
        specs = nnx.to_pure_dict(nnx.get_partition_spec(nnx.state(abstract, nnx.Param)))
    want = param_specs(CFG8, mesh)
    got, exp = dict(flatten(specs)), dict(flatten(want))
    assert got.keys() == exp.keys() and len(got) == len(PARAM_AXES)
    for k in exp:
        assert got[k] == exp[k], k
    assert got[("text", "embed", "embedding")] == jax.sharding.PartitionSpec("tensor", "fsdp")


def test_big_tables_are_split_rows_on_tensor_columns_on_fsdp():
    mesh = FakeMesh(data=2, fsdp=2, tensor=2)
    v, d, lv = CFG8.text.vocab_size, CFG8.text.hidden_size, CFG8.n_levels
    assert tuple(spec_for((v, d), PARAM_AXES["text/embed/embedding"], mesh)) == ("tensor", "fsdp")
    assert tuple(spec_for((d, v), PARAM_AXES["lm_head/kernel"], mesh)) == ("fsdp", "tensor")
    assert tuple(spec_for((lv, d), PARAM_AXES["uncertainty/embedding"], mesh)) == ("tensor", "fsdp")
    assert tuple(spec_for((8, 5), ("batch", None), mesh)) == (("data", "fsdp"), None)


def test_a_batch_the_mesh_does_not_divide_is_an_error_naming_the_sizes():
    mesh = FakeMesh(data=2, fsdp=2, tensor=2)
    for shape, logical in [((6, 5), ("batch", None)), ((3, 5), ("batch", None)), ((2, 3, 16), (None, "batch", None)),
                           ((3, 2, 2, 7, 32), CACHE_AXES)]:
        dim = shape[logical.index("batch")]
        with pytest.raises(ValueError, match=rf"batch dimension {dim} .* data=2 × fsdp=2 = 4"):
            spec_for(shape, logical, mesh)
    assert batch_shards(mesh) == 4 and batch_shards(FakeMesh(data=1, fsdp=8, tensor=1)) == 8
    assert tuple(spec_for((6, 5), ("batch", None), FakeMesh(data=2, fsdp=3, tensor=1))) == (("data", "fsdp"), None)


def test_other_dimensions_the_mesh_does_not_divide_are_replicated_with_one_log_line(caplog):
    mesh = FakeMesh(data=1, fsdp=2, tensor=3)
    with caplog.at_level(logging.WARNING, logger="prisma_jax.core.partitioning"):
        for _ in range(3):                                    # traced in a loop: still one line
            assert tuple(spec_for((128, 64), ("vocab", "hidden"), mesh)) == (None, "fsdp")
        assert tuple(spec_for((129, 64), ("vocab", "hidden"), mesh)) == ("tensor", "fsdp")   # 3 divides 129
        assert tuple(spec_for((131, 64), ("vocab", "hidden"), mesh)) == (None, "fsdp")
        assert tuple(spec_for((128, 64), ("vocab", "hidden"), FakeMesh(data=1, fsdp=2, tensor=5))) == (None, "fsdp")
    lines = [r.getMessage() for r in caplog.records if r.name == "prisma_jax.core.partitioning"]
    assert lines == ["sharding: logical axis 'vocab' of size 128 is not divisible by mesh axis tensor=3; replicated over it",
                     "sharding: logical axis 'vocab' of size 131 is not divisible by mesh axis tensor=3; replicated over it",
                     "sharding: logical axis 'vocab' of size 128 is not divisible by mesh axis tensor=5; replicated over it"]


def test_take_rows_without_mesh_is_take():
    t = jnp.arange(40.0).reshape(10, 4)
    ids = jnp.array([[0, 9], [3, 3]])
    np.testing.assert_array_equal(np.asarray(take_rows(t, ids, ("vocab", "hidden"))), np.asarray(t)[np.asarray(ids)])


def test_flops_count_the_text_matmuls():
    # independent count: every text-layer kernel and lm_head from the param tree
    shapes = dict(flatten(param_shapes(CFG8)))
    n = sum(math.prod(s) for p, s in shapes.items()
            if (p[:2] == ("text", "layers") and p[-1] == "kernel") or p[0] == "lm_head")
    assert text_matmul_params(CFG8) == n
    tcfg = train_config(os.path.join(ROOT, "configs", "prisma_vl_8b.yaml"), 2, 8, ["train.introspection_passes=2"],
                        images=0)
    f = step_flops(tcfg)
    assert f["text"] == 6 * n * 16
    t = CFG8.text
    assert f["attention"] == 3 * 4 * 2 * 64 * t.num_attention_heads * t.head_dim * t.num_hidden_layers
    assert f["introspection"] == (f["text"] + f["attention"]) // 3
    assert f["total"] == f["text"] + f["attention"] + f["vision"] + f["introspection"]


def test_all_gather_scanner_reads_compiled_hlo_lines():
    hlo = ("  %all-gather.3 = f32[128,64]{1,0} all-gather(f32[64,64]{1,0} %p), dimensions={0}\n"
           "  %ag = (bf16[4,128]{1,0}, u32[]) all-gather-start(bf16[4,64]{1,0} %x), dimensions={1}\n"
           "  %add = f32[128,64]{1,0} add(%a, %b)\n")
    assert all_gathers(hlo) == [("f32", (128, 64)), ("bf16", (4, 128)), ("u32", ())]
    assert forbidden_gathers(hlo, TINY, 4) == [("f32", (128, 64)), ("bf16", (4, 128))]


def test_plan_rejects_unknown_preset(capsys):
    assert main(["plan", "--config", os.path.join(ROOT, "configs", "tiny.yaml"), "--mesh", "v9-9"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unknown mesh preset 'v9-9'" in err[0]


def test_plan_reads_the_tpu_compilers_refusal():
    from prisma_jax.apps.plan import compiler_oom
    msg = ("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO temporaries (21.39G) "
           "exceeds available HBM (15.75G).")
    assert compiler_oom(RuntimeError(msg)) == "HLO temporaries need 21.39 GiB > HBM 15.75 GiB"
    assert compiler_oom(RuntimeError("INTERNAL: something else")) is None


def _tiny_train_config(batch, seq):
    from prisma_jax.apps.plan import train_config
    return train_config(os.path.join(ROOT, "configs", "tiny.yaml"), batch, seq, images=0)


def test_plan_trains_with_image_slots(tmp_path):
    """A model-only YAML plans one 448² image a row, a training YAML its own data section, --images /
    --image-size override either; the planned batch is the trainer's: `Collate`'s slots, zero pixels, geometry."""
    import jax
    from prisma_jax.apps.plan import abstract_train_batch, image_tokens, train_config
    from prisma_jax.parallel.mesh import make_mesh

    tiny = os.path.join(ROOT, "configs", "tiny.yaml")
    c = train_config(tiny, 4, 512)
    assert (c.data.max_images, c.data.image_size, image_tokens(c)) == (1, 448, 196)    # (448 / 16)² / 2²
    c = train_config(tiny, 4, 512, images=3, image_size=64)
    assert (c.data.max_images, c.data.image_size, image_tokens(c)) == (3, 64, 12)
    own = tmp_path / "train.yaml"
    own.write_text(open(tiny).read() + "train: {steps: 1, batch_size: 2, seq_len: 128}\ndata: {image_size: 96}\n")
    c = train_config(str(own), None, None)
    assert (c.data.max_images, c.data.image_size, c.train.batch_size) == (1, 96, 2)   # DataSection's slot count
    with pytest.raises(ValueError, match="196 tokens a row, not fewer than train.seq_len 128"):
        train_config(tiny, 4, 128)
    with pytest.raises(ValueError, match="data.max_images must be ≥ 0, got -1"):
        train_config(tiny, 4, 512, images=-1)
    with pytest.raises(ValueError, match="data.image_size must be a positive multiple of .* = 32, got 40"):
        train_config(tiny, 4, 512, images=1, image_size=40)

    mesh = make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, jax.devices()[:1])
    b = abstract_train_batch(train_config(tiny, 6, 256, ["train.grad_accum=2"], images=2, image_size=64), mesh)
    # 2 micro-batches of 3 rows; each row 2 slots of a 4 × 4 patch grid, each patch 3 channels · 2 frames · 16²
    # (pixels per row, sharded with it; the geometry describes one row's slots)
    assert b.input_ids.shape == (2, 3, 256) and b.positions.shape == (2, 3, 3, 256)
    assert b.pixel_values.shape == (2, 3, 2 * 16, 3 * 2 * 16 * 16) and b.pixel_values.dtype == jnp.float32
    assert b.geometry.rows.shape == (2 * 16,) and b.geometry.frame_len == 16
    assert abstract_train_batch(train_config(tiny, 6, 256, images=0), mesh).pixel_values is None


def test_plan_lowers_the_lora_step_with_the_trained_leaves_only():
    """With train.lora the planned state is the adapters and the table (float32, with Adam's moments), the base
    a bfloat16 argument; the step compiles, with fewer argument bytes than full fine-tuning."""
    import jax
    from prisma_jax.apps.plan import abstract_train_state, bytes_per_device, lower_train, memory, train_config
    from prisma_jax.parallel.mesh import make_mesh

    tiny = os.path.join(ROOT, "configs", "tiny.yaml")
    mesh = make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, jax.devices()[:1])
    full = train_config(tiny, 2, 64, images=0)
    assert train_config(tiny, 2, 512, ["train.lora={rank: 4}"]).data.image_size == 448   # still model-only
    lora = train_config(tiny, 2, 64, ["train.lora={rank: 4, targets: [q_proj, fc1]}"], images=0)
    s_full, no_base = abstract_train_state(full, mesh)
    s_lora, base = abstract_train_state(lora, mesh)
    assert no_base is None
    trained = {"/".join(str(getattr(k, "key", k)) for k in p): x.dtype
               for p, x in jax.tree_util.tree_flatten_with_path(s_lora.params)[0]}
    assert set(trained) == {"text/layers/attn/q_proj/lora/lora_a", "text/layers/attn/q_proj/lora/lora_b",
                            "vision/blocks/mlp/fc1/lora/lora_a", "vision/blocks/mlp/fc1/lora/lora_b",
                            "uncertainty/embedding"} and set(trained.values()) == {jnp.dtype(jnp.float32)}
    assert {x.dtype for x in jax.tree.leaves(base)} == {jnp.dtype(jnp.bfloat16)} and len(jax.tree.leaves(base)) > 30
    assert bytes_per_device((s_lora, base)) < bytes_per_device(s_full) / 2
    m_full, m_lora = memory(lower_train(full, mesh).compile()), memory(lower_train(lora, mesh).compile())
    assert m_lora.arguments < m_full.arguments / 2


def test_plan_help_states_the_default_image(capsys):
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "or 1 for a model-only YAML" in out and "or 448 for a model-only YAML: 448² = 196 merged tokens" in out


@pytest.mark.parametrize("hbm, seq, want, calls", [
    (6, 4096, (1, 2048), [(1, 4096), (1, 2048), (2, 2048)]),     # nothing at 4096: halve until one row fits
    (20, 1024, (9, 1024), [(1, 1024), (2, 1024), (9, 1024)]),    # two compiles fix the line, a third checks it
    (5, 1024, (1, 1024), [(1, 1024), (2, 1024)]),                # two rows do not fit: one
    (2.5, 1024, (0, 512), [(1, 1024), (1, 512)]),                # nothing fits down to the shortest length
])
def test_plan_search_over_batch_then_sequence(monkeypatch, hbm, seq, want, calls):
    """`search_train_batch` against a stand-in compiler whose memory is 2 GiB + 1 GiB per 512 tokens and
    which refuses (like libtpu) any program larger than HBM."""
    import jax
    from prisma_jax.apps import plan
    from prisma_jax.parallel.mesh import Preset
    seen = []

    def fake_plan_train(tcfg, p, devices):
        b, s = tcfg.train.batch_size, tcfg.train.seq_len
        seen.append((b, s))
        total = 2 * plan.GiB + b * s * plan.GiB // 512
        if total > p.hbm_gib * plan.GiB:
            return {"batch": b, "seq": s, "memory": None, "fits": False, "oom": "refused"}
        return {"batch": b, "seq": s, "memory": plan.Memory(total, 0, 0, 0, 0), "fits": True}

    monkeypatch.setattr(plan, "plan_train", fake_plan_train)
    p = Preset("fake-1", 1, hbm, None, None, MeshSpec(1, 1, 1), MeshSpec(1, 1, 1))
    best, r = plan.search_train_batch(_tiny_train_config, p, jax.devices()[:1], seq)
    assert (best, r["seq"]) == want and seen == calls


def test_plan_search_stops_when_the_state_alone_exceeds_hbm(monkeypatch):
    import jax
    from prisma_jax.apps import plan
    from prisma_jax.parallel.mesh import Preset
    monkeypatch.setattr(plan, "plan_train", lambda *a: pytest.fail("no compile should be needed"))
    p = Preset("fake-1", 1, 1e-6, None, None, MeshSpec(1, 1, 1), MeshSpec(1, 1, 1))
    best, r = plan.search_train_batch(_tiny_train_config, p, jax.devices()[:1], 64)
    assert best == 0 and not r["fits"] and "weights + AdamW state alone" in r["oom"]
    text = plan.format_train(r, p, _tiny_train_config(1, 64))
    assert "weights + AdamW state alone" in text and "DOES NOT FIT" in text
