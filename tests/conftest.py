import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, os.path.dirname(__file__))

# The slowest files first (measured with --durations=0; the Makefile runs `--dist loadfile --no-loadscope-reorder`,
# so xdist hands files to its workers in this order): what is left for the end is short, and neither worker waits
# long for the other. xdist's own order (most tests first) left single heavy files, like the two-process one, last.
SLOWEST_FIRST = ("test_logits_chunk.py", "test_attention.py", "test_sharding_mesh.py", "test_train_step.py",
                 "test_train_loop.py", "test_sharding_multihost.py", "test_packing.py", "test_runtime.py",
                 "test_sharding_tpu.py", "test_demo_pipeline.py", "test_generate.py", "test_quantize.py",
                 "test_serve_robustness.py", "test_tunix.py", "test_attention_blocked.py")


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))      # stable: the rest keep their order
