"""Float8Tensor: float8 data plus the scale that produced it.

A Float8Tensor looks like a tensor of its original (high-precision) dtype and shape, and holds

* ``_data``: the float8 bytes, same shape as the tensor;
* ``_scale``: float32, a 0-dim tensor (tensorwise) or one that broadcasts against ``_data`` with
  a 1 at ``_axiswise_dim`` (axiswise: one scale per row or column);
* ``_orig_dtype``: the dtype it dequantizes to and that gemm outputs take;
* ``_mm_config``: how a gemm with this operand runs (emulation, fast accumulation).

Only the ops in ``_OPS`` are defined (views, transposes, ``mm`` and what autograd, DTensor and
FSDP2 need); anything else raises, so a float8 tensor never silently turns into garbage.
``aten.mm`` on two Float8Tensors is the float8 gemm (``torch._scaled_mm``); because it is an aten
op, a DTensor wrapping Float8Tensors runs its sharding propagation and calls it on the shards.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Optional

import torch

from f8dist.scaling import dequantize

__all__ = ["Float8Tensor", "ScaledMMConfig", "implements", "rewrap"]

aten = torch.ops.aten


@dataclass(frozen=True)
class ScaledMMConfig:
    """How a gemm that takes this operand runs. Hashable: it is compile-time metadata."""

    emulate: bool = False
    use_fast_accum: bool = False
    pad_inner_dim: bool = False


class Float8Tensor(torch.Tensor):
    _data: torch.Tensor
    _scale: torch.Tensor
    _orig_dtype: torch.dtype
    _axiswise_dim: Optional[int]
    _mm_config: ScaledMMConfig

    @staticmethod
    def __new__(
        cls,
        data: torch.Tensor,
        scale: torch.Tensor,
        orig_dtype: torch.dtype,
        axiswise_dim: Optional[int] = None,
        mm_config: ScaledMMConfig = ScaledMMConfig(),
    ):
        self = torch.Tensor._make_wrapper_subclass(
            cls,
            data.size(),
            strides=data.stride(),
            storage_offset=data.storage_offset(),
            dtype=orig_dtype,
            layout=data.layout,
            requires_grad=data.requires_grad,
            device=data.device,
        )
        self._data = data
        self._scale = scale
        self._orig_dtype = orig_dtype
        self._axiswise_dim = axiswise_dim
        self._mm_config = mm_config
        return self

    def __repr__(self):
        kind = "tensorwise" if self._axiswise_dim is None else f"axiswise(dim={self._axiswise_dim})"
        return (
            f"Float8Tensor(shape={tuple(self.shape)}, {self._data.dtype}, {kind}, "
            f"orig_dtype={self._orig_dtype}, scale={self._scale if self._scale.numel() == 1 else tuple(self._scale.shape)})"
        )

    # -- subclass protocol (torch.compile, FSDP2, DTensor) ------------------------------------

    def __tensor_flatten__(self):
        return ["_data", "_scale"], (self._orig_dtype, self._axiswise_dim, self._mm_config)

    @staticmethod
    def __tensor_unflatten__(inner_tensors, metadata, outer_size, outer_stride):
        orig_dtype, axiswise_dim, mm_config = metadata
        return Float8Tensor(
            inner_tensors["_data"], inner_tensors["_scale"], orig_dtype, axiswise_dim, mm_config
        )

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args, kwargs=None):
        kwargs = kwargs or {}
        handler = _OPS.get(func)
        if handler is None:
            raise NotImplementedError(
                f"{func} is not defined on Float8Tensor. Float8Tensors only flow into float8 "
                f"gemms; call .to_original_precision() first to use the high-precision value."
            )
        return handler(func, args, kwargs)

    # -- public helpers -----------------------------------------------------------------------

    def to_original_precision(self) -> torch.Tensor:
        """The high-precision tensor this float8 tensor stands for (differentiable)."""
        return _Dequantize.apply(self)

    def with_mm_config(self, mm_config: ScaledMMConfig) -> "Float8Tensor":
        """The same bytes and scale, headed for a gemm with another ``ScaledMMConfig``."""
        return Float8Tensor(self._data, self._scale, self._orig_dtype, self._axiswise_dim, mm_config)

    @property
    def is_axiswise(self) -> bool:
        return self._axiswise_dim is not None


class _Dequantize(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t: Float8Tensor):
        return dequantize(t._data, t._scale, t._orig_dtype)

    @staticmethod
    def backward(ctx, grad):
        return grad


# ---------------------------------------------------------------------------------------------
# op table
# ---------------------------------------------------------------------------------------------

_OPS: Dict[object, Callable] = {}


def implements(ops):
    """Register a Float8Tensor implementation for one or more aten ops."""

    def decorator(fn):
        for op in ops:
            _OPS[op] = fn
        return fn

    return decorator


def rewrap(t: Float8Tensor, data: torch.Tensor, scale=None, axiswise_dim="same") -> Float8Tensor:
    """A Float8Tensor like ``t`` (orig dtype, mm config; scale and axis unless given) around
    ``data``: how every op of the table builds its result."""
    return Float8Tensor(
        data,
        t._scale if scale is None else scale,
        t._orig_dtype,
        t._axiswise_dim if axiswise_dim == "same" else axiswise_dim,
        t._mm_config,
    )


@implements([aten.detach.default, aten.alias.default, aten.clone.default])
def _same_scale_unary(func, args, kwargs):
    t = args[0]
    scale = t._scale if func is not aten.clone.default else t._scale.clone()
    return rewrap(t, func(t._data, *args[1:], **kwargs), scale)


@implements([aten.t.default, aten.transpose.int])
def _transpose(func, args, kwargs):
    t = args[0]
    data = func(t._data, *args[1:], **kwargs)
    if not t.is_axiswise:
        return rewrap(t, data)
    if t._data.dim() != 2:
        raise NotImplementedError("transposing an axiswise Float8Tensor is defined for 2-D tensors")
    # [N, 1] scales of a [N, K] tensor become [1, N] scales of its [K, N] transpose
    axis = 1 - (t._axiswise_dim % 2)
    return rewrap(t, data, t._scale.t(), axis)


@implements([aten.view.default, aten._unsafe_view.default, aten.reshape.default])
def _view(func, args, kwargs):
    t, new_shape = args[0], args[1]
    data = func(t._data, new_shape, *args[2:], **kwargs)
    if not t.is_axiswise or data.shape == t._data.shape:
        return rewrap(t, data)  # (same shape: e.g. DTensor.from_local's view_as)
    # Axiswise scales survive a reshape of the other dims as long as the scaled-over dim is the
    # last one and keeps its size: [B, S, K] with scales [B, S, 1] <-> [B*S, K] with [B*S, 1].
    last = t._data.dim() - 1
    if t._axiswise_dim % t._data.dim() != last or data.shape[-1] != t._data.shape[-1]:
        raise NotImplementedError(
            f"cannot reshape an axiswise Float8Tensor of shape {tuple(t.shape)} (scaled over dim "
            f"{t._axiswise_dim}) to {tuple(data.shape)}: the scaled-over dim must stay last"
        )
    scale = t._scale.reshape(*data.shape[:-1], 1)
    return rewrap(t, data, scale, data.dim() - 1)


@implements([aten.is_same_size.default])
def _is_same_size(func, args, kwargs):
    return args[0].shape == args[1].shape


@implements([aten.mm.default])
def _mm(func, args, kwargs):
    a, b = args
    if not (isinstance(a, Float8Tensor) and isinstance(b, Float8Tensor)):
        raise TypeError(
            "a float8 gemm needs both operands in float8; got "
            f"{type(a).__name__} @ {type(b).__name__}"
        )
    from f8dist.gemm import scaled_mm  # the gemm itself lives next to its kernels

    return scaled_mm(a, b)

