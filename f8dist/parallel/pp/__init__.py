"""Float8 pipeline parallelism: a stage boundary that sends activations in e4m3 and their
gradients in e5m2, per token, through ``torch.distributed.pipelining``'s schedules (a ready split
of the LLaMA-style model: ``f8dist.models.llama_pp``).
"""

from f8dist.parallel.pp.boundary import Float8StageInput, Float8StageOutput, wire_like

__all__ = ["Float8StageInput", "Float8StageOutput", "wire_like"]
