"""torchrun program: FSDP2 float8 all-gather against a one-device run of the same float8 model.

Scenarios (comma-separated ``--scenarios``):

* ``parity``: same data on every rank; forward outputs and every gradient bit-identical to one
  device over several AdamW steps, with and without float8 all-gather, precomputing scales between
  steps; counts the collectives of precompute and of the next forward.
* ``bytes``: forward all-gather bytes with float8 all-gather vs bf16 all-gather under
  MixedPrecisionPolicy(param_dtype=bf16).
* ``dcp``: torch.distributed.checkpoint round trip: FSDP2 float8 -> plain model -> FSDP2 float8.

The model mixes float8 linears with an embedding, a LayerNorm and biases in one fully_shard unit;
its head has 4 output rows, so on 3 ranks one shard of it is empty (and 128 rows split 43/43/42).
"""

import copy

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from f8dist import Float8LinearConfig, convert_to_float8_training
from f8dist.testing import count_collectives
from f8dist.parallel.fsdp import Float8AllGatherWeight, precompute_float8_dynamic_scale_for_fsdp
from tests.distributed.common import assert_equal, main, run_scenarios, scenario_args, sqnr

DIM, HIDDEN, VOCAB, HEAD = 32, 128, 16, 4
STEPS = 3


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.norm = nn.LayerNorm(DIM)
        self.fc1 = nn.Linear(DIM, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, DIM)
        self.head = nn.Linear(DIM, HEAD)

    def forward(self, tokens):
        h = self.norm(self.emb(tokens))  # [B, S, DIM]
        h = h + self.fc2(torch.relu(self.fc1(h)))  # [B, S, DIM]
        return self.head(h)  # [B, S, HEAD]


def config(fp8_all_gather: bool) -> Float8LinearConfig:
    return Float8LinearConfig(enable_fsdp_float8_all_gather=fp8_all_gather, pad_inner_dim=True)


def make_model(device, seed, fp8_all_gather):
    torch.manual_seed(seed)
    model = Net().to(device)
    return convert_to_float8_training(model, config=config(fp8_all_gather))


def shard(model, mp_policy=None):
    kw = {} if mp_policy is None else {"mp_policy": mp_policy}
    fully_shard(model.fc1, **kw)
    fully_shard(model.fc2, **kw)
    fully_shard(model, **kw)  # root unit: emb, norm, head (float8) and its bias together
    # sum-reduce, then divide by the world size: the one-device reference does the same arithmetic
    model.set_force_sum_reduction_for_comms(True)
    return model


def batch(device, step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, VOCAB, (2, 8), generator=g).to(device)  # [B, S], same on every rank


def full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def parity(device, world, fp8_all_gather, out):
    ref = make_model(device, 0, fp8_all_gather)
    model = shard(copy.deepcopy(ref))
    n_f8 = sum(isinstance(p.to_local(), Float8AllGatherWeight) for p in model.parameters())
    if fp8_all_gather and n_f8 != 3:
        raise AssertionError(f"expected 3 float8 all-gather weights, found {n_f8}")
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tag = "fp8_ag" if fp8_all_gather else "hp_ag"
    for name in ("fc1", "head"):  # uneven (and, on 3 ranks, empty) shards
        rows = [None] * world
        dist.all_gather_object(rows, getattr(model, name).weight.to_local().shape[0])
        out[f"{name}_shard_rows"] = rows
    forward_all_reduces = []
    for step in range(STEPS):
        x = batch(device, step)
        with count_collectives() as fwd:
            y = model(x)
        fwd.expect("all_gather")
        forward_all_reduces.append(fwd["all_reduce"].calls)
        y_ref = ref(x)
        assert_equal(f"{tag} step {step} output", y_ref, y)
        y.float().pow(2).mean().backward()
        y_ref.float().pow(2).mean().backward()
        for (name, p_ref), p in zip(ref.named_parameters(), model.parameters()):
            # FSDP2 sums the identical grads of all ranks, then divides by the world size
            p_ref.grad.mul_(world).div_(world)
            assert_equal(f"{tag} step {step} grad {name}", p_ref.grad, full(p.grad))
        opt_ref.step()
        opt.step()
        opt_ref.zero_grad()
        opt.zero_grad()
        if fp8_all_gather:
            with count_collectives() as pre:
                precompute_float8_dynamic_scale_for_fsdp(model)
            out[f"precompute_step{step}"] = pre.as_dict()
    for (name, p_ref), p in zip(ref.named_parameters(), model.parameters()):
        assert_equal(f"{tag} final param {name}", p_ref.detach(), full(p.detach()))
    out[f"{tag}_forward_all_reduces"] = forward_all_reduces


def all_gather_bytes(device, fp8_all_gather, x):
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = shard(make_model(device, 0, fp8_all_gather), mp)
    with count_collectives() as fwd:
        y = model(x)
    y.float().sum().backward()  # the backward runs too (float8 weight under bf16 params)
    return fwd.expect("all_gather").output_bytes, y.detach().float()


def bytes_ratio(device, out):
    x = batch(device, 0)
    fp8_bytes, y_fp8 = all_gather_bytes(device, True, x)
    bf16_bytes, y_bf16 = all_gather_bytes(device, False, x)
    out["bytes"] = {
        "fp8_all_gather_output_bytes": fp8_bytes,
        "bf16_all_gather_output_bytes": bf16_bytes,
        "ratio": fp8_bytes / bf16_bytes,
        "sqnr_fp8_vs_bf16_all_gather_db": sqnr(y_bf16, y_fp8),
    }


def dcp_round_trip(device, ckpt_dir, out):
    model = shard(make_model(device, 1, True))
    x = batch(device, 0)
    model(x).float().pow(2).mean().backward()
    torch.optim.AdamW(model.parameters(), lr=1e-2).step()
    saved = {k: full(v).clone() for k, v in model.state_dict().items()}
    dcp.save(model.state_dict(), checkpoint_id=f"{ckpt_dir}/fp8")
    meta = dcp.FileSystemReader(f"{ckpt_dir}/fp8").read_metadata().state_dict_metadata
    out["dcp_dtypes"] = sorted({str(m.properties.dtype) for m in meta.values()})
    out["dcp_keys"] = sorted(meta)

    # into the plain model (no float8, no FSDP) ...
    plain = Net().to(device)
    sd = plain.state_dict()
    dcp.load(sd, checkpoint_id=f"{ckpt_dir}/fp8")
    plain.load_state_dict(sd)
    for k, v in plain.state_dict().items():
        assert_equal(f"plain {k}", saved[k], v)

    # ... and back into a fresh FSDP2 float8 model
    with torch.no_grad():
        for p in plain.parameters():
            p.mul_(2)
    dcp.save(plain.state_dict(), checkpoint_id=f"{ckpt_dir}/plain")
    fresh = shard(make_model(device, 2, True))
    sd = fresh.state_dict()
    dcp.load(sd, checkpoint_id=f"{ckpt_dir}/plain")
    fresh.load_state_dict(sd)
    for k, v in fresh.state_dict().items():
        assert_equal(f"reloaded {k}", plain.state_dict()[k], full(v))
    if not isinstance(fresh.fc1.weight.to_local(), Float8AllGatherWeight):
        raise AssertionError("loading a checkpoint dropped the float8 all-gather weight")
    assert_equal("reloaded forward", plain_forward(plain, fresh, x)[0], plain_forward(plain, fresh, x)[1])


def plain_forward(plain, fresh, x):
    """The reloaded FSDP2 float8 model and a float8 copy of the plain model agree exactly."""
    ref = convert_to_float8_training(copy.deepcopy(plain), config=config(True))
    return ref(x), fresh(x)


def run(args):
    def table(rank, world, device, out):
        return {
            "parity": lambda: [parity(device, world, fp8, out) for fp8 in (True, False)],
            "bytes": lambda: bytes_ratio(device, out),
            "dcp": lambda: dcp_round_trip(device, args.ckpt_dir, out),
        }

    if "dcp" in args.scenarios.split(",") and not args.ckpt_dir:
        raise ValueError("the dcp scenario writes checkpoints: pass --ckpt-dir <a temporary dir>")
    run_scenarios(args, table)


def extra(parser):
    scenario_args(parser)
    parser.add_argument("--ckpt-dir", default=None, help="required by the dcp scenario")


if __name__ == "__main__":
    main(run, extra)
