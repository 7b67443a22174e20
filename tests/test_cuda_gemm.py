"""gemm.cu's decode GEMM (minisgl/kernel/cuda/gemm.py): NVRTC compiles every configuration the rule picks for
Hopper without spills (any machine with libnvrtc), the rule's tiles fit the shapes it is given, and on a GPU the
kernel multiplies as a float32 product does, adds the residual in place, and gives the same bits every run.
"""

from __future__ import annotations

import pytest
import torch

from minisgl.kernel import cuda as cuda_kernels
from minisgl.kernel.cuda import gemm

CUDA = torch.cuda.is_available()
needs_gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")

# (N, K) of every projection of Qwen3-0.6B and Llama-3-8B: q|k|v, o, gate|up, down
SHAPES = [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072), (6144, 4096), (4096, 4096), (28672, 4096),
          (4096, 14336)]  # fmt: skip
ROWS = (1, 8, 16, 17, 32, 64, 100, 128, 192, 256)


def _nvrtc_here() -> bool:
    try:
        cuda_kernels.nvrtc()
        return True
    except cuda_kernels.CudaUnavailable:
        return False


@pytest.mark.parametrize("n,k", SHAPES)
def test_the_rule_picks_tiles_that_fit_and_fill_the_gpu(n: int, k: int) -> None:
    for m in ROWS:
        c = gemm.choose_config(m, n, k, sms=132)
        assert c.fits(n, k), (m, n, k, c)
        assert c.bm >= min(m, 128) and c.bm % 16 == 0
        programs = n // c.bn * -(-m // c.bm) * c.split
        # K is split only while the programs fall short of the SMs, and never below two stages' K a program
        assert c.split == 1 or programs // 2 < 132
        assert k // c.split >= 2 * gemm.BK


@pytest.mark.skipif(not _nvrtc_here(), reason="libnvrtc not found (nvidia-cuda-nvrtc)")
def test_every_configuration_the_rule_picks_compiles_for_hopper_without_spills() -> None:
    configs = tuple({gemm.choose_config(m, n, k, 132) for n, k in SHAPES for m in ROWS})
    _, log = cuda_kernels.compile_cubin(gemm.program(configs), "sm_90", ["--ptxas-options=-v"], "gemm.cu")
    got = {block.split("'")[0]: block for block in log.split("Compiling entry function '")[1:]}
    assert set(got) == {c.name for c in configs}
    for name, block in got.items():
        assert "0 bytes spill stores, 0 bytes spill loads" in block, (name, block)


CASES = [  # (rows, N, K, config): every tile height, each split, rows that are not a multiple of 16
    (1, 1024, 2048, gemm.config(64, 16, 8)),
    (5, 4096, 1024, gemm.config(128, 16, 2)),
    (17, 6144, 1024, gemm.config(128, 32, 1, 3)),
    (40, 1024, 3072, gemm.config(64, 48, 4)),
    (64, 4096, 1024, gemm.config(128, 64, 4)),
    (100, 1024, 2048, gemm.config(64, 128, 8)),
    (256, 6144, 1024, gemm.config(128, 128, 2)),
    (200, 1024, 3072, gemm.config(64, 64, 2, 3)),
]


@pytest.fixture(scope="module")
def kernel() -> gemm.CudaGemm:
    return gemm.CudaGemm(tuple({c for *_, c in CASES}))


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("m,n,k,cfg", CASES, ids=[c.name + f"_m{m}" for m, _, _, c in CASES])
@pytest.mark.parametrize("add", [False, True], ids=["plain", "residual"])
def test_the_kernel_multiplies_as_a_float32_product(
    kernel: gemm.CudaGemm, m: int, n: int, k: int, cfg: gemm.GemmConfig, add: bool
) -> None:
    torch.manual_seed(m + n + k)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5
    residual = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    ref = x.float() @ w.float().t() + (residual.float() if add else 0)
    blas = residual.clone().addmm_(x, w.t()) if add else x @ w.t()
    held = residual.clone()
    got = kernel(x, w, cfg, residual=held if add else None, out=held if add else None)
    err, blas_err = (got.float() - ref).abs().max().item(), (blas.float() - ref).abs().max().item()
    assert err <= 2 * blas_err + 1e-6, (err, blas_err)
    if add:
        assert got.data_ptr() == held.data_ptr()  # written over the residual
    again = kernel(x, w, cfg, residual=residual.clone() if add else None)
    assert torch.equal(again, got)  # the split's sums in rank order: the same bits every run
