"""Grouped experts of a mixture-of-experts layer, and their float8 grouped gemms.

[Note: grouped gemms]
An expert layer holds 3-D weights ``[experts, out, in]`` and runs one gemm per expert over the
expert's token group (rows of ``x`` sorted by expert, ``offsets`` as in ``torch._grouped_mm``,
[Note: token groups] in f8dist/scaling.py). Its three gemms are a linear's ([Note: gemms] in
f8dist/linear.py), per expert ``e``::

    output      = x[rows of e] @ w[e].t()              [M_e, K] x [K, N]   -> [M_e, N]
    grad_input  = grad_output[rows of e] @ w[e]        [M_e, N] x [N, K]   -> [M_e, K]
    grad_weight = grad_output[rows of e].t() @ x[rows of e]  [N, M_e] x [M_e, K] -> [N, K]

and each of their six operands is cast as the same cell of the same Float8LinearConfig table says,
per expert ([Note: grouped casts] in f8dist/config.py): ``config.grouped_cast_specs(fqn)``.
rowwise: a scale per token, per expert and row (or column) of the weight, and per expert and
column over the expert's tokens in grad_weight; tensorwise: a scale per expert (its weight, its
token group); rowwise_with_gw_hp: grad_weight in high precision. An expert with no tokens has an
empty group: no output rows, a zero weight gradient.

[Note: one cast of the tokens]
The up projections w1 and w3 read the same tokens. When their input cast is per token (rowwise),
:class:`Float8GroupedExperts` casts the tokens once (``ToFloat8``) and both gemms take those bytes;
expert parallelism casts at the same point, before the dispatch all-to-all (f8dist/dispatch.py),
so one device and EP multiply the same float8 tokens. The grad_weight gemms re-cast the float8
tokens along each expert's token axis (a second rounding; with the rowwise recipe's power-of-2
scales only a shift of exponents, exact but for e4m3 subnormals).
"""

from __future__ import annotations

from typing import Dict, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from f8dist.cast import ToFloat8, cast_to_float8, high_precision
from f8dist.config import CastSpec, CastSpecs, Float8LinearConfig, Gemm, Operand
from f8dist.fsdp.weight import wrap_weight_for_float8_all_gather
from f8dist.gemm import GEMM_ALIGNMENT
from f8dist.grouped_gemm import scaled_grouped_mm
from f8dist.placement import local_part

__all__ = ["GroupedExperts", "Float8GroupedExperts", "float8_grouped_mm", "grouped_mm",
           "swiglu_experts", "grouped_specs", "token_spec", "cast_tokens"]

OUTPUT, GRAD_INPUT, GRAD_WEIGHT = Gemm
INPUT, WEIGHT, GRAD_OUTPUT = Operand
WEIGHTS = ("w1", "w2", "w3")


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``x[rows of e] @ w[e].t()`` in high precision: x [M, K], w [E, N, K] -> [M, N]."""
    return torch._grouped_mm(x, w.transpose(-2, -1).to(x.dtype), offs=offsets)


def _per_group(scale: torch.Tensor, offsets: torch.Tensor, cols: int) -> torch.Tensor:
    """Per-row scales that are constant over each token group ([M, C] or [M, 1]) -> [E, cols],
    1 for an empty group (it multiplies nothing)."""
    e, m = offsets.shape[0], scale.shape[0]
    if m == 0:
        return scale.new_ones((e, cols))
    sizes = torch.diff(offsets, prepend=offsets.new_zeros(1))  # [E]
    starts = (offsets - sizes).clamp(max=m - 1).long()  # [E]
    per_group = scale[starts].expand(e, cols)  # [E, cols]
    return torch.where(sizes[:, None] > 0, per_group, torch.ones_like(per_group))


def _rows(scale: torch.Tensor, m: int) -> torch.Tensor:
    """A token operand's scale ([M, 1], or [] for none) as one per row: [M]."""
    return scale.expand(m, 1)[:, 0].contiguous()


def _select(scale: torch.Tensor, w_shape, dim: int) -> torch.Tensor:
    """A 3-D weight's scale ([E, 1, 1], [E, N, 1] or [E, 1, K]) as one per expert and output
    column of the gemm (``dim`` of the weight): [E, w_shape[dim]]."""
    full = scale.expand(*w_shape)  # [E, N, K]
    other = 2 if dim == 1 else 1
    return full.select(other, 0).contiguous()  # [E, w_shape[dim]]


def _gemm(gemm: Gemm, a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor,
          specs: CastSpecs) -> torch.Tensor:
    """One gemm of [Note: grouped gemms], in float8 as ``specs`` say or in high precision.
    output: a=x [M, K], b=w [E, N, K]; grad_input: a=grad_output [M, N], b=w; grad_weight:
    a=grad_output [M, N], b=x [M, K] -> [E, N, K]."""
    left, right = gemm.operands
    out_dtype = a.dtype
    if not specs.gemm_in_float8(gemm):
        a, b = high_precision(a), high_precision(b)
        if gemm is OUTPUT:
            return grouped_mm(a, b, offsets)  # [M, N]
        if gemm is GRAD_INPUT:
            return torch._grouped_mm(a, b.to(a.dtype), offs=offsets)  # [M, K]
        return torch._grouped_mm(a.t(), b.to(a.dtype), offs=offsets)  # [E, N, K]
    a8 = cast_to_float8(a, specs[gemm, left], offsets=offsets)
    b8 = cast_to_float8(b, specs[gemm, right], offsets=offsets)
    a8, b8 = local_part(a8), local_part(b8)
    cfg = specs[gemm, left].mm_config
    m = a8.shape[0]
    if gemm is OUTPUT:  # [M, K] x [E, K, N]
        w_scale = _select(b8._scale, b8.shape, 1)  # [E, N]
        return scaled_grouped_mm(a8._data, _rows(a8._scale, m), b8._data.transpose(-2, -1),
                                 w_scale, offsets, out_dtype=out_dtype, mm_config=cfg)
    if gemm is GRAD_INPUT:  # [M, N] x [E, N, K]
        w_scale = _select(b8._scale, b8.shape, 2)  # [E, K]
        return scaled_grouped_mm(a8._data, _rows(a8._scale, m), b8._data, w_scale, offsets,
                                 out_dtype=out_dtype, mm_config=cfg)
    n, k = a8.shape[1], b8.shape[1]  # [N, M] x [M, K] per group
    a_scale = _per_group(a8._scale.expand(m, a8._scale.shape[-1]), offsets, n)  # [E, N]
    b_scale = _per_group(b8._scale.expand(m, b8._scale.shape[-1]), offsets, k)  # [E, K]
    return scaled_grouped_mm(a8._data.t(), a_scale, b8._data, b_scale, offsets,
                             out_dtype=out_dtype, mm_config=cfg)


class _Float8GroupedMM(torch.autograd.Function):
    """``x[rows of e] @ w[e].t()`` through float8 grouped gemms ([Note: grouped gemms]).
    ``x`` [M, K] (high precision or per-token float8), ``w`` [E, N, K], ``offsets`` [E] int32."""

    @staticmethod
    def forward(ctx, x, w, offsets, specs: CastSpecs):
        out = _gemm(OUTPUT, x, w, offsets, specs)  # [M, N]
        ctx.save_for_backward(x, w, offsets)
        ctx.specs = specs
        return out

    @staticmethod
    def backward(ctx, grad_output):
        x, w, offsets = ctx.saved_tensors
        specs = ctx.specs
        grad_output = grad_output.contiguous()  # [M, N]
        grad_x = _gemm(GRAD_INPUT, grad_output, w, offsets, specs)  # [M, K]
        grad_w = _gemm(GRAD_WEIGHT, grad_output, x, offsets, specs)  # [E, N, K]
        return grad_x, grad_w.to(w.dtype), None, None


def float8_grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor,
                      specs: CastSpecs) -> torch.Tensor:
    """``x[rows of e] @ w[e].t()`` with float8 grouped gemms cast as ``specs`` say
    (``Float8LinearConfig.grouped_cast_specs``): x [M, K], w [E, N, K] -> [M, N].

    Example::

        >>> specs = Float8LinearConfig.from_recipe_name("rowwise").grouped_cast_specs("w1")
        >>> x, w = torch.randn(40, 32), torch.randn(4, 16, 32)
        >>> offsets = torch.tensor([8, 8, 30, 40], dtype=torch.int32)
        >>> float8_grouped_mm(x, w, offsets, specs).shape
        torch.Size([40, 16])
    """
    return _Float8GroupedMM.apply(x, w, offsets.to(torch.int32), specs)


def swiglu_experts(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor,
                   offsets: torch.Tensor, mm) -> torch.Tensor:
    """``w2(silu(w1(x)) * w3(x))`` per expert: x [M, dim], w1, w3 [E, H, dim], w2 [E, dim, H];
    ``mm(name, x, w, offsets)`` is the grouped gemm of weight ``name``."""
    h = F.silu(mm("w1", x, w1, offsets)) * mm("w3", x, w3, offsets)  # [M, H]
    return mm("w2", h, w2, offsets)  # [M, dim]


class _ScaleGrad(torch.autograd.Function):
    """The identity, whose backward multiplies the gradient by ``scale``."""

    @staticmethod
    def forward(ctx, w, scale: float):
        ctx.scale = scale
        return w.view_as(w)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


class GroupedExperts(nn.Module):
    """``num_experts`` SwiGLU experts as 3-D weights, ``w2(silu(w1(x)) * w3(x))`` per expert:
    ``w1``, ``w3`` [E, hidden, dim], ``w2`` [E, dim, hidden] (torchtitan's names and layout).
    Under expert parallelism the weights are DTensors sharded on the experts dim and the layer
    computes with its local experts.

    Example::

        >>> experts = GroupedExperts(dim=32, hidden_dim=64, num_experts=4)
        >>> offsets = torch.tensor([3, 3, 7, 10], dtype=torch.int32)  # expert 1 gets no token
        >>> experts(torch.randn(10, 32), offsets).shape
        torch.Size([10, 32])
    """

    def __init__(self, dim: int, hidden_dim: int, num_experts: int, *, device=None, dtype=None):
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        self.num_experts, self.dim, self.hidden_dim = num_experts, dim, hidden_dim
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim, **kw))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim, **kw))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim, **kw))
        # multiplies the weights' gradients (EP x FSDP2: [Note: EP x FSDP2] in
        # f8dist/models/moe_parallel.py)
        self.grad_scale = 1.0

    def forward(self, x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """``x`` [M, dim] sorted by expert, ``offsets`` [local experts] -> [M, dim]."""
        weights = (local_part(w) for w in (self.w1, self.w2, self.w3))
        if self.grad_scale != 1.0:
            weights = (_ScaleGrad.apply(w, self.grad_scale) for w in weights)
        return swiglu_experts(x, *weights, offsets, self._mm)

    def _mm(self, name: str, x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor):
        return grouped_mm(x, w, offsets)

    def init_weights(self, std: float, generator: Optional[torch.Generator] = None) -> None:
        for w, s in ((self.w1, 0.02), (self.w2, std), (self.w3, std)):
            nn.init.trunc_normal_(w, mean=0.0, std=s, a=-2.0, b=2.0, generator=generator)

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, dim={self.dim}, hidden_dim={self.hidden_dim}"


def grouped_specs(config: Float8LinearConfig, fqn: str) -> Dict[str, CastSpecs]:
    """The casts of each expert weight's gemms, by weight name (FQNs ``fqn.w1`` ...)."""
    return {name: config.grouped_cast_specs(f"{fqn}.{name}" if fqn else name) for name in WEIGHTS}


def token_spec(specs: Dict[str, CastSpecs]) -> Optional[CastSpec]:
    """The per-token cast of the tokens when the up projections take one ([Note: one cast of
    the tokens]); None otherwise (high precision, or tensorwise: per-group scales)."""
    spec = specs["w1"][OUTPUT, INPUT]
    return spec if spec.enabled and spec.axiswise else None


def cast_tokens(x: torch.Tensor, specs: Dict[str, CastSpecs]) -> torch.Tensor:
    """The tokens cast once for both up projections when they cast per token ([Note: one cast
    of the tokens]; differentiable), else ``x``."""
    spec = token_spec(specs)
    return x if spec is None else ToFloat8.apply(x, spec, None)


def is_float8_grouped_compatible(mod: GroupedExperts) -> bool:
    """Whether ``torch._scaled_grouped_mm`` can take the experts' gemms (dims % 16 == 0)."""
    return mod.dim % GEMM_ALIGNMENT == 0 and mod.hidden_dim % GEMM_ALIGNMENT == 0


class Float8GroupedExperts(GroupedExperts):
    """:class:`GroupedExperts` whose grouped gemms run in float8 as ``config`` says
    ([Note: grouped gemms]); its state dict is GroupedExperts'. Made by
    ``convert_to_float8_training``.

    Example::

        >>> experts = Float8GroupedExperts.from_float(GroupedExperts(32, 64, 4),
        ...     Float8LinearConfig.from_recipe_name("rowwise"), fqn="moe.experts")
    """

    def __init__(self, *args, config: Optional[Float8LinearConfig] = None, fqn: str = "",
                 **kwargs):
        super().__init__(*args, **kwargs)
        self.config = config if config is not None else Float8LinearConfig()
        if not self.config.emulate and not is_float8_grouped_compatible(self):
            raise ValueError(
                f"Float8GroupedExperts {fqn or '<root>'}: torch._scaled_grouped_mm needs dim "
                f"({self.dim}) and hidden_dim ({self.hidden_dim}) to be multiples of "
                f"{GEMM_ALIGNMENT}; keep the experts in high precision with module_filter_fn"
            )
        self.fqn = fqn  # the experts' name in the model; their weights' casts are fqn.w1 ...
        self.specs = grouped_specs(self.config, fqn)  # resolved once

    @classmethod
    def from_float(cls, mod: GroupedExperts, config: Optional[Float8LinearConfig] = None,
                   fqn: str = "") -> "Float8GroupedExperts":
        """A Float8GroupedExperts that shares ``mod``'s parameters (no copy)."""
        with torch.device("meta"):
            new = cls(mod.dim, mod.hidden_dim, mod.num_experts, config=config, fqn=fqn)
        for name in WEIGHTS:
            setattr(new, name, getattr(mod, name))
        if new.config.enable_fsdp_float8_all_gather:  # [Note: float8 all-gather of expert weights]
            wrap_weight_for_float8_all_gather(new, WEIGHTS)
        return new

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)
        if self.config.enable_fsdp_float8_all_gather:  # assign=True put plain weights in place
            wrap_weight_for_float8_all_gather(self, WEIGHTS)

    @property
    def token_spec(self) -> Optional[CastSpec]:
        """The per-token cast of the tokens ([Note: one cast of the tokens]), or None."""
        return token_spec(self.specs)

    def forward(self, x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        if torch.is_autocast_enabled(x.device.type):  # [Note: autocast] in f8dist/linear.py
            x = x.to(torch.get_autocast_dtype(x.device.type))
        return super().forward(cast_tokens(x, self.specs), offsets)

    def _mm(self, name: str, x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor):
        return float8_grouped_mm(x, w, offsets, self.specs[name])

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, fqn={self.fqn!r}, cast_configs={self.config.short_str()}"

