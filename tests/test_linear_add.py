"""linear_add: residual + x @ W.T with the add in the GEMM, and no copy of the residual before it."""

from __future__ import annotations

import pytest
import torch

from minisgl.layers.linear import linear_add

CUDA = torch.cuda.is_available()


def _operands(rows: int, device: str, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=g).to(device=device, dtype=dtype)
    w = torch.randn(64, 96, generator=g).to(device=device, dtype=dtype)
    r = torch.randn(rows, 64, generator=g).to(device=device, dtype=dtype)
    return x, w, r


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if CUDA else []))
def test_the_sum_is_written_over_the_residual(device: str) -> None:
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    x, w, r = _operands(40, device, dtype)  # 40 rows: cuBLAS's path on CUDA, not the split-K GEMM's
    want = torch.addmm(r, x, w.t())
    got = linear_add(x, w, r)
    assert got.data_ptr() == r.data_ptr()
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_strided_residual_is_left_alone() -> None:
    x, w, r = _operands(8, "cpu", torch.float32)
    wide = torch.zeros(8, 128)
    wide[:, ::2] = r
    strided = wide[:, ::2]
    got = linear_add(x, w, strided)
    torch.testing.assert_close(got, torch.addmm(r, x, w.t()))
    assert torch.equal(strided, r)


@pytest.mark.skipif(not CUDA, reason="counts CUDA kernels")
def test_one_kernel_on_cuda() -> None:
    # torch's addmm into a fresh output copies the residual there first: a second kernel as long as the
    # residual add that the epilogue was meant to save
    x, w, r = _operands(64, "cuda", torch.bfloat16)
    linear_add(x, w, r.clone())  # cuBLAS's handle and workspace made outside the count
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        linear_add(x, w, r)
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert len(kernels) == 1, kernels
