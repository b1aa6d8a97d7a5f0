"""Training text that needs no download: the Python standard library's own source, as bytes.

The tokenizer is the identity on bytes (vocab 256). Batches are random windows of the corpus,
drawn from a generator seeded by ``(seed, step)`` alone: each dp rank takes its contiguous slice
of the global batch, so every data-parallel layout sees the same rows, and the loader's whole
state is its step counter, so resuming is exact.
"""

from __future__ import annotations

import functools
import glob
import os
from typing import Dict, Tuple

import torch

__all__ = ["ByteBatches", "corpus_bytes", "decode", "encode", "VOCAB_SIZE"]

VOCAB_SIZE = 256
_VAL_FRACTION = 0.1
_SPLITS = ("train", "val")


@functools.lru_cache(maxsize=None)
def corpus_bytes(split: str = "train") -> torch.Tensor:
    """The stdlib's top-level ``*.py`` files, sorted and concatenated (uint8, 1-D), split."""
    if split not in _SPLITS:
        raise ValueError(f"unknown split {split!r}; use one of {_SPLITS}")
    stdlib = os.path.dirname(os.__file__)
    paths = sorted(glob.glob(os.path.join(stdlib, "*.py")))
    if not paths:
        raise RuntimeError(f"no *.py files found in the standard library directory {stdlib}")
    data = bytearray()
    for path in paths:
        with open(path, "rb") as f:
            data += f.read()
    tokens = torch.frombuffer(data, dtype=torch.uint8).clone()
    cut = int(len(tokens) * (1 - _VAL_FRACTION))
    return tokens[:cut] if split == "train" else tokens[cut:]


def encode(text: str) -> torch.Tensor:
    """UTF-8 bytes of ``text`` as token ids (int64)."""
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)


def decode(tokens: torch.Tensor) -> str:
    return bytes(tokens.to(torch.uint8).tolist()).decode("utf-8", errors="replace")


class ByteBatches:
    """An endless iterator of ``(inputs, targets)``, each ``[batch_size // dp_size, seq_len]``
    int64, targets shifted by one byte; a DCP ``Stateful``.

    Example::

        >>> batches = ByteBatches(seq_len=8, batch_size=4, seed=0, dp_rank=1, dp_size=2)
        >>> inputs, targets = next(batches)
        >>> inputs.shape, bool((inputs[:, 1:] == targets[:, :-1]).all()), batches.state_dict()
        (torch.Size([2, 8]), True, {'step': 1})
    """

    def __init__(
        self,
        *,
        seq_len: int,
        batch_size: int,
        seed: int,
        split: str = "train",
        dp_rank: int = 0,
        dp_size: int = 1,
    ):
        if batch_size % dp_size:
            raise ValueError(
                f"the global batch size ({batch_size}) must be divisible by the number of "
                f"data-parallel ranks ({dp_size}); change --batch-size or the parallel layout"
            )
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} is not in [0, {dp_size})")
        self.data = corpus_bytes(split)
        if len(self.data) <= seq_len + 1:
            raise ValueError(f"seq_len {seq_len} is longer than the {split} split")
        self.seq_len, self.batch_size, self.seed = seq_len, batch_size, seed
        self.rows = slice(dp_rank * batch_size // dp_size, (dp_rank + 1) * batch_size // dp_size)
        self.step = 0

    def __iter__(self):
        return self

    def __next__(self) -> Tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.step)
        starts = torch.randint(  # on the CPU, as the generator and the data, whatever the default
            0, len(self.data) - self.seq_len - 1, (self.batch_size,), generator=generator,
            device="cpu",
        )[self.rows]  # [b]
        windows = torch.stack([self.data[s : s + self.seq_len + 1] for s in starts.tolist()])
        windows = windows.long()  # [b, S + 1]
        self.step += 1
        return windows[:, :-1], windows[:, 1:]

    def state_dict(self) -> Dict[str, int]:
        return {"step": self.step}

    def load_state_dict(self, state_dict: Dict[str, int]) -> None:
        self.step = int(state_dict["step"])
