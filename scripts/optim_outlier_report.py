"""What one huge gradient element does to the updates of its neighbours, with 8-bit states.

A gradient element ``G`` (1e20) makes its second moment ``(1 - beta2) G**2``, which decays by
``beta2`` a step; coded in blocks, the other elements of its block can fall below the format's
range and get updates close to 0 until it has decayed ([Note: outliers in the second moment] in
f8dist/optim/states.py). Each candidate takes the same gradients at the same weights as torch's
fp32 AdamW (as ``scripts/optim_states_report.py``'s tracking), so only the rounding of the states
differs; we compare the updates of the spiked element's neighbours with torch's::

    PYTHONPATH=$PWD python scripts/optim_outlier_report.py              # CPU, a few minutes
    PYTHONPATH=$PWD python scripts/optim_outlier_report.py --long-steps 0   # the training run only

Candidates: f8dist's AdamW with its default states (int8 / log16, blocks of 64), and
bitsandbytes' AdamW8bit (blockwise dynamic 8-bit states, blocks of 256) where it imports.

* training: the LLaMA of scripts/train.py (one process, fp32 weights), a spike of ``--spike`` on
  one (or two neighbouring) elements of one weight's gradient at step ``--spike-step``. Per
  window of steps after the spike: the norm of the neighbours' updates over torch's (1: as
  torch; 0: silenced), for the other elements of the spike's block of 64 and of its block of 256;
  and the same run without the spike, for each optimizer's ratio when nothing happens.
* long: one vector of gaussian gradients (``--grad-std``), constant lr, the spike at step 10; the
  step after the spike from which the neighbours' updates stay within 2x of torch's (norm
  ratio in [0.5, 2] for 100 steps), up to ``--long-steps``.
"""

from __future__ import annotations

import argparse
import os
import sys
from types import SimpleNamespace

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from optim_states_report import add_model_args, build, loss_of  # noqa: E402

from f8dist.optim import AdamW  # noqa: E402

try:
    import bitsandbytes
except ImportError:  # [Note: bnb] pip install bitsandbytes (recent versions run on the CPU)
    bitsandbytes = None


def optimizers(params, opts):
    """name -> optimizer over ``params`` (each its own copy), torch's fp32 AdamW first."""
    hyper = dict(lr=opts.lr, betas=(0.9, opts.beta2), eps=1e-8, weight_decay=0.1)
    out = {"torch AdamW fp32": torch.optim.AdamW(params(), foreach=False, **hyper),
           "f8dist int8/log16": AdamW(params(), **hyper)}
    if bitsandbytes is not None:
        out[f"bnb {bitsandbytes.__version__} AdamW8bit"] = bitsandbytes.optim.AdamW8bit(
            params(), min_8bit_size=0, **hyper)
    return out


def neighbours(index: int, spikes: int, numel: int, block: int) -> torch.Tensor:
    """Indices of the other elements of the block of ``block`` holding the spike."""
    start = index // block * block
    idx = torch.arange(start, min(start + block, numel))
    return idx[(idx < index) | (idx >= index + spikes)]


def tracked_steps(opts, spikes: int, make_weights, grad_at, steps, on_step):
    """Every step, torch's AdamW moves the weights; every candidate takes the same gradient at
    the same weights; ``on_step(step, {name: update of the spiked tensor})``."""
    ref_weights = make_weights()
    opt = optimizers(lambda: [w.detach().clone() for w in ref_weights], opts)
    names = list(opt)
    weights = {name: o.param_groups[0]["params"] for name, o in opt.items()}
    for step in range(1, steps + 1):
        grads, which = grad_at(step, weights[names[0]])
        if step == opts.spike_step and spikes:
            grads[which].view(-1)[opts.index:opts.index + spikes] = opts.spike
        before = [w.detach().clone() for w in weights[names[0]]]
        updates = {}
        for name in names:
            for w, b, g in zip(weights[name], before, grads):
                w.data.copy_(b)
                w.grad = g.clone()
            opt[name].step()
            updates[name] = (weights[name][which] - before[which]).reshape(-1)
        on_step(step, updates)


def ratio(update, ref, idx) -> float:
    return (update[idx].norm() / ref[idx].norm()).item()


def training_run(opts, spikes: int):
    model, batches = build(opts)
    params = list(model.parameters())
    names = [n for n, _ in model.named_parameters()]
    which = next(i for i, p in enumerate(params) if p.dim() == 2 and "layers" in names[i])

    def make_weights():
        return [torch.nn.Parameter(p.detach().clone()) for p in params]

    def grad_at(step, weights):  # the reference's weights: load them, take the gradient
        with torch.no_grad():
            for p, w in zip(params, weights):
                p.copy_(w)
        model.zero_grad()
        loss_of(model, next(batches)).backward()
        return [p.grad.detach().clone() for p in params], which

    last = opts.steps - opts.spike_step
    windows = [(lo, min(hi, last)) for lo, hi in ((1, 10), (11, 100), (101, last)) if lo <= last]
    numel = params[which].numel()
    groups = {b: neighbours(opts.index, spikes, numel, b) for b in (64, 256)}
    sums = {}

    def on_step(step, updates):
        after = step - opts.spike_step
        ref = updates["torch AdamW fp32"]
        for lo, hi in windows:
            if lo <= after <= hi:
                for name, u in updates.items():
                    for b, idx in groups.items():
                        sums.setdefault((name, lo, hi, b), []).append(ratio(u, ref, idx))

    tracked_steps(opts, spikes, make_weights, grad_at, opts.steps, on_step)
    return names[which], tuple(params[which].shape), windows, sums


def long_run(opts, spikes: int):
    n = 1024
    gen = torch.Generator().manual_seed(opts.seed)
    spike_opts = SimpleNamespace(**{**vars(opts), "spike_step": 10, "index": 300})

    def make_weights():
        return [torch.nn.Parameter(torch.randn(n, generator=gen))]

    def grad_at(step, weights):
        return [torch.randn(n, generator=gen) * opts.grad_std], 0

    idx = neighbours(spike_opts.index, spikes, n, 64)
    good_since, recovered = {}, {}

    def on_step(step, updates):
        if step <= spike_opts.spike_step:
            return
        ref = updates["torch AdamW fp32"]
        for name, u in updates.items():
            if name in recovered:
                continue
            if 0.5 <= ratio(u, ref, idx) <= 2:
                since = good_since.setdefault(name, step)
                if step - since >= 100:
                    recovered[name] = since - spike_opts.spike_step
            else:
                good_since.pop(name, None)

    class Done(Exception):
        pass

    def on_step_until_all(step, updates):
        on_step(step, updates)
        if len(recovered) == len(updates):
            raise Done

    try:
        tracked_steps(spike_opts, spikes, make_weights, grad_at, opts.long_steps, on_step_until_all)
    except Done:
        pass
    return recovered


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--beta2", type=float, default=0.999)
    p.add_argument("--spike", type=float, default=1e20)
    p.add_argument("--spike-step", type=int, default=50)
    p.add_argument("--index", type=int, default=300, help="the spiked element (flat index)")
    p.add_argument("--long-steps", type=int, default=100_000)
    p.add_argument("--grad-std", type=float, default=1e-3)
    add_model_args(p)
    opts = p.parse_args()
    torch.manual_seed(opts.seed)
    bnb = "not installed" if bitsandbytes is None else bitsandbytes.__version__
    print(f"# torch {torch.__version__}, bitsandbytes {bnb}; lr {opts.lr} (constant), betas "
          f"(0.9, {opts.beta2}), weight_decay 0.1; a gradient element of {opts.spike:g} at one "
          "step (two neighbouring elements: 'x2')")
    for spikes in (0, 1, 2):  # 0: the same run without the spike, each optimizer's baseline
        name, shape, windows, sums = training_run(opts, spikes)
        if spikes == 0:
            print(f"\n## training: LLaMA dim={opts.dim} layers={opts.n_layers}, "
                  f"{opts.steps} steps, the spike at step {opts.spike_step} on {name} "
                  f"{list(shape)} element {opts.index}; neighbours' update norm / torch's, per "
                  "window of steps after the spike (block of 64 | block of 256)")
            print(f"{'optimizer':32}" + "".join(f"{f'{lo}-{hi}':>16}" for lo, hi in windows))
        for opt_name in dict.fromkeys(k[0] for k in sums):
            cells = []
            for lo, hi in windows:
                r64, r256 = (sum(v) / len(v) for v in
                             (sums[(opt_name, lo, hi, 64)], sums[(opt_name, lo, hi, 256)]))
                cells.append(f"{r64:7.3f} |{r256:6.3f}")
            label = opt_name + {0: " no spike", 1: "", 2: " x2"}[spikes]
            print(f"{label:32}" + "".join(f"{c:>16}" for c in cells))
    if opts.long_steps:
        print(f"\n## long: 1024 gaussian gradients (std {opts.grad_std:g}), the spike at step 10; "
              "steps until the other 63 elements of its block of 64 have updates within 2x of "
              f"torch's (norm ratio in [0.5, 2] for 100 steps), up to {opts.long_steps}")
        for spikes in (1, 2):
            recovered = long_run(opts, spikes)
            for opt_name in optimizers(lambda: [torch.zeros(1, requires_grad=True)], opts):
                steps = recovered.get(opt_name)
                label = opt_name + (" x2" if spikes == 2 else "")
                print(f"{label:32}{steps if steps is not None else f'> {opts.long_steps}':>10}")


if __name__ == "__main__":
    main()
