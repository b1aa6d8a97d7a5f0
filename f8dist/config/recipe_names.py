"""The recipe names, torch-free: scripts/train.py reads them before importing torch ([Note: flags
before torch] in scripts/train_flags.py). Standard library only."""

from __future__ import annotations

import enum

__all__ = ["Float8LinearRecipeName"]


class Float8LinearRecipeName(enum.Enum):
    TENSORWISE = "tensorwise"
    ROWWISE = "rowwise"
    ROWWISE_WITH_GW_HP = "rowwise_with_gw_hp"
    DELAYED = "delayed"
    # 1x32 blocks, e8m0 scales, e4m3 everywhere ([Note: block scales] in f8dist/config/cells.py)
    MXFP8 = "mxfp8"
    MXFP8_WGRAD_WITH_HP = "mxfp8_wgrad_with_hp"  # mxfp8, grad_weight gemm in high precision
    MXFP8_SQUARE_WEIGHTS = "mxfp8_square_weights"  # mxfp8 with 32x32 weight blocks
    BLOCKWISE = "blockwise"  # DeepSeek-V3: 1x128 activations and gradients, 128x128 weights
    # e2m1 in 1x16 blocks (16x16 weights), e4m3 block scales, a float32 tensor scale ([Note:
    # NVFP4] in f8dist/config/cells.py)
    NVFP4 = "nvfp4"
    # nvfp4 without the random Hadamard transform of the grad_weight gemm's operands, which
    # costs grad_weight SQNR on data with outliers (docs/numerics.md)
    NVFP4_NO_RHT = "nvfp4_no_rht"
