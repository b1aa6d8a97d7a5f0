"""Float8Linear and the float8 matmul behind it.

[Note: gemms]
A linear layer runs three gemms (``f8dist.config.Gemm``); each of their six operands has its own
cast, resolved once per layer into ``Float8Linear.specs`` (``config.cast_spec(gemm, operand)``)::

    output      = input       @ weight_t     [M, K] x [K, N]   e4m3 x e4m3   forward
    grad_input  = grad_output @ weight       [M, N] x [N, K]   e5m2 x e4m3   backward
    grad_weight = grad_output_t @ input      [N, M] x [M, K]   e5m2 x e4m3   backward

M is the number of tokens (all leading dims of the input), K = in_features, N = out_features.
An axiswise cast's amax runs over the gemm's contraction dim: K in ``output``, N in
``grad_input``, M in ``grad_weight``. A tensorwise cast is the same for every gemm, so its bytes
are reused.

[Note: what the matmul keeps for backward]
* weight: the high-precision parameter (alive anyway), re-cast in backward. Keeping the forward's
  float8 copy instead holds one per weight until backward (under FSDP2, per unsharded weight), so
  it is an option, ``float8_weight_for_backward`` (``CastSpecs.save_float8_weight``), for casts
  whose backward bytes are the forward's (``CastSpecs.weight_same_bytes``). Compiled, the
  partitioner keeps those bytes too (``ban_recompute_materialized_backward``). A weight that
  arrives in float8 (FSDP2 float8 all-gather) is kept as it is: FSDP2 manages it.
* weight amax, when backward's weight cast is tensorwise (``CastSpecs.weight_amax_from_forward``):
  the max of the forward's amax, one float32; the weight has not changed, so it is exact and
  saves a pass over the weight.
* input: what ``CastSpecs.saved_input`` says (the one rule: ``Float8LinearConfig._saved_input``).
  High precision by default: axiswise needs the other axis, a high-precision gemm the values.
  ``float8_activations_for_backward`` keeps the grad_weight gemm's cast, made in forward (bit for
  bit backward's); ``axiswise_requantize_input_for_grad_weight`` re-scales the forward's (a second
  rounding, exact but for e4m3 subnormals with power-of-2 scales); ``sp_grad_weight="derive"``
  keeps the forward's block cast and re-casts it in token blocks (so does backward with the
  grad_input gemm's cast of grad_output). scripts/memory_report.py
  measures the choices (docs/performance.md). An input that arrives in
  float8 with the grad_weight gemm's cast as its companion ([Note: two casts of one tensor] in
  f8dist/core/tensor.py) keeps that cast only; one that left it on its rank (``KeptShard``) keeps the
  shard and all-gathers it in backward, once for all its readers. A float8 input kept for
  backward is one copy for all its readers ([Note: one cast per input] in f8dist/core/cast.py); one
  handed over with ``recompute`` is not kept ([Note: a recomputed input]).
"""

from __future__ import annotations

import functools
from typing import Callable, Dict, Optional, Tuple

import torch
import torch.nn as nn

from f8dist.core.cast import (
    autocast_input, cast_to_float8, companion_for, high_precision, kept_shard_for, logical_amax,
    shared_casts,
)
from f8dist.config import CastSpecs, Float8LinearConfig, Gemm, Operand, SavedInput
from f8dist.policy.delayed import DelayedScaling, apply_to_delayed_module, load_delayed_state
from f8dist.core.weight import wrap_weight_for_float8_all_gather
from f8dist.core.gemm import check_block_shape, check_gemm_shape
from f8dist.core.placement import layout, local_part, reduce_partial, with_layout
from f8dist.core.tensor import Float8Tensor

__all__ = ["Float8Linear", "float8_linear_mm"]

OUTPUT, GRAD_INPUT, GRAD_WEIGHT = Gemm
INPUT, WEIGHT, GRAD_OUTPUT = Operand

Scales = Optional[Dict[Tuple[Gemm, Operand], torch.Tensor]]
Delayed = Optional[Tuple[DelayedScaling, bool]]
Recompute = Optional[Tuple[Callable[..., torch.Tensor], Tuple[torch.Tensor, ...]]]


def _mm(gemm: Gemm, a: torch.Tensor, b: torch.Tensor, specs: CastSpecs, scales: Scales,
        b_amax: Optional[torch.Tensor] = None):
    """One gemm ``a @ b`` of [Note: gemms], both operands in float8 as ``specs`` say or both in
    high precision (``b`` in its operand layout; ``b_amax``: its amax, when known)."""
    left, right = gemm.operands
    if not specs.gemm_in_float8(gemm):
        a, b = high_precision(a), high_precision(b)
        return _gemm_layout(gemm, a, b.to(a.dtype))
    a8 = _cast(gemm, left, a, specs, scales)
    b8 = _cast(gemm, right, b, specs, scales, amax=b_amax)
    return _gemm_layout(gemm, a8, b8)


def _cast(gemm: Gemm, operand: Operand, t: torch.Tensor, specs: CastSpecs, scales: Scales,
          *, amax: Optional[torch.Tensor] = None, store: bool = False, shared=None
          ) -> torch.Tensor:
    """``t`` cast as ``operand`` of ``gemm``: its spec, and its delayed scale if there is one;
    ``shared``: the table of its sibling linears' casts ([Note: one cast per input])."""
    scale = (scales or {}).get((gemm, operand))
    return cast_to_float8(t, specs[gemm, operand], scale, amax=amax, store=store, shared=shared)


def _check_grad_weight_operand(x: torch.Tensor, specs: CastSpecs, found: bool) -> None:
    """Raise where ``x`` arrived in float8 without the grad_weight operand this linear's config
    needs (``found``: it carries one): a style cast a shared input with another linear's config
    ([Note: the grad_weight operand of a gathered tensor] in f8dist/config/cells.py)."""
    if (found or not isinstance(local_part(x), Float8Tensor) or x.numel() == 0
            or torch.compiler.is_compiling() or specs.sp_grad_weight.sends_one_cast):
        return
    if not specs.own_grad_weight_operand(INPUT):
        return  # it reads the gathered float8, or re-scales it: nothing was to travel along
    gw = specs[GRAD_WEIGHT, INPUT]
    needs = (f"its {gw.block_size} token-block cast" if gw.enabled
             else "the high-precision input (a high-precision grad_weight gemm)")
    raise ValueError(
        f"Float8Linear {gw.fqn or '<root>'}: its input arrived in float8, cast before a "
        f"tensor-parallel all-gather, without what its grad_weight gemm reads for one device's "
        f"numbers ({needs}; sp_grad_weight={specs.sp_grad_weight.value!r}): the input is shared "
        "with a linear whose config the cast followed (PrepareFloat8ModuleInput's "
        "fwd_config_submodule_fqn) and that config differs (recipe or sp_grad_weight). Give the "
        "linears that read one input one Float8LinearConfig (convert_to_float8_training's "
        "config), or set sp_grad_weight='recast' on this one to accept the re-cast")


def _forward_weight_amax(weight: torch.Tensor, specs: CastSpecs) -> Optional[torch.Tensor]:
    """The forward weight cast's amax when backward's weight cast takes it too
    ([Note: what the matmul keeps for backward]), else None."""
    if not specs.weight_amax_from_forward or isinstance(local_part(weight), Float8Tensor):
        return None
    return logical_amax(weight, specs[OUTPUT, WEIGHT].axiswise_dim(weight.dim()))  # [] or [N, 1]


def _max_of(amax: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """Backward's tensorwise weight amax from the forward cast's ([] or per row)."""
    if amax is None or amax.dim() == 0:
        return amax
    return logical_amax(amax)  # [N, 1] -> []


def _gemm_layout(gemm: Gemm, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if gemm is OUTPUT:
        return torch.mm(a, b.t())  # input [M, K] @ weight_t [K, N]
    if gemm is GRAD_INPUT:
        return torch.mm(a, b)  # grad_output [M, N] @ weight [N, K]
    return torch.mm(a.t(), b)  # grad_output_t [N, M] @ input [M, K]


class _Float8Matmul(torch.autograd.Function):
    """``input @ weight.t()`` with float8 gemms; see [Note: gemms].

    ``input`` [M, K] and ``weight`` [N, K] may arrive in float8. ``backward``: whether a backward
    will run; only then is anything kept for it (the weight amax costs a reduction, an all-reduce
    for a TP-sharded weight). ``shared`` and ``recompute``: as in :func:`float8_linear_mm`.
    """

    @staticmethod
    def forward(ctx, input, weight, specs: CastSpecs, scales: Scales, delayed: Delayed,
                backward: bool, shared, recompute: Recompute = None):
        x = input
        if specs.save_float8_input:  # cast once: the bytes serve the output gemm and backward
            x = _cast(OUTPUT, INPUT, input, specs, scales, store=True, shared=shared)
        weight_amax = _forward_weight_amax(weight, specs)  # None, [] or [N, 1]
        if backward and specs.save_float8_weight:  # cast once: the bytes serve both gemms
            weight = _cast(OUTPUT, WEIGHT, weight, specs, scales, amax=weight_amax)  # [N, K]
            weight_amax = None  # backward takes the bytes, not an amax
        out = _mm(OUTPUT, x, weight, specs, scales, weight_amax)  # [M, N]
        kept = _max_of(weight_amax) if backward else None  # [] or None
        saved = x  # [Note: what the matmul keeps for backward]
        companion = kept_shard = ctx.gather = None
        if backward:  # [Note: the grad_weight operand of a gathered tensor] in f8dist/config/cells.py
            companion = companion_for(x, specs[GRAD_WEIGHT, INPUT])
            kept_shard = kept_shard_for(x, specs[GRAD_WEIGHT, INPUT])
            _check_grad_weight_operand(x, specs, companion is not None or kept_shard is not None)
        if companion is not None and specs.gemm_in_float8(GRAD_WEIGHT):
            saved = companion  # only the bytes backward reads
        elif kept_shard is not None:  # this rank's shard of them, gathered in backward
            saved = kept_shard.local  # [B, S / tp, K] float8
            kept_shard.gather.add_reader()
            ctx.gather = (kept_shard.gather, tuple(local_part(x).shape), layout(x))
        if recompute is not None:
            saved, ctx.gather = None, None  # recomputed in backward from recompute's tensors
        elif (backward and specs.saved_input is SavedInput.GRAD_WEIGHT_CAST
              and ctx.gather is None):
            saved = _cast(GRAD_WEIGHT, INPUT, input, specs, scales, shared=shared)  # [M, K] float8
        fn, sources = recompute if recompute is not None else (None, ())
        ctx.save_for_backward(saved, weight, kept, *sources)
        ctx.specs, ctx.scales, ctx.delayed, ctx.recompute = specs, scales, delayed, fn
        return out

    @staticmethod
    def backward(ctx, grad_output):
        if torch.is_grad_enabled():  # backward(create_graph=True): its result would be differentiated
            raise RuntimeError(
                "Float8Linear does not support double backward (backward with create_graph=True, "
                "e.g. a gradient penalty): its float8 gemms' backward is not differentiable. Keep "
                "the layers you differentiate twice in high precision (module_filter_fn)."
            )
        saved_input, weight, weight_amax, *sources = ctx.saved_tensors
        specs, scales = ctx.specs, ctx.scales
        if ctx.recompute is not None:
            saved_input = ctx.recompute(*sources)  # [M, K], the input's dtype
        elif ctx.gather is not None:  # the kept shard of the grad_weight gemm's cast, gathered
            gather, shape, layout_2d = ctx.gather
            ctx.gather = None
            saved_input = gather(saved_input, shape, layout_2d)  # [M, K] float8
        grad_output = reduce_partial(grad_output)  # [Note: gradient placements under compile]
        later = []  # [Note: record after the cast] in f8dist/policy/delayed/scale.py
        if ctx.delayed is not None:  # a delayed grad_output scale is known now
            state, record = ctx.delayed
            scales = {**scales, **state.grad_output_scales(grad_output, record, later)}
        if specs.cast_grad_output_once or specs.derives_grad_weight_operand(GRAD_OUTPUT):
            # the same bytes serve both gemms (tensorwise), or grad_weight re-casts them (derive)
            grad_output = _cast(GRAD_INPUT, GRAD_OUTPUT, grad_output, specs, scales, store=True)
        grad_input = _mm(GRAD_INPUT, grad_output, weight, specs, scales, weight_amax)  # [M, K]
        grad_weight = _mm(GRAD_WEIGHT, grad_output, saved_input, specs, scales)  # [N, K]
        for amax_record in later:
            amax_record()
        return grad_input, grad_weight.to(weight.dtype), None, None, None, None, None, None


# [Note: autocast]
# Under torch.autocast Float8Linear casts its input to the autocast dtype, as autocast does for
# nn.Linear's; each gemm outputs its left operand's dtype and the weight gradient comes back in
# the weight's dtype. A Float8Tensor that autocast casts (the float8 weight, a float8 TP input)
# keeps its bytes and scale and stands for the new dtype (f8dist/core/tensor.py). A device autocast has
# no backend for (meta, where torchtitan builds a model) is not cast, as for nn.Linear.

# [Note: gradient placements under compile]
# torch.compile traces the backward with a gradient placed as the forward's output: Partial(sum)
# for a rowwise-parallel gemm, while eager autograd hands it the reduce-scatter's Replicate one.
# Reducing a Partial gradient makes both see the same gradient; in eager mode it is a no-op.


def float8_linear_mm(
    input: torch.Tensor, weight: torch.Tensor, specs: CastSpecs, scales: Scales = None,
    delayed: Delayed = None, share_with: Optional[torch.Tensor] = None,
    recompute: Recompute = None,
) -> torch.Tensor:
    """``input @ weight.t()`` through the float8 gemms, for inputs of any leading shape.
    ``scales``: the forward's delayed scales; ``delayed``: (state, whether the forward recorded).
    ``share_with``: the caller's input, whose readers share the float8 copy kept for backward
    ([Note: one cast per input] in f8dist/core/cast.py). ``recompute``: ``(fn, tensors)`` giving the
    input again in backward ([Note: a recomputed input])."""
    k = input.shape[-1]
    input_2d = input.reshape(-1, k)  # [M, K]
    backward = torch.is_grad_enabled() and (input.requires_grad or weight.requires_grad)
    shared = None
    if backward and share_with is not None and specs.saved_input is not SavedInput.HIGH_PRECISION:
        shared = shared_casts(share_with)
    if recompute is not None and not backward:
        recompute = None
    if recompute is not None:  # [Note: a recomputed input]
        fn, tensors = recompute
        recompute = (functools.partial(
            _recomputed_input, fn, tuple(local_part(input_2d).shape), layout(input_2d),
            input.dtype), tensors)
    out_2d = _Float8Matmul.apply(  # [M, N]
        input_2d, weight, specs, scales, delayed, backward, shared, recompute)
    if input.dim() == 2:
        return out_2d
    # [Note: an output that is no view]
    return torch.ops.aten._unsafe_view(out_2d, (*input.shape[:-1], out_2d.shape[-1]))  # [..., N]


# [Note: a recomputed input]
# ``recompute=(fn, tensors)``: ``fn(*tensors)`` gives the forward's high-precision input again in
# backward (any leading shape; for a DTensor input, this rank's part, laid out as the forward's
# input was). A TP plan that redistributes the tensor on its way in gives the linear other local
# values than ``fn`` recomputes; where their shapes differ, backward raises.


def _recomputed_input(fn, shape: tuple, layout_2d, dtype: torch.dtype, *tensors) -> torch.Tensor:
    """``fn(*tensors)`` as the forward's [M, K] input, in the gemms' dtype ([Note: a recomputed
    input])."""
    local = fn(*tensors)  # [..., K]
    if local.numel() != shape[0] * shape[1] or local.shape[-1] != shape[1]:
        raise RuntimeError(
            f"an input recomputed in backward (recompute_swiglu_product, recompute_norm_output) "
            f"has shape {tuple(local.shape)}, but the linear read {list(shape)} on this rank: a "
            "tensor-parallel plan redistributed it on its way in; turn the option off for this "
            "plan")
    return with_layout(layout_2d, local.reshape(shape).to(dtype))  # [M, K]


# [Note: an output that is no view]
# nn.Linear's output is never a view (aten::matmul uses _unsafe_view); a reshape would be one, and
# FSDP2 warns about a module that returns a view. No other tensor aliases the gemm's output, so
# the same _unsafe_view is safe here.


class Float8Linear(nn.Linear):
    """A drop-in ``nn.Linear`` whose three gemms run in float8 as ``config`` says.

    Its ``state_dict`` has ``nn.Linear``'s keys (plus delayed-scaling buffers), so checkpoints
    move between float8 and plain models.

    Example::

        >>> lin = Float8Linear.from_float(nn.Linear(64, 32), Float8LinearConfig())
        >>> lin(torch.randn(16, 64)).shape
        torch.Size([16, 32])
    """

    def __init__(self, *args, config: Optional[Float8LinearConfig] = None, fqn: str = "", **kwargs):
        super().__init__(*args, **kwargs)
        self._config = config if config is not None else Float8LinearConfig()
        self.fqn = fqn  # also computes self.specs
        if self.config.emulate is False:
            check_gemm_shape(
                self.in_features, self.out_features,
                what=f"Float8Linear {fqn or '<root>'} ({self.in_features} -> {self.out_features})",
                pad_inner_dim=self.config.pad_inner_dim,
            )
            check_block_shape(
                self.specs, self.in_features, self.out_features,
                what=f"Float8Linear {fqn or '<root>'} ({self.in_features} -> {self.out_features})",
                pad_inner_dim=self.config.pad_inner_dim,
            )
        self.delayed = DelayedScaling.attach(self)  # None without delayed casts

    @classmethod
    def from_float(
        cls, mod: nn.Linear, config: Optional[Float8LinearConfig] = None, fqn: str = ""
    ) -> "Float8Linear":
        """Make a Float8Linear that shares ``mod``'s parameters (no copy)."""
        with torch.device("meta"):
            new = cls(mod.in_features, mod.out_features, bias=False, config=config, fqn=fqn)
        new.weight = mod.weight
        new.bias = mod.bias
        if new.delayed is not None:  # its buffers were made on meta: make them on mod's device
            new.delayed = DelayedScaling.attach(new)
        if new.config.enable_fsdp_float8_all_gather:
            wrap_weight_for_float8_all_gather(new)
        return new

    @property
    def config(self) -> Float8LinearConfig:
        """The config the layer was made with (fixed: convert again to change it)."""
        return self._config

    @property
    def fqn(self) -> str:
        """The layer's name in its model (telemetry and error messages use it)."""
        return self._fqn

    @fqn.setter
    def fqn(self, fqn: str) -> None:
        self._fqn = fqn
        self.specs: CastSpecs = self._config.cast_specs(fqn)  # the six casts, resolved once

    def forward(self, input: torch.Tensor, *, recompute: Recompute = None) -> torch.Tensor:
        """``recompute``: ``(fn, tensors)`` giving the input again in backward ([Note: a
        recomputed input])."""
        return self.forward_with(input, self.weight, self.bias, recompute=recompute)

    def forward_with(self, input: torch.Tensor, weight: torch.Tensor,
                     bias: Optional[torch.Tensor], *, recompute: Recompute = None) -> torch.Tensor:
        """The forward with ``weight`` and ``bias`` in place of the layer's own, e.g. its local
        shards wrapped as DTensors (f8dist/integrations/torchtitan.py)."""
        if not input.is_floating_point():  # nn.Linear raises too; a float8 cast would not
            raise TypeError(
                f"Float8Linear {self.fqn or '<root>'}: input must be a floating-point tensor, got "
                f"{input.dtype}; convert it first (e.g. input.float()), as nn.Linear needs too."
            )
        source = input  # what sibling linears share: [Note: one cast per input] in f8dist/core/cast.py
        input = autocast_input(input)  # [Note: autocast]
        scales = delayed = None
        later = []  # [Note: record after the cast] in f8dist/policy/delayed/scale.py
        if self.delayed is not None:  # [Note: delayed scaling] in f8dist/policy/delayed/
            delayed = (self.delayed, self.delayed.training())
            scales = self.delayed.forward_scales(input, weight, delayed[1], later)
        out = float8_linear_mm(input, weight, self.specs, scales, delayed, share_with=source,
                               recompute=recompute)
        for amax_record in later:
            amax_record()
        if bias is not None:
            out = out + bias.to(out.dtype)
        return out

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)
        if self.delayed is not None:  # see [Note: delayed checkpoints] in f8dist/policy/delayed/hooks.py
            load_delayed_state(self.delayed, state_dict, prefix, missing_keys)
        if self.config.enable_fsdp_float8_all_gather:  # assign=True put a plain weight in place
            wrap_weight_for_float8_all_gather(self)

    def reset_parameters(self) -> None:
        super().reset_parameters()
        if getattr(self, "delayed", None) is not None:  # None while nn.Linear.__init__ runs
            self.delayed.restart()

    def _apply(self, fn, recurse=True):  # the delayed buffers stay float32
        return apply_to_delayed_module(getattr(self, "delayed", None), fn,
                                       lambda f: super(Float8Linear, self)._apply(f, recurse))

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, fqn={self.fqn!r}, cast_configs={self.config.short_str()}"
