"""Distributed checkpoints (DCP) that load across float8 recipes.

[Note: loading across recipes]
A model's recipe decides its state_dict: a delayed-scaling linear adds its amax histories and
scales (``fp8_amax_*``, ``fp8_amax_history_*``, ``fp8_scale_*``: [Note: delayed checkpoints] in
f8dist/delayed.py); a plain, dynamic or block-scaled one has its weight and bias only. DCP's
default planner loads exactly the keys the model asks for and refuses any that the checkpoint
lacks, so a plain or tensorwise checkpoint would not load into a delayed model.
:class:`Float8LoadPlanner` loads every key the checkpoint has and leaves out the delayed-scaling
state it lacks; :meth:`Float8LoadPlanner.restart_missing` then restarts those linears' histories
(the next step is a first step) and names them, so a run can say so. The other direction needs no
help: keys the checkpoint has and the model does not ask for (a delayed checkpoint loaded into a
tensorwise model) are not read; :attr:`Float8LoadPlanner.unused_delayed_state` lists them.
Any other missing key still raises DCP's error.
"""

from __future__ import annotations

from typing import List

import torch.nn as nn
from torch.distributed.checkpoint import DefaultLoadPlanner

from f8dist.agreement import canonical_name
from f8dist.delayed import DELAYED_BUFFER_PREFIXES, DelayedScaling

__all__ = ["Float8LoadPlanner"]


def _is_delayed_state(key: str) -> bool:
    return key.rsplit(".", 1)[-1].startswith(DELAYED_BUFFER_PREFIXES)


class Float8LoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` that loads a checkpoint saved with another float8 recipe
    ([Note: loading across recipes]).

    Example::

        >>> planner = Float8LoadPlanner()
        >>> dcp.load({"model": sd}, checkpoint_id=path, planner=planner)    # doctest: +SKIP
        >>> model.load_state_dict(sd)                                        # doctest: +SKIP
        >>> planner.restart_missing(model)   # linears whose histories restart  # doctest: +SKIP
        ['layers.0.attention.wq', ...]
    """

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.missing_delayed_state: List[str] = []  # asked for, not in the checkpoint: not loaded
        self.unused_delayed_state: List[str] = []  # in the checkpoint, not asked for

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        super().set_up_planner(state_dict, metadata, is_coordinator)
        saved = metadata.state_dict_metadata if metadata is not None else {}
        self.missing_delayed_state = [k for k in self.state_dict if _is_delayed_state(k) and k not in saved]
        for key in self.missing_delayed_state:
            del self.state_dict[key]  # it keeps the value it has: restart_missing resets it
        self.unused_delayed_state = [k for k in saved if _is_delayed_state(k) and k not in self.state_dict]

    def restart_missing(self, model: nn.Module) -> List[str]:
        """Restart the delayed scaling of each linear of ``model`` whose state the checkpoint did
        not hold (``DelayedScaling.restart``); returns their names. Keys may carry a prefix
        (``{"model": model_state_dict}`` loads as ``model.<fqn>``)."""
        owners = {key.rsplit(".", 1)[0] for key in self.missing_delayed_state}
        restarted = []
        for name, module in model.named_modules():
            delayed = getattr(module, "delayed", None)
            name = canonical_name(name)
            if isinstance(delayed, DelayedScaling) and any(o == name or o.endswith("." + name) for o in owners):
                delayed.restart()
                restarted.append(name)
        return restarted
