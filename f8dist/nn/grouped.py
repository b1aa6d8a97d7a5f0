"""Grouped experts of a mixture-of-experts layer, and their float8 grouped gemms.

[Note: grouped gemms]
An expert layer holds 3-D weights ``[experts, out, in]`` and runs a linear's three gemms
([Note: gemms] in f8dist/nn/linear.py) per expert ``e`` over its token group (rows of ``x`` sorted by
expert: [Note: token groups] in f8dist/core/scaling.py), e.g. ``output = x[rows of e] @ w[e].t()``,
each operand cast as the config's table says, per expert ([Note: grouped casts] in
f8dist/config/specs.py). An expert with no tokens gets a zero weight gradient.

[Note: block grouped gemms]
With block scales ([Note: block scales] in f8dist/config/cells.py) each expert's gemm is the dense
block-scaled gemm on its group. grad_weight contracts the tokens, so the groups are first padded
with zero rows to a multiple of the block (``pad_groups``; exact: zeros raise no amax and add no
product), so that no block holds two experts' tokens: per expert, bit for bit a block-scaled
``Float8Linear`` ([Note: the CPU block grouped kernel] in f8dist/core/gemm.py).

[Note: NVFP4 experts]
NVFP4's tensor scale is the amax of the logical tensor ([Note: NVFP4] in f8dist/config/cells.py):
all the tokens of the layer, the whole [E, N, K] weight. Under expert parallelism a rank holds
its experts' rows of them (tokens from every rank, weights sharded on dim 0), so each NVFP4
operand of the experts' gemms takes the amax of what it casts (transformed, for the grad_weight
gemm's tokens: [Note: random Hadamard transform] in f8dist/core/scaling.py) reduced over the mesh
axes that shard it (``cast_to_float8(..., shards=)``; ``sharding``, the tokens' from the weight's:
[Note: tokens of sharded experts] in f8dist/core/placement.py), one scalar all-reduce per cast:
every rank casts with one device's tensor scales, and its block scales are its own blocks', so its bytes are one device's. The
float8 dispatch casts the tokens so on their source rank ([Note: float8 dispatch] in
f8dist/parallel/ep/dispatch.py); without it each gemm casts the high-precision tokens it
receives (the same bytes as one cast before both). The gradients' stochastic rounding draws by
each element's place in its expert's group, one device's on every rank ([Note: positions in token
groups] in f8dist/core/scaling.py).

[Note: delayed experts]
Delayed scaling ([Note: delayed scaling] in f8dist/policy/delayed/) keeps one amax history per expert
weight (``ExpertWeightScaling``, so the sync, checkpoints and telemetry treat it as a linear's)
and operand, per tensor, not per expert: (1) a history predicts the next step's amax, and an
expert's token group changes with the routing every step, while the layer's tokens do not;
(2) the state stays a few replicated scalars, so checkpoints reshard across EP degrees. Under
expert parallelism the first step's amaxes are reduced over the EP axis ([Note: tokens of sharded
experts] in f8dist/core/placement.py), so every history is that of one device. Under FSDP2's
float8 all-gather the weight is cast with its history's scale, and its amax recorded, where it
is gathered ([Note: float8 all-gather of expert weights] in f8dist/core/weight.py).

[Note: one cast of the tokens]
When w1's and w3's input cast is per token, :class:`Float8GroupedExperts` casts the tokens once
and both gemms take those bytes; EP casts at the same point, before the dispatch, so one device
and EP multiply the same float8 tokens. The grad_weight gemms re-cast the float8 tokens along
each group (a second rounding, exact but for e4m3 subnormals with power-of-2 scales).

[Note: options of grouped experts]
Every Float8LinearConfig field takes effect in the experts or is refused at conversion
(``check_grouped_options``). ``enable_fsdp_float8_all_gather`` gathers the expert weights in
float8 ([Note: float8 all-gather of expert weights] in f8dist/core/weight.py); ``pad_inner_dim``
does not pad experts; ``sp_grad_weight`` has nothing to choose ([Note: MoE under tensor
parallelism] in f8dist/models/moe_parallel.py); the options of what a linear keeps for backward
(``LINEAR_ONLY_OPTIONS``) raise, naming the fix.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from f8dist.core import agreement
from f8dist.core.cast import ToFloat8, autocast_input, cast_to_float8, high_precision
from f8dist.config import E4M3, CastSpec, CastSpecs, Float8LinearConfig, Gemm, Operand
from f8dist.config.cells import E2M1
from f8dist.policy.delayed import (
    DelayedScaling, apply_to_delayed_module, delayed_operands, load_delayed_state,
)
from f8dist.core.weight import wrap_weight_for_float8_all_gather
from f8dist.core.gemm import pad_groups, scatter_rows, shape_problems
from f8dist.core.placement import (
    expert_token_placements, is_dtensor, local_part, shard_index,
)
from f8dist.core.scaling import group_positions
from f8dist.core.tensor import Float8Tensor

__all__ = ["GroupedExperts", "Float8GroupedExperts", "ExpertWeightScaling", "float8_grouped_mm",
           "grouped_mm", "swiglu_experts", "grouped_specs", "token_spec", "cast_tokens",
           "grouped_problems", "check_grouped_options", "LINEAR_ONLY_OPTIONS"]

OUTPUT, GRAD_INPUT, GRAD_WEIGHT = Gemm
Scales = Optional[Dict[Tuple[Gemm, Operand], torch.Tensor]]
Delayed = Optional[Tuple[DelayedScaling, bool]]
Shardings = Optional[Dict[Operand, tuple]]  # (mesh, placements) by operand, under EP
INPUT, WEIGHT, GRAD_OUTPUT = Operand
WEIGHTS = ("w1", "w2", "w3")


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``x[rows of e] @ w[e].t()`` in high precision: x [M, K], w [E, N, K] -> [M, N]."""
    return torch._grouped_mm(x, w.transpose(-2, -1).to(x.dtype), offs=offsets)


def _gemm(gemm: Gemm, a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor,
          specs: CastSpecs, scales: Scales = None, sharding: Shardings = None) -> torch.Tensor:
    """One gemm of [Note: grouped gemms], in float8 as ``specs`` say or in high precision;
    ``scales``: delayed scales by (gemm, operand) ([Note: delayed experts]); ``sharding``: the
    operands' (mesh, placements) under EP ([Note: NVFP4 experts])."""
    left, right = gemm.operands
    out_dtype = a.dtype
    if not specs.gemm_in_float8(gemm):
        a, b = high_precision(a), high_precision(b)
        if gemm is OUTPUT:
            return grouped_mm(a, b, offsets)  # [M, N]
        if gemm is GRAD_INPUT:
            return torch._grouped_mm(a, b.to(a.dtype), offs=offsets)  # [M, K]
        return torch._grouped_mm(a.t(), b.to(a.dtype), offs=offsets)  # [E, N, K]
    if specs[gemm, left].blockwise:
        a8, b8, offsets = _block_operands(gemm, a, b, offsets, specs, sharding)
    else:
        scales = scales or {}
        a8 = cast_to_float8(a, specs[gemm, left], scales.get((gemm, left)), offsets=offsets)
        b8 = cast_to_float8(b, specs[gemm, right], scales.get((gemm, right)), offsets=offsets)
    a8, b8 = local_part(a8), local_part(b8)
    # laid out as torch._grouped_mm's ([Note: grouped gemm constraints] in f8dist/core/gemm.py)
    if gemm is OUTPUT:  # [M, K] x [E, K, N]: the weight [E, N, K] transposed with its scales
        b8 = b8.transpose(-2, -1)
    elif gemm is GRAD_WEIGHT:  # [N, M] x [M, K] -> [E, N, K]
        a8 = a8.t()
    return torch._grouped_mm(a8, b8, offs=offsets, out_dtype=out_dtype)


def _sharded_nvfp4(t: torch.Tensor, spec: CastSpec, sharding) -> bool:
    """Whether ``spec`` casts ``t``, a local part sharded as ``sharding`` says, to NVFP4 from
    high precision ([Note: NVFP4 experts]); float8 bytes are taken as they are."""
    return spec.dtype == E2M1 and sharding is not None and not isinstance(t, Float8Tensor)


def _nvfp4_shards(t: torch.Tensor, spec: CastSpec, sharding):
    """The (mesh, placements) the cast reduces its amax over where :func:`_sharded_nvfp4`;
    None where the cast's local amax is the tensor's."""
    return sharding if _sharded_nvfp4(t, spec, sharding) else None


def _block_operands(gemm: Gemm, a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor,
                    specs: CastSpecs, sharding: Shardings = None):
    """The float8 operands and token offsets of a gemm with block scales ([Note: block grouped
    gemms])."""
    left, right = gemm.operands
    sa, sb = specs[gemm, left], specs[gemm, right]
    if gemm is GRAD_WEIGHT:  # tokens blocked within each group: groups padded to the block
        a, b = local_part(high_precision(a)), local_part(high_precision(b))  # [M, N], [M, K]
        padded, rows, m_padded = pad_groups(offsets, a.shape[0], sa.block_size[1])
        a, b = scatter_rows(a, rows, m_padded), scatter_rows(b, rows, m_padded)  # [M', *]
        offsets = padded
    # blocks of tokens need no offsets
    shards = sharding or {}
    return (cast_to_float8(a, sa, shards=_nvfp4_shards(a, sa, shards.get(left)),
                           positions=_draw_positions(a, sa, offsets, shards.get(left))),
            cast_to_float8(b, sb, shards=_nvfp4_shards(b, sb, shards.get(right)),
                           positions=_draw_positions(b, sb, offsets, shards.get(right))), offsets)


def _draw_positions(t: torch.Tensor, spec: CastSpec, offsets: torch.Tensor,
                    sharding) -> Optional[torch.Tensor]:
    """Where a stochastically rounded token operand ``t`` [M, C] in groups ``offsets`` draws:
    one device's places in its experts' groups ([Note: positions in token groups] in
    f8dist/core/scaling.py), the rank's first expert found from ``sharding`` (the tokens'
    (mesh, placements) under EP); None where ``spec`` rounds to nearest."""
    if not spec.stochastic_rounding:
        return None
    first = 0 if sharding is None else shard_index(*sharding) * offsets.shape[0]
    return group_positions(offsets, *t.shape, first)  # [M, C]


class _Float8GroupedMM(torch.autograd.Function):
    """``x[rows of e] @ w[e].t()`` through float8 grouped gemms ([Note: grouped gemms]);
    ``x`` may be per-token float8."""

    @staticmethod
    def forward(ctx, x, w, offsets, specs: CastSpecs, scales: Scales, delayed: Delayed,
                sharding):
        out = _gemm(OUTPUT, x, w, offsets, specs, scales, sharding)  # [M, N]
        ctx.save_for_backward(x, w, offsets)
        ctx.specs, ctx.scales, ctx.delayed, ctx.sharding = specs, scales, delayed, sharding
        return out

    @staticmethod
    def backward(ctx, grad_output):
        x, w, offsets = ctx.saved_tensors
        specs, scales = ctx.specs, ctx.scales
        grad_output = grad_output.contiguous()  # [M, N]
        later = []  # [Note: record after the cast] in f8dist/policy/delayed/scale.py
        if ctx.delayed is not None:  # a delayed grad_output scale is known now
            state, record = ctx.delayed
            scales = {**scales, **state.grad_output_scales(grad_output, record, later,
                                                           ctx.sharding)}
        grad_x = _gemm(GRAD_INPUT, grad_output, w, offsets, specs, scales, ctx.sharding)  # [M, K]
        grad_w = _gemm(GRAD_WEIGHT, grad_output, x, offsets, specs, scales, ctx.sharding)  # [E, N, K]
        for amax_record in later:
            amax_record()
        return grad_x, grad_w.to(w.dtype), None, None, None, None, None


def float8_grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor,
                      specs: CastSpecs, scales: Scales = None, delayed: Delayed = None,
                      sharding=None) -> torch.Tensor:
    """``x[rows of e] @ w[e].t()`` with float8 grouped gemms cast as ``specs`` say:
    x [M, K], w [E, N, K] -> [M, N]. ``scales``, ``delayed`` (state, whether the forward
    recorded) are delayed scaling's ([Note: delayed experts]), ``sharding`` the operands'
    under EP (:func:`expert_sharding`: [Note: delayed experts], [Note: NVFP4 experts]).

    Example::

        >>> specs = Float8LinearConfig.from_recipe_name("rowwise").grouped_cast_specs("w1")
        >>> x, w = torch.randn(40, 32), torch.randn(4, 16, 32)
        >>> offsets = torch.tensor([8, 8, 30, 40], dtype=torch.int32)
        >>> float8_grouped_mm(x, w, offsets, specs).shape
        torch.Size([40, 16])
    """
    return _Float8GroupedMM.apply(x, w, offsets.to(torch.int32), specs, scales or {}, delayed,
                                  sharding)


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
    Under expert parallelism the weights are DTensors sharded on dim 0.

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
        # [Note: EP x FSDP2] in f8dist/models/moe_parallel.py
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


agreement.CONVERTIBLE.append(GroupedExperts)  # the ranks agree on whether experts are float8


def grouped_specs(config: Float8LinearConfig, fqn: str) -> Dict[str, CastSpecs]:
    """The casts of each expert weight's gemms, by weight name (FQNs ``fqn.w1`` ...)."""
    return {name: config.grouped_cast_specs(f"{fqn}.{name}" if fqn else name) for name in WEIGHTS}


def token_spec(specs: Dict[str, CastSpecs]) -> Optional[CastSpec]:
    """The per-token cast of the tokens when the up projections take one ([Note: one cast of
    the tokens]); None otherwise."""
    spec = specs["w1"][OUTPUT, INPUT]
    per_token = spec.axiswise or (spec.blockwise and spec.block_shape(2)[0] == 1)
    return spec if spec.enabled and per_token else None


def cast_tokens(x: torch.Tensor, specs: Dict[str, CastSpecs],
                sharding: Shardings = None) -> torch.Tensor:
    """The tokens cast once for both up projections ([Note: one cast of the tokens]), else x
    (also high-precision NVFP4 tokens under EP, which each gemm casts: [Note: NVFP4 experts])."""
    spec = token_spec(specs)
    if spec is None or _sharded_nvfp4(x, spec, (sharding or {}).get(INPUT)):
        return x
    return ToFloat8.apply(x, spec, None)


def grouped_problems(mod: GroupedExperts, config: Float8LinearConfig) -> List[str]:
    """Why the experts' float8 grouped gemms cannot take ``mod``'s dims under ``config``
    (alignment, blocks); empty when they can."""
    specs, bad = grouped_specs(config, ""), []
    for name, (k, n) in (("w1", (mod.dim, mod.hidden_dim)), ("w2", (mod.hidden_dim, mod.dim))):
        for problem in shape_problems(specs[name], k, n):
            problem = problem.replace("in_features", "dim" if name == "w1" else "hidden_dim")
            problem = problem.replace("out_features", "hidden_dim" if name == "w1" else "dim")
            if problem not in bad:
                bad.append(problem)
    return bad


# [Note: options of grouped experts]: option -> what the experts keep instead
LINEAR_ONLY_OPTIONS = {
    "axiswise_requantize_input_for_grad_weight":
        "w2's grad_weight gemm casts its high-precision input (w1 and w3 re-scale the float8 "
        "tokens already: [Note: one cast of the tokens])",
    "float8_activations_for_backward":
        "the experts keep SwiGLU's gate and up and w2's input in high precision",
    "recompute_swiglu_product": "the experts keep w2's input (SwiGLU's product)",
    "recompute_norm_output": "the experts keep the routed tokens they read",
    "float8_weight_for_backward": "the experts re-cast the high-precision weight in backward",
}


def check_grouped_options(config: Float8LinearConfig, fqn: str = "") -> None:
    """Raise if ``config`` sets an option that grouped experts do not implement ([Note: options
    of grouped experts])."""
    asked = [name for name in LINEAR_ONLY_OPTIONS if getattr(config, name)]
    if asked:
        raise ValueError(
            f"Float8GroupedExperts {fqn or '<root>'}: "
            + "; ".join(f"{name}={getattr(config, name)!r} is implemented for Float8Linear only "
                        f"({LINEAR_ONLY_OPTIONS[name]})" for name in asked)
            + ". Convert the experts with a config without it, in a call of their own: "
            "convert_to_float8_training(model, config=config, module_filter_fn=lambda mod, fqn: "
            "not isinstance(mod, GroupedExperts)), then convert_to_float8_training(model, "
            f"config=config.replace({', '.join(f'{n}=False' for n in asked)}), "
            "module_filter_fn=lambda mod, fqn: isinstance(mod, GroupedExperts))"
        )


def is_float8_grouped_compatible(mod: GroupedExperts,
                                 config: Optional[Float8LinearConfig] = None) -> bool:
    """Whether the float8 grouped gemms can take the experts' gemms (:func:`grouped_problems`)."""
    return not grouped_problems(mod, config if config is not None else Float8LinearConfig())


def expert_sharding(w: torch.Tensor) -> Shardings:
    """(mesh, placements) of the shards of an expert weight ``w`` and of its tokens under expert
    parallelism ([Note: tokens of sharded experts] in f8dist/core/placement.py); None otherwise."""
    if not is_dtensor(w):
        return None
    mesh, tokens = w.device_mesh, (w.device_mesh, expert_token_placements(w.placements))
    return {WEIGHT: (mesh, w.placements), INPUT: tokens, GRAD_OUTPUT: tokens}


class ExpertWeightScaling(nn.Module):
    """The delayed-scaling state of one expert weight ([Note: delayed experts]): the
    ``fp8_*`` buffers of its casts, FQN ``<experts>.w1`` ...; a child of its
    :class:`Float8GroupedExperts` (``delayed_scaling.w1``), whose weight it reads.

    Example::

        >>> experts = Float8GroupedExperts.from_float(GroupedExperts(32, 64, 4),
        ...     Float8LinearConfig.from_recipe_name("delayed"), fqn="moe.experts")
        >>> experts.delayed_scaling["w1"].fqn, experts.delayed_scaling["w1"].fp8_scale_input
        ('moe.experts.w1', tensor(1.))
    """

    def __init__(self, experts: "Float8GroupedExperts", name: str):
        super().__init__()
        self.config, self.name = experts.config, name
        self.fqn = f"{experts.fqn}.{name}" if experts.fqn else name
        self.__dict__["_experts"] = experts  # not a child: state_dict and modules() skip it
        self.delayed = DelayedScaling.attach(self, E4M3)  # e4m3: [Note: grouped casts]

    @property
    def weight(self) -> torch.Tensor:
        """The expert weight (the parameter, a DTensor under expert parallelism)."""
        return getattr(self.__dict__["_experts"], self.name)

    def sharding(self) -> Shardings:
        """:func:`expert_sharding` of the weight."""
        return expert_sharding(self.weight)

    def _apply(self, fn, recurse=True):  # the delayed buffers stay float32
        return apply_to_delayed_module(self.delayed, fn,
                                       lambda f: super(ExpertWeightScaling, self)._apply(f, recurse))

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)
        load_delayed_state(self.delayed, state_dict, prefix, missing_keys)

    def extra_repr(self) -> str:
        return f"fqn={self.fqn!r}"


class Float8GroupedExperts(GroupedExperts):
    """:class:`GroupedExperts` whose grouped gemms run in float8 as ``config`` says
    ([Note: grouped gemms]); its state dict is GroupedExperts'.

    Example::

        >>> experts = Float8GroupedExperts.from_float(GroupedExperts(32, 64, 4),
        ...     Float8LinearConfig.from_recipe_name("rowwise"), fqn="moe.experts")
    """

    def __init__(self, *args, config: Optional[Float8LinearConfig] = None, fqn: str = "",
                 **kwargs):
        super().__init__(*args, **kwargs)
        self.config = config if config is not None else Float8LinearConfig()
        check_grouped_options(self.config, fqn)
        bad = [] if self.config.emulate else grouped_problems(self, self.config)
        if bad:
            raise ValueError(
                f"Float8GroupedExperts {fqn or '<root>'}: its float8 grouped gemms need dim "
                f"({self.dim}) and hidden_dim ({self.hidden_dim}) to divide into their alignment "
                f"and blocks, got {', '.join(bad)}; keep the experts in high precision with "
                "module_filter_fn"
            )
        self.fqn = fqn  # the experts' name in the model; their weights' casts are fqn.w1 ...
        self.specs = grouped_specs(self.config, fqn)  # resolved once
        self._attach_delayed()

    def _attach_delayed(self) -> None:
        """One :class:`ExpertWeightScaling` per weight when the config has delayed casts."""
        if delayed_operands(self.config):
            self.delayed_scaling = nn.ModuleDict(
                {name: ExpertWeightScaling(self, name) for name in WEIGHTS})
        else:
            self.delayed_scaling = None

    @classmethod
    def from_float(cls, mod: GroupedExperts, config: Optional[Float8LinearConfig] = None,
                   fqn: str = "") -> "Float8GroupedExperts":
        """A Float8GroupedExperts that shares ``mod``'s parameters (no copy)."""
        with torch.device("meta"):
            new = cls(mod.dim, mod.hidden_dim, mod.num_experts, config=config, fqn=fqn)
        for name in WEIGHTS:
            setattr(new, name, getattr(mod, name))
        new._wrap_for_float8_all_gather()
        new._attach_delayed()  # its buffers on the weights' device (they were made on meta)
        return new

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)
        self._wrap_for_float8_all_gather()  # assign=True put plain weights in place

    def _wrap_for_float8_all_gather(self) -> None:
        """[Note: float8 all-gather of expert weights] in f8dist/core/weight.py."""
        if self.config.enable_fsdp_float8_all_gather:
            wrap_weight_for_float8_all_gather(self, WEIGHTS)

    @property
    def token_spec(self) -> Optional[CastSpec]:
        """The per-token cast of the tokens ([Note: one cast of the tokens]), or None."""
        return token_spec(self.specs)

    def forward(self, x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        x = autocast_input(x)  # [Note: autocast] in f8dist/nn/linear.py
        return super().forward(cast_tokens(x, self.specs, expert_sharding(self.w1)), offsets)

    def _mm(self, name: str, x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor):
        if self.delayed_scaling is None:  # [Note: NVFP4 experts]: the shards' sharding
            return float8_grouped_mm(x, w, offsets, self.specs[name],
                                     sharding=expert_sharding(getattr(self, name)))
        scaling = self.delayed_scaling[name]  # [Note: delayed experts]
        state, record, later, sharding = scaling.delayed, scaling.delayed.training(), [], scaling.sharding()
        scales = state.forward_scales(x, w, record, later, sharding)
        out = float8_grouped_mm(x, w, offsets, self.specs[name], scales, (state, record), sharding)
        for amax_record in later:  # [Note: record after the cast] in f8dist/policy/delayed/scale.py
            amax_record()
        return out

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, fqn={self.fqn!r}, cast_configs={self.config.short_str()}"

