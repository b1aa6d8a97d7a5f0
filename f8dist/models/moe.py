"""A mixture-of-experts LLaMA: the decoder of ``llama.py`` with a routed MoE FFN in every block.

Module names follow torchtitan's (llama4 / deepseek_v3)::

    MoETransformer
      layers.N
        attention ...           as in llama.py
        moe                     MoE
          router                TokenChoiceRouter: gate [experts, dim] (high precision)
          experts               GroupedExperts: w1, w3 [E, hidden, dim], w2 [E, dim, hidden]
          shared_expert         FeedForward (optional): w1, w2, w3 (nn.Linear)

[Note: routing]
Each token picks its ``top_k`` experts by the router's float32 softmax scores, renormalized to sum
to 1. The assignments are sorted stably by expert into token groups ([Note: token groups] in
f8dist/core/scaling.py). ``capacity_factor``: an expert takes at most ``ceil(capacity_factor * T * k /
E)`` of a rank's assignments, the first in token order; the rest are dropped. The outputs are
weighted by the scores and summed over each token's k experts in a fixed order (the same bits
whatever rank computed them). The auxiliary loss is Switch Transformer's. Expert parallelism is
the experts' parallel style (f8dist/parallel/ep/style.py); this module's code is one device's either way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from f8dist.nn.grouped import GroupedExperts
from f8dist.models.llama import Attention, FeedForward, ModelArgs, Transformer, TransformerBlock
from f8dist.models.norm import RMSNorm

__all__ = ["MoEArgs", "MoE", "MoETransformer", "TokenChoiceRouter"]


@dataclass(frozen=True, kw_only=True)
class MoEArgs:
    """The MoE FFN of a :class:`MoETransformer`.

    Example::

        >>> MoEArgs(num_experts=8, top_k=2).hidden_dim is None  # the dense FFN's hidden size
        True
    """

    num_experts: int = 8
    top_k: int = 2
    hidden_dim: Optional[int] = None  # each expert's; None: ModelArgs.ffn_hidden_dim
    shared_expert: bool = True
    aux_loss_coef: float = 0.01
    capacity_factor: Optional[float] = None  # None: no token is dropped ([Note: routing])

    def __post_init__(self):
        for name in ("num_experts", "top_k"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"MoEArgs.{name} must be a positive int, got {value!r}")
        if self.top_k > self.num_experts:
            raise ValueError(f"MoEArgs.top_k ({self.top_k}) exceeds num_experts "
                             f"({self.num_experts}); a token picks top_k different experts")
        if self.hidden_dim is not None and self.hidden_dim < 1:
            raise ValueError(f"MoEArgs.hidden_dim must be positive, got {self.hidden_dim}")
        if self.aux_loss_coef < 0:
            raise ValueError(f"MoEArgs.aux_loss_coef must be >= 0, got {self.aux_loss_coef}")
        if self.capacity_factor is not None and self.capacity_factor <= 0:
            raise ValueError(f"MoEArgs.capacity_factor must be positive (or None for no "
                             f"capacity limit), got {self.capacity_factor}")


class TokenChoiceRouter(nn.Module):
    """Top-k softmax routing in float32 ([Note: routing]): ``x [T, dim] -> (scores [T, k],
    experts [T, k], all scores [T, E])``. Its gate is no nn.Linear, so it stays in high
    precision: routing is discrete, and a float8 rounding could flip it."""

    def __init__(self, dim: int, num_experts: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.gate = nn.Parameter(torch.empty(num_experts, dim))

    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        scores = F.linear(x.float(), self.gate.float()).softmax(dim=-1)  # [T, E]
        top, experts = scores.topk(self.top_k, dim=-1)  # [T, k]
        top = top / top.sum(dim=-1, keepdim=True)  # [T, k]
        return top, experts, scores


def load_balancing_loss(scores: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """Switch Transformer's auxiliary loss ``E * sum_e f_e * P_e`` (``f_e``: fraction of the
    assignments to ``e``, ``P_e``: its mean score); 1 when perfectly balanced."""
    e = scores.shape[-1]
    if scores.shape[0] == 0:
        return scores.new_zeros(())
    f = torch.bincount(experts.reshape(-1), minlength=e).to(scores.dtype) / experts.numel()
    return e * (f * scores.mean(dim=0)).sum()


class MoE(nn.Module):
    """A routed mixture-of-experts FFN: ``[B, S, dim] -> [B, S, dim]`` ([Note: routing]).

    Example::

        >>> moe = MoE(dim=32, hidden_dim=64, args=MoEArgs(num_experts=4, top_k=2))
        >>> moe.init_weights(0.02, torch.Generator().manual_seed(0))
        >>> moe(torch.randn(2, 8, 32)).shape
        torch.Size([2, 8, 32])
    """

    def __init__(self, dim: int, hidden_dim: int, args: MoEArgs):
        super().__init__()
        self.args = args
        self.router = TokenChoiceRouter(dim, args.num_experts, args.top_k)
        self.experts = GroupedExperts(dim, hidden_dim, args.num_experts)
        self.shared_expert = FeedForward(dim, hidden_dim) if args.shared_expert else None
        self.aux_loss = torch.zeros(())

    def forward(self, x: torch.Tensor, recompute=None) -> torch.Tensor:
        """``recompute``: as in :meth:`FeedForward.forward`, for the shared expert."""
        shape = x.shape
        xf = x.reshape(-1, shape[-1])  # [T, dim]
        t, k = xf.shape[0], self.args.top_k
        top, experts, scores = self.router(xf)  # [T, k], [T, k], [T, E]
        self.aux_loss = load_balancing_loss(scores, experts)

        order, counts = self._assignments(experts.reshape(-1))  # [A], [E]
        tokens = xf[order // k]  # [A, dim], sorted by expert
        out = self._experts(tokens, counts)  # [A, dim]
        combined = xf.new_zeros((t * k, shape[-1])).index_copy(0, order, out)  # [T * k, dim]
        weighted = combined.view(t, k, shape[-1]).float() * top[..., None]  # [T, k, dim]
        y = weighted.sum(dim=1).to(x.dtype)  # [T, dim]
        if self.shared_expert is not None:
            kwargs = {} if recompute is None else {"recompute": recompute}
            y = y + self.shared_expert(xf, **kwargs)  # the recompute gives x: any leading shape
        return y.reshape(shape)

    def norm_readers(self) -> tuple:
        """The linears that read the input (a norm's output): the shared expert's."""
        return () if self.shared_expert is None else self.shared_expert.norm_readers()

    def _assignments(self, experts: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """The assignments sorted by expert, capacity overflow dropped, and each expert's token
        count ([Note: routing])."""
        e = self.args.num_experts
        order = torch.argsort(experts, stable=True)  # [T * k]
        counts = torch.bincount(experts, minlength=e)  # [E]
        if self.args.capacity_factor is not None:
            capacity = math.ceil(self.args.capacity_factor * experts.numel() / e)
            starts = torch.cumsum(counts, 0) - counts  # [E]
            position = torch.arange(order.numel(), device=order.device) - starts[experts[order]]
            order = order[position < capacity]  # [A]
            counts = counts.clamp(max=capacity)
        return order, counts

    def _experts(self, tokens: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """The experts' outputs for tokens sorted by expert."""
        offsets = torch.cumsum(counts, 0).to(torch.int32)  # [E]
        return self.experts(tokens, offsets)

    def init_weights(self, std: float, generator: torch.Generator) -> None:
        nn.init.trunc_normal_(self.router.gate, mean=0.0, std=0.02, a=-2.0, b=2.0,
                              generator=generator)
        self.experts.init_weights(std, generator)
        if self.shared_expert is not None:
            self.shared_expert.init_weights(std, generator)


class MoEBlock(TransformerBlock):
    """A LLaMA block whose FFN is a :class:`MoE` (named ``moe``, as torchtitan's)."""

    def __init__(self, layer_id: int, args: ModelArgs, moe_args: MoEArgs):
        nn.Module.__init__(self)
        self.layer_id = layer_id
        self.attention_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.moe = MoE(args.dim, moe_args.hidden_dim or args.ffn_hidden_dim, moe_args)
        self.weight_init_std = 0.02 / (2 * (layer_id + 1)) ** 0.5

    @property
    def feed_forward(self) -> MoE:
        return self.moe


class MoETransformer(Transformer):
    """The LLaMA decoder of ``llama.py`` with :class:`MoE` FFNs: ``tokens [B, S] -> logits``;
    after a forward, :meth:`aux_loss` is the weighted load-balancing loss to add to the loss.

    Example::

        >>> model = MoETransformer(ModelArgs(dim=32, n_layers=1, n_heads=2, max_seq_len=8),
        ...                        MoEArgs(num_experts=4, top_k=2))
        >>> model.init_weights(seed=0)
        >>> model(torch.zeros(2, 8, dtype=torch.long)).shape
        torch.Size([2, 8, 256])
    """

    def __init__(self, args: ModelArgs, moe_args: MoEArgs):
        self.moe_args = moe_args
        super().__init__(args)

    def block(self, layer_id: int, args: ModelArgs) -> nn.Module:
        return MoEBlock(layer_id, args, self.moe_args)

    def aux_loss(self) -> torch.Tensor:
        """``aux_loss_coef`` times the layers' load-balancing losses of the last forward."""
        losses = [layer.moe.aux_loss for layer in self.layers.values()]
        return self.moe_args.aux_loss_coef * torch.stack(losses).sum()
