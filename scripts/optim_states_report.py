"""Which formats should AdamW's moments be kept in? Each choice of f8dist.optim.AdamW measured
against torch.optim.AdamW in fp32, on the LLaMA of scripts/train.py (one process, fp32 weights)::

    PYTHONPATH=. python scripts/optim_states_report.py                   # CPU, ~7 min on 2 cores
    PYTHONPATH=. python scripts/optim_states_report.py --steps 20 --skip-training --block-sizes 64
    PYTHONPATH=. python scripts/optim_states_report.py --steps 300 --beta2 0.999

Three tables (docs/optim.md holds a run of them):

* tracking: torch's fp32 AdamW trains the model; every step, each candidate takes the same
  gradients from the same weights (its own moments, rounded as its formats say) and its update
  is compared with fp32 AdamW's: SQNR in dB (the mean over steps and the worst step), and the
  share of elements whose update is more than 2x off or of the other sign. Only the rounding
  of the states differs, step after step, so it accumulates as it would in training.
* training: each candidate trains the model on its own; final loss (mean of the last 10 steps)
  against fp32 AdamW's on the same batches.
* block size: the chosen formats, and e4m3 first moments with the chosen second moments, with
  other block sizes (tracking only).
* checkpoint: what ``state_dict()`` allocates (decoded moments, laid out like the parameters)
  while the caller holds it, and its peak, against the optimizer's own state
  (``f8dist.testing.LiveBytes`` counts the storages).

Bytes per parameter: the optimizer's state (codes, block scales, the step) over the parameter count.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
from types import SimpleNamespace
from typing import Dict, List, Tuple

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train import lr_at  # noqa: E402  (scripts/train.py: warmup, then cosine to 10 %)

from f8dist.models import ModelArgs, Transformer  # noqa: E402
from f8dist.models.data import VOCAB_SIZE, ByteBatches  # noqa: E402
from f8dist.optim import AdamW  # noqa: E402
from f8dist.testing import LiveBytes  # noqa: E402

# (exp_avg format, exp_avg_sq format): the candidates
CANDIDATES = [
    ("fp32", "fp32"),  # f8dist's step in full precision: must equal torch's
    ("bf16", "bf16"),
    ("e4m3", "bf16"),
    ("bf16", "sqrt_e4m3"),
    ("bf16", "log8"),
    ("bf16", "log16"),
    ("e4m3", "log8"),
    ("e4m3", "log16"),
    ("int8", "log16"),
    ("e4m3", "e4m3"),
    ("e4m3", "e5m2"),
    ("e4m3", "sqrt_e4m3"),
    ("int8", "sqrt_e4m3"),
    ("e5m2", "sqrt_e4m3"),
]


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of every tensor in the optimizer's state (local shards)."""
    return sum(
        t.numel() * t.element_size()
        for state in optimizer.state.values() for t in state.values() if isinstance(t, torch.Tensor)
    )


def sqnr(ref: torch.Tensor, x: torch.Tensor) -> float:
    err = (ref - x).norm()
    return float("inf") if err == 0 else float(20 * torch.log10(ref.norm() / err))


def build(opts) -> Tuple[Transformer, ByteBatches]:
    args = ModelArgs(dim=opts.dim, n_layers=opts.n_layers, n_heads=opts.n_heads,
                     vocab_size=VOCAB_SIZE, max_seq_len=opts.seq_len)
    model = Transformer(args)
    model.init_weights(seed=opts.seed)
    batches = ByteBatches(seq_len=opts.seq_len, batch_size=opts.batch_size, seed=opts.seed)
    return model, batches


def loss_of(model, batch) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten(0, 1))


def make_optimizer(params, fmt, opts, block_size=None):
    hyper = dict(lr=opts.lr, betas=(0.9, opts.beta2), weight_decay=0.1)
    if fmt is None:
        return torch.optim.AdamW(params, foreach=False, **hyper)
    return AdamW(params, exp_avg_format=fmt[0], exp_avg_sq_format=fmt[1],
                 block_size=block_size or opts.block_size, **hyper)


def set_lr(optimizer, step, schedule):
    for group in optimizer.param_groups:
        group["lr"] = lr_at(step, schedule)


def tracking(opts, candidates: List[Tuple[Tuple[str, str], int]]) -> Dict:
    """Per candidate: update SQNR vs fp32 AdamW over the steps, and the share of bad elements."""
    model, batches = build(opts)
    schedule = SimpleNamespace(lr=opts.lr, warmup_steps=opts.warmup, steps=opts.steps)
    params = list(model.parameters())
    reference = make_optimizer(params, None, opts)
    shadows = []  # (candidate, its own copy of the weights, its optimizer)
    for fmt, block in candidates:
        weights = [p.detach().clone() for p in params]
        shadows.append(((fmt, block), weights, make_optimizer(weights, fmt, opts, block)))
    results = {c: {"sqnr": [], "bad": []} for c, _, _ in shadows}
    for step in range(1, opts.steps + 1):
        model.zero_grad()
        loss_of(model, next(batches)).backward()
        before = [p.detach().clone() for p in params]
        set_lr(reference, step, schedule)
        reference.step()
        ref_update = torch.cat([(p.detach() - b).reshape(-1) for p, b in zip(params, before)])
        for cand, weights, optimizer in shadows:
            for w, b, p in zip(weights, before, params):
                w.copy_(b)
                w.grad = p.grad
            set_lr(optimizer, step, schedule)
            optimizer.step()
            update = torch.cat([(w - b).reshape(-1) for w, b in zip(weights, before)])
            bad = ((update - ref_update).abs() > ref_update.abs()) | (update * ref_update < 0)
            results[cand]["sqnr"].append(sqnr(ref_update, update))
            results[cand]["bad"].append(bad.float().mean().item())
    n_params = sum(p.numel() for p in params)
    out = {}
    for cand, _, optimizer in shadows:
        r = results[cand]
        late = r["sqnr"][opts.warmup:]  # after warmup: the states have a history
        out[cand] = {
            "mean_sqnr": sum(late) / len(late), "min_sqnr": min(late),
            "bad": sum(r["bad"][opts.warmup:]) / len(late),
            "bytes_per_param": state_bytes(optimizer) / n_params,
        }
    return out


def training(opts, fmt) -> float:
    """Final loss (mean of the last 10 steps) of a run with these formats (None: torch fp32)."""
    torch.manual_seed(opts.seed)
    model, batches = build(opts)
    schedule = SimpleNamespace(lr=opts.lr, warmup_steps=opts.warmup, steps=opts.steps)
    optimizer = make_optimizer(model.parameters(), fmt, opts)
    losses = []
    for step in range(1, opts.steps + 1):
        optimizer.zero_grad()
        loss = loss_of(model, next(batches))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        set_lr(optimizer, step, schedule)
        optimizer.step()
        losses.append(loss.item())
    tail = losses[-10:]
    return sum(tail) / len(tail)


def checkpoint_bytes(opts) -> Dict[str, int]:
    """Bytes of the optimizer's state, and what its state_dict() holds and peaks at."""
    model, batches = build(opts)
    optimizer = AdamW(model.parameters(), block_size=opts.block_size)
    loss_of(model, next(batches)).backward()
    optimizer.step()
    with LiveBytes() as live:
        sd = optimizer.state_dict()
        held = live.current
    del sd
    return {"state": state_bytes(optimizer), "held": held, "peak": live.peak,
            "params": sum(p.numel() for p in model.parameters())}


def name(fmt) -> str:
    return "torch AdamW fp32" if fmt is None else f"{fmt[0]} / {fmt[1]}"



def add_model_args(p: argparse.ArgumentParser) -> None:
    """The small LLaMA the reports train (:func:`build`) and its batches."""
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--n-layers", type=int, default=2)
    p.add_argument("--n-heads", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)

def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--beta2", type=float, default=0.95)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--block-sizes", default="32,64,128,256,512")
    add_model_args(p)
    p.add_argument("--skip-training", action="store_true")
    opts = p.parse_args()
    torch.manual_seed(opts.seed)
    n_params = sum(t.numel() for t in build(opts)[0].parameters())
    print(f"# torch {torch.__version__}; LLaMA dim={opts.dim} layers={opts.n_layers} "
          f"({n_params:,} params, fp32), batch {opts.batch_size}x{opts.seq_len}, {opts.steps} "
          f"steps, lr {opts.lr}, betas (0.9, {opts.beta2}), weight_decay 0.1, block "
          f"{opts.block_size}; the reference: torch.optim.AdamW (fp32 states, 8 bytes/param)\n")

    track = tracking(opts, [(c, opts.block_size) for c in CANDIDATES])
    print("## tracking: update vs fp32 AdamW on the same weights and gradients, every step")
    print(f"{'exp_avg / exp_avg_sq':24} {'bytes/param':>11} {'mean SQNR dB':>12} "
          f"{'worst step dB':>13} {'elements >2x off or flipped':>28}")
    for (fmt, _), r in track.items():
        print(f"{name(fmt):24} {r['bytes_per_param']:11.3f} {r['mean_sqnr']:12.2f} "
              f"{r['min_sqnr']:13.2f} {100 * r['bad']:27.3f}%")

    if not opts.skip_training:
        print("\n## training: final loss (mean of the last 10 steps), each on its own trajectory")
        base = training(opts, None)
        print(f"{'exp_avg / exp_avg_sq':24} {'final loss':>10} {'vs fp32 AdamW':>13}")
        print(f"{name(None):24} {base:10.4f}")
        for fmt in CANDIDATES:
            loss = training(opts, fmt)
            print(f"{name(fmt):24} {loss:10.4f} {100 * (loss - base) / base:+12.2f}%")

    default = AdamW([torch.zeros(1)]).defaults
    chosen = (str(default["exp_avg_format"]), str(default["exp_avg_sq_format"]))
    sizes = [int(b) for b in opts.block_sizes.split(",") if b]
    pairs = [chosen, ("e4m3", chosen[1])]
    track = tracking(opts, [(fmt, b) for fmt in pairs for b in sizes])
    print(f"\n## block size (the defaults: {name(chosen)}, block {default['block_size']})")
    print(f"{'exp_avg / exp_avg_sq':24} {'block size':>10} {'bytes/param':>11} "
          f"{'mean SQNR dB':>12} {'worst step dB':>13}")
    for (fmt, block), r in track.items():
        print(f"{name(fmt):24} {block:10d} {r['bytes_per_param']:11.3f} {r['mean_sqnr']:12.2f} "
              f"{r['min_sqnr']:13.2f}")

    c = checkpoint_bytes(opts)
    n = c["params"]
    print(f"\n## checkpoint: state_dict() of {name(chosen)}, bytes per parameter")
    print(f"optimizer state {c['state'] / n:.3f}; state_dict() holds {c['held'] / n:.3f} more "
          f"while the caller keeps it (peak during the call {c['peak'] / n:.3f})")


if __name__ == "__main__":
    main()
