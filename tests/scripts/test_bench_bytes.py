"""scripts/bench_bytes.py: inductor's byte accounting of a compiled fwd+bwd, on tiny shapes.

The figures are deterministic (inductor's static count, see [Note: inductor accounting] in the
script), so they are asserted: bf16 against the gemm byte formula, f8dist's ratios against the
bounds the current code meets (a change that makes float8 move more bytes fails here).
"""

import os
import sys

import pytest
import torch

SCRIPTS = os.path.join(os.path.dirname(__file__), "..", "..", "scripts")
sys.path.insert(0, os.path.abspath(SCRIPTS))

import bench_bytes  # noqa: E402

# f8dist bytes / bf16 bytes and generated kernels of the --small FFN block, as measured when the
# test was written (scripts/bench_bytes.py --small --blocks ffn); lower them as casts get cheaper.
FFN_BOUNDS = {
    "tensorwise": (1.537, 45),
    "rowwise": (1.473, 93),
    "rowwise_with_gw_hp": (1.329, 64),
    "delayed": (1.209, 64),  # the default, rescale_out_of_range=False
    "delayed_rescaled": (1.538, 75),
}


@pytest.fixture(scope="module")
def ffn():
    return bench_bytes.run(["ffn"], bench_bytes.RECIPES, small=True, torchao=False)


@pytest.fixture(scope="module")
def linear_logged():
    """The --small linear in bf16 and four of the recipes, compiled once for every linear test, and
    inductor's own counters over those compiles (what TORCH_LOGS=inductor_metrics logs)."""
    from torch._inductor import metrics

    torch._logging.set_logs(inductor_metrics=True)
    try:
        metrics.reset()
        results = bench_bytes.run(
            ["linear"], ["tensorwise", "rowwise", "mxfp8", "mxfp8_square_weights_kept"],
            small=True, torchao=False)
        logged = metrics.num_bytes_accessed, metrics.generated_kernel_count
    finally:
        torch._logging.set_logs()
    return results, logged


@pytest.fixture(scope="module")
def linear(linear_logged):
    return linear_logged[0]


def test_bf16_linear_is_its_three_gemms(linear):
    """A bf16 linear compiles to its three gemms and nothing else: each reads its two operands
    and writes its output, 2 bytes an element."""
    args = bench_bytes.model_args(small=True)
    acc = linear[("linear", "bf16", "-")]
    m, k, n = args.max_seq_len, args.dim, args.ffn_hidden_dim
    assert acc.kernels == 0
    assert [k.kind for k in acc.breakdown] == ["gemm"] * 3
    assert acc.bytes == 3 * 2 * (m * k + n * k + m * n)
    assert sum(k.bytes for k in acc.breakdown) == acc.bytes


def test_figures_are_what_inductor_metrics_logs(linear_logged):
    """The totals equal inductor's own counters (what TORCH_LOGS=inductor_metrics logs)."""
    results, (logged_bytes, logged_kernels) = linear_logged
    assert logged_bytes == sum(acc.bytes for acc in results.values())
    assert logged_kernels == sum(acc.kernels for acc in results.values()) > 0


@pytest.mark.skipif(not torch.__version__.startswith("2.13"),
                    reason="FFN_BOUNDS are of torch 2.13's inductor (CI's pin): 2.11 lowers differently")
def test_ffn_bytes_within_bounds(ffn):
    bf16 = ffn[("ffn", "bf16", "-")]
    assert bf16.kernels == 14
    for recipe, (bound, kernels) in FFN_BOUNDS.items():
        acc = ffn[("ffn", "f8dist", recipe)]
        ratio = acc.bytes / bf16.bytes
        assert ratio <= bound, f"{recipe}: {ratio:.4f} > {bound}"
        assert acc.kernels <= kernels, recipe
        # float8 moves more than bf16 does at these shapes (small tensors: scales count)
        assert ratio > 1.0, recipe


def test_delayed_casts_without_rescaling_move_fewer_bytes(ffn):
    """[Note: the price of re-scaling] in f8dist/policy/delayed/scale.py: a delayed cast with the history's
    scale needs no amax before it, so it fuses into its producer (any torch version)."""
    counted, rescaled = (ffn[("ffn", "f8dist", r)].bytes for r in ("delayed", "delayed_rescaled"))
    tensorwise = ffn[("ffn", "f8dist", "tensorwise")].bytes
    assert counted < 0.9 * rescaled and counted < tensorwise


def _assert_fewer_bytes_than_patched(ffn, recipe: str) -> None:
    """The FFN of ``recipe`` in the ``ffn`` fixture moves under 95% of the bytes it moves when
    measured again now, with the caller's monkeypatch undoing one byte cut."""
    patched = bench_bytes.run(["ffn"], [recipe], small=True, torchao=False)[("ffn", "f8dist", recipe)]
    kept = ffn[("ffn", "f8dist", recipe)]
    assert kept.bytes < 0.95 * patched.bytes, (recipe, kept.bytes, patched.bytes)


def test_casts_that_wait_for_their_amax_read_stored_tensors(ffn, monkeypatch):
    """[Note: a cast that waits for its amax] in f8dist/core/scaling.py: without the ``in_memory``
    views, inductor recomputes SwiGLU's gradients in every pass of their casts (any torch)."""
    import f8dist.core.cast
    import f8dist.policy.delayed.scale

    def inlined(x):
        return x

    monkeypatch.setattr(f8dist.core.cast, "in_memory", inlined)
    monkeypatch.setattr(f8dist.policy.delayed.scale, "in_memory", inlined)
    _assert_fewer_bytes_than_patched(ffn, "tensorwise")


def test_column_scaled_operands_reach_the_gemm_stored(ffn, monkeypatch):
    """[Note: operands in their kernel layout] in f8dist/core/gemm.py: handed to the gemm as views,
    rowwise's column-scaled operands are read twice, once for the amax and once for the cast."""
    import f8dist.core.gemm

    monkeypatch.setattr(f8dist.core.gemm, "in_memory", lambda x: x)
    _assert_fewer_bytes_than_patched(ffn, "rowwise")


def test_backward_weight_casts_take_the_forward_amax(ffn, monkeypatch):
    """CastSpecs.weight_amax_from_forward: rowwise_with_gw_hp's tensorwise backward weight casts
    would otherwise read every weight once more for its amax."""
    import f8dist.config.linear

    monkeypatch.setattr(f8dist.config.linear, "_amax_follows", lambda *args: False)
    _assert_fewer_bytes_than_patched(ffn, "rowwise_with_gw_hp")


def test_delayed_amax_records_follow_their_casts(ffn, monkeypatch):
    """[Note: record after the cast] in f8dist/policy/delayed/scale.py: recorded before the cast, an amax
    that the cast does not wait for is a second pass over its tensor."""
    import f8dist.policy.delayed.state

    scale = f8dist.policy.delayed.state.cast_scale
    monkeypatch.setattr(f8dist.policy.delayed.state, "cast_scale",
                        lambda *args, later=None, **kwargs: scale(*args, **kwargs))
    _assert_fewer_bytes_than_patched(ffn, "delayed")


def test_ffn_float8_gemms_read_float8(ffn):
    """Every gemm of a float8 recipe is a torch._scaled_mm (on a CPU f8dist.cpu_scaled_mm) on
    1-byte operands, except the high-precision grad_weight gemms of rowwise_with_gw_hp (one per
    linear: 3)."""
    for recipe in bench_bytes.RECIPES:
        gemms = [k for k in ffn[("ffn", "f8dist", recipe)].breakdown if k.kind == "gemm"]
        assert len(gemms) == 9, recipe
        scaled = [g for g in gemms if "_scaled_mm" in g.op]  # f8dist.cpu_scaled_mm on a CPU
        assert len(scaled) == (6 if recipe == "rowwise_with_gw_hp" else 9), recipe
        for g in scaled:
            operands = [b for b in g.reads if len(b.shape) == 2 and min(b.shape) > 1]
            assert [b.dtype in ("e4m3", "e5m2") for b in operands] == [True, True], (recipe, g)


def test_printed_table(capsys, monkeypatch, linear):
    """main() asks run() for what its flags name and prints the table and the breakdown; the
    figures are the ``linear`` fixture's (the same compiles: run() is what the fixture calls)."""
    asked = []

    def run(blocks, recipes, **kwargs):
        asked.append((blocks, recipes, kwargs["small"], kwargs["torchao"]))
        return {key: acc for key, acc in linear.items() if key[2] in ("-", *recipes)}

    monkeypatch.setattr(bench_bytes, "run", run)
    bench_bytes.main(["--small", "--blocks", "linear", "--recipes", "tensorwise",
                      "--no-torchao", "--breakdown", "f8dist:tensorwise"])
    assert asked == [(["linear"], ["tensorwise"], True, False)]
    printed = capsys.readouterr().out
    header = next(line for line in printed.splitlines() if line.startswith("| "))
    assert [c.strip() for c in header.strip("|").split("|")] == bench_bytes.COLUMNS
    assert "### linear f8dist tensorwise:" in printed
    assert "_scaled_mm" in printed
    table = [line for line in printed.splitlines() if line.startswith("| linear")]
    assert len(table) == 1 and "tensorwise" in table[0], printed


def test_block_scaled_linear_gemms_read_float8(linear):
    """MXFP8 on the --small linear: its three gemms are the block-scaled CPU kernel on 1-byte
    operands (plus their block scales), and the step moves no more than the bound measured when
    the test was written (scripts/bench_bytes.py --small --blocks linear --recipes mxfp8)."""
    acc, bf16 = linear[("linear", "f8dist", "mxfp8")], linear[("linear", "bf16", "-")]
    gemms = [k for k in acc.breakdown if k.kind == "gemm"]
    assert [g.op for g in gemms] == ["f8dist.cpu_block_scaled_mm.default"] * 3
    for g in gemms:
        operands = [b for b in g.reads if b.dtype == "e4m3"]
        assert len(operands) == 2, g
    assert acc.bytes / bf16.bytes <= 2.6



def _bf16_bytes_read(acc) -> int:
    """Bytes that inductor's generated kernels read of high-precision (bf16) buffers."""
    return sum(b.bytes for k in acc.breakdown if k.kind == "kernel" for b in k.reads
               if b.dtype == "bf16")


def test_block_casts_read_their_tensors_once(linear):
    """[Note: a block cast in one pass] in f8dist/core/scaling.py: compiled, each MXFP8 cast of the
    --small linear's input, weight and gradient (1 x 32 blocks along K, 32 x 1 along the tokens)
    reads its bf16 tensor once, as each rowwise cast does: no more bf16 bytes read than rowwise.
    Before, the block amax and the cast were two kernels, each reading the tensor (2x)."""
    rowwise, mxfp8 = (linear[("linear", "f8dist", r)] for r in ("rowwise", "mxfp8"))
    assert 0 < _bf16_bytes_read(mxfp8) <= _bf16_bytes_read(rowwise)


def test_a_kept_square_weight_is_not_cast_again_in_backward(linear):
    """float8_weight_for_backward ([Note: what the matmul keeps for backward] in f8dist/nn/linear.py):
    compiled, the partitioner keeps the forward's float8 square-tile weight, so no backward kernel
    reads the bf16 weight (before, backward cast it again from the bf16 weight and its saved block
    amaxes: one more read), and the step moves fewer bytes than mxfp8's, which casts its weight
    for each gemm."""
    args = bench_bytes.model_args(small=True)
    weight = [args.ffn_hidden_dim, args.dim]
    kept, mxfp8 = (linear[("linear", "f8dist", r)] for r in ("mxfp8_square_weights_kept", "mxfp8"))
    reads = [(k.graph, b) for k in kept.breakdown for b in k.reads
             if b.shape == weight and b.dtype == "bf16"]
    assert reads and all(graph == "forward" for graph, _ in reads), reads
    gemm = [k for k in kept.breakdown if k.graph == "backward" and k.kind == "gemm"]
    assert any(b.shape == weight and b.dtype == "e4m3" for k in gemm for b in k.reads)
    assert kept.bytes < mxfp8.bytes
