import pytest
import torch

from f8dist.core.numerics import sqnr
from f8dist.optim.states import StateFormat, blocks, decode, encode, encode_into, unblock

BLOCKWISE = [f for f in StateFormat if f.blockwise]
UNSIGNED = [f for f in StateFormat if not f.signed]

# one rounding of gaussian data (second moments: its square), in dB; the float8 and log floors
# follow from the significant bits of each format ([Note: state formats])
FLOOR_DB = {
    StateFormat.FP32: float("inf"), StateFormat.BF16: 50, StateFormat.E4M3: 29,
    StateFormat.E5M2: 21, StateFormat.INT8: 34, StateFormat.SQRT_E4M3: 23,
    StateFormat.LOG8: 27, StateFormat.LOG16: 33,
}


def _data(fmt, n=1000, seed=0):
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed))
    return x if fmt.signed else x * x


def _round_trip(x, fmt, block_size):
    return unblock(decode(encode(x, fmt, block_size)), x.numel())


@pytest.mark.parametrize("fmt", list(StateFormat), ids=str)
def test_round_trip_within_the_format_precision(fmt):
    x = _data(fmt)
    q = encode(x, fmt, block_size=128)
    assert q.codes.dtype == fmt.code_dtype and q.codes.shape == (1024,)  # 8 whole blocks
    assert q.scales.shape == (8 * fmt.scales_per_block,)
    y = unblock(decode(q), 1000)
    assert sqnr(x, y) >= FLOOR_DB[fmt]
    assert torch.equal(decode(q)[-1, 1000 - 7 * 128:], torch.zeros(24))  # the padding
    # encoding what was decoded gives it back, bit for bit: a checkpoint of decoded states
    # resumes exactly ([Note: state formats])
    assert torch.equal(_round_trip(y, fmt, 128), y)


@pytest.mark.parametrize("fmt", [StateFormat.E4M3, StateFormat.E5M2, StateFormat.SQRT_E4M3],
                         ids=str)
def test_decoded_float8_states_are_exact_in_bfloat16(fmt):
    y = _round_trip(_data(fmt) * 1e-6, fmt, 32)
    assert torch.equal(y.bfloat16().float(), y)


@pytest.mark.parametrize("fmt", BLOCKWISE, ids=str)
def test_blocks_are_independent_and_zeros_stay_zero(fmt):
    x = _data(fmt, n=300)
    x[128:256] = 0  # one all-zero block
    x[256:] *= 1e6  # a block 1e6 larger does not touch the others
    q = encode(x, fmt, 128)
    y = unblock(decode(q), 300)
    assert torch.equal(y[128:256], torch.zeros(128))
    assert torch.equal(y[:128], _round_trip(x[:128], fmt, 128))
    encode_into(q, blocks(torch.zeros(300), 128))
    assert torch.equal(decode(q), torch.zeros(3, 128))


# octaves below its block's max (the log formats: below the largest value but their outlier)
# that a format keeps ([Note: state formats])
RANGE = {StateFormat.E4M3: 17, StateFormat.E5M2: 31, StateFormat.SQRT_E4M3: 35,
         StateFormat.LOG8: 31, StateFormat.LOG16: 15}


@pytest.mark.parametrize("fmt", list(RANGE), ids=str)
def test_range_below_the_block_max(fmt):
    inside, beyond = 2.0 ** -RANGE[fmt], 2.0 ** -(RANGE[fmt] + 8)
    y = _round_trip(torch.tensor([1.0, 1.0, inside, beyond, 0.0]), fmt, 5)
    assert y[2] > 0 and y[4] == 0
    if fmt in (StateFormat.LOG8, StateFormat.LOG16):
        # a second moment below the range is overestimated (a smaller update), never flushed to
        # zero (an update of m / eps), as the float8 formats do
        floor = _round_trip(torch.tensor([1.0, 1.0, beyond * 2 ** -30]), fmt, 3)[2]
        assert y[3] == floor > 0
    else:
        assert y[3] == 0


@pytest.mark.parametrize("fmt", list(StateFormat), ids=str)
def test_empty_and_short_vectors(fmt):
    assert encode(torch.zeros(0), fmt, 128).codes.shape == (0,)
    assert decode(encode(torch.zeros(0), fmt, 128)).shape == (0, 128)
    x = _data(fmt, n=5)
    y = _round_trip(x.view(5, 1), fmt, 128)  # one short block, any input shape
    assert y.shape == (5,) and sqnr(x, y) >= FLOOR_DB[fmt]


@pytest.mark.parametrize("fmt", list(StateFormat), ids=str)
def test_non_finite_values_decode_as_themselves_and_leave_their_block_alone(fmt):
    # [Note: non-finite states]: a moment of inf or NaN is kept (so a step follows torch's
    # AdamW: v = inf gives an update of 0), the block's scale comes from its finite values
    inf = float("inf")
    x = _data(fmt, n=8)
    y = _round_trip(torch.cat([x, torch.tensor([inf, float("nan"), -inf])]), fmt, 16)
    assert torch.equal(y[:8], _round_trip(x, fmt, 16))
    assert y[8] == inf and y[9].isnan()
    assert y[10] == (-inf if fmt.signed else 0.0)  # no sign: -inf is 0, as any negative
    # the largest finite values stay finite (bf16 saturates where rounding gives inf)
    big = x / x.abs().max() * torch.finfo(torch.float32).max
    assert _round_trip(big, fmt, 16).isfinite().all()
    # no finite value takes a non-finite code (e4m3's -0 is NaN's)
    tiny = torch.tensor([1.0, -1e-30, 0.0, -0.0])
    assert _round_trip(tiny if fmt.signed else tiny.abs(), fmt, 4).isfinite().all()


def test_log_formats_keep_one_outlier_apart():
    # [Note: outliers in the second moment]: one huge value in a block leaves the others coded
    # as without it (and is itself exact); a second one pushes them below the range
    x = _data(StateFormat.LOG16, n=64)
    for fmt in (StateFormat.LOG8, StateFormat.LOG16):
        alone = _round_trip(x, fmt, 64)
        one = _round_trip(torch.cat([torch.tensor([1e37]), x[1:]]), fmt, 64)
        without = _round_trip(torch.cat([x[1:].max().view(1), x[1:]]), fmt, 64)
        assert one[0] == 1e37 and torch.equal(one[1:], without[1:])
        assert sqnr(x[1:], one[1:]) >= FLOOR_DB[fmt] and sqnr(x, alone) >= FLOOR_DB[fmt]
        two = _round_trip(torch.cat([torch.tensor([1e37, 1e37]), x[2:]]), fmt, 64)
        assert (two[2:] > 1e20).all()  # the others at the smallest code, 1e37 * 2**-31.4 or more
