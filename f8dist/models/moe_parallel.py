"""Expert parallelism for the MoE model of ``moe.py``, and EP x FSDP2.

``parallelize_moe(model, ep_mesh)`` applies :class:`~f8dist.ep.Float8ExpertParallel` to every
MoE layer's experts: their weights sharded on the experts dim over the 1-D ``ep_mesh`` (DTensors,
``Shard(0)``), their tokens routed with all-to-alls in the style's hooks ([Note: expert
parallelism] in f8dist/ep/dispatch.py), in float8 where the experts' up projections cast per
token ([Note: float8 dispatch]). Every other parameter is replicated over the EP ranks,
which also are data-parallel ranks: each routes its own batch, and the replicated parameters'
gradients are averaged (FSDP2 does it, see :func:`fully_shard_moe`).

[Note: EP x FSDP2]
On a 2-D mesh ``(dp_shard, ep)`` the experts are sharded over ``ep`` on dim 0 and over
``dp_shard`` by FSDP2 on dim 1 (a mesh of its own, ``dp_shard`` only: an expert's gradient is
already the sum over the EP ranks' tokens); every other parameter is sharded by FSDP2 over the
flattened ``(dp_shard, ep)`` mesh, as in torchtitan. FSDP2's gradient of an expert weight is the
mean over the dp_shard ranks only, so the experts' gradients are divided by the EP degree too
(``GroupedExperts.grad_scale``, in backward before the reduce-scatter: FSDP2's own
``set_gradient_divide_factor`` needs ReduceOp.PREMUL_SUM, which gloo lacks) to be the mean over
all data-parallel ranks, as the other parameters'.

[Note: MoE under tensor parallelism]
``parallelize_llama(model, tp_mesh, ffn_plan=moe_tp_plan)`` shards the MoE transformer's attention
and output as the dense plan does (f8dist/models/llama_tp.py: wq/wk/wv column-, wo row-sharded,
norms sequence parallel), and keeps each MoE layer whole on every TP rank: its input, sequence
sharded after ``ffn_norm``, is all-gathered over tp; every TP rank routes and runs the experts
(and the shared expert) on the whole sequence, the same computation on the same tokens, and keeps
its own sequence shard of the output. Backward all-gathers the output's gradient, so each TP rank
computes the whole gradient of the MoE's parameters and of its input, the same on every TP rank:
no reduction over tp, and the routing, the capacity limit and the load-balancing loss see the
sequence one device sees. The price: the MoE's compute is repeated on the tp ranks (experts
replicated over tp; the all-gather and the gradient all-gather carry high-precision activations).
Expert parallelism with TP (a 3-D mesh) is not implemented.
"""

from __future__ import annotations

from typing import Dict, Optional

import torch
import torch.nn as nn
from torch.distributed.tensor import DeviceMesh, DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ParallelStyle, PrepareModuleInputOutput, parallelize_module,
)

from f8dist.ep import Float8ExpertParallel
from f8dist.models.moe import MoE

__all__ = ["parallelize_moe", "fully_shard_moe", "moe_tp_plan"]


def parallelize_moe(model: nn.Module, ep_mesh: DeviceMesh, *, float8_dispatch: bool = True
                    ) -> nn.Module:
    """Shard the experts of every :class:`MoE` in ``model`` over ``ep_mesh`` (in place).
    ``float8_dispatch=False`` sends the tokens in high precision ([Note: float8 dispatch]).
    Convert to float8 before, FSDP2 after.

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
            float8_dispatch=float8_dispatch))
    return model


def fully_shard_moe(model: nn.Module, mesh: DeviceMesh, *, ep_dim: str = "ep",
                    dp_dim: str = "dp_shard", dp_mesh: Optional[DeviceMesh] = None,
                    **kwargs) -> nn.Module:
    """FSDP2 for an expert-parallel model on the 2-D ``mesh`` ([Note: EP x FSDP2]): experts over
    ``mesh[dp_dim]`` on dim 1, everything else over ``dp_mesh`` (default: the flattened mesh),
    one FSDP unit per block. ``kwargs`` go to every ``fully_shard`` (e.g. ``mp_policy``).

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
    """The tensor-parallel style of an MoE block's FFN ([Note: MoE under tensor parallelism]):
    the ``ffn_plan`` of ``parallelize_llama`` for a :class:`~f8dist.models.moe.MoETransformer`.

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
