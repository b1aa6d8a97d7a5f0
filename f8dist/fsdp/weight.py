"""A high-precision weight that FSDP2 all-gathers in float8.

[Note: float8 all-gather]
With ``Float8LinearConfig(enable_fsdp_float8_all_gather=True)`` a Float8Linear's weight is a
:class:`Float8AllGatherWeight`: it holds the high-precision weight (what the optimizer updates and
checkpoints store) and implements FSDP2's all-gather extension hooks:

* ``fsdp_pre_all_gather`` casts this rank's shard to float8 with the scale of the WHOLE weight
  (its amax reduced over the mesh axes sharding it, ``[Note: amax]`` in f8dist/placement.py: dp
  under FSDP2, dp and tp under 2-D; a precomputed or delayed scale when there is one), pads it to
  FSDP2's padded shard size (uneven shards, empty ones included) and hands FSDP2 its bytes as
  ``uint8``, so gloo and NCCL carry it: its wire tensors ([Note: the wire] in f8dist/tensor.py).
  The scale rides along as metadata (the WireMeta): it is the same on every rank.
* ``fsdp_post_all_gather`` views the gathered bytes as float8 (``Float8Tensor.from_wire``, one
  post_all_gather for every weight kind) and returns a
  :class:`~f8dist.tensor.Float8Tensor` (of ``param_dtype``, so a bf16 MixedPrecisionPolicy gives
  bf16 gemm outputs) that ``_Float8Matmul`` takes as its weight without casting again. From the
  second all-gather on FSDP2 passes ``out=``: the gathered bytes are already in ``out``'s buffer
  and only the scale is updated.

The bytes each rank casts are exactly those a single device casts from the unsharded weight (same
scale, same elementwise cast), so results match one device bit for bit.

Outside the hooks the wrapper behaves like its high-precision tensor: view-like and allocation ops
keep the wrapper (FSDP2 chunks, pads and narrows it), everything else returns plain tensors, and
in-place ops (the optimizer) update the wrapped tensor.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import torch
import torch.nn.functional as F
from torch.utils._pytree import tree_leaves, tree_map, tree_map_only

from f8dist.cast import cast_to_float8
from f8dist.config import Float8LinearConfig, Gemm, Operand, ScalingType
from f8dist.placement import (
    blocks_split_by_shards, is_dtensor, like, local_part, reduce_over_shards,
)
from f8dist.scaling import amax_to_scale, tensor_amax
from f8dist.tensor import Float8Tensor, wrapper_like

__all__ = ["Float8AllGatherWeight"]

aten = torch.ops.aten

# ops whose results stay wrapped: how FSDP2 shards, pads and re-views a parameter, and how
# ``module.to(...)`` / ``to_empty`` rebuild one
_KEEP_WRAPPED = {
    aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default, aten.slice.Tensor,
    aten.narrow.default, aten.view.default, aten._unsafe_view.default, aten.reshape.default,
    aten.as_strided.default, aten.detach.default, aten.alias.default, aten.clone.default,
    aten._to_copy.default, aten.new_zeros.default, aten.new_empty.default,
    aten.new_empty_strided.default, aten.empty_like.default,
}


class Float8AllGatherWeight(torch.Tensor):
    """A high-precision weight whose FSDP2 all-gather runs in float8 ([Note: float8 all-gather]).

    Made by ``Float8Linear.from_float`` when ``config.enable_fsdp_float8_all_gather`` is set.

    Example::

        >>> config = Float8LinearConfig(enable_fsdp_float8_all_gather=True)
        >>> lin = Float8Linear.from_float(nn.Linear(32, 16), config)   # doctest: +SKIP
        >>> type(lin.weight).__name__                                   # doctest: +SKIP
        'Float8AllGatherWeight'
        >>> fully_shard(lin)                       # all-gathers 1 byte per element  # doctest: +SKIP
    """

    _tensor: torch.Tensor
    _config: Float8LinearConfig
    # (scale, version of _tensor it was computed at), set by precompute_float8_dynamic_scale_for_fsdp;
    # dropped by any in-place op on the wrapper (which does not bump _tensor's version counter)
    _precomputed: Optional[Tuple[torch.Tensor, int]]

    @staticmethod
    def __new__(cls, tensor: torch.Tensor, config: Float8LinearConfig):
        if isinstance(tensor, Float8AllGatherWeight):
            tensor = tensor._tensor
        self = wrapper_like(cls, tensor, tensor.dtype)
        self._tensor = tensor
        self._config = config
        self._precomputed = None
        return self

    def __repr__(self):
        return f"Float8AllGatherWeight({self._tensor})"

    def __tensor_flatten__(self):
        return ["_tensor"], self._config

    @staticmethod
    def __tensor_unflatten__(inner_tensors, config, outer_size, outer_stride):
        return Float8AllGatherWeight(inner_tensors["_tensor"], config)

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        config = next(a._config for a in tree_leaves((args, kwargs)) if isinstance(a, cls))
        unwrapped = {}

        def unwrap(t):
            if isinstance(t, cls):
                unwrapped[id(t._tensor)] = t
                return t._tensor
            return t

        out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))
        if func._schema.is_mutable:
            for w in unwrapped.values():  # e.g. the optimizer step: a precomputed scale is stale
                w._precomputed = None
        if func in _KEEP_WRAPPED:
            return tree_map_only(torch.Tensor, lambda t: cls(t, config), out)
        # an in-place op returns the tensor it mutated: give back the wrapper around it
        return tree_map_only(torch.Tensor, lambda t: unwrapped.get(id(t), t), out)

    # -- FSDP2 all-gather extension --------------------------------------------------------------

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        inputs, metadata = self._all_gather_inputs(mesh, outer_size, module)
        # [Note: one-rank FSDP2 group]: the inputs FSDP2 then does not copy ride along
        local = tuple(t.clone() for t in inputs[1:]) if mesh.size() == 1 else ()
        return inputs, (metadata, local)

    def _all_gather_inputs(self, mesh, outer_size, module):
        """This rank's all-gather inputs (uint8) and the metadata post_all_gather reads."""
        shard = self._tensor  # [rows, K], rows <= padded rows (0 for an empty shard)
        spec = _weight_spec(self, module, self._config)
        if spec.grouped:  # a 3-D expert weight: [Note: float8 all-gather of expert weights]
            return _experts_pre_all_gather(self, outer_size, mesh, module, spec)
        if tuple(shard.shape[1:]) != tuple(outer_size[1:]):
            raise NotImplementedError(
                f"float8 all-gather supports FSDP2 sharding on dim 0 only; got a shard of shape "
                f"{tuple(shard.shape)} of a weight of shape {tuple(outer_size)}. Use the default "
                "shard_placement_fn or enable_fsdp_float8_all_gather=False."
            )
        if spec.blockwise:
            return _block_pre_all_gather(self, outer_size, mesh, module, spec)
        scale = self._scale_for_all_gather(mesh, module, spec)
        # the shard is cast as part of the logical weight, so that observers (f8dist.debug) reduce
        # its statistics over the shards ([Note: statistics of the logical tensor])
        fp8 = local_part(cast_to_float8(like(_sharded_param(self, module), shard), spec, scale))
        padded_rows = -(-outer_size[0] // mesh.size())  # FSDP2 pads every shard to chunk 0's size
        (data,), meta = _to_wire(fp8, 0)  # [rows, K] uint8
        data = F.pad(data, (0, 0, 0, padded_rows - data.shape[0])) if data.dim() == 2 else \
            F.pad(data, (0, padded_rows - data.shape[0]))  # [padded_rows, K]
        return (data,), meta

    def fsdp_post_all_gather(
        self,
        all_gather_outputs: Tuple[torch.Tensor, ...],
        metadata: Any,
        param_dtype: torch.dtype,
        *,
        out: Optional[torch.Tensor] = None,
    ):
        metadata, local = metadata
        # [Note: one-rank FSDP2 group]: the outputs FSDP2 did not make are this rank's inputs
        outputs = (*all_gather_outputs, *local[len(all_gather_outputs) - 1:])
        if out is not None:  # FSDP2's second all-gather on: into the tensor it made before
            target = local_part(out)
            if not isinstance(target, Float8Tensor):
                raise TypeError(f"FSDP2 passed out={type(target).__name__}, expected a Float8Tensor")
            return Float8Tensor.from_wire(metadata, outputs, out=target)
        # [world * padded_rows, K] bytes (and the gathered scales, when they travel)
        return Float8Tensor.from_wire(metadata, outputs, orig_dtype=param_dtype), tuple(outputs)

    def _scale_for_all_gather(self, mesh, module, spec) -> torch.Tensor:
        """The scale of the whole weight: delayed, precomputed, or from an amax all-reduce."""
        if spec.scaling_type is ScalingType.DELAYED:
            # the module's synced amax history: no collective, the shard's amax is recorded for
            # the next sync (on the first step the history is filled from all shards, one
            # all-reduce: [Note: first step] in f8dist/delayed/scale.py)
            # a copy: the sync updates the buffer in place ([Note: eval forwards under FSDP2])
            return module.delayed.all_gather_scale(
                self._tensor, *_sharding_of(self, module, mesh)
            ).clone()
        if self._precomputed is not None and self._precomputed[1] == self._tensor._version:
            return self._precomputed[0]
        amax = self._whole_weight_amax(mesh, module)
        return amax_to_scale(amax, spec.dtype, round_to_power_of_2=spec.round_scales_to_power_of_2)

    def _whole_weight_amax(self, mesh, module) -> torch.Tensor:
        """amax of the logical weight: one all-reduce over the axes sharding it."""
        return reduce_over_shards(tensor_amax(self._tensor), *_sharding_of(self, module, mesh), "max")


# [Note: one-rank FSDP2 group]
# On a one-rank FSDP2 group (one process; dp = 1 under TP or EP) torch's FSDP2 runs no collective
# (FSDPParamGroup.unshard and wait_for_unshard, torch 2.13): it calls fsdp_pre_all_gather, copies
# its FIRST input into the all-gather output and hands fsdp_post_all_gather that one output, with
# the metadata. A weight may send more than one input (a block-scaled weight's scales, the
# per-expert scales of experts FSDP2 shards on dim 0), so on a mesh of one rank (the group FSDP2
# tests) pre_all_gather puts the inputs after the first in the metadata too, and post_all_gather
# takes each output FSDP2 did not make from there: on one rank an all-gather returns its input.
# One rule for every weight kind; with more ranks nothing more rides along. They are clones:
# FSDP2 frees the storage of the tensors post_all_gather returns and re-allocates it.


# [Note: block-scaled all-gather]
# A block-scaled weight ([Note: block scales] in f8dist/cells.py) is all-gathered as two
# tensors, its float8 bytes and its grid of block scales (as uint8: 1 byte per block for e8m0, 4
# for float32), cast by each rank from its shard with no collective: a block's scale depends on
# its own elements. When FSDP2's shards (ceil(rows / world) rows each, the last ones padded)
# start on block boundaries, every rank casts the blocks one device casts, bit for bit; a shard
# that would split a block raises, naming the fix. Only square weight blocks are gathered in
# float8 (the config says so): the one gathered copy serves the output and grad_input gemms.


def _block_pre_all_gather(weight: "Float8AllGatherWeight", outer_size, mesh, module, spec):
    from torch.distributed.tensor import Shard

    block = spec.block_shape(2)
    rows_per_block, padded_rows = block[0], -(-outer_size[0] // mesh.size())  # FSDP2's chunk
    split = blocks_split_by_shards(outer_size, block, [mesh.size()], [Shard(0)])
    if split:  # [Note: shards on block boundaries] in f8dist/placement.py
        raise ValueError(
            f"{spec.site}: the float8 all-gather of a block-scaled weight needs shards on block "
            f"boundaries, got {split}: change the number of ranks or the layer's size, or set "
            "enable_fsdp_float8_all_gather=False"
        )
    # cast as part of the logical weight (telemetry reduces its statistics over the shards)
    shard = weight._tensor  # [rows, K]
    fp8 = local_part(cast_to_float8(like(_sharded_param(weight, module), shard), spec))
    (data, scale), meta = _to_wire(fp8, 0)  # [rows, K], [rows / br, scale bytes per block row]
    data = F.pad(data, (0, 0, 0, padded_rows - data.shape[0]))  # [padded_rows, K]
    scale = F.pad(scale, (0, 0, 0, padded_rows // rows_per_block - scale.shape[0]))
    return (data, scale), meta


# [Note: float8 all-gather of expert weights]
# A Float8GroupedExperts' weights w1, w2, w3 ([experts, out, in], f8dist/grouped.py) are wrapped
# like a Float8Linear's weight when its config sets enable_fsdp_float8_all_gather, which needs a
# tensorwise weight cast: for experts, one scale per expert ([Note: grouped casts] in
# f8dist/specs.py), one float8 copy serving the output and grad_input gemms; dynamic only
# (``gathers_float8``: the experts' delayed and block-scaled weights, which the config allows
# with the all-gather for linears, are gathered in high precision, and convert_to_float8_training
# warns naming them: refusing the config would take the float8 gather from its linears too).
# (Rowwise recipes scale the weight per row in the output gemm and per column in the grad_input
# gemm, so one float8 copy cannot serve both: the config refuses the float8 all-gather for them.)
# Each rank casts its shard as part of the logical weight: the per-expert
# amax is the DTensor reduction over dims 1 and 2, made Replicate over the mesh axes that shard
# those dims ([Note: amax] in f8dist/placement.py), so
#
# * FSDP2 on dim 1 (EP x FSDP2, [Note: EP x FSDP2] in f8dist/models/moe_parallel.py): one
#   all-reduce of the local experts' amaxes over dp_shard; the scales are then the same on every
#   dp_shard rank and ride along as metadata, the all-gather carries 1 byte per element;
# * FSDP2 on dim 0 (experts sharded by FSDP2 alone): each rank holds whole experts, whose scales
#   need no collective and differ between ranks, so they are gathered with the bytes (a second
#   all-gather input, 4 bytes per expert); FSDP2 then needs num_experts to be a multiple of its
#   ranks (its uneven shards take inputs of the padded shard's size only), else this raises.
#
# Every rank thus casts the bytes one device casts from the whole weight: one device's numbers,
# bit for bit (tests/distributed/test_fsdp_experts.py).


def gathers_float8(spec) -> bool:
    """Whether FSDP2 all-gathers an expert weight whose output-gemm cast is ``spec`` in float8
    ([Note: float8 all-gather of expert weights]): a dynamic per-expert (tensorwise) cast; the
    experts' delayed and block-scaled casts are gathered in high precision."""
    return (spec.enabled and not spec.axiswise and not spec.blockwise
            and spec.scaling_type is ScalingType.DYNAMIC)


def _experts_pre_all_gather(weight: "Float8AllGatherWeight", outer_size, mesh, module, spec):
    shard = weight._tensor  # [E_local, N, K] sharded on dim 0 or 1 by FSDP2
    if not gathers_float8(spec):  # Float8GroupedExperts wraps no such weight
        raise NotImplementedError(f"{spec.site}: float8 all-gather of expert weights is dynamic "
                                  "tensorwise")
    fsdp_dim = 0 if tuple(shard.shape[1:]) == tuple(outer_size[1:]) else 1
    if fsdp_dim == 0 and outer_size[0] % mesh.size():
        raise ValueError(
            f"{spec.site}: the float8 all-gather of expert weights sharded on the experts dim by "
            f"FSDP2 needs num_experts ({outer_size[0]}) to be a multiple of its {mesh.size()} "
            "ranks; change the number of experts or ranks, shard on dim 1 (fully_shard_moe), or "
            "set enable_fsdp_float8_all_gather=False"
        )
    fp8 = local_part(cast_to_float8(like(_sharded_param(weight, module), shard), spec))
    # [E_local, N, K] bytes; on dim 1 the [E_local, 1, 1] scales are the same on every FSDP2
    # rank, on dim 0 they travel as [E_local, 1, 4] uint8 ([Note: the wire] in f8dist/tensor.py)
    return _to_wire(fp8, fsdp_dim)


def _to_wire(fp8: Float8Tensor, dim: int):
    """The all-gather inputs of ``fp8``'s pieces along ``dim`` and its WireMeta, the metadata
    post_all_gather rebuilds it with ([Note: the wire] in f8dist/tensor.py). A scale that stays
    home is copied: FSDP2's ``out=`` writes the next all-gather's scale into the tensor
    post_all_gather made around it."""
    wire, meta = fp8.to_wire(dim)
    return wire, meta if meta.scale is None else meta._replace(scale=meta.scale.clone())


def _weight_spec(local: torch.Tensor, module, config: Float8LinearConfig):
    """The output gemm's weight cast of the module owning the weight whose local tensor is
    ``local``: a Float8Linear's, or the grouped cast of one of a Float8GroupedExperts' weights
    (its ``specs`` hold one CastSpecs per weight name). FSDP2's 1-argument hook passes no module:
    then the wrapper's config, unnamed."""
    specs = getattr(module, "specs", None)
    if isinstance(specs, dict):  # grouped experts: which of w1, w2, w3
        for name, p in module.named_parameters(recurse=False):
            if p is local or getattr(p, "_local_tensor", None) is local:
                return specs[name][Gemm.OUTPUT, Operand.WEIGHT]
        raise RuntimeError(f"{type(module).__name__} holds no parameter {type(local).__name__}")
    if specs is not None:
        return specs[Gemm.OUTPUT, Operand.WEIGHT]
    return config.cast_spec(Gemm.OUTPUT, Operand.WEIGHT)


def _sharded_param(local: torch.Tensor, module):
    """The sharded DTensor parameter of ``module`` whose local tensor is ``local`` (None without a
    module: the 1-argument hook)."""
    if module is not None:
        for p in module.parameters(recurse=False):
            if getattr(p, "_local_tensor", None) is local:
                return p
    return None


def _sharding_of(local: torch.Tensor, module, mesh):
    """(mesh, placements) of the sharded DTensor parameter whose local tensor is ``local``.

    Under 2-D FSDP x TP this is the 2-D mesh with dp and tp placements; without a module (the
    1-argument hook) the FSDP mesh, sharded on every axis."""
    param = _sharded_param(local, module)
    if param is not None:
        return param.device_mesh, param.placements
    from torch.distributed.tensor import Shard

    return mesh, [Shard(0)] * mesh.ndim


def wrap_weight_for_float8_all_gather(module: torch.nn.Module,
                                      names: Tuple[str, ...] = ("weight",)) -> None:
    """Make each parameter ``names`` of ``module`` (a Float8Linear's weight, a
    Float8GroupedExperts' w1, w2, w3) a :class:`Float8AllGatherWeight` parameter sharing its
    storage, and keep the module's ``state_dict`` in plain high-precision tensors (the keys and
    values of ``nn.Linear`` / ``GroupedExperts``), so checkpoints load into models with or
    without float8.

    The modules call it again after ``load_state_dict(sd, assign=True)``, which puts the
    checkpoint's plain tensor in place of the wrapper (FSDP2 would then all-gather that weight in
    high precision)."""
    for name in names:
        weight = getattr(module, name)
        if isinstance(weight, Float8AllGatherWeight) or is_dtensor(weight):  # done, or sharded
            continue
        setattr(module, name, torch.nn.Parameter(
            Float8AllGatherWeight(weight.detach(), module.config),
            requires_grad=weight.requires_grad))
    if not getattr(module, "_plain_weight_hook", False):
        module._register_state_dict_hook(_plain_weights_in_state_dict)
        module._plain_weight_hook = True


def _plain_weights_in_state_dict(module, state_dict, prefix, local_metadata):
    for name, _ in module.named_parameters(prefix=prefix[:-1], recurse=False):
        value = state_dict.get(name)
        if isinstance(value, Float8AllGatherWeight):
            state_dict[name] = value._tensor
        elif is_dtensor(value) and isinstance(value._local_tensor, Float8AllGatherWeight):
            state_dict[name] = like(value, value._local_tensor._tensor)
