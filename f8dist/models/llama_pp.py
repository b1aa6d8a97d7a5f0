"""A pipeline split of the LLaMA-style model of ``llama.py``: one stage's modules, with a float8
stage boundary ([Note: the float8 stage boundary] in f8dist/parallel/pp/boundary.py) where
activations leave or enter the stage.

Split after ``convert_to_float8_training`` (the linears keep the FQNs of the whole model, and so do
the stage's parameters: a checkpoint of the stages is the whole model's) and before
``fully_shard``. ``pipeline_stage`` builds the ``PipelineStage`` with the wire's shapes given.
"""

from __future__ import annotations

from typing import Tuple

import torch
import torch.nn as nn

from f8dist.models.llama import Transformer
from f8dist.parallel.pp import Float8StageInput, Float8StageOutput, wire_like

__all__ = ["LlamaStage", "split_llama", "pipeline_stage"]


class LlamaStage(nn.Module):
    """Layers ``[first, last)`` of a :class:`Transformer`, the embedding on the first stage, the
    norm and output on the last: ``tokens [B, S]`` or a wire -> a wire or ``logits [B, S, vocab]``.
    ``float8``: activations cross the boundaries in float8 (else in the model's dtype)."""

    def __init__(self, model: Transformer, first: int, last: int, float8: bool = True):
        super().__init__()
        self.args, n = model.args, model.args.n_layers
        self.is_first, self.is_last = first == 0, last == n
        self.tok_embeddings = model.tok_embeddings if self.is_first else None
        self.receive = None if self.is_first or not float8 else Float8StageInput()
        self.layers = nn.ModuleDict({str(i): model.layers[str(i)] for i in range(first, last)})
        self.send = None if self.is_last or not float8 else Float8StageOutput()
        self.norm = model.norm if self.is_last else None
        self.output = model.output if self.is_last else None
        self.register_buffer("rope", model.rope, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_first:
            h = self.tok_embeddings(x)  # [B, S, dim]
        else:
            h = x if self.receive is None else self.receive(x)  # [B, S, dim]
        for layer in self.layers.values():
            h = layer(h, self.rope)
        if self.is_last:
            return self.output(self.norm(h))  # [B, S, vocab]
        return h if self.send is None else self.send(h)  # [B, S, dim] or its wire


def _bounds(n_layers: int, stage: int, num_stages: int) -> Tuple[int, int]:
    if not 0 <= stage < num_stages <= n_layers:
        raise ValueError(
            f"a pipeline of {num_stages} stages over {n_layers} layers has no stage {stage}: "
            "num_stages must be at most ModelArgs.n_layers and stage in [0, num_stages)"
        )
    return stage * n_layers // num_stages, (stage + 1) * n_layers // num_stages


def split_llama(model: Transformer, stage: int, num_stages: int, float8: bool = True) -> LlamaStage:
    """Stage ``stage`` of ``num_stages`` of ``model``, its layers split evenly (the modules are
    ``model``'s own, not copies).

    Example::

        >>> from f8dist.models import ModelArgs
        >>> model = Transformer(ModelArgs(dim=32, n_layers=2, n_heads=2))
        >>> list(split_llama(model, 1, 2).state_dict())[:2]
        ['layers.1.attention_norm.weight', 'layers.1.attention.wq.weight']
    """
    return LlamaStage(model, *_bounds(model.args.n_layers, stage, num_stages), float8=float8)


def pipeline_stage(stage: LlamaStage, stage_index: int, num_stages: int, microbatch: Tuple[int, int],
                   group, dtype: torch.dtype = torch.float32):
    """The ``torch.distributed.pipelining.PipelineStage`` of ``stage`` for micro-batches of
    ``microbatch`` = (batch, seq) tokens, its inputs and outputs given statically ([Note: the
    float8 stage boundary]: no forward on uninitialized buffers); ``dtype``: the activations'."""
    from torch.distributed.pipelining import PipelineStage

    act = torch.empty(*microbatch, stage.args.dim, dtype=dtype, device="meta")  # [B, S, dim]

    def boundary(float8: bool) -> torch.Tensor:
        return wire_like(act) if float8 else act.requires_grad_()

    tokens = torch.empty(*microbatch, dtype=torch.long, device="meta")
    inputs = tokens if stage.is_first else boundary(stage.receive is not None)
    if stage.is_last:
        outputs = torch.empty(*microbatch, stage.args.vocab_size, dtype=dtype, device="meta")
    else:
        outputs = boundary(stage.send is not None)
    return PipelineStage(stage, stage_index, num_stages, stage.rope.device, input_args=inputs,
                         output_args=outputs, group=group)
