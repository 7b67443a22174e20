"""Weights kept quantized on the CPU: int8 per output channel and int4 in groups of 32, with torch's kernels.

Int8Weight and Int4Weight run weight-only: the activations stay bf16 and the kernel widens the weights as
it reads them, so a decode step reads a half (int8) or a quarter (int4) of the bf16 bytes. W8A8Weight
quantizes the activations too (per row, at run time) and multiplies int8 by int8 with int32 sums
(`torch._int_mm`): on a CPU with integer dot products (VNNI) 1.1-1.4x faster than the bf16 matmul
from 8 rows on, at the cost of a second rounding (docs/benchmarks.md, "W8A8"). torch's CPU kernels
are fast only for bf16 activations (float32 ones are 5-30x slower, measured), so activations of any
other dtype are cast to bf16 around the call. Where a float copy of the weight is kept as well,
batches of more than `max_rows` rows use it: the bf16 matmul beats both kernels from about 8 rows.
"""

from __future__ import annotations

import torch
from torch import nn

from minisgl.kernel import cpu as cpu_kernels

INT4_GROUP = 32  # the block of GGUF's Q4_0 / Q4_1 and the sub-block of Q4_K


class QuantizedWeight(nn.Module):
    """A [N, K] weight in a packed format; `matmul(x)` is x @ w.T for x: [M, K]."""

    out_features: int
    in_features: int

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def dequantize(self) -> torch.Tensor:
        """The float32 weight the kernel multiplies by (what tests compare against)."""
        raise NotImplementedError


class Int8Weight(QuantizedWeight):
    """Symmetric int8 with one scale per output channel: w[n, k] = q[n, k] * scale[n]."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor) -> None:
        super().__init__()
        self.out_features, self.in_features = q.shape
        self.register_buffer("q", q.to(torch.int8).contiguous())
        self.register_buffer("scale", scale.to(torch.bfloat16).contiguous())

    @classmethod
    def from_float(cls, w: torch.Tensor) -> Int8Weight:
        w = w.float()
        # a scale rounded to bf16 first, so that the codes are computed against the scale the kernel uses
        scale = (w.abs().amax(dim=1) / 127).clamp(min=1e-12).to(torch.bfloat16).float()
        q = torch.round(w / scale[:, None]).clamp(-127, 127)
        return cls(q, scale)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16).contiguous(), self.q, self.scale)
        return y.to(x.dtype)

    def dequantize(self) -> torch.Tensor:
        return self.q.float() * self.scale.float()[:, None]


class Int4Weight(QuantizedWeight):
    """Asymmetric int4 in groups of 32 along K: w = code * scale + offset, code in [0, 15].

    That is exactly GGUF's Q4_0 (offset = -8 * scale), Q4_1 and Q4_K (per 32-element sub-block), so
    those files load with their own codes; the only change is that scale and offset are rounded to bf16.
    """

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> None:
        """codes: [N, K] integers in [0, 15]; scale, offset: [N, K // 32]."""
        super().__init__()
        n, k = codes.shape
        if k % INT4_GROUP or scale.shape != (n, k // INT4_GROUP) or offset.shape != scale.shape:
            raise ValueError(f"an int4 weight needs K a multiple of {INT4_GROUP}; got {tuple(codes.shape)}")
        self.out_features, self.in_features = n, k
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), 1)
        self.register_buffer("packed", packed)
        # torch's kernel computes (code - 8) * scale + zero, so its zero is our offset + 8 * scale
        zero = offset.float() + 8 * scale.float()
        table = torch.stack([scale.float().t(), zero.t()], dim=-1).to(torch.bfloat16).contiguous()
        self.register_buffer("scale_zero", table)

    @classmethod
    def from_float(cls, w: torch.Tensor) -> Int4Weight:
        """Group-wise min/max quantization (GGUF's Q4_1 rule)."""
        n, k = w.shape
        g = w.float().reshape(n, k // INT4_GROUP, INT4_GROUP)
        lo, hi = g.amin(dim=-1), g.amax(dim=-1)
        scale = ((hi - lo) / 15).clamp(min=1e-12)
        codes = torch.round((g - lo[..., None]) / scale[..., None]).clamp(0, 15).reshape(n, k)
        return cls(codes, scale, lo)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.bfloat16 and x.is_contiguous():
            # the decode step's case: no conversions to dispatch
            return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, INT4_GROUP, self.scale_zero)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.to(torch.bfloat16).contiguous(), self.packed, INT4_GROUP, self.scale_zero
        )
        return y.to(x.dtype)

    def dequantize(self) -> torch.Tensor:
        # The codes read back through the kernel's own unpacking: an identity times the weight with
        # scale 1 and zero 8 gives each code exactly, and the bf16 path is fast where float32's is not.
        k, n = self.in_features, self.out_features
        unit = torch.stack([torch.ones(k // INT4_GROUP, n), torch.full((k // INT4_GROUP, n), 8.0)], dim=-1)
        eye = torch.eye(k, dtype=torch.bfloat16)
        codes = torch.ops.aten._weight_int4pack_mm_for_cpu(
            eye, self.packed, INT4_GROUP, unit.to(torch.bfloat16)
        )
        table = self.scale_zero.float()
        scale = table[..., 0].t().repeat_interleave(INT4_GROUP, dim=1)
        zero = table[..., 1].t().repeat_interleave(INT4_GROUP, dim=1)
        return (codes.float().t() - 8) * scale + zero


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row symmetric int8: x [M, K] -> (q [M, K] int8, scale [M, 1] float32), x ~ q * scale, the
    row's largest magnitude at 127. The reference for the C kernel that does the same in one pass."""
    xf = x.float()
    scale = xf.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 127
    return torch.round(xf / scale).clamp_(-127, 127).to(torch.int8), scale


class W8A8Weight(Int8Weight):
    """Int8Weight's codes and scales, multiplied by activations quantized to int8 a row (token) at a time.

    y = (q_x @ q_w.T) * scale_x[m] * scale_w[n] with exact int32 sums: the only errors are the two
    roundings to int8. An activation row with one large outlier loses precision in all its other
    values; docs/benchmarks.md has what that costs a small model.
    """

    def __init__(self, q: torch.Tensor, scale: torch.Tensor) -> None:
        super().__init__(q, scale)
        # the rescale multiplies in float32: the bf16 scale widened once here, not at every call
        self.register_buffer("scale_f32", self.scale.float())

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        lib = cpu_kernels.library() if x.device.type == "cpu" else None
        if lib is not None and x.dtype in (torch.float32, torch.bfloat16):
            xq, row_scale = cpu_kernels.quantize_rows_int8(lib, x)
            acc = torch._int_mm(xq, self.q.t())
            return cpu_kernels.rescale_int32(lib, acc, row_scale, self.scale_f32, x.dtype)
        xq, row_scale = quantize_rows(x)
        acc = torch._int_mm(xq, self.q.t())
        return (acc.float() * (row_scale * self.scale_f32)).to(x.dtype)
