"""scripts/cuda_block_check.py without a GPU: the gemms it sends to CUDA are the three gemms of
each block recipe (checked here on the CPU kernel), and its skip rule is f8dist's own error."""

import os
import sys

import pytest
import torch

from f8dist.config import ScaledMMConfig
from f8dist.core.gemm import scaled_mm
from f8dist.core.numerics import sqnr

SCRIPTS = os.path.join(os.path.dirname(__file__), "..", "..", "scripts")
sys.path.insert(0, os.path.abspath(SCRIPTS))

import cuda_block_check  # noqa: E402


@pytest.mark.parametrize("kernel, names", [
    ("deepseek", ["output", "grad_input", "grad_weight"]),
    ("mxfp8", ["output w1x32", "grad_input w1x32", "output w32x32", "grad_input w32x32",
               "grad_weight"]),
])
def test_gemm_cases_are_valid_block_gemms(kernel, names):
    # 200 tokens: the grad_weight gemm's K is not a multiple of the block (padded)
    with torch.device("cpu"):
        torch.manual_seed(0)
        cases = cuda_block_check.gemm_cases(200, 256, 384, "cpu", kernel)
        assert [c[0] for c in cases] == names
        for name, ad, as_, ab, bd, bs, bb, hp in cases:
            assert as_.dtype == bs.dtype == cuda_block_check.KERNELS[kernel]["scale_dtype"]
            assert ab[1] == bb[0] == cuda_block_check.KERNELS[kernel]["inner"], name
            out = scaled_mm(ad, as_, bd, bs, out_dtype=torch.float32, mm_config=ScaledMMConfig(),
                            a_block=ab, b_block=bb)
            assert out.shape == hp.shape and sqnr(hp, out) > cuda_block_check.FLOOR_VS_HP, name


def test_recipes_of_each_kernel_are_the_block_recipes():
    from f8dist.config import Float8LinearRecipeName

    listed = sorted(r for spec in cuda_block_check.KERNELS.values() for r in spec["recipes"])
    block = sorted(r.value for r in Float8LinearRecipeName
                   if r.value.startswith(("mxfp8", "blockwise", "nvfp4")))
    assert listed == block


@pytest.mark.parametrize("capability, skipped", [((9, 0), ["mxfp8", "nvfp4"]), ((10, 0), ["deepseek"]),
                                                  ((8, 0), ["deepseek", "mxfp8", "nvfp4"])])
def test_skip_reason_is_f8dists_error(capability, skipped, monkeypatch):
    # an sm90 GPU skips MXFP8 and NVFP4 naming 'blockwise' and sm100 skips DeepSeek's blocks naming 'mxfp8'
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: capability)
    reasons = {k: cuda_block_check.skip_reason(k) for k in cuda_block_check.KERNELS}
    assert sorted(k for k, r in reasons.items() if r is not None) == skipped
    if capability == (9, 0):
        assert "'blockwise'" in reasons["mxfp8"] and "emulate=True" in reasons["mxfp8"]
    if capability == (10, 0):
        assert "'mxfp8'" in reasons["deepseek"]
