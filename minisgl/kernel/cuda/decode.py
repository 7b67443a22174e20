"""Decode attention by decode.cu's CUDA kernel: the Triton decode kernel's work (no rotary inside) for a bf16
query, head dim 128 and 1 or 2 query heads a KV head (decode.cu also takes 4, slower there than Triton), over a
bf16 or FP8 pool.

On an H200 it reads the workload's FP8 rows 15-25% faster than the Triton kernel at every batch size, and bf16
rows as fast or faster (docs/benchmarks.md, "Decode attention in CUDA C++"). The attention backend uses it
where it applies (MINISGL_DECODE_CUDA; 0: the Triton kernel everywhere). `TensorCoreDecode` is decode_tc.cu's
kernel for an FP8 or bf16 pool: the same launch, the products on the tensor cores, faster than both at 2, 4 and
8 query heads a KV head (MINISGL_DECODE_TENSOR_CORES), so the engine keeps this one for 1.
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING, Any

import torch

from minisgl.env import ENV
from minisgl.kernel.cuda import CudaModule, load_module, source
from minisgl.utils.misc import next_pow2

if TYPE_CHECKING:
    from minisgl.attention.base import DecodeRope

# query heads a KV head that the engine takes this kernel for (measured faster than Triton's); decode.cu also
# takes 4, with 16 threads a key for its registers (benchmark/offline/decode_cuda.py measures it)
GROUPS = (1, 2)
HEAD_DIM = 128
THREADS = 128
# (keys a thread group loads a step, threads a key): 8 threads a key take 16 dims each, one 16-byte load of
# an FP8 row (two of a bf16 one); 4 keys a step keep more loads in flight, which pays while the batch alone
# does not fill the GPU, 2 keep fewer registers, which pays once it does
VARIANTS = ((2, 8), (4, 8))
SMALL_BATCH = 64  # up to this many requests, 4 keys a step (measured on an H200: docs/benchmarks.md)
_LOG2E = 1.4426950408889634


def pdl_define() -> str:
    """The kernels wait for their inputs on the device first (decode_common.cuh's wait_for_inputs) where
    MINISGL_PDL_KERNELS is on: a separate source, so a separate cached cubin."""
    return "#define MINISGL_PDL 1" if ENV.PDL_KERNELS.value else ""


def kernel_name(group: int, variant: tuple[int, int], fp8: bool) -> str:
    unroll, lanes = variant
    return f"decode_{'fp8' if fp8 else 'bf16'}_g{group}_u{unroll}_l{lanes}"


def program(
    fp8_pools: tuple[bool, ...],
    variants: tuple[tuple[int, int], ...] = VARIANTS,
    groups: tuple[int, ...] = GROUPS,
) -> str:
    """decode.cu with a kernel for every query group, variant and pool asked for."""
    lines = [pdl_define(), source("decode_common.cuh"), source("decode.cu")]
    for fp8 in fp8_pools:
        for g in groups:
            for unroll, lanes in variants:
                name = kernel_name(g, (unroll, lanes), fp8)
                lines.append(f"DECODE_KERNEL({name}, {g}, {unroll}, {lanes}, {'true' if fp8 else 'false'})")
    return "\n".join(lines) + "\n"


def _vector_rows(x: torch.Tensor) -> bool:
    """Every thread's slice of a row starts on a 16-byte boundary (the kernel reads it in 8- or 16-byte words)."""
    step = 16 // x.element_size()
    return x.stride(2) == 1 and x.stride(0) % step == 0 and x.stride(1) % step == 0 and x.data_ptr() % 16 == 0


def _applies(q: torch.Tensor, k_cache: torch.Tensor, groups: tuple[int, ...], fp8: bool) -> bool:
    """A kernel for `groups` query heads a KV head and this pool dtype takes q over k_cache."""
    hq, d = q.shape[1], q.shape[2]
    hk = k_cache.shape[1]
    return (
        q.dtype == torch.bfloat16
        and d == HEAD_DIM
        and hq % hk == 0
        and hq // hk in groups
        and (k_cache.dtype == torch.float8_e4m3fn) == fp8
        and _vector_rows(q)
        and _vector_rows(k_cache)
    )


class CudaDecode:
    """The kernels for one pool dtype, compiled (or read from the cache) and loaded at construction, so that
    nothing is compiled or loaded while a CUDA graph is being captured."""

    rope = False  # whether its kernels also take the rotary kernel's work (decode_tc.cu's `_rope` kernels)

    def __init__(
        self,
        fp8: bool,
        device_index: int = 0,
        variants: tuple[tuple[int, int], ...] = VARIANTS,
        groups: tuple[int, ...] = GROUPS,
    ) -> None:
        self.fp8 = fp8
        self.variants = variants
        self.groups = groups
        pool = "fp8" if fp8 else "bf16"
        src = program((fp8,), variants, groups)
        self.module: CudaModule = load_module(src, f"decode_{pool}.cu", device_index)
        for g in groups:
            for v in variants:
                self.module.function(kernel_name(g, v, fp8))

    def applies(self, q: torch.Tensor, k_cache: torch.Tensor) -> bool:
        return _applies(q, k_cache, self.groups, self.fp8)

    def kernel(self, group: int, variant: tuple[int, int], rope: bool = False) -> str:
        """The entry point for `group` query heads a KV head and `variant` (benchmarks' candidates override it)."""
        assert not rope, "decode.cu has no rotary inside"
        return kernel_name(group, variant, self.fp8)

    def shared_bytes(self, variant: tuple[int, int]) -> int:
        """Dynamic shared memory a program of `variant` takes (decode.cu's: none)."""
        return 0

    def variant(self, batch_size: int) -> tuple[int, int]:
        """The engine's choice: the last of `variants` up to SMALL_BATCH rows, the first above."""
        return self.variants[-1] if batch_size <= SMALL_BATCH else self.variants[0]

    def __call__(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        page_table: torch.Tensor,
        rows: torch.Tensor,
        seq_lens: torch.Tensor,
        num_splits: int,
        sm_scale: float,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
        order: torch.Tensor | None = None,
        variant: tuple[int, int] | None = None,
        rope: tuple[Any, ...] | None = None,
    ) -> torch.Tensor:
        """q: [B, Hq, 128] bf16; k/v_cache: [slots, Hk, 128]; rows, seq_lens, order: [B] int32 -> [B, Hq, 128],
        as `minisgl.kernel.attention.decode_attention`; `rope`: the step's rotary work as `rope_params` gives it
        (then q comes unrotated and this step's K/V unstored)."""
        from minisgl.kernel.attention import _decode_merge_kernel

        bs, hq, d = q.shape
        hk = k_cache.shape[1]
        out = torch.empty((bs, hq, d), dtype=q.dtype, device=q.device)
        mid_o = mid_lse = out  # with one split the kernel writes the output itself
        if num_splits > 1:
            mid_o = torch.empty((bs, hq, num_splits, d), dtype=torch.float32, device=q.device)
            mid_lse = torch.empty((bs, hq, num_splits), dtype=torch.float32, device=q.device)
        args = (
            q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(), mid_o.data_ptr(),
            mid_lse.data_ptr(), page_table.data_ptr(), rows.data_ptr(), seq_lens.data_ptr(),
            order.data_ptr() if order is not None else 0,
            k_scale.data_ptr() if self.fp8 else 0, v_scale.data_ptr() if self.fp8 else 0,
            ctypes.c_int64(q.stride(0)), ctypes.c_int64(q.stride(1)), ctypes.c_int64(k_cache.stride(0)),
            ctypes.c_int64(k_cache.stride(1)), ctypes.c_int64(page_table.stride(0)), ctypes.c_int64(out.stride(0)),
            ctypes.c_int64(out.stride(1)), ctypes.c_int32(hq), ctypes.c_int32(num_splits),
            ctypes.c_float(sm_scale * _LOG2E),
        )  # fmt: skip
        if rope is not None:
            if not self.rope:
                raise ValueError("this decode kernel was built without the rotary kernel's work (rope=True)")
            args = (*args, *rope)
        variant = variant or self.variant(bs)
        name = self.kernel(hq // hk, variant, rope is not None)
        stream = torch.cuda.current_stream(q.device).cuda_stream
        self.module.launch(name, (hk, bs, num_splits), THREADS, args, stream, self.shared_bytes(variant))
        if num_splits > 1:
            _decode_merge_kernel[(bs, hq)](
                mid_o, mid_lse, out, out.stride(0), out.stride(1), num_splits, NUM_QO_HEADS=hq, D=d,
                BLOCK_D=d, BLOCK_S=next_pow2(num_splits), num_warps=4,
            )  # fmt: skip
        return out


# decode_tc.cu's variants: (STAGES, MIN_BLOCKS), see the kernel; the engine takes the first for batches of
# TC_FEW_ROWS + 1 to TC_SMALL_BATCH rows, the second for the others (measured on an H200: docs/benchmarks.md,
# "Decode attention on the tensor cores")
TC_VARIANTS = ((4, 3), (2, 4))
# the same over a bf16 pool (a stage is twice an FP8 one's bytes, 3 programs an SM at most)
TC_BF16_VARIANTS = ((3, 2), (2, 3))
TC_FEW_ROWS = 16
TC_SMALL_BATCH = 64
# query heads a KV head that the engine takes decode_tc.cu for, FP8 and bf16 pools: faster than Triton's kernel and
# decode.cu's there
TC_GROUPS = (2, 4, 8)
# decode_tc.cu's: the largest hidden row a `_rope` program reduces for a folded norm's scale
ROPE_MAX_HIDDEN = 2048
_JOIN_BYTES = 4 * (1056 + 16) * 4  # decode_tc.cu's join of the warps' states, in the ring's place


def tc_kernel_name(group: int, variant: tuple[int, int], fp8: bool = True, rope: bool = False) -> str:
    stages, min_blocks = variant
    return f"decode_tc_{'fp8' if fp8 else 'bf16'}_g{group}_s{stages}_b{min_blocks}{'_rope' if rope else ''}"


def tc_program(
    variants: tuple[tuple[int, int], ...],
    groups: tuple[int, ...] = (1, 2, 4, 8),
    fp8: bool = True,
    rope: bool = False,
) -> str:
    """decode_tc.cu with a kernel for every query group and variant asked for, over an FP8 or a bf16 pool; with
    `rope`, each also with the rotary kernel's work inside (`..._rope`)."""
    lines = [pdl_define(), source("decode_common.cuh"), source("decode_tc.cu")]
    for g in sorted(set(groups)):
        for stages, min_blocks in variants:
            for inside in (False, True) if rope else (False,):
                name = tc_kernel_name(g, (stages, min_blocks), fp8, inside)
                macro = "DECODE_TC_ROPE_KERNEL" if inside else "DECODE_TC_KERNEL"
                lines.append(f"{macro}({name}, {g}, {stages}, {min_blocks}, {'true' if fp8 else 'false'})")
    return "\n".join(lines) + "\n"


def _aligned(x: torch.Tensor, *dims: int) -> bool:
    """x starts on a 16-byte boundary, and so does every step along `dims` (decode_tc.cu copies 16 bytes at a time)."""
    step = 16 // x.element_size()
    return x.data_ptr() % 16 == 0 and all(x.stride(d) % step == 0 for d in dims)


def rope_args(rope: DecodeRope, q: torch.Tensor) -> tuple[Any, ...] | None:
    """decode_tc.cu's DECODE_ROPE_PARAMS for `rope`, or None where its kernels cannot take it: they copy 16-byte
    words of bf16 heads of 128 dims, of a float32 or bf16 cos | sin table, of bf16 norm weights and of a bf16 hidden
    row of at most ROPE_MAX_HIDDEN (a multiple of 8), and read int64 positions and slots and one eps for both norms."""
    k, v = rope.k, rope.v
    hidden = rope.row_scale[0] if rope.row_scale is not None else None
    weights = [w for w in (rope.q_weight, rope.k_weight) if w is not None]
    if (
        k.dtype != torch.bfloat16
        or v.dtype != torch.bfloat16
        or k.stride() != v.stride()
        or k.stride(-1) != 1
        or k.shape[-1] != HEAD_DIM
        or not (_aligned(k, 0, 1) and _aligned(v, 0, 1))
        or rope.positions.dtype != torch.int64
        or rope.loc.dtype != torch.int64
        or rope.cos_sin.dtype not in (torch.float32, torch.bfloat16)
        or rope.cos_sin.stride(-1) != 1
        or not _aligned(rope.cos_sin, 0)
        or len(weights) == 1
        or any(w.dtype != torch.bfloat16 or not w.is_contiguous() or not _aligned(w) for w in weights)
        or (
            hidden is not None
            and (
                hidden.dtype != torch.bfloat16
                or hidden.stride(-1) != 1
                or hidden.shape[-1] > ROPE_MAX_HIDDEN
                or hidden.shape[-1] % 8
                or not _aligned(hidden, 0)
            )
        )
        or q.shape[0] != k.shape[0]
    ):
        return None
    return (
        k.data_ptr(), v.data_ptr(), ctypes.c_int64(k.stride(0)), ctypes.c_int64(k.stride(1)),
        rope.positions.data_ptr(), rope.cos_sin.data_ptr(), ctypes.c_int64(rope.cos_sin.stride(0)),
        ctypes.c_int32(rope.cos_sin.dtype == torch.bfloat16), rope.loc.data_ptr(),
        rope.q_weight.data_ptr() if weights else 0, rope.k_weight.data_ptr() if weights else 0,
        ctypes.c_float(rope.eps), hidden.data_ptr() if hidden is not None else 0,
        ctypes.c_int64(hidden.stride(0) if hidden is not None else 0),
        ctypes.c_int32(hidden.shape[-1] if hidden is not None else 0),
        ctypes.c_float(rope.row_scale[1] if rope.row_scale is not None else 0.0),
    )  # fmt: skip


class TensorCoreDecode(CudaDecode):
    """decode_tc.cu's kernels: an FP8 (or bf16) pool, 1, 2, 4 or 8 query heads a KV head; S = K Q^T and the
    weighted sum of V by mma.sync (decode_tc.cu says how)."""

    GROUPS = (1, 2, 4, 8)

    def __init__(
        self,
        device_index: int = 0,
        variants: tuple[tuple[int, int], ...] = TC_VARIANTS,
        groups: tuple[int, ...] = TC_GROUPS,
        fp8: bool = True,
        rope: bool = False,
    ) -> None:
        self.fp8 = fp8
        self.variants = variants
        self.groups = groups
        self.rope = rope
        # only the groups it is asked for: NVRTC takes about 0.4 s a kernel on a 2-core machine (once: the cubin
        # is cached)
        name = f"decode_tc_{'fp8' if fp8 else 'bf16'}{'_rope' if rope else ''}.cu"
        self.module = load_module(tc_program(variants, groups, fp8, rope), name, device_index)
        for g in groups:
            for v in variants:
                for inside in (False, True) if rope else (False,):
                    self.module.allow_shared(tc_kernel_name(g, v, fp8, inside), self.shared_bytes(v))

    def kernel(self, group: int, variant: tuple[int, int], rope: bool = False) -> str:
        return tc_kernel_name(group, variant, self.fp8, rope)

    def rope_params(self, rope: DecodeRope, q: torch.Tensor, k_cache: torch.Tensor) -> tuple[Any, ...] | None:
        """The `rope` argument of a call for this step's q over k_cache with the rotary kernel's work inside (its
        `_rope` kernels' extra arguments), or None where they cannot take it."""
        if not (self.rope and self.applies(q, k_cache)):
            return None
        return rope_args(rope, q)

    def shared_bytes(self, variant: tuple[int, int]) -> int:
        """The ring (4 warps, K and V, 16 rows of 128 or 256 bytes a stage), or the join's floats if larger."""
        return max(variant[0] * 4 * 2 * 16 * (128 if self.fp8 else 256), _JOIN_BYTES)

    def variant(self, batch_size: int) -> tuple[int, int]:
        """The engine's choice: the first of `variants` from TC_FEW_ROWS + 1 to TC_SMALL_BATCH rows, else the last."""
        return self.variants[0] if TC_FEW_ROWS < batch_size <= TC_SMALL_BATCH else self.variants[-1]
