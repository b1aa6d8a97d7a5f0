"""Small reference models for f8dist's end-to-end training and tests."""

from f8dist.models.llama import ModelArgs, Transformer

__all__ = ["ModelArgs", "Transformer"]
