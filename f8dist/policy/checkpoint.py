"""Distributed checkpoints (DCP) that load across float8 recipes.

[Note: loading across recipes]
Only a delayed-scaling linear adds state to its weight and bias ([Note: delayed checkpoints] in
f8dist/policy/delayed/hooks.py), and DCP's default planner refuses keys the checkpoint lacks, so a
non-delayed checkpoint would not load into a delayed model. :class:`Float8LoadPlanner` leaves out
the delayed state the checkpoint lacks, and :meth:`Float8LoadPlanner.restart_missing` restarts
those linears' histories and names them. Keys the model does not ask for are not read
(:attr:`Float8LoadPlanner.unused_delayed_state` lists them). Any other missing key still raises.
"""

from __future__ import annotations

from typing import List

import torch.nn as nn
from torch.distributed.checkpoint import DefaultLoadPlanner

from f8dist.core.agreement import canonical_name
from f8dist.policy.delayed import DELAYED_BUFFER_PREFIXES, DelayedScaling

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
        not hold; returns their names. Keys may carry a prefix (``model.<fqn>``)."""
        owners = {key.rsplit(".", 1)[0] for key in self.missing_delayed_state}
        restarted = []
        for name, module in model.named_modules():
            delayed = getattr(module, "delayed", None)
            name = canonical_name(name)
            if isinstance(delayed, DelayedScaling) and any(o == name or o.endswith("." + name) for o in owners):
                delayed.restart()
                restarted.append(name)
        return restarted
