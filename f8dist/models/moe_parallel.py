"""Expert parallelism for the MoE model of ``moe.py``, and EP x FSDP2.

The EP ranks are also data-parallel ranks, each routing its own batch ([Note: expert
parallelism] in f8dist/parallel/ep/dispatch.py).

[Note: EP x FSDP2]
On a 2-D mesh ``(dp_shard, ep)`` FSDP2 shards the experts over ``dp_shard`` on dim 1 (an expert's
gradient already sums the EP ranks' tokens) and everything else over the flattened mesh, as in
torchtitan. FSDP2 then averages an expert's gradient over dp_shard only, so the experts' gradients
are divided by the EP degree too (``GroupedExperts.grad_scale``; FSDP2's
``set_gradient_divide_factor`` needs ReduceOp.PREMUL_SUM, which gloo lacks).

[Note: MoE under tensor parallelism]
``moe_tp_plan`` keeps each MoE layer whole on every TP rank: its sequence-sharded input is
all-gathered over tp (in high precision) and each TP rank runs the whole sequence, keeping its
shard of the output: no reduction over tp, and routing sees what one device sees, for the price
of repeating the MoE's compute on the tp ranks. EP with TP is not implemented.
"""

from __future__ import annotations

from typing import Dict, Optional

import torch
import torch.nn as nn
from torch.distributed.tensor import DeviceMesh, DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ParallelStyle, PrepareModuleInputOutput, parallelize_module,
)

from f8dist.parallel.ep import Float8ExpertParallel
from f8dist.models.moe import MoE

__all__ = ["parallelize_moe", "fully_shard_moe", "moe_tp_plan"]


def parallelize_moe(model: nn.Module, ep_mesh: DeviceMesh, *, float8_dispatch: bool = True,
                    float8_combine: bool = False, float8_backward: bool = False) -> nn.Module:
    """Shard the experts of every :class:`MoE` in ``model`` over ``ep_mesh`` (in place) with
    :class:`~f8dist.parallel.ep.Float8ExpertParallel` and these options of it
    (``float8_dispatch``: [Note: float8 dispatch]; ``float8_combine``, ``float8_backward``:
    [Note: float8 combine and backward]). Convert to float8 before, FSDP2 after.

    Example::

        >>> # xdoctest: +SKIP("needs a process group")
        >>> convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name("rowwise"))
        >>> parallelize_moe(model, init_device_mesh("cpu", (2,), mesh_dim_names=("ep",)))
    """
    if ep_mesh.ndim != 1:
        raise ValueError(f"parallelize_moe takes a 1-D EP mesh, got {ep_mesh.mesh_dim_names}")
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    if not moes:
        raise ValueError(f"{type(model).__name__} has no MoE layer to shard")
    for moe in moes:
        e, w = moe.args.num_experts, ep_mesh.size()
        if e % w:
            raise ValueError(f"expert parallelism over {w} ranks needs num_experts ({e}) to be "
                             f"a multiple of it")
        parallelize_module(moe.experts, ep_mesh, Float8ExpertParallel(
            float8_dispatch=float8_dispatch, float8_combine=float8_combine,
            float8_backward=float8_backward))
    return model


def fully_shard_moe(model: nn.Module, mesh: DeviceMesh, *, ep_dim: str = "ep",
                    dp_dim: str = "dp_shard", dp_mesh: Optional[DeviceMesh] = None,
                    **kwargs) -> nn.Module:
    """FSDP2 for an expert-parallel model on the 2-D ``mesh`` ([Note: EP x FSDP2]), one unit per
    block; ``dp_mesh`` defaults to the flattened mesh, ``kwargs`` go to every ``fully_shard``.

    Example::

        >>> # xdoctest: +SKIP("needs a process group")
        >>> mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "ep"))
        >>> fully_shard_moe(parallelize_moe(model, mesh["ep"]), mesh)
    """
    from torch.distributed.fsdp import fully_shard

    ep = mesh[ep_dim].size()
    flat = dp_mesh if dp_mesh is not None else mesh._flatten("dp_ep")
    dp_mesh = mesh[dp_dim]
    for block in model.layers.values():
        moe: Optional[MoE] = getattr(block, "moe", None)
        if moe is not None:
            moe.experts.grad_scale = 1.0 / ep  # [Note: EP x FSDP2]
            fully_shard(moe.experts, mesh=dp_mesh, shard_placement_fn=lambda p: Shard(1),
                        **kwargs)
        fully_shard(block, mesh=flat, **kwargs)
    fully_shard(model, mesh=flat, **kwargs)
    return model


def moe_tp_plan(prefix: str, block: nn.Module, float8: bool) -> Dict[str, ParallelStyle]:
    """``parallelize_llama``'s ``ffn_plan`` for a :class:`~f8dist.models.moe.MoETransformer`
    ([Note: MoE under tensor parallelism]).

    Example::

        >>> # xdoctest: +SKIP("needs a process group")
        >>> parallelize_llama(moe_model, mesh["tp"], float8=True, ffn_plan=moe_tp_plan)
    """
    if not isinstance(getattr(block, "moe", None), MoE):
        raise TypeError(f"moe_tp_plan: block {prefix[:-1]} has no MoE named 'moe'")
    if any(isinstance(p, DTensor) for p in block.moe.experts.parameters()):
        raise NotImplementedError(
            f"{prefix}moe is expert parallel: tensor parallelism with expert parallelism (a 3-D "
            "mesh) is not implemented; use one of them"
        )
    return {prefix + "moe": PrepareModuleInputOutput(
        input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_input=True,
        output_layouts=Replicate(), desired_output_layouts=Shard(1), use_local_output=True,
    )}
