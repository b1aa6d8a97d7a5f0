"""Optimizers whose states take less memory, for float8 training (and any other).

* :class:`AdamW` (``adamw.py``): ``torch.optim.AdamW`` with 8-bit moments on each parameter's
  local shard ([Note: 8-bit AdamW on shards]); checkpoints as torch's AdamW's.
* :class:`StateFormat` (``states.py``): the formats a moment can be stored in
  ([Note: state formats]).

Example::

    >>> from f8dist.optim import AdamW
    >>> optimizer = AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95))   # doctest: +SKIP
"""

from f8dist.optim.adamw import AdamW
from f8dist.optim.states import StateFormat

__all__ = ["AdamW", "StateFormat"]
