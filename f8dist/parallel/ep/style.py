"""Expert parallelism as a ``ParallelStyle``: the experts' weights sharded on the experts dim,
the token dispatch and combine as the experts module's input and output hooks.

[Note: the expert-parallel style]
``parallelize_module(experts, ep_mesh, Float8ExpertParallel())`` shards every parameter of the
experts module on dim 0 over the 1-D ``ep_mesh`` and, as torchtitan's ``ExpertParallel``, wraps
its forward: the input hook dispatches the caller's ``(tokens sorted by expert, group sizes
[E])`` ([Note: expert parallelism] in f8dist/parallel/ep/dispatch.py) and hands the module its local
tokens and group sizes; the output hook combines. Group sizes are offsets (int32, f8dist's
:class:`~f8dist.nn.grouped.GroupedExperts`) or token counts (e.g. torchtitan's experts), returned
in the same kind, so the caller's code is one device's.

The plan passes from input to output hook through a slot bound to the module's hooks (one style
may serve many modules). Nothing runs in between, so each forward, recompute included, reads its
own plan; backward's state lives in the autograd contexts, never in the slot.
"""

from __future__ import annotations

import functools
from typing import List, Optional

import torch
import torch.nn as nn
from torch.distributed.tensor import DeviceMesh, DTensor, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

from f8dist.core import agreement
from f8dist.parallel.ep.dispatch import COMBINE_SPEC, GRAD_SPEC, Plan, combine, dispatch
from f8dist.nn.grouped import GroupedExperts, token_spec

__all__ = ["Float8ExpertParallel"]


class Float8ExpertParallel(ParallelStyle):
    """Expert parallelism for an experts module ``forward(tokens, group_sizes)`` whose parameters
    are stacked per expert on dim 0 ([Note: the expert-parallel style]). Apply it after
    converting to float8, before FSDP2.

    Keyword Args:
        float8_dispatch (bool, optional): dispatch float8 tokens where the experts cast per
            token ([Note: float8 dispatch] in f8dist/parallel/ep/dispatch.py). Default True.
        float8_combine (bool, optional): combine the experts' outputs as e4m3 per token
            ([Note: float8 combine and backward]); other numbers than one device's run without
            it. Default False.
        float8_backward (bool, optional): send both backward all-to-alls' gradients as e4m3 per
            token (the same note). Default False.

    Example::

        >>> # xdoctest: +SKIP("needs a process group")
        >>> ep_mesh = init_device_mesh("cuda", (8,), mesh_dim_names=("ep",))
        >>> parallelize_module(model.layers[0].moe.experts, ep_mesh, Float8ExpertParallel())
    """

    def __init__(self, *, float8_dispatch: bool = True, float8_combine: bool = False,
                 float8_backward: bool = False):
        super().__init__()
        self.float8_dispatch = float8_dispatch
        self.float8_combine = float8_combine
        self.float8_backward = float8_backward

    def __repr__(self) -> str:
        # the ranks' agreement check compares reprs (f8dist/core/agreement.py): the options off
        # by default show when set
        extra = "".join(f", {name}=True" for name in ("float8_combine", "float8_backward")
                        if getattr(self, name))
        return f"{type(self).__name__}(float8_dispatch={self.float8_dispatch}{extra})"

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
        grad_spec = GRAD_SPEC if self.float8_backward else None
        local, plan = dispatch(tokens, counts, group, spec, grad_spec)  # [M_recv, dim]
        pending[0] = plan
        return local, plan.local_offsets if offsets else plan.local_counts.to(sizes.dtype)

    def _combine(self, group, pending, module: nn.Module, inputs, out):
        plan, pending[0] = pending[0], None
        spec = COMBINE_SPEC if self.float8_combine else None
        grad_spec = GRAD_SPEC if self.float8_backward else None
        return combine(out, plan, group, spec, grad_spec)  # [M, dim]
