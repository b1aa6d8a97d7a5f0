"""Context parallelism for the LLaMA-style model of ``llama.py``: each rank holds a contiguous
shard of every sequence, its attention gathers K and V in float8 over the cp mesh
(:class:`~f8dist.parallel.cp.Float8ContextParallel` on every block's ``attention.sdpa``) and
rotates by the positions of its shard.

[Note: the LLaMA model under context parallelism]
The caller feeds rank ``r`` tokens ``[:, r * S / cp : (r + 1) * S / cp]`` and reduces the
gradients over the cp ranks as over data-parallel ones (FSDP2 over dp x cp, or an all-reduce):
each rank's loss covers its own tokens. Everything but attention is per token, so it runs on the
shard as one device does; float8 linears cast their rank's tokens as a data-parallel rank casts
its micro-batch (scales over the tokens are the shard's).

[Note: context parallelism with tensor parallelism]
On a (dp, cp, tp) mesh, apply :func:`~f8dist.models.llama_tp.parallelize_llama` over tp first:
its attention input all-gathers the sequence-parallel rows over tp back to the cp shard, and
wq/wk/wv give each tp rank its heads. The rope hook sits on ``attention`` after that gather, so
it reads the cp shard's length; the K/V cast is per token and head, so a tp rank's heads cast as
one device's, and each tp rank all-gathers its own heads' K and V over cp.
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
    With tensor parallelism, call it after ``parallelize_llama`` ([Note: context parallelism
    with tensor parallelism]).

    Example::

        >>> # xdoctest: +SKIP("needs a process group")
        >>> parallelize_llama_cp(model, init_device_mesh("cuda", (4,), mesh_dim_names=("cp",)))
        >>> logits = model(tokens.chunk(4, dim=1)[cp_rank])  # [B, S / 4, vocab]
    """
    style = Float8ContextParallel() if style is None else style
    rank = cp_mesh.get_local_rank()
    for block in model.layers.values():
        parallelize_module(block.attention.sdpa, cp_mesh, style)
        # after tp's input gather: [Note: context parallelism with tensor parallelism]
        block.attention.register_forward_pre_hook(
            functools.partial(_shard_rope, rank, cp_mesh.size()))
    return model


def _shard_rope(rank: int, cp: int, attention: nn.Module, args):
    """The attention's ``(x, rope)`` with the rotations of this rank's positions."""
    x, rope = args
    s = x.shape[1]  # [B, S / cp, dim] (a DTensor replicated over tp under tensor parallelism)
    if cp * s > rope.shape[0]:
        raise ValueError(f"context parallelism over {cp} ranks of {s} tokens each needs "
                         f"ModelArgs.max_seq_len >= {cp * s}, got {rope.shape[0]}")
    return x, rope[rank * s:(rank + 1) * s]  # [S / cp, D / 2, 2]
