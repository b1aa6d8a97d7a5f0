import pytest
import torch

from f8dist.numerics import sqnr
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
    assert q.scales.shape == ((8,) if fmt.blockwise else (0,))
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


# octaves below its block's max that a format keeps ([Note: state formats])
RANGE = {StateFormat.E4M3: 17, StateFormat.E5M2: 31, StateFormat.SQRT_E4M3: 35,
         StateFormat.LOG8: 31, StateFormat.LOG16: 15}


@pytest.mark.parametrize("fmt", list(RANGE), ids=str)
def test_range_below_the_block_max(fmt):
    inside, beyond = 2.0 ** -RANGE[fmt], 2.0 ** -(RANGE[fmt] + 8)
    y = _round_trip(torch.tensor([1.0, inside, beyond, 0.0]), fmt, 4)
    assert y[1] > 0 and y[3] == 0
    if fmt in (StateFormat.LOG8, StateFormat.LOG16):
        # a second moment below the range is overestimated (a smaller update), never flushed to
        # zero (an update of m / eps), as the float8 formats do
        assert y[2] == _round_trip(torch.tensor([1.0, beyond * 2 ** -30]), fmt, 2)[1] > 0
    else:
        assert y[2] == 0


@pytest.mark.parametrize("fmt", list(StateFormat), ids=str)
def test_empty_and_short_vectors(fmt):
    assert encode(torch.zeros(0), fmt, 128).codes.shape == (0,)
    assert decode(encode(torch.zeros(0), fmt, 128)).shape == (0, 128)
    x = _data(fmt, n=5)
    y = _round_trip(x.view(5, 1), fmt, 128)  # one short block, any input shape
    assert y.shape == (5,) and sqnr(x, y) >= FLOOR_DB[fmt]
