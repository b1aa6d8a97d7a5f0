"""scripts/train.py's flags and every rule they follow alone, torch-free: a refused flag ends a
torchrun job before any rank imports torch ([Note: flags before torch]). The rules that need
torch (the training text, each recipe's config, the model on the meta device) are train.py's
``parse_args``."""

from __future__ import annotations

import argparse
import importlib.util
import os
import runpy
import sys
import tempfile
from typing import Optional, Sequence, Tuple

__all__ = ["OPTIM_STATES", "RECIPES", "parse_flags"]

# [Note: flags before torch]
# Under torchrun every rank parses the flags, and importing torch (and f8dist) takes each rank
# seconds: a refused flag cost that, then torchrun's report. So train.py runs parse_flags
# before it imports torch (its parse_args runs it again, then the rules that need torch), and a
# refused flag ends each rank at once with argparse's status 2, the message on rank 0 only.
# Every rank exits 2: one that exited 0 would drop its entry from torchrun's report (which the
# torchrun process prints; a rank cannot shorten it), but where one rank alone refuses (a
# directory on its own host) the others would wait for it in the process group. The recipe names
# come from f8dist/config/recipe_names.py, run as a file: importing f8dist.config.recipe_names would run
# f8dist/__init__.py, which imports torch.


def _recipe_names() -> Tuple[str, ...]:
    """Float8LinearRecipeName's values, from the f8dist that ``import f8dist`` would load."""
    spec = importlib.util.find_spec("f8dist")  # finds the package without running it
    if spec is None:
        raise ModuleNotFoundError("No module named 'f8dist'", name="f8dist")
    package = spec.submodule_search_locations[0]
    names = runpy.run_path(os.path.join(package, "config", "recipe_names.py"))["Float8LinearRecipeName"]
    return tuple(r.value for r in names)


# every recipe f8dist has ("none": bf16); train.py derives what each config allows
RECIPES = ("none", *_recipe_names())
OPTIM_STATES = ("fp32", "8bit")


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """--help keeps the module docstring's layout and shows every flag's default."""


class _Parser(argparse.ArgumentParser):
    """Bad flags end the job in one line, printed once (by rank 0 under torchrun), before any
    process group, model or data exists."""

    def error(self, message: str):
        if os.environ.get("RANK", "0") == "0":
            sys.stderr.write(f"{self.prog}: error: {message} (see --help)\n")
        sys.exit(2)


def _at_least(low: int):
    def parse(text: str) -> int:
        value = int(text)
        if value < low:
            raise argparse.ArgumentTypeError(
                f"must be {'a positive' if low == 1 else 'a non-negative'} integer, got {value}"
            )
        return value

    parse.__name__ = "int"  # argparse names the type in its message
    return parse


def parse_flags(argv: Optional[Sequence[str]] = None, description: Optional[str] = None
                ) -> Tuple[argparse.ArgumentParser, argparse.Namespace]:
    """The parser and the flags of ``argv``; a flag that breaks a rule of its own (or one of the
    flags together, or with torchrun's ranks) ends the process: [Note: flags before torch]."""
    p = _Parser(description=description, formatter_class=_HelpFormatter)
    positive, non_negative = _at_least(1), _at_least(0)
    p.add_argument("--steps", type=positive, default=60,
                   help="train to this step (the learning rate decays to 10%% there)")
    p.add_argument("--seed", type=int, default=0, help="weights, batches and RNG")
    p.add_argument("--float8", choices=RECIPES, default="tensorwise",
                   help="float8 recipe for every linear but the output layer ('none': bf16)")
    p.add_argument("--float8-all-gather", action="store_true",
                   help="FSDP2 all-gathers weights in float8 (recipes with a tensorwise weight "
                        "cast or square weight blocks; delayed and block-scaled expert weights in "
                        "high precision)")
    p.add_argument("--float8-activations-for-backward", action="store_true",
                   help="keep float8 copies of the activations backward reads (grad_weight inputs, "
                        "SwiGLU inputs) instead of high-precision ones (float8 recipes only; "
                        "linears: MoE experts keep their own)")
    p.add_argument("--recompute-swiglu-product", action="store_true",
                   help="with --float8-activations-for-backward: w2 keeps nothing of its input and "
                        "recomputes it in backward from the SwiGLU's float8 gate and up (other "
                        "numerics for w2's weight gradient)")
    p.add_argument("--recompute-norm-output", action="store_true",
                   help="wq/wk/wv and w1/w3 keep nothing of the RMSNorm output they read and "
                        "recompute it in backward from the norm's input and rstd (the same "
                        "gradients; float8 recipes only)")
    p.add_argument("--sp-grad-weight", choices=("forward_gather", "recast", "backward_gather"),
                   default="forward_gather",
                   help="with --tp, block recipes: how the grad_weight gemm gets the sequence-"
                        "parallel input (Float8LinearConfig.sp_grad_weight): both float8 casts "
                        "in the forward all-gather (exact), the row-block cast only re-cast "
                        "(0.52x bf16 on the wire, not one device's numbers), or the token-block "
                        "shard kept and all-gathered in backward (exact, 1/tp of it kept)")
    p.add_argument("--pad-inner-dim", action="store_true",
                   help="zero-pad the dims of linears the float8 gemms cannot take as they are "
                        "(the kernels' multiples of 16, the block recipes' blocks): exact, "
                        "Float8LinearConfig.pad_inner_dim (float8 recipes only)")
    p.add_argument("--float8-reduce-scatter", action="store_true",
                   help="FSDP2 reduce-scatters gradients in float8, summed in fp32 (any --float8)")
    p.add_argument("--tp", type=positive, default=1, help="tensor-parallel degree; FSDP2 on the rest")
    p.add_argument("--dp-replicate", type=positive, default=1,
                   help="HSDP (torchtitan's name): FSDP2 shards over dp_shard = ranks / "
                        "(dp_replicate x tp) and all-reduces each shard's gradients over the "
                        "dp_replicate replicas (in float8 with --float8-reduce-scatter)")
    p.add_argument("--pp", type=positive, default=1,
                   help="pipeline stages: the layers split evenly over a (pp, dp) mesh, FSDP2 "
                        "inside each stage, activations and their gradients cross in float8 "
                        "with a --float8 recipe (bf16 with none)")
    p.add_argument("--pp-microbatches", type=positive, default=None,
                   help="with --pp: micro-batches per step of each rank's batch (None: --pp, "
                        "the fewest 1F1B takes)")
    p.add_argument("--pp-schedule", choices=("1f1b", "gpipe"), default="1f1b",
                   help="with --pp: torch.distributed.pipelining's Schedule1F1B or ScheduleGPipe")
    p.add_argument("--cp", type=positive, default=1,
                   help="context-parallel degree: each sequence sharded over the cp ranks of a "
                        "(dp, cp) mesh ((dp, cp, tp) with --tp), K and V all-gathered in float8 "
                        "for attention, FSDP2 over dp x cp")
    p.add_argument("--compile", action="store_true", help="torch.compile each block")
    p.add_argument("--ac", choices=("none", "sac", "full"), default="none",
                   help="activation checkpointing per block: selective (op-level) or full")
    p.add_argument("--log-every", type=positive, default=10, help="rank 0 logs every N steps")
    p.add_argument("--checkpoint-dir", default=None, help="where checkpoints go (DIR/step-N)")
    p.add_argument("--checkpoint-every", type=non_negative, default=0, help="save every K steps (0: at the end only)")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --checkpoint-dir")
    p.add_argument("--metrics-file", default=None, help="rank 0 writes per-step losses here (JSON)")
    p.add_argument("--float8-stats-every", type=non_negative, default=0,
                   help="every N steps, record every float8 cast (amax, scale, saturated %%, "
                        "underflow %%, SQNR by module/gemm/operand; eager only); 0: off")
    p.add_argument("--float8-stats-dir", default=None,
                   help="where --float8-stats-every writes float8_stats.{jsonl,txt,png} (rank 0; "
                        "default float8_stats)")
    # optimization
    p.add_argument("--batch-size", type=positive, default=8, help="global batch (sequences)")
    p.add_argument("--grad-accum-steps", type=positive, default=1,
                   help="split each rank's batch into this many micro-batches (forward and "
                        "backward each) per optimizer step")
    p.add_argument("--seq-len", type=positive, default=64, help="tokens (bytes) per sequence")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW's peak learning rate")
    p.add_argument("--warmup-steps", type=non_negative, default=10,
                   help="linear warmup to --lr, then cosine decay to 10%% at --steps")
    p.add_argument("--max-norm", type=float, default=1.0,
                   help="clip gradients to this global norm (inf: no clipping)")
    p.add_argument("--optim-states", choices=OPTIM_STATES, default="fp32",
                   help="AdamW's moments: fp32 (torch.optim.AdamW) or 8bit (f8dist.optim.AdamW, "
                        "about 2 bytes per parameter instead of 8)")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                   help="FSDP2 parameter (compute) dtype; master weights and grads reduce in fp32")
    # model size
    p.add_argument("--dim", type=positive, default=64, help="model width")
    p.add_argument("--n-layers", type=positive, default=2, help="transformer blocks")
    p.add_argument("--n-heads", type=positive, default=4, help="attention heads")
    p.add_argument("--n-kv-heads", type=positive, default=None,
                   help="key/value heads (grouped-query attention; None: --n-heads)")
    p.add_argument("--ffn-dim-multiplier", type=float, default=None,
                   help="scales the FFN's hidden dim, LLaMA's 2/3 of 4 x --dim rounded up to 32 "
                        "(None: 1)")
    # mixture of experts (f8dist/models/moe.py)
    p.add_argument("--moe-experts", type=non_negative, default=0,
                   help="routed experts per block (0: the dense LLaMA FFN)")
    p.add_argument("--moe-top-k", type=positive, default=None,
                   help="experts per token (with --moe-experts; None: 2)")
    p.add_argument("--ep", type=positive, default=1,
                   help="expert-parallel degree (with --moe-experts); FSDP2 shards the experts "
                        "over the other ranks and everything else over all ranks")
    p.add_argument("--float8-ep-combine", action="store_true",
                   help="with --ep: the combine all-to-all sends the experts' outputs as e4m3 "
                        "per token (Float8ExpertParallel's float8_combine; other numbers than "
                        "one device's run without it; any --float8)")
    p.add_argument("--float8-ep-backward", action="store_true",
                   help="with --ep: both backward all-to-alls send their gradients as e4m3 per "
                        "token (Float8ExpertParallel's float8_backward; other numbers, as "
                        "--float8-ep-combine; any --float8)")
    args = p.parse_args(argv)
    if args.resume and not args.checkpoint_dir:
        p.error("--resume needs --checkpoint-dir")
    if args.checkpoint_every and not args.checkpoint_dir:
        p.error("--checkpoint-every needs --checkpoint-dir")
    world = int(os.environ.get("WORLD_SIZE", "1"))  # torchrun's, known before any rank starts
    _check_no_silent_flags(p, args, world)
    args.moe_top_k = 2 if args.moe_top_k is None else args.moe_top_k
    args.float8_stats_dir = args.float8_stats_dir or "float8_stats"
    _check_moe_args(p, args, world)
    _check_pp_args(p, args, world)
    _check_cp_args(p, args, world)
    _check_hsdp_args(p, args, world)
    if world % (args.tp * args.cp):
        p.error(f"--tp {args.tp} must divide the number of ranks ({world})" if args.cp == 1 else
                f"--cp x --tp ({args.cp * args.tp}) must divide the number of ranks ({world})")
    dp = world // (args.tp * args.pp * args.cp)  # cp ranks share their sequences
    if args.batch_size % dp:
        p.error(f"--batch-size {args.batch_size} must be a multiple of the {dp} "
                "data-parallel ranks")
    flag, micro = (("--pp-microbatches", args.pp_microbatches) if args.pp > 1
                   else ("--grad-accum-steps", args.grad_accum_steps))
    if (args.batch_size // dp) % micro:
        p.error(f"{flag} {micro} must divide each rank's batch ({args.batch_size // dp} "
                "sequences); change --batch-size")
    for heads in (args.n_heads, args.n_kv_heads or args.n_heads):
        if heads % args.tp:
            p.error(f"--tp {args.tp} shards attention heads: --n-heads and --n-kv-heads must be "
                    f"multiples of it (got {heads})")
    if args.float8_stats_every and (args.float8 == "none" or args.compile):
        p.error("--float8-stats-every records float8 casts in eager mode: it needs a --float8 "
                "recipe and no --compile")
    if not args.max_norm > 0:  # a negative norm reversed the gradients, 0 zeroed them
        p.error(f"--max-norm must be positive (inf: no clipping), got {args.max_norm}")
    if args.tp > 1 and args.seq_len % (args.cp * args.tp):
        of = f"--cp x --tp ({args.cp * args.tp})" if args.cp > 1 else f"--tp {args.tp}"
        p.error(f"--seq-len {args.seq_len} must be a multiple of {of}: sequence "
                "parallelism shards each sequence" + (" shard" if args.cp > 1 else "")
                + " over the tp ranks")
    for flag, path in (("--checkpoint-dir", args.checkpoint_dir),
                       ("--metrics-file", args.metrics_file and os.path.dirname(args.metrics_file)),
                       ("--float8-stats-dir", args.float8_stats_every and args.float8_stats_dir)):
        wrong = _unwritable(path) if path is not None and path is not False else None
        if wrong:
            p.error(f"{flag} {getattr(args, flag[2:].replace('-', '_'))}: {wrong}")
    if args.metrics_file and os.path.isdir(args.metrics_file):
        p.error(f"--metrics-file {args.metrics_file} is a directory; name a file in it")
    return p, args


def _check_no_silent_flags(p: argparse.ArgumentParser, args: argparse.Namespace,
                           world: int) -> None:
    """A flag that would change nothing in this run is refused, not ignored."""
    float8_only = {"--float8-activations-for-backward": args.float8_activations_for_backward,
                   "--recompute-swiglu-product": args.recompute_swiglu_product,
                   "--recompute-norm-output": args.recompute_norm_output,
                   "--pad-inner-dim": args.pad_inner_dim,
                   f"--sp-grad-weight {args.sp_grad_weight}":
                       args.sp_grad_weight != "forward_gather"}
    given = [flag for flag, on in float8_only.items() if on]
    if args.float8 == "none" and given:
        p.error(f"{', '.join(given)} change(s) how float8 linears keep and cast their operands; "
                "with --float8 none there are none: choose a --float8 recipe or drop them")
    needs = [("--sp-grad-weight", args.sp_grad_weight != "forward_gather" and args.tp == 1,
              "chooses how sequence-parallel float8 inputs reach the grad_weight gemm", "--tp N"),
             ("--recompute-norm-output", args.recompute_norm_output and args.tp > 1,
              "recomputes a norm's output from its input and rstd; under --tp the norms are "
              "sequence parallel and give nothing to recompute from", "--tp 1"),
             ("--moe-top-k", args.moe_top_k is not None and not args.moe_experts,
              "picks the experts of each token", "--moe-experts N"),
             ("--float8-stats-dir", args.float8_stats_dir is not None
              and not args.float8_stats_every, "is where --float8-stats-every writes",
              "--float8-stats-every N"),
             ("--float8-reduce-scatter",
              args.float8_reduce_scatter
              and world // (args.tp * args.pp * args.dp_replicate) == 1,
              "reduce-scatters gradients over the data-parallel ranks that shard them; with one, "
              "FSDP2 runs no reduce-scatter",
              "more ranks than --tp" + (" x --pp" if args.pp > 1 else "")
              + (" x --dp-replicate" if args.dp_replicate > 1 else "")),
             *[(flag, on and args.ep == 1, "casts what an expert-parallel all-to-all sends; "
                "without expert parallelism there is none", "--moe-experts N --ep M")
               for flag, on in (("--float8-ep-combine", args.float8_ep_combine),
                                ("--float8-ep-backward", args.float8_ep_backward))],
             ("--pp-microbatches", args.pp_microbatches is not None and args.pp == 1,
              "splits each rank's batch for the pipeline's schedule", "--pp N"),
             ("--pp-schedule", args.pp_schedule != "1f1b" and args.pp == 1,
              "picks the pipeline's schedule", "--pp N")]
    for flag, unused, what, fix in needs:
        if unused:
            p.error(f"{flag} {what}: it would do nothing in this run; add {fix} or drop it")


def _check_moe_args(p: argparse.ArgumentParser, args: argparse.Namespace, world: int) -> None:
    """The MoE flags and the combinations train.py runs with them (the others are refused)."""
    if not args.moe_experts:
        if args.ep > 1:
            p.error("--ep shards experts: it needs --moe-experts N")
        return
    if args.moe_top_k > args.moe_experts:
        p.error(f"--moe-top-k {args.moe_top_k} exceeds --moe-experts {args.moe_experts}")
    if args.moe_experts % args.ep or world % args.ep:
        p.error(f"--ep {args.ep} must divide --moe-experts ({args.moe_experts}) and the number "
                f"of ranks ({world})")
    if args.float8_all_gather and args.ep == 1 and (args.moe_experts % (world // args.tp)):
        # [Note: float8 all-gather of expert weights] in f8dist/core/weight.py
        p.error(f"--float8-all-gather shards the experts dim over the {world // args.tp} "
                f"data-parallel ranks, which must divide --moe-experts ({args.moe_experts}); "
                "change --moe-experts or use --ep")
    refused = {
        # [Note: MoE under tensor parallelism] in f8dist/models/moe_parallel.py: no 3-D mesh
        "--tp with --ep > 1": args.tp > 1 and args.ep > 1,
        "--compile": args.compile,
        "--float8-reduce-scatter": args.float8_reduce_scatter,
    }
    bad = [flag for flag, on in refused.items() if on]
    if bad:
        p.error(f"--moe-experts does not run with {', '.join(bad)} in train.py: the MoE model "
                "trains with data parallelism (FSDP2), expert parallelism (--ep) or tensor-parallel "
                "attention (--tp), every float8 recipe, in eager mode")


def _check_pp_args(p: argparse.ArgumentParser, args: argparse.Namespace, world: int) -> None:
    """--pp and the flags train.py runs with it (the others are refused)."""
    if args.pp == 1:
        return
    if world % args.pp or args.pp > args.n_layers:
        p.error(f"--pp {args.pp} must divide the number of ranks ({world}) and be at most "
                f"--n-layers ({args.n_layers}): each stage takes whole layers")
    args.pp_microbatches = args.pp_microbatches or args.pp
    if args.pp_schedule == "1f1b" and args.pp_microbatches < args.pp:
        p.error(f"--pp-microbatches {args.pp_microbatches} is fewer than the {args.pp} stages: "
                "1F1B keeps every stage busy with one micro-batch each; raise it to --pp or use "
                "--pp-schedule gpipe")
    refused = {
        "--tp": args.tp > 1, "--moe-experts": args.moe_experts > 0, "--compile": args.compile,
        "--grad-accum-steps (use --pp-microbatches)": args.grad_accum_steps > 1,
        "--checkpoint-dir": args.checkpoint_dir is not None,
        "--float8-stats-every": args.float8_stats_every > 0,
    }
    _refuse(p, "--pp", refused, "a pipeline stage trains with FSDP2 over its data-parallel "
                                "ranks (every --float8 recipe, --ac, the float8 FSDP2 options, "
                                "8-bit AdamW states), without tensor or expert parallelism, "
                                "checkpoints, compile or float8 stats; drop them or --pp")


def _check_cp_args(p: argparse.ArgumentParser, args: argparse.Namespace, world: int) -> None:
    """--cp and the flags train.py runs with it (the others are refused)."""
    if args.cp == 1:
        return
    if world % args.cp:
        p.error(f"--cp {args.cp} must divide the number of ranks ({world})")
    if args.seq_len % args.cp:
        p.error(f"--seq-len {args.seq_len} must be a multiple of --cp {args.cp}: each cp rank "
                "holds an equal, contiguous shard of every sequence")
    refused = {
        "--pp": args.pp > 1, "--moe-experts": args.moe_experts > 0, "--compile": args.compile,
        "--float8-stats-every": args.float8_stats_every > 0,
    }
    _refuse(p, "--cp", refused, "context parallelism trains the dense model with FSDP2 over dp x "
                                "cp and --tp (every --float8 recipe, --ac, checkpoints, "
                                "--grad-accum-steps, the float8 FSDP2 options, 8-bit AdamW "
                                "states), without pipeline or expert parallelism, compile or "
                                "float8 stats; drop them or --cp")


def _check_hsdp_args(p: argparse.ArgumentParser, args: argparse.Namespace, world: int) -> None:
    """--dp-replicate and the flags train.py runs with it (the others are refused)."""
    if args.dp_replicate == 1:
        return
    if world % (args.dp_replicate * args.tp):
        p.error(f"--dp-replicate {args.dp_replicate} x --tp {args.tp} must divide the number of "
                f"ranks ({world}): FSDP2 shards over the {world} / (dp_replicate x tp) ranks "
                "left; change --dp-replicate")
    refused = {"--pp": args.pp > 1, "--cp": args.cp > 1, "--moe-experts": args.moe_experts > 0}
    _refuse(p, "--dp-replicate", refused, "HSDP trains the dense model on a (dp_replicate, "
                                          "dp_shard, tp) mesh (every --float8 recipe, --tp, the "
                                          "float8 FSDP2 options); drop them or --dp-replicate")


def _refuse(p: argparse.ArgumentParser, flag: str, refused: dict, runs_with: str) -> None:
    """End with one line naming the flags of ``refused`` that are on, if any: ``flag`` does not
    run with them yet, and what it ``runs_with``."""
    bad = [name for name, on in refused.items() if on]
    if bad:
        p.error(f"{flag} does not run with {', '.join(bad)} in train.py yet: {runs_with}")


def _unwritable(directory: str) -> Optional[str]:
    """Why files cannot be written in ``directory`` (made if missing), or None: checked when the
    flags are, not at the first save or the end of the run."""
    existing = os.path.abspath(directory or ".")
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        return f"{existing} is not a directory"
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as e:
        return f"cannot write in {existing} ({e.strerror})"
    return None
