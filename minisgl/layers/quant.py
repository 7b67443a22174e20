"""Weights kept quantized on the CPU: int8 per output channel and int4 in groups of 32.

On a CPU with integer dot products (AVX512-VNNI), Int4Weight and Int8Weight run minisgl's C kernel
(`minisgl/kernel/cpu/qlinear.c`): the activations are rounded to int8 in blocks of 32 (one scale a block,
as llama.cpp's Q8 activations) and multiplied with int32 sums; a one-stream decode step's matmuls take
about 0.65x of torch's int4 kernel's time (docs/benchmarks.md, "Int4 times int8"). Elsewhere they run
torch's weight-only kernels: the activations stay bf16 and the kernel widens the weights as it reads
them, so a decode step reads a half (int8) or a quarter (int4) of the bf16 bytes. W8A8Weight quantizes
the activations per row (token) and multiplies with `torch._int_mm`: on a VNNI CPU 1.1-1.4x faster than
the bf16 matmul from 8 rows on, at the cost of a coarser rounding (docs/benchmarks.md, "W8A8"). torch's
CPU kernels are fast only for bf16 activations (float32 ones are 5-30x slower, measured), so
activations of any other dtype are cast to bf16 around those calls. Where a float copy of the weight is
kept as well, prefill steps and batches of more than `max_rows` rows use it: the bf16 matmul beats the
packed kernels on large batches (`QuantizableLinear` says why prompts take it too).
"""

from __future__ import annotations

import ctypes
import functools

import torch
from torch import nn

from minisgl.env import ENV
from minisgl.kernel import cpu as cpu_kernels
from minisgl.kernel import triton_everywhere
from minisgl.kernel.cpu import qlinear

INT4_GROUP = 32  # the block of GGUF's Q4_0 / Q4_1 and the sub-block of Q4_K


def q8_kernels() -> ctypes.CDLL | None:
    """The C library where its int8-activation kernels are the fast path (a CPU with AVX512-VNNI) and
    MINISGL_CPU_INT8_ACTIVATIONS is on, else None: packed weights then run torch's weight-only kernels."""
    if triton_everywhere() or not ENV.CPU_INT8_ACTIVATIONS.value:
        return None
    lib = cpu_kernels.library()
    return lib if lib is not None and lib.qlinear_fast() else None


class QuantizedWeight(nn.Module):
    """A [N, K] weight in a packed format; `matmul(x)` is x @ w.T for x: [M, K]."""

    out_features: int
    in_features: int

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def dequantize(self) -> torch.Tensor:
        """The float32 weight the kernel multiplies by (what tests compare against)."""
        raise NotImplementedError


def round_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (codes [N, K] in [-127, 127] as float32, scale [N] float32), w ~ codes * scale[:, None]."""
    w = w.float()
    # a scale rounded to bf16 first, so that the codes are computed against the scale the kernel uses
    scale = (w.abs().amax(dim=1) / 127).clamp(min=1e-12).to(torch.bfloat16).float()
    return torch.round(w / scale[:, None]).clamp(-127, 127), scale


class Int8Weight(QuantizedWeight):
    """Symmetric int8 with one scale per output channel: w[n, k] = q[n, k] * scale[n]."""

    # whether the C kernel (int8 activation blocks) may serve this weight; W8A8Weight keeps its own path
    q8_activations = True

    def __init__(self, q: torch.Tensor, scale: torch.Tensor) -> None:
        super().__init__()
        self.out_features, self.in_features = q.shape
        # the scale in bf16, the type torch's kernel takes; the C kernel reads the same values widened
        scale = scale.to(torch.bfloat16).contiguous()
        self.pack: qlinear.I8Pack | None = None
        if self.q8_activations and q8_kernels() is not None and self.in_features % qlinear.PAIR == 0:
            self.pack = qlinear.pack_i8(q.to(torch.int8), scale.float())
            self.register_buffer("q", None)
        else:
            self.register_buffer("q", q.to(torch.int8).contiguous())
        self.register_buffer("scale", scale)

    @staticmethod
    def codes_of(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The constructor's arguments for w: its int8 codes and per-channel scales."""
        q, scale = round_per_channel(w)
        return q.to(torch.int8), scale

    @classmethod
    def from_float(cls, w: torch.Tensor) -> Int8Weight:
        return cls(*cls.codes_of(w))

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        pack = self.pack
        if pack is not None and x.device.type == "cpu" and x.dtype in qlinear.FLOAT_KINDS:
            if torch.compiler.is_compiling():
                # a compiled step runs only where the kernels were built (engine/cpu_compile.py)
                return torch.ops.minisgl.cpu_linear_i8(x, pack.w, pack.scale)
            # the library a pack was made for (q8_kernels() at construction): cached, no checks a call
            lib = cpu_kernels.library()
            assert lib is not None
            return qlinear.linear_i8(lib, x, pack)
        y = torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16).contiguous(), self.codes(), self.scale)
        return y.to(x.dtype)

    def codes(self) -> torch.Tensor:
        """[N, K] int8."""
        if self.q is not None:
            return self.q
        assert self.pack is not None
        return (self.pack.w.to(torch.int16) - 128).to(torch.int8)

    def dequantize(self) -> torch.Tensor:
        return self.codes().float() * self.scale.float()[:, None]


class Int4Weight(QuantizedWeight):
    """Asymmetric int4 in groups of 32 along K: w = code * scale + offset, code in [0, 15].

    That is exactly GGUF's Q4_0 (offset = -8 * scale), Q4_1 and Q4_K (per 32-element sub-block), so
    those files load with their own codes; the only change is the rounding of scale and offset: to
    float16 for the C kernel (a Q4_0 / Q4_1 file's own type: exact), to bf16 for torch's.
    """

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> None:
        """codes: [N, K] integers in [0, 15]; scale, offset: [N, K // 32]."""
        super().__init__()
        n, k = codes.shape
        if k % INT4_GROUP or scale.shape != (n, k // INT4_GROUP) or offset.shape != scale.shape:
            raise ValueError(f"an int4 weight needs K a multiple of {INT4_GROUP}; got {tuple(codes.shape)}")
        self.out_features, self.in_features = n, k
        self.pack: qlinear.Q4Pack | None = None
        if q8_kernels() is not None and k % qlinear.PAIR == 0:
            self.pack = qlinear.pack_q4(codes, scale, offset)
            return
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
        pack = self.pack
        if pack is not None and x.device.type == "cpu" and x.dtype in qlinear.FLOAT_KINDS:
            if torch.compiler.is_compiling():
                return torch.ops.minisgl.cpu_linear_q4(x, pack.qs, pack.d, pack.off)
            lib = cpu_kernels.library()
            assert lib is not None
            return qlinear.linear_q4(lib, x, pack)
        if x.dtype == torch.bfloat16 and x.is_contiguous():
            # the decode step's case: no conversions to dispatch
            return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, INT4_GROUP, self.scale_zero)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.to(torch.bfloat16).contiguous(), self.packed, INT4_GROUP, self.scale_zero
        )
        return y.to(x.dtype)

    def dequantize(self) -> torch.Tensor:
        if self.pack is not None:
            codes = qlinear.unpack_q4(self.pack).float()
            scale = self.pack.d.float().repeat_interleave(INT4_GROUP, dim=1)
            return codes * scale + self.pack.off.float().repeat_interleave(INT4_GROUP, dim=1)
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


@functools.cache
def onednn_int8_supported() -> bool:
    """Whether this torch has oneDNN's prepacked int8 matmul and it gives _int_mm's sums (checked once)."""
    try:
        gen = torch.Generator().manual_seed(0)
        w = torch.randint(-127, 128, (24, 64), dtype=torch.int8, generator=gen)
        x = torch.randint(-127, 128, (5, 64), dtype=torch.int8, generator=gen)
        packed = torch.ops.onednn.qlinear_prepack(w, None)
        xu = (x.to(torch.int16) + 128).to(torch.uint8)
        got = torch.ops.onednn.qlinear_pointwise(
            xu,
            1.0,
            128,
            packed,
            torch.ones(24),
            torch.zeros(24, dtype=torch.int64),
            None,
            1.0,
            0,
            torch.float32,
            "none",
            [],
            "",
        )
        return bool(torch.equal(got, torch._int_mm(x, w.t()).float()))
    except (AttributeError, RuntimeError):
        return False


def quantize_rows(x: torch.Tensor, col_mul: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row symmetric int8 of x * col_mul (col_mul: [K] float32, W8A8's smoothing, or None): x [M, K]
    -> (q [M, K] int8, scale [M, 1] float32), the row's largest magnitude at 127. The reference for the
    C kernel that does the same in one pass."""
    xf = x.float()
    if col_mul is not None:
        xf = xf * col_mul
    scale = xf.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 127
    return torch.round(xf / scale).clamp_(-127, 127).to(torch.int8), scale


class W8A8Weight(Int8Weight):
    """Int8Weight's codes and scales, multiplied by activations quantized to int8 a row (token) at a time.

    (Not by the C kernel's blocks of 32: this is the per-token scheme of GPU engines.)

    y = (q_x @ q_w.T) * scale_x[m] * scale_w[n] with exact int32 sums: the only errors are the two
    roundings to int8. An activation row with one large outlier channel loses precision in all its other
    values, so the input channels are smoothed (SmoothQuant): the codes are those of w * s (s: [K], one
    factor an input channel, `minisgl/models/smoothing.py`) and the activations are multiplied by 1 / s
    before their rounding, which moves part of each outlier channel's range into the weight's columns.
    Without s (None) the activations are rounded as they come; docs/benchmarks.md has what each costs.
    """

    q8_activations = False

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, inv_smooth: torch.Tensor | None = None) -> None:
        super().__init__(q, scale)
        # the rescale multiplies in float32: the bf16 scale widened once here, not at every call
        self.register_buffer("scale_f32", self.scale.float())
        if inv_smooth is not None:
            assert inv_smooth.shape == (self.in_features,)
            inv_smooth = inv_smooth.float().contiguous()
        self.register_buffer("inv_smooth", inv_smooth)
        # not buffers: oneDNN's own layout of the codes, made once (an opaque tensor, never saved)
        self.onednn: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        if q.device.type == "cpu" and ENV.CPU_ONEDNN_WEIGHTS.value and onednn_int8_supported():
            self.onednn = (
                torch.ops.onednn.qlinear_prepack(self.q, None),
                torch.ones(self.out_features),  # the scales go on after, in rescale_int32's order
                torch.zeros(self.out_features, dtype=torch.int64),
            )
            if cpu_kernels.library() is not None and not ENV.CPU_COMPILE.value:
                # every call then runs on oneDNN's copy: the plain codes (an int8 byte a weight, 134 MB
                # for the default model) are dropped, and codes() reads them back from that copy
                self.q = None

    @staticmethod
    def codes_of(
        w: torch.Tensor, smooth: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The constructor's arguments: the codes of w (or of w * smooth, column by column) as Int8Weight rounds
        them, and 1 / smooth for the activations."""
        if smooth is None:
            return (*Int8Weight.codes_of(w), None)
        smooth = smooth.float()
        return (*Int8Weight.codes_of(w.float() * smooth), 1 / smooth)

    @classmethod
    def from_float(cls, w: torch.Tensor, smooth: torch.Tensor | None = None) -> W8A8Weight:
        return cls(*cls.codes_of(w, smooth))

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        inv_smooth = self.inv_smooth
        cpu_float = x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16)
        if cpu_float and torch.compiler.is_compiling():
            # one opaque node (a compiled step runs only where the kernels were built): inductor would
            # round the torch ops' divisions otherwise than the C ends do
            return torch.ops.minisgl.cpu_linear_w8a8(x, self.q, self.scale_f32, inv_smooth)
        lib = cpu_kernels.library() if cpu_float else None
        if lib is not None:
            onednn = self.onednn
            if onednn is not None:
                # the codes + 128 against weights in oneDNN's layout, zero point 128: the same int32 sums,
                # written as float32 (exact), without the repacking of the weight that _int_mm does in
                # every call (a 64-row step's matmuls of the default model 57 -> 50 ms, measured)
                xu, row_scale = cpu_kernels.quantize_rows_int8(lib, x, inv_smooth, as_uint8=True)
                packed, ones, zeros = onednn
                acc = torch.ops.onednn.qlinear_pointwise(
                    xu, 1.0, 128, packed, ones, zeros, None, 1.0, 0, torch.float32, "none", [], ""
                )
                return cpu_kernels.rescale_int32(lib, acc, row_scale, self.scale_f32, x.dtype)
            xq, row_scale = cpu_kernels.quantize_rows_int8(lib, x, inv_smooth)
            acc = torch._int_mm(xq, self.q.t())
            return cpu_kernels.rescale_int32(lib, acc, row_scale, self.scale_f32, x.dtype)
        xq, row_scale = quantize_rows(x, inv_smooth)
        acc = torch._int_mm(xq, self.codes().t())
        return (acc.float() * (row_scale * self.scale_f32)).to(x.dtype)

    def codes(self) -> torch.Tensor:
        """[N, K] int8; from oneDNN's copy when the plain codes were dropped (its dense form is [K, N])."""
        if self.q is not None:
            return self.q
        assert self.onednn is not None
        return self.onednn[0].to_dense().t().contiguous()

    def dequantize(self) -> torch.Tensor:
        # the weight that multiplies the unsmoothed x: the codes' columns divided by their factors again
        w = super().dequantize()
        return w if self.inv_smooth is None else w * self.inv_smooth
