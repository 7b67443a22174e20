"""C kernels for the CPU path, built with the system's C compiler on first use and loaded through ctypes.

They need no torch headers, so a build takes about a second. The library is compiled for the CPU it
runs on (`-march=native`) and cached under a name made of the source's and the CPU flags' hash, so a
cache shared between different machines never hands one a library with instructions it lacks. Where
no compiler is found or the build fails, `library()` returns None and callers keep their torch path.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import subprocess
import tempfile
from collections.abc import Sequence
from functools import cache
from pathlib import Path

import torch

from minisgl.env import ENV
from minisgl.kernel import triton_everywhere
from minisgl.utils.logger import init_logger

logger = init_logger(__name__)

_SOURCES = ["attention.c", "elementwise.c", "layer.c", "linear.c", "qlinear.c"]
_HEADERS = ["bf16.h", "kernels.h"]
_FLAGS = [
    "-O3",
    "-march=native",
    "-fopenmp",
    "-shared",
    "-fPIC",
    # lets the compiler vectorise the dot products' sums; no NaN/inf assumptions (scores start at -inf)
    "-fno-math-errno",
    "-fassociative-math",
    "-fno-signed-zeros",
    "-fno-trapping-math",
]


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def _build(target: Path, sources: list[Path], extra_flags: Sequence[str]) -> None:
    cc = os.environ.get("CC", "cc")
    target.parent.mkdir(parents=True, exist_ok=True)
    # built beside the target, then renamed: processes building at once never load a half-written file
    with tempfile.NamedTemporaryFile(dir=target.parent, suffix=".so", delete=False) as tmp:
        partial = Path(tmp.name)
    try:
        subprocess.run(
            [cc, *_FLAGS, *extra_flags, *map(str, sources), "-o", str(partial), "-lm"],
            check=True,
            capture_output=True,
            text=True,
            timeout=120,
        )
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)


def load(folder: Path, extra_flags: Sequence[str] = ()) -> ctypes.CDLL:
    """The kernels built into `folder` (once: the file is named by the sources', flags' and CPU's hash)
    and loaded. extra_flags follow the usual ones: the tests build the plain-C paths with
    `-mno-avx512f` to check they give what the vector paths give."""
    here = Path(__file__).parent
    sources = [here / name for name in _SOURCES]
    digest = hashlib.sha256()
    for src in [*sources, *(here / name for name in _HEADERS)]:
        digest.update(src.read_bytes())
    digest.update(" ".join([*_FLAGS, *extra_flags]).encode())
    digest.update(_cpu_flags().encode())
    target = folder / f"minisgl_cpu_{digest.hexdigest()[:16]}.so"
    if not target.exists():
        _build(target, sources, extra_flags)
    lib = ctypes.CDLL(str(target))
    _declare(lib)
    return lib


@cache
def library() -> ctypes.CDLL | None:
    """The compiled kernels, or None where they cannot be built here (the callers then use torch ops)."""
    if ENV.DISABLE_CPU_KERNELS:
        return None
    try:
        return load(Path(ENV.CACHE_DIR.value) / "cpu_kernels")
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", "") or str(e)
        logger.warning(
            f"the CPU kernels could not be built ({detail.strip()[:300]}); using torch ops instead"
        )
        return None


def _declare(lib: ctypes.CDLL) -> None:
    p, i32, i64, f32 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
    lib.decode_attention.argtypes = [p, i32, i64, p, p, i32, p, i64, p, p, p, i32, i32, i32, i32, f32, i32]
    lib.decode_attention.restype = i32
    lib.prefill_attention.argtypes = [
        p,
        i32,
        i64,
        p,
        p,
        i32,
        p,
        i64,
        p,
        p,
        p,
        p,
        i32,
        i32,
        i32,
        i32,
        f32,
        f32,
        i32,
    ]
    lib.prefill_attention.restype = i32
    lib.linear_bf16.argtypes = [p, p, p, i32, i32, i32, i32]
    lib.linear_bf16.restype = None
    lib.rms_norm_bf16.argtypes = [p, p, p, p, p, i64, i32, i64, f32, i32]
    lib.rms_norm_bf16.restype = None
    lib.rotary_bf16.argtypes = [p, p, p, p, i64, i32, i32, i32, i64, i64, i32]
    lib.rotary_bf16.restype = None
    lib.quantize_rows_int8.argtypes = [p, i32, i64, p, p, p, i32, i32, i32, i32]
    lib.quantize_rows_int8.restype = None
    lib.rescale_int32.argtypes = [p, i32, p, p, p, i32, i32, i32, i32]
    lib.rescale_int32.restype = None
    lib.argmax_rows.argtypes = [p, i64, i64, i64, p, i32]
    lib.argmax_rows.restype = None
    lib.silu_and_mul_bf16.argtypes = [p, i64, p, i64, i32, i32]
    lib.silu_and_mul_bf16.restype = None
    lib.qlinear_fast.argtypes = []
    lib.qlinear_fast.restype = i32
    lib.quantize_q8_blocks.argtypes = [p, i32, i64, p, p, p, p, i32, i32, i32]
    lib.quantize_q8_blocks.restype = None
    lib.linear_q4.argtypes = [p, i32, i64, i32, i32, p, p, p, i32, p, i32, i32]
    lib.linear_q4.restype = i32
    lib.linear_i8.argtypes = [p, i32, i64, i32, i32, p, p, i32, p, i32, i32]
    lib.linear_i8.restype = i32


# the element types attention.c reads, by its kv_kind codes
_KV_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float8_e4m3fn: 2}
# the float kinds the kernels' activations are read and written in (W8A8's ends, prefill attention's
# queries and outputs), by their x_kind / y_kind / q_kind codes
FLOAT_KINDS = {torch.float32: 0, torch.bfloat16: 1}


def _paged_query(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor
) -> torch.Tensor:
    """The attention kernels' checks of the pool, and q as they read it: float32 or bf16, heads contiguous
    within a token (tokens may stay strided)."""
    assert k_cache.dtype in _KV_KINDS and page_table.dtype == torch.int32
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and page_table.stride(1) == 1
    if q.dtype not in FLOAT_KINDS:
        q = q.to(torch.float32)
    if q.stride(2) != 1 or q.stride(1) != q.shape[2]:
        q = q.contiguous()
    return q


def decode_attention(
    lib: ctypes.CDLL,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    rows: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """q: [B, Hq, D] float32 or bf16 (heads contiguous; requests may be strided, as views of a qkv
    projection are); k/v_cache: [slots, Hk, D] float32, bf16 or float8_e4m3fn (read as stored * k_scale
    or v_scale); page_table: [R, W] int32 token slots; rows, lens: [B] int64 -> [B, Hq, D] float32, each
    query over the first lens[b] slots of its row. bf16 queries over a bf16 pool are computed as torch's
    SDPA computes bf16 attention (attention.c says how)."""
    q = _paged_query(q, k_cache, v_cache, page_table)
    bs, num_q, d = q.shape
    rows, lens = rows.contiguous(), lens.contiguous()
    out = torch.empty((bs, num_q, d), dtype=torch.float32)
    rc = lib.decode_attention(
        q.data_ptr(),
        FLOAT_KINDS[q.dtype],
        q.stride(0),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        _KV_KINDS[k_cache.dtype],
        page_table.data_ptr(),
        page_table.stride(0),
        rows.data_ptr(),
        lens.data_ptr(),
        out.data_ptr(),
        bs,
        num_q,
        k_cache.shape[1],
        d,
        # K's scale is a factor of every score, V's of every output: both are applied outside the loops
        scale * k_scale,
        torch.get_num_threads(),
    )
    if rc != 0:
        raise MemoryError("decode attention: out of memory for its scores")
    if v_scale != 1.0:
        out.mul_(v_scale)
    return out


def prefill_attention(
    lib: ctypes.CDLL,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    rows: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Causal attention of a packed prefill batch over the paged pool.

    q: [T, Hq, D] float32 or bf16 (heads contiguous; tokens may be strided, as views of a qkv projection
    are), the extend_lens[b] rows of each request one after another; k/v_cache: [slots, Hk, D] float32,
    bf16 or float8_e4m3fn (read as stored * k_scale or v_scale); page_table: [R, W] int32 token slots;
    rows, prefix_lens (cached tokens), extend_lens: [B] int64. Row t of request b attends over the first
    prefix_lens[b] + t + 1 slots of its page-table row -> [T, Hq, D] in q's dtype. D % 16 == 0.
    """
    q = _paged_query(q, k_cache, v_cache, page_table)
    t, num_q, d = q.shape
    rows, prefix_lens, extend_lens = rows.contiguous(), prefix_lens.contiguous(), extend_lens.contiguous()
    out = torch.empty((t, num_q, d), dtype=q.dtype)
    rc = lib.prefill_attention(
        q.data_ptr(),
        FLOAT_KINDS[q.dtype],
        q.stride(0),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        _KV_KINDS[k_cache.dtype],
        page_table.data_ptr(),
        page_table.stride(0),
        rows.data_ptr(),
        prefix_lens.data_ptr(),
        extend_lens.data_ptr(),
        out.data_ptr(),
        rows.shape[0],
        num_q,
        k_cache.shape[1],
        d,
        scale * k_scale,
        v_scale,
        torch.get_num_threads(),
    )
    if rc == -2:
        raise MemoryError("prefill attention: out of memory for its tiles")
    if rc != 0:
        raise ValueError(
            f"prefill attention takes head_dim % 16 == 0 and Hq % Hk == 0: got {d}, {num_q}, {k_cache.shape[1]}"
        )
    return out


# the most rows of x the small-batch linear kernel is used for: at 4 rows oneDNN catches up with it
# (measured on AVX512-BF16 without AMX), and linear.c takes at most 8
LINEAR_MAX_ROWS = 2


def linear_bf16(lib: ctypes.CDLL, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x: [M, K] with M <= 8, weight: [N, K] bf16, K % 16 == 0 -> x @ weight.T in x's dtype."""
    assert (
        weight.dtype == torch.bfloat16 and weight.is_contiguous() and x.shape[0] <= 8 and x.shape[1] % 16 == 0
    )
    xf = x.to(torch.float32).contiguous()
    (m, k), n = xf.shape, weight.shape[0]
    y = torch.empty(m, n, dtype=torch.float32)
    lib.linear_bf16(xf.data_ptr(), weight.data_ptr(), y.data_ptr(), m, n, k, torch.get_num_threads())
    return y.to(x.dtype)


def elementwise_lib(x: torch.Tensor) -> ctypes.CDLL | None:
    """The kernels for the small ops of a layer (elementwise.c) where they serve `x`: bf16 on the CPU,
    outside a compiled step.

    float32 keeps the torch ops, the reference the tests compare with transformers; MINISGL_KERNELS=triton
    runs the CUDA path's code, which has no C kernels.
    """
    if (
        x.dtype != torch.bfloat16
        or x.device.type != "cpu"
        or triton_everywhere()
        or torch.compiler.is_compiling()
    ):
        # a compiled step leaves these ops to inductor, which fuses them into its own loops
        return None
    return library()


def rms_norm_bf16(
    lib: ctypes.CDLL, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x + residual), x + residual) of bf16 [..., N] tensors, or (norm(x), x) without a residual."""
    n = x.shape[-1]
    x2 = x if x.dim() == 2 else x.reshape(-1, n)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    assert weight.dtype == torch.bfloat16 and (residual is None or residual.dtype == torch.bfloat16)
    weight = weight.contiguous()
    rows = x2.shape[0]
    y = torch.empty((rows, n), dtype=torch.bfloat16)
    res_out = x
    res_ptr = out_ptr = None
    if residual is not None:
        residual = residual.reshape(-1, n).contiguous()
        res_out = torch.empty((rows, n), dtype=torch.bfloat16)
        res_ptr, out_ptr = residual.data_ptr(), res_out.data_ptr()
        res_out = res_out.view(x.shape)
    lib.rms_norm_bf16(
        x2.data_ptr(),
        res_ptr,
        y.data_ptr(),
        out_ptr,
        weight.data_ptr(),
        rows,
        n,
        x2.stride(0),
        eps,
        torch.get_num_threads(),
    )
    return y.view(x.shape), res_out


def rotary_bf16(
    lib: ctypes.CDLL, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotates bf16 q [T, Hq, D] and k [T, Hk, D] in place (heads contiguous, tokens strided, as the
    views of a qkv projection are) by the rows of cos_sin [P, 2D] float32 at `positions` [T].

    Positions are not checked against P: the engine's are below max_seq_len, the table's length.
    """
    t, hq, d = q.shape
    assert q.stride(2) == 1 and q.stride(1) == d and k.stride(2) == 1 and k.stride(1) == d
    assert cos_sin.dtype == torch.float32 and cos_sin.is_contiguous() and cos_sin.shape[1] == 2 * d
    positions = positions.to(torch.int64).contiguous()
    lib.rotary_bf16(
        q.data_ptr(),
        k.data_ptr(),
        positions.data_ptr(),
        cos_sin.data_ptr(),
        t,
        hq,
        k.shape[1],
        d,
        q.stride(0),
        k.stride(0),
        torch.get_num_threads(),
    )
    return q, k


def quantize_rows_int8(
    lib: ctypes.CDLL, x: torch.Tensor, col_mul: torch.Tensor | None = None, as_uint8: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [M, K] float32 or bf16 (rows may be strided), col_mul: [K] float32 or None -> (q [M, K] int8,
    scale [M, 1] float32) of x * col_mul, each row symmetric with its largest magnitude at 127, as
    `layers.quant.quantize_rows` computes it; with `as_uint8`, q is code + 128 as uint8."""
    assert col_mul is None or (col_mul.dtype == torch.float32 and col_mul.is_contiguous())
    if x.stride(-1) != 1:
        x = x.contiguous()
    m, k = x.shape
    q = torch.empty((m, k), dtype=torch.uint8 if as_uint8 else torch.int8)
    scale = torch.empty((m, 1), dtype=torch.float32)
    lib.quantize_rows_int8(
        x.data_ptr(),
        FLOAT_KINDS[x.dtype],
        x.stride(0),
        None if col_mul is None else col_mul.data_ptr(),
        q.data_ptr(),
        scale.data_ptr(),
        m,
        k,
        int(as_uint8),
        torch.get_num_threads(),
    )
    return q, scale


def rescale_int32(
    lib: ctypes.CDLL, acc: torch.Tensor, row_scale: torch.Tensor, col_scale: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """acc: [M, N] int32 (or float32 holding int32 sums exactly), row_scale: [M, 1], col_scale: [N]
    float32 -> acc * (row_scale * col_scale) in dtype (float32 or bf16)."""
    assert (
        acc.dtype in (torch.int32, torch.float32) and acc.is_contiguous() and col_scale.dtype == torch.float32
    )
    m, n = acc.shape
    y = torch.empty((m, n), dtype=dtype)
    lib.rescale_int32(
        acc.data_ptr(),
        int(acc.dtype == torch.float32),
        row_scale.data_ptr(),
        col_scale.data_ptr(),
        y.data_ptr(),
        FLOAT_KINDS[dtype],
        m,
        n,
        torch.get_num_threads(),
    )
    return y


def silu_and_mul_bf16(lib: ctypes.CDLL, x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of a bf16 [rows, 2n] tensor holding gate|up side by side (rows contiguous) -> [rows, n]."""
    assert x.dtype == torch.bfloat16 and x.dim() == 2 and x.stride(1) == 1
    rows, n = x.shape[0], x.shape[1] // 2
    y = torch.empty((rows, n), dtype=torch.bfloat16)
    lib.silu_and_mul_bf16(x.data_ptr(), x.stride(0), y.data_ptr(), rows, n, torch.get_num_threads())
    return y


def argmax_rows(lib: ctypes.CDLL, x: torch.Tensor) -> torch.Tensor:
    """torch.argmax(x, dim=-1) as int32 for a float32 [rows, n] CPU tensor whose rows are contiguous."""
    assert x.dtype == torch.float32 and x.dim() == 2 and x.stride(1) == 1
    out = torch.empty(x.shape[0], dtype=torch.int32)
    lib.argmax_rows(
        x.data_ptr(), x.stride(0), x.shape[0], x.shape[1], out.data_ptr(), torch.get_num_threads()
    )
    return out
