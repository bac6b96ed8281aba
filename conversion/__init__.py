"""Checkpoint conversion: Hugging Face safetensors ↔ Orbax, streamed, validated, bit-identical both ways.

    from conversion import convert, export, restore_params
    convert("hf_dir", "orbax_dir")            # prisma convert hf-to-orbax hf_dir orbax_dir
    export("orbax_dir", "hf_out")             # prisma convert orbax-to-hf orbax_dir hf_out
    params, cfg = restore_params("orbax_dir", shardings=tree_of_named_shardings)
"""
from conversion.hf_to_orbax import convert
from prisma_jax.checkpoint.orbax import is_converted, restore_params
from conversion.orbax_to_hf import export

__all__ = ["convert", "export", "restore_params", "is_converted"]
