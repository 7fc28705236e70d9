"""compile_train_step with tensor (and sequence) parallel parameters: torch.distributed DTensors, desugared.

A model parallelised with ``parallelize_module`` (ColwiseParallel, RowwiseParallel, SequenceParallel, ...) holds
DTensor parameters, and torch.optim keeps DTensor states for them. make_fx cannot take a DTensor as a graph input (it
traced the DTensor's local tensor as a constant), so the step's graph takes each DTensor's LOCAL tensor as its input
and, inside the traced step, wraps it again as a DTensor with the real one's spec (mesh, placements, global shape).
The user's model then runs on DTensors as in eager and DTensor's dispatch traces local ops and functional
collectives (all-gather, reduce-scatter, all-reduce), which Inductor compiles as data parallel's.

Why the fused update is exact there: a sharded weight's gradient on each rank is the gradient of its own shard
(ColwiseParallel: dW_r = dY_r^T X, RowwiseParallel: dW_r = dY^T X_r; with sequence parallelism X is the all-gathered
input the forward saved), a complete local matrix product -- the pattern pass sees a plain mm whose result only the
rule consumes and fuses it as for a single device, on the local shard. Where autograd leaves a gradient in another
placement than its parameter's (a replicated norm weight under sequence parallelism gets a Partial gradient), the
traced step redistributes it to the parameter's placement first, as eager DTensor arithmetic in torch.optim would, so
the rule always reads the complete gradient of the local elements. The rule itself is element-wise on the local
shard, exactly what torch.optim's foreach ops do on a DTensor.
"""
from __future__ import annotations

import torch

from . import _compat

__all__ = ["specs_of", "to_local", "local", "wrap", "wrap_all", "rule_inputs", "round_salt", "shard_inputs",
           "q8_global", "SHARD_SALT", "unsupported"]

# stochastic rounding: a shard's salt is its parameter's salt (the index in the step) + SHARD_SALT x its shard index
SHARD_SALT = 1 << 20


def specs_of(tensors) -> tuple | None:
    """Per tensor its DTensor spec (None for a plain tensor), or None when none is a DTensor: the common case costs
    one isinstance check per tensor."""
    specs = tuple(_compat.dtensor_spec(t) if _compat.is_dtensor(t) else None for t in tensors)
    return specs if any(s is not None for s in specs) else None


def to_local(tensors, specs) -> list:
    """The compiled step's inputs: each DTensor's local tensor (the same storage, no copy)."""
    with torch.no_grad():      # to_local() with grad enabled makes a differentiable view per call
        return [t.to_local() if s is not None else t for t, s in zip(tensors, specs)]


def local(t):
    """A DTensor's local tensor (the same storage: an in-place update of it updates the DTensor), else ``t``."""
    if _compat.is_dtensor(t):
        with torch.no_grad():
            return t.to_local()
    return t


def wrap(local, spec):
    """A DTensor on ``local`` (the traced input itself, not a view: the fused update's weight must be the graph's
    input) with the real tensor's spec."""
    return local if spec is None else _compat.dtensor_from_local(local, spec)


def wrap_all(tensors, specs) -> list:
    return list(tensors) if specs is None else [wrap(t, s) for t, s in zip(tensors, specs)]


def rule_inputs(param, grad):
    """(local parameter, local gradient) of a DTensor parameter for the traced optimizer rule; the gradient in the
    parameter's placements first (a Partial one is reduced here, traced)."""
    if grad.placements != param.placements or grad.device_mesh != param.device_mesh:
        grad = grad.redistribute(param.device_mesh, param.placements)
    return local(param), local(grad)


def round_salt(param, salt: int) -> int:
    """The stochastic-rounding salt of this rank's shard of a DTensor parameter. The spec's bits are a function of
    (key, salt, LOCAL element index): with the parameter's salt alone every shard of a weight would round with the
    same bits. So the salt also counts the shard -- ``salt + SHARD_SALT * shard index``, the index of this rank's
    coordinates over the mesh dimensions the parameter is sharded on -- and ranks holding the same shard (replicated
    dimensions, a replicated parameter) keep one salt: their copies stay bitwise equal."""
    mesh, index = param.device_mesh, 0
    coord = mesh.get_coordinate()
    for d, placement in enumerate(param.placements):
        if placement.is_shard():
            index = index * mesh.size(d) + coord[d]
    return salt + SHARD_SALT * index


def shard_inputs(param, salt: int):
    """(parameter, gradient, rounding salt) that an update of ``param`` runs on: a DTensor's local shard, its local
    gradient in the parameter's placements (``rule_inputs``) and the shard's salt (``round_salt``); a plain tensor's
    own. The traced updates (fp32 and 8-bit) and the eager 8-bit optimizer's step."""
    if not _compat.is_dtensor(param):
        return param, param.grad, salt
    return (*rule_inputs(param, param.grad), round_salt(param, salt))


def _chunk_sizes(n: int, parts: int) -> list[int]:
    # torch.chunk's sizes (a Shard placement's local sizes): ceil(n / parts) each while elements last
    c = -(-n // parts)
    return [max(0, min(c, n - i * c)) for i in range(parts)]


def q8_global(codes, scales, param, block: int):
    """DTensors over this rank's 8-bit ``codes`` [rows, k] and ``scales`` [rows, ceil(k / block)] of its shard of the
    DTensor ``param`` (optim/optimizer8bit.py keeps them as plain local tensors): what its state dict holds, so that
    torch.distributed.checkpoint saves every rank's shard under one name (plain tensors of the same name are taken
    for replicas: DCP kept one rank's codes for all). The codes are laid out as the parameter (its 2-D rows view: a
    1-D parameter is one row); the scales' global row length is the sum of the shards' block counts, since blocks lie
    within each shard's local rows. Raises ValueError for layouts this cannot describe (a parameter of more than two
    dimensions sharded past its first, its columns sharded over two mesh dimensions)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    mesh, nd = param.device_mesh, param.dim()
    rows = param.shape[0] if nd >= 2 else 1
    k = param.numel() // max(rows, 1)
    placements, col_dims = [], []
    for d, pl in enumerate(param.placements):
        if pl.is_replicate():
            placements.append(Replicate())
            continue
        dim = pl.dim % nd if pl.is_shard() else None
        if dim == 0 and nd >= 2:
            placements.append(Shard(0))
        elif (dim == 0 and nd == 1) or (dim == 1 and nd == 2):
            placements.append(Shard(1))
            col_dims.append(d)
        else:
            raise ValueError(f"forge: 8-bit states of a {nd}-D parameter placed {list(param.placements)} have no "
                             "DTensor layout (rows sharded on dimension 0, or columns of a 2-D / 1-D parameter)")
    if len(col_dims) > 1:
        raise ValueError(f"forge: 8-bit states of a parameter whose columns are sharded over {len(col_dims)} mesh "
                         f"dimensions ({list(param.placements)}) have no DTensor layout (one at most)")
    if col_dims:
        sizes = _chunk_sizes(k, mesh.size(col_dims[0]))
        blocks = [-(-c // block) for c in sizes]
        nb = sum(blocks)
        # the scales' shards must be Shard(1)'s own chunks of that global length
        if _chunk_sizes(nb, len(blocks)) != blocks:
            raise ValueError(f"forge: 8-bit scales of a parameter with {k} columns over {len(sizes)} shards do not "
                             "split as a DTensor's chunks")
    else:
        nb = -(-k // block)
    return (DTensor.from_local(codes, mesh, placements, run_check=False, shape=(rows, k), stride=(k, 1)),
            DTensor.from_local(scales, mesh, placements, run_check=False, shape=(rows, nb), stride=(nb, 1)))


def unsupported(ddps, cast_weights: bool) -> str | None:
    """Why a step with DTensor inputs cannot be compiled yet, or None."""
    if ddps:
        return "DistributedDataParallel over DTensor (tensor-parallel) parameters"
    if cast_weights:
        return "cast_weights_in_update=True with DTensor (tensor-parallel) parameters"
    return None
