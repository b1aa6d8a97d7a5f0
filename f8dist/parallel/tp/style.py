"""Float8 tensor- and sequence-parallel styles: PyTorch's styles, communicating in float8.

The styles subclass PyTorch's, take the same keyword arguments and override only their hooks.

[Note: cast before communicating]
An activation redistributed before a float8 gemm (the sequence-parallel all-gather) is cast
*first*, with the consuming linear's spec, so the all-gather moves float8 ([Note: float8 on the
wire] in f8dist/core/tensor.py) and the linear reuses the bytes; cast as a DTensor, its amax is the
logical tensor's ([Note: amax] in f8dist/core/placement.py). So is the rowwise style's gradient before
its backward all-gather.

[Note: the grad_weight gemm under sequence parallelism]
The grad_weight gemm contracts over the tokens, so it needs the input scaled along the tokens
(or in high precision); re-casting the gathered row-scaled float8 would round twice
(tests/sim/parallel/tp/test_llama.py). ``_grad_weight_cast`` picks per consuming linear and per forward:

* token blocks on shards holding whole blocks ([Note: token blocks of N-D activations] in
  f8dist/config/specs.py): the shard's token-block cast travels as the row-block cast's companion
  ([Note: two casts of one tensor] in f8dist/core/tensor.py);
* a high-precision grad_weight gemm, or split token blocks: the input travels in high precision;
* tensorwise and rowwise (power-of-2 scales, exact but for e4m3 subnormals): the gathered float8
  is reused or re-scaled.

``sp_grad_weight`` may trade this otherwise ([Note: the grad_weight operand of a gathered
tensor] in f8dist/config/cells.py). The rowwise style's gradient makes the same choice; under
torch.compile neither is made ([Note: float8 gradients under compile]).

[Note: which redistributions carry float8]
An axiswise cast is not made before a redistribution that shards its scaled-over dim (e.g. a
rowwise recipe's input going ``Replicate() -> Shard(-1)``): float8 shards cannot be reassembled
along the dim their scales span, the split moves no bytes anyway, and the grad_weight gemm would
get a re-scaled copy. The linear casts its shard with the logical row's amax ([Note: amax]). A
tensorwise cast is still made first: the split keeps its scale.

[Note: block scales on tensor-parallel shards]
Block scales ([Note: block scales] in f8dist/config/cells.py) need no amax collective. Activation and
gradient 1 x K blocks are local to a token, so they are cast before the all-gather and their scale
grid travels with the shards ([Note: row blocks of N-D activations]). Weights are sharded on block
boundaries; a TP degree whose shards would split a block of any of the layer's casts raises when
the style is applied (``_check_blocks``, by ``blocks_split_by_shards``).

[Note: float8 gradients under compile]
torch.compile traces an autograd.Function's backward assuming a gradient of the forward output's
type, so a gradient that becomes float8 on its way (the backward float8 all-gather) would fail in
the linear's compiled backward. Under torch.compile the rowwise style all-gathers the gradient in
high precision; forward activations are still cast first.

[Note: delayed casts in the float8 styles]
With ``ScalingType.DELAYED`` a style's cast uses the consuming linear's amax history ([Note:
delayed scaling] in f8dist/policy/delayed/): it records the amax of the rank's shard into the linear,
and the sync's MAX all-reduce makes it the logical tensor's. The bytes must share one scale on
every rank, so the out-of-range decision ([Note: out of range]) is taken on the logical amax: one
scalar all-reduce per cast (on the [Note: first step], over all ranks).

A shared input (``PrepareFloat8ModuleInput``) is cast with the named linear's scale and recorded
into it, and aside into every other delayed linear below the module (their own record replaces it).
Caveat: a delayed linear below the module that does not run in a step keeps the shared amax.
"""

from __future__ import annotations

import copy
import math
from typing import Optional, Sequence

import torch
import torch.nn as nn
from torch.distributed.tensor import DeviceMesh, DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel

from f8dist.core import agreement
from f8dist.core.cast import ToFloat8, cast_with_companion
from f8dist.config import (
    E4M3, CastConfig, CastSpec, CastSpecs, Float8LinearConfig, Gemm, Operand, ScalingType,
    SPGradWeight,
)
from f8dist.policy.delayed import shared_scale
from f8dist.core.gemm import check_gemm_shape
from f8dist.nn.linear import Float8Linear
from f8dist.core.placement import blocks_split_by_shards, has_partial

__all__ = ["Float8ColwiseParallel", "Float8RowwiseParallel", "PrepareFloat8ModuleInput", "cast_input"]

OUTPUT_INPUT = (Gemm.OUTPUT, Operand.INPUT)
GRAD_INPUT_GRAD_OUTPUT = (Gemm.GRAD_INPUT, Operand.GRAD_OUTPUT)


# ---------------------------------------------------------------------------------------------
# casts made outside the linear
# ---------------------------------------------------------------------------------------------


def _scale_for(spec: CastSpec, linears: Sequence[Float8Linear], x: torch.Tensor, record=None):
    """The scale of a cast of ``x`` made for ``linears`` outside their forward: None (dynamic) or
    the delayed scale, after recording ``x``'s amax ([Note: delayed casts in the float8 styles]).
    It records even when only another gemm's cast is delayed: the linears only see float8 bytes."""
    if not linears or linears[0].delayed is None or not linears[0].delayed.keeps(spec.operand):
        return None
    scale = shared_scale([m.delayed for m in linears], spec.operand, x, record)
    return scale if spec.scaling_type is ScalingType.DELAYED else None


_HIGH_PRECISION = "high_precision"


def _grad_weight_cast(x: torch.Tensor, specs: Optional[CastSpecs], operand: Operand):
    """How the grad_weight gemm gets one device's ``operand`` when ``x`` is cast before it is
    communicated ([Note: the grad_weight gemm under sequence parallelism]): None (it reuses or
    re-casts the communicated bytes; also without grad, for an empty batch or with
    ``SPGradWeight.RECAST`` or ``DERIVE``), its CastSpec (a companion cast) or ``_HIGH_PRECISION``."""
    if (specs is None or torch.compiler.is_compiling() or not torch.is_grad_enabled()
            or x.numel() == 0 or specs.sp_grad_weight.sends_one_cast
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


def cast_input(
    x: torch.Tensor, spec: CastSpec, linears: Sequence[Float8Linear], desired_layouts=()
) -> torch.Tensor:
    """``x`` cast to float8 for ``linears`` (gradients pass in high precision), with the
    grad_weight gemm's cast as companion or kept shard ([Note: the grad_weight gemm under sequence
    parallelism]); or ``x`` itself ([Note: which redistributions carry float8])."""
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
    """Identity in forward; in backward casts the gradient with ``mod``'s ``(grad_input,
    grad_output)`` spec so it is communicated in float8, carrying ``other``: the grad_weight
    gemm's cast ([Note: the grad_weight gemm under sequence parallelism])."""

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
    cast ([Note: block scales on tensor-parallel shards]), by the rule of f8dist/core/placement.py."""
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
    """Make ``module``'s delayed buffers Replicate DTensors in place: no broadcast per buffer, so
    ranks that disagree reach the agreement check instead of hanging ([Note: ranks that
    disagree] in f8dist/core/agreement.py)."""
    names = module.delayed.buffer_names if module.delayed is not None else ()
    for name in names:
        module._buffers[name] = _as_dtensor(module._buffers[name], mesh, [Replicate()] * mesh.ndim)


def _as_dtensor(x: torch.Tensor, mesh: DeviceMesh, layouts) -> DTensor:
    return x if isinstance(x, DTensor) else DTensor.from_local(x, mesh, layouts, run_check=False)


# ---------------------------------------------------------------------------------------------
# styles
# ---------------------------------------------------------------------------------------------


class _Float8LinearStyle:
    """Checks at ``_apply`` and the input cast ([Note: cast before communicating]) that the
    float8 colwise and rowwise styles add to PyTorch's (the next base class)."""

    _sharded_features: str  # "out" (colwise) or "in" (rowwise)

    def check_blocks(self, module: nn.Module, tp: int) -> None:
        """Raise, naming the fix, if sharding ``module`` over ``tp`` ranks would split a block of
        its block-scaled casts; needs no process group (works on a meta-device model)."""
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
            inputs = (cast_input(x, mod.specs[OUTPUT_INPUT], [mod], desired_input_layouts),
                      *inputs[1:])
        return super()._prepare_input_fn(
            input_layouts, desired_input_layouts, mod, inputs, device_mesh
        )


class Float8ColwiseParallel(_Float8LinearStyle, ColwiseParallel):
    """``ColwiseParallel`` for a :class:`~f8dist.nn.linear.Float8Linear`, communicating in float8.

    The weight is sharded on ``out_features`` (``Shard(0)``). An input in another layout than
    ``Replicate()`` (sequence parallel: ``input_layouts=Shard(1)``) is cast to float8 before the
    all-gather ([Note: cast before communicating]).

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
    """``RowwiseParallel`` for a :class:`~f8dist.nn.linear.Float8Linear`, communicating in float8.

    The weight is sharded on ``in_features`` (``Shard(1)``); the partial-sum output is reduced in
    high precision. With a sharded output the gradient is cast to float8 before backward
    all-gathers it; see [Note: which redistributions carry float8] for the input.

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
            # backward all-gathers the sharded gradient: cast it to float8 first
            other = _grad_weight_cast(outputs, mod.specs, Operand.GRAD_OUTPUT)
            if other != _HIGH_PRECISION:
                outputs = _CastGradToFloat8.apply(outputs, mod, other)
        return outputs.to_local() if use_local_output else outputs


class PrepareFloat8ModuleInput(PrepareModuleInput):
    """``PrepareModuleInput`` that casts the inputs it redistributes to float8 first.

    For a module whose float8 linears share one input (wq/wk/wv, w1/w3): the input is cast once
    with the input spec of ``fwd_config_submodule_fqn``'s linear and all-gathered once in float8;
    the linears take ``Float8ColwiseParallel()`` and reuse the bytes.

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
            input = cast_input(x, self._spec, self._linears, (desired_layout,))
        return super()._prepare_input_arg(input, mesh, input_layout, desired_layout)

    def _cast_for(self, module: nn.Module):
        """(spec, linears) of the shared input's cast ([Note: delayed casts in the float8 styles])."""
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
