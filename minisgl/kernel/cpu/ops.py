"""The C kernels as torch operators (`torch.ops.minisgl.*`), so that `torch.compile` can trace a decode step.

A ctypes call is opaque to dynamo: it would break the graph at every layer. Registered with
`torch.library`, each kernel is one node of the graph with a fake implementation that gives
its output's shape. Eager code keeps calling the ctypes wrappers directly: the dispatcher adds some
microseconds a call that only a compiled step wins back.
"""

from __future__ import annotations

import ctypes

import torch

from minisgl.kernel import cpu as cpu_kernels
from minisgl.kernel.cpu import qlinear
from minisgl.kvcache.mha_pool import write_kv


def _lib() -> ctypes.CDLL:
    """The compiled C kernels; a compiled step is only built where they exist (engine/cpu_compile.py)."""
    lib = cpu_kernels.library()
    if lib is None:
        raise RuntimeError("the CPU kernels could not be built here; a compiled step needs them")
    return lib


# Defined through torch.library.Library, not custom_op: custom_op's Python wrapper cost ~50 us a call
# here, as much as the kernel; a plain CPU implementation is dispatched in a few.
_LIB = torch.library.Library("minisgl", "DEF")
_LIB.define(
    "cpu_decode_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) k_buffer, Tensor(b!) v_buffer, "
    "int layer_id, Tensor out_loc, Tensor page_table, Tensor rows, Tensor lens, float scale, "
    "float k_scale, float v_scale) -> Tensor"
)
_LIB.define("cpu_linear_bf16(Tensor x, Tensor weight) -> Tensor")
_LIB.define("cpu_linear_q4(Tensor x, Tensor qs, Tensor d, Tensor off) -> Tensor")
_LIB.define("cpu_linear_i8(Tensor x, Tensor w, Tensor scale) -> Tensor")
_LIB.define("cpu_linear_w8a8(Tensor x, Tensor q, Tensor scale, Tensor? inv_smooth) -> Tensor")


def cpu_decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    layer_id: int,
    out_loc: torch.Tensor,
    page_table: torch.Tensor,
    rows: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
    k_scale: float,
    v_scale: float,
) -> torch.Tensor:
    """Stores this step's k, v [B, Hk, D] at out_loc in layer `layer_id` of the pool's buffers
    [layers, slots, Hk, D], then attends q [B, Hq, D] over each request's context -> [B, Hq, D] float32.

    One op for both, so the pool's buffers are mutated in place: a functional store would copy them.
    """
    k_buf, v_buf = k_buffer[layer_id], v_buffer[layer_id]
    write_kv(k_buf, v_buf, k, v, out_loc, k_scale, v_scale)
    return cpu_kernels.decode_attention(
        _lib(), q, k_buf, v_buf, page_table, rows, lens, scale, k_scale, v_scale
    )


def cpu_linear_bf16(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ weight.T for bf16 weight [N, K] and M <= 8 rows (linear.c), in x's dtype."""
    return cpu_kernels.linear_bf16(_lib(), x, weight)


def cpu_linear_q4(x: torch.Tensor, qs: torch.Tensor, d: torch.Tensor, off: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ w.T for an int4 weight in qlinear.c's layout, x rounded to int8 blocks (qlinear.py)."""
    return qlinear.linear_q4(_lib(), x, qlinear.Q4Pack(qs, d, off))


def cpu_linear_i8(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """As cpu_linear_q4, for an int8 weight."""
    return qlinear.linear_i8(_lib(), x, qlinear.I8Pack(w, scale))


def cpu_linear_w8a8(
    x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, inv_smooth: torch.Tensor | None
) -> torch.Tensor:
    """W8A8Weight.matmul's eager path in one node: x [M, K] (times inv_smooth) rounded to int8 a row, times
    the int8 codes q [N, K] with int32 sums, rescaled by the row's and the channel's (float32) scale."""
    lib = _lib()
    xq, row_scale = cpu_kernels.quantize_rows_int8(lib, x, inv_smooth)
    return cpu_kernels.rescale_int32(lib, torch._int_mm(xq, q.t()), row_scale, scale, x.dtype)


_LIB.impl("cpu_decode_attention", cpu_decode_attention, "CPU")
_LIB.impl("cpu_linear_bf16", cpu_linear_bf16, "CPU")
_LIB.impl("cpu_linear_q4", cpu_linear_q4, "CPU")
_LIB.impl("cpu_linear_i8", cpu_linear_i8, "CPU")
_LIB.impl("cpu_linear_w8a8", cpu_linear_w8a8, "CPU")


@torch.library.register_fake("minisgl::cpu_decode_attention", lib=_LIB)
def _(q, k, v, k_buffer, v_buffer, layer_id, out_loc, page_table, rows, lens, scale, k_scale, v_scale):  # noqa: ANN001, ANN202
    return torch.empty(q.shape, dtype=torch.float32)


@torch.library.register_fake("minisgl::cpu_linear_bf16", lib=_LIB)
def _(x, weight):  # noqa: ANN001, ANN202
    return x.new_empty((x.shape[0], weight.shape[0]))


@torch.library.register_fake("minisgl::cpu_linear_q4", lib=_LIB)
def _(x, qs, d, off):  # noqa: ANN001, ANN202
    return x.new_empty((x.shape[0], qs.shape[0]))


@torch.library.register_fake("minisgl::cpu_linear_i8", lib=_LIB)
def _(x, w, scale):  # noqa: ANN001, ANN202
    return x.new_empty((x.shape[0], w.shape[0]))


@torch.library.register_fake("minisgl::cpu_linear_w8a8", lib=_LIB)
def _(x, q, scale, inv_smooth):  # noqa: ANN001, ANN202
    return x.new_empty((x.shape[0], q.shape[0]))
