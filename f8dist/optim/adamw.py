"""AdamW whose moments are kept in 8 bits, on each parameter's local shard.

[Note: 8-bit AdamW on shards]
``torch.optim.AdamW`` with the moments stored as block-scaled codes ([Note: state formats] in
f8dist/optim/states.py). A step decodes them to float32, updates them as torch does, encodes
them, and updates the weight from the fresh float32 moments: only what is carried to the next
step is rounded. The codes live on the parameter's local shard, in blocks of ``block_size``
elements whose scale needs only the block: a step runs no collective, and where shard boundaries
fall on block boundaries the states are one device's, bit for bit.

[Note: optimizer checkpoints]
``state_dict()`` holds what torch.optim.AdamW's holds, the moments decoded to float32 and laid
out like the parameter, so DCP reshards them and torch's AdamW loads them; ``load_state_dict``
encodes whatever it gets (bit for bit on the same sharding; resharded, rounded again where blocks
moved). Param groups carry torch's keys only: storage options belong to the loading optimizer.
"""

from __future__ import annotations

import math
from itertools import chain
from typing import Any, Dict, Iterable, Optional, Tuple, Union

import torch

from f8dist.optim.states import (
    QuantizedState, StateFormat, blocks, check_block_size, decode, encode, encode_into, unblock,
)
from f8dist.core.placement import is_dtensor, like, local_part

__all__ = ["AdamW"]

_MOMENTS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
# how this optimizer stores and runs, not what it learned ([Note: optimizer checkpoints])
_STORAGE_KEYS = ("exp_avg_format", "exp_avg_sq_format", "block_size")
_INSTANCE_KEYS = _STORAGE_KEYS + ("foreach", "fused", "capturable", "differentiable")
_FORMAT_KEY = {"exp_avg": "exp_avg_format", "exp_avg_sq": "exp_avg_sq_format",
               "max_exp_avg_sq": "exp_avg_sq_format"}


def _value(x):
    """A python number from a 0-dim tensor in eager mode (the step lives on the CPU, as in
    torch.optim.AdamW), the tensor itself while compiling (no graph break)."""
    if isinstance(x, torch.Tensor) and not torch.compiler.is_compiling():
        return x.item()
    return x


def _sqrt(x):
    """sqrt of a python number (as torch.optim.AdamW takes it) or of a tensor."""
    return x.sqrt() if isinstance(x, torch.Tensor) else math.sqrt(x)


class AdamW(torch.optim.Optimizer):
    """``torch.optim.AdamW`` with 8-bit moments ([Note: 8-bit AdamW on shards]).

    Args are torch.optim.AdamW's, plus ``exp_avg_format`` and ``exp_avg_sq_format``
    (:class:`~f8dist.optim.states.StateFormat` or its string; defaults from
    ``scripts/optim_states_report.py``, docs/optim.md) and ``block_size`` (elements per scale),
    which may differ per param group. ``foreach``, ``fused``, ``capturable`` and
    ``differentiable`` are refused: compile the step instead (``torch.compile(optimizer.step)``).

    Example::

        >>> model = torch.nn.Linear(256, 64)
        >>> opt = AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
        >>> model(torch.randn(8, 256)).sum().backward()
        >>> opt.step()
        >>> opt.state[model.weight]["exp_avg_codes"].dtype
        torch.int8
    """

    def __init__(
        self,
        params: Iterable,
        lr: Union[float, torch.Tensor] = 1e-3,
        betas: Tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        foreach: Optional[bool] = None,
        capturable: bool = False,
        differentiable: bool = False,
        fused: Optional[bool] = None,
        exp_avg_format: Union[str, StateFormat] = StateFormat.INT8,
        exp_avg_sq_format: Union[str, StateFormat] = StateFormat.LOG16,
        block_size: int = 64,
    ):
        defaults = dict(
            lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
            maximize=maximize, foreach=foreach, capturable=capturable,
            differentiable=differentiable, fused=fused, decoupled_weight_decay=True,
            exp_avg_format=exp_avg_format,
            exp_avg_sq_format=exp_avg_sq_format, block_size=block_size,
        )
        super().__init__(params, defaults)

    # -- options ------------------------------------------------------------------------------

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        super().add_param_group(param_group)
        _check_group(self.param_groups[-1])

    def __setstate__(self, state: Dict[str, Any]) -> None:
        super().__setstate__(state)
        for group in self.param_groups:
            for key, value in self.defaults.items():
                group.setdefault(key, value)
            _check_group(group)

    # -- the step -----------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure=None):
        """One AdamW step for every parameter with a gradient; returns ``closure()``'s loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    _init_state(p, state, group)
                _update(p, p.grad, state, group)
        return loss

    # -- checkpoints: [Note: optimizer checkpoints] -------------------------------------------

    def state_dict(self) -> Dict[str, Any]:
        """torch.optim.AdamW's state dict: moments decoded to float32, shaped (and placed) like
        their parameters."""
        sd = super().state_dict()
        params = list(chain.from_iterable(g["params"] for g in self.param_groups))
        groups = [g for g in self.param_groups for _ in g["params"]]
        sd["state"] = {
            index: _export(params[index], state, groups[index])
            for index, state in sd["state"].items()
        }
        for group in sd["param_groups"]:
            for key in _STORAGE_KEYS:
                del group[key]
        return sd

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Load a state dict of this optimizer or of torch.optim.AdamW (also resharded by DCP),
        encoding its moments in this optimizer's formats."""
        saved_params = chain.from_iterable(g["params"] for g in state_dict["param_groups"])
        params = chain.from_iterable(g["params"] for g in self.param_groups)
        by_key = dict(zip(saved_params, params))
        moments = {key: {k: v for k, v in s.items() if k in _MOMENTS}
                   for key, s in state_dict["state"].items()}
        rest = {key: {k: v for k, v in s.items() if k not in _MOMENTS}
                for key, s in state_dict["state"].items()}
        kept = [{**saved, **{k: group[k] for k in _INSTANCE_KEYS}}
                for saved, group in zip(state_dict["param_groups"], self.param_groups)]
        if len(state_dict["param_groups"]) != len(self.param_groups):
            kept = state_dict["param_groups"]  # torch's error says what differs
        super().load_state_dict({**state_dict, "state": rest, "param_groups": kept})
        group_of = {p: g for g in self.param_groups for p in g["params"]}
        for key, saved in moments.items():
            p = by_key[key]
            state, group = self.state[p], group_of[p]
            missing = [k for k in _moment_names(group) if k not in saved]
            if missing:
                raise KeyError(f"optimizer state of parameter {key!r} has no {missing}; "
                               f"it has {sorted(state_dict['state'][key])}")
            _init_state(p, state, group, keep_step=True)
            for name in _moment_names(group):
                _import(p, key, name, saved[name], state, group)


def _check_group(group: Dict[str, Any]) -> None:
    """Clear errors for options this optimizer does not have, and normalized formats."""
    for flag, why in (
        ("foreach", "its step is one pass per parameter over the parameter's codes; batch the "
                    "steps with torch.compile(optimizer.step)"),
        ("fused", "it has no fused kernel; compile the step with torch.compile(optimizer.step)"),
        ("capturable", "its step keeps the step count on the CPU, as torch.optim.AdamW does by "
                       "default; compile it instead of capturing it in a CUDA graph"),
        ("differentiable", "its rounded states are not differentiable"),
    ):
        if group.get(flag):
            raise ValueError(f"f8dist.optim.AdamW does not support {flag}=True: {why}. "
                             f"Leave {flag} at its default.")
    if not group.get("decoupled_weight_decay", True):
        raise ValueError("f8dist.optim.AdamW decays weights decoupled from the gradient (AdamW); "
                         "for L2 regularization in the gradient (Adam) use torch.optim.Adam")
    lr = group["lr"]
    if isinstance(lr, torch.Tensor) and lr.numel() != 1:
        raise ValueError(f"lr as a tensor must hold one value, got shape {tuple(lr.shape)}")
    if not 0.0 <= float(lr):
        raise ValueError(f"invalid learning rate {float(lr)}")
    beta1, beta2 = group["betas"]
    for name, beta in (("betas[0]", beta1), ("betas[1]", beta2)):
        if not 0.0 <= float(beta) < 1.0:
            raise ValueError(f"invalid {name}: {float(beta)} (must be in [0, 1))")
    if not 0.0 <= group["eps"]:
        raise ValueError(f"invalid eps {group['eps']}")
    if not 0.0 <= group["weight_decay"]:
        raise ValueError(f"invalid weight_decay {group['weight_decay']}")
    for key in ("exp_avg_format", "exp_avg_sq_format"):
        try:
            group[key] = StateFormat(group[key])
        except ValueError:
            raise ValueError(f"{key} {group[key]!r} is not a state format; choose from "
                             f"{[f.value for f in StateFormat]}") from None
    if not group["exp_avg_format"].signed:
        raise ValueError(f"exp_avg_format {group['exp_avg_format']} holds only values >= 0; the "
                         "first moment is signed: choose e4m3, int8, e5m2, bf16 or fp32")
    group["block_size"] = check_block_size(group["block_size"])


def _moment_names(group) -> Tuple[str, ...]:
    return _MOMENTS if group["amsgrad"] else _MOMENTS[:2]


def _moment(state, group, name: str) -> QuantizedState:
    return QuantizedState(state[f"{name}_codes"], state[f"{name}_scales"],
                          group[_FORMAT_KEY[name]], group["block_size"])


def _init_state(p: torch.Tensor, state: dict, group: dict, keep_step: bool = False) -> None:
    """Zero moments in the group's formats on ``p``'s local shard, and step 0."""
    local = local_part(p)
    if local.is_complex():
        raise ValueError("f8dist.optim.AdamW does not support complex parameters; "
                         "use torch.optim.AdamW for them (a param group of its own optimizer)")
    if not keep_step:
        state["step"] = torch.tensor(0.0, dtype=torch.float32)
    zeros = torch.zeros(local.numel(), dtype=torch.float32, device=local.device)  # [n]
    for name in _moment_names(group):
        q = encode(zeros, group[_FORMAT_KEY[name]], group["block_size"])
        state[f"{name}_codes"], state[f"{name}_scales"] = q.codes, q.scales


def _local_grad(p: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    if grad.is_sparse:
        raise ValueError("f8dist.optim.AdamW does not support sparse gradients")
    if is_dtensor(grad) and grad.placements != p.placements:  # e.g. a Partial gradient
        grad = grad.redistribute(p.device_mesh, p.placements)
    return local_part(grad)


def _update(p: torch.Tensor, grad: torch.Tensor, state: dict, group: dict) -> None:
    """One AdamW step of ``p`` from ``grad`` ([Note: 8-bit AdamW on shards]), computed on
    [blocks, block_size] ([Note: whole blocks] in f8dist/optim/states.py)."""
    state["step"] += 1
    local = local_part(p)
    if local.numel() == 0:  # an empty shard: nothing to update, the step still counts
        return
    block = group["block_size"]
    g = blocks(_local_grad(p, grad).to(torch.float32), block)  # [blocks, B]
    if group["maximize"]:
        g = -g
    beta1, beta2 = (_value(b) for b in group["betas"])
    lr, step = _value(group["lr"]), _value(state["step"])

    exp_avg, exp_avg_sq = _moment(state, group, "exp_avg"), _moment(state, group, "exp_avg_sq")
    m = torch.lerp(decode(exp_avg), g, 1 - beta1)  # [blocks, B]
    v = decode(exp_avg_sq).mul_(beta2).addcmul_(g, g, value=1 - beta2)  # [blocks, B]
    encode_into(exp_avg, m)
    encode_into(exp_avg_sq, v)
    if group["amsgrad"]:
        max_sq = _moment(state, group, "max_exp_avg_sq")
        v = torch.maximum(decode(max_sq), v)  # [blocks, B]
        encode_into(max_sq, v)

    bias_correction1 = 1 - beta1 ** step
    bias_correction2_sqrt = _sqrt(1 - beta2 ** step)
    step_size = lr / bias_correction1
    # [Note: update precision] in the weight's dtype, float32 at least: float64 keeps its bits,
    # bf16 and fp16 are rounded once
    dtype = torch.promote_types(local.dtype, torch.float32)
    m, v = m.to(dtype), v.to(dtype)
    denom = (v.sqrt() / bias_correction2_sqrt).add_(group["eps"])  # [blocks, B]
    weight = blocks(local.to(dtype), block)  # [blocks, B]
    if group["weight_decay"] != 0:
        weight = weight * (1 - lr * group["weight_decay"])
    weight = weight + (-step_size * m) / denom  # [blocks, B]
    local.copy_(unblock(weight, local.numel()).view(local.shape))


def _export(p: torch.Tensor, state: dict, group: dict) -> Dict[str, Any]:
    """One parameter's entry of ``state_dict()``: step and decoded moments shaped like ``p``."""
    out = {"step": state["step"]}
    local = local_part(p)
    for name in _moment_names(group):
        moment = unblock(decode(_moment(state, group, name)), local.numel())  # [n]
        out[name] = like(p, moment.view(local.shape))
    return out


def _import(p, key, name: str, value: torch.Tensor, state: dict, group: dict) -> None:
    """Encode a loaded moment ``value`` (float, laid out like ``p``) into ``state``."""
    local, value = local_part(p), local_part(value)
    if value.numel() != local.numel():
        raise ValueError(
            f"optimizer state {name!r} of parameter {key!r} holds {value.numel()} elements on "
            f"this rank, the parameter's local shard {local.numel()}: a state dict saved on "
            "another sharding must be loaded through torch.distributed.checkpoint "
            "(get_optimizer_state_dict / set_optimizer_state_dict), which reshards it"
        )
    value = value.to(local.device, torch.float32)
    encode_into(_moment(state, group, name), blocks(value, group["block_size"]))
