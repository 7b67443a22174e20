"""Linear layers split across tensor-parallel ranks.

Column-parallel layers split the output features (each rank keeps its heads / its slice of the MLP),
row-parallel layers split the input features and all-reduce the partial sums.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minisgl.distributed import all_reduce, get_tp_info


class LinearReplicated(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class LinearColParallelMerged(nn.Module):
    """Several column-parallel projections in one matmul (q|k|v, gate|up); `out_sizes` are the full sizes."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool = False) -> None:
        super().__init__()
        tp = get_tp_info().size
        for size in out_sizes:
            if size % tp:
                raise ValueError(f"output size {size} does not split over {tp} tensor-parallel ranks")
        self.local_sizes = [s // tp for s in out_sizes]
        total = sum(self.local_sizes)
        self.weight = nn.Parameter(torch.empty(total, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(total), requires_grad=False) if bias else None

    def shard_offset(self, shard: int) -> tuple[int, int]:
        start = sum(self.local_sizes[:shard])
        return start, self.local_sizes[shard]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class LinearRowParallel(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        tp = get_tp_info().size
        if in_features % tp:
            raise ValueError(f"input size {in_features} does not split over {tp} tensor-parallel ranks")
        self.weight = nn.Parameter(torch.empty(out_features, in_features // tp), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        y = all_reduce(y)
        return y + self.bias if self.bias is not None else y
