import pytest
import torch

from f8dist.core.cast import cast_to_float8
from f8dist.config import CastSpec, ScaledMMConfig, ScalingGranularity
from f8dist.core.gemm import check_gemm_shape
from f8dist.core.numerics import sqnr
from tests.floors import exact_gemm_db, on_cpu

E4M3 = torch.float8_e4m3fn
AXISWISE = ScalingGranularity.AXISWISE


def _operands(m, k, n, dtype, axiswise, mm_config):
    torch.manual_seed(0)
    a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
    g = AXISWISE if axiswise else ScalingGranularity.TENSORWISE
    fa = cast_to_float8(a, CastSpec(dtype=E4M3, granularity=g, axis=1, mm_config=mm_config))
    fb = cast_to_float8(b, CastSpec(dtype=E4M3, granularity=g, axis=0, mm_config=mm_config))
    return a, b, fa, fb


def scaled_mm(fa, fb):
    """The float8 gemm as Float8Tensors run it (aten.mm -> f8dist.core.gemm.scaled_mm)."""
    return torch.mm(fa, fb)


@pytest.mark.parametrize("axiswise", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scaled_mm_matches_emulation(axiswise, dtype):
    a, b, fa, fb = _operands(32, 64, 48, dtype, axiswise, ScaledMMConfig())
    out = scaled_mm(fa, fb)
    assert out.dtype == dtype and out.shape == (32, 48)
    emu = scaled_mm(fa.with_mm_config(ScaledMMConfig(emulate=True)), fb)
    assert sqnr(emu, out) > (exact_gemm_db() if dtype == torch.float32 else 40)
    assert sqnr(a.float() @ b.float(), out) > 25


def test_unaligned_shapes_raise_a_clear_error_or_pad_exactly():
    a, b, fa, fb = _operands(8, 40, 24, torch.float32, False, ScaledMMConfig())
    with pytest.raises(ValueError, match=r"K=40, N=24.*pad_inner_dim=True"):
        scaled_mm(fa, fb)
    padded = ScaledMMConfig(pad_inner_dim=True)
    out = scaled_mm(fa.with_mm_config(padded), fb.with_mm_config(padded))
    emu = scaled_mm(fa.with_mm_config(ScaledMMConfig(emulate=True)), fb)
    assert out.shape == (8, 24) and sqnr(emu, out) > exact_gemm_db()


def test_rowwise_padding_of_n_pads_scales_too():
    padded = ScaledMMConfig(pad_inner_dim=True)
    a, b, fa, fb = _operands(8, 40, 24, torch.float32, True, padded)
    emu = scaled_mm(fa.with_mm_config(ScaledMMConfig(emulate=True)), fb)
    assert sqnr(emu, scaled_mm(fa, fb)) > exact_gemm_db()


def test_pad_k_pads_only_the_contraction_dim():
    # [Note: any token count]: the grad_weight gemm pads its K (tokens) without pad_inner_dim
    pad_k = ScaledMMConfig(pad_k=True)
    for axiswise in (False, True):
        a, b, fa, fb = _operands(8, 15, 32, torch.float32, axiswise, pad_k)
        out = scaled_mm(fa, fb)
        emu = scaled_mm(fa.with_mm_config(ScaledMMConfig(emulate=True)), fb)
        assert out.shape == (8, 32) and sqnr(emu, out) > exact_gemm_db()
    _, _, fa, fb = _operands(8, 15, 24, torch.float32, False, pad_k)
    with pytest.raises(ValueError, match=r"got N=24\..*pad_inner_dim=True"):  # N is the layer's
        scaled_mm(fa, fb)


def test_padding_k_is_the_layout_copy():
    # The grad_weight gemm's operands are transposed views (grad_output_t, input) that the kernel
    # copies into row-/column-major anyway; with unaligned tokens the pad is that copy: the same
    # number of float8 copies as an aligned gemm, no extra pass
    from torch.utils._python_dispatch import TorchDispatchMode

    from f8dist.core.gemm import scaled_mm as raw_scaled_mm

    class Copies(TorchDispatchMode):
        calls: list

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in (torch.ops.aten.clone.default, torch.ops.aten.constant_pad_nd.default,
                        torch.ops.aten.copy_.default):
                self.calls.append(func.__name__)
            return func(*args, **(kwargs or {}))

    one = torch.ones(())
    counts = {}
    for m in (16, 15):
        grad_output = torch.randn(m, 32).to(E4M3)  # [M, N]
        x = torch.randn(m, 64).to(E4M3)  # [M, K]
        mode = Copies()
        mode.calls = []
        with mode:
            raw_scaled_mm(grad_output.t(), one, x, one, out_dtype=torch.float32,
                          mm_config=ScaledMMConfig(pad_k=True))
        counts[m] = mode.calls
    assert counts[16] == ["clone.default"] * 2
    assert counts[15] == ["constant_pad_nd.default"] * 2


@pytest.mark.parametrize("axiswise", [False, True])
@pytest.mark.parametrize("m, k, n", [(0, 32, 16), (16, 0, 32), (16, 32, 0)])
def test_empty_gemm_gives_zeros(m, k, n, axiswise):
    a, b, fa, fb = _operands(m, k, n, torch.bfloat16, axiswise, ScaledMMConfig())
    out = scaled_mm(fa, fb)
    assert out.dtype == torch.bfloat16 and torch.equal(out, torch.zeros(m, n, dtype=torch.bfloat16))


def test_check_gemm_shape_names_the_culprit():
    check_gemm_shape(32, 16, what="x", pad_inner_dim=False)
    with pytest.raises(ValueError, match="layers.0.w1.*N=8"):
        check_gemm_shape(32, 8, what="layers.0.w1", pad_inner_dim=False)


def test_fp32_rowwise_applies_scales_to_a_fp32_result():
    # CUDA's rowwise kernel emits bf16 only; an fp32 rowwise gemm (unit-scale fp32 gemm, scales
    # applied after) must give the float32 result, not a bf16-rounded one
    a, b, fa, fb = _operands(32, 64, 48, torch.float32, True, ScaledMMConfig())
    out = scaled_mm(fa, fb)
    assert out.dtype == torch.float32
    emu = scaled_mm(fa.with_mm_config(ScaledMMConfig(emulate=True)), fb)
    assert sqnr(emu, out) > exact_gemm_db()
    assert sqnr(emu, out.bfloat16()) < 70  # what a bf16 output would have cost


def test_fp16_rowwise_is_rounded_once_to_fp16():
    # issue 23 item 1: CUDA's per-row kernel writes bf16 only; an fp16 rowwise gemm goes through
    # float32 and is rounded once, to fp16 (not to bf16 first)
    a, b, fa, fb = _operands(32, 64, 48, torch.float16, True, ScaledMMConfig())
    out = scaled_mm(fa, fb)
    exact = (fa._data.float() / fa._scale) @ (fb._data.float() / fb._scale)  # [32, 48] float32
    assert out.dtype == torch.float16 and out.shape == (32, 48)
    assert sqnr(exact, out) > sqnr(exact, exact.half()) - 1  # exact products, one rounding
    assert sqnr(exact, out) > sqnr(exact, exact.bfloat16()) + 15


@pytest.mark.parametrize(
    "case, words",
    [
        ("a_col_major", ["a must be row-major"]),
        ("b_row_major", ["b must be column-major"]),
        ("rowwise_fp32", ["bfloat16 output"]),
        ("rowwise_bad_shape", ["[M, 1] and [1, N]"]),
        # tensorwise means one scale each; an empty batch's [0, 1] scale is not one
        ("empty_rows_with_scalar", ["[M, 1] and [1, N]"]),
    ],
)
def test_cpu_kernel_enforces_cuda_constraints(case, words):
    # [Note: the CPU kernel]: what CUDA's torch._scaled_mm rejects, the CPU kernel rejects too
    from f8dist.core.gemm import cpu_scaled_mm

    a = torch.randn(32, 64).to(E4M3)
    b = torch.randn(48, 64).to(E4M3).t()  # [64, 48] column-major
    one, rows, cols = torch.ones(()), torch.ones(32, 1), torch.ones(1, 48)
    args = {
        "a_col_major": (a.t().contiguous().t(), b, one, one, torch.bfloat16),
        "b_row_major": (a, b.contiguous(), one, one, torch.bfloat16),
        "rowwise_fp32": (a, b, rows, cols, torch.float32),
        "rowwise_bad_shape": (a, b, rows.t(), cols, torch.bfloat16),
        "empty_rows_with_scalar": (a[:0], b, rows[:0], one, torch.bfloat16),
    }[case]
    with pytest.raises(RuntimeError, match="would reject") as info:
        cpu_scaled_mm(*args)
    for word in words:
        assert word in str(info.value)
    assert cpu_scaled_mm(a, b, rows, cols, torch.bfloat16).shape == (32, 48)  # the valid call


# -- block scales ([Note: the block-scaled gemm]) -------------------------------------------------

from f8dist.config import E8M0  # noqa: E402

BLOCKWISE = ScalingGranularity.BLOCKWISE


def _block_operands(m, k, n, a_block, b_block, scale_dtype, mm_config=ScaledMMConfig()):
    torch.manual_seed(0)
    a = torch.randn(m, k) * torch.logspace(-2, 2, k)  # magnitudes vary along K: blocks matter
    b = torch.randn(k, n)

    def spec(block, axis):
        return CastSpec(dtype=E4M3, granularity=BLOCKWISE, axis=axis, block_size=block,
                        scale_dtype=scale_dtype, mm_config=mm_config)

    return a, b, cast_to_float8(a, spec(a_block, 1)), cast_to_float8(b, spec(b_block, 0))


@pytest.mark.parametrize("m, k, n, a_block, b_block, scale_dtype", [
    (32, 96, 48, (1, 32), (1, 32), E8M0),  # MXFP8
    (16, 64, 64, (1, 32), (32, 32), E8M0),  # square weight blocks
    (8, 256, 256, (1, 128), (128, 128), torch.float32),  # DeepSeek-V3
    (8, 37, 16, (1, 32), (1, 32), E8M0),  # K = 37 tokens: the last block zero-padded
])
@on_cpu  # CUDA runs block-scaled gemms on sm90 or sm100+ only (tests/floors.py)
def test_block_scaled_gemm_is_exact_per_block(m, k, n, a_block, b_block, scale_dtype):
    a, b, fa, fb = _block_operands(m, k, n, a_block, b_block, scale_dtype)
    assert fa._block == a_block and fb._block == b_block[::-1]  # b's block in its [K, N] layout
    out = torch.mm(fa, fb)
    # the reference: per k-block, the float8 products in float64, then the two scales
    a_hp, b_hp = fa.to_original_precision().double(), fb.to_original_precision().double()
    assert sqnr(a_hp @ b_hp, out) > exact_gemm_db()
    assert sqnr(a.double() @ b.double(), out) > 25
    emu = torch.mm(fa.with_mm_config(ScaledMMConfig(emulate=True)), fb)
    assert sqnr(emu, out) > exact_gemm_db()


@on_cpu  # CUDA runs block-scaled gemms on sm90 or sm100+ only (tests/floors.py)
def test_block_scaled_gemm_needs_block_scales_on_both_sides():
    _, _, fa, fb = _block_operands(16, 64, 32, (1, 32), (1, 32), E8M0)
    tensorwise = cast_to_float8(torch.randn(64, 32), CastSpec(dtype=E4M3))
    with pytest.raises(TypeError, match="both operands of a block-scaled gemm"):
        torch.mm(fa, tensorwise)
    _, _, _, fb128 = _block_operands(16, 128, 32, (1, 128), (1, 128), E8M0)
    _, _, fa32, _ = _block_operands(16, 128, 32, (1, 32), (1, 32), E8M0)
    with pytest.raises(ValueError, match="differ along the contraction dim K"):
        torch.mm(fa32, fb128)


def test_block_scaled_gemm_off_the_cpu_raises_naming_the_way_out():
    # [Note: the block-scaled gemm]: off the CPU only CUDA's kernels run; any other device or
    # block (here MXFP8 handed to the CUDA path on meta, which stands for one without a GPU) gets
    # the error, and emulate runs; scaled_mm itself gives meta tensors their shape (the CPU op's
    # fake kernel: a model built on meta runs a shape-only step)
    from f8dist.core.gemm import _cuda_block_scaled_mm, scaled_mm

    a, s_a = torch.empty(16, 64, dtype=E4M3, device="meta"), torch.empty(16, 2, device="meta")
    b, s_b = torch.empty(64, 32, dtype=E4M3, device="meta"), torch.empty(2, 32, device="meta")
    with pytest.raises(NotImplementedError, match="no meta kernel for float8 blocks.*MXFP8.*sm100.*emulate=True"):
        _cuda_block_scaled_mm(a, b, s_a, s_b, (1, 32), (32, 1), e8m0=False, out_dtype=torch.bfloat16)
    out = scaled_mm(a, s_a, b, s_b, out_dtype=torch.bfloat16, mm_config=ScaledMMConfig(),
                    a_block=(1, 32), b_block=(32, 1))
    assert out.is_meta and out.shape == (16, 32)
    out = scaled_mm(a, s_a, b, s_b, out_dtype=torch.bfloat16,
                    mm_config=ScaledMMConfig(emulate=True), a_block=(1, 32), b_block=(32, 1))
    assert out.shape == (16, 32) and out.dtype == torch.bfloat16


@pytest.mark.parametrize("a_block, b_block", [
    ((1, 128), (128, 128)),  # output and grad_input of "blockwise"
    ((1, 128), (128, 1)),  # grad_weight: blocks along the tokens
    ((128, 128), (128, 1)),
])
@pytest.mark.parametrize("m, k, n", [(256, 384, 512), (200, 640, 256), (256, 8192, 1280)])
def test_cuda_block_scales_meet_cudas_layout_contract(a_block, b_block, m, k, n):
    # the arguments f8dist hands CUDA's DeepSeek kernels ([Note: the block-scaled gemm]) in the
    # shapes and strides CUDA requires, judged by f8dist's own statement of them ([Note: CUDA's
    # block layout contract]; torch's meta kernel checks nothing from torch 2.14), no GPU needed
    from f8dist.core.gemm import cuda_block_arg_problems, cuda_block_args

    if a_block[0] == 128 and m % 128:
        m = 256  # an operand of 128x128 blocks is a weight: its dims are whole blocks
    a = torch.empty(m, k, dtype=E4M3, device="meta")
    b = torch.empty(n, k, dtype=E4M3, device="meta").t()  # [K, N] column-major
    inv_a = torch.empty(-(-m // a_block[0]), k // 128, device="meta")  # [M/bm, K/128]
    inv_b = torch.empty(k // 128, -(-n // b_block[1]), device="meta")  # [K/128, N/bn]
    # the scales come in row-major or as a transposed view ([K/128, N/128] of an [N/128, K/128]
    # tensor): the layout handed to torch must not depend on the view
    for inv_b in (inv_b, inv_b.t().contiguous().t()):
        args, kwargs = cuda_block_args(a, b, inv_a, inv_b, a_block, b_block,
                                       out_dtype=torch.bfloat16)
        assert cuda_block_arg_problems(args, kwargs) == []
        assert args[2].stride(0) == args[4].stride(0) == 1  # outer-dim-major, as CUDA wants
    # and a layout CUDA rejects is caught by the same check: a's scales row-major instead
    sa = args[2].contiguous()
    problems = cuda_block_arg_problems((*args[:2], sa, *args[3:]), kwargs)
    assert len(problems) == 1 and "scale_a must have strides (1, " in problems[0], problems


# -- MXFP8 on CUDA ([Note: MXFP8 on CUDA]): layouts checked on the CPU -----------------------------

def _swizzled_index(r: int, c: int, cols: int) -> int:
    """cuBLAS's 1-D block scaling factor layout, element by element: tiles of 128 rows x 4 columns
    stored tile row by tile row, inside a tile (r % 32) * 16 + (r % 128 // 32) * 4 + c % 4."""
    tile = (r // 128) * -(-cols // 4) + c // 4
    return tile * 512 + (r % 32) * 16 + (r % 128) // 32 * 4 + c % 4


def _read_swizzled(flat: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """[rows, cols] read out of ``flat`` by :func:`_swizzled_index` (not by unswizzle_32_4_4),
    the formula applied to every (row, column) pair at once."""
    r, c = torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij")
    return flat.to(torch.float32)[_swizzled_index(r, c, cols)]  # [rows, cols]


@pytest.mark.parametrize("rows, cols", [(1, 1), (5, 3), (128, 4), (130, 9), (256, 8)])
def test_swizzle_32_4_4_is_cublas_layout_and_inverts(rows, cols):
    from f8dist.core.gemm import swizzle_32_4_4, unswizzle_32_4_4

    x = torch.arange(rows * cols, dtype=torch.float32).reshape(rows, cols) + 2  # distinct, not 1
    flat = swizzle_32_4_4(x)
    padded = -(-rows // 128) * 128 * (-(-cols // 4) * 4)
    assert flat.shape == (padded,) and flat.is_contiguous()
    assert torch.equal(_read_swizzled(flat, rows, cols), x)  # each element where cuBLAS reads it
    assert int((flat == 1).sum()) == padded - rows * cols  # the rest is padding, 1
    assert torch.equal(unswizzle_32_4_4(flat, rows, cols), x)  # the round trip


def test_mx_scales_are_exact_e8m0():
    # every quantizing e8m0 scale f8dist keeps, 2**-127 .. 2**127: its reciprocal (what the kernel
    # multiplies by) goes to e8m0 and back unchanged
    from f8dist.core.gemm import _mx_scales, swizzle_32_4_4, unswizzle_32_4_4

    quant = torch.ldexp(torch.ones(255), torch.arange(-127, 128)).to(E8M0)  # [255]
    inv = quant.to(torch.float32).reciprocal().reshape(51, 5)  # [rows, K/32]
    swizzled = _mx_scales(inv, (1, 32), 51)
    assert swizzled.dtype == E8M0
    assert torch.equal(unswizzle_32_4_4(swizzled.to(torch.float32), 51, 5), inv)
    # torch's own conversion agrees byte for byte, and a NaN scale (a non-finite block) stays NaN
    by_torch = swizzle_32_4_4(inv).to(E8M0)
    assert torch.equal(swizzled.view(torch.uint8), by_torch.view(torch.uint8))
    nan = _mx_scales(torch.full((1, 1), float("nan")), (1, 32), 1)
    assert nan.to(torch.float32)[0].isnan()


# (tokens, in_features, out_features): whole tiles; tokens, rows and K-blocks that pad to 128 / 4
# and to 32 along K; an N (out_features = 40) that pads to 16
_MX_SHAPES = [(256, 512, 384), (200, 96, 64), (8, 32, 40)]


def _mx_gemms(t, k_in, n_out, square, device):
    """The three gemms of an MXFP8 linear as f8dist hands them to the block gemm: (name, a, b,
    inv_a, a_block, inv_b, b_block), operands in their natural layouts (the weight's transpose and
    grad_output's are views), dequantizing power-of-2 scales."""
    torch.manual_seed(0)

    def data(*shape):
        return torch.randn(*shape, device=device).to(E4M3) if device == "cpu" else \
            torch.empty(*shape, dtype=E4M3, device=device)

    def inv(*shape):  # powers of 2, as e8m0 scales are
        return torch.ldexp(torch.ones(*shape, device=device),
                           torch.randint(-8, 8, shape, device=device))

    x, w, go = data(t, k_in), data(n_out, k_in), data(t, n_out)  # [T, K], [N, K], [T, N]
    c = lambda n: -(-n // 32)  # noqa: E731 - 32-blocks
    if square:  # 32x32 weight tiles: [N/32, K/32] in the weight's [N, K] layout
        w_inv, wt_block, w_block = inv(c(n_out), c(k_in)), (32, 32), (32, 32)
        w_for_out, w_for_gi = w_inv.t(), w_inv
    else:  # 1x32 along each gemm's contraction dim
        wt_block, w_block = (32, 1), (32, 1)
        w_for_out, w_for_gi = inv(n_out, c(k_in)).t(), inv(c(n_out), k_in)
    return [
        ("output", x, w.t(), inv(t, c(k_in)), (1, 32), w_for_out, wt_block),
        ("grad_input", go, w, inv(t, c(n_out)), (1, 32), w_for_gi, w_block),
        ("grad_weight", go.t(), x, inv(n_out, c(t)), (1, 32), inv(c(t), k_in), (32, 1)),
    ]


@pytest.mark.parametrize("square", [False, True])
@pytest.mark.parametrize("t, k_in, n_out", _MX_SHAPES)
def test_mxfp8_cuda_args_meet_cudas_layout_contract(t, k_in, n_out, square):
    # the exact tensors f8dist hands CUDA's MXFP8 kernel, judged on the meta device by f8dist's own
    # statement of what CUDA requires ([Note: CUDA's block layout contract]): the forward,
    # grad_input and grad_weight gemms, the weight in 1x32 blocks or 32x32 tiles, row-major
    # operands and transposed views
    from f8dist.core.gemm import _torch_block_enums, cuda_block_arg_problems, cuda_block_args

    kinds, swizzles = _torch_block_enums()
    for name, a, b, inv_a, a_block, inv_b, b_block in _mx_gemms(t, k_in, n_out, square, "meta"):
        m, n = a.shape[0], b.shape[1]
        args, kwargs = cuda_block_args(a, b, inv_a, inv_b, a_block, b_block,
                                       out_dtype=torch.bfloat16)
        a2, b2, sa, recipe_a, sb, recipe_b = args
        assert recipe_a == recipe_b == kinds.BlockWise1x32, name
        assert kwargs["swizzle_a"] == kwargs["swizzle_b"] == swizzles.SWIZZLE_32_4_4, name
        assert sa.dtype == sb.dtype == E8M0 and sa.is_contiguous() and sb.is_contiguous(), name
        assert cuda_block_arg_problems(args, kwargs) == [], name
        assert b2.shape[1] == -(-n // 16) * 16, name  # N padded to 16, sliced off after
        # and the check can fail: the same scales unswizzled (not 128 x 4 padded) or not marked
        # swizzled are refused
        nk = a2.shape[1] // 32
        if m % 128 or nk % 4:
            problems = cuda_block_arg_problems((a2, b2, sa[: m * nk], *args[3:]), kwargs)
            assert problems and "scale_a must have" in problems[0], (name, problems)
        problems = cuda_block_arg_problems(args, dict(kwargs, swizzle_a=swizzles.NO_SWIZZLE))
        assert problems and "swizzle_a must be [SWIZZLE_32_4_4]" in problems[0], (name, problems)


def _valid_block_args(kernel):
    """Valid F.scaled_mm arguments for CUDA's ``kernel`` ("deepseek": 1x128 x 128x128, or "mxfp8")
    on meta tensors, as f8dist builds them: (args, kwargs)."""
    from f8dist.core.gemm import cuda_block_args

    m, k, n = 256, 512, 384
    a = torch.empty(m, k, dtype=E4M3, device="meta")
    b = torch.empty(n, k, dtype=E4M3, device="meta").t()  # [K, N] column-major
    if kernel == "deepseek":
        inv_a, inv_b = torch.empty(m, k // 128, device="meta"), \
            torch.empty(k // 128, n // 128, device="meta")
        return cuda_block_args(a, b, inv_a, inv_b, (1, 128), (128, 128), out_dtype=torch.bfloat16)
    inv_a, inv_b = torch.empty(m, k // 32, device="meta"), torch.empty(k // 32, n, device="meta")
    return cuda_block_args(a, b, inv_a, inv_b, (1, 32), (32, 1), out_dtype=torch.bfloat16)


def _mutate(case):
    """(kernel, args, kwargs) with one thing CUDA's kernel rejects ([Note: CUDA's block layout
    contract]), and whether torch 2.13's meta kernel checks that thing too."""
    import torch.nn.functional as F

    kernel, what = case
    args, kwargs = _valid_block_args(kernel)
    a, b, sa, ka, sb, kb = args
    k_504 = lambda: ((a[:, :504], b[:504], sa, ka, sb, kb), kwargs)  # noqa: E731
    swap = {  # name -> (args, kwargs) with one rule broken
        "scale_a_row_major": lambda: ((a, b, sa.contiguous(), ka, sb, kb), kwargs),
        "scale_b_row_major": lambda: ((a, b, sa, ka, sb.contiguous(), kb), kwargs),
        "scale_a_shape": lambda: ((a, b, sa[:-1], ka, sb, kb), kwargs),
        "scale_b_not_padded_to_4": lambda: ((a, b, sa, ka, sb[:-1], kb), kwargs),
        "scale_dtype": lambda: ((a, b, sa.to(torch.bfloat16), ka, sb, kb), kwargs),
        "a_col_major": lambda: ((a.t().contiguous().t(), b, sa, ka, sb, kb), kwargs),
        "b_row_major": lambda: ((a, b.contiguous(), sa, ka, sb, kb), kwargs),
        "e5m2_operand": lambda: ((a, b.to(torch.float8_e5m2), sa, ka, sb, kb), kwargs),
        "fast_accum": lambda: (args, dict(kwargs, use_fast_accum=True)),
        "kinds_swapped": lambda: ((a, b, sa, kb, sb, ka), kwargs),
        "scale_numel": lambda: ((a, b, sa[:-1], ka, sb, kb), kwargs),
        "scale_not_contiguous": lambda: ((a, b, torch.empty_strided(  # every other element
            sa.shape, (2,), dtype=sa.dtype, device="meta"), ka, sb, kb), kwargs),
        "scales_f32": lambda: ((a, b, sa.to(torch.float32), ka, sb, kb), kwargs),
        "no_swizzle": lambda: (args, dict(kwargs, swizzle_b=F.SwizzleType.NO_SWIZZLE)),
        "k_not_16": k_504,
    }[what]()
    # the rules torch 2.13's meta kernel checks too (it leaves operand layouts and dtypes, fast
    # accumulation and contiguity to the CUDA kernel)
    meta_checks = what not in {"a_col_major", "b_row_major", "e5m2_operand", "fast_accum",
                               "scale_not_contiguous"}
    return kernel, *swap, meta_checks


_REJECTED = [
    (("deepseek", "scale_a_row_major"), ["scale_a must have strides (1, 256)"]),
    (("deepseek", "scale_b_row_major"), ["scale_b must have strides (1, 4)"]),
    (("deepseek", "scale_a_shape"), ["scale_a must have shape [256, 4]"]),
    (("deepseek", "scale_b_not_padded_to_4"), ["scale_b must have shape [4, 3]"]),
    (("deepseek", "scale_dtype"), ["scale_a must be float32"]),
    (("deepseek", "a_col_major"), ["a must be row-major"]),
    (("deepseek", "b_row_major"), ["b must be column-major"]),
    (("deepseek", "e5m2_operand"), ["both operands must be torch.float8_e4m3fn"]),
    (("deepseek", "fast_accum"), ["use_fast_accum must be False"]),
    (("deepseek", "kinds_swapped"), ["scale_a must have shape [4, 2]",
                                     "scale_b must have shape [384, 4]"]),
    (("mxfp8", "scale_numel"), ["scale_a must have 4096 elements"]),
    (("mxfp8", "scale_not_contiguous"), ["scale_a must be contiguous"]),
    (("mxfp8", "scales_f32"), ["scale_a must be torch.float8_e8m0fnu"]),
    (("mxfp8", "no_swizzle"), ["swizzle_b must be [SWIZZLE_32_4_4]"]),
    (("mxfp8", "k_not_16"), ["K=504 and N=384 must be multiples of 16"]),
    (("mxfp8", "e5m2_operand"), ["both operands must be torch.float8_e4m3fn"]),
]


@pytest.mark.parametrize("case, words", _REJECTED, ids=[f"{k}-{w}" for (k, w), _ in _REJECTED])
def test_cuda_block_check_rejects_what_cuda_rejects(case, words):
    # [Note: CUDA's block layout contract]: each rule of CUDA's DeepSeek and MXFP8 kernels, broken
    # one at a time, is refused with an error naming the argument, the value and the rule
    from f8dist.core.gemm import check_cuda_block_args, cuda_block_arg_problems

    check_cuda_block_args(*_valid_block_args(case[0]))  # the unbroken arguments pass
    _, args, kwargs, _ = _mutate(case)
    with pytest.raises(ValueError, match="scaled_mm on CUDA would reject") as info:
        check_cuda_block_args(args, kwargs)
    for word in words:
        assert word in str(info.value), str(info.value)
    assert len(cuda_block_arg_problems(args, kwargs)) == len(words)


def _meta_kernel_checks_layouts() -> bool:
    """Whether this torch's meta kernel of ``aten._scaled_mm_v2`` checks block-scale layouts
    (torch 2.11-2.13); from torch 2.14 it infers the output's shape only."""
    import torch.nn.functional as F

    _, args, kwargs, _ = _mutate(("deepseek", "scale_a_row_major"))
    try:
        F.scaled_mm(*args, **kwargs)
    except RuntimeError:
        return True
    return False


@pytest.mark.parametrize("case", sorted({c for c, _ in _REJECTED} | {("deepseek", None),
                                                                     ("mxfp8", None)},
                                        key=str))
def test_cuda_block_check_agrees_with_torchs_meta_kernel(case):
    # f8dist's statement of CUDA's rules and torch's own, where torch's meta kernel still states
    # them: both accept f8dist's arguments, both reject each broken layout torch checks
    import torch.nn.functional as F

    from f8dist.core.gemm import cuda_block_arg_problems

    if not _meta_kernel_checks_layouts():
        pytest.skip(f"torch {torch.__version__}'s meta kernel of _scaled_mm_v2 checks no layouts")
    if case[1] is None:
        args, kwargs = _valid_block_args(case[0])
        assert F.scaled_mm(*args, **kwargs).shape == (256, 384)
        return
    _, args, kwargs, meta_checks = _mutate(case)
    assert cuda_block_arg_problems(args, kwargs)
    if meta_checks:
        with pytest.raises(RuntimeError):
            F.scaled_mm(*args, **kwargs)


@pytest.mark.parametrize("square", [False, True])
@pytest.mark.parametrize("t, k_in, n_out", _MX_SHAPES)
def test_mxfp8_cuda_args_compute_the_cpu_kernel_bit_for_bit(t, k_in, n_out, square):
    # CUDA's MXFP8 gemm read on the CPU: the operands f8dist passes (padded), each scale read where
    # cuBLAS reads it (_swizzled_index), through the CPU kernel in 1x32 blocks, equal f8dist's CPU
    # kernel on the original operands and blocks (32x32 tiles included: their expansion is exact)
    from f8dist.core.gemm import cpu_block_scaled_mm, cuda_block_args

    for name, a, b, inv_a, a_block, inv_b, b_block in _mx_gemms(t, k_in, n_out, square, "cpu"):
        n = b.shape[1]
        want = cpu_block_scaled_mm(a, b, inv_a, inv_b, list(a_block), list(b_block),
                                   torch.float32)
        (a2, b2, sa, _, sb, _), _ = cuda_block_args(a, b, inv_a, inv_b, a_block, b_block,
                                                    out_dtype=torch.float32)
        assert a2.stride(1) == 1 and b2.stride(0) == 1, name  # row-major, column-major
        (m, kp), np_ = a2.shape, b2.shape[1]
        assert kp % 32 == 0 and np_ % 16 == 0 and kp - a.shape[1] < 32 and np_ - n < 16, name
        sa_rows = _read_swizzled(sa, m, kp // 32)  # [M, K'/32]
        sb_rows = _read_swizzled(sb, np_, kp // 32)  # [N', K'/32]
        got = cpu_block_scaled_mm(a2, b2, sa_rows, sb_rows.t(), [1, 32], [32, 1], torch.float32)
        assert torch.equal(got[:, :n], want), name
        assert not got[:, n:].any(), name  # padded columns are zero


def test_square_weight_tiles_expand_to_row_blocks_exactly():
    # [Note: MXFP8 on CUDA]: a 32x32 tile's scale is the scale of each of its rows' 1x32 blocks;
    # the CPU kernel with the expanded 1x32 grid gives the 32x32 path's bits (a weight of 48 rows:
    # its last tile row cut short)
    from f8dist.core.gemm import _row_block_scales, cpu_block_scaled_mm

    _, _, fx, _ = _block_operands(24, 64, 48, (1, 32), (1, 32), E8M0)
    w = torch.randn(48, 64)  # [N, K]
    fw = cast_to_float8(w, CastSpec(dtype=E4M3, granularity=BLOCKWISE, axis=1,
                                    block_size=(32, 32), scale_dtype=E8M0))
    assert fw._block == (32, 32) and fw._scale.shape == (2, 2)
    out = torch.mm(fx, fw.t())  # [24, 48], the 32x32 path
    inv_w = fw._scale.to(torch.float32).reciprocal()  # [N/32, K/32]
    rows = _row_block_scales(inv_w, (32, 32), 48)  # [N, K/32]
    assert rows.shape == (48, 2)
    assert torch.equal(rows[31], inv_w[0]) and torch.equal(rows[32], inv_w[1])
    expanded = cpu_block_scaled_mm(fx._data, fw._data.t(), fx._scale.float().reciprocal(),
                                   rows.t(), [1, 32], [32, 1], torch.float32)
    assert torch.equal(expanded, out)


@pytest.mark.parametrize("kernel, capability, kw, words", [
    ("mxfp8", None, dict(device="meta"), ["no meta kernel", "sm100", "emulate=True"]),
    ("mxfp8", (9, 0), {}, ["sm100", "sm90", "'blockwise'", "emulate=True"]),
    ("mxfp8", (8, 9), {}, ["sm100", "sm89", "'rowwise'", "emulate=True"]),
    ("mxfp8", (10, 0), dict(api=False), ["BlockWise1x32", "upgrade torch", "emulate=True"]),
    ("mxfp8", (10, 0), dict(e8m0=False), ["e8m0", "emulate=True"]),
    ("mxfp8", (10, 0), dict(dtypes=(E4M3, torch.float8_e5m2)), ["e4m3", "emulate=True"]),
    ("mxfp8", (10, 0), dict(rocm=True), ["ROCm", "emulate=True"]),
    ("deepseek", (10, 0), {}, ["sm90 only", "'mxfp8'", "emulate=True"]),
    ("deepseek", (8, 0), {}, ["sm90 only", "'rowwise'", "emulate=True"]),
    (None, (10, 0), dict(blocks="(1, 64) x (1, 64)"),
     ["no CUDA kernel", "(1, 64)", "emulate=True"]),
    ("mxfp8", (10, 0), {}, None),  # Blackwell runs MXFP8
    ("mxfp8", (12, 0), {}, None),
    ("deepseek", (9, 0), {}, None),  # Hopper runs DeepSeek's blocks
    ("nvfp4", (9, 0), {}, ["NVFP4", "sm100", "sm90", "emulate=True"]),
    ("nvfp4", (8, 9), {}, ["NVFP4", "sm100", "sm89", "emulate=True"]),
    ("nvfp4", (10, 0), dict(api=False), ["BlockWise1x16", "upgrade torch", "emulate=True"]),
    ("nvfp4", (10, 0), dict(rocm=True), ["ROCm", "emulate=True"]),
    ("nvfp4", None, dict(device="xpu"), ["no xpu kernel", "NVFP4", "sm100", "emulate=True"]),
    ("nvfp4", (10, 0), {}, None),  # Blackwell runs NVFP4
])
def test_cuda_block_problem_names_the_fix(kernel, capability, kw, words):
    from f8dist.core.gemm import cuda_block_problem

    problem = cuda_block_problem(kernel, capability, **kw)
    if words is None:
        assert problem is None
    else:
        assert problem is not None and all(w in problem for w in words), problem


@on_cpu  # CUDA runs block-scaled gemms on sm90 or sm100+ only (tests/floors.py)
@pytest.mark.parametrize("recipe", ["mxfp8", "mxfp8_square_weights", "mxfp8_wgrad_with_hp"])
def test_mxfp8_linear_through_the_cuda_args_is_bit_for_bit(recipe, monkeypatch):
    # a Float8Linear whose block gemms go through the arguments CUDA's MXFP8 kernel would get,
    # read on the CPU as above: output and gradients equal the CPU kernel's bit for bit, and every
    # block gemm of the recipe is one CUDA's MXFP8 kernel takes
    import copy

    import f8dist.core.gemm as gemm
    from f8dist import Float8LinearConfig
    from f8dist.nn.linear import Float8Linear

    kernel = gemm.cpu_block_scaled_mm
    kernels = []

    def via_cuda_args(a, b, inv_a, inv_b, a_block, b_block, out_dtype):
        bt_block = (b_block[1], b_block[0])
        kernels.append(gemm._cuda_block_kernel(tuple(a_block), bt_block))
        (a2, b2, sa, _, sb, _), _ = gemm.cuda_block_args(a, b, inv_a, inv_b, a_block, b_block,
                                                         out_dtype=out_dtype)
        kp, np_ = a2.shape[1], b2.shape[1]
        sa_rows = _read_swizzled(sa, a2.shape[0], kp // 32)  # [M, K'/32]
        sb_rows = _read_swizzled(sb, np_, kp // 32)  # [N', K'/32]
        out = kernel(a2, b2, sa_rows, sb_rows.t(), [1, 32], [32, 1], out_dtype)
        return out[:, : b.shape[1]]

    torch.manual_seed(0)
    lin = torch.nn.Linear(96, 40, bias=False)  # 40 outputs: N padded to 48 in the output gemm
    f8 = Float8Linear.from_float(lin, Float8LinearConfig.from_recipe_name(recipe).replace(
        pad_inner_dim=True), fqn="lin")  # 40 rows of the weight: the grad_input K padded to 64
    x, grad = torch.randn(37, 96), torch.randn(37, 40)  # 37 tokens: grad_weight's K padded

    def run(mod):
        xi = x.clone().requires_grad_()
        out = mod(xi)
        out.backward(grad)
        return out, xi.grad, mod.weight.grad

    want = run(copy.deepcopy(f8))
    monkeypatch.setattr(gemm, "cpu_block_scaled_mm", via_cuda_args)
    got = run(copy.deepcopy(f8))
    for w, g in zip(want, got):
        assert torch.equal(w, g)
    n_block_gemms = 2 if recipe == "mxfp8_wgrad_with_hp" else 3
    assert kernels == ["mxfp8"] * n_block_gemms


def test_one_entry_runs_every_kind_of_gemm(monkeypatch):
    """[Note: one gemm entry]: dense and grouped, per-row and block-scaled gemms of Float8Tensors
    all run float8_mm, which picks the kind from the operands' blocks and the token groups."""
    import f8dist.core.gemm as gemm
    from f8dist.config import Float8LinearConfig

    ran = []
    monkeypatch.setattr(gemm, "_GEMMS", {kind: (lambda row, kind: lambda *a, **k: (
        ran.append(kind), row(*a, **k))[1])(row, kind) for kind, row in gemm._GEMMS.items()})
    offsets = torch.tensor([16, 48, 64], dtype=torch.int32)
    for recipe, blocks in (("rowwise", False), ("mxfp8", True)):
        specs = Float8LinearConfig.from_recipe_name(recipe).cast_specs()
        grouped = Float8LinearConfig.from_recipe_name(recipe).grouped_cast_specs()
        x, w = torch.randn(64, 64), torch.randn(32, 64)
        torch.mm(cast_to_float8(x, specs["output", "input"]), cast_to_float8(w, specs["output", "weight"]).t())
        w3 = torch.randn(3, 32, 64)
        torch._grouped_mm(cast_to_float8(x, grouped["output", "input"]),
                          cast_to_float8(w3, grouped["output", "weight"]).transpose(-2, -1), offs=offsets)
        assert ran[-2:] == [(False, blocks), (True, blocks)]


def _nvfp4_operands(m, k, n, emulate=False, b_block=(16, 16)):
    from f8dist.config.cells import E2M1

    torch.manual_seed(0)
    a, b = torch.randn(m, k) * torch.logspace(-2, 2, k), torch.randn(k, n)

    def spec(block, axis):
        return CastSpec(dtype=E2M1, granularity=BLOCKWISE, axis=axis, block_size=block,
                        scale_dtype=E4M3, mm_config=ScaledMMConfig(emulate=emulate))

    return a, b, cast_to_float8(a, spec((1, 16), 1)), cast_to_float8(b, spec(b_block, 0))


@on_cpu  # the exact CPU kernel; scripts/cuda_block_check.py checks CUDA's (sm100+) against it
def test_nvfp4_gemm_is_exact_and_torchaos_emulation():
    # [Note: the NVFP4 gemm]: block products of e2m1 values, e4m3 block scales, the tensor scales
    # as alpha; against float64 on the dequantized operands and torchao's dequantize-then-matmul
    nvfp4 = pytest.importorskip("torchao.prototype.mx_formats.nvfp4_tensor")
    a, b, fa, fb = _nvfp4_operands(32, 96, 48)
    assert fa.float8_layout.dtype == torch.float4_e2m1fn_x2 and fa._tensor_scale.dim() == 0
    out = torch.mm(fa, fb)
    a_hp, b_hp = fa.to_original_precision(), fb.to_original_precision()
    assert sqnr(a_hp.double() @ b_hp.double(), out) > exact_gemm_db()
    assert sqnr(a @ b, out) > 15  # e2m1: about 17 dB on gaussian data
    _, _, ea, eb = _nvfp4_operands(32, 96, 48, emulate=True)
    assert sqnr(torch.mm(ea, eb), out) > exact_gemm_db()

    def torchao(x):  # torchao's NVFP4 emulation: 1x16 blocks along the last dim, dequantized
        scale = nvfp4.per_tensor_amax_to_scale(x.abs().max())
        return nvfp4.NVFP4Tensor.to_nvfp4(x.contiguous(), per_tensor_scale=scale).dequantize(
            torch.float32)

    # the same blocks as torchao's (b in 1x16 blocks along K): the same values, bit for bit
    _, _, fa, fb = _nvfp4_operands(32, 96, 48, b_block=(1, 16))
    assert torch.equal(fa.to_original_precision(), torchao(a))
    assert torch.equal(fb.to_original_precision(), torchao(b.t()).t())
    assert sqnr(torchao(a) @ torchao(b.t()).t(), torch.mm(fa, fb)) > exact_gemm_db()


@on_cpu
def test_nvfp4_gemm_needs_nvfp4_on_both_sides():
    _, _, fa, _ = _nvfp4_operands(16, 64, 32)
    _, _, _, mx = _block_operands(16, 64, 32, (1, 16), (16, 16), torch.float32)
    with pytest.raises(TypeError, match="NVFP4 operand meets another format"):
        torch.mm(fa, mx)


# -- NVFP4 on CUDA ([Note: NVFP4 on CUDA]): arguments checked on the CPU ---------------------------

@pytest.mark.parametrize("rows, cols", [(128, 4), (256, 8), (130, 9), (5, 3)])
def test_nvfp4_scales_are_torchaos_to_blocked(rows, cols):
    # the e4m3 scales f8dist hands CUDA's NVFP4 kernel, byte for byte torchao's swizzle of the same
    # grid (to_blocked, which _addmm_nvfp4_dispatch passes): padded with 1 where torchao pads 0
    to_blocked = pytest.importorskip("torchao.prototype.mx_formats.utils").to_blocked
    from f8dist.core.gemm import _nvfp4_scales

    torch.manual_seed(0)
    grid = torch.rand(rows, cols).mul(400).add(0.01).to(E4M3)  # [rows, K/16] decode scales
    ours = _nvfp4_scales(grid, (1, 16), rows).view(torch.uint8)
    padded = torch.nn.functional.pad(grid.float(), (0, -cols % 4, 0, -rows % 128), value=1.0)
    assert torch.equal(ours, to_blocked(padded.to(E4M3)).view(torch.uint8))
    theirs = to_blocked(grid).view(torch.uint8)  # zero padding
    assert torch.equal(ours[theirs != 0], theirs[theirs != 0])


def _nvfp4_linear_gemms(t, k_in, n_out):
    """The three gemms of an "nvfp4" linear as Float8Tensors: (name, a, b), the weight's transpose
    and grad_output's as views (packed along the features, not grad_weight's K)."""
    from f8dist import Float8LinearConfig

    torch.manual_seed(0)
    specs = Float8LinearConfig.from_recipe_name("nvfp4").cast_specs()
    x, w, go = torch.randn(t, k_in), torch.randn(n_out, k_in), torch.randn(t, n_out)
    fx = cast_to_float8(x, specs["output", "input"])
    fw = cast_to_float8(w, specs["output", "weight"])
    fgo = cast_to_float8(go, specs["grad_input", "grad_output"])
    fw_gi = cast_to_float8(w, specs["grad_input", "weight"])
    fgo_gw = cast_to_float8(go, specs["grad_weight", "grad_output"])
    fx_gw = cast_to_float8(x, specs["grad_weight", "input"])
    return [("output", fx, fw.t()), ("grad_input", fgo, fw_gi),
            ("grad_weight", fgo_gw.t(), fx_gw)]


def _nvfp4_args(a, b, device="cpu"):
    from f8dist.core.gemm import cuda_nvfp4_args, kernel_block

    def on(t):
        return t.to(device) if device == "cpu" else torch.empty_like(t, device=device)

    return cuda_nvfp4_args(on(a.values().to(E4M3)), on(b.values().to(E4M3)), on(a._scale),
                           on(b._scale), kernel_block(a._block), kernel_block(b._block),
                           out_dtype=torch.float32)


# (tokens, in_features, out_features): whole tiles; tokens and K-blocks that pad to 128 / 4 and
# grad_weight's K (37 tokens) to 64; an N (out_features = 40) that pads to 48
_NVFP4_SHAPES = [(128, 64, 32), (37, 96, 40)]


@pytest.mark.parametrize("t, k_in, n_out", _NVFP4_SHAPES)
def test_nvfp4_cuda_args_repack_along_k_and_pass_torchs_meta_kernel(t, k_in, n_out):
    # [Note: NVFP4 on CUDA]: each operand packed along K, byte for byte the unpack -> pack of its
    # values (and its own bytes where its cast packed along K already); the same arguments built on
    # the meta device pass f8dist's statement of CUDA's rules and torch 2.13's meta kernel of
    # scaled_mm, which checks the fp4 K, layouts, scale counts, scale dtype and swizzle
    from f8dist.core.gemm import _torch_block_enums, cuda_block_arg_problems
    from f8dist.core.scaling import e2m1_pack, e2m1_unpack

    kinds, swizzles = _torch_block_enums()
    for name, a, b in _nvfp4_linear_gemms(t, k_in, n_out):
        (m, k), n = a.shape, b.shape[1]
        (a2, b2, sa, ka, sb, kb), kwargs = _nvfp4_args(a, b)
        assert a2.dtype == b2.dtype == torch.float4_e2m1fn_x2, name
        assert a2.stride(1) == 1 and b2.stride(0) == 1, name  # row-major, column-major
        assert ka == kb == kinds.BlockWise1x16 and sa.dtype == sb.dtype == E4M3, name
        assert kwargs["swizzle_a"] == kwargs["swizzle_b"] == swizzles.SWIZZLE_32_4_4, name
        kp = 2 * a2.shape[1]
        assert kp % 32 == 0 and kp - k < 32 and b2.shape == (kp // 2, -(-n // 16) * 16), name
        for x, x2, k_dim in ((a, a2, 1), (b, b2, 0)):
            values = e2m1_unpack(x._data, x._packed_dim)  # zero-padded along K to K'
            values = torch.nn.functional.pad(values, (0, kp - k) if k_dim else (0, 0, 0, kp - k))
            got = x2 if k_dim else x2[:, :n]  # N padded: zero columns
            assert torch.equal(got.view(torch.uint8),
                               e2m1_pack(values, dim=k_dim).view(torch.uint8)), name
            if x._packed_dim == k_dim and kp == k:  # packed along K by its cast: its own bytes
                assert torch.equal(got.view(torch.uint8), x._data.view(torch.uint8)), name
        args, kwargs = _nvfp4_args(a, b, device="meta")
        assert cuda_block_arg_problems(args, kwargs) == [], name
        out = torch.nn.functional.scaled_mm(*args, **kwargs)  # torch's meta kernel checks
        assert out.shape == (m, b2.shape[1]), name
        if _meta_kernel_checks_layouts():  # torch 2.11-2.13; later ones infer the shape only
            with pytest.raises(RuntimeError, match="swizzle"):
                torch.nn.functional.scaled_mm(*args, **dict(kwargs, swizzle_a=swizzles.NO_SWIZZLE))
        assert cuda_block_arg_problems(args, dict(kwargs, swizzle_a=swizzles.NO_SWIZZLE)), name
        short = (args[0], args[1], args[2][:-1], *args[3:])
        assert "scale_a must have" in cuda_block_arg_problems(short, kwargs)[0], name


@on_cpu  # the exact CPU kernel is the reference
@pytest.mark.parametrize("t, k_in, n_out", _NVFP4_SHAPES)
def test_nvfp4_cuda_args_compute_the_cpu_kernel_bit_for_bit(t, k_in, n_out):
    # CUDA's NVFP4 gemm read on the CPU: the packed operands unpacked, each scale read where cuBLAS
    # reads it (_swizzled_index), through the CPU kernel in 1x16 blocks, times the tensor scales
    # (what _cuda_nvfp4_mm does with the kernel's float32 output): f8dist's CPU NVFP4 gemm, bit for
    # bit, for the three gemms of a linear (16x16 weight blocks expand exactly)
    from f8dist.core.gemm import cpu_block_scaled_mm
    from f8dist.core.scaling import e2m1_unpack

    for name, a, b in _nvfp4_linear_gemms(t, k_in, n_out):
        n = b.shape[1]
        want = torch.mm(a, b).float()  # the CPU NVFP4 gemm, out_dtype float32
        (a2, b2, sa, _, sb, _), _ = _nvfp4_args(a, b)
        (m, kp), np_ = (a2.shape[0], 2 * a2.shape[1]), b2.shape[1]
        sa_rows = _read_swizzled(sa, m, kp // 16)  # [M, K'/16]
        sb_rows = _read_swizzled(sb, np_, kp // 16)  # [N', K'/16]
        got = cpu_block_scaled_mm(e2m1_unpack(a2, 1).to(E4M3), e2m1_unpack(b2, 0).to(E4M3),
                                  sa_rows, sb_rows.t(), [1, 16], [16, 1], torch.float32)
        got = got[:, :n] * (a._tensor_scale * b._tensor_scale)
        assert torch.equal(got, want), name


def test_nvfp4_gemm_off_the_cpu_raises_naming_emulate():
    # [Note: NVFP4 on CUDA]: a device without CUDA's NVFP4 kernel (here meta, standing for one
    # without a GPU) gets the error naming emulate=True, dense and grouped
    from f8dist.core.gemm import _cuda_nvfp4_mm

    a = torch.empty(16, 64, dtype=E4M3, device="meta")
    b = torch.empty(64, 32, dtype=E4M3, device="meta")
    sa = torch.empty(16, 4, dtype=E4M3, device="meta")  # [M, K/16]
    sb = torch.empty(4, 2, dtype=E4M3, device="meta")  # [K/16, N/16]
    ts = (torch.ones((), device="meta"),) * 2
    with pytest.raises(NotImplementedError, match="no meta kernel.*NVFP4.*sm100.*emulate=True"):
        _cuda_nvfp4_mm(a, b, sa, sb, (1, 16), (16, 16), None, ts, out_dtype=torch.bfloat16)
    offs = torch.empty(2, dtype=torch.int32, device="meta")
    with pytest.raises(NotImplementedError, match="grouped.*emulate=True"):
        _cuda_nvfp4_mm(a, b, sa, sb, (1, 16), (16, 16), offs, ts, out_dtype=torch.bfloat16)
