"""A high-precision weight that FSDP2 all-gathers in float8.

[Note: float8 all-gather]
With ``Float8LinearConfig(enable_fsdp_float8_all_gather=True)`` a Float8Linear's weight is a
:class:`Float8AllGatherWeight`: it holds the high-precision weight (what the optimizer updates and
checkpoints store) and implements FSDP2's all-gather extension hooks:

* ``fsdp_pre_all_gather`` casts this rank's shard with the scale of the WHOLE weight ([Note:
  amax] in f8dist/core/placement.py; or a precomputed or delayed scale), pads it to FSDP2's padded
  shard size and hands FSDP2 ``uint8`` wire tensors ([Note: the wire] in f8dist/core/tensor.py); the
  scale, the same on every rank, rides along as metadata.
* ``fsdp_post_all_gather`` views the gathered bytes as a
  :class:`~f8dist.core.tensor.Float8Tensor` of ``param_dtype`` that the linear takes without casting
  again; with FSDP2's ``out=`` only the scale is updated.

Each rank casts the bytes one device casts from the unsharded weight: one device's numbers, bit
for bit. Outside the hooks view-like and allocation ops keep the wrapper (FSDP2 chunks and pads
it), other ops return plain tensors and in-place ops update the wrapped tensor.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import torch
import torch.nn.functional as F
from torch.utils._pytree import tree_leaves, tree_map, tree_map_only

from f8dist.core.cast import cast_to_float8
from f8dist.config import Float8LinearConfig, Gemm, Operand, ScalingType
from f8dist.core.placement import (
    all_gather, blocks_split_by_shards, is_dtensor, like, local_part, reduce_over_shards,
)
from f8dist.core.scaling import amax_to_scale, tensor_amax
from f8dist.core.tensor import Float8Tensor, wrapper_like

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
    # (scale, _tensor's version), from precompute_float8_dynamic_scale_for_fsdp; dropped by any
    # in-place op on the wrapper (which does not bump _tensor's version counter)
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
        # cast as part of the logical weight ([Note: statistics of the logical tensor])
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
            return self._delayed_scale(mesh, module)
        if self._precomputed is not None and self._precomputed[1] == self._tensor._version:
            return self._precomputed[0]
        amax = self._whole_weight_amax(mesh, module)
        return amax_to_scale(amax, spec.dtype, round_to_power_of_2=spec.round_scales_to_power_of_2)

    def _delayed_scale(self, mesh, module) -> torch.Tensor:
        """The delayed scale of the whole weight, from its amax history (a Float8Linear's, or
        the ExpertWeightScaling of an expert weight); recorded, as a forward's weight cast is."""
        scaling = getattr(module, "delayed_scaling", None)  # grouped experts: one per weight
        state = module.delayed if scaling is None else scaling[_param_name(self, module)].delayed
        # a copy: the sync updates the buffer in place ([Note: eval forwards under FSDP2])
        return state.all_gather_scale(self._tensor, *_sharding_of(self, module, mesh)).clone()

    def _whole_weight_amax(self, mesh, module) -> torch.Tensor:
        """amax of the logical weight: one all-reduce over the axes sharding it."""
        return reduce_over_shards(tensor_amax(self._tensor), *_sharding_of(self, module, mesh), "max")


# [Note: one-rank FSDP2 group]
# On a one-rank group FSDP2 runs no collective (FSDPParamGroup.unshard, torch 2.13): it copies
# only the FIRST all-gather input to the output. A weight with more inputs (block scales, per-expert
# scales) so also puts the others in the metadata on one rank, and post_all_gather takes the
# outputs FSDP2 did not make from there. Clones: FSDP2 frees and re-allocates the returned storage.


# [Note: block-scaled all-gather]
# A block-scaled weight ([Note: block scales] in f8dist/config/cells.py) travels as its float8 bytes and
# its scale grid (uint8), cast per shard with no collective: a block's scale is its own. FSDP2's
# shards must start on block boundaries (else this raises, naming the fix). Only square blocks
# are gathered in float8 (config rule): one copy serves the output and grad_input gemms. NVFP4's
# 16x16 blocks ([Note: two-level scales] in f8dist/core/tensor.py) travel the same way, 4-bit
# e2m1 pairs and e4m3 block scales; its float32 tensor scale, the logical weight's (the cast's
# one amax all-reduce over the shard axis), is the same on every rank and stays home in the
# WireMeta.


def _block_pre_all_gather(weight: "Float8AllGatherWeight", outer_size, mesh, module, spec):
    block = spec.block_shape(2)
    rows_per_block, padded_rows = block[0], -(-outer_size[0] // mesh.size())  # FSDP2's chunk
    _check_whole_blocks(spec, outer_size, mesh, 0)
    # cast as part of the logical weight ([Note: statistics of the logical tensor])
    shard = weight._tensor  # [rows, K]
    fp8 = local_part(cast_to_float8(like(_sharded_param(weight, module), shard), spec))
    (data, scale), meta = _to_wire(fp8, 0)  # [rows, K], [rows / br, scale bytes per block row]
    data = F.pad(data, (0, 0, 0, padded_rows - data.shape[0]))  # [padded_rows, K]
    scale = F.pad(scale, (0, 0, 0, padded_rows // rows_per_block - scale.shape[0]))
    return (data, scale), meta


# [Note: float8 all-gather of expert weights]
# A Float8GroupedExperts' w1, w2, w3 ([experts, out, in]) are wrapped like a Float8Linear's
# weight and cast as their output gemm's weight spec says ([Note: grouped casts] in
# f8dist/config/specs.py): one dynamic scale per expert [E, 1, 1], a delayed scale of the whole
# weight (its ExpertWeightScaling's history, [Note: delayed experts] in f8dist/nn/grouped.py), or
# square blocks per expert (1, rows, cols). Each rank casts its shard as part of the logical
# weight ([Note: amax] in f8dist/core/placement.py), so the gathered bytes and scales are those of
# a cast of the whole weight:
#
# * FSDP2 on dim 0: each rank holds whole experts, whose per-expert scales and block grids travel
#   with the bytes along dim 0 ([Note: the wire] in f8dist/core/tensor.py); FSDP2's uneven shards
#   then need num_experts % ranks == 0;
# * FSDP2 on dim 1 ([Note: EP x FSDP2] in f8dist/models/moe_parallel.py): FSDP2 chunk-cats every
#   all-gather output in the shape of the weight's shard (torch 2.13), so nothing else rides
#   with the bytes: per-expert scales come from one all-reduce of the local experts' amaxes, a
#   block grid from one all-gather of the shards' grids (each shard holding whole blocks), and
#   stay home, in the WireMeta, as a delayed scale does (the same on every rank).
#
# A block shard that would split a block raises at the all-gather, naming the fix.


def _experts_pre_all_gather(weight: "Float8AllGatherWeight", outer_size, mesh, module, spec):
    shard = weight._tensor  # [E_local, N, K] sharded on dim 0 or 1 by FSDP2
    fsdp_dim = 0 if tuple(shard.shape[1:]) == tuple(outer_size[1:]) else 1
    if fsdp_dim == 0 and outer_size[0] % mesh.size():
        raise ValueError(
            f"{spec.site}: the float8 all-gather of expert weights sharded on the experts dim by "
            f"FSDP2 needs num_experts ({outer_size[0]}) to be a multiple of its {mesh.size()} "
            "ranks; change the number of experts or ranks, shard on dim 1 (fully_shard_moe), or "
            "set enable_fsdp_float8_all_gather=False"
        )
    if spec.blockwise:
        _check_whole_blocks(spec, outer_size, mesh, fsdp_dim)
    scale = weight._delayed_scale(mesh, module) if spec.scaling_type is ScalingType.DELAYED \
        else None
    fp8 = local_part(cast_to_float8(like(_sharded_param(weight, module), shard), spec, scale))
    wire, meta = _to_wire(fp8, fsdp_dim)  # [E_local, N, K] bytes (and the scales on dim 0)
    if fsdp_dim == 1 and len(wire) > 1:  # the block grid of the whole dim 1 stays home
        grid = all_gather(wire[1], 1, mesh).view(meta.scale_dtype)  # [E_local, N / rows, K / cols]
        wire, meta = wire[:1], meta._replace(scale=grid)
    return wire, meta


def _check_whole_blocks(spec, outer_size, mesh, dim: int) -> None:
    """Raise unless FSDP2's shards of a weight of ``outer_size`` on ``dim`` hold whole blocks of
    ``spec`` ([Note: shards on block boundaries] in f8dist/core/placement.py)."""
    from torch.distributed.tensor import Shard

    block = spec.block_shape(len(outer_size))
    split = blocks_split_by_shards(outer_size, block, [mesh.size()], [Shard(dim)])
    if split:
        raise ValueError(
            f"{spec.site}: the float8 all-gather of a block-scaled weight needs shards on block "
            f"boundaries, got {split}: change the number of ranks or the layer's size, or set "
            "enable_fsdp_float8_all_gather=False"
        )


def _to_wire(fp8: Float8Tensor, dim: int):
    """``fp8``'s all-gather inputs along ``dim`` and its WireMeta ([Note: the wire] in
    f8dist/core/tensor.py). A scale in the metadata is copied: FSDP2's ``out=`` overwrites it later."""
    wire, meta = fp8.to_wire(dim)
    return wire, meta if meta.scale is None else meta._replace(scale=meta.scale.clone())


def _weight_spec(local: torch.Tensor, module, config: Float8LinearConfig):
    """The output gemm's weight cast for the weight whose local tensor is ``local`` (no module,
    from FSDP2's 1-argument hook: the wrapper's config)."""
    specs = getattr(module, "specs", None)
    if isinstance(specs, dict):  # grouped experts: which of w1, w2, w3
        return specs[_param_name(local, module)][Gemm.OUTPUT, Operand.WEIGHT]
    if specs is not None:
        return specs[Gemm.OUTPUT, Operand.WEIGHT]
    return config.cast_spec(Gemm.OUTPUT, Operand.WEIGHT)


def _param_name(local: torch.Tensor, module) -> str:
    """The name of ``module``'s parameter whose local tensor is ``local``."""
    for name, p in module.named_parameters(recurse=False):
        if p is local or getattr(p, "_local_tensor", None) is local:
            return name
    raise RuntimeError(f"{type(module).__name__} holds no parameter {type(local).__name__}")


def _sharded_param(local: torch.Tensor, module):
    """The sharded DTensor parameter of ``module`` whose local tensor is ``local`` (None without a
    module: the 1-argument hook)."""
    if module is not None:
        for p in module.parameters(recurse=False):
            if getattr(p, "_local_tensor", None) is local:
                return p
    return None


def _sharding_of(local: torch.Tensor, module, mesh):
    """(mesh, placements) of the sharded DTensor parameter whose local tensor is ``local``;
    without a module, ``mesh`` sharded on every axis."""
    param = _sharded_param(local, module)
    if param is not None:
        return param.device_mesh, param.placements
    from torch.distributed.tensor import Shard

    return mesh, [Shard(0)] * mesh.ndim


def wrap_weight_for_float8_all_gather(module: torch.nn.Module,
                                      names: Tuple[str, ...] = ("weight",)) -> None:
    """Make each parameter ``names`` of ``module`` a :class:`Float8AllGatherWeight` sharing its
    storage, keeping ``state_dict`` in plain tensors (checkpoints load with or without float8).
    Called again after ``load_state_dict(sd, assign=True)``, which replaces the wrapper."""
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
