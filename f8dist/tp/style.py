"""Float8 tensor- and sequence-parallel styles: PyTorch's styles, communicating in float8.

``Float8ColwiseParallel``, ``Float8RowwiseParallel`` and ``PrepareFloat8ModuleInput`` take the
keyword arguments of ``torch.distributed.tensor.parallel``'s ``ColwiseParallel``,
``RowwiseParallel`` and ``PrepareModuleInput`` and shard the same way. What changes:

[Note: cast before communicating]
An activation that must be redistributed before a float8 gemm (the sequence-parallel all-gather
``Shard(1) -> Replicate``) is cast to float8 *first*, with the cast config of the gemm that
consumes it, so the all-gather moves 1 byte per element ([Note: float8 on the wire] in wire.py)
and the linear reuses the gathered bytes instead of casting again. The cast is
``f8dist.cast.cast_to_float8`` on the sharded DTensor, so its amax is the amax of the logical
tensor ([Note: amax]): a tensorwise amax is all-reduced over tp, a per-token (axiswise) amax needs
no collective because each token's row lives on one rank.

Symmetrically, the gradient of a rowwise-parallel output that was reduce-scattered to sequence
shards comes back sequence-sharded and is all-gathered in backward: it is cast to float8 (the
grad_output cast of the grad_input gemm) before that all-gather.

Gemms that take the other axis (a rowwise recipe's grad_weight gemm scales per column) re-scale the
communicated float8 tensor (``linear._cast``), a second rounding that a one-device
run does not have; layers whose input needs no redistribution are not cast here at all.

[Note: float8 gradients under compile]
The backward float8 all-gather makes a gradient change type on its way (a high-precision DTensor
becomes a DTensor of Float8Tensors). torch.compile traces an autograd.Function's backward when it
traces the forward, assuming a gradient of the forward output's type, so the linear's compiled
backward would treat the float8 gradient as high precision (and fail on it). Under torch.compile
the rowwise style therefore all-gathers the gradient in high precision; forward activations are
still cast before their all-gather. Eager mode sends float8 both ways.

[Note: delayed casts in the float8 styles]
With ``ScalingType.DELAYED`` (recipe "delayed") the casts above take their scale from the amax
history of the linear that consumes the tensor ([Note: delayed scaling] in f8dist/delayed.py),
exactly as the linear would itself (``f8dist.delayed.record_and_scale``):

* forward: the style records the amax of the rank's *shard* of the input into the linear's
  ``fp8_amax_input`` and casts the shard with its ``fp8_scale_input``; no amax collective runs.
  The linear receives the gathered float8 bytes, reuses them and records nothing more.
* backward: ``Float8RowwiseParallel`` records the amax of the sequence-sharded gradient into
  ``fp8_amax_grad_output`` and casts it with ``fp8_scale_grad_output`` before the all-gather.
* ``sync_float8_amax_and_scale_history``'s one MAX all-reduce turns the shard amaxes into the amax
  of the logical tensor, so every rank holds the histories and scales of one device.
* first step (``enable_amax_init``, the default; [Note: first step]): the history and scale are
  filled from the amax of the logical tensor, reduced over tp, so the first step also equals one
  device's. That costs one scalar all-reduce per such cast, on the first step only;
  ``enable_amax_init=False`` avoids it (the first step casts with scale 1.0, as one device with
  that config does).
* shared input (``PrepareFloat8ModuleInput`` with ``fwd_config_submodule_fqn``): the input is cast
  once, with the named linear's scale, and its amax is recorded into *every* delayed Float8Linear
  below the module. The linears that consume that input (wq/wk/wv, w1/w3) thus record the same
  amaxes every step, from the same first step, so their histories and scales are identical to the
  named one's and to what each has on one device: which linear's scale casts makes no
  difference (given one config for all of them, which reusing the bytes assumes anyway). A linear
  below the module that is fed another tensor (wo, w2) records its own input in its forward,
  which runs later and overwrites the shared amax (and on the first step re-initializes its
  history). Caveat: a delayed linear below the module that does not run in a step keeps the
  shared amax for that step, where one device would keep its previous one.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any, Optional

import torch
import torch.nn as nn
from torch.distributed.tensor import DeviceMesh, DTensor, Shard, distribute_module
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel
from torch.distributed.tensor.placement_types import Placement

import f8dist.tp.wire  # noqa: F401  (registers the Float8Tensor collectives)
from f8dist.cast import ToFloat8, cast_to_float8
from f8dist import delayed
from f8dist.config import E4M3, CastConfig, Float8LinearConfig, ScalingType
from f8dist.gemm import check_gemm_shape
from f8dist.linear import Float8Linear, cast_kwargs

__all__ = ["Float8ColwiseParallel", "Float8RowwiseParallel", "PrepareFloat8ModuleInput"]


# ---------------------------------------------------------------------------------------------
# the shared cast helper
# ---------------------------------------------------------------------------------------------


class _Float8InputCast:
    """Casts a linear's input to float8 as the linear's ("output", "input") cast config says.

    A callable ``(x, mod) -> x_fp8`` (differentiable: gradients pass through in high precision).
    With a delayed input (see [Note: delayed casts in the float8 styles]) the input's amax is
    recorded into ``linears`` (default: ``[mod]``, the linear the style is applied to) and the
    cast uses the delayed scale of the first of them.
    """

    def __init__(self, config: Float8LinearConfig, fqn: str, linears=None):
        cc = config.cast_config("output", "input")
        self.enabled = cc.enabled
        self.dtype = config.resolved_dtype("output", "input")
        self.kwargs = cast_kwargs(config, "output", "input", fqn)
        self.delayed_scale = cc.scaling_type is ScalingType.DELAYED
        # the input is recorded even when only another gemm's input cast is delayed: the linear
        # gets float8 bytes and cannot record it itself
        self.records = "input" in delayed.delayed_operands(config)
        self.linears, self.fqn = linears, fqn

    def __call__(self, x: torch.Tensor, mod: Optional[nn.Module] = None) -> torch.Tensor:
        if not self.enabled:
            return x
        kwargs = self.kwargs
        if self.records:
            linears = self.linears if self.linears is not None else [mod]
            if linears[0] is None:
                raise RuntimeError(
                    f"{self.fqn or '<root>'}: a delayed input cast needs the Float8Linear whose "
                    "amax history it records into and scales from"
                )
            scale = delayed.record_and_scale(linears, "input", x)
            if self.delayed_scale:
                kwargs = dict(kwargs, scale=scale)
        return ToFloat8.apply(x, self.dtype, kwargs)


class _CastGradToFloat8(torch.autograd.Function):
    """Identity in forward; in backward casts the gradient to float8 as the ("grad_input",
    "grad_output") cast config says, so that what backward communicates next moves in float8.

    ``module``: the Float8Linear whose output this is; needed when its grad_output is delayed
    (its amax is recorded there and its delayed scale used, [Note: delayed casts in the float8
    styles])."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, config: Float8LinearConfig, fqn: str, module=None):
        ctx.config, ctx.fqn, ctx.module = config, fqn, module
        # whether the forward that made x was the linear's first step (read now: it is reset
        # by the time backward runs)
        ctx.init = bool(getattr(module, "_delayed_init_forward", False))
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        config = ctx.config
        scale = None
        if "grad_output" in delayed.delayed_operands(config):
            if ctx.module is None:
                raise RuntimeError(
                    f"{ctx.fqn or '<root>'}: a delayed grad_output cast needs the Float8Linear "
                    "whose amax history it records into and scales from"
                )
            scale = delayed.record_and_scale([ctx.module], "grad_output", grad, ctx.init)
            if config.cast_config("grad_input", "grad_output").scaling_type is not ScalingType.DELAYED:
                scale = None
        fp8 = cast_to_float8(
            grad,
            config.resolved_dtype("grad_input", "grad_output"),
            scale=scale,
            **cast_kwargs(config, "grad_input", "grad_output", ctx.fqn),
        )
        return fp8, None, None, None


def _moves(x: DTensor, placements) -> bool:
    """Whether redistributing ``x`` to ``placements`` communicates (Shard(-1) is Shard(ndim-1))."""

    def norm(p):
        return Shard(p.dim % x.ndim) if isinstance(p, Shard) else p

    return tuple(map(norm, x.placements)) != tuple(map(norm, placements))


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


def _delayed_input(m: nn.Module) -> bool:
    return isinstance(m, Float8Linear) and "input" in m._delayed_operands


def _check_castable_layouts(style: str, layouts) -> None:
    for p in layouts:
        if p is not None and p.is_partial():
            raise ValueError(
                f"{style}: input layout {p} cannot be cast to float8: the amax of partial sums is "
                "not the amax of their sum. Reduce the input first (pass Replicate() or Shard(d))."
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
                f"local shard of {'in' if sharded == 'in' else 'out'}_features = {size}"
            ),
        )


# ---------------------------------------------------------------------------------------------
# styles
# ---------------------------------------------------------------------------------------------


class _Float8LinearParallel:
    """What :class:`Float8ColwiseParallel` and :class:`Float8RowwiseParallel` share: checked
    layouts, the cast of an input before it is redistributed ([Note: cast before
    communicating]), and ``_apply`` on a Float8Linear. Listed before PyTorch's style in the bases;
    subclasses set ``_sharded_features`` ("out": colwise, "in": rowwise)."""

    _sharded_features: str

    def __init__(
        self,
        *,
        input_layouts: Optional[Placement] = None,
        output_layouts: Optional[Placement] = None,
        use_local_output: bool = True,
    ):
        super().__init__(
            input_layouts=input_layouts, output_layouts=output_layouts,
            use_local_output=use_local_output,
        )
        _check_castable_layouts(type(self).__name__, self.input_layouts)
        if self._sharded_features == "in":
            self.desired_input_layouts = (Shard(-1),)  # a rowwise linear takes in_features shards

    @staticmethod
    def _prepare_input_fn(input_layouts, desired_input_layouts, cast, mod, inputs, device_mesh):
        x = inputs[0]
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, device_mesh, input_layouts, run_check=False)
        if _moves(x, desired_input_layouts):
            x = cast(x, mod)  # float8 before it is communicated
            x = x.redistribute(placements=desired_input_layouts, async_op=True)
        return x

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        name = type(self).__name__
        module = _float8_linear(module, name)
        _check_local_gemm(module, device_mesh, self._sharded_features, name)
        cast = _Float8InputCast(module.config, module.fqn)
        return distribute_module(
            module,
            device_mesh,
            self._partition_linear_fn,
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts, cast),
            partial(self._prepare_output_fn, self.output_layouts, self.use_local_output),
        )


class Float8ColwiseParallel(_Float8LinearParallel, ColwiseParallel):
    """``ColwiseParallel`` for a :class:`~f8dist.linear.Float8Linear`, communicating in float8.

    The weight is sharded on ``out_features`` (``Shard(0)``) and its float8 scale comes from the
    amax of the whole weight (all-reduced over tp). An input that arrives in another layout than
    ``Replicate()`` (sequence parallel: ``input_layouts=Shard(1)``) is cast to float8 with the
    layer's input cast config *before* the all-gather, so the all-gather moves 1 byte per element
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


class Float8RowwiseParallel(_Float8LinearParallel, RowwiseParallel):
    """``RowwiseParallel`` for a :class:`~f8dist.linear.Float8Linear`, communicating in float8.

    The weight is sharded on ``in_features`` (``Shard(1)``); the output is a partial sum that is
    all-reduced (``output_layouts=Replicate()``) or reduce-scattered (``Shard(1)``, sequence
    parallel) in high precision. With a sharded output, the gradient that comes back is cast to
    float8 before backward all-gathers it. An input that needs redistributing to ``Shard(-1)`` is
    cast to float8 before it moves.

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
        if outputs.placements != output_layouts:
            outputs = outputs.redistribute(placements=output_layouts, async_op=True)
        sharded = any(isinstance(p, Shard) for p in output_layouts)
        if (
            sharded
            and mod.bias is None
            and mod.config.gemm_in_float8("grad_input")
            and not torch.compiler.is_compiling()  # [Note: float8 gradients under compile]
        ):
            # backward all-gathers the sharded gradient: cast it to float8 first
            outputs = _CastGradToFloat8.apply(outputs, mod.config, mod.fqn, mod)
        return outputs.to_local() if use_local_output else outputs


class PrepareFloat8ModuleInput(PrepareModuleInput):
    """``PrepareModuleInput`` that casts the inputs it redistributes to float8 first.

    Put it on a module whose float8 linears share one input (attention's wq/wk/wv, a SwiGLU FFN's
    w1/w3): the input is cast once, with the input cast config of the linear named by
    ``fwd_config_submodule_fqn``, all-gathered once in float8, and every linear reuses the bytes.
    Those linears then take ``Float8ColwiseParallel()`` (their input already is ``Replicate()``).

    Keyword Args:
        input_layouts, desired_input_layouts, input_kwarg_layouts, desired_input_kwarg_layouts,
        use_local_output: as in ``PrepareModuleInput``.
        float8_dtype (torch.dtype, optional): the float8 dtype of a tensorwise dynamic cast, used
            only without ``fwd_config_submodule_fqn``; default ``torch.float8_e4m3fn``.
        fwd_config_submodule_fqn (str, optional): FQN (relative to this module) of the
            Float8Linear whose ("output", "input") cast config the cast follows. Give it whenever
            the linears use a non-default recipe, so their bytes are reused rather than re-cast.

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

    def __init__(
        self,
        *,
        input_layouts=None,
        desired_input_layouts=None,
        input_kwarg_layouts=None,
        desired_input_kwarg_layouts=None,
        use_local_output: bool = False,
        float8_dtype: Optional[torch.dtype] = None,
        fwd_config_submodule_fqn: Optional[str] = None,
    ):
        super().__init__(
            input_layouts=input_layouts,
            desired_input_layouts=desired_input_layouts,
            input_kwarg_layouts=input_kwarg_layouts,
            desired_input_kwarg_layouts=desired_input_kwarg_layouts,
            use_local_output=use_local_output,
        )
        if float8_dtype is not None and fwd_config_submodule_fqn is not None:
            raise ValueError(
                "PrepareFloat8ModuleInput: pass float8_dtype or fwd_config_submodule_fqn, not "
                "both; the submodule's config already fixes the dtype"
            )
        self.float8_dtype = float8_dtype
        self.fwd_config_submodule_fqn = fwd_config_submodule_fqn
        _check_castable_layouts(type(self).__name__, self.input_layouts or ())
        _check_castable_layouts(type(self).__name__, self.input_kwarg_layouts.values())

    def _cast_for(self, module: nn.Module) -> _Float8InputCast:
        name = type(self).__name__
        if self.fwd_config_submodule_fqn is None:
            delayed_linears = [n for n, m in module.named_modules() if _delayed_input(m)]
            if delayed_linears:
                raise ValueError(
                    f"{name}: {delayed_linears} cast their input with delayed scaling, but "
                    "without fwd_config_submodule_fqn the shared input would be cast with a "
                    "dynamic scale and no amax history would record it; pass "
                    "fwd_config_submodule_fqn=<the linear whose input cast config to follow>"
                )
            dtype = self.float8_dtype or E4M3
            config = Float8LinearConfig(cast_config_input=CastConfig(target_dtype=dtype))
            return _Float8InputCast(config, getattr(module, "fqn", ""))
        try:
            sub = module.get_submodule(self.fwd_config_submodule_fqn)
        except AttributeError:
            children = [n for n, _ in module.named_modules() if n]
            raise ValueError(
                f"{name}: fwd_config_submodule_fqn={self.fwd_config_submodule_fqn!r} is not a "
                f"submodule of {type(module).__name__}; its submodules are {children}"
            ) from None
        sub = _float8_linear(sub, f"{name}(fwd_config_submodule_fqn=...)")
        # [Note: delayed casts in the float8 styles]: scale from sub, amax into every delayed
        # linear below the module (its consumers; the others overwrite it in their forward)
        others = [n for n, m in module.named_modules() if _delayed_input(m) and m is not sub]
        if others and not _delayed_input(sub):
            raise ValueError(
                f"{name}: {others} cast their input with delayed scaling but "
                f"fwd_config_submodule_fqn={self.fwd_config_submodule_fqn!r} does not, so the "
                "shared input would reach them cast with a dynamic scale and unrecorded; name a "
                "linear with a delayed input cast (give the linears sharing the input one config)"
            )
        linears = [sub] + [module.get_submodule(n) for n in others]
        return _Float8InputCast(sub.config, sub.fqn, linears)

    def _prepare_input_arg(self, input: Any, mesh, input_layout, desired_layout, cast=None):
        if input_layout is None:
            return input
        x = input
        if not isinstance(x, DTensor):
            if not isinstance(x, torch.Tensor):
                raise TypeError(f"{type(self).__name__}: expected a tensor input, got {type(x)}")
            x = DTensor.from_local(x, mesh, (input_layout,), run_check=False)
        if desired_layout is not None and _moves(x, (desired_layout,)):
            if cast is not None:
                x = cast(x)  # float8 before it is communicated
            x = x.redistribute(placements=(desired_layout,))
        return x.to_local() if self.use_local_output else x

    def _prepare_input_fn(self, inputs, device_mesh, cast=None):
        if self.input_layouts is None:
            return inputs
        if not isinstance(inputs, tuple):
            inputs = (inputs,)
        if len(inputs) != len(self.input_layouts):
            raise ValueError(
                f"{type(self).__name__}: the module got {len(inputs)} inputs but input_layouts "
                f"has {len(self.input_layouts)} entries (use None for inputs to leave alone)"
            )
        return tuple(
            self._prepare_input_arg(x, device_mesh, layout, desired, cast)
            for x, layout, desired in zip(inputs, self.input_layouts, self.desired_input_layouts)
        )

    def _prepare_input_kwarg_fn(self, inputs, kwarg_inputs, device_mesh, cast=None):
        args = self._prepare_input_fn(inputs, device_mesh, cast)
        kwargs = {
            key: self._prepare_input_arg(
                value, device_mesh, self.input_kwarg_layouts.get(key),
                self.desired_input_kwarg_layouts.get(key), cast,
            )
            for key, value in kwarg_inputs.items()
        }
        return args, kwargs

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        cast = self._cast_for(module)
        if self.with_kwargs:
            module.register_forward_pre_hook(
                lambda _, inputs, kwargs: self._prepare_input_kwarg_fn(
                    inputs, kwargs, device_mesh, cast
                ),
                with_kwargs=True,
            )
        else:
            module.register_forward_pre_hook(
                lambda _, inputs: self._prepare_input_fn(inputs, device_mesh, cast)
            )
        return module

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(input_layouts={self.input_layouts}, "
            f"desired_input_layouts={self.desired_input_layouts}, "
            f"input_kwarg_layouts={self.input_kwarg_layouts}, "
            f"desired_input_kwarg_layouts={self.desired_input_kwarg_layouts}, "
            f"use_local_output={self.use_local_output}, float8_dtype={self.float8_dtype}, "
            f"fwd_config_submodule_fqn={self.fwd_config_submodule_fqn!r})"
        )
