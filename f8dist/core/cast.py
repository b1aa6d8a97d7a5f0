"""The one place a high-precision tensor becomes a Float8Tensor: ``cast_to_float8(t, spec)``.

A cast is described by a :class:`~f8dist.config.CastSpec` (which linear, gemm and operand, and
how: dtype, granularity, contraction axis, rounding), so every cast knows where it happens and can
be observed (``f8dist.debug``). Linear, the tensor-parallel styles and the FSDP2 all-gather all cast
through it.

``cast_to_float8`` takes plain tensors and DTensors alike. For a DTensor the amax is the plain
torch reduction, whose ``Partial(max)`` placements are then reduced ([Note: amax] in
f8dist/core/placement.py); the result is a DTensor whose local tensor is a Float8Tensor holding the local
shard and its scale. A tensor that already is float8 keeps its bytes when they are what this spec
would produce, and is re-cast from its high-precision value otherwise.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Callable, Dict, List, Optional

import torch
from torch.utils.weak import WeakIdKeyDictionary

from f8dist.config import CastSite, CastSpec, ScalingType
from f8dist.core.placement import (
    blocks_split_by_shards, global_positions, is_dtensor, layout, like, local_part, reduce_partial,
    reduce_over_shards, with_layout,
)
from f8dist.core.scaling import (
    E2M1, amax_to_scale, block_cast, counter_uniform, group_amax, group_ids, hadamard_signs,
    in_memory, nvfp4_cast, random_hadamard, saturated_cast, stored_scale, tensor_amax,
)
from f8dist.core.tensor import Block, Float8Tensor, KeptShard, block_of

__all__ = [
    "CastSite", "cast_to_float8", "ToFloat8", "logical_amax", "high_precision", "cast_observers",
    "shared_casts", "cast_with_companion", "companion_for", "kept_shard_for", "SharedGather",
    "autocast_input", "StochasticRounding", "stochastic_rounding",
]


# Callbacks ``fn(site, hp, fp8)`` run after every cast while non-empty (f8dist.debug fills it).
# Empty by default: the check is a Python-level branch, so it adds no op to a traced graph.
cast_observers: List[Callable[[CastSite, torch.Tensor, torch.Tensor], None]] = []


def logical_amax(x: torch.Tensor, dim: Optional[int] = None) -> torch.Tensor:
    """amax of the logical tensor ([Note: amax]): for a DTensor the reduction's Partial
    placements are reduced (an all-reduce over the axes sharding the reduced dims), Shard
    placements of kept dims stay sharded."""
    return reduce_partial(tensor_amax(x, dim))


def high_precision(t: torch.Tensor) -> torch.Tensor:
    """The high-precision value of an operand (dequantized if it is float8)."""
    local = local_part(t)
    if isinstance(local, Float8Tensor):
        return like(t, local.to_original_precision())
    return t


def autocast_input(x: torch.Tensor) -> torch.Tensor:
    """``x`` in the autocast dtype of its device when autocast is on there, as autocast casts
    nn.Linear's input ([Note: autocast] in f8dist/nn/linear.py); else ``x`` as it is. A device that
    autocast does not know (meta: a model built there, a shape-only forward) computes as
    nn.Linear does on it, in ``x``'s dtype."""
    device = x.device.type
    if torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device):
        return x.to(torch.get_autocast_dtype(device))
    return x


# [Note: the stochastic rounding key]
# A stochastically rounded cast ([Note: stochastic rounding] in f8dist/core/scaling.py) draws with
# the key (seed, site, draw): the site's FQN, gemm and operand, and ``draw`` the number of such
# casts that site made before since the seed was set. Every rank of an SPMD program makes the same
# casts of a site in the same order (its shards of one tensor, each cast once), so each derives
# the same key with no collective, and with the element's global position the same draw as one
# device. Data-parallel replicas, each on its own batch, must not draw alike: their positions are
# their batches', and alike draws would correlate their rounding errors, which then would not
# average down over the gradient reduction (what rounding stochastically is for). So each rank
# draws from a stream, ``stochastic_rounding.reset(seed, stream=k)``, mixed into the key: its
# data-parallel replica's index (scripts/train.py's ``sr_stream_of``). The ranks that shard one
# tensor (TP, CP, EP; FSDP2's weight, which is never rounded stochastically) are one replica and
# share a stream; one device running replica k's batch with stream k draws as its ranks do.
# Stream 0 keys as before streams were.
# ``stochastic_rounding`` holds the seed, the streams and the counts (``state_dict`` to
# checkpoint them: a resumed run then draws on as the uninterrupted one), streams and counts per
# process-group rank so that ranks simulated as threads of one process count as processes do
# (``reset`` starts over the calling rank's). Two runs compared draw alike only from the same
# state: ``stochastic_rounding.reset(seed, stream)`` (or ``load_state_dict``) before each.
# The cast reads its key from the custom op ``f8dist::sr_key(t, site)``, an int64 tensor: opaque
# to torch.compile, so a compiled graph calls it each step (a Python int would be traced as a
# constant, every step rounding alike, and its count a side effect dynamo refuses). Counting per
# site makes the order of sites' casts within a graph irrelevant; ``t``, the tensor being cast,
# is an input so the op runs where the cast does (backward, for a gradient) and two casts are
# never merged into one call (nondeterministic_seeded: no CSE either).


def _key(text: str) -> int:
    """A 64-bit key of ``text``, the same in every process (``hash`` is not)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


class StochasticRounding:
    """The seed and per-site draw counts of stochastic rounding ([Note: the stochastic rounding
    key]), and the seed of the random Hadamard transform's signs; one per process,
    ``f8dist.core.cast.stochastic_rounding``."""

    def __init__(self, seed: int = 0, stream: int = 0):
        self.load_state_dict({"seed": seed, "streams": {0: stream}, "draws": {}})

    def reset(self, seed: int = 0, stream: int = 0) -> None:
        """Start this rank over from ``seed`` (every rank the same) on ``stream`` (its
        data-parallel replica's index), none of its sites having drawn."""
        rank = _rank()
        self.load_state_dict({
            "seed": seed, "streams": {**self.streams, rank: stream},
            "draws": {c: n for c, n in self.draws.items() if c[1] != rank}})

    def key(self, site) -> int:
        """The key of ``site``'s next cast (a 64-bit int); counts the draw. Casts call it through
        :func:`sr_key`."""
        name, rank = str(site), _rank()
        draw = self.draws.get((name, rank), 0)
        self.draws[(name, rank)] = draw + 1
        stream = self.streams.get(rank, 0)
        return _key(f"{self.seed}:{name}:{draw}" + (f":{stream}" if stream else ""))

    def signs_key(self) -> int:
        """The key of the random Hadamard transform's signs: the seed's alone ([Note: random
        Hadamard transform] in f8dist/core/scaling.py). Kept from when the seed was set: a
        compiled graph reads it as a constant (guarded), which hashing in the cast would not be."""
        return self._signs_key

    def counts(self) -> Dict[str, int]:
        """This rank's draw count per site: what a checkpoint keeps so that a resumed run draws on
        as the unbroken one (the same on every rank of an SPMD program)."""
        rank = _rank()
        return {name: n for (name, r), n in self.draws.items() if r == rank}

    def load_counts(self, counts: Dict[str, int]) -> None:
        """Set this rank's draw counts to ``counts`` (:meth:`counts` of a saved run)."""
        rank = _rank()
        self.draws = {**{c: n for c, n in self.draws.items() if c[1] != rank},
                      **{(name, rank): int(n) for name, n in counts.items()}}

    def state_dict(self) -> dict:
        return {"seed": self.seed, "streams": dict(self.streams), "draws": dict(self.draws)}

    def load_state_dict(self, state: dict) -> None:
        self.seed, self.draws = int(state["seed"]), dict(state["draws"])
        self.streams = dict(state.get("streams", {}))  # none: stream 0 (a state before streams)
        self._signs_key = _key(f"{self.seed}:hadamard")


stochastic_rounding = StochasticRounding()


@torch.library.custom_op("f8dist::sr_key", mutates_args=(), tags=torch.Tag.nondeterministic_seeded)
def sr_key(t: torch.Tensor, site: str) -> torch.Tensor:
    """``stochastic_rounding.key(site)`` as an int64 [] on ``t``'s device (its bits; ``t`` is the
    tensor being cast): [Note: the stochastic rounding key]."""
    key = stochastic_rounding.key(site)
    return torch.tensor(key - 2**64 if key >= 2**63 else key, dtype=torch.int64, device=t.device)


@sr_key.register_fake
def _(t: torch.Tensor, site: str) -> torch.Tensor:
    return t.new_empty((), dtype=torch.int64)


def _draw_key(t: torch.Tensor, site: str) -> torch.Tensor:
    """:func:`sr_key` of ``t``: one call for the ranks a LocalTensorMode simulates in this process,
    as each process makes one (the op would otherwise run, and count, once per simulated rank)."""
    from torch.distributed._local_tensor import enabled_local_tensor_mode

    mode = enabled_local_tensor_mode()
    if mode is None:
        return sr_key(t, site)
    with mode.disable():
        return sr_key(torch.empty(0, device=t.device), site)  # every rank's key


def _rank() -> int:
    """This process's rank in the default group (0 without one)."""
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


# [Note: one cast per input]
# Sibling linears read the same input: attention's wq, wk and wv the normalized activations, an
# FFN's w1 and w3 theirs. Each would cast it and keep its own float8 copy for its grad_weight gemm,
# identical bytes when their specs are identical. A linear that keeps a float8 cast of its input
# for backward (``CastSpecs.saved_input`` FORWARD_CAST or GRAD_WEIGHT_CAST) casts it through the
# table of that input instead, ``cast_to_float8(..., shared=shared_casts(input))``: the table
# holds the casts made of the tensor at its current version, by spec less its FQN (plus the dtype
# and shape cast), so the first sibling casts and the others get its Float8Tensor, one copy kept
# for all. A cast is a pure function of the tensor and the spec, so each linear's gradients are
# those of casting on its own, bit for bit; telemetry still sees one cast per linear (observers
# are told of a shared cast under each site). The table is keyed weakly by the tensor's identity:
# it dies with the tensor, and an in-place write (a new ``_version``) starts a new one.
# Delayed scaling shares too: the siblings' input histories are the same, since every step each
# records the amax of the same tensor (its own records, the sync's rolls and a checkpoint's
# buffers are equal for all of them), so their scales are equal and so are their casts. The
# cast is made with the scale of the first sibling that casts the input, the others' scales (the
# same value) unused for it; each still records its amax into its own history, which keeps its
# ``state_dict`` keys and the sync as they were. This is the rule of the TP styles' shared input
# cast ([Note: delayed casts in the float8 styles] in f8dist/parallel/tp/style.py: cast with the named
# linear's scale, recorded into every linear below the module). Only a linear that also reads
# other tensors in other calls of the step can hold another history; it then computes with the
# first sibling's scale of this input. Not shared:
# - casts given an amax (the weight's, in backward) or any other given scale than a delayed one,
#   and grouped casts;
# - forwards that keep nothing for backward (eval, no grad): the cast is transient there, and the
#   table would keep it as long as the input lives;
# - tensors autograd did not make (no ``grad_fn``: a batch, a leaf): the caller may hand the same
#   tensor to the next step (a benchmark's loop), which would find this step's casts and skip its
#   own; the activations of a forward are made anew by each;
# - casts under saved-tensor hooks (activation checkpointing, full or per-op SAC; offloading):
#   the hooks decide what is kept, and a table beside them would keep a copy they do not know of
#   (of a checkpointed function's input, alive until its backward); worse, the recompute, handed
#   the same input, would find the original forward's table and skip casts that the forward ran,
#   and a per-op SAC policy replays its saved amaxes in the forward's order;
# - casts under torch.compile: dynamo does not trace the table. The traced graph holds one cast per
#   sibling, and AOTAutograd's common-subexpression elimination merges the identical ones before
#   its partitioner chooses what to save (tests/nn/test_linear.py checks the saved bytes); not the
#   delayed ones, whose scales are different buffers (equal values that the graph cannot see).
# The table lives as long as its input: the activations a model hands its linears die within
# the forward; a tensor the caller keeps across steps keeps its float8 copy as long.
_SHARED: "WeakIdKeyDictionary" = WeakIdKeyDictionary()


def shared_casts(t: torch.Tensor) -> Optional[Dict[tuple, torch.Tensor]]:
    """The table of float8 casts made of ``t`` at its current version ([Note: one cast per
    input]); hand it to :func:`cast_to_float8` as ``shared``. None where casts are not shared:
    under torch.compile, under saved-tensor hooks, for a tensor without ``grad_fn``.

    Example::

        >>> x = torch.randn(8, 16, requires_grad=True) * 2
        >>> a = cast_to_float8(x, CastSpec(fqn="wq"), shared=shared_casts(x))
        >>> a is cast_to_float8(x, CastSpec(fqn="wk"), shared=shared_casts(x))
        True
    """
    if (torch.compiler.is_compiling() or t.grad_fn is None
            or torch._C._autograd._top_saved_tensors_default_hooks(False)):
        return None
    version, table = _SHARED.get(t, (None, None))
    if version != t._version:
        table = {}
        _SHARED[t] = (t._version, table)
    return table


def _fits(fp8: Float8Tensor, spec: CastSpec, offsets: Optional[torch.Tensor] = None) -> bool:
    """Whether float8 bytes are what casting their value with ``spec`` would give."""
    if offsets is not None and fp8.dim() == 2 and _grouped_axis(spec, 2) != 1:
        return False  # tokens with per-group scales: their bytes depend on the groups
    layout = fp8.float8_layout
    return (layout.dtype == spec.dtype and layout.block == _block(spec, fp8.dim())
            and (not spec.blockwise or layout.scale_dtype == spec.scale_dtype))


def _block(spec: CastSpec, ndim: int) -> Block:
    """The block of ``spec``'s cast of an ``ndim``-D tensor ([Note: one scale layout] in
    f8dist/core/tensor.py): per ``spec.block_shape``; tensorwise (delayed too: one scale); or the
    whole dim the cast reduces over, blocks of 1 along the others, and a grouped cast's per
    expert or per token group scales along dim 0 ([Note: grouped casts] in f8dist/config/specs.py;
    the per-group scales of tokens scaled over their dim 0 are stored per element)."""
    if spec.blockwise:
        return block_of(ndim, block=spec.block_shape(ndim))
    if not spec.grouped or spec.scaling_type is ScalingType.DELAYED:
        return block_of(ndim, axiswise_dim=spec.axiswise_dim(ndim))
    axis = _grouped_axis(spec, ndim)
    whole = range(1, ndim) if axis is None else () if ndim == 2 and axis == 0 else (axis,)
    return tuple(None if d in whole else 1 for d in range(ndim))


def _grouped_axis(spec: CastSpec, ndim: int) -> Optional[int]:
    """The dim a grouped cast reduces over in an operand of ``ndim`` dims: the spec's axis in the
    2-D layout, shifted past the experts dim of a 3-D weight; None: tensorwise (per expert)."""
    if not spec.axiswise:
        return None
    return spec.axis % 2 + (ndim - 2)


def grouped_amax(t: torch.Tensor, spec: CastSpec, offsets: Optional[torch.Tensor]) -> torch.Tensor:
    """The amax of a grouped cast ([Note: grouped casts] in f8dist/config/specs.py), shaped to broadcast
    against ``t``: [E, 1, 1] / [E, N, 1] / [E, 1, K] for a 3-D weight; [M, 1] per token, or per
    token group ([M, 1] tensorwise, [M, C] over the tokens) for a 2-D ``t`` with ``offsets``."""
    axis = _grouped_axis(spec, t.dim())
    if t.dim() == 3:  # [E, N, K]
        return tensor_amax(t, (1, 2) if axis is None else axis)
    if axis == 1:  # one scale per token: no groups needed
        return tensor_amax(t, 1)  # [M, 1]
    if offsets is None:
        raise ValueError(f"{spec.site}: a grouped cast of token groups needs their offsets")
    rows = t if axis == 0 else tensor_amax(t, 1)  # [M, C] or [M, 1]
    per_group = group_amax(rows, offsets)  # [E, C] or [E, 1]
    ids = group_ids(offsets, t.shape[0]).clamp(max=offsets.shape[0] - 1)  # [M]
    return per_group[ids]  # [M, C] or [M, 1]


def cast_to_float8(
    t: torch.Tensor, spec: CastSpec, scale: Optional[torch.Tensor] = None, *,
    amax: Optional[torch.Tensor] = None, store: bool = False,
    offsets: Optional[torch.Tensor] = None, shared: Optional[Dict[tuple, torch.Tensor]] = None,
    positions: Optional[torch.Tensor] = None, shards: Optional[tuple] = None,
) -> torch.Tensor:
    """Cast ``t`` as ``spec`` says: a Float8Tensor, or a DTensor of them if ``t`` is a DTensor.

    ``scale`` given: use it (a delayed scale from an amax history, a precomputed FSDP scale);
    else compute it from the amax of the logical ``t``: of the whole tensor (tensorwise) or over
    ``spec.axis`` (axiswise). ``amax`` given: that amax, already known (the forward's weight amax
    in backward, [Note: what the matmul keeps for backward] in f8dist/nn/linear.py), shaped as the
    cast's own would be; for NVFP4, the logical tensor's amax ([] float32) of a local ``t``
    (experts under EP: [Note: NVFP4 experts] in f8dist/nn/grouped.py). ``store``: the bytes serve two gemms, so a compiled graph stores them
    once and takes the other layout from them. ``offsets``: the token groups of a grouped cast
    (``spec.grouped``, [Note: grouped casts] in f8dist/config/specs.py). ``shared``: a table of casts of
    the same tensor (:func:`shared_casts`), looked up first and filled ([Note: one cast per
    input]; a delayed cast found there has the first sibling's scale). ``positions``: where a
    stochastically rounded cast draws, int64 of the local shape (the experts' tokens: [Note:
    positions in token groups] in f8dist/core/scaling.py); else the elements' global positions.
    ``shards``: the (mesh, placements) a plain NVFP4 ``t`` is a local part of, its own amax (of
    what it casts: transformed, under ``spec.random_hadamard``) reduced over their axes
    (experts under EP: [Note: NVFP4 experts] in f8dist/nn/grouped.py). Not differentiable: see :class:`ToFloat8` for that.

    Example::

        >>> fp8 = cast_to_float8(torch.randn(32, 16), CastSpec(dtype=torch.float8_e4m3fn))
        >>> fp8.float8_layout  # one scale: every dim whole
        Layout(dtype=torch.float8_e4m3fn, block=(None, None), scale_dtype=torch.float32)
    """
    delayed = spec.scaling_type is ScalingType.DELAYED
    if (shared is not None and (scale is None or delayed) and amax is None and offsets is None
            and not spec.grouped):
        key = (dataclasses.replace(spec, fqn=""), t.dtype, tuple(t.shape))
        out = shared.get(key)
        if out is not None:  # a delayed one: the first sibling's scale ([Note: one cast per input])
            return _observed(spec, t, out)
        out = shared[key] = cast_to_float8(t, spec, scale, store=store)
        return out
    local = local_part(t)
    if isinstance(local, Float8Tensor):
        if _fits(local, spec, offsets):
            return like(t, local.with_mm_config(spec.mm_config))
        companion = local._companion  # [Note: two casts of one tensor] in f8dist/core/tensor.py
        if isinstance(companion, Float8Tensor) and _fits(companion, spec, offsets):
            return like(t, companion.with_mm_config(spec.mm_config))
        t = high_precision(t)
    if not spec.enabled:
        raise ValueError(f"{spec.site}: its CastSpec says ScalingType.DISABLED; nothing to cast")
    if spec.blockwise:
        return _cast_blocks(t, spec, scale, amax, store, positions, shards)
    if spec.scaling_type is ScalingType.DELAYED and scale is None:
        raise RuntimeError(
            f"{spec.site}: a delayed cast needs the scale from the module's amax history"
        )
    axis = spec.axiswise_dim(t.dim())
    if spec.grouped and spec.scaling_type is not ScalingType.DELAYED:  # delayed: one scale
        if scale is not None or amax is not None:
            raise ValueError(f"{spec.site}: a grouped cast computes its own per-expert scales")
        axis = _grouped_axis(spec, t.dim())
        amax = reduce_partial(grouped_amax(t, spec, offsets))  # a DTensor's: [Note: amax]
    if scale is not None and amax is not None:
        raise ValueError(f"{spec.site}: give a cast its scale or its amax, not both")
    if scale is None:
        if amax is None:
            t = in_memory(t)  # read twice: [Note: a cast that waits for its amax] (scaling.py)
            amax = logical_amax(t, axis)  # [] or t.shape with 1 at axis
        elif amax.dim() != (0 if axis is None else t.dim()) and not spec.grouped:
            raise ValueError(
                f"{spec.site}: a given amax must have the shape of the cast's own ([] tensorwise, "
                f"{t.dim()}-D axiswise), got {tuple(amax.shape)}"
            )
        scale = amax_to_scale(amax, spec.dtype, round_to_power_of_2=spec.round_scales_to_power_of_2)
    elif axis is not None:
        raise ValueError(f"{spec.site}: a given scale is tensorwise; axiswise casts compute their own")

    scale_local = local_part(scale)  # [] or the local shard's [..., 1, ...]
    data = saturated_cast(  # a delayed scale may not follow t: [Note: non-finite values]
        local_part(t), scale_local, spec.dtype,
        keep_non_finite=spec.scaling_type is ScalingType.DELAYED,
    )
    if store:  # bytes that serve two gemms: [Note: a cast that waits for its amax]
        data = in_memory(data)
    out = like(t, Float8Tensor(data, scale_local, t.dtype, mm_config=spec.mm_config,
                               block=_block(spec, t.dim())))
    return _observed(spec, t, out)


def _observed(spec: CastSpec, t: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    if cast_observers:
        for observer in cast_observers:
            observer(spec.site, t, out)
    return out


def _cast_blocks(t: torch.Tensor, spec: CastSpec, scale, amax, store: bool,
                 positions: Optional[torch.Tensor] = None,
                 shards: Optional[tuple] = None) -> torch.Tensor:
    """A blockwise cast ([Note: block scales] in f8dist/config/cells.py): each block scaled by its own
    amax, so no collective; a DTensor casts its local shard, whose blocks must be whole ([Note:
    shards on block boundaries] in f8dist/core/placement.py)."""
    if scale is not None or (amax is not None and spec.dtype != E2M1):
        raise ValueError(f"{spec.site}: a blockwise cast computes its own scales, give none "
                         "(NVFP4 takes its tensor's amax)")
    block = spec.block_shape(t.dim())
    if is_dtensor(t):
        mesh = t.device_mesh
        split = blocks_split_by_shards(t.shape, block, mesh.shape, t.placements)
        if split:
            raise NotImplementedError(
                f"{spec.site}: a block-scaled cast of a DTensor needs shards on block boundaries, "
                f"got {split}; change the number of ranks or the tensor's size, or keep this "
                "layer in high precision (module_filter_fn; enable_fsdp_float8_all_gather=False "
                "for an FSDP2 weight)"
            )
    if spec.dtype == E2M1:  # two levels: [Note: NVFP4] in f8dist/config/cells.py
        dtype = t.dtype
        if spec.random_hadamard:  # [Note: random Hadamard transform] in f8dist/core/scaling.py
            if amax is not None:
                raise ValueError(f"{spec.site}: random_hadamard=True casts the transformed "
                                 "tensor, whose amax it computes; give it no amax")
            signs = hadamard_signs(stochastic_rounding.signs_key())  # [16], every rank's
            t = like(t, random_hadamard(local_part(t), signs))  # observers see it transformed
        t = in_memory(t)  # read twice: [Note: a cast that waits for its amax]
        if amax is None:
            amax = local_part(logical_amax(t))
            if shards is not None:  # [] float32, the logical tensor's
                amax = reduce_over_shards(amax, *shards, "max")
        uniform = None
        if spec.stochastic_rounding:  # one device's draws: [Note: the stochastic rounding key]
            if positions is None:
                positions = global_positions(t)  # [local shape]
            key = _draw_key(local_part(t), str(spec.site))  # int64 []
            uniform = counter_uniform(positions, key)  # [local shape]
        data, scale, tensor_scale = nvfp4_cast(  # the tensor scale from the logical amax
            local_part(t), _block(spec, t.dim()), amax, uniform)
        out = like(t, Float8Tensor(data, scale, dtype, mm_config=spec.mm_config,
                                   block=_block(spec, t.dim()), tensor_scale=tensor_scale))
        return _observed(spec, t, out)
    local = in_memory(local_part(t))  # read twice: [Note: a cast that waits for its amax]
    data, scale = block_cast(  # [R, C] float8, [ceil(R / rows), ceil(C / cols)] float32
        local, block, spec.dtype, scale_dtype=spec.scale_dtype, rounding=spec.scale_rounding,
        round_to_power_of_2=spec.round_scales_to_power_of_2,
    )
    if store:
        data = in_memory(data)
    scale = stored_scale(scale, spec.scale_dtype)  # e8m0: 1 byte per block, exact
    out = like(t, Float8Tensor(data, scale, t.dtype, mm_config=spec.mm_config,
                               block=_block(spec, t.dim())))
    return _observed(spec, t, out)


def cast_with_companion(t: torch.Tensor, spec: CastSpec, other: Optional[CastSpec],
                        scale: Optional[torch.Tensor] = None, keep: bool = False) -> torch.Tensor:
    """``t`` cast as ``spec``, carrying its cast as ``other`` (the operand's other gemm) when
    ``other`` is given ([Note: two casts of one tensor] in f8dist/core/tensor.py): both from ``t``'s
    high-precision values, so each gemm reads one device's bytes however the pair then moves.
    ``keep``: the second cast stays on this rank as a :class:`~f8dist.core.tensor.KeptShard` of the
    DTensor ``t``, gathered in backward (:class:`SharedGather`)."""
    out = cast_to_float8(t, spec, scale)
    if other is None:
        return out
    companion = local_part(cast_to_float8(t, other))
    if keep:
        companion = KeptShard(companion, SharedGather(layout(t)))
    return like(out, local_part(out).with_companion(companion))


def companion_for(t: torch.Tensor, spec: CastSpec) -> Optional[torch.Tensor]:
    """The companion cast ``t`` carries for ``spec`` ([Note: two casts of one tensor]), laid out
    like ``t``; None when it carries none that fits."""
    companion = getattr(local_part(t), "_companion", None)
    if not isinstance(companion, Float8Tensor) or not _fits(companion, spec):
        return None
    return like(t, companion)


def kept_shard_for(t: torch.Tensor, spec: CastSpec) -> Optional[KeptShard]:
    """The companion cast for ``spec`` that ``t`` left on this rank (a :class:`KeptShard`,
    ``sp_grad_weight="backward_gather"``); None when it carries none that fits."""
    kept = getattr(local_part(t), "_companion", None)
    if not isinstance(kept, KeptShard) or not _fits(kept.local, spec):
        return None
    return kept


class SharedGather:
    """The backward all-gather of a :class:`~f8dist.core.tensor.KeptShard` (``sp_grad_weight=
    "backward_gather"``, [Note: the grad_weight operand of a gathered tensor] in
    f8dist/config/cells.py), run once for all the linears that read the shard (wq, wk and wv of one
    shared input): each reader's forward counts itself in (:meth:`add_reader`), the first
    backward gathers, the last one lets the gathered tensor go."""

    __slots__ = ("layout", "readers", "whole")

    def __init__(self, layout: tuple):
        self.layout, self.readers, self.whole = layout, 0, None  # layout: placement.layout's

    def add_reader(self) -> None:
        self.readers += 1

    def __call__(self, local: torch.Tensor, shape: tuple, layout_as: Optional[tuple]) -> torch.Tensor:
        """The whole tensor of the shard ``local`` (this rank's, as kept for backward), gathered
        in float8 with its block scales and reshaped to ``shape`` ([B, S, K] token blocks to the
        [B * S, K] view's: [Note: token blocks of N-D activations] in f8dist/config/specs.py), as this
        rank's part of a DTensor of ``layout_as`` (or None: the local tensor)."""
        from torch.distributed.tensor import Replicate

        if self.whole is None:
            mesh = self.layout[0]
            shard = with_layout(self.layout, local)
            self.whole = shard.redistribute(mesh, [Replicate()] * mesh.ndim).to_local()  # [B, S, K]
        whole = self.whole
        self.readers -= 1
        if self.readers <= 0:  # the last reader: nothing keeps it any longer
            self.whole = None
        return with_layout(layout_as, whole.reshape(shape))  # [M, K]


class ToFloat8(torch.autograd.Function):
    """Differentiable cast: forward casts to float8, backward passes the gradient through in high
    precision (the cast is an identity up to rounding). Used where a float8 tensor must cross a
    module boundary, e.g. a sequence-parallel input cast before its all-gather. ``other``: a
    second cast to carry along (:func:`cast_with_companion`).

    Example::

        >>> x = torch.randn(32, 16, requires_grad=True)
        >>> ToFloat8.apply(x, CastSpec(), None).to_local()  # doctest: +SKIP
    """

    @staticmethod
    def forward(ctx, hp: torch.Tensor, spec: CastSpec, scale: Optional[torch.Tensor],
                other: Optional[CastSpec] = None, keep: bool = False):
        return cast_with_companion(hp, spec, other, scale, keep)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None, None, None
