"""Collectives across tensor-parallel ranks; with one rank they are the identity."""

from __future__ import annotations

import torch
import torch.distributed as dist

from minisgl.distributed.info import get_tp_info


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    if get_tp_info().size == 1:
        return x
    dist.all_reduce(x)
    return x


def all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate each rank's shard along `dim` (the vocabulary, for the LM head)."""
    size = get_tp_info().size
    if size == 1:
        return x
    x = x.contiguous()
    dim = dim % x.dim()
    # one collective into one buffer [size, *x.shape], then one copy that puts each rank's shard in place
    out = torch.empty((size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    dist.all_gather_into_tensor(out, x)
    shape = list(x.shape)
    shape[dim] *= size
    return out.view(size, *x.shape).movedim(0, dim).reshape(shape)
