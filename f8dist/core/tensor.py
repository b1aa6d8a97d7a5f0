"""Float8Tensor: float8 data plus the scale that produced it.

A Float8Tensor looks like a tensor of its original (high-precision) dtype and shape, and holds

* ``_data``: the float8 bytes, same shape as the tensor (NVFP4: e2m1 pairs, half as long along
  ``_packed_dim``, [Note: two-level scales]);
* ``_block``: the scale layout, one entry per dim of ``_data``: the block's length along that
  dim, or None for the whole dim ([Note: one scale layout]);
* ``_scale``: the grid of scales over those blocks (float32, or float8_e8m0fnu for MX blocks):
  ceil(size / block) along a dim with a block length, 1 along a whole dim; 0-dim when every dim
  is whole (tensorwise);
* ``_orig_dtype``: the dtype it dequantizes to and that gemm outputs take;
* ``_mm_config``: how a gemm with this operand runs (emulation, fast accumulation);
* ``_tensor_scale``: None, or NVFP4's second-level float32 scale under a grid of e4m3 block
  scales ([Note: two-level scales]);
* ``_packed_dim``: None, or the dim along which NVFP4's ``_data`` holds two values a byte;
* ``_companion``: None, or a second Float8Tensor of the same values cast for the operand's other
  gemm ([Note: two casts of one tensor]), or a :class:`KeptShard` of one (the cast of this rank's
  shard, gathered later).

Only the ops in the op table below are defined; anything else raises, so a float8 tensor never
silently turns into garbage. The table is complete when this module is imported (it is the one
place Float8Tensor ops are defined):

* views and transposes (what autograd, DTensor and FSDP2 do to a tensor), ``as_strided`` (FSDP2's
  view of an all-gathered weight);
* ``_to_copy`` to another high-precision dtype (autocast's cast): the same bytes and scale;
* ``mm``: the float8 gemm (``f8dist.core.gemm.float8_mm``); because it is an aten op, a DTensor
  wrapping Float8Tensors runs its sharding propagation and calls it on the shards;
* the functional collectives, ``split`` and ``cat`` that DTensor's redistribution runs:
  float8 crosses the wire as uint8 ([Note: float8 on the wire], [Note: the wire]).

[Note: one scale layout]
A Float8Tensor's scale is a grid over a block shape, ``_block``, one entry per data dim: a block
length, or None, the whole dim (the scale does not vary along it; a whole-dim block of a
gathered tensor is still whole, since its scale was computed from the logical tensor, [Note:
amax] in f8dist/core/placement.py). Every granularity is a value of it, as in torch's
``F.scaled_mm`` scaling types (TensorWise, RowWise, BlockWise1x32, ...) and torchao's newer
Float8Tensor (``block_size``):

    tensorwise                    (None, None)         scale []
    rowwise [N, K]                (1, None)            scale [N, 1]
    per column (scaled over dim 0) (None, 1)           scale [1, K]
    MXFP8 / DeepSeek activations  (1, 32) / (1, 128)   scale [N, ceil(K / 32)] ...
    DeepSeek weights              (128, 128)
    token blocks of [B, S, K]     (1, 32, 1)           scale [B, ceil(S / 32), K]
    per expert [E, N, K]          (1, None, None)      scale [E, 1, 1]
    expert weight blocks          (1, 128, 128)        scale [E, N / 128, K / 128]

The ops read the block shape only, one rule each: a transpose swaps two entries and two scale
dims; a reshape keeps the last dim and maps the leading ones through the [tokens, K] view
(``_rows_block``); split, cat, all-gather and as_strided along dim d cut the grid where the data
is cut, into pieces aligned to a block length (``_scale_pieces``), and leave it whole along a
whole dim (on the wire it then stays home, [Note: the wire]); dequantizing expands the grid
(``f8dist.core.scaling.expand_blocks``); the gemm (``f8dist.core.gemm.float8_mm``, [Note: one gemm
entry]) runs the block kernel when an operand has block lengths along both dims of a matrix
(``kernel_block``), the tensorwise / per-row one otherwise.

[Note: two-level scales]
NVFP4 ([Note: NVFP4] in f8dist/config/cells.py) scales each block by an e4m3 scale and the tensor
by a float32 one under them: ``_scale`` is the grid of e4m3 block scales (the one layout above),
``_tensor_scale`` the 0-dim float32 scale, whole along every dim. Both are decode scales (the
value is ``data * block_scale * tensor_scale``, ``f8dist.core.scaling.nvfp4_dequantize``). The
data is float4_e2m1fn_x2, two values a byte along ``_packed_dim`` ([Note: packed e2m1] in
f8dist/core/scaling.py): the tensor's shape is the data's with that dim doubled, the ops take
and give logical sizes and halve them along the packed dim for the bytes (``_packed``), a
transpose moves the packed dim with the bytes, and the bytes cross the wire as they are (half a
byte an element). The tensor scale comes from the logical tensor's amax, so it is the same on
every rank: views, transposes, split, cat and the wire keep it as it is (it stays home, in the
WireMeta, as a tensorwise scale does), and the gemm takes both levels, the values unpacked one a
byte ([Note: the NVFP4 gemm] in f8dist/core/gemm.py).

[Note: two casts of one tensor]
A tensor-parallel style casts an activation (or a gradient) before communicating it, but its two
gemms may scale it along different axes: the output gemm's input in 1 x K row blocks, the
grad_weight gemm's in token blocks ([Note: token blocks of N-D activations] in f8dist/config/specs.py).
The cast for the second gemm is made from the same high-precision shard and rides along as the
first one's ``_companion`` (as Transformer Engine's float8 tensors carry row- and column-wise
data): the ops that move or re-view a tensor on its way to the gemms (views, detach, the
all-gather, split and cat of a redistribution, autocast's dtype) apply to both, any other op
drops it. ``cast_to_float8`` takes the companion when it is what the spec asks for
(f8dist/core/cast.py), so the second gemm reads bytes cast from high precision, never re-cast from
float8.

A companion may also stay behind: with ``sp_grad_weight="backward_gather"`` ([Note: the
grad_weight operand of a gathered tensor] in f8dist/config/cells.py) the style casts the shard for the
grad_weight gemm and attaches it as a :class:`KeptShard` (the shard's cast and what gathers
it), which the same ops pass on unchanged, not moved: the linear keeps the shard for backward and
all-gathers it there (f8dist/nn/linear.py).
"""

from __future__ import annotations

import math
from typing import Callable, Dict, NamedTuple, Optional, Sequence, Tuple, Union

import torch

from f8dist.config import ScaledMMConfig
from f8dist.core.gemm import float8_mm, kernel_block
from f8dist.core.scaling import E2M1, dequantize, e2m1_unpack, expand_blocks, nvfp4_dequantize

__all__ = ["Block", "Float8Tensor", "KeptShard", "Layout", "WireMeta", "as_wire", "block_of",
           "rewrap", "wrapper_like"]

aten = torch.ops.aten
c10d = torch.ops._c10d_functional


def wrapper_like(cls, inner: torch.Tensor, dtype: torch.dtype,
                 packed_dim: Optional[int] = None) -> torch.Tensor:
    """A new wrapper subclass instance of ``cls`` with ``inner``'s shape, strides, device and
    ``requires_grad``, looking like a tensor of ``dtype``; with ``packed_dim``, ``inner`` holds
    two elements a byte along it ([Note: two-level scales]): twice as long there, the other
    strides doubled."""
    size, stride, offset = list(inner.size()), list(inner.stride()), inner.storage_offset()
    if packed_dim is not None:
        size[packed_dim] *= 2
        stride = [s if d == packed_dim else 2 * s for d, s in enumerate(stride)]
        offset *= 2
    return torch.Tensor._make_wrapper_subclass(
        cls, size, strides=stride, storage_offset=offset,
        dtype=dtype, layout=inner.layout, device=inner.device, requires_grad=inner.requires_grad,
    )


# [Note: the wire]
# Every collective that moves a Float8Tensor (DTensor's all-gather, split and cat, FSDP2's
# all-gather hooks, expert parallelism's all-to-all) moves what ``Float8Tensor.to_wire(dim)``
# gives, pieces of the tensor along ``dim``, and rebuilds it with ``Float8Tensor.from_wire``:
#
# * the inner tensors travel as uint8 views of their bytes (gloo carries no float8 dtype, e8m0
#   scales included; NCCL carries the same bytes): first the float8 data, then the scales when
#   vary between the pieces: a grid with a block length along ``dim`` (per-row scales, grids of
#   block scales, one per expert [E, 1, 1]). A grid whole along ``dim`` ([Note: one scale
#   layout]: a tensorwise scale, per-column scales along the rows) is the same on every rank
#   ([Note: amax] in f8dist/core/placement.py) and stays home, in the WireMeta;
# * ``WireMeta`` is the rest: the dtypes to view the bytes back as, the scale that stays home,
#   and the tensor's metadata (dtype it stands for, block, gemm options).
#
# The wire tensors keep the shapes of the inner tensors (a float32 scale gains 4 bytes along its
# last dim), so a collective along ``dim`` acts on them as on the tensor: gathered, exchanged,
# indexed or concatenated along ``dim`` they view back as the pieces' bytes and scales put
# together. ``as_wire`` is the same rule for a lone tensor that may be float8.
# (The float8 reduce-scatter of gradients, f8dist/parallel/fsdp/reduce_scatter.py, sends raw blocks it
# casts itself: no Float8Tensor crosses it.)

# a block length along each dim of a Float8Tensor's data, None: the whole dim ([Note: one scale
# layout])
Block = Tuple[Optional[int], ...]


_FLOAT8_DTYPES = frozenset(getattr(torch, n) for n in (
    "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu",
    "float4_e2m1fn_x2") if hasattr(torch, n))


def as_wire(t: torch.Tensor) -> torch.Tensor:
    """``t`` as it crosses a collective: a float8 tensor as a uint8 view of its bytes, any other
    as it is ([Note: the wire]); ``.view(dtype)`` puts it back."""
    return t.view(torch.uint8) if t.dtype in _FLOAT8_DTYPES else t


class Layout(NamedTuple):
    """How a Float8Tensor holds its value ([Note: one scale layout]): what a cast compares to
    reuse float8 bytes (f8dist/core/cast.py)."""

    dtype: torch.dtype  # the float8 data's
    block: Block
    scale_dtype: torch.dtype


class WireMeta(NamedTuple):
    """What :meth:`Float8Tensor.from_wire` needs besides the wire tensors ([Note: the wire])."""

    dtype: torch.dtype  # the float8 data's
    scale_dtype: torch.dtype
    scale: Optional[torch.Tensor]  # the scale when it stays home; None: it travels
    orig_dtype: torch.dtype
    block: Block
    mm_config: ScaledMMConfig
    tensor_scale: Optional[torch.Tensor] = None  # [Note: two-level scales]: stays home
    packed_dim: Optional[int] = None  # [Note: two-level scales]


class KeptShard:
    """A companion cast that stays on its rank ([Note: two casts of one tensor]): ``local``, the
    Float8Tensor cast of this rank's shard, and ``gather``, what all-gathers it in backward, once
    for every linear that reads it (``f8dist.core.cast.SharedGather``, which knows the DTensor layout
    it is a shard of). Ops that carry companions pass it on as it is."""

    __slots__ = ("local", "gather")

    def __init__(self, local: "Float8Tensor", gather):
        self.local, self.gather = local, gather

    def __repr__(self):
        return f"KeptShard({self.local!r})"


def block_of(ndim: int, *, axiswise_dim: Optional[int] = None,
             block: Optional[Sequence[Optional[int]]] = None) -> Block:
    """The block of an ``ndim``-D tensor ([Note: one scale layout]): ``block`` itself (one entry
    per dim), or that of a matrix (rows, cols) over the last two dims, 1 along the others; else
    scaled over ``axiswise_dim`` (the whole dim there, 1 along the others); else tensorwise."""
    if block is not None:
        return (1,) * (ndim - len(block)) + tuple(block)
    if axiswise_dim is not None:
        return tuple(None if d == axiswise_dim % ndim else 1 for d in range(ndim))
    return (None,) * ndim


class Float8Tensor(torch.Tensor):
    _data: torch.Tensor
    _scale: torch.Tensor
    _orig_dtype: torch.dtype
    _mm_config: ScaledMMConfig
    _block: Block
    _tensor_scale: Optional[torch.Tensor]
    _packed_dim: Optional[int]
    _companion: Optional[Union["Float8Tensor", KeptShard]]

    @staticmethod
    def __new__(cls, data: torch.Tensor, scale: torch.Tensor, orig_dtype: torch.dtype,
                axiswise_dim: Optional[int] = None, mm_config: ScaledMMConfig = ScaledMMConfig(),
                block: Optional[Sequence[Optional[int]]] = None,
                companion: Optional[Union["Float8Tensor", KeptShard]] = None,
                tensor_scale: Optional[torch.Tensor] = None, packed_dim: Optional[int] = None):
        block = block_of(data.dim(), axiswise_dim=axiswise_dim, block=block)
        whole = [d for d, b in enumerate(block) if b is None]
        grid = (len(whole) == len(block) if scale.dim() == 0 else
                scale.dim() == data.dim() and all(scale.shape[d] == 1 for d in whole))
        if len(block) != data.dim() or not grid:
            raise ValueError(
                f"a Float8Tensor's block {block} needs one entry per dim of its data "
                f"{tuple(data.shape)} and a grid of scales of as many dims, 1 along each whole "
                f"(None) dim, or a 0-dim scale with every dim whole; got scales "
                f"{tuple(scale.shape)} ([Note: one scale layout])")
        if packed_dim is not None and data.dtype != E2M1:
            raise ValueError(f"a Float8Tensor's packed_dim={packed_dim} is for float4_e2m1fn_x2 "
                             f"data (two values a byte), got {data.dtype} data ([Note: two-level "
                             "scales])")
        if data.dtype == E2M1:  # as nvfp4_cast packs it unless given: along the last dim
            packed_dim = (data.dim() - 1 if packed_dim is None else packed_dim) % data.dim()
        self = wrapper_like(cls, data, orig_dtype, packed_dim)
        self._data, self._scale, self._orig_dtype = data, scale, orig_dtype
        self._packed_dim = packed_dim
        self._mm_config, self._block = mm_config, block
        if tensor_scale is not None and tensor_scale.dim() != 0:
            raise ValueError(f"a Float8Tensor's tensor scale is 0-dim, got "
                             f"{tuple(tensor_scale.shape)} ([Note: two-level scales])")
        self._tensor_scale = tensor_scale
        if isinstance(companion, Float8Tensor) and companion.shape != self.shape:
            raise ValueError(f"a companion cast {tuple(companion.shape)} of a Float8Tensor "
                             f"{tuple(self.shape)} must have its shape")
        self._companion = companion
        return self

    def __repr__(self):
        return (
            f"Float8Tensor(shape={tuple(self.shape)}, {self._data.dtype}, block={self._block} "
            f"({self._scale.dtype} scales), "
            f"orig_dtype={self._orig_dtype}, scale={self._scale if self._scale.numel() == 1 else tuple(self._scale.shape)})"
        )

    # -- subclass protocol (torch.compile, FSDP2, DTensor) ------------------------------------

    def __tensor_flatten__(self):
        meta = (self._orig_dtype, self._mm_config, self._block, self._packed_dim)
        # a KeptShard is made in eager mode only ([Note: float8 gradients under compile] in
        # f8dist/parallel/tp/style.py): no traced subclass holds one
        carried = isinstance(self._companion, Float8Tensor)
        inner = ["_data", "_scale"] + (["_companion"] if carried else [])
        return inner + (["_tensor_scale"] if self._tensor_scale is not None else []), meta

    @staticmethod
    def __tensor_unflatten__(inner_tensors, metadata, outer_size, outer_stride):
        orig_dtype, mm_config, block, packed_dim = metadata
        return Float8Tensor(inner_tensors["_data"], inner_tensors["_scale"], orig_dtype,
                            mm_config=mm_config, block=block,
                            companion=inner_tensors.get("_companion"),
                            tensor_scale=inner_tensors.get("_tensor_scale"),
                            packed_dim=packed_dim)

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
        out = handler(func, args, kwargs)
        if func in _CARRY_COMPANION:  # [Note: two casts of one tensor]
            out = _with_companions(out, handler, func, args, kwargs)
        return out

    # -- public helpers -----------------------------------------------------------------------

    def to_original_precision(self) -> torch.Tensor:
        """The high-precision tensor this float8 tensor stands for (differentiable)."""
        return _Dequantize.apply(self)

    def with_mm_config(self, mm_config: ScaledMMConfig) -> "Float8Tensor":
        """The same bytes and scale, headed for a gemm with another ``ScaledMMConfig``."""
        return rewrap(self, self._data, mm_config=mm_config)

    def with_companion(self, companion: Optional[Union["Float8Tensor", KeptShard]]) -> "Float8Tensor":
        """The same bytes and scale, carrying ``companion``: the same values cast for the
        operand's other gemm, or a KeptShard of them ([Note: two casts of one tensor])."""
        out = rewrap(self, self._data)
        out._companion = companion
        return out

    @property
    def float8_layout(self) -> Layout:
        """The float8 dtype, the block and the scales' dtype ([Note: one scale layout]); a
        property, which dynamo traces on a Float8Tensor made inside a graph (a method it cannot)."""
        return Layout(self._data.dtype, self._block, self._scale.dtype)

    @property
    def is_axiswise(self) -> bool:
        """Scaled per row or column: one whole dim, 1 along the others (a convenience: the ops
        read ``_block``, [Note: one scale layout])."""
        return self._block.count(None) == 1 and set(self._block) == {None, 1}

    @property
    def is_blockwise(self) -> bool:
        """Scaled in blocks that the block gemm takes ([Note: one scale layout])."""
        return kernel_block(self._block) is not None

    # -- the wire ([Note: the wire]) ----------------------------------------------------------

    def scale_travels(self, dim: int = 0) -> bool:
        """Whether pieces of this tensor along ``dim`` have scales of their own, which cross the
        wire with the bytes ([Note: the wire]): the grid has a block length along ``dim``."""
        return self._block[dim % self._data.dim()] is not None

    def to_wire(self, dim: int = 0) -> Tuple[Tuple[torch.Tensor, ...], WireMeta]:
        """(the uint8 tensors a collective moving pieces of this tensor along ``dim`` moves,
        the WireMeta that :meth:`from_wire` rebuilds it with) ([Note: the wire])."""
        travels = self.scale_travels(dim)
        inner = (self._data, self._scale) if travels else (self._data,)
        wire = tuple(_as_bytes(t) for t in inner)
        return wire, WireMeta(self._data.dtype, self._scale.dtype, None if travels else self._scale,
                              self._orig_dtype, self._block, self._mm_config, self._tensor_scale,
                              self._packed_dim)

    @staticmethod
    def from_wire(meta: WireMeta, wire: Sequence[torch.Tensor], *,
                  orig_dtype: Optional[torch.dtype] = None,
                  out: Optional["Float8Tensor"] = None) -> Optional["Float8Tensor"]:
        """The Float8Tensor of the wire tensors ``wire`` (as :meth:`to_wire` gave them, moved by
        a collective) and ``meta``; standing for ``orig_dtype`` if given. With ``out`` (FSDP2's
        all-gather into the buffers of the tensor it made before) the bytes and scales are
        copied into ``out``'s, their leading rows (its padding dropped), and None is returned."""
        data = wire[0].view(meta.dtype)
        scale = meta.scale if meta.scale is not None else wire[1].view(meta.scale_dtype)
        if out is None:
            return Float8Tensor(data, scale, orig_dtype or meta.orig_dtype,
                                mm_config=meta.mm_config, block=meta.block,
                                tensor_scale=meta.tensor_scale, packed_dim=meta.packed_dim)
        pairs = [(out._data, data), (out._scale, scale), (out._tensor_scale, meta.tensor_scale)]
        for mine, new in pairs:
            if mine is not None and (
                    mine.untyped_storage().data_ptr() != new.untyped_storage().data_ptr()):
                mine.copy_(new[: mine.shape[0]] if mine.dim() else new)
        return None

    def float8_values(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """(the float8 values as float32, the float32 scale per element that divides them,
        broadcasting against them): the cast's numbers, for tools that inspect casts
        (f8dist.debug); the value is their quotient."""
        return self.values(), self.scale_per_element()

    def values(self) -> torch.Tensor:
        """The float8 (or e2m1) values as float32, in the tensor's shape: NVFP4's pairs unpacked
        ([Note: two-level scales])."""
        if self._packed_dim is None:
            return self._data.to(torch.float32)
        return e2m1_unpack(self._data, self._packed_dim)

    def scale_per_element(self) -> torch.Tensor:
        """The float32 scale to divide ``_data`` by, broadcasting against it: the grid with its
        blocks expanded ([Note: one scale layout]); two levels of decode scales, the reciprocal
        of their product ([Note: two-level scales])."""
        grid = expand_blocks(self._scale, self._block, self.shape)
        if self._tensor_scale is None:
            return grid
        return (self._tensor_scale * grid).reciprocal()


class _Dequantize(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t: Float8Tensor):
        if t._tensor_scale is not None:  # [Note: two-level scales]
            return nvfp4_dequantize(t._data, t._scale, t._block, t._tensor_scale, t._orig_dtype,
                                    t._packed_dim)
        return dequantize(t._data, t.scale_per_element(), t._orig_dtype)

    @staticmethod
    def backward(ctx, grad):
        return grad


# ---------------------------------------------------------------------------------------------
# op table
# ---------------------------------------------------------------------------------------------

_OPS: Dict[object, Callable] = {}


def _implements(ops):
    """Register a Float8Tensor implementation for one or more aten ops; each handles tensorwise,
    axiswise and block-scaled tensors, or raises for the layouts it cannot keep."""

    def decorator(fn):
        for op in ops:
            _OPS[op] = fn
        return fn

    return decorator


def _with_companions(out, handler, func, args, kwargs):
    """``out`` (a Float8Tensor or a list of them) with the companions of ``args``' Float8Tensors
    put through the same op ([Note: two casts of one tensor]); without them when any is missing."""
    from torch.utils._pytree import tree_flatten, tree_map_only

    inputs = [t for t in tree_flatten(args)[0] if isinstance(t, Float8Tensor)]
    if not inputs or any(t._companion is None for t in inputs):
        return out
    kept = inputs[0]._companion
    if isinstance(kept, KeptShard):  # stays where it is: passed on if every input carries it
        if all(t._companion is kept for t in inputs):
            for o in (out if isinstance(out, (list, tuple)) else [out]):
                o._companion = kept
        return out
    if any(not isinstance(t._companion, Float8Tensor) for t in inputs):
        return out
    companions = handler(func, tree_map_only(Float8Tensor, lambda t: t._companion, args), kwargs)
    if isinstance(out, Float8Tensor):
        out._companion = companions
    elif isinstance(out, (list, tuple)):
        for o, c in zip(out, companions):
            o._companion = c
    return out


def _grid_shape(block: Block, shape) -> list:
    """The shape of the grid of scales of a tensor of ``shape`` in ``block`` blocks."""
    return [1 if b is None else -(-n // b) for n, b in zip(shape, block)]


def _scale_pieces(t: "Float8Tensor", sizes, dim: int, what: str):
    """The sizes of the scale grid's pieces along ``dim`` for pieces of ``t`` of ``sizes``
    elements: each piece must start on a block boundary (the last may end short); None: the
    grid is whole along ``dim``, every piece has all of it ([Note: one scale layout])."""
    block, start = t._block[dim], 0
    if block is None:
        return None
    for size in sizes[:-1]:
        start += size
        if start % block:
            raise NotImplementedError(
                f"cannot {what} a block-scaled Float8Tensor of shape {tuple(t.shape)} along dim "
                f"{dim} into pieces of {list(sizes)}: a piece would split its {block}-wide blocks; "
                "shard on block boundaries ([Note: shards on block boundaries] in f8dist/core/placement.py)")
    return [-(-size // block) for size in sizes]


def rewrap(t: Float8Tensor, data: torch.Tensor, scale=None, *, block=None, mm_config=None,
           orig_dtype=None, packed_dim=None) -> Float8Tensor:
    """A Float8Tensor like ``t`` (orig dtype, mm config; scale and block unless given) around
    ``data``: how every op of the table builds its result."""
    return Float8Tensor(
        data,
        t._scale if scale is None else scale,
        t._orig_dtype if orig_dtype is None else orig_dtype,
        mm_config=t._mm_config if mm_config is None else mm_config,
        block=t._block if block is None else block,
        tensor_scale=t._tensor_scale,
        packed_dim=t._packed_dim if packed_dim is None else packed_dim,
    )


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes, contiguous, as uint8 [..., n * itemsize]. A 1-byte dtype is viewed as uint8
    before it is copied: torch has no copy or fill kernels for float4_e2m1fn_x2 (a copy under
    ``torch.use_deterministic_algorithms``, as torchtitan's deterministic runs set, fills the new
    memory first), and uint8 has all of them."""
    if t.element_size() == 1:
        return t.view(torch.uint8).contiguous()
    return t.contiguous().view(torch.uint8)


@_implements([aten.detach.default, aten.alias.default, aten.clone.default])
def _same_scale_unary(func, args, kwargs):
    t = args[0]
    if func is not aten.clone.default:
        return rewrap(t, func(t._data, *args[1:], **kwargs))
    data = func(t._data.view(torch.uint8), *args[1:], **kwargs).view(t._data.dtype)  # _as_bytes
    return rewrap(t, data, t._scale.clone())


@_implements([aten.t.default, aten.transpose.int])
def _transpose(func, args, kwargs):
    t = args[0]
    data = func(t._data, *args[1:], **kwargs)
    if t._data.dim() < 2:
        return rewrap(t, data)
    d0, d1 = (0, 1) if func is aten.t.default else (d % t._data.dim() for d in args[1:3])
    # the grid transposes with its blocks: [N, 1] scales of [N, K] in (1, whole) blocks are the
    # [1, N] scales of its [K, N] transpose in (whole, 1) blocks ([Note: one scale layout])
    block = list(t._block)
    block[d0], block[d1] = block[d1], block[d0]
    scale = t._scale.transpose(d0, d1) if t._scale.dim() else t._scale
    packed = {d0: d1, d1: d0}.get(t._packed_dim, t._packed_dim)  # moves with the bytes
    return rewrap(t, data, scale, block=tuple(block), packed_dim=packed)


def _packed(t: Float8Tensor, sizes, dim: int) -> list:
    """``sizes`` along ``dim`` of ``t`` in elements as lengths of its data: halved along NVFP4's
    packed dim, two elements a byte ([Note: two-level scales])."""
    return [n // 2 for n in sizes] if dim == t._packed_dim else list(sizes)


def _packed_view_shape(t: Float8Tensor, shape) -> list:
    """The shape of ``t``'s data viewed as ``shape`` (a view keeps NVFP4's packed dim last, or
    keeps the shape: [Note: two-level scales])."""
    shape, last = list(shape), t._data.dim() - 1
    if t._packed_dim is None:
        return shape
    if shape == list(t.shape):
        return list(t._data.shape)
    if t._packed_dim != last or not shape or shape[-1] != t.shape[-1]:
        raise NotImplementedError(
            f"cannot reshape an NVFP4 Float8Tensor of shape {tuple(t.shape)} (packed along dim "
            f"{t._packed_dim}) to {tuple(shape)}: a reshape keeps the packed last dim; reshape "
            "before the cast ([Note: two-level scales] in f8dist/core/tensor.py)")
    return shape[:-1] + [shape[-1] // 2]


def _rows_block(block: Block, shape) -> Optional[Tuple[Optional[int], Optional[int]]]:
    """The (rows, cols) block of the [tokens, K] view of a tensor of ``shape`` in ``block``
    blocks, tokens = prod(shape[:-1]) in row-major order; None when that view's blocks are not
    the tensor's. An N-D tensor has them when it is blocked along its last two dims only (rows of
    the last dim, [Note: row blocks of N-D activations] in f8dist/config/specs.py) and every sequence
    (dim -2) holds whole blocks, or there is one sequence ([Note: token blocks of N-D
    activations])."""
    if len(shape) < 2 or any(b != 1 for b in block[:-2]):
        return None
    rows = block[-2]
    if len(shape) > 2 and rows != 1 and math.prod(shape[:-2]) != 1 and (
            rows is None or shape[-2] % rows):
        return None
    return rows, block[-1]


@_implements([aten.view.default, aten._unsafe_view.default, aten.reshape.default])
def _view(func, args, kwargs):
    t, new_shape = args[0], args[1]
    data = func(t._data, _packed_view_shape(t, new_shape), *args[2:], **kwargs)
    if data.shape == t._data.shape:  # e.g. DTensor.from_local's view_as
        return rewrap(t, data)
    if t._scale.dim() == 0:  # one scale
        return rewrap(t, data, block=(None,) * data.dim())
    # the grid follows the [tokens, K] view: [B, S, K] with scales [B, S, 1] <-> [B*S, K] with
    # [B*S, 1]; row blocks [B, S, K / 32] <-> [B*S, K / 32]; token blocks [1, S / 32, K] <->
    # [S / 32, K] ([Note: one scale layout])
    rows = _rows_block(t._block, t._data.shape)
    block = (1,) * (data.dim() - 2) + (rows or ())
    if (rows is None or data.dim() < 2 or data.shape[-1] != t._data.shape[-1]
            or _rows_block(block, data.shape) != rows):
        raise NotImplementedError(
            f"cannot reshape a Float8Tensor of shape {tuple(t.shape)} (blocks {t._block}, scales "
            f"{tuple(t._scale.shape)}) to {tuple(data.shape)}: its scales follow reshapes that "
            "keep the last dim (which must stay last) and the blocks of the [tokens, K] view "
            "(row blocks, or token blocks that every sequence holds whole); reshape before the "
            "cast ([Note: one scale layout] in f8dist/core/tensor.py)")
    n = data.shape[-2]
    grid = t._scale.reshape(*data.shape[:-2], 1 if rows[0] is None else -(-n // rows[0]),
                            t._scale.shape[-1])
    packed = None if t._packed_dim is None else data.dim() - 1
    return rewrap(t, data, grid, block=block, packed_dim=packed)


@_implements([aten.is_same_size.default])
def _is_same_size(func, args, kwargs):
    return args[0].shape == args[1].shape


@_implements([aten.mm.default])
def _mm(func, args, kwargs):
    a, b = args
    if not (isinstance(a, Float8Tensor) and isinstance(b, Float8Tensor)):
        raise TypeError(
            "a float8 gemm needs both operands in float8; got "
            f"{type(a).__name__} @ {type(b).__name__}"
        )
    return _gemm(a, b, None, a._orig_dtype)


@_implements([aten._grouped_mm.default])
def _grouped_mm(func, args, kwargs):
    a, b, offs, bias, out_dtype = _grouped_mm_args(*args, **kwargs)
    if not (isinstance(a, Float8Tensor) and isinstance(b, Float8Tensor)):
        raise TypeError(
            "a float8 grouped gemm needs both operands in float8; got "
            f"{type(a).__name__} and {type(b).__name__}"
        )
    if offs is None or bias is not None:
        raise NotImplementedError(
            f"a float8 grouped gemm takes token groups (offs, got {offs}) and no bias (got "
            f"{bias}); add the bias to its output")
    return _gemm(a, b, offs, a._orig_dtype if out_dtype is None else out_dtype)


def _gemm(a: Float8Tensor, b: Float8Tensor, offs, out_dtype) -> torch.Tensor:
    """The float8 gemm of two Float8Tensors, dense or grouped: [Note: one gemm entry] in
    f8dist/core/gemm.py, which reads the kind off their blocks."""
    return float8_mm(_gemm_data(a), a._scale, a._block, _gemm_data(b), b._scale, b._block, offs,
                     out_dtype=out_dtype, mm_config=a._mm_config,
                     tensor_scales=(a._tensor_scale, b._tensor_scale))


def _gemm_data(t: Float8Tensor) -> torch.Tensor:
    """The data a gemm reads: NVFP4's e2m1 values one a byte, as e4m3 (each is one, exactly:
    [Note: the NVFP4 gemm] in f8dist/core/gemm.py)."""
    return t._data if t._packed_dim is None else t.values().to(torch.float8_e4m3fn)


def _grouped_mm_args(self, mat2, offs=None, bias=None, out_dtype=None):
    return self, mat2, offs, bias, out_dtype


# autocast casts float8 gemm operands to its dtype ([Note: autocast] in f8dist/nn/linear.py): the
# same bytes and scale, standing for a tensor of that dtype (which dequantizing and gemms output)
@_implements([aten._to_copy.default])
def _to_dtype(func, args, kwargs):
    t, dtype = args[0], kwargs.get("dtype")
    if set(kwargs) != {"dtype"} or dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise NotImplementedError(
            f"a Float8Tensor converts to another high-precision dtype only (autocast), got "
            f"{kwargs}; call .to_original_precision() first"
        )
    return rewrap(t, t._data, orig_dtype=dtype)


# FSDP2 views the all-gathered float8 weight to its unpadded size with as_strided
@_implements([aten.as_strided.default])
def _as_strided(func, args, kwargs):
    t = args[0]
    size, stride, shape = list(args[1]), list(args[2]), t.shape
    offset = args[3] if len(args) > 3 else kwargs.get("storage_offset", 0)
    if t._packed_dim is not None:  # in bytes: [Note: two-level scales]
        stride = [n if d == t._packed_dim else n // 2 for d, n in enumerate(stride)]
        data = func(t._data, [n // 2 if d == t._packed_dim else n for d, n in enumerate(size)],
                    stride, offset // 2)
    else:
        data = func(t._data, *args[1:], **kwargs)
    if t._scale.dim() == 0:  # one scale
        return rewrap(t, data, block=(None,) * data.dim())
    # a grid: only a leading part of the tensor (FSDP2 dropping its padding), which keeps the
    # grid's leading blocks ([Note: one scale layout]); or FSDP2's view of the buffer it gathered
    # the shards of a whole dim into (experts sharded on dim 1: [dp * E, N / dp, K] bytes viewed
    # as [E, N, K]), whose grid stayed home ([Note: the wire]): the view's, not the buffer's
    if (len(size) == len(shape) and not offset and data.is_contiguous()
            and list(t._scale.shape) == _grid_shape(t._block, size) != _grid_shape(t._block, shape)):
        return rewrap(t, data)
    if not (len(size) == len(shape) and stride == list(t._data.stride()) and not offset
            and all(0 <= s <= n for s, n in zip(size, shape))):
        raise NotImplementedError(
            f"as_strided of a Float8Tensor with a grid of scales (blocks {t._block}) is defined "
            f"for a leading part of it only, got size {size}, stride {stride}, offset {offset} "
            f"of {tuple(shape)}")
    grid = t._scale
    for d, s in enumerate(size):
        pieces = _scale_pieces(t, [s], d, "as_strided")
        if pieces is not None:
            grid = grid.narrow(d, 0, pieces[0])
    return rewrap(t, data, grid)


# ---------------------------------------------------------------------------------------------
# [Note: float8 on the wire]
# ``DTensor.redistribute`` moves a local tensor with ``torch.ops._c10d_functional`` collectives
# and reassembles gathered shards with ``split``/``cat``. A Float8Tensor crosses it as its wire
# tensors ([Note: the wire]): the float8 bytes and any scales that travel as ``uint8`` views
# (gloo has no float8 type; NCCL carries the same bytes), and:
#
# * tensorwise: the scale is one number computed from the reduced amax ([Note: amax] in
#   f8dist/core/placement.py), the same on every rank, so it stays metadata and is not sent;
# * axiswise: each shard carries its own per-row scales ([..., 1] at the scaled-over dim); they
#   are gathered with the data (4 bytes per row, against 1 per element), so a per-token cast
#   needs no amax collective at all;
# * block-scaled: each shard carries its grid of block scales (as uint8: gloo has no e8m0 type;
#   1 byte per 32 elements for MXFP8, 4 per 128 for DeepSeek's float32), gathered, split and
#   cat with the data along block boundaries, so a shard's blocks are blocks of the whole tensor
#   and a cast before the collective gives the bytes and scales of a cast after it.
#
# The collective is waited on before a Float8Tensor is returned, so ``wait_tensor`` and DTensor's
# async wrapper are identities here.
# ---------------------------------------------------------------------------------------------


def _gather(t: torch.Tensor, group_size: int, group_name: str) -> torch.Tensor:
    out = c10d.all_gather_into_tensor(t, group_size, group_name)
    return c10d.wait_tensor(out)


@_implements([c10d.all_gather_into_tensor.default])
def _all_gather(func, args, kwargs):
    t, group_size, group_name = args
    _scale_pieces(t, [t.shape[0]] * group_size, 0, "all-gather")  # grids stack along dim 0
    wire, meta = t.to_wire(0)  # [Note: the wire]
    return Float8Tensor.from_wire(meta, [_gather(w, group_size, group_name) for w in wire])


# DTensor wraps a collective's result for async waiting (torch >= 2.13 routes this through an op,
# which its Python module defines: import it so the table is complete whatever was imported first)
if torch.distributed.is_available():
    import torch.distributed._functional_collectives  # noqa: F401
_WRAPS = [c10d.wait_tensor.default]
if hasattr(c10d, "_wrap_tensor_autograd"):
    _WRAPS.append(c10d._wrap_tensor_autograd.default)


@_implements(_WRAPS)
def _already_waited(func, args, kwargs):
    return args[0]  # gathered synchronously in _all_gather


@_implements([aten.split.Tensor, aten.chunk.default])
def _split(func, args, kwargs):
    t, size_or_chunks = args[0], args[1]
    dim = (args[2] if len(args) > 2 else kwargs.get("dim", 0)) % t._data.dim()
    # the pieces' lengths in elements (NVFP4's data holds them in fewer bytes: [Note: two-level
    # scales])
    pieces = func(t._data if t._packed_dim is None else torch.empty(t.shape, device="meta"),
                  size_or_chunks, dim)
    sizes = _scale_pieces(t, [p.shape[dim] for p in pieces], dim, "split")
    datas = pieces if t._packed_dim is None else torch.split(
        t._data, _packed(t, [p.shape[dim] for p in pieces], dim), dim)
    if sizes is None:  # the grid is whole along dim: every piece has all of it
        return [rewrap(t, d) for d in datas]
    return [rewrap(t, d, s) for d, s in zip(datas, torch.split(t._scale, sizes, dim))]


# [Note: a slice of the whole dim]
# DTensor's all-gather narrows the gathered tensor to the logical size of the gathered dim when the
# two are not the same Python int object (``is not``, torch 2.13: so for any size above 256,
# CPython's small-int cache), a slice that keeps every element: it keeps the float8 tensor as it is.
@_implements([aten.slice.Tensor])
def _slice(func, args, kwargs):
    t, dim = args[0], (args[1] if len(args) > 1 else kwargs.get("dim", 0))
    start = args[2] if len(args) > 2 else kwargs.get("start", None)
    end = args[3] if len(args) > 3 else kwargs.get("end", None)
    step = args[4] if len(args) > 4 else kwargs.get("step", 1)
    size = t.shape[dim]  # a whole dim's end also ends NVFP4's packed bytes
    if (start or 0) != 0 or (end is not None and end < size) or step != 1:
        raise NotImplementedError(
            f"slicing a Float8Tensor is defined for the whole dim only, got [{start}:{end}:{step}] "
            f"of dim {dim} ({size}); call .to_original_precision() first")
    return rewrap(t, func(t._data, *args[1:], **kwargs))


@_implements([aten.cat.default])
def _cat(func, args, kwargs):
    tensors = args[0]
    dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
    first = tensors[0]
    if not all(isinstance(t, Float8Tensor) for t in tensors):
        raise TypeError("cat of Float8Tensors needs every piece in float8")
    dim = dim % first._data.dim()
    if any(t._block != first._block or t._scale.dtype != first._scale.dtype
           or (t._tensor_scale is None) != (first._tensor_scale is None)
           or t._packed_dim != first._packed_dim for t in tensors):
        raise ValueError(
            f"cat of Float8Tensors needs one block shape and scale dtype, got "
            f"{[(t._block, t._scale.dtype) for t in tensors]}")
    if _scale_pieces(first, [t.shape[dim] for t in tensors], dim, "cat") is None and any(
            t._scale is not first._scale and not torch.equal(t._scale, first._scale)
            for t in tensors):
        raise ValueError(
            f"cat of Float8Tensors along dim {dim}, along which their scales do not vary (blocks "
            f"{first._block}: tensorwise, or the whole dim), needs one shared scale")
    if first._tensor_scale is not None and any(
            not torch.equal(t._tensor_scale, first._tensor_scale) for t in tensors):
        raise ValueError("cat of NVFP4 Float8Tensors needs one shared tensor scale (each piece's "
                         "came from the logical tensor's amax: [Note: two-level scales])")
    # the pieces' wire tensors put together ([Note: the wire])
    wires = [t.to_wire(dim)[0] for t in tensors]
    return Float8Tensor.from_wire(first.to_wire(dim)[1], [func(list(w), dim) for w in zip(*wires)])


# the ops that carry a companion cast through ([Note: two casts of one tensor]): those that move
# or re-view a tensor between its cast and its gemms
_CARRY_COMPANION = frozenset([
    aten.detach.default, aten.alias.default, aten.clone.default, aten.view.default,
    aten._unsafe_view.default, aten.reshape.default, aten._to_copy.default, aten.slice.Tensor,
    aten.split.Tensor, aten.chunk.default, aten.cat.default,
    c10d.all_gather_into_tensor.default, *_WRAPS,
])
