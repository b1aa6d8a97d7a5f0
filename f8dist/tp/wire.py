"""Float8Tensor through DTensor's functional collectives: 1 byte per element on the wire.

[Note: float8 on the wire]
``DTensor.redistribute`` moves a local tensor with ``torch.ops._c10d_functional`` collectives and
reassembles gathered shards with ``split``/``cat``. For a local Float8Tensor these ops run here:
the float8 bytes travel as a ``uint8`` view (gloo has no float8 type; NCCL carries the same bytes),
and the scale goes along as follows:

* tensorwise: the scale is one number computed from the tp-reduced amax (``[Note: amax]``), the
  same on every rank, so it stays metadata and is not sent;
* axiswise: each shard carries its own per-row scales ([..., 1] at the scaled-over dim); they are
  gathered with the data (4 bytes per row, against 1 per element), so a per-token cast needs no
  amax collective at all.

The collective is waited on before a Float8Tensor is returned, so ``wait_tensor`` and DTensor's
async wrapper are identities here.
"""

from __future__ import annotations

import torch

from f8dist.tensor import Float8Tensor, implements, rewrap

__all__ = []

aten = torch.ops.aten
c10d = torch.ops._c10d_functional


def _gather(t: torch.Tensor, group_size: int, group_name: str) -> torch.Tensor:
    out = c10d.all_gather_into_tensor(t, group_size, group_name)
    return c10d.wait_tensor(out)


def _check_gather_dim0(t: Float8Tensor) -> None:
    if t.is_axiswise and t._axiswise_dim % t._data.dim() == 0:
        raise NotImplementedError(
            "cannot all-gather an axiswise Float8Tensor along its scaled-over dim 0: each shard "
            "holds a partial row of the scales; cast along another dim or gather in high precision"
        )


@implements([c10d.all_gather_into_tensor.default])
def _all_gather(func, args, kwargs):
    t, group_size, group_name = args
    _check_gather_dim0(t)
    data = t._data.contiguous().view(torch.uint8)  # [n, ...] one byte per element
    gathered = _gather(data, group_size, group_name).view(t._data.dtype)  # [n * group_size, ...]
    scale = t._scale
    if t.is_axiswise:
        scale = _gather(scale.contiguous(), group_size, group_name)  # [n * group_size, ..., 1, ...]
    return rewrap(t, gathered, scale)


# DTensor wraps a collective's result for async waiting (torch >= 2.13 routes this through an op)
_WRAPS = [c10d.wait_tensor.default]
if hasattr(c10d, "_wrap_tensor_autograd"):
    _WRAPS.append(c10d._wrap_tensor_autograd.default)


@implements(_WRAPS)
def _already_waited(func, args, kwargs):
    return args[0]  # gathered synchronously in _all_gather


@implements([aten.split.Tensor, aten.chunk.default])
def _split(func, args, kwargs):
    t, size_or_chunks = args[0], args[1]
    dim = args[2] if len(args) > 2 else kwargs.get("dim", 0)
    datas = func(t._data, size_or_chunks, dim)
    if not t.is_axiswise:
        return [rewrap(t, d) for d in datas]
    if dim % t._data.dim() == t._axiswise_dim % t._data.dim():
        raise NotImplementedError("cannot split an axiswise Float8Tensor along its scaled-over dim")
    scales = func(t._scale, size_or_chunks, dim)
    return [rewrap(t, d, s) for d, s in zip(datas, scales)]


@implements([aten.cat.default])
def _cat(func, args, kwargs):
    tensors = args[0]
    dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
    first = tensors[0]
    if not all(isinstance(t, Float8Tensor) for t in tensors):
        raise TypeError("cat of Float8Tensors needs every piece in float8")
    data = func([t._data.view(torch.uint8) for t in tensors], dim).view(first._data.dtype)
    if not first.is_axiswise:
        if any(t._scale is not first._scale and not torch.equal(t._scale, first._scale) for t in tensors):
            raise ValueError("cat of tensorwise Float8Tensors needs one shared scale")
        return rewrap(first, data)
    if dim % data.dim() == first._axiswise_dim % data.dim():
        raise NotImplementedError("cannot cat axiswise Float8Tensors along their scaled-over dim")
    scale = func([t._scale for t in tensors], dim)
    return rewrap(first, data, scale)
