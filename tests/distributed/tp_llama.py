"""TP+SP (1-D) and FSDP2 x TP (2-D) float8 LLaMA against a one-device run of the same float8 model.

Run on simulated ranks by tests/sim/parallel/tp/test_llama.py (tests/sim/programs.py), and on gloo by
tests/distributed/test_tp.py (tensorwise); by hand::

    torchrun --nproc_per_node=2 tests/distributed/tp_llama.py --recipes tensorwise --dp 1
    torchrun --nproc_per_node=4 tests/distributed/tp_llama.py --recipes tensorwise,rowwise --dp 2

Every rank builds the same float8 model and a reference copy. The parallel model is sharded with
the ready plan (f8dist/models/llama_tp.py) over tp (and FSDP2 over dp); each dp rank feeds its own batch.
The reference runs each dp rank's batch on one device. Compared (SQNR, fp32): the logits, the
gradient of the embedding output (the first activation gradient), and every weight gradient
(the reference's summed over the dp batches). Collectives are counted: the bytes of the forward
all-gathers (all of them sequence-parallel inputs) per local input element.

In 2-D the program also runs FSDP2's float8 all-gather of the weights (tensorwise), with and
without ``precompute_float8_dynamic_scale_for_fsdp``: every float8 weight's scale must equal the
one-device scale of the whole weight exactly (its amax reduced over dp AND tp, [Note: amax]), and
the forward all-reduces are counted (precompute must leave no weight amax all-reduce to them).
"""

from __future__ import annotations

import copy
import dataclasses

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from f8dist import Float8Linear, Float8LinearConfig, convert_to_float8_training
from f8dist.core import agreement
from f8dist.core.cast import cast_to_float8
from f8dist.testing import count_collectives
from f8dist.parallel.fsdp import Float8AllGatherWeight, precompute_float8_dynamic_scale_for_fsdp
from f8dist.models.llama import ModelArgs, Transformer
from f8dist.models import parallelize_llama
from f8dist.core.tensor import Float8Tensor
from f8dist.config import Gemm, Operand
from f8dist.parallel.tp.style import _CastGradToFloat8, cast_input
from tests.distributed.common import init, main, sqnr, write_result

BATCH, SEQ = 2, 16
ARGS = ModelArgs(dim=64, n_layers=2, n_heads=4, multiple_of=32, max_seq_len=SEQ)
FLOOR_DB = 120.0


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def add_wire_casts(model: Transformer) -> None:
    """Give a one-device model the float8 casts the TP plan makes for communication: the shared
    inputs of attention / feed_forward / output cast before their all-gather, the gradients of
    wo / w2 cast before theirs. With them the one-device model runs the same roundings as the
    parallel one, for recipes whose other-axis gemms re-scale communicated float8 tensors."""

    def cast_input(linear):
        spec = linear.specs[Gemm.OUTPUT, Operand.INPUT]
        return lambda mod, args: (cast_input(args[0], spec, [linear]), *args[1:])

    def cast_grad(mod, args, out):
        return _CastGradToFloat8.apply(out, mod)

    for block in model.layers.values():
        block.attention.register_forward_pre_hook(cast_input(block.attention.wq))
        block.feed_forward.register_forward_pre_hook(cast_input(block.feed_forward.w1))
        block.attention.wo.register_forward_hook(cast_grad)
        block.feed_forward.w2.register_forward_hook(cast_grad)
    model.output.register_forward_pre_hook(cast_input(model.output))


def shard_2d(model: Transformer, dp_mesh) -> None:
    """FSDP2 over dp on top of TP, as torchtitan applies it (blocks, then the root)."""
    from torch.distributed.fsdp import fully_shard

    for block in model.layers.values():
        fully_shard(block, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)


def run_model(model, tokens, grad_logits, kept=None):
    """Forward + backward; returns (logits, grad of the embedding output, forward counts,
    backward counts). ``kept``: a dict that gets ``float8_kept_bytes``, the bytes of the float8
    tensors the forward keeps for backward on this rank."""
    captured = {}

    def keep(mod, args, out):
        out.retain_grad()
        captured["h"] = out

    handle = model.tok_embeddings.register_forward_hook(keep)
    with count_collectives() as fwd:
        logits = model(tokens)
    if kept is not None:
        kept["float8_kept_bytes"] = float8_saved_bytes(logits)
    with count_collectives() as bwd:
        logits.backward(grad_logits)
    handle.remove()
    return logits, captured["h"].grad, fwd, bwd


def float8_saved_bytes(out: torch.Tensor) -> int:
    """Bytes of the float8 tensors (data and scales) autograd keeps for ``out``'s backward on this
    rank, each storage once: what [Note: the grad_weight operand of a gathered tensor] trades."""
    from f8dist.testing.memory import graph_saved_tensors, storages

    seen, total = set(), 0
    for t in graph_saved_tensors(out.grad_fn):
        local = t.to_local() if isinstance(t, DTensor) else t
        if isinstance(local, Float8Tensor):
            for st in storages(local):
                if st.data_ptr() not in seen:
                    seen.add(st.data_ptr())
                    total += st.nbytes()
    return total


def compare(
    args, mesh, recipe: str, wire_reference: bool, *,
    float8_all_gather: bool = False, precompute: bool = False, weight_amax_from_forward=True,
    seq: int = None, **config_changes,
) -> dict:
    """One float8 recipe: SQNRs against one device and the counted all-gather bytes.

    ``float8_all_gather`` (2-D only): FSDP2 all-gathers the weights in float8; ``precompute``
    computes their scales before the forward with ``precompute_float8_dynamic_scale_for_fsdp``.
    ``weight_amax_from_forward=False``: backward's weight casts compute their own amax.
    ``seq``: tokens per sequence (default SEQ, at most the model's ``max_seq_len``).
    ``config_changes``: Float8LinearConfig fields to set on the recipe's config.
    """
    seq_len = seq or SEQ
    dp, tp = mesh["dp"].size(), mesh["tp"].size()
    dp_rank, tp_rank = mesh["dp"].get_local_rank(), mesh["tp"].get_local_rank()
    device = mesh.device_type

    config = Float8LinearConfig.from_recipe_name(recipe).replace(**config_changes)
    if float8_all_gather:
        config = config.replace(enable_fsdp_float8_all_gather=True)
    with torch.device(device):
        model = Transformer(ARGS)
    model.init_weights(seed=0)
    convert_to_float8_training(model, config=config)
    if not weight_amax_from_forward:
        for m in model.modules():
            if isinstance(m, Float8Linear):
                m.specs = dataclasses.replace(m.specs, weight_amax_from_forward=False)
    reference = copy.deepcopy(model)
    if wire_reference:
        add_wire_casts(reference)
    # loss_parallel: the logits stay vocab-sharded, so the forward's only all-gathers are the
    # sequence-parallel inputs
    parallelize_llama(model, mesh["tp"], float8=not args.hp_tp, loss_parallel=True)
    if dp > 1:
        shard_2d(model, mesh["dp"])
    agreement.check_once(model)  # the one-time rank check, outside the counted steps

    # the global batch: dp_rank's slice goes to this rank's model
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, ARGS.vocab_size, (dp * BATCH, seq_len), generator=gen).to(device)
    grad_logits = torch.randn(dp * BATCH, seq_len, ARGS.vocab_size, generator=gen).to(device)
    mine = slice(dp_rank * BATCH, (dp_rank + 1) * BATCH)

    grad_logits_tp = distribute_tensor(grad_logits[mine], mesh["tp"], [Shard(-1)])
    pre = None
    if precompute:
        with count_collectives() as pre:
            precompute_float8_dynamic_scale_for_fsdp(model)
    weight_scales = capture_weight_scales(model) if float8_all_gather else None
    kept = {}
    logits, grad_h, fwd, bwd = run_model(model, tokens[mine], grad_logits_tp, kept)
    # the reference runs every dp rank's batch on its own (activations are scaled per batch,
    # [Note: amax]), accumulating weight gradients over them
    for d in range(dp):
        batch = slice(d * BATCH, (d + 1) * BATCH)
        ref = run_model(reference, tokens[batch], grad_logits[batch])
        if d == dp_rank:
            ref_logits, ref_grad_h = ref[0], ref[1]

    mine_seq = slice(tp_rank * seq_len // tp, (tp_rank + 1) * seq_len // tp)  # this rank's shard
    sqnrs = {
        "logits": sqnr(ref_logits.detach(), full(logits).detach()),
        "grad_input": sqnr(ref_grad_h[:, mine_seq], grad_h),
    }
    ref_params = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        # FSDP2 averages gradients over dp; the reference sums over the global batch (dp is a
        # power of 2, so the rescaling is exact)
        sqnrs[f"grad:{name}"] = sqnr(ref_params[name].grad, full(p.grad) * dp)

    if dp > 1:  # FSDP2's weight all-gathers share the counts: no SP byte figures in 2-D
        out = {
            "sqnr_db": sqnrs,
            "fwd_all_reduce_calls": fwd["all_reduce"].calls,  # none for block recipes
            "fwd_all_gather_calls": fwd.expect("all_gather").calls,
            "float8_linears": sum(isinstance(m, Float8Linear) for m in model.modules()),
        }
        if weight_scales is not None:
            out["weight_scales_equal_one_device"] = check_weight_scales(
                model, reference, weight_scales, precompute
            )
        if pre is not None:
            out["precompute_all_reduce_calls"] = pre.expect("all_reduce").calls
        return _worst_over_ranks(out)
    # forward all-gathers: one per sequence-parallel input (attention, feed_forward per layer,
    # output), each of a [BATCH, SEQ / tp, dim] shard
    shard = BATCH * (seq_len // tp) * ARGS.dim
    ag = fwd.expect("all_gather")
    # backward all-gathers: the gradients of wo / w2 outputs (float8) and of the embedding
    # output (plain RowwiseParallel: float32), each a [BATCH, SEQ / tp, dim] shard
    bag = bwd.expect("all_gather")
    out = {
        "sqnr_db": sqnrs,
        "fwd_all_gather_calls": ag.calls,
        "fwd_all_gather_bytes_per_element": ag.input_bytes / ((2 * ARGS.n_layers + 1) * shard),
        "bwd_all_gather_calls": bag.calls,
        "fwd_all_reduce_calls": fwd["all_reduce"].calls,  # none for block recipes
        "bwd_all_reduce_calls": bwd["all_reduce"].calls,
        "float8_linears": sum(isinstance(m, Float8Linear) for m in model.modules()),
        "bwd_all_gather_bytes_per_element": (bag.input_bytes - 4 * shard)
        / (2 * ARGS.n_layers * shard),
        "all_gather_bytes": ag.input_bytes + bag.input_bytes,  # forward and backward
        # float8 bytes kept for backward per element of the local sequence shards
        "float8_kept_bytes_per_element": kept["float8_kept_bytes"] / shard,
    }
    with torch.no_grad(), count_collectives() as evaluation:  # no grad_weight gemm to serve
        model(tokens[mine])
    out["no_grad_fwd_all_gather_bytes_per_element"] = (
        evaluation.expect("all_gather").input_bytes / ((2 * ARGS.n_layers + 1) * shard))
    return _worst_over_ranks(out)


def capture_weight_scales(model) -> dict:
    """Record, for every Float8Linear, the scale of the float8 weight FSDP2 all-gathered (the
    Float8Tensor inside the unsharded DTensor parameter) at its first forward."""
    scales = {}

    def keep(mod, args):
        local = mod.weight.to_local() if isinstance(mod.weight, DTensor) else mod.weight
        if not isinstance(local, Float8Tensor):
            raise AssertionError(f"{mod.fqn}: weight arrived as {type(local).__name__}, not float8")
        scales.setdefault(mod.fqn, local._scale.clone())

    for module in model.modules():
        if isinstance(module, Float8Linear):
            module.register_forward_pre_hook(keep)
    return scales


def check_weight_scales(model, reference, gathered: dict, precompute: bool) -> bool:
    """Every float8 weight's scale (all-gathered, and precomputed on the FSDP2 shard when
    ``precompute``) equals the one-device scale of the whole weight exactly. A weight amax
    reduced over dp only (each tp rank its own scale) fails this on every tp rank without the
    global max."""
    ref_modules = dict(reference.named_modules())
    checked = 0
    for name, module in model.named_modules():
        if not isinstance(module, Float8Linear):
            continue
        ref = ref_modules[name]
        weight = ref.weight._tensor if isinstance(ref.weight, Float8AllGatherWeight) else ref.weight
        spec = module.specs[Gemm.OUTPUT, Operand.WEIGHT]
        weight = weight.detach()
        if spec.blockwise:  # the gathered grid is the tp shard's; a tensorwise scale the weight's
            weight = _tp_shard(weight, model_weight_placements(module))
        expected = cast_to_float8(weight, spec)._scale
        found = {"all-gathered": gathered[module.fqn]}
        if precompute:
            found["precomputed"] = module.weight._local_tensor._precomputed[0]
        for what, scale in found.items():
            if not torch.equal(scale.float(), expected.float()):
                raise AssertionError(
                    f"{name}: {what} weight scale {scale.flatten()[:4].tolist()!r}... != one-device "
                    f"{expected.flatten()[:4].tolist()!r}..."
                )
        checked += 1
    if checked == 0:
        raise AssertionError("no Float8Linear weight scale was checked")
    return True


def model_weight_placements(module):
    """(tp mesh coordinate, tp placement) of a 2-D sharded module's weight."""
    weight = module.weight
    tp_dim = weight.device_mesh.mesh_dim_names.index("tp")
    return weight.device_mesh.get_local_rank("tp"), weight.device_mesh.size(tp_dim), weight.placements[tp_dim]


def _tp_shard(weight: torch.Tensor, where) -> torch.Tensor:
    """This tp rank's shard of a one-device weight (what FSDP2 all-gathers under 2-D)."""
    rank, size, placement = where
    if not isinstance(placement, Shard):
        return weight
    return weight.chunk(size, placement.dim)[rank]


def _worst_over_ranks(out: dict) -> dict:
    """Every rank's figures: the worst SQNR over ranks, the largest byte count."""
    sqnrs = out["sqnr_db"]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, out)
    out["sqnr_db"] = {k: min(r["sqnr_db"][k] for r in gathered) for k in sqnrs}
    for k in out:
        if k != "sqnr_db":
            out[k] = max(r[k] for r in gathered)
    return out


def errors(mesh) -> dict:
    """Mis-specified plans: the message each one raises (the test checks what they say)."""
    import torch.nn as nn
    from torch.distributed.tensor import Partial
    from torch.distributed.tensor.parallel import parallelize_module

    from f8dist import Float8Linear
    from f8dist.models.llama import FeedForward
    from f8dist.parallel.tp import Float8ColwiseParallel, Float8RowwiseParallel, PrepareFloat8ModuleInput

    tp_mesh = mesh["tp"]
    cases = {
        "embedding": lambda: parallelize_module(nn.Embedding(8, 16), tp_mesh, Float8ColwiseParallel()),
        "plain_linear": lambda: parallelize_module(nn.Linear(32, 32), tp_mesh, Float8RowwiseParallel()),
        "partial_input": lambda: Float8ColwiseParallel(input_layouts=Partial()),
        "bad_submodule": lambda: parallelize_module(
            FeedForward(32, 64), tp_mesh,
            PrepareFloat8ModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                     fwd_config_submodule_fqn="w9"),
        ),
        "shard_not_16": lambda: parallelize_module(
            Float8Linear.from_float(nn.Linear(32, 48), fqn="proj"), tp_mesh, Float8ColwiseParallel()
        ),
        "delayed_input": lambda: parallelize_module(  # delayed: needs the submodule's history
            convert_to_float8_training(FeedForward(32, 64), config=Float8LinearConfig.from_recipe_name("delayed")),
            tp_mesh, PrepareFloat8ModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        ),
        "2d_mesh_to_plan": lambda: parallelize_llama(Transformer(ARGS), mesh),
        "block_split": lambda: parallelize_module(  # 48 in_features per rank: 1x32 blocks split
            Float8Linear.from_float(nn.Linear(96, 64), Float8LinearConfig.from_recipe_name("mxfp8"),
                                    fqn="w1"), tp_mesh, Float8RowwiseParallel()),
        "unconverted_model": lambda: parallelize_llama(Transformer(ARGS), tp_mesh, float8=True),
    }
    messages = {}
    for name, fn in cases.items():
        try:
            fn()
        except (TypeError, ValueError) as e:
            messages[name] = f"{type(e).__name__}: {e}"
        else:
            messages[name] = "no error"
    return messages


def shared_input(mesh) -> dict:
    """An FFN whose w1 and w3 share one sequence-parallel input (PrepareFloat8ModuleInput, cast
    with w1's config) but differ in ``sp_grad_weight`` (mxfp8). Per case: the error it raised, or
    the SQNR of w1's and w3's weight gradients against one device."""
    import torch.nn as nn
    from torch.distributed.tensor.parallel import parallelize_module

    from f8dist.models.llama import FeedForward
    from f8dist.parallel.tp import Float8ColwiseParallel, Float8RowwiseParallel, PrepareFloat8ModuleInput

    tp, r = mesh["tp"].size(), mesh["tp"].get_local_rank()
    out = {}
    for w1_mode, w3_mode in (("recast", "forward_gather"), ("backward_gather", "forward_gather")):
        torch.manual_seed(0)
        ref = FeedForward(64, 128)
        ffn = copy.deepcopy(ref)
        for name, mode in (("w1", w1_mode), ("w2", w1_mode), ("w3", w3_mode)):
            config = Float8LinearConfig.from_recipe_name("mxfp8").replace(sp_grad_weight=mode)
            setattr(ffn, name, Float8Linear.from_float(getattr(ffn, name), config, fqn=name))
            setattr(ref, name, Float8Linear.from_float(getattr(ref, name), config, fqn=name))
        x, grad = torch.randn(1, 32 * 2 * tp, 64), torch.randn(1, 32 * 2 * tp, 64)
        ref(x).backward(grad)
        parallelize_module(ffn, mesh["tp"], {
            "": PrepareFloat8ModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                         fwd_config_submodule_fqn="w1"),
            "w1": Float8ColwiseParallel(), "w3": Float8ColwiseParallel(),
            "w2": Float8RowwiseParallel(output_layouts=Shard(1))})
        case = f"w1_{w1_mode}+w3_{w3_mode}"
        try:
            ffn(x.chunk(tp, 1)[r]).backward(grad.chunk(tp, 1)[r])
        except ValueError as e:
            out[case] = f"{type(e).__name__}: {e}"
            continue
        out[case] = {n: sqnr(getattr(ref, n).weight.grad, getattr(ffn, n).weight.grad.full_tensor())
                     for n in ("w1", "w3")}
    return out


def padded_shard(mesh) -> float:
    """A 48-wide layer over tp=2 (local 24) with pad_inner_dim: SQNR of its output vs one device."""
    import torch.nn as nn
    from torch.distributed.tensor.parallel import parallelize_module

    from f8dist import Float8Linear
    from f8dist.parallel.tp import Float8ColwiseParallel

    torch.manual_seed(0)
    lin = Float8Linear.from_float(nn.Linear(32, 48, bias=False), Float8LinearConfig(pad_inner_dim=True))
    ref = copy.deepcopy(lin)
    x = torch.randn(4, 16, 32)
    parallelize_module(lin, mesh["tp"], Float8ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()))
    tp, r = mesh["tp"].size(), mesh["tp"].get_local_rank()
    return sqnr(ref(x).detach(), lin(x.chunk(tp, 1)[r]).detach())


def rowwise_replicated_input(mesh) -> dict:
    """``Float8RowwiseParallel(input_layouts=Replicate())`` (each rank takes its in_features
    slice of a replicated input) per recipe: SQNR of the output, the input gradient and the weight
    gradient against one device, or the error it raised."""
    import torch.nn as nn
    from torch.distributed.tensor.parallel import parallelize_module

    from f8dist.parallel.tp import Float8RowwiseParallel

    out = {}
    for recipe in ("tensorwise", "rowwise", "rowwise_with_gw_hp"):
        torch.manual_seed(0)
        config = Float8LinearConfig.from_recipe_name(recipe)
        lin = Float8Linear.from_float(nn.Linear(64, 32, bias=False), config)
        ref = copy.deepcopy(lin)
        x = torch.randn(2, 16, 64)  # [B, S, K], the same on every rank
        grad = torch.randn(2, 16, 32)  # [B, S, N]
        x_ref, x_tp = x.clone().requires_grad_(), x.clone().requires_grad_()
        y_ref = ref(x_ref)
        y_ref.backward(grad)
        try:
            parallelize_module(lin, mesh["tp"], Float8RowwiseParallel(input_layouts=Replicate()))
            y = lin(x_tp)
            y.backward(grad)
        except Exception as e:  # reported, so the test shows what a recipe raised
            out[recipe] = f"{type(e).__name__}: {e}"
            continue
        out[recipe] = {
            "output": sqnr(y_ref.detach(), y.detach()),
            "grad_input": sqnr(x_ref.grad, x_tp.grad),
            "grad_weight": sqnr(ref.weight.grad, lin.weight.grad.full_tensor()),
        }
    return out


def run(args):
    global ARGS, SEQ
    rank, world, device = init()
    if args.dim:  # block recipes: dims whose tp shards hold whole 128-wide blocks
        ARGS = dataclasses.replace(ARGS, dim=args.dim, multiple_of=args.dim)
    if args.seq:  # block recipes: sequence shards that hold whole token blocks
        SEQ = args.seq
        ARGS = dataclasses.replace(ARGS, max_seq_len=SEQ)
    mesh = init_device_mesh(device.type, (args.dp, world // args.dp), mesh_dim_names=("dp", "tp"))
    results = {}
    wire_reference = args.wire_reference.split(",")  # see add_wire_casts
    for recipe in args.recipes.split(","):
        results[recipe] = compare(args, mesh, recipe, wire_reference=False)
        if recipe in wire_reference:
            results[recipe + "+wire_reference"] = compare(args, mesh, recipe, wire_reference=True)
    for recipe in args.split_seq_recipes.split(",") if args.split_seq_recipes else ():
        # sequence shards of 8 tokens split the grad_weight gemm's token blocks: the SP input and
        # gradient travel in high precision ([Note: the grad_weight gemm under sequence
        # parallelism] in f8dist/parallel/tp/style.py)
        results[recipe + "+split_seq"] = compare(args, mesh, recipe, wire_reference=False, seq=16)
    for recipe in args.float8_all_gather.split(",") if args.float8_all_gather else ():
        # FSDP2 gathers square weight blocks in float8 ([Note: block-scaled all-gather])
        results[recipe + "+float8_all_gather"] = compare(
            args, mesh, recipe, wire_reference=False, float8_all_gather=True)
    for variant in args.sp_grad_weight.split(",") if args.sp_grad_weight else ():
        # [Note: the grad_weight operand of a gathered tensor] in f8dist/config/cells.py
        recipe, mode = variant.split("+")
        results[variant] = compare(args, mesh, recipe, wire_reference=False, sp_grad_weight=mode)
    if args.sp_grad_weight:
        results["shared_input"] = shared_input(mesh)
    if args.only_recipes:
        write_result(args, results)
        return
    if args.dp > 1:  # FSDP2's float8 all-gather (tensorwise weights), with and without precompute
        for precompute in (False, True):
            name = "tensorwise+float8_all_gather" + ("+precompute" if precompute else "")
            results[name] = compare(
                args, mesh, "tensorwise", wire_reference=False,
                float8_all_gather=True, precompute=precompute,
            )
    if args.dp == 1:  # backward's weight amax all-reduces, without the forward's amax
        results["tensorwise+weight_amax_recomputed"] = compare(
            args, mesh, "tensorwise", wire_reference=False, weight_amax_from_forward=False)
        # float8 activations for backward: the SwiGLU's inputs scaled per channel on each rank's
        # channels, the grad_weight inputs cast in forward: one device's numbers still
        results["rowwise+float8_activations"] = compare(
            args, mesh, "rowwise", wire_reference=False, float8_activations_for_backward=True)
        # w2 recomputes its Shard(-1) input from the local float8 gate and up ([Note: a
        # recomputed input] in f8dist/nn/linear.py); the sequence-parallel norms give no recompute,
        # so recompute_norm_output raises there (tests/models/test_llama.py)
        results["rowwise+float8_activations+recompute"] = compare(
            args, mesh, "rowwise", wire_reference=False, float8_activations_for_backward=True,
            recompute_swiglu_product=True)
        results["errors"] = errors(mesh)
        results["padded_shard_sqnr_db"] = padded_shard(mesh)
        results["rowwise_replicated_input"] = rowwise_replicated_input(mesh)
    write_result(args, results)


def extra_args(parser):
    parser.add_argument("--recipes", default="tensorwise,rowwise,rowwise_with_gw_hp")
    parser.add_argument("--dp", type=int, default=1)
    parser.add_argument("--dim", type=int, default=None, help="model width (default 64)")
    parser.add_argument("--seq", type=int, default=None, help=f"sequence length (default {SEQ})")
    parser.add_argument("--split-seq-recipes", default="",
                        help="recipes also run with 16-token sequences (token blocks split by SP)")
    parser.add_argument("--wire-reference", default="",
                        help="recipes also compared against one device making the same wire casts")
    parser.add_argument("--float8-all-gather", default="",
                        help="2-D: block recipes with square weight blocks also run with FSDP2's "
                             "float8 all-gather")
    parser.add_argument("--sp-grad-weight", default="",
                        help="recipe+mode variants of Float8LinearConfig.sp_grad_weight, e.g. "
                             "mxfp8+backward_gather; also runs the shared-input cases")
    parser.add_argument("--only-recipes", action="store_true",
                        help="run the recipes only (no tensorwise variants, errors, small layers)")
    parser.add_argument("--hp-tp", action="store_true", help="PyTorch's styles (high-precision TP)")


if __name__ == "__main__":
    main(run, extra_args)
