"""Float8 tensor- and sequence-parallel styles: PyTorch's styles, communicating in float8.

``Float8ColwiseParallel``, ``Float8RowwiseParallel`` and ``PrepareFloat8ModuleInput`` subclass
``torch.distributed.tensor.parallel``'s ``ColwiseParallel``, ``RowwiseParallel`` and
``PrepareModuleInput``: they take the same keyword arguments, shard the same way, and override
only the hooks those styles are built from (``_apply``, ``_prepare_input_fn`` /
``_prepare_input_arg``, ``_prepare_output_fn``). What changes:

[Note: cast before communicating]
An activation that must be redistributed before a float8 gemm (the sequence-parallel all-gather
``Shard(1) -> Replicate``) is cast to float8 *first*, as the consuming linear's
``(output, input)`` cast spec says, so the all-gather moves 1 byte per element ([Note: float8 on
the wire] in f8dist/tensor.py) and the linear reuses the gathered bytes instead of casting again.
The cast is ``cast_to_float8`` on the sharded DTensor, so its amax is the amax of the logical
tensor ([Note: amax] in f8dist/placement.py): a tensorwise amax is all-reduced over tp, a per-token
(axiswise) amax needs no collective because each token's row lives on one rank.

Symmetrically, the gradient of a rowwise-parallel output that was reduce-scattered to sequence
shards comes back sequence-sharded and is all-gathered in backward: it is cast to float8 (the
``(grad_input, grad_output)`` cast) before that all-gather.

The grad_weight gemm takes the same tensor scaled along the other axis, or in high precision:
[Note: the grad_weight gemm under sequence parallelism] says how it still gets one device's
operand. Layers whose input needs no redistribution are not cast here at all.

[Note: the grad_weight gemm under sequence parallelism]
The output gemm scales the SP input along K (per token, or 1 x K row blocks), but the grad_weight
gemm contracts over the tokens: one device casts the high-precision input along the tokens, or
reads it in high precision. Re-casting the gathered float8 would round twice (weight gradients
far from one device's: tests/distributed/test_tp.py, figures in docs/numerics.md),
so the style picks, per consuming linear's ``(grad_weight, input)`` spec and per forward (the
token count is the batch's), with ``_grad_weight_cast``:

* block scales along the tokens, shards holding whole token blocks (the rule of
  ``blocks_split_by_shards``, [Note: token blocks of N-D activations] in f8dist/specs.py): the
  local high-precision shard is cast twice, in row blocks and in token blocks, and the second
  cast travels as the first's companion ([Note: two casts of one tensor] in f8dist/tensor.py):
  the all-gather moves both, 2 x (1 byte + scales) per element, in forward; the linear keeps only
  the token-block bytes for backward (1 byte per element, as before: memory unchanged). Every
  gemm reads one device's bytes, no collective added.
* a high-precision grad_weight gemm (mxfp8_wgrad_with_hp, rowwise_with_gw_hp), or token blocks
  that the sequence shards split (1x128 blocks need 128 * tp tokens per sequence, 1x32 ones
  32 * tp): the input is all-gathered in high precision (2 bytes per element in bf16, 4 in fp32)
  and the linear casts after the gather, as one device does; it keeps the high-precision input
  for backward, as one device does (2 bytes per element in bf16, where the gathered float8 kept
  1). Exactness costs the bytes either way: the grad_weight gemm's operand cannot be derived from
  the row-block bytes without a second rounding, so an exact path moves two float8 casts (1.03x
  bf16's bytes with their scales) or high precision, never 0.52x.
  ``Float8LinearConfig.sp_grad_weight`` trades otherwise ([Note: the grad_weight operand of a
  gathered tensor] in f8dist/cells.py): with "recast" this rule answers None (the row blocks
  only, re-cast in backward); with "backward_gather" the token-block cast stays on its rank
  (``_cast_input``'s ``keep``: a ``KeptShard``) and the linears all-gather it in backward, once
  per shared input (Transformer Engine's way): the same bytes, 1 / tp of them kept.
* tensorwise (the same bytes serve both gemms) and rowwise (per-column scales over the tokens,
  powers of 2, so re-scaling the gathered per-token bytes is exact but for e4m3 subnormals):
  unchanged, the gathered float8 is reused or re-scaled.

The rowwise style's gradient takes the same choice for its ``(grad_weight, grad_output)`` cast:
cast with its token-block companion before the backward all-gather, or all-gathered in high
precision. Under torch.compile neither is made ([Note: float8 gradients under compile]): the
grad_weight gemm re-casts the gathered float8 input, as before.

[Note: which redistributions carry float8]
An axiswise cast is not made before a redistribution that shards its scaled-over dim on either
side, e.g. a rowwise recipe's input (one scale per token, over K) going ``Replicate() ->
Shard(-1)`` into ``Float8RowwiseParallel(input_layouts=Replicate())``. Float8 shards cannot be
reassembled along the dim their scales span, and that redistribution is a local split that moves
no bytes, so casting first would save nothing and would hand the grad_weight gemm (scaled over
tokens, or in high precision for rowwise_with_gw_hp) a re-scaled or dequantized float8 copy where
one device uses the high-precision input. The input is split in high precision and the linear
casts its shard with the amax of the logical row (one ``[M, 1]`` all-reduce, [Note: amax]): one
device's scales and bytes. A tensorwise cast is still made first: its scale is the replicated
tensor's amax (no collective) and a split keeps it, giving one device's bytes.

[Note: block scales on tensor-parallel shards]
Block-scaled recipes ([Note: block scales] in f8dist/cells.py) take the same styles and run no
amax collective: a block's scale is its own. The 1 x K blocks of an activation or gradient are
local to a token, so the sequence-parallel input (and the rowwise style's gradient) is cast in
[B, S, K] row blocks before its all-gather and its scale grid travels with its shards ([Note:
row blocks of N-D activations]): the gathered bytes and scales are those of a cast after the
gather, bit for bit. Weights are sharded on block boundaries (colwise: out_features, rowwise:
in_features) and cast shard by shard; a TP degree whose shards would split a block of any of the
layer's casts (a weight's 1x32, 128x128 or 32x32 blocks, the sharded activation's or gradient's
1 x K ones) raises when the style is applied, naming the fix, by the rule of f8dist/placement.py
(``blocks_split_by_shards``). The grad_weight gemm blocks its operands along the tokens: its
cast of the local shard travels with the row-block cast, or the tensor moves in high precision
where sequence shards would split token blocks ([Note: the grad_weight gemm under sequence
parallelism]).

[Note: float8 gradients under compile]
The backward float8 all-gather makes a gradient change type on its way (a high-precision DTensor
becomes a DTensor of Float8Tensors). torch.compile traces an autograd.Function's backward when it
traces the forward, assuming a gradient of the forward output's type, so the linear's compiled
backward would treat the float8 gradient as high precision (and fail on it). Under torch.compile
the rowwise style therefore all-gathers the gradient in high precision; forward activations are
still cast before their all-gather. Eager mode sends float8 both ways.

[Note: delayed casts in the float8 styles]
With ``ScalingType.DELAYED`` the casts above take their scale from the amax history of the linear
that consumes the tensor ([Note: delayed scaling] in f8dist/delayed/), as the linear would:
the style records the amax of the rank's *shard* (forward: the input; backward, rowwise style:
the sequence-sharded gradient) into the linear and casts with its scale. The linear reuses the
float8 bytes and records nothing more, and the sync's one MAX all-reduce makes the shard amaxes
the logical tensor's, so every rank holds one device's histories. The bytes must share one scale
on every rank, so whether the history's scale is out of range for this step ([Note: out of range])
is decided on the logical amax: one scalar all-reduce per cast (on the first step, [Note: first
step], over all ranks).

A shared input (``PrepareFloat8ModuleInput`` with ``fwd_config_submodule_fqn``) is cast once with
the named linear's scale and its amax is recorded into *every* delayed Float8Linear below the
module: the linears consuming it (wq/wk/wv, w1/w3) thus hold the same histories, as on one device;
for the others it is a tentative record, which the first cast of their own input in the step (wo,
w2) replaces. Caveat: a delayed linear below the module that does not run in a step keeps the
shared amax.
"""

from __future__ import annotations

import copy
import math
from typing import Optional, Sequence

import torch
import torch.nn as nn
from torch.distributed.tensor import DeviceMesh, DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel

from f8dist import agreement
from f8dist.cast import ToFloat8, cast_with_companion
from f8dist.config import (
    E4M3, CastConfig, CastSpec, CastSpecs, Float8LinearConfig, Gemm, Operand, ScalingType,
    SPGradWeight,
)
from f8dist.delayed import shared_scale
from f8dist.gemm import check_gemm_shape
from f8dist.linear import Float8Linear
from f8dist.placement import blocks_split_by_shards, has_partial

__all__ = ["Float8ColwiseParallel", "Float8RowwiseParallel", "PrepareFloat8ModuleInput"]

OUTPUT_INPUT = (Gemm.OUTPUT, Operand.INPUT)
GRAD_INPUT_GRAD_OUTPUT = (Gemm.GRAD_INPUT, Operand.GRAD_OUTPUT)


# ---------------------------------------------------------------------------------------------
# casts made outside the linear
# ---------------------------------------------------------------------------------------------


def _scale_for(spec: CastSpec, linears: Sequence[Float8Linear], x: torch.Tensor, record=None):
    """The scale of a cast of ``x`` made for ``linears`` outside their forward: None (dynamic),
    or, when they keep an amax history of the operand, the delayed scale after recording ``x``'s
    amax into them ([Note: delayed casts in the float8 styles]). The operand is recorded even when
    only another gemm's cast of it is delayed: the linears get float8 bytes and cannot record it.
    ``record``: that of the forward whose gradient ``x`` is (see ``shared_scale``)."""
    if not linears or linears[0].delayed is None or not linears[0].delayed.keeps(spec.operand):
        return None
    scale = shared_scale([m.delayed for m in linears], spec.operand, x, record)
    return scale if spec.scaling_type is ScalingType.DELAYED else None


_HIGH_PRECISION = "high_precision"


def _grad_weight_cast(x: torch.Tensor, specs: Optional[CastSpecs], operand: Operand):
    """How the grad_weight gemm of the linear with ``specs`` gets one device's ``operand`` when
    ``x`` is cast before it is communicated ([Note: the grad_weight gemm under sequence
    parallelism]): None (it reads the communicated bytes, or re-scales them: tensorwise, rowwise,
    and under torch.compile), its CastSpec (its own cast of ``x`` travels along as a companion,
    or stays behind for a backward all-gather: block scales along the tokens) or
    ``_HIGH_PRECISION`` (communicate ``x`` unscaled: a high-precision grad_weight gemm, or token
    blocks that the sequence shards split). None too where no grad_weight gemm will read it (no
    grad: eval, inference), there is nothing to round (an empty batch) or the linear puts bytes
    first (``SPGradWeight.RECAST``: the gemm re-casts the communicated bytes; [Note: the
    grad_weight operand of a gathered tensor] in f8dist/cells.py)."""
    if (specs is None or torch.compiler.is_compiling() or not torch.is_grad_enabled()
            or x.numel() == 0 or specs.sp_grad_weight is SPGradWeight.RECAST
            or not specs.own_grad_weight_operand(operand)):
        return None
    grad_weight = specs[Gemm.GRAD_WEIGHT, operand]
    if not grad_weight.enabled:
        return _HIGH_PRECISION
    mesh = getattr(x, "device_mesh", None)
    split = blocks_split_by_shards(x.shape, grad_weight.block_shape(x.dim()),
                                   mesh.shape if mesh is not None else (),
                                   getattr(x, "placements", ()))
    return _HIGH_PRECISION if split else grad_weight


def _cast_input(
    x: torch.Tensor, spec: CastSpec, linears: Sequence[Float8Linear], desired_layouts=()
) -> torch.Tensor:
    """``x`` cast to float8 for ``linears`` (differentiable: gradients pass in high precision),
    carrying the grad_weight gemm's cast when it needs one, or keeping it on this rank for a
    backward all-gather ([Note: the grad_weight gemm under sequence parallelism]); or ``x``
    itself when a redistribution to ``desired_layouts`` would shard the dim an axiswise cast
    scales over ([Note: which redistributions carry float8]) or the grad_weight gemm needs it in
    high precision."""
    # the dim its scales span: an axiswise cast's scaled-over dim, a block cast's inner dim
    axis = spec.axis % x.dim() if spec.axiswise or spec.blockwise else None
    layouts = (*getattr(x, "placements", ()), *desired_layouts)
    if not spec.enabled or any(isinstance(p, Shard) and p.dim % x.dim() == axis for p in layouts):
        return x
    specs = linears[0].specs if linears else None
    other = _grad_weight_cast(x, specs, Operand.INPUT)
    if other == _HIGH_PRECISION:
        return x
    keep = (other is not None and specs.sp_grad_weight is SPGradWeight.BACKWARD_GATHER
            and isinstance(x, DTensor))
    return ToFloat8.apply(x, spec, _scale_for(spec, linears, x), other, keep)


class _CastGradToFloat8(torch.autograd.Function):
    """Identity in forward; in backward casts the gradient of ``mod``'s output as its
    ``(grad_input, grad_output)`` spec says, so that what backward communicates next moves in
    float8 (a delayed cast records into ``mod`` and uses its scale); ``other``: the grad_weight
    gemm's cast, carried along ([Note: the grad_weight gemm under sequence parallelism])."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, mod: Float8Linear, other: Optional[CastSpec] = None):
        # a backward exists only for a forward with grad enabled: it recorded unless in eval()
        ctx.mod, ctx.record, ctx.other = mod, mod.training, other
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        spec = ctx.mod.specs[GRAD_INPUT_GRAD_OUTPUT]
        scale = _scale_for(spec, [ctx.mod], grad, ctx.record)
        return cast_with_companion(grad, spec, ctx.other, scale), None, None


# ---------------------------------------------------------------------------------------------
# checks made when a style is applied
# ---------------------------------------------------------------------------------------------


def _float8_linear(module: nn.Module, style: str) -> Float8Linear:
    if isinstance(module, Float8Linear):
        return module
    hint = (
        "convert it with f8dist.convert_to_float8_training first, or use PyTorch's "
        f"{style.replace('Float8', '')} to keep it in high precision"
        if isinstance(module, nn.Linear)
        else f"{style} shards Float8Linear layers only (nn.Embedding and other modules take "
        "PyTorch's own styles)"
    )
    raise TypeError(f"{style} got a {type(module).__name__}, not a Float8Linear: {hint}")


def _check_castable_layouts(style: str, layouts) -> None:
    if has_partial(layouts):
        raise ValueError(
            f"{style}: input layouts ({', '.join(map(str, layouts))}) cannot be cast to float8: the amax of "
            "partial sums is not the amax of their sum. Reduce the input first (pass Replicate() "
            "or Shard(d))."
        )


def _check_local_gemm(module: Float8Linear, mesh: DeviceMesh, sharded: str, style: str) -> None:
    """Fail at parallelize time if a shard makes a gemm dim that torch._scaled_mm cannot take."""
    config = module.config
    if config.emulate or config.pad_inner_dim:
        return
    tp = mesh.size()
    in_f, out_f = module.in_features, module.out_features
    full = in_f if sharded == "in" else out_f
    chunk = math.ceil(full / tp)
    shard_sizes = sorted({min(chunk, full - i * chunk) for i in range(tp) if full > i * chunk})
    for size in shard_sizes:
        k, n = (size, out_f) if sharded == "in" else (in_f, size)
        check_gemm_shape(
            k, n, pad_inner_dim=False,
            what=(
                f"{style} on {module.fqn or '<root>'} ({in_f} -> {out_f}) over {tp} ranks: "
                f"local shard of {sharded}_features = {size}"
            ),
        )


def _check_blocks(module: Float8Linear, tp: int, sharded: str, style: str) -> None:
    """Fail at parallelize time if a shard over ``tp`` ranks splits a block of a block-scaled
    cast ([Note: block scales on tensor-parallel shards]), by the rule of f8dist/placement.py."""
    if module.config.pad_inner_dim:
        return
    in_f, out_f = module.in_features, module.out_features
    # the 2-D operands a shard cuts, with the dim it cuts (the token count M does not matter)
    cut = {Operand.WEIGHT: ((out_f, in_f), 0 if sharded == "out" else 1)}
    cut[Operand.INPUT if sharded == "in" else Operand.GRAD_OUTPUT] = (
        (1, in_f if sharded == "in" else out_f), 1)
    for spec in module.specs:
        if not (spec.enabled and spec.blockwise and spec.operand in cut):
            continue
        shape, dim = cut[spec.operand]
        placements = [Shard(dim)]
        split = blocks_split_by_shards(shape, spec.block_shape(2), [tp], placements)
        if split:
            features = "in_features" if sharded == "in" else "out_features"
            block = spec.block_shape(2)[dim]
            raise ValueError(
                f"{style} on {module.fqn or '<root>'} ({in_f} -> {out_f}) over {tp} ranks: the "
                f"{spec.gemm} gemm's {spec.operand} cast has {spec.block_shape(2)} blocks and {split}. "
                f"Use a tensor-parallel degree that leaves {features} / tp a multiple of {block}, "
                f"make {features} a multiple of {block} * tp, or keep this layer in high precision "
                "(module_filter_fn)"
            )


def _replicate_in_place(module: nn.Module, mesh: DeviceMesh) -> None:
    """Make the delayed buffers of ``module`` Replicate DTensors of the values they hold: every
    rank holds the same initial values, so ``distribute_module`` needs no broadcast per buffer,
    and ranks that disagree on delayed scaling reach the agreement check instead of hanging in
    one ([Note: ranks that disagree] in f8dist/agreement.py)."""
    names = module.delayed.buffer_names if module.delayed is not None else ()
    for name in names:
        module._buffers[name] = _as_dtensor(module._buffers[name], mesh, [Replicate()] * mesh.ndim)


def _as_dtensor(x: torch.Tensor, mesh: DeviceMesh, layouts) -> DTensor:
    return x if isinstance(x, DTensor) else DTensor.from_local(x, mesh, layouts, run_check=False)


# ---------------------------------------------------------------------------------------------
# styles
# ---------------------------------------------------------------------------------------------


class _Float8LinearStyle:
    """What :class:`Float8ColwiseParallel` and :class:`Float8RowwiseParallel` add to PyTorch's
    style (the next base class): checks at ``_apply`` and the input cast of [Note: cast before
    communicating]. Subclasses name the features they shard (``_sharded_features``)."""

    _sharded_features: str  # "out" (colwise) or "in" (rowwise)

    def check_blocks(self, module: nn.Module, tp: int) -> None:
        """Raise, naming the fix, if sharding ``module`` over ``tp`` ranks would split a block of
        its block-scaled casts: what ``_apply`` checks, callable before any process group exists
        (a training script's flag check, on a model built on the meta device)."""
        module = _float8_linear(module, type(self).__name__)
        _check_blocks(module, tp, self._sharded_features, type(self).__name__)

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        _check_castable_layouts(type(self).__name__, self.input_layouts)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        name = type(self).__name__
        module = _float8_linear(module, name)
        _check_local_gemm(module, device_mesh, self._sharded_features, name)
        _check_blocks(module, device_mesh.size(), self._sharded_features, name)
        agreement.record_style(module, self)
        _replicate_in_place(module, device_mesh)
        return super()._apply(module, device_mesh)

    def _prepare_input_fn(self, input_layouts, desired_input_layouts, mod, inputs, device_mesh):
        if input_layouts != desired_input_layouts:  # it will be communicated: float8 first
            x = _as_dtensor(inputs[0], device_mesh, input_layouts)
            inputs = (_cast_input(x, mod.specs[OUTPUT_INPUT], [mod], desired_input_layouts),
                      *inputs[1:])
        return super()._prepare_input_fn(
            input_layouts, desired_input_layouts, mod, inputs, device_mesh
        )


class Float8ColwiseParallel(_Float8LinearStyle, ColwiseParallel):
    """``ColwiseParallel`` for a :class:`~f8dist.linear.Float8Linear`, communicating in float8.

    The weight is sharded on ``out_features`` (``Shard(0)``) and its float8 scale comes from the
    amax of the whole weight (all-reduced over tp). An input that arrives in another layout than
    ``Replicate()`` (sequence parallel: ``input_layouts=Shard(1)``) is cast to float8 with the
    layer's input cast spec *before* the all-gather, so the all-gather moves 1 byte per element
    (see [Note: cast before communicating]).

    Keyword Args:
        input_layouts (Placement, optional): layout of the module input; default ``Replicate()``.
        output_layouts (Placement, optional): layout of the module output; default ``Shard(-1)``.
        use_local_output (bool, optional): return a local tensor instead of a DTensor; default True.

    Example::

        >>> # xdoctest: +SKIP("needs a process group")
        >>> from torch.distributed.tensor import Shard
        >>> from torch.distributed.tensor.parallel import parallelize_module
        >>> convert_to_float8_training(model)
        >>> parallelize_module(model, tp_mesh, {
        ...     "w1": Float8ColwiseParallel(input_layouts=Shard(1)),  # SP input, gathered in float8
        ...     "w2": Float8RowwiseParallel(output_layouts=Shard(1)),
        ... })
    """

    _sharded_features = "out"


class Float8RowwiseParallel(_Float8LinearStyle, RowwiseParallel):
    """``RowwiseParallel`` for a :class:`~f8dist.linear.Float8Linear`, communicating in float8.

    The weight is sharded on ``in_features`` (``Shard(1)``); the output is a partial sum that is
    all-reduced (``output_layouts=Replicate()``) or reduce-scattered (``Shard(1)``, sequence
    parallel) in high precision. With a sharded output, the gradient that comes back is cast to
    float8 before backward all-gathers it. An input that needs redistributing to ``Shard(-1)`` is
    cast to float8 before it moves when its scales survive the split (tensorwise; see [Note: which
    redistributions carry float8]).

    Keyword Args:
        input_layouts (Placement, optional): layout of the module input; default ``Shard(-1)``.
        output_layouts (Placement, optional): layout of the module output; default ``Replicate()``.
        use_local_output (bool, optional): return a local tensor instead of a DTensor; default True.

    Example::

        >>> # xdoctest: +SKIP("needs a process group")
        >>> parallelize_module(attention, tp_mesh, {
        ...     "wq": Float8ColwiseParallel(),
        ...     "wo": Float8RowwiseParallel(output_layouts=Shard(1)),  # reduce-scatter to SP
        ... })
    """

    _sharded_features = "in"

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
        outputs = RowwiseParallel._prepare_output_fn(output_layouts, False, mod, outputs, device_mesh)
        if (
            any(isinstance(p, Shard) for p in output_layouts)
            and mod.bias is None
            and mod.specs.gemm_in_float8(Gemm.GRAD_INPUT)
            and not torch.compiler.is_compiling()  # [Note: float8 gradients under compile]
        ):
            # backward all-gathers the sharded gradient: cast it to float8 first, with the
            # grad_weight gemm's own cast (the gradient has the output's shape and layout)
            other = _grad_weight_cast(outputs, mod.specs, Operand.GRAD_OUTPUT)
            if other != _HIGH_PRECISION:
                outputs = _CastGradToFloat8.apply(outputs, mod, other)
        return outputs.to_local() if use_local_output else outputs


class PrepareFloat8ModuleInput(PrepareModuleInput):
    """``PrepareModuleInput`` that casts the inputs it redistributes to float8 first.

    Put it on a module whose float8 linears share one input (attention's wq/wk/wv, a SwiGLU FFN's
    w1/w3): the input is cast once, with the input cast spec of the linear named by
    ``fwd_config_submodule_fqn``, all-gathered once in float8, and every linear reuses the bytes.
    Those linears then take ``Float8ColwiseParallel()`` (their input already is ``Replicate()``).

    Keyword Args:
        input_layouts, desired_input_layouts, input_kwarg_layouts, desired_input_kwarg_layouts,
        use_local_output: as in ``PrepareModuleInput``.
        float8_dtype (torch.dtype, optional): the float8 dtype of a tensorwise dynamic cast, used
            only without ``fwd_config_submodule_fqn``; default ``torch.float8_e4m3fn``.
        fwd_config_submodule_fqn (str, optional): FQN (relative to this module) of the
            Float8Linear whose ``(output, input)`` cast the cast follows. Give it whenever the
            linears use a non-default recipe, so their bytes are reused rather than re-cast.

    Example::

        >>> # xdoctest: +SKIP("needs a process group")
        >>> parallelize_module(block, tp_mesh, {
        ...     "feed_forward": PrepareFloat8ModuleInput(
        ...         input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
        ...         fwd_config_submodule_fqn="w1",  # w1 and w3 share one float8 all-gather
        ...     ),
        ...     "feed_forward.w1": Float8ColwiseParallel(),
        ...     "feed_forward.w3": Float8ColwiseParallel(),
        ...     "feed_forward.w2": Float8RowwiseParallel(output_layouts=Shard(1)),
        ... })
    """

    # set on the copy of the style that _apply binds to one module
    _spec: Optional[CastSpec] = None
    _linears: Sequence[Float8Linear] = ()

    def __init__(self, *, float8_dtype: Optional[torch.dtype] = None,
                 fwd_config_submodule_fqn: Optional[str] = None, **kwargs):
        super().__init__(**kwargs)  # PrepareModuleInput's keywords
        if float8_dtype is not None and fwd_config_submodule_fqn is not None:
            raise ValueError(
                "PrepareFloat8ModuleInput: pass float8_dtype or fwd_config_submodule_fqn, not "
                "both; the submodule's config already fixes the dtype"
            )
        self.float8_dtype = float8_dtype
        self.fwd_config_submodule_fqn = fwd_config_submodule_fqn
        _check_castable_layouts(type(self).__name__, self.input_layouts or ())
        _check_castable_layouts(type(self).__name__, self.input_kwarg_layouts.values())

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        # a style object may serve several modules (wildcard plans): bind a copy to this one
        bound = copy.copy(self)
        bound._spec, bound._linears = self._cast_for(module)
        agreement.record_style(module, self)
        return PrepareModuleInput._apply(bound, module, device_mesh)

    def _prepare_input_arg(self, input, mesh, input_layout, desired_layout):
        if input_layout is not None and desired_layout is not None and input_layout != desired_layout:
            if not isinstance(input, torch.Tensor):
                raise TypeError(f"{type(self).__name__}: expected a tensor input, got {type(input)}")
            x = _as_dtensor(input, mesh, (input_layout,))
            # float8 before it is communicated
            input = _cast_input(x, self._spec, self._linears, (desired_layout,))
        return super()._prepare_input_arg(input, mesh, input_layout, desired_layout)

    def _cast_for(self, module: nn.Module):
        """(spec, linears) of the shared input's cast: the named linear's input spec, recording
        into every delayed linear below ``module`` ([Note: delayed casts in the float8 styles])."""
        name = type(self).__name__
        delayed_linears = {
            n: m for n, m in module.named_modules()
            if isinstance(m, Float8Linear) and m.delayed is not None and m.delayed.keeps(Operand.INPUT)
        }
        if self.fwd_config_submodule_fqn is None:
            if delayed_linears:
                raise ValueError(
                    f"{name}: {list(delayed_linears)} cast their input with delayed scaling, but "
                    "without fwd_config_submodule_fqn the shared input would be cast with a "
                    "dynamic scale and no amax history would record it; pass "
                    "fwd_config_submodule_fqn=<the linear whose input cast config to follow>"
                )
            config = Float8LinearConfig(
                cast_config_input=CastConfig(target_dtype=self.float8_dtype or E4M3)
            )
            return config.cast_spec(*OUTPUT_INPUT, getattr(module, "fqn", "")), []
        try:
            sub = module.get_submodule(self.fwd_config_submodule_fqn)
        except AttributeError:
            children = [n for n, _ in module.named_modules() if n]
            raise ValueError(
                f"{name}: fwd_config_submodule_fqn={self.fwd_config_submodule_fqn!r} is not a "
                f"submodule of {type(module).__name__}; its submodules are {children}"
            ) from None
        sub = _float8_linear(sub, f"{name}(fwd_config_submodule_fqn=...)")
        others = [m for m in delayed_linears.values() if m is not sub]
        if others and not (sub.delayed is not None and sub.delayed.keeps(Operand.INPUT)):
            raise ValueError(
                f"{name}: {[n for n, m in delayed_linears.items() if m is not sub]} cast their "
                f"input with delayed scaling but fwd_config_submodule_fqn="
                f"{self.fwd_config_submodule_fqn!r} does not, so the shared input would reach "
                "them cast with a dynamic scale and unrecorded; name a linear with a delayed "
                "input cast (give the linears sharing the input one config)"
            )
        return sub.specs[OUTPUT_INPUT], [sub] + others

    def __repr__(self) -> str:
        return (
            f"{super().__repr__()[:-1]}, float8_dtype={self.float8_dtype}, "
            f"fwd_config_submodule_fqn={self.fwd_config_submodule_fqn!r})"
        )
