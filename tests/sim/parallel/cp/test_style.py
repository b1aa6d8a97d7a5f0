"""Float8 context parallelism (f8dist/parallel/cp/) on 2 and 4 simulated ranks in one process
([Note: simulating ranks in one process] in tests/sim/__init__.py) against one device running the
same K/V quantization (``quantize_kv``) in front of the same attention ([Note: float8 context
parallelism] in f8dist/parallel/cp/style.py): outputs and dQ bit for bit, dK and dV at >= 120 dB
(fp32; each rank sums its queries' contributions, then the reduce-scatter sums the ranks, so only
the summation order differs), and the all-gather's exact bytes."""

import dataclasses

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import parallelize_module

from f8dist.config import E4M3, E5M2
from f8dist.core.numerics import sqnr
from f8dist.models.llama import ScaledDotProductAttention
from f8dist.parallel.cp import KV_SPEC, Float8ContextParallel, quantize_kv
from f8dist.testing import count_collectives
from tests.sim.threads import run_threads

B, HQ, HKV, S, D = 1, 4, 2, 32, 64  # grouped-query attention: K and V gathered before the repeat


def _inputs():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, HQ, S, D, generator=g)
    k, v = (torch.randn(B, HKV, S, D, generator=g) for _ in range(2))
    return q, k, v, torch.randn(B, HQ, S, D, generator=g)


def _one_device(q, k, v, grad):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = ScaledDotProductAttention()(q, quantize_kv(k), quantize_kv(v), is_causal=True)
    out.backward(grad)
    return out.detach(), q.grad, k.grad, v.grad


def _on_ranks(world, style, q, k, v, grad):
    """Each rank's (output, dQ, dK, dV) of its sequence shard, and its collective counts."""
    def rank_main(rank):
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
        sdpa = parallelize_module(ScaledDotProductAttention(), mesh, style)
        shard = [t.chunk(world, dim=2)[rank].clone().requires_grad_() for t in (q, k, v)]
        with count_collectives() as counts:
            out = sdpa(*shard, is_causal=True)
            out.backward(grad.chunk(world, dim=2)[rank])
        return (out.detach(), *(t.grad for t in shard)), counts

    results = run_threads(world, rank_main)
    parts = [torch.cat([r[0][i] for r in results], dim=2) for i in range(4)]
    return parts, [r[1] for r in results]


@pytest.mark.parametrize("world", [2, 4])
def test_context_parallel_matches_one_device_with_float8_kv(world):
    q, k, v, grad = _inputs()
    out, dq, dk, dv = _one_device(q, k, v, grad)
    (cp_out, cp_dq, cp_dk, cp_dv), counts = _on_ranks(world, Float8ContextParallel(), q, k, v, grad)
    assert torch.equal(cp_out, out) and torch.equal(cp_dq, dq)
    assert sqnr(dk, cp_dk) >= 120 and sqnr(dv, cp_dv) >= 120, (sqnr(dk, cp_dk), sqnr(dv, cp_dv))
    # per rank: K and V, each its e4m3 bytes and its fp32 scale per token and head
    gathered = 2 * B * HKV * S * (D + 4)
    for c in counts:
        gather = c.expect("all_gather")
        assert (gather.calls, gather.output_bytes) == (4, gathered)
        assert gather.output_bytes / (2 * B * HKV * S * D * 2) == (D + 4) / (2 * D)  # ~0.53x bf16
        assert c.expect("reduce_scatter").input_bytes == 2 * B * HKV * S * D * 4  # fp32 dK, dV


@pytest.mark.parametrize("dtype,floor_db", [(E4M3, 28), (E5M2, 22)])
def test_context_parallel_reduce_scatters_float8_gradients(dtype, floor_db):
    """``grad_spec``: dK and dV cross as float8 bytes and per-token scales (one all-to-all each
    for bytes and scales), summed in fp32 (SQNR floors: scripts/cp_grad_sqnr.py measures 32 and
    26 dB); forward and dQ unchanged."""
    world = 2
    q, k, v, grad = _inputs()
    out, dq, dk, dv = _one_device(q, k, v, grad)
    style = Float8ContextParallel(grad_spec=dataclasses.replace(KV_SPEC, dtype=dtype))
    (cp_out, cp_dq, cp_dk, cp_dv), counts = _on_ranks(world, style, q, k, v, grad)
    assert torch.equal(cp_out, out) and torch.equal(cp_dq, dq)
    assert min(sqnr(dk, cp_dk), sqnr(dv, cp_dv)) >= floor_db, (sqnr(dk, cp_dk), sqnr(dv, cp_dv))
    for c in counts:
        assert c["reduce_scatter"].calls == 0
        sent = c.expect("all_to_all")
        # 0.53x the bytes of a bf16 reduce-scatter of dK and dV (2 bytes per element)
        assert (sent.calls, sent.input_bytes) == (4, 2 * B * HKV * S * (D + 4))


def test_style_refuses_a_scale_over_the_sequence():
    with pytest.raises(ValueError, match="kv_spec must scale each token and head"):
        Float8ContextParallel(kv_spec=dataclasses.replace(KV_SPEC, axis=-2))
    assert repr(Float8ContextParallel()) == (
        "Float8ContextParallel(seq_dim=2, kv_dtype=torch.float8_e4m3fn, grad_dtype=None)")
