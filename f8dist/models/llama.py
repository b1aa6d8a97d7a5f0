"""A small LLaMA-style decoder (RMSNorm, RoPE, SwiGLU, grouped-query attention via
``scaled_dot_product_attention``), with torchtitan's module names.

Plans and tools address modules by FQN (``layers.0.attention.wq``)::

    Transformer
      tok_embeddings            nn.Embedding(vocab_size, dim)
      layers                    nn.ModuleDict {"0": TransformerBlock, ...}
        attention_norm          RMSNorm(dim) (nn.RMSNorm keeping less, f8dist/models/norm.py)
        attention               Attention: wq, wk, wv, wo (nn.Linear, no bias)
        ffn_norm                RMSNorm(dim)
        feed_forward            FeedForward: w2(silu(w1(x)) * w3(x))
      norm                      RMSNorm(dim)
      output                    nn.Linear(dim, vocab_size)

[Note: local heads]
Under tensor parallelism each rank holds a slice of the heads, so attention views a projection as
``[B, S, -1, head_dim]`` (the local head count), never reshaping by ``n_heads``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from f8dist.nn.linear import Float8Linear
from f8dist.models.norm import RMSNorm
from f8dist.core.placement import is_dtensor
from f8dist.nn.swiglu import swiglu_for

__all__ = ["ModelArgs", "Transformer", "TransformerBlock", "Attention", "FeedForward"]


@dataclass(frozen=True, kw_only=True)
class ModelArgs:
    """Sizes of a :class:`Transformer`; the defaults are small enough for CPU training.

    Example::

        >>> args = ModelArgs(dim=64, n_layers=2, n_heads=4)
        >>> args.head_dim, args.ffn_hidden_dim
        (16, 192)
    """

    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: Optional[int] = None  # None: as many as n_heads (plain multi-head attention)
    vocab_size: int = 256  # bytes
    # SwiGLU hidden size rounded up to it: 32 keeps 2 TP halves aligned to 16 (torch._scaled_mm)
    multiple_of: int = 32
    ffn_dim_multiplier: Optional[float] = None
    norm_eps: float = 1e-5
    max_seq_len: int = 128
    rope_theta: float = 10000.0

    def __post_init__(self):
        for name in ("dim", "n_layers", "n_heads", "vocab_size", "multiple_of", "max_seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"ModelArgs.{name} must be a positive int, got {value!r}")
        if self.dim % self.n_heads:
            raise ValueError(
                f"ModelArgs.dim ({self.dim}) must be divisible by n_heads ({self.n_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(
                f"RoPE rotates pairs of channels, so head_dim = dim / n_heads must be even; "
                f"got {self.dim} / {self.n_heads} = {self.head_dim}"
            )
        if self.n_kv_heads is not None and (
            self.n_kv_heads < 1 or self.n_heads % self.n_kv_heads
        ):
            raise ValueError(
                f"ModelArgs.n_kv_heads ({self.n_kv_heads}) must divide n_heads ({self.n_heads})"
            )
        if self.ffn_dim_multiplier is not None and self.ffn_dim_multiplier <= 0:
            raise ValueError(
                f"ModelArgs.ffn_dim_multiplier must be positive, got {self.ffn_dim_multiplier}"
            )
        if self.norm_eps <= 0 or self.rope_theta <= 0:
            raise ValueError("ModelArgs.norm_eps and rope_theta must be positive")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads if self.n_kv_heads is not None else self.n_heads

    @property
    def ffn_hidden_dim(self) -> int:
        # LLaMA's SwiGLU sizing: 2/3 of 4 * dim, scaled, rounded up to multiple_of
        hidden = int(2 * (4 * self.dim) / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * math.ceil(hidden / self.multiple_of)

    def num_params(self, *, exclude_embedding: bool = True) -> int:
        """Parameter count (the embedding excluded by default, as FLOP counts want)."""
        attn = self.dim * self.head_dim * (2 * self.n_heads + 2 * self.kv_heads)
        ffn = 3 * self.dim * self.ffn_hidden_dim
        per_layer = attn + ffn + 2 * self.dim
        total = self.n_layers * per_layer + self.dim + self.dim * self.vocab_size
        return total if exclude_embedding else total + self.vocab_size * self.dim

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token: 6 * params for the matmuls plus attention's scores, as in
        torchtitan's ``get_num_flop_per_token``."""
        return 6 * self.num_params() + 12 * self.n_layers * self.dim * seq_len


def precompute_rope(head_dim: int, max_seq_len: int, theta: float) -> torch.Tensor:
    """cos and sin of each position's rotation angles: ``[max_seq_len, head_dim // 2, 2]``."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), freqs)  # [S, D/2]
    return torch.stack([angles.cos(), angles.sin()], dim=-1)  # [S, D/2, 2]


def apply_rope(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """Rotate channel pairs (0, 1), (2, 3), ... of ``x`` ``[B, S, H, D]`` by each position's
    angles (the real form of torchtitan's complex ``freqs_cis`` product)."""
    b, s, h, d = x.shape
    pairs = x.float().reshape(b, s, h, d // 2, 2)  # [B, S, H, D/2, 2]
    cos = rope[:s, None, :, 0]  # [S, 1, D/2]
    sin = rope[:s, None, :, 1]  # [S, 1, D/2]
    x0, x1 = pairs[..., 0], pairs[..., 1]  # [B, S, H, D/2]
    out = torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1)  # [B, S, H, D/2, 2]
    return out.flatten(-2).type_as(x)  # [B, S, H, D]


def _norm_reader(linear: nn.Module, recompute) -> dict:
    """``{"recompute": recompute}`` for a Float8Linear whose config has
    ``recompute_norm_output``, else ``{}``."""
    if recompute is None or not isinstance(linear, Float8Linear):
        return {}
    return {"recompute": recompute} if linear.config.recompute_norm_output else {}


def _normalize(norm: nn.Module, x: torch.Tensor, readers=()):
    """``(norm(x), kwargs)``: ``{"recompute": (fn, tensors)}`` for the output's ``readers`` when
    the norm gives one ([Note: a norm output recomputed in backward] in f8dist/models/norm.py),
    else ``{}`` (a keyword only when given: a TP style's input layouts count positional inputs).
    Raises where a reader asks for ``recompute_norm_output`` and the norm gives none (another
    class, hooks, a DTensor input): the option would do nothing."""
    plain = isinstance(norm, RMSNorm) and not _hooked(norm)
    out, recompute = norm.normalize(x) if plain else (norm(x), None)
    if recompute is not None:
        return out, {"recompute": recompute}
    if not torch.is_grad_enabled():  # nothing is kept for backward: nothing to recompute
        return out, {}
    asking = [r.fqn or type(r).__name__ for r in readers
              if isinstance(r, Float8Linear) and r.config.recompute_norm_output]
    if asking:
        raise ValueError(
            f"recompute_norm_output: {', '.join(asking)} read a norm's output, but the norm gives "
            f"nothing to recompute it from: {_no_recompute(norm, plain, x)}. The option would do "
            "nothing here: build the linears' config without recompute_norm_output (train.py: "
            "drop --recompute-norm-output)")
    return out, {}


def _no_recompute(norm: nn.Module, plain: bool, x: torch.Tensor) -> str:
    """Why ``norm`` gave no recompute of its output for ``x`` (with grad on)."""
    if not isinstance(norm, RMSNorm):
        return f"it is {type(norm).__name__}, not f8dist.models.norm.RMSNorm"
    if not plain:
        return "it runs hooks (a parallel style's, FSDP2's), which a recompute would bypass"
    if is_dtensor(x):
        return "its input is a DTensor (sequence parallel; a recompute would give the local rows)"
    return "its weight is missing or of another dtype than its input"


def _hooked(module: nn.Module) -> bool:
    """Whether calling ``module`` runs hooks (nn.Module._call_impl's test for its fast path)."""
    from torch.nn.modules import module as m

    return bool(module._backward_hooks or module._backward_pre_hooks or module._forward_hooks
                or module._forward_pre_hooks or m._global_backward_pre_hooks
                or m._global_backward_hooks or m._global_forward_hooks
                or m._global_forward_pre_hooks)


class ScaledDotProductAttention(nn.Module):
    """``F.scaled_dot_product_attention`` of ``q`` [B, Hq, S, D] over ``k``, ``v`` [B, Hkv, S, D],
    each kv head serving ``Hq / Hkv`` query heads (grouped-query attention). A module of its own,
    as torchtitan's attention, so that a context-parallel style
    (:class:`~f8dist.parallel.cp.Float8ContextParallel`) hooks its inputs: it gathers K and V
    before the heads are repeated."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                attn_mask: Optional[torch.Tensor] = None, is_causal: bool = False) -> torch.Tensor:
        n_rep = q.shape[1] // k.shape[1]
        if n_rep > 1:  # grouped-query attention: each kv head serves n_rep query heads
            k = k.repeat_interleave(n_rep, dim=1)  # [B, Hq, S, D]
            v = v.repeat_interleave(n_rep, dim=1)  # [B, Hq, S, D]
        return F.scaled_dot_product_attention(  # [B, Hq, S, D]
            q, k, v, attn_mask=attn_mask, is_causal=is_causal)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)
        self.sdpa = ScaledDotProductAttention()  # what context parallelism hooks

    def forward(self, x: torch.Tensor, rope: torch.Tensor, recompute=None) -> torch.Tensor:
        """``recompute``: ``(fn, tensors)`` giving ``x`` again, for readers with
        ``recompute_norm_output`` ([Note: a norm output recomputed in backward] in
        f8dist/models/norm.py)."""
        b, s, _ = x.shape
        # -1: the local head count, see [Note: local heads]
        q, k, v = (linear(x, **_norm_reader(linear, recompute)).view(b, s, -1, self.head_dim)
                   for linear in (self.wq, self.wk, self.wv))  # [B, S, Hq | Hkv | Hkv, D]
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, Hq | Hkv | Hkv, S, D]
        out = self.sdpa(q, k, v, is_causal=True)  # [B, Hq, S, D]
        out = out.transpose(1, 2).reshape(b, s, -1)  # [B, S, Hq * D]
        return self.wo(out)  # [B, S, dim]

    def norm_readers(self) -> tuple:
        """The linears that read the input (a norm's output)."""
        return self.wq, self.wk, self.wv

    def init_weights(self, std: float, generator: torch.Generator) -> None:
        for linear in (self.wq, self.wk, self.wv):
            _trunc_normal(linear.weight, 0.02, generator)
        _trunc_normal(self.wo.weight, std, generator)


class FeedForward(nn.Module):
    """SwiGLU: ``w2(silu(w1(x)) * w3(x))``, keeping what f8dist/nn/swiglu.py says for backward."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor, recompute=None) -> torch.Tensor:
        """``recompute``: as in :meth:`Attention.forward`, for w1 and w3."""
        product, kwargs = swiglu_for(  # [..., hidden]; gate and up die before w2 runs
            self.w1(x, **_norm_reader(self.w1, recompute)),
            self.w3(x, **_norm_reader(self.w3, recompute)), self.w2)
        return self.w2(product, **kwargs)

    def norm_readers(self) -> tuple:
        """The linears that read the input (a norm's output)."""
        return self.w1, self.w3

    def init_weights(self, std: float, generator: torch.Generator) -> None:
        _trunc_normal(self.w1.weight, 0.02, generator)
        for linear in (self.w2, self.w3):
            _trunc_normal(linear.weight, std, generator)


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, args: ModelArgs):
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.feed_forward = FeedForward(args.dim, args.ffn_hidden_dim)
        # torchtitan's depth-scaled init of the residual projections
        self.weight_init_std = 0.02 / (2 * (layer_id + 1)) ** 0.5

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        normed, recompute = _normalize(self.attention_norm, x, self.attention.norm_readers())
        h = x + self.attention(normed, rope, **recompute)
        normed, recompute = _normalize(self.ffn_norm, h, self.feed_forward.norm_readers())
        return h + self.feed_forward(normed, **recompute)

    def init_weights(self, generator: torch.Generator) -> None:
        self.attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()
        self.attention.init_weights(self.weight_init_std, generator)
        self.feed_forward.init_weights(self.weight_init_std, generator)


class Transformer(nn.Module):
    """Decoder-only LM: ``tokens [B, S] (int64) -> logits [B, S, vocab_size]``.

    Example::

        >>> model = Transformer(ModelArgs(dim=32, n_layers=1, n_heads=2, max_seq_len=8))
        >>> model.init_weights(seed=0)
        >>> model(torch.zeros(2, 8, dtype=torch.long)).shape
        torch.Size([2, 8, 256])
    """

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): self.block(i, args) for i in range(args.n_layers)})
        self.norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.register_buffer(
            "rope", precompute_rope(args.head_dim, args.max_seq_len, args.rope_theta),
            persistent=False,
        )

    def block(self, layer_id: int, args: ModelArgs) -> nn.Module:
        """Block ``layer_id`` (a subclass's hook: f8dist/models/moe.py makes MoE blocks)."""
        return TransformerBlock(layer_id, args)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if tokens.shape[1] > self.args.max_seq_len:
            raise ValueError(
                f"sequence length {tokens.shape[1]} exceeds ModelArgs.max_seq_len "
                f"({self.args.max_seq_len}); raise max_seq_len or shorten the batch"
            )
        h = self.tok_embeddings(tokens)  # [B, S, dim]
        for layer in self.layers.values():
            h = layer(h, self.rope)
        return self.output(self.norm(h))  # [B, S, vocab]

    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> None:
        """Deterministic init from ``seed`` alone (the global RNG is left untouched), as
        torchtitan's."""
        generator = torch.Generator(device=self.output.weight.device).manual_seed(seed)
        self.rope.copy_(
            precompute_rope(self.args.head_dim, self.args.max_seq_len, self.args.rope_theta)
        )
        nn.init.normal_(self.tok_embeddings.weight, generator=generator)
        for layer in self.layers.values():
            layer.init_weights(generator)
        self.norm.reset_parameters()
        std = self.args.dim ** -0.5
        _trunc_normal(self.output.weight, std, generator, cutoff=3 * std)


def _trunc_normal(
    weight: torch.Tensor, std: float, generator: torch.Generator, cutoff: float = 2.0
) -> None:
    nn.init.trunc_normal_(weight, mean=0.0, std=std, a=-cutoff, b=cutoff, generator=generator)
