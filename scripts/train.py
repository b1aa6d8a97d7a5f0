"""Pretrain a small LLaMA-style model on the Python standard library's source, with float8.

One flat loop, nanoGPT-style. Launch with torchrun (FSDP2 over the data-parallel ranks, tensor
parallel over ``--tp`` ranks of a 2-D mesh, ``--pp`` pipeline stages with FSDP2 inside each, or
``--cp`` context-parallel ranks sharing each sequence, FSDP2 over dp x cp, with ``--tp``
on a (dp, cp, tp) mesh; ``--dp-replicate``: HSDP),
or as plain ``python scripts/train.py`` (one process, world size 1)::

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 scripts/train.py \\
        --float8 tensorwise --steps 60

Every rank logs nothing; rank 0 prints one line per ``--log-every`` steps, torchtitan-style::

    step: 60  loss: 2.5563  grad_norm: 0.4370  memory: 0.40GiB (params 0.3MiB grads 0.3MiB ...
    ... optim 0.5MiB act 2.0MiB)  tps: 6,425  [60/60 eta 0:00:00]

The order of model transformations is torchtitan's: float8 conversion, tensor or context
parallel, the pipeline split, activation checkpointing, torch.compile (per block), FSDP2 (per block, then the
root).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import math
import os
import re
import resource
import shutil
import time
from collections import defaultdict
from datetime import timedelta
from typing import Dict, List, Optional, Sequence

from train_flags import OPTIM_STATES, RECIPES, parse_flags  # noqa: F401  (torch-free; OPTIM_STATES for compare_loss.py)

if __name__ == "__main__":  # a refused flag ends the process here: [Note: flags before torch]
    parse_flags(description=__doc__)

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

import f8dist
import f8dist.optim
from f8dist import Float8LinearConfig, convert_to_float8_training, float8_sac_context_fn
from f8dist.core.agreement import canonical_name
from f8dist.core.cast import stochastic_rounding
from f8dist.policy.checkpoint import Float8LoadPlanner
from f8dist.policy.filters import high_precision_tail_filter
from f8dist.core.placement import reduce_over_shards
from f8dist.models import ModelArgs, Transformer, llama_tp_plan, parallelize_llama
from f8dist.models.llama_cp import parallelize_llama_cp
from f8dist.models.llama_pp import LlamaStage, pipeline_stage, split_llama
from f8dist.models.moe import MoEArgs, MoETransformer
from f8dist.models.moe_parallel import fully_shard_moe, moe_tp_plan, parallelize_moe
from f8dist.models.data import VOCAB_SIZE, ByteBatches, corpus_bytes
from f8dist.nn.grouped import LINEAR_ONLY_OPTIONS, Float8GroupedExperts, GroupedExperts
from f8dist.policy.delayed import set_amax_group
from f8dist.parallel.fsdp import enable_float8_reduce_scatter, precompute_float8_dynamic_scale_for_fsdp
from f8dist.testing.memory import storages
from teardown import exit_cleanly, one_gpu_per_rank  # scripts/teardown.py



def _allows_float8_all_gather(recipe: str) -> bool:
    """Whether the recipe's config takes enable_fsdp_float8_all_gather (one float8 weight that
    serves both of its gemms: config_rules.enable_fsdp_float8_all_gather)."""
    try:
        Float8LinearConfig.from_recipe_name(recipe).replace(enable_fsdp_float8_all_gather=True)
    except ValueError:
        return False
    return True


# block-scaled recipes: the model's dims (and their TP shards) must divide into the blocks
BLOCK_RECIPES = tuple(r for r in RECIPES[1:] if any(
    s.blockwise for s in Float8LinearConfig.from_recipe_name(r).cast_specs()))
# the recipes whose one float8 weight serves both of its gemms: FSDP2 can all-gather it in float8
FLOAT8_ALL_GATHER = tuple(r for r in RECIPES[1:] if _allows_float8_all_gather(r))

# dense bf16 tensor-core peak (FLOP/s) per GPU, for the mfu column
_BF16_PEAK = {"H100": 989e12, "H200": 989e12, "B200": 2250e12, "A100": 312e12}


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """The flags of ``argv``, checked: train_flags.py's rules, then those that need torch (the
    training text, each recipe's config, the model on the meta device)."""
    p, args = parse_flags(argv, description=__doc__)
    windows = len(corpus_bytes("train")) - 1  # a sequence is a window of the corpus, plus 1 target
    if args.seq_len >= windows:
        p.error(f"--seq-len {args.seq_len} is longer than the training text ({windows} bytes); "
                "the model's positions and the batches are windows of it")
    if args.float8_all_gather and args.float8 not in FLOAT8_ALL_GATHER:
        p.error("--float8-all-gather needs a tensorwise weight cast or square weight blocks: "
                f"--float8 {' or '.join(FLOAT8_ALL_GATHER)}")
    if args.float8 != "none":  # the model's linears must take the recipe
        wrong = float8_misfit(args)
        if wrong:
            p.error(f"--float8 {args.float8}: {wrong}; {float8_fixes(args)}")
        if args.pad_inner_dim and not float8_misfit(argparse.Namespace(**{**vars(args), "pad_inner_dim": False})):
            p.error(f"--pad-inner-dim pads the dims the float8 gemms cannot take; every linear of "
                    f"this model takes --float8 {args.float8} as it is: it would do nothing; drop it")
    return args


def float8_misfit(args: argparse.Namespace) -> Optional[str]:
    """Why the model of ``args`` cannot take its --float8 recipe (converted on the meta device,
    sharded over --tp), or None. [Note: the flags that fit] says which part of f8dist's error
    is kept."""
    try:
        model = meta_model(args, skip_incompatible=False)
        if args.tp > 1 and not args.moe_experts:  # TP shards must keep blocks whole
            for fqn, style in llama_tp_plan(model).items():
                if hasattr(style, "check_blocks"):
                    style.check_blocks(model.get_submodule(fqn), args.tp)
    except ValueError as e:
        return str(e).replace("\n", " ").split(". Make the layer")[0].rstrip(".")
    return None


def meta_model(args: argparse.Namespace, **kwargs) -> Transformer:
    """The dense model of ``args`` on the meta device, converted to its --float8 recipe (``kwargs``
    for ``convert_to_float8_training``)."""
    with torch.device("meta"):
        model = Transformer(model_args(args))
        if args.float8 != "none":
            convert_float8(model, float8_config(args), args.float8, **kwargs)
    return model


# [Note: the flags that fit]
# f8dist's error names the layer, its dims and the rule, then fixes in the library's terms
# (module_filter_fn, Float8LinearConfig(pad_inner_dim=True)); train.py keeps the first part and
# names its own flags instead, each one checked here on the meta model: --pad-inner-dim, and the
# nearest --dim and --ffn-dim-multiplier (from a few usual multipliers) that fit, e.g.
# "--dim 128 --ffn-dim-multiplier 1.5" for the blockwise recipe's 128-blocks.
_MULTIPLIERS = (None, 1.5, 1.3, 2.0, 1.0)


def float8_fixes(args: argparse.Namespace) -> str:
    """The train.py flags that make the model of ``args`` take its --float8 recipe."""
    def fits(**change) -> bool:
        return float8_misfit(argparse.Namespace(**{**vars(args), **change})) is None

    fixes = []
    if not args.pad_inner_dim and fits(pad_inner_dim=True):
        fixes.append("add --pad-inner-dim (the last block zero-padded, exact)")
    multipliers = dict.fromkeys((args.ffn_dim_multiplier, *_MULTIPLIERS))
    heads = math.lcm(args.n_heads, args.n_kv_heads or args.n_heads) * args.tp
    for dim in range(args.dim, 8 * max(args.dim, 128) + 1):
        if dim % 16 or dim % heads:  # the gemms' alignment; whole heads on each --tp rank
            continue
        fit = next((m for m in multipliers if fits(dim=dim, ffn_dim_multiplier=m)), False)
        if fit is not False:
            fixes.append(f"use --dim {dim}" + (f" --ffn-dim-multiplier {fit:g}" if fit else ""))
            break
    fixes.append("or keep the linears in high precision with --float8 none")
    return ", ".join(fixes[:-1]) + " " + fixes[-1] if len(fixes) > 1 else fixes[0]


# -- distributed setup --------------------------------------------------------------------------

def init_distributed() -> torch.device:
    """Join torchrun's process group, or make a one-process group when run as plain python."""
    if not dist.is_initialized() and "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    cuda = one_gpu_per_rank()
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(minutes=5))
    if cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build_mesh(tp: int, device: torch.device, ep: int = 1, pp: int = 1, cp: int = 1,
               dp_replicate: int = 1) -> DeviceMesh:
    """(dp, tp); with expert parallelism (dp_shard, ep), every rank data-parallel
    (:func:`dp_mesh_of`); with pipeline stages (pp, dp); with context parallelism (dp, cp), and
    (dp, cp, tp) with tensor parallelism too; with HSDP (dp_replicate, dp_shard, tp)."""
    world = dist.get_world_size()
    if dp_replicate > 1:
        return init_device_mesh(device.type, (dp_replicate, world // (dp_replicate * tp), tp),
                                mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
    if cp > 1 and tp > 1:
        return init_device_mesh(device.type, (world // (cp * tp), cp, tp),
                                mesh_dim_names=("dp", "cp", "tp"))
    if cp > 1:
        return init_device_mesh(device.type, (world // cp, cp), mesh_dim_names=("dp", "cp"))
    if pp > 1:
        return init_device_mesh(device.type, (pp, world // pp), mesh_dim_names=("pp", "dp"))
    if ep > 1:
        return init_device_mesh(device.type, (world // ep, ep), mesh_dim_names=("dp_shard", "ep"))
    return init_device_mesh(device.type, (world // tp, tp), mesh_dim_names=("dp", "tp"))


def dp_mesh_of(mesh: DeviceMesh) -> DeviceMesh:
    """The data-parallel ranks: mesh["dp"], all of an expert-parallel (dp_shard, ep) mesh, or
    an HSDP mesh's dp_replicate x dp_shard (flattened, rather than sliced by name from the root:
    torch deprecates that)."""
    if "ep" in mesh.mesh_dim_names:
        return mesh._flatten("dp")
    if "dp_replicate" in mesh.mesh_dim_names:
        return mesh["dp_replicate", "dp_shard"]._flatten("dp")
    return mesh["dp"]


def sr_stream_of(mesh: DeviceMesh) -> int:
    """This rank's stochastic rounding stream: its data-parallel replica's index over the dp
    axes ([Note: the stochastic rounding key] in f8dist/core/cast.py). The ranks that shard one
    tensor (tp, cp, ep; pp's stages run one replica's batch) share it: with --ep the dp_shard
    axis alone, since an expert's tokens from the ep ranks are one tensor, so those ranks' dense
    layers draw alike too."""
    stream = 0
    for dim, name in enumerate(mesh.mesh_dim_names):
        if name in ("dp", "dp_replicate", "dp_shard"):
            stream = stream * mesh.size(dim) + mesh.get_local_rank(name)
    return stream


def fsdp_mesh_of(mesh: DeviceMesh) -> DeviceMesh:
    """The ranks FSDP2 shards over and reduces gradients across: the data-parallel ones, with
    --cp their context-parallel ones too ([Note: context parallelism in train.py]), with
    --dp-replicate the 2-D (dp_replicate, dp_shard) mesh that makes FSDP2 HSDP."""
    if "cp" in mesh.mesh_dim_names:
        return mesh["dp", "cp"]._flatten("dp_cp")
    if "dp_replicate" in mesh.mesh_dim_names:
        return mesh["dp_replicate", "dp_shard"]
    return dp_mesh_of(mesh)


# -- the model ----------------------------------------------------------------------------------

def model_args(args: argparse.Namespace) -> ModelArgs:
    return ModelArgs(dim=args.dim, n_layers=args.n_layers, n_heads=args.n_heads,
                     n_kv_heads=args.n_kv_heads, ffn_dim_multiplier=args.ffn_dim_multiplier,
                     vocab_size=VOCAB_SIZE, max_seq_len=args.seq_len)


def float8_config(args: argparse.Namespace) -> Optional[Float8LinearConfig]:
    if args.float8 == "none":
        return None
    config = Float8LinearConfig.from_recipe_name(args.float8).replace(
        float8_activations_for_backward=args.float8_activations_for_backward,
        recompute_swiglu_product=args.recompute_swiglu_product,
        recompute_norm_output=args.recompute_norm_output, sp_grad_weight=args.sp_grad_weight,
        pad_inner_dim=args.pad_inner_dim)
    if args.float8_all_gather:
        # a delayed weight's first-step history comes from the whole weight, in the
        # pre-all-gather cast ([Note: first step] in f8dist/policy/delayed/scale.py)
        config = config.replace(enable_fsdp_float8_all_gather=True)
    return config


def convert_float8(model: Transformer, config: Float8LinearConfig, recipe: str, **kwargs) -> None:
    # the output layer (logits over the vocabulary) stays in high precision, and the recipe's
    # high-precision tail of blocks (nvfp4's); the experts take the
    # options they implement, in a call of their own ([Note: options of grouped experts] in
    # f8dist/nn/grouped.py): the linears' memory flags and padding are the linears'
    def is_experts(mod: nn.Module, fqn: str) -> bool:
        return isinstance(mod, GroupedExperts)

    tail = high_precision_tail_filter(recipe, len(model.layers))  # [Note: a high-precision tail]
    convert_to_float8_training(
        model, config=config, **kwargs,
        module_filter_fn=lambda mod, fqn: fqn != "output" and not is_experts(mod, fqn) and tail(mod, fqn))
    experts_config = config.replace(pad_inner_dim=False,
                                    **{name: False for name in LINEAR_ONLY_OPTIONS})
    convert_to_float8_training(model, config=experts_config,
                               module_filter_fn=lambda mod, fqn: is_experts(mod, fqn) and tail(mod, fqn),
                               **kwargs)


def build_model(args: argparse.Namespace, mesh: DeviceMesh, device: torch.device) -> nn.Module:
    """The model this rank trains: the whole model, or with --pp its stage (:func:`split_stage`)."""
    margs = model_args(args)
    if args.moe_experts:
        model = MoETransformer(margs, MoEArgs(num_experts=args.moe_experts, top_k=args.moe_top_k))
    else:
        model = Transformer(margs)
    model.init_weights(seed=args.seed)  # same weights on every rank before sharding
    config = float8_config(args)
    if config is not None:
        convert_float8(model, config, args.float8)
    if args.tp > 1:  # torchtitan's TP + SP plan; float8 linears all-gather their inputs in float8
        # an MoE layer runs whole on every TP rank: [Note: MoE under tensor parallelism]
        parallelize_llama(model, mesh["tp"], float8=config is not None,
                          ffn_plan=moe_tp_plan if args.moe_experts else None)
    if args.ep > 1:  # experts over the ep ranks; float8 token dispatch with per-token casts,
        # the combine and backward all-to-alls in float8 with --float8-ep-combine, -backward
        parallelize_moe(model, mesh["ep"], float8_combine=args.float8_ep_combine,
                        float8_backward=args.float8_ep_backward)
    if args.cp > 1:  # [Note: context parallelism in train.py]
        parallelize_llama_cp(model, mesh["cp"])
    if args.pp > 1:
        model = split_stage(model, mesh, float8=config is not None)
    for name, block in list(model.layers.items()):
        block = apply_ac(block, args.ac)
        if args.compile:
            block.compile(fullgraph=True)
        model.layers[name] = block
    mp = MixedPrecisionPolicy(param_dtype=getattr(torch, args.dtype), reduce_dtype=torch.float32)
    dp = fsdp_mesh_of(mesh)
    if args.ep > 1:  # [Note: EP x FSDP2] in f8dist/models/moe_parallel.py
        fully_shard_moe(model, mesh, dp_mesh=dp, mp_policy=mp, reshard_after_forward=True)
    else:
        for block in model.layers.values():
            fully_shard(block, mesh=dp, mp_policy=mp, reshard_after_forward=True)
        fully_shard(model, mesh=dp, mp_policy=mp, reshard_after_forward=True)
    if args.float8_reduce_scatter:
        enable_float8_reduce_scatter(model)
    model.to(device)
    return model


# [Note: pipeline stages in train.py]
# --pp N splits the converted model into N stages of whole layers (split_llama: the modules are
# the model's own, FQNs kept), one per row of the (pp, dp) mesh, before activation checkpointing
# and FSDP2, which then shard each stage over its dp ranks. With a --float8 recipe, activations
# and their gradients cross the stage boundaries in float8 ([Note: the float8 stage boundary] in
# f8dist/parallel/pp/boundary.py), else in the compute dtype. Every rank builds and initializes
# the whole model (the same weights as without --pp) and keeps its stage. Delayed amaxes are
# reduced over the stage's dp ranks (the other stages hold other layers). The schedule splits
# each rank's batch into --pp-microbatches, the first stage reads the tokens, the last computes
# the loss of each micro-batch (gradients averaged over them, as --grad-accum-steps does), and the
# logged loss is the last stage's, summed over the world from zeros on the other stages.


# [Note: context parallelism in train.py]
# --cp N builds a (dp, cp) mesh: the N ranks of a row read the same sequences (ByteBatches over
# the dp ranks only) and each feeds its contiguous shard of every sequence, inputs and targets
# sliced alike along the sequence ([Note: the LLaMA model under context parallelism] in
# f8dist/models/llama_cp.py: parallelize_llama_cp after the float8 conversion, so attention
# gathers K and V in float8). Each rank's loss is the mean over its own tokens, all shards of
# one size: FSDP2 over dp x cp flattened (as torchtitan does) averages the gradients over both,
# which is the gradient of the mean over every token, and the logged loss is the mean over all
# ranks as without --cp. With --tp the mesh is (dp, cp, tp), tp applied first ([Note: context
# parallelism with tensor parallelism] in f8dist/models/llama_cp.py); the tp ranks of a cp rank
# feed the same shard.


def split_stage(model: Transformer, mesh: DeviceMesh, float8: bool) -> LlamaStage:
    """This rank's stage of ``model`` ([Note: pipeline stages in train.py])."""
    pp = mesh["pp"]
    stage = split_llama(model, pp.get_local_rank(), pp.size(), float8=float8)
    set_amax_group(stage, mesh["dp"])
    return stage


def build_schedule(stage: LlamaStage, args: argparse.Namespace, mesh: DeviceMesh):
    """The pipeline schedule of ``stage`` (built by :func:`build_model`, on its device), its
    micro-batches' shapes given statically."""
    pp, n = mesh["pp"], args.pp_microbatches
    microbatch = (args.batch_size // mesh["dp"].size() // n, args.seq_len)
    piped = pipeline_stage(stage, pp.get_local_rank(), pp.size(), microbatch, pp.get_group(),
                           getattr(torch, args.dtype))
    schedule = Schedule1F1B if args.pp_schedule == "1f1b" else ScheduleGPipe
    return schedule(piped, n, loss_fn=next_byte_loss)  # scale_grads: gradients / n


def pipeline_step(pipe, stage: LlamaStage, inputs: torch.Tensor,
                  targets: torch.Tensor) -> torch.Tensor:
    """One step of ``pipe`` on the batch ``inputs``, ``targets`` [b, S] (forward and backward of
    every micro-batch): their mean loss on the last stage, 0 on the others."""
    losses: List[torch.Tensor] = []
    pipe.step(*[inputs] if stage.is_first else [], target=targets if stage.is_last else None,
              losses=losses)
    return torch.stack(losses).detach().mean() if losses else torch.zeros((), device=inputs.device)


def next_byte_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of ``logits`` [b, S, V] (in fp32) against the next bytes ``targets`` [b, S]."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(0, 1))


def apply_ac(block: nn.Module, mode: str) -> nn.Module:
    if mode == "none":
        return block
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    if mode == "full":
        return checkpoint_wrapper(block, preserve_rng_state=False)
    # op-level SAC that is safe for float8: saves matmul outputs, attention and amaxes
    return checkpoint_wrapper(block, context_fn=float8_sac_context_fn, preserve_rng_state=False)


# -- optimization -------------------------------------------------------------------------------

def build_optimizer(model: nn.Module, args: argparse.Namespace) -> torch.optim.Optimizer:
    """AdamW (torchtitan's settings): torch's with fp32 moments, or f8dist's with 8-bit moments
    on each rank's shards ([Note: 8-bit AdamW on shards] in f8dist/optim/adamw.py); both
    checkpoint the same state dict, so a run can resume with the other."""
    hyper = dict(lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95))
    if args.optim_states == "8bit":
        return f8dist.optim.AdamW(model.parameters(), **hyper)
    return torch.optim.AdamW(model.parameters(), foreach=True, **hyper)


# the flags lr_at reads: a checkpoint keeps them ([Note: a resumed schedule])
SCHEDULE = ("lr", "warmup_steps", "steps")


def lr_at(step: int, args) -> float:
    """Linear warmup to --lr, then cosine decay to 10 % at --steps (a function of the step
    and the SCHEDULE flags alone, so a resumed run needs no scheduler state)."""
    if step <= args.warmup_steps:
        return args.lr * step / max(1, args.warmup_steps)
    progress = (step - args.warmup_steps) / max(1, args.steps - args.warmup_steps)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def clip_grad_norm_(params: List[nn.Parameter], max_norm: float, pp_group=None) -> torch.Tensor:
    """Clip by the global norm over all ranks. Gradients of one model can live on different
    meshes (FSDP's dp mesh, or dp x tp) with different placements: the squares of each sharding's
    local gradients are summed over the mesh axes that shard them, one all-reduce each (DTensor's
    norm would reduce a 2-D partial norm with one all-reduce per mesh axis, and warns so).
    ``pp_group``: the ranks of the other pipeline stages, whose squares are summed in too."""
    by_sharding, by_mesh = defaultdict(list), defaultdict(list)
    for p in params:
        if p.grad is not None:
            dt = isinstance(p.grad, DTensor)
            by_sharding[(p.grad.device_mesh, tuple(p.grad.placements)) if dt else None].append(p.grad)
            by_mesh[p.grad.device_mesh if dt else None].append(p)
    squares = []
    for sharding, grads in by_sharding.items():
        local = [g.to_local() if sharding else g for g in grads]
        sq = torch.stack([torch.linalg.vector_norm(t, dtype=torch.float32) for t in local]).square().sum()
        squares.append(sq if sharding is None else reduce_over_shards(sq, *sharding, "sum"))
    total = torch.stack(squares).sum()
    if pp_group is not None:
        dist.all_reduce(total, group=pp_group)
    total = total.sqrt()
    for group in by_mesh.values():  # foreach ops take one mesh at a time
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
    return total


# -- checkpoints --------------------------------------------------------------------------------

# [Note: atomic checkpoints]
# A checkpoint is written to DIR/step-N.partial and renamed to DIR/step-N once complete (DCP's
# .metadata, written last, is on disk when dcp.save returns on any rank), so a job killed while
# saving leaves no step-N that --resume would take and fail to load. --resume takes the newest
# DIR/step-N that holds .metadata, which also skips incomplete directories of older train.py runs.
# RNG states are saved per rank: a run resumed on another number of ranks re-seeds instead.
#
# [Note: verified checkpoints]
# A file can still be damaged after its save (a disk or copy that truncates it, a file overwritten
# with garbage); DCP would then fail with a zip or pickle traceback, or load garbage without a
# word. So rank 0 writes CHECKSUMS (the sha256 of every file of the step) into the step before the
# rename, and --resume verifies the newest step first: a damaged step is named with the file and
# what is wrong, and the newest intact one is taken. A step without CHECKSUMS (an older train.py)
# is taken if DCP can read its .metadata. The price: rank 0 reads the step back once per save and
# once per --resume (the script assumes one file system shared by the ranks, as the rename does).

_STEP_DIR = re.compile(r"step-(\d+)")
CHECKSUMS = "checksums.json"


def _rng_key() -> str:
    return f"rank{dist.get_rank()}"


# [Note: stochastic rounding in checkpoints]
# NVFP4's gradients round with draws keyed on each site's count of casts ([Note: the stochastic
# rounding key] in f8dist/core/cast.py); a checkpoint keeps the counts (json bytes, the same on
# every rank) so that a resumed run draws on as the unbroken one, on any number of ranks: the
# seed is --seed's and the stream the rank's data-parallel index, set when the run starts.


def _as_bytes(obj) -> torch.Tensor:
    return torch.tensor(list(json.dumps(obj, sort_keys=True).encode()), dtype=torch.uint8)


def save_checkpoint(path: str, model, optimizer, batches: ByteBatches, step: int,
                    args: argparse.Namespace) -> None:
    """Save to ``path/step-{step}``, atomically ([Note: atomic checkpoints]), with the flags of
    the learning-rate schedule ([Note: a resumed schedule])."""
    state = {
        "model": get_model_state_dict(model),
        "optimizer": get_optimizer_state_dict(model, optimizer),
        "train": {"step": torch.tensor(step), "batches_step": torch.tensor(batches.step),
                  "schedule": {k: torch.tensor(float(getattr(args, k)), dtype=torch.float64)
                               for k in SCHEDULE},
                  "sr_draws": _as_bytes(stochastic_rounding.counts())},
        "rng": {_rng_key(): torch.get_rng_state()},
    }
    final = os.path.join(path, f"step-{step}")
    partial = final + ".partial"
    if dist.get_rank() == 0:
        shutil.rmtree(partial, ignore_errors=True)  # left by a save that was killed
    dist.barrier()
    dcp.save(state, checkpoint_id=partial)
    if dist.get_rank() == 0:
        write_checksums(partial)  # [Note: verified checkpoints]
        shutil.rmtree(final, ignore_errors=True)  # this step, saved by an earlier run
        os.rename(partial, final)
        print(f"saved checkpoint {final}", flush=True)
    dist.barrier()


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_checksums(directory: str) -> None:
    """Write ``directory/CHECKSUMS``: the sha256 of each of its files ([Note: verified checkpoints])."""
    sums = {name: _sha256(os.path.join(directory, name)) for name in sorted(os.listdir(directory))
            if name != CHECKSUMS and os.path.isfile(os.path.join(directory, name))}
    with open(os.path.join(directory, CHECKSUMS + ".tmp"), "w") as f:
        json.dump(sums, f, indent=1)
    os.replace(os.path.join(directory, CHECKSUMS + ".tmp"), os.path.join(directory, CHECKSUMS))


def damage(directory: str) -> Optional[str]:
    """What is wrong with the checkpoint ``directory``, or None if it is intact."""
    listed = os.path.join(directory, CHECKSUMS)
    if not os.path.exists(listed):  # an older train.py: DCP's .metadata must at least read
        try:
            dcp.FileSystemReader(directory).read_metadata()
        except Exception as e:  # noqa: BLE001 (pickle, EOF, ...: all mean unreadable)
            return f".metadata unreadable ({type(e).__name__}) and no {CHECKSUMS} to check the files"
        return None
    try:
        with open(listed) as f:
            sums = json.load(f)
    except ValueError:
        return f"{CHECKSUMS} unreadable"
    for name, expected in sums.items():
        file = os.path.join(directory, name)
        if not os.path.exists(file):
            return f"{name} missing"
        if _sha256(file) != expected:
            return f"{name} differs from what was saved ({os.path.getsize(file)} bytes now)"
    return None


def latest_checkpoint(path: str, log=print) -> Optional[str]:
    """The newest complete and intact checkpoint ``path/step-N`` (one with DCP's ``.metadata``
    whose files match their checksums: [Note: verified checkpoints]), or None; ``log`` names each
    damaged step passed over."""
    steps = [
        int(m.group(1)) for name in (os.listdir(path) if os.path.isdir(path) else [])
        if (m := _STEP_DIR.fullmatch(name)) and os.path.exists(os.path.join(path, name, ".metadata"))
    ]
    for step in sorted(steps, reverse=True):
        checkpoint = os.path.join(path, f"step-{step}")
        wrong = damage(checkpoint)
        if wrong is None:
            return checkpoint
        log(f"checkpoint {checkpoint} is damaged: {wrong}; trying the one before it")
    return None


def load_checkpoint(checkpoint: str, model, optimizer, batches: ByteBatches, seed: int):
    """Load ``checkpoint``; returns (its step, a note for the log, its schedule flags: a dict of
    SCHEDULE, None in a checkpoint of an older train.py). Model and optimizer state are
    resharded to this run's mesh; RNG states come back if the run has the checkpoint's number of
    ranks, else every rank is re-seeded from ``seed``, the step and its rank."""
    saved = dcp.FileSystemReader(checkpoint).read_metadata().state_dict_metadata
    saved_ranks = sum(key.startswith("rng.") for key in saved)
    same_ranks = saved_ranks == dist.get_world_size()
    train_state = {"step": torch.tensor(0), "batches_step": torch.tensor(0)}
    if f"train.schedule.{SCHEDULE[0]}" in saved:
        train_state["schedule"] = {k: torch.tensor(0.0, dtype=torch.float64) for k in SCHEDULE}
    if "train.sr_draws" in saved:  # [Note: stochastic rounding in checkpoints]
        train_state["sr_draws"] = torch.empty(saved["train.sr_draws"].size, dtype=torch.uint8)
    state = {
        "model": get_model_state_dict(model),
        "optimizer": get_optimizer_state_dict(model, optimizer),
        "train": train_state,
    }
    if same_ranks:
        state["rng"] = {_rng_key(): torch.get_rng_state()}
    planner = Float8LoadPlanner()  # [Note: loading across recipes] in f8dist/policy/checkpoint.py
    dcp.load(state, checkpoint_id=checkpoint, planner=planner)
    set_model_state_dict(model, state["model"])
    restarted = planner.restart_missing(model)
    recipes = ""
    if restarted:
        recipes = (f"; delayed-scaling histories restarted for {len(restarted)} linear(s): the "
                   "checkpoint holds none (saved with another --float8 recipe), so the next step "
                   "is a first step")
    elif planner.unused_delayed_state:
        recipes = "; the checkpoint's delayed-scaling state is not used by this --float8 recipe"
    set_optimizer_state_dict(model, optimizer, state["optimizer"])
    batches.load_state_dict({"step": int(state["train"]["batches_step"])})
    if "sr_draws" in state["train"]:
        stochastic_rounding.load_counts(json.loads(bytes(state["train"]["sr_draws"].tolist())))
    step = int(state["train"]["step"])
    schedule = state["train"].get("schedule")
    schedule = schedule and {k: float(v) for k, v in schedule.items()}
    if same_ranks:
        torch.set_rng_state(state["rng"][_rng_key()])
        return step, "RNG states restored" + recipes, schedule
    torch.manual_seed(hash((seed, step, dist.get_rank())) % 2**63)
    return step, (f"saved on {saved_ranks} rank(s), resumed on {dist.get_world_size()}: model and "
                  "optimizer resharded, RNG re-seeded per rank from --seed, the step and the rank"
                  + recipes), schedule


# [Note: a resumed schedule]
# The learning rate is lr_at(step) of this run's --lr, --warmup-steps and --steps, as in
# torchtitan, whose resumed scheduler keeps only the step and takes the rest from the config: so
# --resume with a larger --steps extends training (the cosine stretched to the new end). A
# checkpoint keeps the schedule's flags, and a resumed run that changes them says so in one line
# with the learning rate of its next step under each, since it no longer continues the saved run
# (a 30-step checkpoint resumed to 60 ends elsewhere than 60 steps in one run). A checkpoint at or
# past --steps leaves nothing to train: one line says so, before anything is loaded.


def schedule_change(saved: Optional[Dict[str, float]], args: argparse.Namespace,
                    step: int) -> Optional[str]:
    """The line that says how this run's schedule differs from the checkpoint's (``saved``), or
    None: [Note: a resumed schedule]."""
    if saved is None:
        return None
    ours = {k: float(getattr(args, k)) for k in SCHEDULE}
    changed = [k for k in SCHEDULE if ours[k] != saved[k]]
    if not changed:
        return None
    flags = ", ".join(f"--{k.replace('_', '-')} {ours[k]:g} (saved {saved[k]:g})" for k in changed)
    then = argparse.Namespace(**saved)
    return (f"learning-rate schedule changed on resume: {flags}; it follows this run's flags, so "
            f"step {step + 1} takes lr {lr_at(step + 1, args):.3g} (the saved run's: "
            f"{lr_at(step + 1, then):.3g}) and the losses are not the saved run's continued")


# -- logging ------------------------------------------------------------------------------------

# [Note: the memory line]
# Every logged step prints the peak and its parts on rank 0 (this rank's shards):
#   peak         CUDA: torch.cuda.max_memory_allocated since the start; CPU: the process's peak RSS
#   params       the parameters and buffers (FSDP2: the fp32 shards, not the bf16 all-gathered copy)
#   grads        the gradients after backward (fp32 shards)
#   optim        every tensor in the optimizer's state (8 bytes per parameter for torch's AdamW,
#                2.125 for --optim-states 8bit)
#   act          what the last micro-batch's forward (and loss) keeps for backward: on CUDA the
#                allocator's growth over the forward; on the CPU the tensors autograd saves
#                (pack hooks, counted by storage once the forward is done, parameters and buffers
#                excluded),
#                which misses what a selective-checkpoint policy caches (--ac sac: its inputs only)
# docs/performance.md holds the same split per parameter and per token from
# scripts/memory_budget.py.


def memory_gib(device: torch.device) -> float:
    """The peak of [Note: the memory line], GiB."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2**30  # peak RSS (Linux: KiB)


def _local(t):
    return t.to_local() if isinstance(t, DTensor) else t


def local_nbytes(tensors) -> int:
    """Bytes of this rank's part of each tensor (a DTensor's local shard); non-tensors count 0."""
    parts = (_local(t) for t in tensors)
    return sum(t.numel() * t.element_size() for t in parts if isinstance(t, torch.Tensor))


def memory_split(model: nn.Module, optimizer: torch.optim.Optimizer) -> Dict[str, int]:
    """params, grads and optim of [Note: the memory line], bytes on this rank."""
    return {
        "params": local_nbytes([*model.parameters(), *model.buffers()]),
        "grads": local_nbytes(p.grad for p in model.parameters()),
        "optim": local_nbytes(v for state in optimizer.state.values() for v in state.values()),
    }


@contextlib.contextmanager
def kept_for_backward(device: torch.device, model: nn.Module, out: Dict[str, int]):
    """``out["act"]``: the bytes the forward inside keeps for backward ([Note: the memory line])."""
    if device.type == "cuda":
        before = torch.cuda.memory_allocated(device)
        yield
        out["act"] = max(out.get("act", 0), torch.cuda.memory_allocated(device) - before)
        return
    state = [*model.parameters(), *model.buffers()]  # counted as params
    params = {st.data_ptr() for p in state for st in storages(_local(p))}
    saved = {}

    def pack(t):
        # FSDP2's all-gathered weights are Parameters too (freed after forward, not activations)
        if not (isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter)):
            for storage in storages(t):
                if storage.data_ptr() not in params:
                    saved[storage.data_ptr()] = storage
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield
    out["act"] = max(out.get("act", 0), sum(s.nbytes() for s in saved.values()))


def _size(nbytes: float) -> str:
    return f"{nbytes / 2**30:.2f}GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f}MiB"


def memory_text(device: torch.device, split: Dict[str, int]) -> str:
    """``memory: 0.41GiB (params 0.5MiB grads 0.5MiB optim 1.1MiB act 2.3MiB)``."""
    keys = [k for k in ("params", "grads", "optim", "act") if k in split]
    parts = " ".join(f"{k} {_size(split[k])}" for k in keys)
    return f"memory: {memory_gib(device):.2f}GiB ({parts})"


def bf16_peak_flops(device: torch.device) -> Optional[float]:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in _BF16_PEAK.items() if key in name), None)


def _eta(seconds: float) -> str:
    return str(timedelta(seconds=int(seconds)))


def eta_seconds(now: float, first_step_end: float, done: int, left: int, start: float) -> float:
    """Seconds until the last step, at the pace of the steps after the first (which compiles,
    allocates and warms up: with --compile it takes minutes the others do not)."""
    if done > 1:
        return (now - first_step_end) / (done - 1) * left
    return (now - start) / done * left


class Throughput:
    """The ``tps`` of a log line: tokens per second over the steps since the last line, leaving
    out the run's first step (it compiles under --compile, for minutes, and allocates and warms
    up) unless it is the only step of the line, as the ETA and the done line do."""

    def __init__(self, now: float):
        self.since, self.tokens, self.steps = now, 0, 0
        self.first = None  # (start, tokens) of the run's first step while it is all the window

    def step(self, tokens: int, now: float) -> None:
        """A step of ``tokens`` ended at ``now``."""
        self.steps += 1
        if self.steps == 1:  # the window starts after it, unless tps() comes now
            self.first, self.since = (self.since, tokens), now
        else:
            self.first = None
            self.tokens += tokens

    def tps(self, now: float) -> float:
        """Tokens per second since the last call (or the start); starts a new window."""
        since, tokens = self.first or (self.since, self.tokens)
        self.since, self.tokens, self.first = now, 0, None
        return tokens / (now - since)


def float8_linears_text(model: nn.Module, recipe: str) -> str:
    """Which linears (and an MoE model's grouped experts) run in float8 and which stay high
    precision, one line; the blocks' indices are folded (``layers.*.attention.wq`` in every block, ``layers.{1,3}.attention.wo`` in some)."""
    blocks = [str(i) for i in range(len(model.layers))]

    def folded(names):
        where: Dict[str, List[str]] = {}
        for n in names:
            m = re.fullmatch(r"layers\.(\d+)\.(.*)", n)
            where.setdefault(f"layers.{{}}.{m.group(2)}" if m else n, []).append(m.group(1) if m else "")
        return ", ".join(k.format("*" if v == blocks else "{" + ",".join(v) + "}") for k, v in where.items()) or "none"

    def split(kind, float8_kind):
        names = {canonical_name(n): m for n, m in model.named_modules() if isinstance(m, kind)}
        fp8 = [n for n, m in names.items() if isinstance(m, float8_kind)]
        return names, fp8, [n for n in names if n not in fp8]

    names, fp8, hp = split(nn.Linear, f8dist.Float8Linear)
    text = (f"float8 linears ({recipe}): {len(fp8)} of {len(names)}: {folded(fp8)} | "
            f"high precision: {len(hp)}: {folded(hp)}")
    experts, fp8, hp = split(GroupedExperts, Float8GroupedExperts)
    if experts:  # an MoE model's routed experts (one module per block): grouped gemms, not linears
        text += (f" || float8 grouped experts: {len(fp8)} of {len(experts)}: {folded(fp8)} | "
                 f"high precision: {len(hp)}: {folded(hp)}")
    return text


# -- the loop -----------------------------------------------------------------------------------

def train(args: argparse.Namespace) -> Dict[str, object]:
    """Run the training loop; returns ``{"losses": [...], "steps": [...]}`` (losses averaged over
    data-parallel ranks) on every rank."""
    device = init_distributed()
    mesh = build_mesh(args.tp, device, args.ep, args.pp, args.cp, args.dp_replicate)
    rank, world = dist.get_rank(), dist.get_world_size()
    dp_rank, dp_size = dp_mesh_of(mesh).get_local_rank(), dp_mesh_of(mesh).size()
    cp_rank = mesh["cp"].get_local_rank() if args.cp > 1 else 0
    torch.manual_seed(args.seed)
    stochastic_rounding.reset(stream=sr_stream_of(mesh))  # each replica its own draws

    model = build_model(args, mesh, device)  # with --pp: this rank's stage
    margs = model.args
    pipe = build_schedule(model, args, mesh) if args.pp > 1 else None
    whole = meta_model(args) if args.pp > 1 else model  # for the lines that describe the model
    optimizer = build_optimizer(model, args)
    batches = ByteBatches(seq_len=args.seq_len, batch_size=args.batch_size, seed=args.seed,
                          dp_rank=dp_rank, dp_size=dp_size)
    accum = args.grad_accum_steps

    start = 0
    if args.resume:  # rank 0 verifies ([Note: verified checkpoints]); every rank loads its pick
        found = [latest_checkpoint(args.checkpoint_dir, log=lambda line: print(line, flush=True))
                 if rank == 0 else None]
        dist.broadcast_object_list(found, src=0)
        checkpoint = found[0]
        if checkpoint is None:
            raise FileNotFoundError(f"--resume: no complete, intact step-N checkpoint in {args.checkpoint_dir}")
        saved_step = int(_STEP_DIR.fullmatch(os.path.basename(checkpoint)).group(1))
        if saved_step >= args.steps:  # [Note: a resumed schedule]
            if rank == 0:
                print(f"nothing to do: {checkpoint} is at step {saved_step} and --steps is "
                      f"{args.steps}; raise --steps to train on", flush=True)
            return {"steps": [], "losses": []}
        start, note, schedule = load_checkpoint(checkpoint, model, optimizer, batches, args.seed)
        if rank == 0:
            print(f"resumed from {checkpoint} at step {start} ({note})", flush=True)
            change = schedule_change(schedule, args, start)
            if change:
                print(change, flush=True)

    if rank == 0:
        n_params = sum(p.numel() for p in whole.parameters())
        print(f"model: {margs.n_layers} layers, dim {margs.dim}, {n_params:,} params | "
              f"float8: {args.float8} | optim states: {args.optim_states} | "
              f"mesh: dp={dp_size} tp={args.tp} ep={args.ep}"
              + (f" cp={args.cp}" if args.cp > 1 else "")
              + (f" (dp_replicate={args.dp_replicate})" if args.dp_replicate > 1 else "")
              + (f" pp={args.pp} ({args.pp_schedule}, {args.pp_microbatches} micro-batches)"
                 if pipe else "") + f" | ac: {args.ac} | "
              + (f"moe: {args.moe_experts} experts top-{args.moe_top_k} | " if args.moe_experts else "")
              + f"compile: {args.compile} | {device.type} x {world}", flush=True)

    if rank == 0:
        print(float8_linears_text(whole, args.float8), flush=True)

    peak = bf16_peak_flops(device)
    tokens_per_step = args.batch_size // dp_size * args.seq_len // args.cp  # per rank
    steps, losses = [], []
    stats = None
    if args.float8_stats_every:
        from f8dist.debug import Float8StatsLogger

        # the tables go to their files, not into the log: one line at the end says where
        stats = Float8StatsLogger(model, every=args.float8_stats_every,
                                  out_dir=args.float8_stats_dir, print_fn=None)
    if args.compile and rank == 0:
        print(f"torch.compile: compiling the {margs.n_layers} transformer block(s) in step "
              f"{start + 1}; the first log line can take minutes", flush=True)
    t_start = time.perf_counter()
    first_step_end, rate = t_start, Throughput(t_start)

    for step in range(start + 1, args.steps + 1):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, args)
        inputs, targets = (t.to(device) for t in next(batches))  # [b, S], [b, S]
        if args.cp > 1:  # this rank's shard of every sequence: [Note: context parallelism in train.py]
            inputs, targets = (t.chunk(args.cp, dim=1)[cp_rank] for t in (inputs, targets))  # [b, S / cp]
        logged = rank == 0 and (step % args.log_every == 0 or step == args.steps)
        split: Dict[str, int] = {}  # [Note: the memory line], on logged steps
        # --float8-stats-every N: record this step's float8 casts if step % N == 0
        with stats.step(step) if stats is not None else contextlib.nullcontext():
            if pipe is not None:  # the memory line measures no act
                loss = pipeline_step(pipe, model, inputs, targets)
            else:
                loss = 0.0
                for x, y in zip(inputs.chunk(accum), targets.chunk(accum)):  # [b / accum, S]
                    measured = kept_for_backward(device, model, split) if logged else None
                    with measured or contextlib.nullcontext():
                        logits = model(x)  # [b / accum, S, V]
                        micro = next_byte_loss(logits, y) / accum
                        if args.moe_experts:  # the load-balancing loss ([Note: routing], moe.py)
                            micro = micro + model.aux_loss() / accum
                    micro.backward()
                    loss = loss + micro.detach()
        grad_norm = clip_grad_norm_(list(model.parameters()), args.max_norm,
                                    mesh["pp"].get_group() if pipe else None)
        if args.compile and rank == 0 and step == start + 1:
            print(f"compiled: step {step} took {time.perf_counter() - t_start:.0f}s", flush=True)
        if args.float8 == "delayed":  # one MAX all-reduce: the step's amaxes into the histories
            f8dist.sync_float8_amax_and_scale_history(model)
        optimizer.step()
        if logged:
            split.update(memory_split(model, optimizer))
        optimizer.zero_grad(set_to_none=True)
        if args.float8_all_gather and args.float8 == "tensorwise":
            # one all-reduce for the scales of every float8 weight's next all-gather
            precompute_float8_dynamic_scale_for_fsdp(model)

        global_loss = loss.clone()
        dist.all_reduce(global_loss)  # sum over all ranks; tp ranks hold equal losses, cp ranks equal shards
        global_loss = float(global_loss) / (world // args.pp)  # --pp: the last stage's ranks
        steps.append(step)
        losses.append(global_loss)
        now = time.perf_counter()
        rate.step(tokens_per_step, now)
        if step == start + 1:
            first_step_end = now

        if logged:
            tps = rate.tps(now)
            line = (f"step: {step}  loss: {global_loss:.4f}  grad_norm: {float(grad_norm):.4f}  "
                    f"{memory_text(device, split)}  tps: {tps:,.0f}")
            if peak is not None:
                mfu = 100 * margs.flops_per_token(args.seq_len) / args.pp * tps / peak
                line += f"  mfu(vs bf16 peak): {mfu:.2f}%"
            eta = eta_seconds(now, first_step_end, step - start, args.steps - step, t_start)
            print(f"{line}  [{step}/{args.steps} eta {_eta(eta)}]", flush=True)

        if args.checkpoint_dir and (
            step == args.steps or (args.checkpoint_every and step % args.checkpoint_every == 0)
        ):
            save_checkpoint(args.checkpoint_dir, model, optimizer, batches, step, args)

    if stats is not None:
        written = stats.close()  # the last table and the PNG plot over steps
        if rank == 0:
            print(f"float8 stats of steps {', '.join(map(str, stats.recorder.steps))}: "
                  f"{', '.join(written)}", flush=True)
    result = {"steps": steps, "losses": losses}
    if rank == 0 and args.metrics_file:
        os.makedirs(os.path.dirname(args.metrics_file) or ".", exist_ok=True)
        with open(args.metrics_file, "w") as f:
            json.dump({"args": vars(args), **result}, f)
    if rank == 0 and steps:
        seconds = time.perf_counter() - t_start
        after_first = len(steps) - 1
        rate = (tokens_per_step * after_first / (time.perf_counter() - first_step_end)
                if after_first else tokens_per_step * len(steps) / seconds)
        print(f"done: {len(steps)} steps ({steps[0]}-{steps[-1]}) in {_eta(seconds)}, "
              f"{rate:,.0f} tokens/s per rank{' after the first step' if after_first else ''}, "
              f"peak memory {memory_gib(device):.2f}GiB, final loss {losses[-1]:.4f}"
              + (f", metrics in {args.metrics_file}" if args.metrics_file else ""), flush=True)
    return result


def main(argv: Optional[Sequence[str]] = None) -> None:
    with exit_cleanly():  # barrier, destroy the group, exit: [Note: gloo teardown]
        train(parse_args(argv))


if __name__ == "__main__":
    main()
