"""Context parallelism for the LLaMA-style model of ``llama.py``: each rank holds a contiguous
shard of every sequence, its attention gathers K and V in float8 over the cp mesh
(:class:`~f8dist.parallel.cp.Float8ContextParallel` on every block's ``attention.sdpa``) and its
blocks rotate by the positions of its shard.

[Note: the LLaMA model under context parallelism]
The caller feeds rank ``r`` tokens ``[:, r * S / cp : (r + 1) * S / cp]`` and reduces the
gradients over the cp ranks as over data-parallel ones (FSDP2 over dp x cp, or an all-reduce):
each rank's loss covers its own tokens. Everything but attention is per token, so it runs on the
shard as one device does; float8 linears cast their rank's tokens as a data-parallel rank casts
its micro-batch (scales over the tokens are the shard's).
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.nn as nn
from torch.distributed.tensor import DeviceMesh
from torch.distributed.tensor.parallel import parallelize_module

from f8dist.models.llama import Transformer
from f8dist.parallel.cp import Float8ContextParallel

__all__ = ["parallelize_llama_cp"]


def parallelize_llama_cp(model: Transformer, cp_mesh: DeviceMesh,
                         style: Optional[Float8ContextParallel] = None) -> Transformer:
    """Context parallelism of ``model`` over the 1-D ``cp_mesh`` ([Note: the LLaMA model under
    context parallelism]); ``style``: the attention's (default ``Float8ContextParallel()``).

    Example::

        >>> # xdoctest: +SKIP("needs a process group")
        >>> parallelize_llama_cp(model, init_device_mesh("cuda", (4,), mesh_dim_names=("cp",)))
        >>> logits = model(tokens.chunk(4, dim=1)[cp_rank])  # [B, S / 4, vocab]
    """
    style = Float8ContextParallel() if style is None else style
    rank = cp_mesh.get_local_rank()
    for block in model.layers.values():
        parallelize_module(block.attention.sdpa, cp_mesh, style)
        block.register_forward_pre_hook(functools.partial(_shard_rope, rank, cp_mesh.size()))
    return model


def _shard_rope(rank: int, cp: int, block: nn.Module, args):
    """The block's ``(x, rope)`` with the rotations of this rank's positions."""
    x, rope = args
    s = x.shape[1]  # [B, S / cp, dim]
    if cp * s > rope.shape[0]:
        raise ValueError(f"context parallelism over {cp} ranks of {s} tokens each needs "
                         f"ModelArgs.max_seq_len >= {cp * s}, got {rope.shape[0]}")
    return x, rope[rank * s:(rank + 1) * s]  # [S / cp, D / 2, 2]
