"""Products of few rows (decode steps) by gemm.cu's kernel: y = x @ w.T (+ residual) on the tensor cores, K split
over a cluster of programs whose partial sums meet in distributed shared memory (Hopper and later).

`CudaGemm` compiles the configurations it is given; `choose_config` is the rule by shape and rows, measured
against cuBLAS (benchmark/offline/gemm_cuda.py, docs/benchmarks.md).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from minisgl.kernel.cuda import CudaModule, load_module, source
from minisgl.utils.misc import div_ceil

BK = 64  # K columns a pipeline stage (gemm.cu's GEMM_BK)
MAX_SPLIT = 8  # the largest portable cluster


@dataclass(frozen=True)
class GemmConfig:
    """A tile of `bn` weight rows by `bm` tokens, warps `wn` x `wm`, K in `split` ranges (one cluster), `stages`
    tiles of 64 K in flight."""

    bn: int
    bm: int
    wn: int
    wm: int
    split: int
    stages: int

    @property
    def name(self) -> str:
        return f"gemm_n{self.bn}_m{self.bm}_w{self.wn}x{self.wm}_s{self.split}_p{self.stages}"

    @property
    def threads(self) -> int:
        return self.wn * self.wm * 32

    @property
    def shared_bytes(self) -> int:
        """The pipeline's tiles, or the partial sums (a row of bn + 4 floats a token) if larger."""
        return max(self.stages * (self.bn + self.bm) * 128, self.bm * (self.bn + 4) * 4)

    def fits(self, n: int, k: int) -> bool:
        return n % self.bn == 0 and k % (self.split * BK) == 0


def warps(bn: int, bm: int) -> tuple[int, int]:
    """Warps along the weight rows and the tokens: 16 weight rows a warp up to 64 tokens, else 32 rows and half
    the tokens (each warp's accumulators at most 64 floats a thread)."""
    if bm <= 64 and bn // 16 <= 8:
        return bn // 16, 1
    return bn // 32, 2


def config(bn: int, bm: int, split: int, stages: int = 4) -> GemmConfig:
    return GemmConfig(bn, bm, *warps(bn, bm), split, stages)


def program(configs: tuple[GemmConfig, ...]) -> str:
    lines = [source("gemm.cu")]
    for c in sorted(set(configs), key=lambda c: c.name):
        lines.append(f"GEMM_KERNEL({c.name}, {c.bn}, {c.bm}, {c.wn}, {c.wm}, {c.split}, {c.stages})")
    return "\n".join(lines) + "\n"


def token_block(m: int) -> int:
    """Tokens a program: the rows padded to 16, at most 128 (larger batches take several row blocks)."""
    return min(128, max(16, div_ceil(m, 16) * 16 if m <= 64 else 128))


def choose_config(m: int, n: int, k: int, sms: int) -> GemmConfig:
    """The rule: 64 weight rows a program for outputs no wider than 2,048, else 128; K split (up to 8, keeping at
    least two stages' K a program) until the programs fill every SM once."""
    bm = token_block(m)
    bn = 64 if n <= 2048 else 128
    tiles = div_ceil(n, bn) * div_ceil(m, bm)
    split = 1
    while split < MAX_SPLIT and tiles * split < sms and k % (2 * split * 2 * BK) == 0:
        split *= 2
    return config(bn, bm, split)


def _aligned(t: torch.Tensor) -> bool:
    return t.dtype == torch.bfloat16 and t.stride(-1) == 1 and t.stride(0) % 8 == 0 and t.data_ptr() % 16 == 0


class CudaGemm:
    """gemm.cu's kernels for `configs`, compiled (or read from the cache) and loaded at construction, so that
    nothing is compiled while a CUDA graph is being captured."""

    def __init__(self, configs: tuple[GemmConfig, ...], device_index: int = 0) -> None:
        self.configs = configs
        self.module: CudaModule = load_module(program(configs), "gemm.cu", device_index)
        for c in configs:
            self.module.allow_shared(c.name, c.shared_bytes)

    @staticmethod
    def applies(x: torch.Tensor, w: torch.Tensor) -> bool:
        return x.dim() == 2 and w.dim() == 2 and _aligned(x) and _aligned(w) and x.shape[1] == w.shape[1]

    def __call__(
        self,
        x: torch.Tensor,
        w: torch.Tensor,
        cfg: GemmConfig,
        residual: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x [M, K], w [N, K] bf16 -> x @ w.T (+ residual) [M, N]; `out` may be `residual` (written in place)."""
        m, k = x.shape
        n = w.shape[0]
        if out is None:
            out = torch.empty((m, n), dtype=x.dtype, device=x.device)
        res = residual if residual is not None else out
        args = (
            x.data_ptr(), w.data_ptr(), out.data_ptr(), residual.data_ptr() if residual is not None else 0,
            ctypes.c_int32(m), ctypes.c_int32(k), ctypes.c_int64(x.stride(0)), ctypes.c_int64(w.stride(0)),
            ctypes.c_int64(out.stride(0)), ctypes.c_int64(res.stride(0)),
        )  # fmt: skip
        grid = (n // cfg.bn * cfg.split, div_ceil(m, cfg.bm), 1)
        stream = torch.cuda.current_stream(x.device).cuda_stream
        self.module.launch(cfg.name, grid, cfg.threads, args, stream, cfg.shared_bytes)
        return out
