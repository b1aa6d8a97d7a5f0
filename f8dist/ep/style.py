"""Expert parallelism as a ``ParallelStyle``: the experts' weights sharded on the experts dim,
the token dispatch and combine as the experts module's input and output hooks.

[Note: the expert-parallel style]
``parallelize_module(experts, ep_mesh, Float8ExpertParallel())`` shards every parameter of the
experts module on dim 0 (``Shard(0)`` DTensors over the 1-D ``ep_mesh``: rank ``r`` holds experts
``[r * E / W, (r + 1) * E / W)``) and wraps its forward, as torchtitan's ``ExpertParallel`` does:

* the input hook takes the caller's ``(tokens [M, dim] sorted by expert, group sizes [E])``,
  plans and dispatches them ([Note: expert parallelism] in f8dist/ep/dispatch.py; float8 bytes
  and scales where the experts cast per token: [Note: float8 dispatch]) and hands the module its
  local tokens, expert-major, and its local group sizes [E / W];
* the output hook brings the local outputs back to the caller's rows (the combine).

The group sizes are offsets (cumulative, int32: f8dist's :class:`~f8dist.grouped.GroupedExperts`)
or token counts (anything else, e.g. torchtitan's experts, ``forward(x, num_tokens_per_expert)``),
and the module gets back the same kind. The caller's code is one device's: no branch on expert
parallelism.

The plan (split sizes and the permutation) passes from the input hook to the output hook of the
same call through a slot of the module's hooks (not the module, not the style: one style may be
applied to many modules). The input hook fills it and the output hook empties it, and nothing
runs the module in between, so each forward reads its own plan: also activation checkpointing's
recompute, which re-runs both hooks (a recompute stopped early leaves a plan that the next input
hook replaces). The autograd functions keep what backward needs in their contexts, never in the
slot.
"""

from __future__ import annotations

import functools
from typing import List, Optional

import torch
import torch.nn as nn
from torch.distributed.tensor import DeviceMesh, DTensor, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

from f8dist import agreement
from f8dist.ep.dispatch import Plan, combine, dispatch
from f8dist.grouped import GroupedExperts, token_spec

__all__ = ["Float8ExpertParallel"]


class Float8ExpertParallel(ParallelStyle):
    """Expert parallelism for an experts module ``forward(tokens, group_sizes)`` whose parameters
    are stacked per expert on dim 0 ([Note: the expert-parallel style]): its weights are sharded
    over the 1-D mesh on dim 0, its tokens dispatched to their experts' ranks before forward and
    combined back after. Apply it after converting to float8, before FSDP2.

    Keyword Args:
        float8_dispatch (bool, optional): when the experts cast their tokens per token, cast them
            before the dispatch and send float8 bytes and scales ([Note: float8 dispatch] in
            f8dist/ep/dispatch.py); False sends them as they come. Default True.

    Example::

        >>> # xdoctest: +SKIP("needs a process group")
        >>> ep_mesh = init_device_mesh("cuda", (8,), mesh_dim_names=("ep",))
        >>> parallelize_module(model.layers[0].moe.experts, ep_mesh, Float8ExpertParallel())
    """

    def __init__(self, *, float8_dispatch: bool = True):
        super().__init__()
        self.float8_dispatch = float8_dispatch

    def __repr__(self) -> str:
        return f"{type(self).__name__}(float8_dispatch={self.float8_dispatch})"

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        name = type(self).__name__
        if device_mesh.ndim != 1:
            raise ValueError(f"{name} takes a 1-D EP mesh, got {device_mesh.mesh_dim_names}")
        params = list(module.named_parameters(recurse=False))
        if not params:
            raise ValueError(f"{name}: {type(module).__name__} has no parameters of its own to "
                             "shard on the experts dim; apply it to the experts module")
        if any(isinstance(p, DTensor) for _, p in params):
            raise ValueError(f"{name}: {type(module).__name__}'s parameters already are "
                             "DTensors; apply expert parallelism once, before FSDP2")
        w = device_mesh.size()
        e = params[0][1].shape[0]
        if e % w:
            raise ValueError(f"expert parallelism over {w} ranks needs num_experts ({e}) to be "
                             f"a multiple of it")
        for pname, param in params:
            sharded = distribute_tensor(param.detach(), device_mesh, [Shard(0)])
            setattr(module, pname, nn.Parameter(sharded, requires_grad=param.requires_grad))
        agreement.record_style(module, self)
        group = device_mesh.get_group()
        pending: List[Optional[Plan]] = [None]  # the plan between this module's two hooks
        module.register_forward_pre_hook(functools.partial(self._dispatch, group, pending))
        module.register_forward_hook(functools.partial(self._combine, group, pending))
        return module

    def _dispatch(self, group, pending, module: nn.Module, inputs):
        tokens, sizes = inputs
        offsets = isinstance(module, GroupedExperts)  # else token counts
        counts = torch.diff(sizes, prepend=sizes.new_zeros(1)).long() if offsets else sizes
        specs = getattr(module, "specs", None)
        spec = token_spec(specs) if self.float8_dispatch and specs is not None else None
        local, plan = dispatch(tokens, counts, group, spec)  # [M_recv, dim]
        pending[0] = plan
        return local, plan.local_offsets if offsets else plan.local_counts.to(sizes.dtype)

    def _combine(self, group, pending, module: nn.Module, inputs, out):
        plan, pending[0] = pending[0], None
        return combine(out, plan, group)  # [M, dim]
