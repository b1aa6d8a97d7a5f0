"""Float8Linear and the float8 matmul behind it.

[Note: gemms]
A linear layer runs three gemms; each of their six operands has its own CastConfig
(``Float8LinearConfig.cast_config(gemm, operand)``)::

    output      = input       @ weight_t     [M, K] x [K, N]   e4m3 x e4m3   forward
    grad_input  = grad_output @ weight       [M, N] x [N, K]   e5m2 x e4m3   backward
    grad_weight = grad_output_t @ input      [N, M] x [M, K]   e5m2 x e4m3   backward

M is the number of tokens (all leading dims of the input), K = in_features, N = out_features.
An axiswise cast takes one scale per row of the left operand and per column of the right one,
i.e. its amax runs over the gemm's contraction dim: K in ``output``, N in ``grad_input``, M in
``grad_weight``. A tensorwise cast is the same for every gemm, so its float8 bytes are reused.

[Note: what the matmul keeps for backward]
* weight: the high-precision weight (a parameter, alive anyway) and it is re-cast in backward,
  instead of keeping a second float8 copy. A weight that arrives already in float8 (FSDP2 float8
  all-gather) is kept as it is: it is the unsharded parameter FSDP2 manages.
* input, when the grad_weight gemm reuses the forward cast (same tensorwise config): the float8
  input, 1 byte per element, and no high-precision copy.
* input otherwise: the high-precision input (axiswise needs the other axis; a high-precision
  grad_weight gemm needs the values). With ``axiswise_requantize_input_for_grad_weight`` the
  float8 forward copy is kept and re-scaled along the token axis in backward instead (less memory,
  a second rounding). With power-of-2 scales (the rowwise default) re-scaling only shifts
  exponents, so the second rounding changes nothing but e4m3 subnormals. Measured by
  scripts/memory_report.py (SwiGLU FFN dim 64, hidden 192, 64 tokens, bf16, gaussian): kept bytes
  106496 -> 94976; min grad_weight SQNR vs fp32 25.21 -> 25.21 dB (power-of-2 scales, grads bit
  identical) and 26.21 -> 25.26 dB (exact scales).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

from f8dist.cast import CastSite, cast_to_float8, is_dtensor, like, local_part
from f8dist.config import Float8LinearConfig, ScalingGranularity, ScalingType
from f8dist import delayed
from f8dist.gemm import check_gemm_shape
from f8dist.tensor import Float8Tensor, ScaledMMConfig

__all__ = ["Float8Linear", "float8_linear_mm"]

# contraction dim of each operand in each gemm, in the operand's own [rows, cols] layout:
# input [M, K], weight [N, K], grad_output [M, N]
_AXIS = {
    ("output", "input"): -1,  # K
    ("output", "weight"): -1,  # K
    ("grad_input", "grad_output"): -1,  # N
    ("grad_input", "weight"): 0,  # N
    ("grad_weight", "grad_output"): 0,  # M
    ("grad_weight", "input"): 0,  # M
}


def _mm_config(config: Float8LinearConfig, gemm: str) -> ScaledMMConfig:
    return ScaledMMConfig(
        emulate=config.emulate,
        use_fast_accum=config.gemm_config(gemm).use_fast_accum,
        pad_inner_dim=config.pad_inner_dim,
    )


def _cast(
    t: torch.Tensor,
    config: Float8LinearConfig,
    gemm: str,
    operand: str,
    fqn: str,
    scale: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Cast one operand of one gemm as the config says (a Float8Tensor, or a DTensor of them).

    An operand that already is float8 keeps its bytes if they fit this gemm's cast, else it is
    dequantized and cast again (e.g. a per-token input re-scaled per channel for grad_weight)."""
    dtype = config.resolved_dtype(gemm, operand)
    kwargs = cast_kwargs(config, gemm, operand, fqn)
    local = local_part(t)
    if isinstance(local, Float8Tensor):
        if _fits(local, dtype, kwargs):
            return like(t, local.with_mm_config(kwargs["mm_config"]))
        return _cast(_hp(t), config, gemm, operand, fqn)
    if config.cast_config(gemm, operand).scaling_type is ScalingType.DELAYED and scale is None:
        raise RuntimeError(
            f"{fqn}: delayed scaling of {operand} in the {gemm} gemm needs a scale from the "
            "module's amax history"
        )
    return cast_to_float8(t, dtype, scale=scale, **kwargs)


def cast_kwargs(config: Float8LinearConfig, gemm: str, operand: str, fqn: str) -> dict:
    """``cast_to_float8`` keyword arguments (all but ``scale``) for one operand of one gemm; the
    float8 dtype is ``config.resolved_dtype(gemm, operand)``. Also used by f8dist.tp, which casts
    a linear's input before communicating it."""
    return dict(
        granularity=config.cast_config(gemm, operand).scaling_granularity,
        axiswise_dim=_AXIS[(gemm, operand)],
        round_scales_to_power_of_2=config.round_scales_to_power_of_2,
        mm_config=_mm_config(config, gemm),
        site=CastSite(fqn, gemm, operand),
    )


def _fits(local: Float8Tensor, dtype: torch.dtype, kwargs: dict) -> bool:
    """Whether float8 bytes are what a cast with these ``cast_kwargs`` to ``dtype`` would give."""
    want_axis = None
    if kwargs["granularity"] is ScalingGranularity.AXISWISE:
        want_axis = kwargs["axiswise_dim"] % local.dim()
    return local._data.dtype == dtype and local._axiswise_dim == want_axis


def _hp(t: torch.Tensor) -> torch.Tensor:
    """The high-precision value of an operand (dequantized if it arrived in float8)."""
    local = local_part(t)
    if isinstance(local, Float8Tensor):
        return like(t, local.to_original_precision())
    return t


def _reduce_partial(grad: torch.Tensor) -> torch.Tensor:
    """A DTensor gradient with Partial placements, reduced (Replicate on those mesh axes).

    [Note: gradient placements under compile]
    torch.compile traces an autograd.Function's backward when it traces the forward, with a
    gradient that has the forward output's placements: a rowwise-parallel gemm's output is
    Partial(sum), so the traced backward sees a Partial gradient, while eager autograd hands it the
    gradient of the reduce-scatter, Replicate. Reducing a Partial gradient here makes both see the
    same (logical) gradient; in eager mode it never is Partial and this is a no-op.
    """
    if not is_dtensor(grad) or not any(p.is_partial() for p in grad.placements):
        return grad
    from torch.distributed.tensor import Replicate

    placements = [Replicate() if p.is_partial() else p for p in grad.placements]
    return grad.redistribute(grad.device_mesh, placements)


class _Float8Matmul(torch.autograd.Function):
    """``input @ weight.t()`` with float8 gemms; see [Note: gemms].

    ``input`` is [M, K] (high precision or float8), ``weight`` is [N, K] (high precision, or a
    float8 tensor from FSDP2's float8 all-gather). ``scales`` holds delayed-scaling scales by
    (gemm, operand) or is None.
    """

    @staticmethod
    def forward(ctx, input, weight, config: Float8LinearConfig, fqn: str, scales):
        scales = scales or {}
        if config.gemm_in_float8("output"):
            x_fp8 = _cast(input, config, "output", "input", fqn, scales.get(("output", "input")))
            w_fp8 = _cast(weight, config, "output", "weight", fqn, scales.get(("output", "weight")))
            out = torch.mm(x_fp8, w_fp8.t())  # [M, N]
        else:
            x_fp8 = None
            out = torch.mm(_hp(input), _hp(weight).t())  # [M, N]

        # input for the grad_weight gemm: keep float8 bytes where they are exactly what the
        # backward cast would produce; else the high-precision input.
        gw_input_cc = config.cast_config("grad_weight", "input")
        reuse = (
            x_fp8 is not None
            and gw_input_cc == config.cast_config("output", "input")
            and gw_input_cc.scaling_granularity is ScalingGranularity.TENSORWISE
            and config.resolved_dtype("grad_weight", "input")
            == config.resolved_dtype("output", "input")
        ) or config.axiswise_requantize_input_for_grad_weight  # re-scaled in backward
        saved_input = x_fp8 if reuse else input
        ctx.save_for_backward(saved_input, weight)
        ctx.config, ctx.fqn, ctx.scales = config, fqn, scales
        return out

    @staticmethod
    def backward(ctx, grad_output):
        saved_input, weight = ctx.saved_tensors
        config, fqn, scales = ctx.config, ctx.fqn, ctx.scales
        grad_output = _reduce_partial(grad_output)

        # grad_input = grad_output @ weight    [M, N] x [N, K]
        if config.gemm_in_float8("grad_input"):
            go = _cast(grad_output, config, "grad_input", "grad_output", fqn,
                       scales.get(("grad_input", "grad_output")))
            w = _cast(weight, config, "grad_input", "weight", fqn,
                      scales.get(("grad_input", "weight")))
            grad_input = torch.mm(go, w)  # [M, K]
        else:
            grad_input = torch.mm(_hp(grad_output), _hp(weight).to(grad_output.dtype))  # [M, K]

        # grad_weight = grad_output_t @ input  [N, M] x [M, K]
        if config.gemm_in_float8("grad_weight"):
            go = _cast(grad_output, config, "grad_weight", "grad_output", fqn,
                       scales.get(("grad_weight", "grad_output")))
            x = _cast(saved_input, config, "grad_weight", "input", fqn,
                      scales.get(("grad_weight", "input")))
            grad_weight = torch.mm(go.t(), x)  # [N, K]
        else:
            grad_weight = torch.mm(_hp(grad_output).t(), _hp(saved_input))  # [N, K]
        return grad_input, grad_weight.to(weight.dtype), None, None, None


def float8_linear_mm(
    input: torch.Tensor,
    weight: torch.Tensor,
    config: Float8LinearConfig,
    fqn: str = "",
    scales: Optional[dict] = None,
) -> torch.Tensor:
    """``input @ weight.t()`` through the float8 gemms, for inputs of any leading shape."""
    k = input.shape[-1]
    input_2d = input.reshape(-1, k)  # [M, K]
    out_2d = _Float8Matmul.apply(input_2d, weight, config, fqn, scales)  # [M, N]
    return out_2d.reshape(*input.shape[:-1], out_2d.shape[-1])


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
        self.config = config if config is not None else Float8LinearConfig()
        self.fqn = fqn
        if self.config.emulate is False:
            check_gemm_shape(
                self.in_features, self.out_features,
                what=f"Float8Linear {fqn or '<root>'} ({self.in_features} -> {self.out_features})",
                pad_inner_dim=self.config.pad_inner_dim,
            )
        delayed.register_delayed_buffers(self)

    @classmethod
    def from_float(
        cls, mod: nn.Linear, config: Optional[Float8LinearConfig] = None, fqn: str = ""
    ) -> "Float8Linear":
        """Make a Float8Linear that shares ``mod``'s parameters (no copy)."""
        with torch.device("meta"):
            new = cls(mod.in_features, mod.out_features, bias=False, config=config, fqn=fqn)
        new.weight = mod.weight
        new.bias = mod.bias
        if new._delayed_operands:  # its buffers were made on meta: make them on mod's device
            delayed.register_delayed_buffers(new)
        if new.config.enable_fsdp_float8_all_gather:
            from f8dist.fsdp.weight import wrap_weight_for_float8_all_gather

            wrap_weight_for_float8_all_gather(new)
        return new

    def delayed_scales(self) -> Optional[dict]:
        """Scales by (gemm, operand) for delayed casts; None when the config has none."""
        return delayed.delayed_scales(self) if self._delayed_operands else None

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if torch.is_autocast_enabled(input.device.type):
            input = input.to(torch.get_autocast_dtype(input.device.type))
        if self._delayed_operands:
            delayed.delayed_pre_forward(self, input)
        out = float8_linear_mm(input, self.weight, self.config, self.fqn, self.delayed_scales())
        if self._delayed_operands:
            out = delayed.delayed_post_forward(self, out)
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)
        if self._delayed_operands:  # see [Note: delayed checkpoints] in f8dist/delayed.py
            delayed.load_delayed_state(self, state_dict, prefix, missing_keys)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, fqn={self.fqn!r}, cast_configs={self.config.short_str()}"
