"""Delayed scaling in the setups of a real training run, case by case: one row of figures each.

One process (activation checkpointing, gradient accumulation, eval forwards, bad batches, range
jumps, ``model.half()``), then the table of the out-of-range thresholds (docs/numerics.md)::

    PYTHONPATH=$PWD python scripts/delayed_cases.py

Two ranks (FSDP2 with the default config against one device on the global batch, a range jump
under TP + SP, and ranks that hold different delayed layers)::

    OMP_NUM_THREADS=1 PYTHONPATH=$PWD torchrun --standalone --nproc_per_node=2 scripts/delayed_cases.py

Every case trains a small float8 MLP (recipe "delayed") with SGD on gaussian data and compares it
with what the case should equal: the same run without checkpointing / accumulation / eval, the
high-precision computation with the same weights (SQNR in dB, ``f8dist.core.numerics.sqnr``), or one
device on the global batch. A case that raises prints the error instead of figures; "counters"
are ``f8dist.policy.delayed.delayed_scaling_counters`` summed over the layers and operands. The script
uses the public API only, so it also runs on a checkout from before the counters existed (they
print as n/a) to give the before figures.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import functools
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from f8dist import Float8Linear, Float8LinearConfig, convert_to_float8_training, float8_sac_context_fn
from f8dist import sync_float8_amax_and_scale_history as sync
from f8dist.core.numerics import sqnr

DELAYED = Float8LinearConfig.from_recipe_name("delayed")
STEPS = 20


def mlp(seed=0, bias=True):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 128, bias=bias), nn.ReLU(), nn.Linear(128, 64, bias=bias))


def float8_mlp(config=DELAYED, seed=0, bias=True):
    return convert_to_float8_training(mlp(seed, bias), config=config)


def data(steps=STEPS, batch=32, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 64, generator=g), torch.randn(batch, 64, generator=g))
            for _ in range(steps)]


def buffers(model):
    return {k: v.clone() for k, v in model.state_dict().items() if ".fp8_" in k}


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def high_precision(model, x):
    """``model(x)`` with every Float8Linear computed as nn.Linear (same weights)."""
    for layer in model:
        x = F.linear(x, layer.weight, layer.bias) if isinstance(layer, nn.Linear) else layer(x)
    return x


def counters(model) -> str:
    """The delayed-scaling counters, where the library has them."""
    fn = getattr(sys.modules["f8dist.policy.delayed"], "delayed_scaling_counters", None)
    if fn is None:
        return "n/a"
    total = {}
    for per_op in fn(model).values():
        for op, c in per_op.items():
            for k, v in c.items():
                total[k] = total.get(k, 0) + v
    return ", ".join(f"{k}={v}" for k, v in sorted(total.items())) or "0"


def error(e: BaseException) -> str:
    return f"raises {type(e).__name__}: {str(e).splitlines()[0][:90]}"


# -- activation checkpointing, gradient accumulation, eval ---------------------------------------

def run_steps(model, batches, forward=None, micro=1, eval_between=False):
    """Train; per step: output, gradients and the buffers after the sync."""
    forward = forward or model
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    outs, grads, hist = [], [], []
    for x, t in batches:
        opt.zero_grad()
        ys = []
        for xm, tm in zip(x.chunk(micro), t.chunk(micro)):
            y = forward(xm)
            (F.mse_loss(y, tm) / micro).backward()
            ys.append(y.detach())
        sync(model)
        outs.append(torch.cat(ys))
        grads.append([p.grad.clone() for p in model.parameters()])
        hist.append(buffers(model))
        opt.step()
        if eval_between:
            with torch.no_grad():
                model(x)
            with torch.inference_mode():
                model(x)
    return outs, grads, hist


def compare(ref, got) -> str:
    (o1, g1, h1), (o2, g2, h2) = ref, got
    outs = min(sqnr(a, b) for a, b in zip(o1, o2))
    grads = min(sqnr(a, b) for s1, s2 in zip(g1, g2) for a, b in zip(s1, s2))
    hist = all(same(a, b) for a, b in zip(h1, h2))
    return f"outputs {outs:.1f} dB, grads {grads:.1f} dB (inf = identical), histories equal: {hist}"


def case_checkpointing(compiled: bool):
    batches = data(6)
    rows = {}
    ref = run_steps(float8_mlp(), batches)
    for name, context in (("full", None), ("sac", float8_sac_context_fn)):
        model = float8_mlp()
        kwargs = {"use_reentrant": False}
        if context is not None:
            kwargs["context_fn"] = context
        fwd = functools.partial(checkpoint, model, **kwargs)
        if compiled:
            torch._dynamo.reset()
            fwd = torch.compile(fwd, backend="aot_eager", fullgraph=True)
            ref_c = float8_mlp()
            ref_run = run_steps(ref_c, batches, torch.compile(ref_c, backend="aot_eager", fullgraph=True))
        else:
            ref_run = ref
        try:
            got = run_steps(model, batches, fwd)
            rows[f"AC {name}{' compiled' if compiled else ''}"] = compare(ref_run, got)
        except Exception as e:  # noqa: BLE001 (the figure is the error)
            rows[f"AC {name}{' compiled' if compiled else ''}"] = error(e)
    return rows


def case_grad_accum():
    """From a trained state (histories full): the first-step casts of a micro-batch use its own
    amax, so a run from step 0 differs from one on the whole batch by its step-0 rounding."""
    batches = data(8)
    try:
        warm = float8_mlp()
        run_steps(warm, batches[:2])
        whole = run_steps(copy.deepcopy(warm), batches[2:])
        accum = run_steps(copy.deepcopy(warm), batches[2:], micro=2)
        exact = [same(a, b) for a, b in zip(whole[2], accum[2])]
        close = [all(torch.allclose(a[k], b[k], rtol=1e-5, atol=0) for k in a)
                 for a, b in zip(whole[2], accum[2])]
        g = [min(sqnr(a, b) for a, b in zip(s1, s2)) for s1, s2 in zip(whole[1], accum[1])]
        return {"grad accumulation (2 micro-batches vs whole batch, 6 steps after 2)": (
            f"histories bit-equal at {sum(exact)}/6 syncs (first: {exact[0]}), within 1e-5 at "
            f"{sum(close)}/6; grads {g[0]:.1f} dB at the first step, >= {min(g):.1f} dB")}
    except Exception as e:  # noqa: BLE001
        return {"grad accumulation (2 micro-batches vs whole batch, 6 steps after 2)": error(e)}


def case_eval():
    batches = data(6)
    try:
        ref, got = run_steps(float8_mlp(), batches), run_steps(float8_mlp(), batches, eval_between=True)
        return {"no_grad + inference_mode eval after every step": compare(ref, got)}
    except Exception as e:  # noqa: BLE001
        return {"no_grad + inference_mode eval after every step": error(e)}


# -- bad batches and range jumps -----------------------------------------------------------------

def guarded_run(make_batch, loss_scale=lambda step: 1.0, steps=STEPS, config=DELAYED, dtype=None):
    """Train with the guard a float8 or AMP loop has (skip the optimizer step on a non-finite
    loss, clip gradients); per step: output SQNR vs high precision with the same weights,
    gradient SQNR likewise, finiteness, whether every float8 weight gradient is exactly 0. No
    biases: the figures are those of the float8 gemms."""
    model = float8_mlp(config, bias=False)
    if dtype is not None:
        model = model.to(dtype)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    rows = []
    for step in range(steps):
        x, t = make_batch(step)
        if dtype is not None:
            x, t = x.to(dtype), t.to(dtype)
        ref = mlp(bias=False).to(x.dtype)
        for p_ref, p in zip(ref.parameters(), model.parameters()):
            p_ref.data.copy_(p.data)
        y_ref = ref(x)
        (F.mse_loss(y_ref.float(), t.float()) * loss_scale(step)).backward()
        opt.zero_grad()
        y = model(x)
        loss = F.mse_loss(y.float(), t.float()) * loss_scale(step)
        loss.backward()
        sync(model)
        f8_grads = [m.weight.grad for m in model if isinstance(m, Float8Linear)]
        rows.append(dict(
            finite=bool(torch.isfinite(y).all()),
            out_db=sqnr(y_ref.detach().float(), y.detach().float()),
            grad_db=min(sqnr(a.grad.float(), b.grad.float())
                        for a, b in zip(ref.parameters(), model.parameters())),
            zero_wgrad=all(not g.any() for g in f8_grads),
            scales_finite=all(bool(torch.isfinite(v).all())
                              for k, v in buffers(model).items() if "scale" in k),
            buffer_dtypes={str(v.dtype) for v in buffers(model).values()},
        ))
        if torch.isfinite(loss):
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
    return rows, model


def _steps(rows, key, start, value=True):
    return sum(1 for r in rows[start:] if r[key] == value)


def case_bad_values():
    clean = data(STEPS)
    rows, model = guarded_run(lambda step: clean[step])
    out = {"clean data (the baseline of the rows below)": (
        f"min output {min(r['out_db'] for r in rows):.1f} dB, "
        f"min grad {min(r['grad_db'] for r in rows):.1f} dB; "
        f"counters: {counters(model)}")}
    for name, bad in (("inf", float("inf")), ("nan", float("nan"))):
        def batch(step, bad=bad):
            x, t = clean[step]
            if step == 2:
                x = x.clone()
                x[0, 0] = bad
            return x, t
        try:
            rows, model = guarded_run(batch)
            after = rows[3:]
            out[f"one {name} in the input at step 2"] = (
                f"step 2 output finite: {rows[2]['finite']}; clean steps 3-{STEPS - 1}: "
                f"{_steps(rows, 'finite', 3, False)} non-finite, {_steps(rows, 'scales_finite', 3, False)} "
                f"with non-finite scales, min output {min(r['out_db'] for r in after):.1f} dB; "
                f"counters: {counters(model)}")
        except Exception as e:  # noqa: BLE001
            out[f"one {name} in the input at step 2"] = error(e)
    return out


def case_range_jumps():
    out = {}
    clean = data(STEPS)

    def drop(step):
        x, t = clean[step]
        return (x * 1e-6, t * 1e-6) if step >= 4 else (x, t)

    rows, model = guarded_run(drop)
    after = rows[4:]
    out["activations drop 1e6x at step 4"] = (
        f"steps 4-{STEPS - 1} below 10 dB: {sum(r['out_db'] < 10 for r in after)}, "
        f"min output {min(r['out_db'] for r in after):.1f} dB; counters: {counters(model)}")

    rows, model = guarded_run(lambda step: clean[step], loss_scale=lambda step: 1e12 if step == 4 else 1.0)
    after = rows[5:]
    out["loss x 1e12 at step 4"] = (
        f"spike step grads {rows[4]['grad_db']:.1f} dB; steps 5-{STEPS - 1} with every float8 weight "
        f"grad == 0: {_steps(rows, 'zero_wgrad', 5)}, min grad {min(r['grad_db'] for r in after):.1f} dB; "
        f"counters: {counters(model)}")
    return out


def case_rescaling_price():
    """[Note: the price of re-scaling]: what an out-of-range step costs each mode. Range jumps at
    step 4 (activations x 2**-k or x 4, the loss x 1e12), with re-scaling and without it
    (``rescale_out_of_range=False``: the history scale, the step counted, the history restarted
    by the sync): output SQNR of the jump step and the worst after it. Clean data gives both the
    same figures (bit-identical while in range)."""
    from f8dist.config import DelayedScalingConfig

    clean = data(STEPS)
    modes = {mode: DELAYED.replace(delayed_scaling_config=DelayedScalingConfig(rescale_out_of_range=r))
             for mode, r in (("re-scaled", True), ("counted", False))}
    jumps = {
        "activations x 2**-8 from step 4": (2.0**-8, 1.0),
        "activations x 2**-20 from step 4": (2.0**-20, 1.0),
        "activations x 4 from step 4": (4.0, 1.0),
        "loss x 1e12 at step 4": (1.0, 1e12),
    }
    out = {}
    for name, (factor, loss) in jumps.items():
        cells = []
        for mode, config in modes.items():
            def batch(step, factor=factor):
                x, t = clean[step]
                return (x * factor, t * factor) if step >= 4 and factor != 1.0 else (x, t)

            rows, model = guarded_run(batch, loss_scale=lambda step, loss=loss: loss if step == 4 else 1.0,
                                      config=config)
            key = "grad_db" if loss != 1.0 else "out_db"
            cells.append(f"{mode}: steps 4, 5: {rows[4][key]:.1f}, {rows[5][key]:.1f} dB; steps "
                         f"6-{STEPS - 1} >= {min(r[key] for r in rows[6:]):.1f} dB")
        what = "gradients" if loss != 1.0 else "output"
        out[f"{name} ({what})"] = "; ".join(cells)
    return out


def case_half():
    try:
        rows, _ = guarded_run(lambda step: data(6)[step], steps=6, dtype=torch.float16)
        return {"model.half() after conversion": (
            f"buffer dtypes {sorted(rows[-1]['buffer_dtypes'])}, steps with non-finite output "
            f"{_steps(rows, 'finite', 0, False)}/6, min grad {min(r['grad_db'] for r in rows):.1f} dB")}
    except Exception as e:  # noqa: BLE001
        return {"model.half() after conversion": error(e)}


# -- the out-of-range thresholds -----------------------------------------------------------------

def threshold_table() -> str:
    """Data cast with a delayed scale made for an amax ``2**-k`` times its own: SQNR and the
    share flushed to zero, and whether [Note: out of range] counts the cast (and, with
    ``rescale_out_of_range=True``, re-scales it). Gaussian data, and
    heavy-tailed data (Student's t, 3 degrees of freedom), whose bulk lies far below its max."""
    from f8dist.policy.delayed import in_range
    from f8dist.core.scaling import amax_to_scale, saturated_cast

    torch.manual_seed(0)
    gauss = torch.randn(4096, 256)
    heavy = torch.distributions.StudentT(3.0).sample((4096, 256))
    e4m3, e5m2 = torch.float8_e4m3fn, torch.float8_e5m2
    columns = (("gaussian", gauss, e4m3), ("gaussian", gauss, e5m2), ("t(3)", heavy, e4m3))
    lines = ["| current amax / history amax | " + " | ".join(
        f"{name} {str(d).replace('torch.float8_', '')}: SQNR dB, zeros" for name, _, d in columns) + " |",
        "|---|" + "---|" * len(columns)]
    for k in (3, 2, 1, 0, -2, -4, -5, -6, -8, -10, -12, -14, -16, -20, -24, -28, -30):
        cells = []
        for _, x, dtype in columns:
            amax = x.abs().max()
            scale = amax_to_scale(amax * 2.0**-k, dtype)  # the history saw 2**-k times this amax
            q = saturated_cast(x, scale, dtype).float() / scale
            landing = float(amax * scale)
            low, high = in_range(dtype)
            out = not low <= landing <= high
            cells.append(f"{sqnr(x, q):.1f}, {100 * float((q == 0).float().mean()):.0f} %"
                         + (" (out of range)" if out else ""))
        lines.append(f"| 2^{k} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# -- two ranks -----------------------------------------------------------------------------------

def case_data_parallel(rank, world):
    """FSDP2, different data per rank, against one device on the global batch (on the first step
    the ranks' micro-batches accumulated, each cast from its own amax: [Note: first step] in
    f8dist/policy/delayed/scale.py)."""
    from torch.distributed.fsdp import fully_shard

    out = {}
    for fp8_ag in (False, True):
        config = DELAYED.replace(enable_fsdp_float8_all_gather=fp8_ag)
        model, ref = float8_mlp(config), float8_mlp(config)
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        fully_shard(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.1 * world)
        opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(1)
        exact, close = [], []
        for step in range(6):
            x, t = torch.randn(16 * world, 64, generator=g), torch.randn(16 * world, 64, generator=g)
            parts = world if step == 0 else 1
            for xc, tc in zip(x.chunk(parts), t.chunk(parts)):
                (F.mse_loss(ref(xc), tc, reduction="sum") / t.numel()).backward()
            sync(ref)
            opt_ref.step()
            opt_ref.zero_grad()
            y = model(x.chunk(world)[rank])  # this rank's share of the global-batch loss
            (F.mse_loss(y, t.chunk(world)[rank], reduction="sum") / t.numel()).backward()
            sync(model)  # FSDP2 averages gradients: lr * world
            opt.step()
            opt.zero_grad()
            mine, theirs = buffers(model), buffers(ref)
            exact.append(same(mine, theirs))
            close.append(all(torch.allclose(mine[k], theirs[k], rtol=1e-5, atol=0) for k in theirs))
        dbs = [sqnr(p_ref.detach(), p.full_tensor().detach())
               for (n, p), p_ref in zip(model.named_parameters(), ref.parameters()) if n.endswith("weight")]
        name = f"FSDP2 2 ranks, default config{', float8 all-gather' if fp8_ag else ''}"
        out[f"{name}, 6 steps vs one device"] = (
            f"weights min {min(dbs):.1f} dB; histories bit-equal at {sum(exact)}/6 syncs "
            f"(first: {exact[0]}), within 1e-5 at {sum(close)}/6")
    return out


def case_tp_drop(rank, world):
    """TP + SP with the float8 styles (a SwiGLU FFN behind a shared sequence-parallel input, then
    a column-wise projection): activations 1e6x smaller from step 3; output SQNR per step against
    the high-precision model with the same weights, without re-scaling (the default) and with."""
    from f8dist.config import DelayedScalingConfig

    out = {}
    for mode, rescale in (("default, no re-scaling", False), ("rescale_out_of_range=True", True)):
        config = DELAYED.replace(delayed_scaling_config=DelayedScalingConfig(rescale_out_of_range=rescale))
        out[f"TP + SP 2 ranks, activations drop 1e6x at step 3 ({mode})"] = _tp_drop(rank, world, config)
    return out


def _tp_drop(rank, world, config) -> str:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import parallelize_module

    from f8dist.models.llama import FeedForward
    from f8dist.parallel.tp import Float8ColwiseParallel, Float8RowwiseParallel, PrepareFloat8ModuleInput

    torch.manual_seed(0)
    plain = nn.Sequential(FeedForward(64, 128), nn.Linear(64, 64, bias=False))
    model = convert_to_float8_training(copy.deepcopy(plain), config=config)
    parallelize_module(model, init_device_mesh("cpu", (world,)), {
        "0": PrepareFloat8ModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                      fwd_config_submodule_fqn="w1"),
        "0.w1": Float8ColwiseParallel(), "0.w3": Float8ColwiseParallel(),
        "0.w2": Float8RowwiseParallel(output_layouts=Shard(1)),
        "1": Float8ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    })
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(1)
    seq = slice(rank * 16 // world, (rank + 1) * 16 // world)
    dbs = []
    for step in range(8):
        x, t = torch.randn(2, 16, 64, generator=g), torch.randn(2, 16, 64, generator=g)
        if step >= 3:
            x, t = x * 1e-6, t * 1e-6
        plain.load_state_dict({k: v.full_tensor() if hasattr(v, "full_tensor") else v
                               for k, v in model.state_dict().items() if ".fp8_" not in k})
        with torch.no_grad():
            y_hp = plain(x)
        y = model(x[:, seq])
        F.mse_loss(y, t).backward()
        sync(model)
        opt.step()
        opt.zero_grad()
        dbs.append(sqnr(y_hp, y.detach()))
    return f"output dB per step {', '.join(f'{d:.1f}' for d in dbs)}; counters: {counters(model)}"


def case_layer_mismatch(rank, world):
    """Rank 0 holds two delayed layers, the others one (as pipeline stages would), on the group
    of all ranks: the first step, and (after a first step on one group per rank) the sync."""
    import torch.distributed as dist

    def model_of():
        return float8_mlp() if rank == 0 else convert_to_float8_training(
            nn.Sequential(nn.Linear(64, 64)), config=DELAYED)

    def step(model):
        model(torch.randn(16, 64)).sum().backward()
        sync(model)

    out = {}
    try:
        step(model_of())
        out["different delayed layers per rank: first step"] = "returns without an error"
    except Exception as e:  # noqa: BLE001
        out["different delayed layers per rank: first step"] = error(e)
    model = model_of()
    set_group = getattr(sys.modules["f8dist.policy.delayed"], "set_amax_group", None)
    try:
        if set_group is not None:
            set_group(model, dist.new_subgroups(group_size=1)[0])
            step(model)  # the first step on each rank's own group
            set_group(model, None)
        step(model)
        out["different delayed layers per rank: sync"] = "returns without an error"
    except Exception as e:  # noqa: BLE001
        out["different delayed layers per rank: sync"] = error(e)
    return out


def main():
    argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    rows = {}
    if "RANK" in os.environ:
        import torch.distributed as dist

        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
        rank, world = dist.get_rank(), dist.get_world_size()
        rows.update(case_data_parallel(rank, world))
        rows.update(case_tp_drop(rank, world))
        rows.update(case_layer_mismatch(rank, world))
        if rank != 0:
            os._exit(0)
    else:
        rows.update(case_checkpointing(compiled=False))
        rows.update(case_checkpointing(compiled=True))
        rows.update(case_grad_accum())
        rows.update(case_eval())
        rows.update(case_bad_values())
        rows.update(case_range_jumps())
        rows.update(case_rescaling_price())
        rows.update(case_half())
    print("| case | figures |\n|---|---|")
    for case, figures in rows.items():
        print(f"| {case} | {figures} |", flush=True)
    if "RANK" not in os.environ and hasattr(sys.modules["f8dist.policy.delayed"], "in_range"):
        print("\n" + threshold_table())
    if "RANK" in os.environ:
        os._exit(0)


if __name__ == "__main__":
    main()
