"""Float8Linear and the float8 matmul behind it.

[Note: gemms]
A linear layer runs three gemms (``f8dist.config.Gemm``); each of their six operands has its own
cast, resolved once per layer into ``Float8Linear.specs`` (``config.cast_spec(gemm, operand)``)::

    output      = input       @ weight_t     [M, K] x [K, N]   e4m3 x e4m3   forward
    grad_input  = grad_output @ weight       [M, N] x [N, K]   e5m2 x e4m3   backward
    grad_weight = grad_output_t @ input      [N, M] x [M, K]   e5m2 x e4m3   backward

M is the number of tokens (all leading dims of the input), K = in_features, N = out_features.
An axiswise cast takes one scale per row of the left operand and per column of the right one,
i.e. its amax runs over the gemm's contraction dim: K in ``output``, N in ``grad_input``, M in
``grad_weight``. A tensorwise cast is the same for every gemm, so its float8 bytes are reused.

[Note: what the matmul keeps for backward]
* weight: the high-precision weight (a parameter, alive anyway) and it is re-cast in backward,
  instead of keeping a second float8 copy. With square weight blocks or a tensorwise weight
  (``CastSpecs.weight_same_bytes``, [Note: block scales] in f8dist/cells.py) the backward cast
  gives the forward's bytes again; keeping them instead holds a float8 copy of every weight
  until backward (under FSDP2, of every unsharded weight), more than bf16 keeps, so it is an
  option: ``float8_weight_for_backward`` (``CastSpecs.save_float8_weight``) keeps the forward's
  cast, and backward reads its bytes (1 byte per element) instead of casting the weight again
  (2 read, 1 written). Compiled, the partitioner then keeps those bytes too: the grad_input gemm
  reads the forward's cast, and a node that an extern gemm materializes in backward is not
  recomputed (``ban_recompute_materialized_backward``, on by default); without the option, the
  joint graph's backward cast is its own, recomputed from the weight and the saved block amaxes.
  A weight that arrives already in float8 (FSDP2 float8 all-gather) is kept as it is: it is the
  unsharded parameter FSDP2 manages (freed after the forward and gathered again for backward),
  so it costs no memory of its own.
* weight amax, when backward's weight cast is tensorwise and both casts compute their amax
  (``CastSpecs.weight_amax_from_forward``: tensorwise, rowwise_with_gw_hp): the max of the
  forward's amax ([] or [N, 1]), one float32. The weight has not changed since, so it is
  backward's amax, exact, without reading the weight again (rowwise_with_gw_hp's forward scales
  per row, its backward per tensor: a full pass over every weight saved).
* input: what ``CastSpecs.saved_input`` says, the one rule (``Float8LinearConfig._saved_input``):
  - FORWARD_CAST, when the grad_weight gemm reuses the forward cast (same tensorwise config): the
    float8 input, 1 byte per element, and no high-precision copy;
  - HIGH_PRECISION otherwise by default: the high-precision input (axiswise needs the other axis;
    a high-precision grad_weight gemm needs the values);
  - GRAD_WEIGHT_CAST, with ``float8_activations_for_backward``: the input cast in forward as the
    grad_weight gemm casts it (rowwise: along the token axis), 1 byte per element. Backward then
    reads those bytes: its gradients are those of casting in backward, bit for bit, and the
    forward pays a second cast of its input. A high-precision grad_weight gemm keeps the
    high-precision input (it reads the values, not float8).
  - FORWARD_CAST with ``axiswise_requantize_input_for_grad_weight``: the float8 forward copy is
    kept and re-scaled along the token axis in backward instead (no second cast in forward, a
    second rounding). With power-of-2 scales (the rowwise default) re-scaling only shifts
    exponents, so the second rounding changes nothing but e4m3 subnormals. The two options are
    exclusive (the config says so). scripts/memory_report.py measures the choices (bytes kept,
    grad_weight SQNR; docs/performance.md).
  An input that arrives in float8 (a tensor-parallel style cast it before its all-gather)
  carrying the grad_weight gemm's cast as its companion ([Note: two casts of one tensor] in
  f8dist/tensor.py) keeps that cast only, 1 byte per element: what casting the high-precision
  input in backward would give, bit for bit; one that left it on its rank (``KeptShard``,
  ``sp_grad_weight="backward_gather"``) keeps that rank's shard of it and all-gathers it in
  backward, once for all the linears that read it (``SharedGather`` in f8dist/cast.py).
  A float8 input kept for backward (FORWARD_CAST, GRAD_WEIGHT_CAST) is one copy for all the
  linears that read the same input with the same spec ([Note: one cast per input] in
  f8dist/cast.py); and an input handed over with ``recompute`` (an FFN's w2 with
  ``recompute_swiglu_product``, a norm's readers with ``recompute_norm_output``) is not kept at
  all: backward recomputes it ([Note: a recomputed input]; [Note: a product recomputed in
  backward] in f8dist/swiglu.py; [Note: a norm output recomputed in backward] in
  f8dist/models/norm.py).
"""

from __future__ import annotations

import functools
from typing import Callable, Dict, Optional, Tuple

import torch
import torch.nn as nn

from f8dist.cast import (
    autocast_input, cast_to_float8, companion_for, high_precision, kept_shard_for, logical_amax,
    shared_casts,
)
from f8dist.config import CastSpecs, Float8LinearConfig, Gemm, Operand, SavedInput, SPGradWeight
from f8dist.delayed import DelayedScaling, apply_to_delayed_module, load_delayed_state
from f8dist.fsdp.weight import wrap_weight_for_float8_all_gather
from f8dist.gemm import check_block_shape, check_gemm_shape
from f8dist.placement import layout, local_part, reduce_partial, with_layout
from f8dist.tensor import Float8Tensor

__all__ = ["Float8Linear", "float8_linear_mm"]

OUTPUT, GRAD_INPUT, GRAD_WEIGHT = Gemm
INPUT, WEIGHT, GRAD_OUTPUT = Operand

Scales = Optional[Dict[Tuple[Gemm, Operand], torch.Tensor]]
Delayed = Optional[Tuple[DelayedScaling, bool]]
Recompute = Optional[Tuple[Callable[..., torch.Tensor], Tuple[torch.Tensor, ...]]]


def _mm(gemm: Gemm, a: torch.Tensor, b: torch.Tensor, specs: CastSpecs, scales: Scales,
        b_amax: Optional[torch.Tensor] = None):
    """One gemm ``a @ b`` of [Note: gemms]: both operands cast as ``specs`` say (``b`` given in
    its operand layout and transposed as the gemm needs; ``b_amax``: its amax, when known), or
    both in high precision."""
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
    """Raise where ``x`` arrived in float8 (a tensor-parallel style cast it before its all-gather)
    without the grad_weight gemm's operand that this linear's config asks for one device's
    numbers from (``found``: it carries one that fits): the style cast a shared input with
    another linear's config ([Note: the grad_weight operand of a gathered tensor] in
    f8dist/cells.py). Backward would re-cast the gathered float8, a second rounding."""
    if (found or not isinstance(local_part(x), Float8Tensor) or x.numel() == 0
            or torch.compiler.is_compiling() or specs.sp_grad_weight is SPGradWeight.RECAST):
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
    """The tensorwise amax from a cast's amax ([] or per row): backward's weight amax."""
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

    ``input`` is [M, K] (high precision or float8), ``weight`` is [N, K] (high precision, or a
    float8 tensor from FSDP2's float8 all-gather). ``specs`` are the linear's six cast specs;
    ``scales`` holds delayed-scaling scales by (gemm, operand), or is None. ``backward``: whether
    a backward will run (grad mode on, an operand requiring grad); only then is the weight amax
    kept for it (a reduction, an all-reduce for a TP-sharded weight). ``shared``: the table of
    casts of the input that sibling linears share, or None ([Note: one cast per input] in
    f8dist/cast.py). ``recompute``: None, or ``(fn, tensors)`` with ``fn(*tensors)`` the input
    again: backward recomputes it from ``tensors`` instead of keeping anything of it ([Note: a
    product recomputed in backward] in f8dist/swiglu.py).
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
        if backward:  # [Note: the grad_weight operand of a gathered tensor] in f8dist/cells.py
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
        later = []  # [Note: record after the cast] in f8dist/delayed.py
        if ctx.delayed is not None:  # a delayed grad_output scale is known now
            state, record = ctx.delayed
            scales = {**scales, **state.grad_output_scales(grad_output, record, later)}
        if specs.cast_grad_output_once:  # the same bytes serve both gemms (tensorwise)
            grad_output = _cast(GRAD_INPUT, GRAD_OUTPUT, grad_output, specs, scales, store=True)
        grad_input = _mm(GRAD_INPUT, grad_output, weight, specs, scales, weight_amax)  # [M, K]
        grad_weight = _mm(GRAD_WEIGHT, grad_output, saved_input, specs, scales)  # [N, K]
        for amax_record in later:
            amax_record()
        return grad_input, grad_weight.to(weight.dtype), None, None, None, None, None, None


# [Note: autocast]
# Under torch.autocast, a linear computes in the autocast dtype from parameters of any dtype, and
# gradients come back in the parameters' dtype. Float8Linear casts its input to the autocast
# dtype, as autocast does for nn.Linear's; each gemm outputs its left operand's dtype (the
# input's in forward, grad_output's in backward), and the weight gradient is cast to the weight's
# dtype. Autocast casts the operands of aten.mm too (the float8 weight; a float8 input, cast
# before a TP all-gather, in Float8Linear.forward): a Float8Tensor cast to another
# high-precision dtype keeps its bytes and scale and stands for that dtype (f8dist/tensor.py).
# A device autocast has no backend for (meta, where torchtitan builds a model) is not cast, as
# nn.Linear's input is not there (``autocast_input`` in f8dist/cast.py); the gemms on meta give
# shapes only, through the CPU kernels' fake implementations.

# [Note: gradient placements under compile]
# torch.compile traces an autograd.Function's backward when it traces the forward, with a
# gradient that has the forward output's placements: a rowwise-parallel gemm's output is
# Partial(sum), so the traced backward sees a Partial gradient, while eager autograd hands it the
# gradient of the reduce-scatter, Replicate. Reducing a Partial gradient makes both see the same
# (logical) gradient; in eager mode it never is Partial and this is a no-op.


def float8_linear_mm(
    input: torch.Tensor, weight: torch.Tensor, specs: CastSpecs, scales: Scales = None,
    delayed: Delayed = None, share_with: Optional[torch.Tensor] = None,
    recompute: Recompute = None,
) -> torch.Tensor:
    """``input @ weight.t()`` through the float8 gemms, for inputs of any leading shape.
    ``scales``: the forward's delayed scales; ``delayed``: (state, whether the forward recorded),
    which gives backward its grad_output scale. ``share_with``: the tensor whose sibling readers
    share the float8 copy kept for backward ([Note: one cast per input] in f8dist/cast.py), the
    input as the caller handed it (before autocast's cast and the reshape). ``recompute``:
    ``(fn, tensors)``, ``fn(*tensors)`` the [M, K] input again, for backward to recompute it from
    instead of keeping it ([Note: a product recomputed in backward] in f8dist/swiglu.py)."""
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
# ``float8_linear_mm(..., recompute=(fn, tensors))``: ``fn(*tensors)`` gives the input again in
# backward, the high-precision values it had in forward (before autocast's cast, of any leading
# shape). Backward takes it as the [M, K] input of the gemms, in their dtype. For a DTensor input
# (a tensor-parallel linear, whose input a TP style made from the caller's tensor) it gives this
# rank's part, and backward lays it out as the forward's input was: a rowwise-parallel w2 reads
# its Shard(-1) input as the local product of the column-parallel w1 and w3 (the SwiGLU's
# float8 gate and up are local too), a linear reading a replicated norm output reads it whole.
# A plan that redistributes the tensor on its way in (a gathered input, other shards) gives the
# linear other local values than ``fn`` recomputes; where their shapes differ, backward raises.


def _recomputed_input(fn, shape: tuple, layout_2d, dtype: torch.dtype, *tensors) -> torch.Tensor:
    """``fn(*tensors)`` as the forward's [M, K] input (``shape``: its local shape; ``layout_2d``:
    its DTensor layout or None), in the gemms' dtype ([Note: a recomputed input])."""
    local = fn(*tensors)  # [..., K]
    if local.numel() != shape[0] * shape[1] or local.shape[-1] != shape[1]:
        raise RuntimeError(
            f"an input recomputed in backward (recompute_swiglu_product, recompute_norm_output) "
            f"has shape {tuple(local.shape)}, but the linear read {list(shape)} on this rank: a "
            "tensor-parallel plan redistributed it on its way in; turn the option off for this "
            "plan")
    return with_layout(layout_2d, local.reshape(shape).to(dtype))  # [M, K]


# [Note: an output that is no view]
# nn.Linear's output is never a view (aten::matmul folds the leading dims back with _unsafe_view,
# which autograd does not track as one); a reshape of the gemm's [M, N] output would be, and
# FSDP2 warns about a module that returns a view ("can cause backward to fail or produce wrong
# gradients": an in-place op on it would rebase its autograd history). No other tensor aliases
# the gemm's output, so the same _unsafe_view is safe here.


class Float8Linear(nn.Linear):
    """A drop-in ``nn.Linear`` whose three gemms run in float8 as ``config`` says.

    Its ``state_dict`` has the keys of ``nn.Linear`` (plus delayed-scaling buffers when the config
    uses delayed scaling), so checkpoints move between float8 and plain models.

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
        """``recompute``: ``(fn, tensors)`` that give the input again, [M, K], for backward to
        recompute it from instead of keeping it (f8dist/swiglu.py passes it)."""
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
        source = input  # what sibling linears share: [Note: one cast per input] in f8dist/cast.py
        input = autocast_input(input)  # [Note: autocast]
        scales = delayed = None
        later = []  # [Note: record after the cast] in f8dist/delayed.py
        if self.delayed is not None:  # [Note: delayed scaling] in f8dist/delayed.py
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
        if self.delayed is not None:  # see [Note: delayed checkpoints] in f8dist/delayed.py
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
