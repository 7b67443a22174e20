"""qlinear.c from Python: int4 and int8 weights times activations quantized to int8 in blocks of 32.

The packers put a weight in the kernel's layout (qlinear.c's header: int4 codes in chunks of four
blocks, two codes a byte); `quantize_q8_blocks` rounds the activations; `linear_q4_q8` and `linear_i8_q8`
multiply. The references (`*_reference`) compute the same sums with torch ops, for the tests.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from minisgl.kernel.cpu import FLOAT_KINDS

BLOCK = 32  # values a scale of the activations (and of an int4 weight) covers
PAIR = 2 * BLOCK  # K must be whole pairs of blocks


@dataclass
class Q4Pack:
    """An int4 weight in qlinear.c's layout: w[n, k] = code * d[n, k // 32] + off[n, k // 32]."""

    qs: torch.Tensor  # [N, K / 2] uint8, two codes a byte
    d: torch.Tensor  # [N, K / 32] float16
    off: torch.Tensor  # [N, K / 32] float16


def pack_q4(codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> Q4Pack:
    """codes: [N, K] in [0, 15]; scale, offset: [N, K // 32], rounded to float16 (a GGUF file's own
    type for them). Chunks of 128 values (64 at an odd end), byte t of a chunk of S values holding value
    t and value t + S/2 (qlinear.c's header)."""
    n, k = codes.shape
    if k % PAIR:
        raise ValueError(f"the int4 kernel needs K a multiple of {PAIR}; got {k}")
    c = codes.to(torch.uint8)
    parts = []
    for start in range(0, k, 128):
        half = min(128, k - start) // 2
        parts.append(c[:, start : start + half] | (c[:, start + half : start + 2 * half] << 4))
    return Q4Pack(
        torch.cat(parts, dim=1).contiguous(),
        scale.to(torch.float16).contiguous(),
        offset.to(torch.float16).contiguous(),
    )


def unpack_q4(w: Q4Pack) -> torch.Tensor:
    """The [N, K] codes of a packed weight (uint8), in K's order."""
    k = 2 * w.qs.shape[1]
    parts = []
    for start in range(0, k, 128):
        half = min(128, k - start) // 2
        chunk = w.qs[:, start // 2 : start // 2 + half]
        parts += [chunk & 15, chunk >> 4]
    return torch.cat(parts, dim=1)


@dataclass
class I8Pack:
    """An int8 weight in qlinear.c's layout: w[n, k] = (stored - 128) * scale[n]."""

    w: torch.Tensor  # [N, K] uint8
    scale: torch.Tensor  # [N] float32


def pack_i8(q: torch.Tensor, scale: torch.Tensor) -> I8Pack:
    """q: [N, K] int8 codes; scale: [N]."""
    if q.shape[1] % PAIR:
        raise ValueError(f"the int8 kernel needs K a multiple of {PAIR}; got {q.shape[1]}")
    return I8Pack((q.to(torch.int16) + 128).to(torch.uint8).contiguous(), scale.float().contiguous())


@dataclass
class Q8Blocks:
    """Activations [M, K] rounded to int8, one scale a block of 32 (quantize_q8_blocks' outputs)."""

    q: torch.Tensor  # [M, K] int8
    dx: torch.Tensor  # [M, K / 32] scales
    sx: torch.Tensor  # [M, K / 32] scale times the sum of the block's codes
    dxe: torch.Tensor  # [M, K / 64, 16] each pair's scales spread over the register's lanes


def quantize_q8_blocks(lib: ctypes.CDLL, x: torch.Tensor) -> Q8Blocks:
    """x: [M, K] float32 or bf16, K % 64 == 0: the rounding the matmuls below do first (for tests)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    m, k = x.shape
    q = torch.empty((m, k), dtype=torch.int8)
    dx = torch.empty((m, k // BLOCK), dtype=torch.float32)
    sx = torch.empty_like(dx)
    dxe = torch.empty((m, k // PAIR, 16), dtype=torch.float32)
    lib.quantize_q8_blocks(
        x.data_ptr(), FLOAT_KINDS[x.dtype], x.stride(0), q.data_ptr(), dx.data_ptr(), sx.data_ptr(),
        dxe.data_ptr(), m, k, torch.get_num_threads(),
    )  # fmt: skip
    return Q8Blocks(q, dx, sx, dxe)


def _matmul(entry: ctypes._CFuncPtr, x: torch.Tensor, n: int, weight: list[int]) -> torch.Tensor:
    """y [M, n] in x's dtype from `entry` (linear_q4 / linear_i8) with the weight's pointers `weight`."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    m, k = x.shape
    kind = FLOAT_KINDS[x.dtype]
    y = torch.empty((m, n), dtype=x.dtype)
    rc = entry(x.data_ptr(), kind, x.stride(0), m, k, *weight, n, y.data_ptr(), kind, torch.get_num_threads())
    if rc:
        raise RuntimeError(
            f"{entry.__name__}: " + ("out of memory" if rc == -2 else "a shape it does not take")
        )
    return y


def linear_q4(lib: ctypes.CDLL, x: torch.Tensor, w: Q4Pack) -> torch.Tensor:
    """x: [M, K] float32 or bf16 (rows may be strided) -> x @ w.T: [M, N] in x's dtype, with x rounded to
    int8 blocks of 32 first."""
    return _matmul(lib.linear_q4, x, w.qs.shape[0], [w.qs.data_ptr(), w.d.data_ptr(), w.off.data_ptr()])


def linear_i8(lib: ctypes.CDLL, x: torch.Tensor, w: I8Pack) -> torch.Tensor:
    """As linear_q4, for an int8 weight."""
    return _matmul(lib.linear_i8, x, w.w.shape[0], [w.w.data_ptr(), w.scale.data_ptr()])


def q8_blocks_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [M, K] -> (codes [M, K] in K's order, scales [M, K / 32]): the rounding the kernel does."""
    m, k = x.shape
    blocks = x.float().reshape(m, k // BLOCK, BLOCK)
    d = blocks.abs().amax(dim=-1) / 127.0
    codes = torch.where(d[..., None] > 0, torch.round(blocks / d[..., None].clamp(min=1e-30)), 0.0)
    return codes.reshape(m, k), d


def linear_q8_reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x rounded to Q8 blocks times the float weight w [N, K], in float64: what the kernels compute."""
    codes, d = q8_blocks_reference(x)
    xq = (codes.reshape(*d.shape, BLOCK) * d[..., None]).reshape(x.shape)
    return xq.double() @ w.double().t()
