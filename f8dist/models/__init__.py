"""Small reference models for f8dist's end-to-end training and tests, and their parallel plans."""

from f8dist.models.llama import ModelArgs, Transformer
from f8dist.models.llama_cp import parallelize_llama_cp
from f8dist.models.llama_tp import llama_tp_plan, parallelize_llama

__all__ = ["ModelArgs", "Transformer", "llama_tp_plan", "parallelize_llama", "parallelize_llama_cp"]
