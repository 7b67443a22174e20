"""Linear layers split across tensor-parallel ranks.

Column-parallel layers split the output features (each rank keeps its heads / its slice of the MLP),
row-parallel layers split the input features and all-reduce the partial sums.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minisgl.core import forwarding_prefill
from minisgl.distributed import all_reduce, get_tp_info
from minisgl.env import ENV
from minisgl.kernel import cpu as cpu_kernels
from minisgl.kernel import triton_everywhere
from minisgl.layers.quant import QuantizedWeight

_SKINNY_DTYPES = (torch.bfloat16, torch.float16)


def _skinny(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the split-K Triton GEMM takes x @ weight.T (the few-row products `gemm.serves` names)."""
    if not (x.is_cuda and x.dim() == 2 and weight.dtype in _SKINNY_DTYPES and ENV.SKINNY_GEMM.value):
        return False
    from minisgl.kernel import gemm

    return gemm.serves(x.shape[0], *weight.shape) and weight.stride(1) == 1 and x.dtype == weight.dtype


def _cuda_gemm(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None = None) -> bool:
    """Whether the CUDA GEMM takes x @ weight.T (+ residual) (Hopper, bf16, MINISGL_CUDA_GEMM_ROWS:
    `cuda.gemm.serves`)."""
    if not (x.is_cuda and ENV.CUDA_GEMM_ROWS.value):
        return False
    from minisgl.kernel.cuda import gemm as cuda_gemm

    return cuda_gemm.serves(x, weight, residual)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear; on the CPU, one or two rows against bf16 weights go to a C kernel (oneDNN is slow there),
    unless MINISGL_KERNELS=triton runs the CUDA path's code there; on CUDA, the products of few rows go to
    the CUDA GEMM where `cuda.gemm.serves` (MINISGL_CUDA_GEMM_ROWS), else to the split-K Triton GEMM where
    `gemm.serves` (`kernel/gemm.py`, MINISGL_SKINNY_GEMM)."""
    if _cuda_gemm(x, weight):
        from minisgl.kernel.cuda import gemm as cuda_gemm

        y = cuda_gemm.matmul(x, weight)
        return y + bias if bias is not None else y
    if _skinny(x, weight):
        from minisgl.kernel import gemm

        y = gemm.skinny_matmul(x, weight)
        return y + bias if bias is not None else y
    if (
        x.dim() == 2
        and x.shape[0] <= cpu_kernels.LINEAR_MAX_ROWS
        and weight.dtype == torch.bfloat16
        and x.device.type == "cpu"
        and weight.shape[1] % 16 == 0
        and weight.is_contiguous()
        and not triton_everywhere()
    ):
        if torch.compiler.is_compiling():
            # a compiled step runs only where the kernels were built (engine/cpu_compile.py)
            y = torch.ops.minisgl.cpu_linear_bf16(x, weight)
            return y + bias if bias is not None else y
        lib = cpu_kernels.library()
        if lib is not None:
            y = cpu_kernels.linear_bf16(lib, x, weight)
            return y + bias if bias is not None else y
    return F.linear(x, weight, bias)


def linear_add(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """residual + x @ weight.T with the add in the matmul's epilogue (float32 sums, rounded once): cuBLAS's
    addmm, or the CUDA or split-K Triton GEMM where `linear` would take it. x and residual are [M, K] and [M, N].

    residual is consumed: the sum may be written over it. cuBLAS adds C in place only; torch's addmm into a
    fresh output first copies C there, a launch as long as the residual add it was meant to save."""
    if _cuda_gemm(x, weight, residual):
        from minisgl.kernel.cuda import gemm as cuda_gemm

        return cuda_gemm.matmul(x, weight, residual=residual)
    if _skinny(x, weight):
        from minisgl.kernel import gemm

        return gemm.skinny_matmul(x, weight, residual=residual.contiguous())
    if not residual.is_contiguous():
        return torch.addmm(residual, x, weight.t())
    return residual.addmm_(x, weight.t())


def onednn_packing_supported() -> bool:
    """Whether this torch and CPU can hold bf16 weights in oneDNN's blocked layout (`pack_onednn`)."""
    mkldnn = torch.ops.mkldnn
    return (
        torch.backends.mkldnn.is_available()
        and all(hasattr(mkldnn, op) for op in ("_reorder_linear_weight", "_linear_pointwise"))
        and hasattr(mkldnn, "_is_mkldnn_bf16_supported")
        and mkldnn._is_mkldnn_bf16_supported()
    )


def pack_onednn(weight: torch.Tensor) -> torch.Tensor:
    """A bf16 weight [N, K] in oneDNN's blocked layout (an opaque `torch._mkldnn` tensor).

    F.linear on a CPU hands oneDNN a plain weight, which it copies into this layout inside every call:
    at 64 rows that copy is a fifth of a step's matmul time on an AVX512-BF16 CPU without AMX (the
    default model's 30 layers and LM head: 112 -> 91 ms; docs/benchmarks.md, "Weights in oneDNN's
    layout"). The products are F.linear's to the bit: the same kernel, the same sums.
    """
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous())


def linear_onednn(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """x [M, K] bf16 @ packed.T, the weight from `pack_onednn`."""
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, None, "none", [], "")


class QuantizableLinear(nn.Module):
    """A layer whose weight [N, K] may also be held packed; `matmul` picks the copy that serves the batch.

    With `keep_float` the float weight stays beside the packed one and serves every prefill (and extend)
    step and the decode steps of more than `max_rows` rows; without, the float weight is dropped and
    every batch uses the packed one. A `batch_qweight` (W8A8, where it beats the float matmul on batches)
    takes the float weight's place for those steps.

    `pack_onednn_` adds the float weight in oneDNN's layout (CPU, bf16), which then serves every batch
    of more than `LINEAR_MAX_ROWS` rows; the plain copy is dropped where nothing else reads it.

    Why prefill never takes the packed copy, even for one row: a prompt's first new token must not
    depend on how much of the prompt was cached. A cold prompt is a many-row prefill (float weights);
    the same prompt found in the prefix cache is a one-row extend. The packed kernels round the
    activations to int8, which moves a near-tie: the default model's greedy answer to "What is the
    capital of France?" was "The capital of France is Paris." cold and "L'Étoile, ..." cached.
    """

    weight: torch.Tensor | None

    def __init__(self) -> None:
        super().__init__()
        self.qweight: QuantizedWeight | None = None
        self.batch_qweight: QuantizedWeight | None = None
        self.max_rows = 0
        # not a buffer: an opaque oneDNN tensor, made after loading and never saved
        self.packed: torch.Tensor | None = None

    def quantize_(
        self,
        qweight: QuantizedWeight,
        keep_float: bool,
        max_rows: int,
        batch_qweight: QuantizedWeight | None = None,
    ) -> None:
        self.qweight, self.max_rows, self.batch_qweight = qweight, max_rows, batch_qweight
        if not keep_float:
            self.weight = None

    def serves_batches_apart(self) -> bool:
        """Whether another copy than `qweight` (float, oneDNN-packed, or `batch_qweight`) serves prompts and
        the batches of more than `max_rows` rows."""
        return self.weight is not None or self.packed is not None or self.batch_qweight is not None

    def pack_onednn_(self, keep_plain: bool) -> None:
        """Keep the float weight in oneDNN's layout; `keep_plain` keeps the plain one for 1-2 rows too."""
        assert self.weight is not None
        self.packed = pack_onednn(self.weight)
        if not keep_plain:
            self.weight = None

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        # read once: every nn.Module attribute read of a parameter or submodule is a slow lookup
        qweight, weight, packed, batch_qweight = self.qweight, self.weight, self.packed, self.batch_qweight
        rows = x.numel() // x.shape[-1]
        if qweight is None or (
            (weight is not None or packed is not None or batch_qweight is not None)
            and (rows > self.max_rows or forwarding_prefill())
        ):
            if batch_qweight is not None:
                qweight = batch_qweight
            elif packed is not None and (weight is None or rows > cpu_kernels.LINEAR_MAX_ROWS):
                if x.dim() == 2:
                    return linear_onednn(x, packed)
                return linear_onednn(x.reshape(rows, x.shape[-1]), packed).reshape(*x.shape[:-1], -1)
            else:
                assert weight is not None
                return linear(x, weight)
        if x.dim() == 2:
            return qweight.matmul(x)
        shape = x.shape
        y = qweight.matmul(x.reshape(-1, shape[-1]))
        return y.reshape(*shape[:-1], qweight.out_features)


class LinearReplicated(QuantizableLinear):
    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.matmul(x)
        return y + self.bias if self.bias is not None else y


class LinearColParallelMerged(QuantizableLinear):
    """Several column-parallel projections in one matmul (q|k|v, gate|up); `out_sizes` are the full sizes.

    `slices` (start, size) says which rows of each full projection this rank keeps; by default the
    rank's equal share. K/V heads fewer than the ranks are replicated by passing overlapping slices.
    """

    def __init__(
        self,
        in_features: int,
        out_sizes: list[int],
        bias: bool = False,
        slices: list[tuple[int, int]] | None = None,
    ) -> None:
        super().__init__()
        info = get_tp_info()
        if slices is None:
            for size in out_sizes:
                if size % info.size:
                    raise ValueError(
                        f"output size {size} does not split over {info.size} tensor-parallel ranks"
                    )
            slices = [(info.rank * (s // info.size), s // info.size) for s in out_sizes]
        self.slices = slices
        self.local_sizes = [size for _, size in slices]
        total = sum(self.local_sizes)
        self.weight = nn.Parameter(torch.empty(total, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(total), requires_grad=False) if bias else None

    def shard_offset(self, shard: int) -> tuple[int, int]:
        start = sum(self.local_sizes[:shard])
        return start, self.local_sizes[shard]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.matmul(x)
        return y + self.bias if self.bias is not None else y


class LinearRowParallel(QuantizableLinear):
    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        tp = get_tp_info().size
        if in_features % tp:
            raise ValueError(f"input size {in_features} does not split over {tp} tensor-parallel ranks")
        self.weight = nn.Parameter(torch.empty(out_features, in_features // tp), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x @ W.T summed over the ranks; with `residual`, residual + that, the add in the matmul's epilogue
        on rank 0 only (the all-reduce adds the other ranks' parts to it)."""
        if residual is None or get_tp_info().rank != 0:
            y = self.matmul(x)
        elif self.qweight is None and self.packed is None and self.weight is not None and x.dim() == 2:
            y = linear_add(x, self.weight, residual)
        else:
            y = self.matmul(x) + residual
        y = all_reduce(y)
        return y + self.bias if self.bias is not None else y
