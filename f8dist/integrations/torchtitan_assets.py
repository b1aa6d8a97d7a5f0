"""The files torchtitan's llama3 debug model config reads from a torchtitan checkout, made anywhere.

[Note: torchtitan assets]
torchtitan's ``llama3_debugmodel`` reads a torchtitan checkout's ``tests/assets/tokenizer`` and
``tests/assets/c4_test`` and writes ``./outputs``, so it fails anywhere else. The config
functions of f8dist.integrations.torchtitan use files made here once, under :func:`assets_dir`,
with no download: ``tokenizer/`` (byte-level, 256 byte tokens plus begin/end of text: fits the
debug vocabulary), ``c4_test/train.jsonl`` (the standard library's Python files, the corpus of
f8dist.models.data) and ``outputs/`` (the Trainer's ``dump_folder``).
"""

from __future__ import annotations

import glob
import json
import os
from typing import Dict

__all__ = ["ASSETS_ENV", "BOS", "EOS", "assets_dir", "make_assets"]

ASSETS_ENV = "F8DIST_TORCHTITAN_ASSETS"
BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"


def assets_dir() -> str:
    """Where the assets live: ``$F8DIST_TORCHTITAN_ASSETS``, else ``$XDG_CACHE_HOME/f8dist/torchtitan``
    (``~/.cache/f8dist/torchtitan``)."""
    if os.environ.get(ASSETS_ENV):
        return os.path.abspath(os.environ[ASSETS_ENV])
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "f8dist", "torchtitan")


def make_assets(root: str = "") -> Dict[str, str]:
    """Make (if missing) and return the paths ``{"tokenizer", "dataset", "outputs"}`` under
    ``root`` (default :func:`assets_dir`) ([Note: torchtitan assets]).

    Example::

        >>> paths = make_assets()                                       # doctest: +SKIP
        >>> config.hf_assets_path = paths["tokenizer"]                  # doctest: +SKIP
    """
    root = root or assets_dir()
    paths = {name: os.path.join(root, sub) for name, sub in
             (("tokenizer", "tokenizer"), ("dataset", "c4_test"), ("outputs", "outputs"))}
    for path in paths.values():
        os.makedirs(path, exist_ok=True)
    if not os.path.exists(os.path.join(paths["tokenizer"], "tokenizer_config.json")):
        _write_tokenizer(paths["tokenizer"])
    if not os.path.exists(os.path.join(paths["dataset"], "train.jsonl")):
        _write_dataset(paths["dataset"])
    return paths


def _write_tokenizer(directory: str) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())  # 256 printable stand-ins for bytes
    tokenizer = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([BOS, EOS])
    tokenizer.save(_partial(directory, "tokenizer.json"))
    _commit(directory, "tokenizer.json")
    with open(_partial(directory, "tokenizer_config.json"), "w") as f:  # written last: the marker
        json.dump({"bos_token": BOS, "eos_token": EOS, "add_bos_token": False,
                   "add_eos_token": False}, f, indent=1)
    _commit(directory, "tokenizer_config.json")


def _write_dataset(directory: str) -> None:
    stdlib = os.path.dirname(os.__file__)
    with open(_partial(directory, "train.jsonl"), "w") as f:
        for path in sorted(glob.glob(os.path.join(stdlib, "*.py"))):
            with open(path, encoding="utf-8", errors="replace") as src:
                f.write(json.dumps({"text": src.read()}) + "\n")
    _commit(directory, "train.jsonl")


def _partial(directory: str, name: str) -> str:
    return os.path.join(directory, f".{name}.{os.getpid()}.partial")


def _commit(directory: str, name: str) -> None:
    """Rename the partial file into place: ranks making the assets at once never read half a file."""
    os.replace(_partial(directory, name), os.path.join(directory, name))
