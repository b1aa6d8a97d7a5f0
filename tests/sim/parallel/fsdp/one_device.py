"""The one-device reference of FSDP2 data-parallel training on simulated ranks."""

from typing import Callable, Dict, List, Tuple

import torch

from f8dist.core.cast import StochasticRounding, stochastic_rounding


def one_device_steps(ref: torch.nn.Module, batch: Callable[[int, int], torch.Tensor], world: int,
                     steps: int) -> Tuple[List[List[torch.Tensor]], List[Dict[str, torch.Tensor]]]:
    """``ref`` trained as ``world`` ranks train its copies: each step one device runs every
    rank's ``batch(step, rank)`` (with that rank's stochastic rounding draws, from its stream
    ``rank``: [Note: the stochastic rounding key] in f8dist/core/cast.py) and sums the gradients in rank order (the
    threaded group's reduce-scatter order), then divides by ``world``, as FSDP2 does, then AdamW
    (lr 1e-2) steps. Returns each step's outputs per rank and gradients by parameter name."""
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    outs, grads = [], []
    draws = [StochasticRounding(stream=rank).state_dict() for rank in range(world)]  # as each starts
    for step in range(steps):
        outs.append([])
        summed = {}
        for rank in range(world):
            stochastic_rounding.load_state_dict(draws[rank])
            y = ref(batch(step, rank))
            y.pow(2).mean().backward()
            draws[rank] = stochastic_rounding.state_dict()
            outs[step].append(y.detach())
            for n, p in ref.named_parameters():
                summed[n] = p.grad.clone() if n not in summed else summed[n].add_(p.grad)
            ref.zero_grad()
        grads.append({n: g / world for n, g in summed.items()})
        for n, p in ref.named_parameters():
            p.grad = grads[step][n].clone()
        opt.step()
        opt.zero_grad()
    return outs, grads
