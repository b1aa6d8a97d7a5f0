"""FSDP2 gradient reduce-scatter with float8 on the wire, reduced in float32.

[Note: float8 reduce-scatter]
:class:`Float8ReduceScatter` replaces FSDP2's gradient reduce-scatter: every rank casts each
destination chunk to float8 in blocks, packed into ``uint8`` rows ([Note: payload layout]; gloo
and NCCL carry no float8), one ``all_to_all_single`` sends them, and each owner dequantizes, puts
its own chunk back in full precision, sums in float32 and applies FSDP2's reduce op's factor.
Not a reduce-scatter, which adds in the wire's dtype at every hop: each contribution is rounded
once, so the error does not grow with the number of ranks. The default (e4m3, 256) comes from
``scripts/bench_reduce_scatter.py`` (docs/performance.md). Under HSDP the same comm also reduces
over dp_replicate in float8 ([Note: float8 HSDP]).

Example::

    >>> fully_shard(block); fully_shard(model)                       # doctest: +SKIP
    >>> enable_float8_reduce_scatter(model)                          # doctest: +SKIP
    >>> model(x).sum().backward()      # one all_to_all of uint8 per FSDP module   # doctest: +SKIP
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from f8dist.core import agreement
from f8dist.config import E4M3, E5M2
from f8dist.core.scaling import amax_to_scale, dequantize, saturated_cast, tensor_amax

__all__ = [
    "Float8ReduceScatterConfig",
    "Float8ReduceScatter",
    "enable_float8_reduce_scatter",
    "quantize_chunks",
    "dequantize_and_sum",
    "dequantize_rows",
    "payload_numel",
]

_SCALE_BYTES = 4  # a float32 scale per block


@dataclass(frozen=True, kw_only=True)
class Float8ReduceScatterConfig:
    """How gradient chunks are cast for the wire ([Note: float8 reduce-scatter]).

    * ``float8_dtype``: ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``;
    * ``block_size``: elements per float32 scale, within one destination chunk; ``None``: one
      scale for the whole chunk.
    """

    float8_dtype: torch.dtype = E4M3
    block_size: Optional[int] = 256

    def __post_init__(self):
        if self.float8_dtype not in (E4M3, E5M2):
            raise ValueError(
                f"Float8ReduceScatterConfig.float8_dtype must be torch.float8_e4m3fn or "
                f"torch.float8_e5m2, got {self.float8_dtype}"
            )
        if self.block_size is not None and (
            not isinstance(self.block_size, int) or isinstance(self.block_size, bool)
            or self.block_size < 1
        ):
            raise ValueError(
                f"Float8ReduceScatterConfig.block_size must be a positive int (elements per "
                f"scale) or None (one scale per destination chunk), got {self.block_size!r}"
            )

    def blocks(self, n: int) -> tuple:
        """(number of blocks, block length) of a chunk of ``n`` elements."""
        block = self.block_size if self.block_size is not None else max(n, 1)
        return -(-n // block), block


# -- the chunk math (pure: no process group) ----------------------------------------------------

# [Note: payload layout]
# A chunk of n elements travels as one uint8 row: [ n float8 bytes | n_blocks float32 scales ].
# A partial last block is zero-padded for its amax and cast; only its real bytes are sent.


def payload_numel(n: int, config: Float8ReduceScatterConfig) -> int:
    """Bytes of the ``uint8`` row one destination chunk of ``n`` elements travels as."""
    n_blocks, _ = config.blocks(n)
    return n + _SCALE_BYTES * n_blocks


def quantize_chunks(chunks: torch.Tensor, config: Float8ReduceScatterConfig) -> torch.Tensor:
    """Cast each row of ``chunks`` ([W, n], any float dtype) to float8 in blocks and pack it
    ([Note: payload layout]); returns ``uint8`` of shape [W, payload_numel(n)]."""
    w, n = chunks.shape
    n_blocks, block = config.blocks(n)
    padded = F.pad(chunks, (0, n_blocks * block - n)).view(w, n_blocks, block)  # [W, nb, B]
    scale = amax_to_scale(tensor_amax(padded, dim=-1), config.float8_dtype)  # [W, nb, 1]
    data = saturated_cast(padded, scale, config.float8_dtype)  # [W, nb, B]
    data = data.view(w, n_blocks * block)[:, :n].view(torch.uint8)  # [W, n]
    scale_bytes = scale.view(w, n_blocks).view(torch.uint8)  # [W, 4 * nb]
    return torch.cat([data, scale_bytes], dim=1)  # [W, n + 4 * nb]


def dequantize_rows(payload: torch.Tensor, n: int, config: Float8ReduceScatterConfig) -> torch.Tensor:
    """The chunks packed in ``payload`` ([W, payload_numel(n)] ``uint8``, [Note: payload layout])
    in float32: [W, n]."""
    w = payload.shape[0]
    n_blocks, block = config.blocks(n)
    data = F.pad(payload[:, :n], (0, n_blocks * block - n))  # [W, nb * B] uint8
    data = data.view(config.float8_dtype).view(w, n_blocks, block)  # [W, nb, B]
    scale = payload[:, n:].contiguous().view(torch.float32).view(w, n_blocks, 1)  # [W, nb, 1]
    values = dequantize(data, scale, torch.float32)  # [W, nb, B]
    return values.view(w, n_blocks * block)[:, :n]  # [W, n]


def dequantize_and_sum(
    payload: torch.Tensor, own: torch.Tensor, rank: int, config: Float8ReduceScatterConfig
) -> torch.Tensor:
    """The float32 sum of the chunks in ``payload`` ([W, payload_numel(n)] ``uint8``, row ``r``
    from rank ``r``), with row ``rank`` replaced by ``own`` ([n], this rank's chunk in full
    precision); returns [n] float32."""
    if own.numel() == 0:
        return own.to(torch.float32)
    values = dequantize_rows(payload, own.numel(), config)  # [W, n]
    values[rank] = own  # this rank's chunk never crossed the wire
    return values.sum(dim=0)  # [n]


# -- the FSDP2 comm -----------------------------------------------------------------------------


class Float8ReduceScatter:
    """FSDP2's reduce-scatter comm (``allocate`` and ``__call__``) that sends float8
    ([Note: float8 reduce-scatter]); see :func:`enable_float8_reduce_scatter`.
    """

    def __init__(self, config: Float8ReduceScatterConfig):
        self.config = config

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device):
        return torch.empty(*size, dtype=dtype, device=device)

    @torch.no_grad()
    def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False):
        if async_op:
            raise NotImplementedError(
                "Float8ReduceScatter runs synchronously (it dequantizes and sums after the "
                "all-to-all); FSDP2 calls it with async_op=False"
            )
        factor = _sum_factor(op, group.size())
        world, rank = group.size(), dist.get_rank(group)
        n = output_tensor.numel()
        chunks = input_tensor.view(world, n)  # [W, n]: row d is what rank d keeps
        payload = quantize_chunks(chunks, self.config)  # [W, m] uint8
        received = torch.empty_like(payload)  # [W, m]: row r came from rank r
        dist.all_to_all_single(received, payload, group=group)
        total = dequantize_and_sum(received, chunks[rank], rank, self.config)  # [n] fp32
        total, factor = self._reduce_replicas(total, factor)
        if factor is not None:
            total.mul_(factor)
        output_tensor.copy_(total)
        return None

    def _reduce_replicas(self, total: torch.Tensor, factor: Optional[float]) -> tuple:
        """(sum over replicas, factor): none to sum here, outside HSDP."""
        return total, factor


# [Note: float8 HSDP]
# FSDP2's HSDP reduce-scatters gradients over dp_shard, then all-reduces each shard over
# dp_replicate with a plain ``dist.all_reduce`` that no comm replaces. So
# enable_float8_reduce_scatter moves that reduction into the comm: the module's param group gets
# a shard-only mesh info (FSDP2 then runs no all-reduce; an all-reduce hook still sees the reduced
# gradient, as under native HSDP), and after the float8 all-to-all and float32 sum over dp_shard
# the comm casts that sum with the same cast (quantize_chunks, one row), all-gathers the rows over
# dp_replicate and adds them dequantized in replica order. Every replica adds the same values in
# the same order (its own row dequantized too, unlike the shard sum), so replicas hold identical
# bits. Each gradient is rounded twice: its chunk, then the shard's sum. FSDP2 now derives its
# reduce op from dp_shard alone; where it would have averaged over replicas too (no
# set_gradient_divide_factor) the comm divides by their number. set_requires_all_reduce(False)
# is refused (its shards would accumulate unreduced over replicas); set_requires_gradient_sync
# (False) micro-steps reduce nothing, and the synced step reduces their sum over both axes.


class _HSDPFloat8ReduceScatter(Float8ReduceScatter):
    """:class:`Float8ReduceScatter` of one HSDP param group, reducing over dp_replicate too
    ([Note: float8 HSDP])."""

    def __init__(self, config: Float8ReduceScatterConfig, param_group, replicate: dist.ProcessGroup):
        super().__init__(config)
        self.param_group = param_group
        self.replicate = replicate

    def _reduce_replicas(self, total: torch.Tensor, factor: Optional[float]) -> tuple:
        if not self.param_group.all_reduce_grads:
            raise NotImplementedError(
                "enable_float8_reduce_scatter under HSDP reduces over dp_replicate in every "
                "reduce-scatter, so set_requires_all_reduce(False) (all_reduce_grads=False: "
                "accumulate without the replicas' all-reduce) cannot hold: keep "
                "set_requires_all_reduce(True), or leave the float8 reduce-scatter off"
            )
        replicas = self.replicate.size()
        if self.param_group.gradient_divide_factor is None:  # FSDP2 would average replicas too
            factor = (1.0 if factor is None else factor) / replicas
        if total.numel() == 0:
            return total, factor
        row = quantize_chunks(total.view(1, -1), self.config)  # [1, m] uint8
        rows = row.new_empty(replicas, row.shape[1])  # [R, m]: row r from replica r
        dist.all_gather_single(rows, row, group=self.replicate)
        return dequantize_rows(rows, total.numel(), self.config).sum(dim=0), factor  # [n]


def _sum_factor(op, world: int) -> Optional[float]:
    """What multiplies the sum under FSDP2's reduce op: ``None`` for SUM, ``1 / world`` for AVG,
    ``f`` for PREMUL_SUM(f)."""
    RedOpType = dist.ReduceOp.RedOpType
    kind = op if isinstance(op, RedOpType) else op.op  # a bare RedOpType, or a ReduceOp
    if kind == RedOpType.SUM:
        return None
    if kind == RedOpType.AVG:
        return 1.0 / world
    if kind == RedOpType.PREMUL_SUM:
        if not hasattr(op, "factor"):  # torch < 2.13 keeps it in C++
            raise NotImplementedError(
                "Float8ReduceScatter cannot read the factor of FSDP2's PREMUL_SUM on torch "
                f"{torch.__version__} (torch >= 2.13 exposes it): drop set_gradient_divide_factor "
                "(FSDP2 then averages) or upgrade torch"
            )
        factor = op.factor
        return float(factor) if isinstance(factor, torch.Tensor) else factor
    raise NotImplementedError(
        f"Float8ReduceScatter reduces with SUM, AVG or PREMUL_SUM (what FSDP2 uses for "
        f"gradients), got {op}"
    )


def enable_float8_reduce_scatter(
    model: nn.Module, *, config: Optional[Float8ReduceScatterConfig] = None
) -> int:
    """Make every FSDP2 module in ``model`` (after ``fully_shard``) reduce its gradients with
    float8 on the wire ([Note: float8 reduce-scatter]); returns how many modules it set. Every
    rank must call it with the same config (checked).

    Example::

        >>> for block in model.layers: fully_shard(block)              # doctest: +SKIP
        >>> fully_shard(model)                                         # doctest: +SKIP
        >>> enable_float8_reduce_scatter(model)                        # doctest: +SKIP
        4
        >>> enable_float8_reduce_scatter(model, config=Float8ReduceScatterConfig(
        ...     float8_dtype=torch.float8_e5m2, block_size=None))      # doctest: +SKIP
    """
    from torch.distributed.fsdp import FSDPModule

    config = Float8ReduceScatterConfig() if config is None else config
    if not isinstance(config, Float8ReduceScatterConfig):
        raise TypeError(f"config must be a Float8ReduceScatterConfig, got {type(config).__name__}")
    if not hasattr(FSDPModule, "set_custom_reduce_scatter"):
        raise RuntimeError(
            f"enable_float8_reduce_scatter needs FSDPModule.set_custom_reduce_scatter, which this "
            f"torch ({torch.__version__}) does not have; upgrade torch (2.13 has it) or leave the "
            "gradient reduce-scatter in high precision"
        )
    modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not modules:
        raise ValueError(
            "enable_float8_reduce_scatter: no FSDP2 module in the model; call it after "
            "fully_shard(...)"
        )
    sizes = {_shard_size(m) for m in modules} - {None}
    if sizes == {1}:  # FSDP2 skips the reduce-scatter of a one-rank shard group
        raise ValueError(
            "enable_float8_reduce_scatter: every FSDP2 module shards its parameters over one "
            "rank, where FSDP2 runs no reduce-scatter (no gradient crosses the wire), so a float8 "
            "one would never run; leave it off with one data-parallel rank (train.py: drop "
            "--float8-reduce-scatter)")
    if dist.is_initialized() and dist.get_world_size() > 1:  # [Note: ranks that disagree]
        agreement.agree(
            {("float8_reduce_scatter", "float8_dtype"): str(config.float8_dtype),
             ("float8_reduce_scatter", "block_size"): str(config.block_size)},
            dist.group.WORLD, what="ranks disagree on enable_float8_reduce_scatter's config",
            fix="Pass the same Float8ReduceScatterConfig on every rank.",
        )
    comm = Float8ReduceScatter(config)
    for module in modules:
        try:
            module.set_custom_reduce_scatter(_hsdp_comm(module, config) or comm)
        except ValueError as e:  # e.g. several param groups (per-parameter meshes)
            raise ValueError(
                f"enable_float8_reduce_scatter: FSDP2 refused a custom reduce-scatter on "
                f"{type(module).__name__}: {e}"
            ) from e
    return len(modules)


def _shard_size(module) -> Optional[int]:
    """How many ranks the FSDP2 ``module`` shards its parameters over; None without parameters."""
    group = module._get_fsdp_state()._fsdp_param_group
    return None if group is None else group.mesh_info.shard_mesh_size


def _hsdp_comm(module, config: Float8ReduceScatterConfig) -> Optional[_HSDPFloat8ReduceScatter]:
    """The comm of an HSDP ``module``, whose param group then runs no all-reduce ([Note: float8
    HSDP]); None for a module that is not HSDP or shards over one rank (FSDP2 runs no
    reduce-scatter there, so it keeps its own all-reduce)."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, HSDPMeshInfo

    state = module._get_fsdp_state()
    group = state._fsdp_param_group
    if group is None or len(state._fsdp_param_groups) > 1:  # FSDP2 refuses several groups' comm
        return None
    comm = group._reduce_scatter_comm
    if isinstance(comm, _HSDPFloat8ReduceScatter):  # enabled before: the mesh info is swapped
        return _HSDPFloat8ReduceScatter(config, group, comm.replicate)
    info = group.mesh_info
    if not isinstance(info, HSDPMeshInfo) or info.shard_mesh_size == 1:
        return None
    shard_only = FSDPMeshInfo(mesh=info.mesh, shard_mesh_dim=info.shard_mesh_dim,
                              dp_mesh_dims=info.dp_mesh_dims, spmd_mesh=info.spmd_mesh)
    shard_only.reduce_scatter_process_group = info.reduce_scatter_process_group
    if group.post_forward_mesh_info is info:  # reshard_after_forward=True: the same mesh
        group.post_forward_mesh_info = shard_only
    group.mesh_info = shard_only
    return _HSDPFloat8ReduceScatter(config, group, info.replicate_process_group)
