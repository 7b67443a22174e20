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
    parts = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=dim)
