"""f8dist in torchtitan 0.3.0: a model converter, its Float8Linear, optimizer hooks and configs.

[Note: torchtitan integration]
torchtitan builds a model from a tree of configs: a model's ``model_registry(flavor,
converters=[...])`` lets each converter rewrite the tree before the model is built, and the
Trainer then builds it on the meta device, applies its parallelisms (``parallelize_fn``: TP,
compile, FSDP2), moves it with ``to_empty`` and initializes it with ``init_weights``. So:

* :class:`Float8LinearConverter` replaces each ``Linear.Config`` its filter accepts with a
  :class:`Float8Linear.Config` that keeps every field (dims, ``param_init``, sharding) and adds the
  float8 options and the layer's FQN;
* :class:`Float8Linear` is f8dist's Float8Linear and a torchtitan ``Module``: it builds on meta,
  ``init_weights`` initializes its weight with the original ``param_init`` and re-creates its
  delayed-scaling buffers (``to_empty`` leaves them uninitialized); with float8 all-gather its
  weight is a ``Float8AllGatherWeight`` from construction on, so torchtitan's FSDP apply function
  shards it like any weight and all-gathers it in float8;
* :class:`Float8GroupedExpertsConverter` replaces each ``GroupedExperts.Config`` (the routed
  experts of torchtitan's MoE models, e.g. deepseek_v3) with a :class:`Float8GroupedExperts.Config`:
  the same module and parameters (``w1_EFD``, ``w2_EDF``, ``w3_EFD``), whose three grouped gemms
  run through f8dist's float8 grouped gemms, cast by the recipe's table per expert
  ([Note: grouped gemms] in f8dist/nn/grouped.py), and their ``AllToAllTokenDispatcher.Config`` with
  a :class:`Float8AllToAllTokenDispatcher.Config`, whose expert-parallel dispatch sends float8
  tokens; routers and combine are untouched;
* under torchtitan's tensor parallelism (``Module.parallelize`` from each config's
  ``ShardingConfig``), :class:`Float8Linear` casts its local shards with the logical tensors'
  amaxes ([Note: float8 casts under spmd_types]) and keeps its delayed buffers whole ([Note:
  delayed buffers under torchtitan's parallelize]); the converter swaps ``FeedForward`` and
  ``GQAttention`` configs for :class:`Float8FeedForward` and :class:`Float8GQAttention`, which
  all-gather their sequence-parallel input in float8 ([Note: float8 sequence-parallel
  all-gathers under torchtitan]);
* :func:`post_optimizer_build_fn` registers what f8dist needs around the optimizer step: the
  delayed-scaling sync before it, the FSDP scale precompute after it; :func:`with_float8_hooks`
  chains it after the ``post_optimizer_build_fn`` a ``ModelSpec`` already has;
* the ``llama3_debugmodel_float8_*`` functions are torchtitan config functions:
  ``python -m torchtitan.train --module f8dist.integrations.torchtitan --config NAME``.

What stays high precision under torchtitan (MLA and MoE inputs, the expert-parallel dispatch):
docs/torchtitan.md.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import sys
from typing import Callable, List, Literal, Optional

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

try:
    import spmd_types as spmd
    from torchtitan.components.quantization import QuantizationConverter
    from torchtitan.distributed.parallel_dims import MeshAxisName
    from torchtitan.models.common.attention import FusedQKVLinear, GQAttention
    from torchtitan.models.common.feed_forward import FeedForward
    from torchtitan.models.common.linear import Linear
    from torchtitan.models.common.moe import GroupedExperts, RoutedExperts
    from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher
    from torchtitan.protocols.model_spec import ModelSpec
    from torchtitan.protocols.module import Module
    from torchtitan.protocols.sharding import ShardingConfig, resolve_placements
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "f8dist.integrations.torchtitan needs torchtitan 0.3.0: install f8dist with its extra, "
        "`pip install torch==2.13.0 && pip install -e \".[torchtitan]\"`"
    ) from e

# Modules, not functions: this module is also a torchtitan config registry, and torchtitan lists
# every public callable of it as a config function when --config names none.
import f8dist
from f8dist.policy import delayed, filters
from f8dist.parallel import fsdp
from f8dist.core import gemm, placement
from f8dist.nn import grouped
from f8dist.parallel.ep import dispatch as ep_dispatch
from f8dist.core.tensor import Float8Tensor
from f8dist.parallel.tp import style as tp_style
from f8dist.integrations import torchtitan_assets

__all__ = [
    "AUTO_FILTER",
    "Float8Linear",
    "Float8LinearConverter",
    "Float8GroupedExperts",
    "Float8GroupedExpertsConverter",
    "Float8AllToAllTokenDispatcher",
    "Float8FeedForward",
    "Float8GQAttention",
    "post_optimizer_build_fn",
    "with_float8_hooks",
    "llama3_debugmodel_float8_tensorwise",
    "llama3_debugmodel_float8_rowwise",
    "llama3_debugmodel_float8_rowwise_with_gw_hp",
    "llama3_debugmodel_float8_delayed",
    "llama3_debugmodel_float8_tensorwise_fsdp_all_gather",
    "llama3_debugmodel_float8_mxfp8",
    "llama3_debugmodel_float8_blockwise",
]

logger = logging.getLogger(__name__)

# the recipe names torchtitan's config parser accepts: every Float8LinearRecipeName
RecipeName = Literal[tuple(r.value for r in f8dist.Float8LinearRecipeName)]

# the filter_fqns entry torchtitan users know from torchao ("auto_filter_small_kn"), served by
# f8dist.auto_filter_for_recipe
AUTO_FILTER = "auto_filter_small_kn"


def _float8_config(recipe_name: str, enable_fsdp_float8_all_gather: bool,
                   pad_inner_dim: bool) -> f8dist.Float8LinearConfig:
    return f8dist.Float8LinearConfig.from_recipe_name(recipe_name).replace(
        enable_fsdp_float8_all_gather=enable_fsdp_float8_all_gather, pad_inner_dim=pad_inner_dim
    )


def _as(config_type: type, config, **extra):
    """A ``config_type`` (a subclass of ``config``'s type) holding every field of ``config``, and
    ``extra``."""
    return config_type(**{f.name: getattr(config, f.name) for f in dataclasses.fields(config)},
                       **extra)


def _experts_specs(config) -> dict:
    """The grouped gemms' cast specs of the experts a config with ``recipe_name`` and ``fqn``
    names."""
    return grouped.grouped_specs(_float8_config(config.recipe_name, False, False), config.fqn)


def _put(root, parent, attr, new):
    """``new`` in the place ``Module.Config.traverse`` found a config at (``parent[attr]`` or
    ``parent.attr``; the root itself when ``parent`` is None); returns the root."""
    if parent is None:
        return new
    if isinstance(parent, list):
        parent[attr] = new
    else:
        setattr(parent, attr, new)
    return root


class Float8Linear(f8dist.Float8Linear, Module):
    """f8dist's :class:`~f8dist.Float8Linear` as a torchtitan ``Module``, built from a
    :class:`Float8Linear.Config` (what :class:`Float8LinearConverter` puts in the model config).

    It inherits ``Module`` rather than torchtitan's ``Linear`` (whose ``__init__`` takes a config
    where ``nn.Linear``'s takes dims); its Config inherits ``Linear.Config``, so config traversals
    for linears still find it.

    Example::

        >>> lin = Float8Linear.Config(in_features=64, out_features=32, recipe_name="rowwise",
        ...                           fqn="layers.0.w1").build()
        >>> lin.config.cast_config("output", "input").scaling_granularity.value
        'axiswise'
    """

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(Linear.Config):
        recipe_name: RecipeName = "tensorwise"
        enable_fsdp_float8_all_gather: bool = False
        pad_inner_dim: bool = False
        # precompute this weight's float8 all-gather scale after each optimizer step
        precompute_float8_dynamic_scale_for_fsdp: bool = False
        fqn: str = ""

    def __init__(self, config: Config):
        f8dist.Float8Linear.__init__(
            self, config.in_features, config.out_features, bias=config.bias,
            config=_float8_config(config.recipe_name, config.enable_fsdp_float8_all_gather,
                                  config.pad_inner_dim),
            fqn=config.fqn,
        )
        # read by post_optimizer_build_fn
        self.recipe_name = config.recipe_name
        self.precompute_float8_dynamic_scale_for_fsdp = (
            config.precompute_float8_dynamic_scale_for_fsdp
        )
        if config.enable_fsdp_float8_all_gather:
            fsdp.wrap_weight_for_float8_all_gather(self)

    # (mesh, placements) of the TP region under spmd_types: [Note: float8 casts under spmd_types]
    _tp_region: Optional[tuple] = None

    def parallelize(self, parallel_dims) -> None:
        if parallel_dims.tp_enabled and self._sharding_config is not None:
            _refuse_tp_replicated_weight(self._sharding_config, self.fqn)
        Module.parallelize(self, parallel_dims)
        if (parallel_dims.spmd_backend == "spmd_types" and parallel_dims.tp_enabled
                and self._sharding_config is not None):
            self._tp_region = _tp_region(self._sharding_config,
                                         parallel_dims.get_dense_tp_mesh())

    def _distribute_states(self, parallel_dims) -> None:
        # [Note: delayed buffers under torchtitan's parallelize]
        # Module._distribute_states raises for a buffer its ShardingConfig has no placement for,
        # and torchtitan's model sharding (decoder_sharding.py) declares the weight and bias only.
        # The amax histories stay plain tensors on every rank, whole, as under f8dist's own TP
        # styles: each rank records the amax of what it casts, and the sync before the optimizer
        # step (one MAX all-reduce over all ranks) gives every rank the logical tensors' amaxes.
        kept = {name: self._buffers.pop(name) for name in _delayed_buffers(self)}
        try:
            Module._distribute_states(self, parallel_dims)
        finally:
            self._buffers.update(kept)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if self._tp_region is None:
            return f8dist.Float8Linear.forward(self, input)
        mesh, (x, grad_x), (w, b), (out, grad_out) = (
            _normalized(self._tp_region, input.dim()))
        if not isinstance(input, DTensor):  # a DTensor: gathered in float8 by its module
            input = DTensor.from_local(input, mesh, (x,), run_check=False,
                                       grad_placements=(grad_x,))
        weight = DTensor.from_local(self.weight, mesh, (w,), run_check=False)
        bias = (None if self.bias is None
                else DTensor.from_local(self.bias, mesh, (b,), run_check=False))
        output = self.forward_with(input, weight, bias)
        return output.to_local(grad_placements=(grad_out,))

    def _init_self_buffers(self, *, buffer_device=None) -> None:
        # Buffers built on meta hold nothing after to_empty(): make the delayed-scaling ones anew,
        # as Float8Linear.from_float does for a linear that was on meta.
        if self.delayed is not None:
            self.delayed = delayed.DelayedScaling.attach(self)
            if buffer_device is not None:
                for name, buf in self._buffers.items():
                    self._buffers[name] = buf.to(buffer_device)


def _delayed_buffers(linear: f8dist.Float8Linear) -> List[str]:
    """The names of ``linear``'s delayed-scaling buffers (amaxes, histories, scales, steps)."""
    return [] if linear.delayed is None else list(linear.delayed.buffer_names)


def _refuse_tp_replicated_weight(sharding: ShardingConfig, fqn: str) -> None:
    """A weight torchtitan replicates over tp (deepseek_v3's ``wkv_a``, ``wq_a``) gets its
    gradient tp-partial, and a float8 cast of partial sums is not one device's: refuse it."""
    layout = sharding.state_shardings.get("weight")
    tp = None if layout is None else layout.per_axis_spmd_types().get(MeshAxisName.TP)
    if tp is not None and not isinstance(tp, spmd.Shard):
        raise ValueError(
            f"Float8Linear {fqn or '<root>'}: torchtitan's ShardingConfig keeps its weight "
            f"{tp} over tp, so its gradients arrive tp-partial and a float8 cast of partial sums "
            f"is not one device's numbers; keep it in high precision with the converter's "
            f"filter_fqns (e.g. filter_fqns=[\"lm_head\", \"{fqn.rsplit('.', 1)[-1] or fqn}\"])")


def _tp_region(sharding: ShardingConfig, mesh) -> Optional[tuple]:
    """``(mesh, (input, its grad), (weight, bias), (output, its grad))``: the TP placements of a
    linear's local tensors under torchtitan's spmd_types backend, read from its weight's TP type
    ([Note: float8 casts under spmd_types]); None when the weight is not TP-sharded.

    [Note: float8 casts under spmd_types]
    Under ``spmd_backend="spmd_types"`` (torchtitan 0.3.0's default) a module's forward gets plain
    local tensors: the weight's TP shard and the activation's. A float8 cast of a shard would
    take the shard's amax (tensorwise: each rank its own scale, not one device's). So the layer
    wraps its local tensors as DTensors on the TP mesh, with the placements its ShardingConfig
    gives them, and casts as under the full_dtensor backend or f8dist's own TP styles: the amax
    of the logical tensor ([Note: amax] in f8dist/core/placement.py). The placements follow the
    weight's: colwise (S(0)) takes a replicated input, whose gradient is partial (spmd_types'
    R -> P), and gives a sharded output; rowwise (S(1)) takes a sharded input and gives a partial
    output, whose gradient is replicated (P -> R). torchtitan's redistributions around the
    layer are unchanged.
    """
    layouts = sharding.state_shardings
    weight = layouts["weight"].per_axis_spmd_types().get(MeshAxisName.TP)
    if not isinstance(weight, spmd.Shard):
        return None
    bias_layout = layouts.get("bias")
    bias = (Replicate() if bias_layout is None
            else spmd.spmd_type_to_dtensor_placement(
                bias_layout.per_axis_spmd_types()[MeshAxisName.TP]))
    if weight.dim % 2 == 0:  # colwise: the 2-D weight [out, in] sharded on out
        return mesh, (Replicate(), Partial()), (Shard(0), bias), (Shard(-1), Shard(-1))
    return mesh, (Shard(-1), Shard(-1)), (Shard(1), bias), (Partial(), Replicate())


def _normalized(placements, ndim: int):
    """``placements`` (nested tuples) with ``Shard(-1)`` as the last dim of an ``ndim``-D
    activation: DTensor's gradient placements take non-negative dims only."""
    if isinstance(placements, tuple):
        return tuple(_normalized(p, ndim) for p in placements)
    return Shard(ndim - 1) if placements == Shard(-1) else placements


class _Float8Gather:
    """A torchtitan module (FeedForward, GQAttention) whose input arrives sequence-sharded and is
    all-gathered in float8, in its forward, for the Float8Linears that read it.

    [Note: float8 sequence-parallel all-gathers under torchtitan]
    torchtitan declares the sequence-parallel all-gather (tp ``S(1) -> R``) on the module whose
    linears read the activation: ``in_src/in_dst_shardings`` of FeedForward's ``x`` and
    GQAttention's ``x_BLD`` (models/common/decoder_sharding.py), run by ``Module.parallelize``'s
    wrapper before the forward, on the high-precision tensor. These modules' Configs build a
    subclass (the converter swaps the Config, every field kept) that takes the gather over when
    every linear reading the input is a Float8Linear: its build drops the boundary's gather
    (``in_dst`` = ``in_src``), and its forward casts the sequence shard as the first reader's
    ``(output, input)`` spec says (the amax of the logical tensor; a delayed cast records into
    every reader, [Note: delayed casts in the float8 styles] in f8dist/parallel/tp/style.py) and
    all-gathers the float8 bytes (DTensor ``redistribute``): 1 byte per element on the wire, one
    cast for all readers, which reuse the gathered bytes. Its backward reduce-scatters the
    readers' partial gradients, as torchtitan's redistribution does. Readers in high precision,
    or a sharding config without this gather (tp off, sequence parallel off), leave the module
    as torchtitan's.
    """

    # (argument name, its sharding after the gather, the Float8Linears that read it)
    _float8_gather: Optional[tuple] = None
    _gather_mesh = None

    def _readers(self) -> List[nn.Module]:
        raise NotImplementedError

    def _take_gather(self, arg: str) -> None:
        sharding = self._sharding_config
        readers = self._readers()
        if sharding is None or not all(isinstance(m, Float8Linear) for m in readers):
            return
        src = (sharding.in_src_shardings or {}).get(arg)
        dst = (sharding.in_dst_shardings or {}).get(arg)
        if src is None or dst is None:
            return
        tp_src, tp_dst = (layout.per_axis_spmd_types().get(MeshAxisName.TP)
                          for layout in (src, dst))
        if not (isinstance(tp_src, spmd.Shard) and tp_dst is spmd.R):
            return
        self._sharding_config = dataclasses.replace(
            sharding, in_dst_shardings={**sharding.in_dst_shardings, arg: src})
        self._float8_gather = (arg, dst, readers)

    def parallelize(self, parallel_dims) -> None:
        Module.parallelize(self, parallel_dims)
        if self._float8_gather is not None and parallel_dims.tp_enabled:
            self._gather_mesh = parallel_dims.get_dense_tp_mesh()

    def _gather(self, x: torch.Tensor) -> torch.Tensor:
        """``x``'s sequence shard, cast to float8 and all-gathered: a DTensor whose local tensor
        is the whole sequence's float8 bytes."""
        if self._gather_mesh is None:
            return x
        _, dst, readers = self._float8_gather
        if isinstance(x, DTensor):  # full_dtensor: on the dense mesh
            mesh, desired = x.device_mesh, resolve_placements(dst, x.device_mesh)
        else:  # spmd_types: the local shard, on the tp mesh
            mesh, desired = self._gather_mesh, (Replicate(),)
            x = DTensor.from_local(x, mesh, (Shard(1),), run_check=False)
        spec = readers[0].specs[tp_style.OUTPUT_INPUT]
        x = tp_style.cast_input(x, spec, readers, desired)
        return x.redistribute(mesh, desired)


def _build_taking_gather(base: type, arg: str) -> Callable:
    """A Config's ``build``: ``base``'s (its ``sharding_config`` attached), then the module takes
    the gather of its input ``arg`` over (slots dataclasses have no zero-argument ``super()``)."""
    def build(self, **kwargs):
        instance = base.build(self, **kwargs)
        instance._take_gather(arg)
        return instance

    return build


class Float8FeedForward(_Float8Gather, FeedForward):
    """torchtitan's ``FeedForward`` whose sequence-parallel input all-gather moves float8 when
    ``w1`` and ``w3`` are Float8Linears ([Note: float8 sequence-parallel all-gathers under
    torchtitan])."""

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(FeedForward.Config):
        build = _build_taking_gather(FeedForward.Config, "x")

    def _readers(self) -> List[nn.Module]:
        return [self.w1, self.w3]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return FeedForward.forward(self, self._gather(x))


class Float8GQAttention(_Float8Gather, GQAttention):
    """torchtitan's ``GQAttention`` whose sequence-parallel input all-gather moves float8 when
    its Q/K/V projections are Float8Linears ([Note: float8 sequence-parallel all-gathers under
    torchtitan])."""

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(GQAttention.Config):
        build = _build_taking_gather(GQAttention.Config, "x_BLD")

    def _readers(self) -> List[nn.Module]:
        qkv = self.qkv_linear
        return [qkv.wqkv] if isinstance(qkv, FusedQKVLinear) else [qkv.wq, qkv.wkv]

    def forward(self, x_BLD, attention_masks, positions=None):
        return GQAttention.forward(self, self._gather(x_BLD), attention_masks, positions)


# the module configs whose input the converter lets gather in float8, by their float8 subclass
_GATHERS = {FeedForward.Config: Float8FeedForward.Config,
            GQAttention.Config: Float8GQAttention.Config}


# converter options every converted layer's Config carries
_LAYER_OPTIONS = ("recipe_name", "enable_fsdp_float8_all_gather", "pad_inner_dim",
                  "precompute_float8_dynamic_scale_for_fsdp")



def _tail_filter(model_config: Module.Config, recipe_name: str):
    """The recipe's high-precision tail of ``model_config``'s blocks ``layers.N`` ([Note: a
    high-precision tail] in f8dist/policy/filters.py), one rule for its linears and experts."""
    blocks = {int(f.split(".")[1]) for f, *_ in model_config.traverse(Linear.Config)
              if re.match(r"layers\.\d+\.", f)}
    return filters.high_precision_tail_filter(recipe_name, max(blocks, default=-1) + 1)

class Float8LinearConverter(QuantizationConverter):
    """Convert the ``Linear.Config``\\ s of a torchtitan model config to :class:`Float8Linear`.

    Pass its Config to a model's ``model_registry(..., converters=[...])``; wrap the resulting
    ``ModelSpec`` with :func:`with_float8_hooks` so delayed scaling and the FSDP precompute run.

    * ``recipe_name``: "tensorwise", "rowwise", "rowwise_with_gw_hp", "delayed", or the
      block-scaled "mxfp8", "mxfp8_wgrad_with_hp", "mxfp8_square_weights" and "blockwise"
      (``f8dist.Float8LinearConfig.from_recipe_name``; block scales: single device and FSDP2,
      no tensor parallel yet).
    * ``filter_fqns``: linears whose FQN contains one of these stay high precision (one string
      is one FQN);
      "auto_filter_small_kn" adds f8dist's auto filter (``docs/auto_filter.md``) for
      ``auto_filter_tokens`` tokens per gemm (local batch size x sequence length). The recipe's
      last blocks stay high precision too (nvfp4: the last 15% of ``layers.*``, as torchtitan's
      NVFP4 converter keeps them; ``f8dist.policy.filters.HIGH_PRECISION_TAIL``).
    * ``enable_fsdp_float8_all_gather``: FSDP2 all-gathers the weights in float8 (the recipes
      whose one float8 weight serves both of its gemms: tensorwise, delayed and the square-block
      ones); ``precompute_float8_dynamic_scale_for_fsdp``: their scales in one
      all-reduce after each optimizer step (dynamic tensorwise only).
    * ``pad_inner_dim``: pad dims that are not multiples of 16 (or of the recipe's blocks)
      instead of keeping those linears in high precision.

    Only plain ``Linear.Config``\\ s are converted; subclasses (e.g. ``ScaledBiasRowwiseLinear``)
    have their own forward and stay as they are. Plain ``FeedForward.Config``\\ s and
    ``GQAttention.Config``\\ s become :class:`Float8FeedForward` / :class:`Float8GQAttention`
    (the same module, every field kept), which all-gather a sequence-parallel input in float8
    when the linears reading it are Float8Linears.

    Example::

        >>> from torchtitan.models.llama3 import model_registry
        >>> float8 = Float8LinearConverter.Config(recipe_name="rowwise", filter_fqns=["lm_head"])
        >>> spec = with_float8_hooks(model_registry("debugmodel", converters=[float8]))
    """

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(QuantizationConverter.Config):
        recipe_name: RecipeName = "tensorwise"
        filter_fqns: List[str] = dataclasses.field(default_factory=list)
        float8_combine: bool = False
        float8_backward: bool = False
        auto_filter_tokens: int = 8192
        enable_fsdp_float8_all_gather: bool = False
        precompute_float8_dynamic_scale_for_fsdp: bool = False
        pad_inner_dim: bool = False

    def __init__(self, config: Config):
        self.config = config
        # validates the combination (e.g. float8 all-gather needs a tensorwise weight cast)
        self.float8_config = _float8_config(
            config.recipe_name, config.enable_fsdp_float8_all_gather, config.pad_inner_dim)
        if config.precompute_float8_dynamic_scale_for_fsdp:
            if not config.enable_fsdp_float8_all_gather:
                raise ValueError(
                    "precompute_float8_dynamic_scale_for_fsdp computes the scales of float8 "
                    "all-gathers; set enable_fsdp_float8_all_gather=True too, or turn it off"
                )
            if self.float8_config.cast_config_weight.scaling_type is not f8dist.ScalingType.DYNAMIC:
                raise ValueError(
                    f"precompute_float8_dynamic_scale_for_fsdp is for dynamic weight scales; the "
                    f"{config.recipe_name!r} recipe takes its weight scale from the amax history "
                    "(synced before each optimizer step). Turn it off for this recipe"
                )
        filter_fqns = _fqn_list(config.filter_fqns)
        fqns = [f for f in filter_fqns if f != AUTO_FILTER]
        if AUTO_FILTER in filter_fqns:
            self.filter_fn = filters.auto_filter_for_recipe(
                config.recipe_name, filter_fqns=fqns, tokens=config.auto_filter_tokens
            )
        else:
            self.filter_fn = filters.fqn_filter(fqns)

    def convert(self, model_config: Module.Config) -> Module.Config:
        cfg = self.config
        converted, kept = [], []
        linears = list(model_config.traverse(Linear.Config))
        tail = _tail_filter(model_config, cfg.recipe_name)
        for fqn, linear, parent, attr in linears:
            if (type(linear) is not Linear.Config or not self.filter_fn(linear, fqn)
                    or not tail(linear, fqn)):
                continue
            problems = gemm.shape_problems(self.float8_config.cast_specs(), linear.in_features,
                                      linear.out_features)
            if problems and not cfg.pad_inner_dim:
                kept.append(f"{fqn} ({linear.in_features} -> {linear.out_features}: "
                            f"{', '.join(problems)})")
                continue
            new = _as(Float8Linear.Config, linear, fqn=fqn,
                      **{name: getattr(cfg, name) for name in _LAYER_OPTIONS})
            model_config = _put(model_config, parent, attr, new)
            converted.append(fqn)
        for config_type, float8_type in _GATHERS.items():
            for _, module, parent, attr in list(model_config.traverse(config_type)):
                if type(module) is config_type:
                    model_config = _put(model_config, parent, attr, _as(float8_type, module))
        logger.info("f8dist: %d linear(s) converted to float8 (%s recipe)", len(converted),
                    cfg.recipe_name)
        if kept:
            logger.warning(
                "f8dist: kept %d linear(s) in high precision because their dims do not fit the "
                "float8 gemms (the kernels' alignment, the recipe's blocks): %s. Set "
                "pad_inner_dim=True to pad them instead.",
                len(kept), "; ".join(kept),
            )
        return model_config


class Float8GroupedExperts(GroupedExperts):
    """torchtitan's ``GroupedExperts`` whose grouped gemms run in float8 (f8dist's
    :func:`~f8dist.nn.grouped.float8_grouped_mm`, cast by ``recipe_name``'s table per expert); its
    parameters, state dict and init are torchtitan's.

    Example::

        >>> experts = Float8GroupedExperts.Config(dim=64, hidden_dim=64, num_experts=4,
        ...                                       recipe_name="rowwise", fqn="layers.1.moe").build()
    """

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(GroupedExperts.Config):
        recipe_name: RecipeName = "rowwise"
        fqn: str = ""

    def __init__(self, config: Config):
        super().__init__(config)
        self.fqn = config.fqn
        self.specs = _experts_specs(config)

    def forward(self, x_RD, num_tokens_per_expert_E):
        weights = (placement.local_part(w) for w in (self.w1_EFD, self.w2_EDF, self.w3_EFD))
        offsets_E = torch.cumsum(num_tokens_per_expert_E, dim=0, dtype=torch.int32)
        if isinstance(x_RD, Float8Tensor):  # cast in bf16 before the dispatch, per token
            # the tokens' dtype was that of the weights (FSDP's param_dtype, or the model's)
            dtype, x_RD_bf16 = self.w1_EFD.dtype, x_RD
        else:
            dtype, x_RD_bf16 = x_RD.dtype, grouped.cast_tokens(x_RD.bfloat16(), self.specs)

        def mm(name, a, w, offs):
            return grouped.float8_grouped_mm(a, w.bfloat16(), offs, self.specs[name])

        return grouped.swiglu_experts(x_RD_bf16, *weights, offsets_E, mm).to(dtype)


class Float8AllToAllTokenDispatcher(AllToAllTokenDispatcher):
    """torchtitan's expert-parallel ``AllToAllTokenDispatcher`` whose dispatch all-to-all sends
    float8 tokens, when the experts cast their tokens per token (rowwise, the 1 x K block
    recipes): each token cast on its source rank, as bf16 before the dispatch and the experts'
    cast would give it ([Note: float8 dispatch] in f8dist/parallel/ep/dispatch.py), its bytes and
    scales on the wire, which the experts' grouped gemms take as they are. The count exchange
    stays as torchtitan's; the combine and both backward all-to-alls too, unless
    ``float8_combine`` and ``float8_backward`` (the options of f8dist's
    :class:`~f8dist.parallel.ep.Float8ExpertParallel`, off by default: other numbers than one
    device's run without them) send them as e4m3 per token ([Note: float8 combine and
    backward] in the same file). :class:`Float8GroupedExpertsConverter` puts it in place of a
    ``RoutedExperts``'s ``AllToAllTokenDispatcher.Config``, with the experts' recipe and FQN."""

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(AllToAllTokenDispatcher.Config):
        recipe_name: RecipeName = "rowwise"
        fqn: str = ""
        float8_combine: bool = False
        float8_backward: bool = False

    def __init__(self, config: Config):
        super().__init__(config)
        self.token_spec = grouped.token_spec(_experts_specs(config))  # None: tokens as they are
        self.combine_spec = ep_dispatch.COMBINE_SPEC if config.float8_combine else None
        self.grad_spec = ep_dispatch.GRAD_SPEC if config.float8_backward else None

    def _dispatch_token_exchange(self, routed_input_ND, pg, output_splits, input_splits):
        if self.token_spec is None and self.grad_spec is None:
            return AllToAllTokenDispatcher._dispatch_token_exchange(
                self, routed_input_ND, pg, output_splits, input_splits)
        if self.token_spec is not None:  # cast from bf16, as Float8GroupedExperts casts its tokens
            routed_input_ND = routed_input_ND.bfloat16()
        # the rows in arrival order: torchtitan's _permute orders them by expert next
        arrival = torch.arange(sum(output_splits), device=routed_input_ND.device)
        return ep_dispatch.exchange(routed_input_ND, arrival, input_splits, output_splits, pg,
                                    self.token_spec, self.grad_spec)  # [R, D], float8 with token_spec

    def _combine_token_exchange(self, routed_output_RD, pg, input_splits, output_splits):
        if self.combine_spec is None and self.grad_spec is None:
            return AllToAllTokenDispatcher._combine_token_exchange(
                self, routed_output_RD, pg, input_splits, output_splits)
        # torchtitan's _unpermute gave the rows in arrival order: they go back as they came
        back = torch.arange(sum(input_splits), device=routed_output_RD.device)
        out = ep_dispatch.exchange(routed_output_RD, back, output_splits, input_splits, pg,
                                   self.combine_spec, self.grad_spec)  # [N, D]
        return out.to_original_precision() if isinstance(out, Float8Tensor) else out

    def _permute(self, routed_input_RD, num_global_tokens_per_local_expert_E):
        if not isinstance(routed_input_RD, Float8Tensor):
            return AllToAllTokenDispatcher._permute(
                self, routed_input_RD, num_global_tokens_per_local_expert_E)
        # torchtitan's permutation, read off a one-column stand-in for the rows
        rows = torch.empty(routed_input_RD.shape[0], 0, device=routed_input_RD.device)
        _, _, permuted, counts_e = AllToAllTokenDispatcher._permute(
            self, rows, num_global_tokens_per_local_expert_E)
        return routed_input_RD.shape, _Rows.apply(routed_input_RD, permuted), permuted, counts_e


class _Rows(torch.autograd.Function):
    """``x[index]`` for per-token float8 rows (bytes and scales); the gradient, high precision,
    goes back to the rows it came from."""

    @staticmethod
    def forward(ctx, x, index):
        ctx.index, ctx.rows = index, x.shape[0]
        return ep_dispatch.take_rows(x, index)

    @staticmethod
    def backward(ctx, grad):
        out = grad.new_zeros(ctx.rows, *grad.shape[1:])
        out[ctx.index] = grad
        return out, None


class Float8GroupedExpertsConverter(QuantizationConverter):
    """Convert the ``GroupedExperts.Config``\\ s of a torchtitan MoE model config (e.g.
    deepseek_v3) to :class:`Float8GroupedExperts`.

    * ``recipe_name``: "tensorwise", "rowwise", "rowwise_with_gw_hp" or a block recipe ("mxfp8",
      "mxfp8_wgrad_with_hp", "mxfp8_square_weights", "blockwise"); not "delayed" (torchtitan's
      experts module keeps no amax histories);
    * ``filter_fqns``: experts whose FQN contains one of these stay high precision;
    * ``float8_combine``, ``float8_backward``: the expert-parallel combine and backward
      all-to-alls in float8 (:class:`Float8AllToAllTokenDispatcher`; off by default).

    Experts whose dims are not multiples of 16 (or of the recipe's blocks) stay high precision,
    with a log note. A converted module's plain ``AllToAllTokenDispatcher.Config`` becomes a
    :class:`Float8AllToAllTokenDispatcher.Config` (float8 tokens on the expert-parallel dispatch
    when the recipe casts them per token).

    Example::

        >>> from torchtitan.models.deepseek_v3 import model_registry
        >>> experts = Float8GroupedExpertsConverter.Config(recipe_name="rowwise")
        >>> spec = model_registry("debugmodel", converters=[experts])
    """

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(QuantizationConverter.Config):
        recipe_name: RecipeName = "rowwise"
        filter_fqns: List[str] = dataclasses.field(default_factory=list)
        float8_combine: bool = False
        float8_backward: bool = False

    def __init__(self, config: Config):
        self.config = config
        # validates the recipe for grouped gemms
        self.float8_config = f8dist.Float8LinearConfig.from_recipe_name(config.recipe_name)
        self.float8_config.grouped_cast_specs()
        if self.float8_config.uses(f8dist.ScalingType.DELAYED):
            raise ValueError(
                f"Float8GroupedExpertsConverter: recipe {config.recipe_name!r} needs amax "
                "histories, which torchtitan's experts module does not keep; use a dynamic recipe "
                "('rowwise', 'tensorwise', 'rowwise_with_gw_hp', 'mxfp8', ...) or f8dist's MoE "
                "model (f8dist.models.moe), whose Float8GroupedExperts keeps them")
        self.filter_fqns = _fqn_list(config.filter_fqns)

    def convert(self, model_config: Module.Config) -> Module.Config:
        converted, kept = [], []
        tail = _tail_filter(model_config, self.config.recipe_name)
        for fqn, experts, parent, attr in model_config.traverse(GroupedExperts.Config):
            if type(experts) is not GroupedExperts.Config:
                continue
            if any(f in fqn for f in self.filter_fqns) or not tail(experts, fqn):
                continue
            problems = grouped.grouped_problems(experts, self.float8_config)  # alignment, blocks
            if problems:
                kept.append(f"{fqn} ({experts.dim} <-> {experts.hidden_dim}: "
                            f"{', '.join(problems)})")
                continue
            new = _as(Float8GroupedExperts.Config, experts, recipe_name=self.config.recipe_name,
                      fqn=fqn)
            model_config = _put(model_config, parent, attr, new)
            converted.append(fqn)
            dispatcher = getattr(parent, "token_dispatcher", None)
            if (isinstance(parent, RoutedExperts.Config)
                    and type(dispatcher) is AllToAllTokenDispatcher.Config):
                parent.token_dispatcher = _as(Float8AllToAllTokenDispatcher.Config, dispatcher,
                                              recipe_name=self.config.recipe_name, fqn=fqn,
                                              float8_combine=self.config.float8_combine,
                                              float8_backward=self.config.float8_backward)
        logger.info("f8dist: %d grouped experts converted to float8 (%s recipe)", len(converted),
                    self.config.recipe_name)
        if kept:
            logger.warning("f8dist: kept %d grouped experts in high precision because their dims "
                           "do not fit the float8 grouped gemms (the kernels' alignment, the "
                           "recipe's blocks): %s", len(kept), "; ".join(kept))
        return model_config
def _fqn_list(filter_fqns) -> List[str]:
    """``filter_fqns`` as a list: one string is one FQN (iterating it would give its characters,
    and every FQN contains one of them: nothing would be converted)."""
    fqns = [filter_fqns] if isinstance(filter_fqns, str) else list(filter_fqns)
    wrong = [f for f in fqns if not isinstance(f, str)]
    if wrong:
        raise TypeError(f"filter_fqns must be FQN strings (e.g. [\"lm_head\"]), got {wrong!r}")
    return fqns


def _float8_linears(model: nn.Module) -> List[Float8Linear]:
    return [m for m in model.modules() if isinstance(m, Float8Linear)]


def post_optimizer_build_fn(optimizers, model_parts: List[nn.Module], parallel_dims) -> None:
    """Register f8dist's optimizer hooks on torchtitan's ``OptimizersContainer``, for the
    :class:`Float8Linear` layers of ``model_parts``:

    * before each step, if a model part has delayed-scaling layers:
      ``f8dist.sync_float8_amax_and_scale_history`` (one all-reduce for the part);
    * after each step, if a part has float8 all-gather weights that asked for it
      (``precompute_float8_dynamic_scale_for_fsdp``):
      ``f8dist.parallel.fsdp.precompute_float8_dynamic_scale_for_fsdp`` (one all-reduce for the part).

    Has the signature of ``ModelSpec.post_optimizer_build_fn``; :func:`with_float8_hooks` puts it
    there. (torch's optimizer hooks must return None: these do.)
    """
    delayed_parts = [
        m for m in model_parts if any(lin.config.uses(f8dist.ScalingType.DELAYED) for lin in _float8_linears(m))
    ]
    precompute_parts = [
        m for m in model_parts
        if any(lin.precompute_float8_dynamic_scale_for_fsdp for lin in _float8_linears(m))
    ]
    if delayed_parts:
        def sync_delayed_scales(optimizer, args, kwargs) -> None:
            for part in delayed_parts:
                f8dist.sync_float8_amax_and_scale_history(part)

        optimizers.register_step_pre_hook(sync_delayed_scales)
    if precompute_parts:
        def precompute_fsdp_scales(optimizer, args, kwargs) -> None:
            for part in precompute_parts:
                fsdp.precompute_float8_dynamic_scale_for_fsdp(part)

        optimizers.register_step_post_hook(precompute_fsdp_scales)


def with_float8_hooks(model_spec: ModelSpec) -> ModelSpec:
    """A copy of ``model_spec`` whose ``post_optimizer_build_fn`` runs the one it had (e.g. a MoE
    load-balancing hook), then :func:`post_optimizer_build_fn`."""
    previous: Optional[Callable] = model_spec.post_optimizer_build_fn

    def chained(optimizers, model_parts, parallel_dims) -> None:
        if previous is not None:
            previous(optimizers, model_parts, parallel_dims)
        post_optimizer_build_fn(optimizers, model_parts, parallel_dims)

    return dataclasses.replace(model_spec, post_optimizer_build_fn=chained)


# -- torchtitan config functions: --module f8dist.integrations.torchtitan --config NAME ------------


def _check_launch() -> None:
    """Under ``python -m torchtitan.train``, end in one line where the Trainer would fail deep in
    its setup: it needs CUDA (it sets the CUDA device first) and torchrun's ``LOCAL_RANK``."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is None or spec.name != "torchtitan.train":  # e.g. a test building the config
        return
    if not torch.cuda.is_available():
        raise SystemExit(
            "f8dist: torchtitan's Trainer needs CUDA (it sets the CUDA device before anything "
            "else) and this machine has none; on a CPU, train with scripts/train.py (docs/training.md)"
        )
    if "LOCAL_RANK" not in os.environ:
        raise SystemExit(
            "f8dist: torchtitan's Trainer runs under torchrun (it reads LOCAL_RANK): torchrun "
            "--nproc_per_node=1 -m torchtitan.train --module f8dist.integrations.torchtitan --config NAME"
        )


def _llama3_debugmodel_float8(**float8):
    """torchtitan's llama3 debug model config, its linears in float8 (the output projection,
    ``lm_head``, stays high precision: float8 logits cost accuracy for little speed), reading
    assets made by f8dist instead of a torchtitan checkout's ([Note: torchtitan assets] in
    f8dist/integrations/torchtitan_assets.py)."""
    from torchtitan.models.llama3 import model_registry
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    _check_launch()
    config = llama3_debugmodel()
    paths = torchtitan_assets.make_assets()
    config.hf_assets_path = paths["tokenizer"]
    config.dataloader.dataset_path = paths["dataset"]
    config.dump_folder = paths["outputs"]
    converter = Float8LinearConverter.Config(
        model_compile_enabled=config.compile.enable and "model" in config.compile.components,
        filter_fqns=["lm_head"],
        **float8,
    )
    config.model_spec = with_float8_hooks(model_registry("debugmodel", converters=[converter]))
    return config


def llama3_debugmodel_float8_tensorwise():
    """llama3 debug model, float8 with dynamic tensorwise scaling."""
    return _llama3_debugmodel_float8(recipe_name="tensorwise")


def llama3_debugmodel_float8_rowwise():
    """llama3 debug model, float8 with dynamic rowwise scaling."""
    return _llama3_debugmodel_float8(recipe_name="rowwise")


def llama3_debugmodel_float8_rowwise_with_gw_hp():
    """llama3 debug model, float8 rowwise with a high-precision grad_weight gemm."""
    return _llama3_debugmodel_float8(recipe_name="rowwise_with_gw_hp")


def llama3_debugmodel_float8_delayed():
    """llama3 debug model, float8 with delayed tensorwise scaling (synced before each step)."""
    return _llama3_debugmodel_float8(recipe_name="delayed")


def llama3_debugmodel_float8_tensorwise_fsdp_all_gather():
    """llama3 debug model, float8 tensorwise; FSDP2 all-gathers weights in float8 and their
    scales are precomputed in one all-reduce after each optimizer step."""
    return _llama3_debugmodel_float8(
        recipe_name="tensorwise",
        enable_fsdp_float8_all_gather=True,
        precompute_float8_dynamic_scale_for_fsdp=True,
    )


def llama3_debugmodel_float8_mxfp8():
    """llama3 debug model, MXFP8: 1x32 blocks with e8m0 scales (weights all-gathered in bf16)."""
    return _llama3_debugmodel_float8(recipe_name="mxfp8")


def llama3_debugmodel_float8_blockwise():
    """llama3 debug model, DeepSeek-V3 blockwise float8: 1x128 activations and gradients, 128x128
    weights, float32 scales (weights all-gathered in bf16)."""
    return _llama3_debugmodel_float8(recipe_name="blockwise")
