"""prisma-jax: Prisma-VL (Qwen3-VL + the introspective uncertainty mechanism) in JAX, built for TPU pods."""
from .api import PrismaVL
from .config import ModelConfig, TextConfig, VisionConfig, load_config

__version__ = "0.1.0"
__all__ = ["PrismaVL", "ModelConfig", "TextConfig", "VisionConfig", "load_config", "__version__"]
