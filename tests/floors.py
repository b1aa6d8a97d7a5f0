"""SQNR floors the tests share, where they depend on the device.

[Note: exact gemm floor]
A float8 gemm and its emulation (``ScaledMMConfig(emulate=True)``: dequantize, then a float32
matmul) multiply the same float8 values, so they differ only by how the products are summed. On
the CPU, f8dist's kernel (``f8dist::cpu_scaled_mm``) sums in a float32 matmul too: > 100 dB.
CUDA's float8 tensor cores sum with fewer mantissa bits than float32: on an H100
(scripts/gpu_check.sh, torch 2.11) the tests measured 82 to 88 dB at K <= 64, so on CUDA the
floor is 80 dB, still far above any cast (e4m3 rounding alone is about 30 dB).
"""

import torch

__all__ = ["exact_gemm_db", "on_cpu", "NVFP4_FLOOR", "NVFP4_GRAD_FLOOR"]

# NVFP4 against high precision (docs/numerics.md): e2m1 in 1x16 e4m3 blocks gives about 17 dB
# per gemm on gaussian data; its gradients round stochastically, which costs about 2 dB per
# gradient gemm
NVFP4_FLOOR = 15.0
NVFP4_GRAD_FLOOR = NVFP4_FLOOR - 2.0


def exact_gemm_db() -> float:
    """The floor for a float8 gemm against its emulation on the default device."""
    return 80.0 if torch.get_default_device().type == "cuda" else 100.0


def on_cpu(test):
    """Run ``test`` with the CPU as the default device, also under ``F8DIST_TEST_DEVICE=cuda``:
    for tests of block-scaled gemms, whose CUDA kernels need sm90 (DeepSeek's blocks) or sm100+
    (MXFP8) ([Note: the block-scaled gemm] in f8dist/core/gemm.py): on CUDA they are checked against
    the CPU kernel by scripts/cuda_block_check.py instead."""
    import functools

    @functools.wraps(test)
    def wrapper(*args, **kwargs):
        with torch.device("cpu"):
            return test(*args, **kwargs)

    return wrapper
