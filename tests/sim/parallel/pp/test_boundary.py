"""Pipeline parallelism with float8 stage boundaries ([Note: the float8 stage boundary] in
f8dist/parallel/pp/boundary.py) through torch.distributed.pipelining's schedules, on simulated ranks
(tests/sim/threads.py gives the threaded group send and recv), against one device running the
same stages one after the other: bit for bit, and the bytes each boundary sends."""

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

from f8dist import Float8LinearConfig, convert_to_float8_training
from f8dist.models import ModelArgs, Transformer
from f8dist.models.llama_pp import pipeline_stage, split_llama
from f8dist.testing import count_collectives
from tests.sim.threads import run_threads

ARGS = ModelArgs(dim=64, n_layers=2, n_heads=4, max_seq_len=16)
MICROBATCHES, MB, SEQ = 2, 2, 8
DTYPE = torch.bfloat16


def _model(recipe: str) -> Transformer:
    model = Transformer(ARGS)
    model.init_weights(seed=0)
    config = Float8LinearConfig.from_recipe_name(recipe)
    convert_to_float8_training(model, config=config, module_filter_fn=lambda m, fqn: fqn != "output")
    return model.to(DTYPE)


def _loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), target.flatten())


def _batch(step: int):
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, ARGS.vocab_size, (MICROBATCHES * MB, SEQ), generator=g)
    return tokens, torch.roll(tokens, -1, dims=1)


def _one_device(recipe: str, steps: int):
    """Both stages on one device, micro-batch after micro-batch (gradients accumulated)."""
    model = _model(recipe)
    stages = [split_llama(model, s, 2) for s in range(2)]
    losses = []
    for step in range(steps):
        tokens, target = _batch(step)
        for x, y in zip(tokens.chunk(MICROBATCHES), target.chunk(MICROBATCHES)):
            loss = _loss(stages[1](stages[0](x)), y)
            loss.backward()
            losses.append(loss.detach())
    return losses, {n: p.grad for n, p in model.named_parameters()}


def _pipelined(schedule, recipe: str, steps: int, float8: bool = True):
    def rank_main(rank: int):
        stage = split_llama(_model(recipe), rank, 2, float8=float8)
        pipe = schedule(pipeline_stage(stage, rank, 2, (MB, SEQ), None, DTYPE), MICROBATCHES,
                        loss_fn=_loss, scale_grads=False)
        losses = []
        for step in range(steps):
            tokens, target = _batch(step)
            step_losses = []
            with count_collectives() as counts:
                if rank == 0:
                    pipe.step(tokens)
                else:
                    pipe.step(target=target, losses=step_losses)
            losses += [loss.detach() for loss in step_losses]
        grads = {n: p.grad for n, p in stage.named_parameters()}
        return losses, grads, counts["send"].input_bytes  # the last step's

    return run_threads(2, rank_main)


@pytest.mark.parametrize("schedule", [ScheduleGPipe, Schedule1F1B])
def test_float8_boundary_equals_one_device(schedule):
    losses, grads = _one_device("tensorwise", steps=2)
    (_, grads0, _), (pp_losses, grads1, _) = _pipelined(schedule, "tensorwise", steps=2)
    assert len(pp_losses) == len(losses) == 2 * MICROBATCHES
    for a, b in zip(pp_losses, losses):
        assert torch.equal(a, b)
    assert set(grads0) | set(grads1) == set(grads) and not set(grads0) & set(grads1)
    for name, grad in {**grads0, **grads1}.items():
        assert torch.equal(grad, grads[name]), name


def test_float8_boundary_bytes():
    tokens = MICROBATCHES * MB * SEQ
    fp8 = _pipelined(Schedule1F1B, "tensorwise", steps=2)
    bf16 = _pipelined(Schedule1F1B, "tensorwise", steps=2, float8=False)
    # activations forward (rank 0), their gradients back (rank 1): a token's e4m3 / e5m2 bytes
    # and its float32 scale, against its bf16 values
    for rank in range(2):
        assert fp8[rank][2] == tokens * (ARGS.dim + 4)
        assert bf16[rank][2] == tokens * ARGS.dim * 2
    assert fp8[0][2] / bf16[0][2] == (ARGS.dim + 4) / (2 * ARGS.dim)  # 0.53125


def test_delayed_amax_group_and_fsdp_inside_stages():
    # pp 2 x dp 2: each stage sharded by FSDP2 over its dp pair (the same batch on both, so their
    # averaged gradients are one device's), delayed scaling synced over the stage's dp group
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from f8dist import sync_float8_amax_and_scale_history
    from f8dist.policy.delayed import set_amax_group

    steps = 2
    model = _model("delayed")
    stages = [split_llama(model, s, 2) for s in range(2)]
    losses = []
    for step in range(steps):
        tokens, target = _batch(step)
        model.zero_grad()  # FSDP2 sums micro-batches before adding to a step's gradients
        for x, y in zip(tokens.chunk(MICROBATCHES), target.chunk(MICROBATCHES)):
            loss = _loss(stages[1](stages[0](x)), y)
            loss.backward()
            losses.append(loss.detach())
        sync_float8_amax_and_scale_history(model)
    grads = {n: p.grad for n, p in model.named_parameters()}  # the last step's

    def rank_main(rank: int):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
        pp = mesh["pp"].get_local_rank()
        stage = split_llama(_model("delayed"), pp, 2)
        set_amax_group(stage, mesh["dp"])
        for layer in stage.layers.values():
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(stage, mesh=mesh["dp"])
        pipe = Schedule1F1B(pipeline_stage(stage, pp, 2, (MB, SEQ), mesh["pp"].get_group(), DTYPE),
                            MICROBATCHES, loss_fn=_loss, scale_grads=False)
        out = []
        for step in range(steps):
            tokens, target = _batch(step)
            step_losses = []
            stage.zero_grad()
            if pp == 0:
                pipe.step(tokens)
            else:
                pipe.step(target=target, losses=step_losses)
            out += [loss.detach() for loss in step_losses]
            with count_collectives() as counts:
                sync_float8_amax_and_scale_history(stage)
        reduces = counts.expect("all_reduce")
        grads = {n: p.grad.full_tensor() for n, p in stage.named_parameters()}
        return out, grads, (reduces.calls, reduces.calls_over(mesh["dp"], "max"))

    results = run_threads(4, rank_main)
    for rank, (pp_losses, pp_grads, sync_reduces) in enumerate(results):
        assert sync_reduces == (1, 1)  # one MAX all-reduce per step, over the stage's dp pair
        if rank >= 2:  # the last stage's ranks
            assert len(pp_losses) == len(losses)
            assert all(torch.equal(a, b) for a, b in zip(pp_losses, losses))
        for name, grad in pp_grads.items():
            assert torch.equal(grad, grads[name]), (rank, name)
