"""A ready tensor + sequence parallel plan for the LLaMA-style model of ``llama.py``.

The plan is torchtitan's. With ``float8=True`` every :class:`~f8dist.nn.linear.Float8Linear` gets
the float8 style (its shared input all-gathered in float8); linears left in high precision keep
PyTorch's. Apply it after ``convert_to_float8_training`` and before ``fully_shard``.
"""

from __future__ import annotations

from typing import Callable, Dict, Optional

import torch
import torch.nn as nn
from torch.distributed.tensor import DeviceMesh, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from f8dist.core import agreement
from f8dist.nn.linear import Float8Linear
from f8dist.parallel.tp import Float8ColwiseParallel, Float8RowwiseParallel, PrepareFloat8ModuleInput

__all__ = ["llama_tp_plan", "parallelize_llama"]


def _colwise(mod: nn.Module, float8: bool, **kwargs) -> ParallelStyle:
    style = Float8ColwiseParallel if float8 and isinstance(mod, Float8Linear) else ColwiseParallel
    return style(**kwargs)


def _rowwise(mod: nn.Module, float8: bool, **kwargs) -> ParallelStyle:
    style = Float8RowwiseParallel if float8 and isinstance(mod, Float8Linear) else RowwiseParallel
    return style(**kwargs)


def _shared_input(parent: nn.Module, first: str, float8: bool, **layouts) -> ParallelStyle:
    """One all-gather of a block's input for the linears that share it; in float8 when they are
    Float8Linears (cast as ``first``'s input cast config says)."""
    if float8 and isinstance(parent.get_submodule(first), Float8Linear):
        return PrepareFloat8ModuleInput(fwd_config_submodule_fqn=first, **layouts)
    return PrepareModuleInput(**layouts)


# the plan of one block's FFN: (its FQN prefix "layers.N.", the block, float8) -> FQN -> style
FFNPlan = Callable[[str, nn.Module, bool], Dict[str, ParallelStyle]]


def swiglu_tp_plan(prefix: str, block: nn.Module, float8: bool) -> Dict[str, ParallelStyle]:
    """The dense SwiGLU FFN's styles: w1/w3 column-sharded behind one shared input all-gather,
    w2 row-sharded with a reduce-scatter back to sequence shards."""
    ffn = block.feed_forward
    return {
        prefix + "feed_forward": _shared_input(
            ffn, "w1", float8,
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
        ),
        prefix + "feed_forward.w1": _colwise(ffn.w1, float8),
        prefix + "feed_forward.w2": _rowwise(ffn.w2, float8, output_layouts=Shard(1)),
        prefix + "feed_forward.w3": _colwise(ffn.w3, float8),
    }


def llama_tp_plan(
    model: nn.Module, *, float8: bool = True, loss_parallel: bool = False,
    ffn_plan: Optional[FFNPlan] = None,
) -> Dict[str, ParallelStyle]:
    """The ``parallelize_module`` plan (FQN -> style) for a :class:`~f8dist.models.llama.Transformer`.

    ``float8=True`` needs a converted model. ``loss_parallel=True`` leaves the logits a
    vocab-sharded DTensor for ``loss_parallel``; else they are replicated local tensors.
    ``ffn_plan``: each block's FFN styles (default :func:`swiglu_tp_plan`).
    """
    for name in ("tok_embeddings", "layers", "norm", "output"):
        if not hasattr(model, name):
            raise TypeError(
                f"llama_tp_plan expects torchtitan's LLaMA module names (tok_embeddings, layers, "
                f"norm, output); {type(model).__name__} has no {name!r}"
            )
    if float8 and not any(isinstance(m, Float8Linear) for m in model.modules()):
        raise ValueError(
            f"llama_tp_plan(float8=True): {type(model).__name__} has no Float8Linear, so the plan "
            "would shard it with PyTorch's high-precision styles; call "
            "f8dist.convert_to_float8_training(model) before parallelizing, or pass float8=False "
            "for high-precision tensor parallelism"
        )
    plan: Dict[str, ParallelStyle] = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": _colwise(
            model.output, float8,
            input_layouts=Shard(1),
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        ),
    }
    for layer_name, block in model.layers.named_children():
        p = f"layers.{layer_name}."
        attn = block.attention
        plan.update({
            p + "attention_norm": SequenceParallel(),
            p + "attention": _shared_input(
                attn, "wq", float8,
                input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None),
            ),
            p + "attention.wq": _colwise(attn.wq, float8),
            p + "attention.wk": _colwise(attn.wk, float8),
            p + "attention.wv": _colwise(attn.wv, float8),
            p + "attention.wo": _rowwise(attn.wo, float8, output_layouts=Shard(1)),
            p + "ffn_norm": SequenceParallel(),
        })
        plan.update((ffn_plan or swiglu_tp_plan)(p, block, float8))
    return plan


def parallelize_llama(
    model: nn.Module, tp_mesh: DeviceMesh, *, float8: bool = True, loss_parallel: bool = False,
    ffn_plan: Optional[FFNPlan] = None,
) -> nn.Module:
    """Apply :func:`llama_tp_plan` to ``model`` over the 1-D ``tp_mesh``, in place; token ids in
    and logits out are replicated over tp (logits vocab-sharded with ``loss_parallel``).

    Example::

        >>> # xdoctest: +SKIP("needs a process group")
        >>> convert_to_float8_training(model, module_filter_fn=lambda m, fqn: fqn != "output")
        >>> parallelize_llama(model, mesh["tp"], float8=True)
        >>> for block in model.layers.values():
        ...     fully_shard(block, mesh=mesh["dp"])
        >>> fully_shard(model, mesh=mesh["dp"])
    """
    if tp_mesh.ndim != 1:
        raise ValueError(
            f"parallelize_llama takes the 1-D tp mesh, got a {tp_mesh.ndim}-D mesh "
            f"{tp_mesh.mesh_dim_names}; pass mesh['tp']"
        )
    heads = (model.args.n_heads, model.args.kv_heads) if hasattr(model, "args") else ()
    for h in heads:
        if h % tp_mesh.size():
            raise ValueError(
                f"tensor parallelism over {tp_mesh.size()} ranks shards attention heads, so "
                f"n_heads and n_kv_heads must be multiples of it; got {heads}"
            )
    plan = llama_tp_plan(model, float8=float8, loss_parallel=loss_parallel, ffn_plan=ffn_plan)
    agreement.check(model, tp_mesh)  # before sharding broadcasts: [Note: ranks that disagree]
    parallelize_module(model, tp_mesh, plan)
    if not loss_parallel:
        model.output.register_forward_hook(_logits_not_a_view)
    return model


# [Note: logits that are no view]
# ColwiseParallel(use_local_output=True) returns ``to_local()``, a view, and FSDP2 warns about a
# module returning a view. Nothing else holds the local tensor, so the hook makes the logits a
# tensor of their own with ``aten._unsafe_view`` (as aten::matmul does), no copy.


def _logits_not_a_view(module: nn.Module, args, output):
    """[Note: logits that are no view]"""
    return torch.ops.aten._unsafe_view(output, output.shape)
