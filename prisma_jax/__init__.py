"""prisma-jax: Prisma-VL (Qwen3-VL + the introspective uncertainty mechanism) in JAX, built for TPU pods."""
from prisma_jax.core import runtime

runtime.configure()   # before JAX starts a backend: the host allocator, a quiet libtpu without a TPU

from prisma_jax.api import PrismaVL  # noqa: E402
from prisma_jax.core.config import ModelConfig, TextConfig, VisionConfig, load_config

__version__ = "0.1.0"
__all__ = ["PrismaVL", "ModelConfig", "TextConfig", "VisionConfig", "load_config", "__version__"]
