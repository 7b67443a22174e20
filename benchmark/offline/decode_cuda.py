"""Decode attention in CUDA C++ on the CUDA cores, compiled at run time by NVRTC: the FP8 pool's rows loaded
straight into registers and widened there, no shared-memory layout change, against the engine's Triton kernel.

    python benchmark/offline/decode_cuda.py [--batches 64,128,256] [--json out.json]
    python benchmark/offline/decode_cuda.py --compile-only [--arch sm_90]   # any machine with libnvrtc

Why (docs/benchmarks.md, "Decode attention's reads"): the Triton FP8 kernel takes what a bare gather of its rows
takes, 2.7-2.9 TB/s, because Triton pipelines through shared memory only tiles that feed the dot as loaded, and
the P x V product wants V's keys side by side, a layout change byte by byte. On the CUDA cores neither is needed:
each group of 8 threads takes one key at a time, each thread 16 of its 128 dims, so a thread's 16 bytes of K
and of V are one vector load each, and the thread multiplies them into its own 16 dims of the output. The
scores are summed over the 8 threads by shuffles. Loads run a step ahead in registers, the page table's slots
two steps ahead, so that no load in the loop waits on another. What it costs: the scores' and the output's
multiply-adds on the CUDA cores (2 x 128 a key and query head), against the tensor cores' padded tiles.

The CUDA source is compiled by NVRTC (libnvrtc, which torch's CUDA wheels carry) to a cubin for the device's
architecture and launched through the driver API (`cuLaunchKernel` on torch's current stream, so that a CUDA
graph captures it). Splits along the sequence reuse the engine's Triton merge kernel. Head dim 128, query heads
a KV head 1, 2 or 4. Written on a machine without a GPU: `--compile-only` checks that NVRTC and ptxas take it
(registers, spills); it has not yet run on a GPU.
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import json
import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

GROUPS = (1, 2, 4)  # query heads a KV head
# (keys a thread group loads per step, threads a key): 8 threads take 16 dims each (FP8: one 16-byte load a row),
# 4 take 32 (two loads a row, one shuffle fewer a score)
VARIANTS = ((2, 8), (4, 8), (2, 4))

CUDA_SRC = r"""
typedef unsigned short bf16_t;
typedef unsigned int u32;
#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif

__device__ __forceinline__ float bf16_to_f32(u32 bits) { return __uint_as_float(bits << 16); }

__device__ __forceinline__ bf16_t f32_to_bf16(float x) {
    unsigned short r;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(x));
    return r;
}

// two e4m3 bytes (element 0 in the low byte) to two floats, through one f16x2 conversion
__device__ __forceinline__ void e4m3x2_to_f32(unsigned short two, float& a, float& b) {
    u32 h2;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h2) : "h"(two));
    unsigned short lo = h2 & 0xffff, hi = h2 >> 16;
    asm("cvt.f32.f16 %0, %1;" : "=f"(a) : "h"(lo));
    asm("cvt.f32.f16 %0, %1;" : "=f"(b) : "h"(hi));
}

// one thread's N elements of a row (N = 16 or 32): N bytes of e4m3, or 2N bytes of bf16, in 16-byte words
template <bool FP8, int N> struct Row { uint4 w[N * (FP8 ? 1 : 2) / 16]; };

template <bool FP8, int N>
__device__ __forceinline__ Row<FP8, N> load_row(const char* p) {
    Row<FP8, N> r;
#pragma unroll
    for (int i = 0; i < N * (FP8 ? 1 : 2) / 16; ++i) r.w[i] = __ldg(reinterpret_cast<const uint4*>(p) + i);
    return r;
}

template <bool FP8, int N>
__device__ __forceinline__ void widen(const Row<FP8, N>& r, float* f) {
    const u32* w = reinterpret_cast<const u32*>(&r.w[0]);
    if (FP8) {
#pragma unroll
        for (int i = 0; i < N / 4; ++i) {
            e4m3x2_to_f32(w[i] & 0xffff, f[4 * i], f[4 * i + 1]);
            e4m3x2_to_f32(w[i] >> 16, f[4 * i + 2], f[4 * i + 3]);
        }
    } else {
#pragma unroll
        for (int i = 0; i < N / 2; ++i) {
            f[2 * i] = bf16_to_f32(w[i] & 0xffff);
            f[2 * i + 1] = bf16_to_f32(w[i] >> 16);
        }
    }
}

// grid (KV heads, requests, splits), 128 threads: groups of LANES threads (8 or 4), a group one key at a time, a
// thread 128 / LANES dims.
// Scores are kept in base 2: q is multiplied by sm_scale * log2(e) (and the FP8 pool's K scale) once.
template <int G, int U, int LANES, bool FP8>
__device__ __forceinline__ void decode_body(
    const bf16_t* __restrict__ Q, const char* __restrict__ K, const char* __restrict__ V, bf16_t* __restrict__ Out,
    float* __restrict__ MidO, float* __restrict__ MidLse, const int* __restrict__ PageTable,
    const int* __restrict__ Rows, const int* __restrict__ SeqLens, const int* __restrict__ Order,
    const float* __restrict__ KScale, const float* __restrict__ VScale, long long stride_qt, long long stride_qh,
    long long stride_kt, long long stride_kh, long long stride_pt, long long stride_ot, long long stride_oh,
    int num_qo_heads, int num_splits, float qk_scale) {
    constexpr int D = 128, DPT = D / LANES, GROUPS = 128 / LANES, STEP = GROUPS * U, ES = FP8 ? 1 : 2;
    const int kvh = blockIdx.x;
    const int b = Order != nullptr ? Order[blockIdx.y] : blockIdx.y;
    const int s = blockIdx.z;
    const int t = threadIdx.x, grp = t / LANES, sub = t % LANES;
    const long long row = Rows[b];
    const int seq_len = SeqLens[b];
    const int chunk = ((seq_len + num_splits - 1) / num_splits + STEP - 1) / STEP * STEP;
    const int start = s * chunk;
    const int end = min(start + chunk, seq_len);
    const float vscale = FP8 ? VScale[0] : 1.0f;
    const float scale = qk_scale * (FP8 ? KScale[0] : 1.0f);

    float q[G][DPT];
#pragma unroll
    for (int h = 0; h < G; ++h) {
        const bf16_t* qp = Q + b * stride_qt + (kvh * G + h) * stride_qh + sub * DPT;
        widen<false, DPT>(load_row<false, DPT>(reinterpret_cast<const char*>(qp)), q[h]);
#pragma unroll
        for (int d = 0; d < DPT; ++d) q[h][d] *= scale;
    }
    float m[G], l[G], acc[G][DPT];
#pragma unroll
    for (int h = 0; h < G; ++h) {
        m[h] = -INFINITY;
        l[h] = 0.0f;
#pragma unroll
        for (int d = 0; d < DPT; ++d) acc[h][d] = 0.0f;
    }

    const int* table = PageTable + row * stride_pt;
    const long long col = ((long long)kvh * stride_kh + sub * DPT) * ES;  // this thread's bytes in a row
    // rows of step i are asked for during step i - 1, their slots during step i - 2
    int slot_next[U];
    Row<FP8, DPT> k_next[U], v_next[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
        const int pos = start + grp * U + u;
        const long long slot = pos < end ? table[pos] : 0;
        k_next[u] = load_row<FP8, DPT>(K + slot * stride_kt * ES + col);
        v_next[u] = load_row<FP8, DPT>(V + slot * stride_kt * ES + col);
        const int ahead = pos + STEP;
        slot_next[u] = ahead < end ? table[ahead] : 0;
    }
    for (int base = start; base < end; base += STEP) {
        Row<FP8, DPT> kc[U], vc[U];
        const bool more = base + STEP < end;  // the same for the whole block: no divergence
#pragma unroll
        for (int u = 0; u < U; ++u) {
            kc[u] = k_next[u];
            vc[u] = v_next[u];
            if (more) {
                const long long slot = slot_next[u];
                k_next[u] = load_row<FP8, DPT>(K + slot * stride_kt * ES + col);
                v_next[u] = load_row<FP8, DPT>(V + slot * stride_kt * ES + col);
                const int ahead = base + 2 * STEP + grp * U + u;
                slot_next[u] = ahead < end ? table[ahead] : 0;
            }
        }
        float sc[U][G];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            float kf[DPT];
            widen<FP8, DPT>(kc[u], kf);
#pragma unroll
            for (int h = 0; h < G; ++h) {
                float a = 0.0f;
#pragma unroll
                for (int d = 0; d < DPT; ++d) a = fmaf(q[h][d], kf[d], a);
#pragma unroll
                for (int o = LANES / 2; o > 0; o /= 2) a += __shfl_xor_sync(0xffffffffu, a, o);
                sc[u][h] = base + grp * U + u < end ? a : -INFINITY;
            }
        }
#pragma unroll
        for (int h = 0; h < G; ++h) {
            float mx = m[h];
#pragma unroll
            for (int u = 0; u < U; ++u) mx = fmaxf(mx, sc[u][h]);
            const float ref = mx == -INFINITY ? 0.0f : mx;  // a group with no key yet keeps weight 0
            const float alpha = exp2f(m[h] - ref);
            l[h] *= alpha;
#pragma unroll
            for (int d = 0; d < DPT; ++d) acc[h][d] *= alpha;
            m[h] = mx;
#pragma unroll
            for (int u = 0; u < U; ++u) sc[u][h] = exp2f(sc[u][h] - ref);
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            float vf[DPT];
            widen<FP8, DPT>(vc[u], vf);
#pragma unroll
            for (int h = 0; h < G; ++h) {
                l[h] += sc[u][h];
#pragma unroll
                for (int d = 0; d < DPT; ++d) acc[h][d] = fmaf(sc[u][h], vf[d], acc[h][d]);
            }
        }
    }

    // the groups' (max, sum, output) joined, one query head at a time; thread t then owns dim t
    __shared__ float sm_m[GROUPS], sm_l[GROUPS];
    __shared__ float sm_acc[GROUPS][D];
#pragma unroll
    for (int h = 0; h < G; ++h) {
        if (sub == 0) {
            sm_m[grp] = m[h];
            sm_l[grp] = l[h];
        }
#pragma unroll
        for (int d = 0; d < DPT; ++d) sm_acc[grp][sub * DPT + d] = acc[h][d];
        __syncthreads();
        float mx = -INFINITY;
#pragma unroll
        for (int g = 0; g < GROUPS; ++g) mx = fmaxf(mx, sm_m[g]);
        const float ref = mx == -INFINITY ? 0.0f : mx;
        float sum = 0.0f, o = 0.0f;
#pragma unroll
        for (int g = 0; g < GROUPS; ++g) {
            const float w = exp2f(sm_m[g] - ref);
            sum += sm_l[g] * w;
            o += sm_acc[g][t] * w;
        }
        const int head = kvh * G + h;
        const float out = (sum > 0.0f ? o / sum : 0.0f) * vscale;
        if (num_splits == 1) {
            Out[b * stride_ot + head * stride_oh + t] = f32_to_bf16(out);
        } else {
            const long long at = ((long long)b * num_qo_heads + head) * num_splits + s;
            MidO[at * D + t] = out;
            if (t == 0) MidLse[at] = sum > 0.0f ? mx + log2f(sum) : -INFINITY;
        }
        __syncthreads();
    }
}

#define DECODE_KERNEL(NAME, G, U, LANES, FP8)                                                                          \
    extern "C" __global__ void __launch_bounds__(128) NAME(                                                    \
        const bf16_t* Q, const char* K, const char* V, bf16_t* Out, float* MidO, float* MidLse,                \
        const int* PageTable, const int* Rows, const int* SeqLens, const int* Order, const float* KScale,      \
        const float* VScale, long long stride_qt, long long stride_qh, long long stride_kt, long long stride_kh, \
        long long stride_pt, long long stride_ot, long long stride_oh, int num_qo_heads, int num_splits,       \
        float qk_scale) {                                                                                      \
        decode_body<G, U, LANES, FP8>(Q, K, V, Out, MidO, MidLse, PageTable, Rows, SeqLens, Order, KScale, VScale,    \
                               stride_qt, stride_qh, stride_kt, stride_kh, stride_pt, stride_ot, stride_oh,    \
                               num_qo_heads, num_splits, qk_scale);                                            \
    }
"""


def kernel_name(group: int, variant: tuple[int, int], fp8: bool) -> str:
    unroll, lanes = variant
    return f"decode_{'fp8' if fp8 else 'bf16'}_g{group}_u{unroll}_l{lanes}"


def full_source() -> str:
    lines = [CUDA_SRC]
    for g in GROUPS:
        for variant in VARIANTS:
            for fp8 in (True, False):
                name = kernel_name(g, variant, fp8)
                lines.append(
                    f"DECODE_KERNEL({name}, {g}, {variant[0]}, {variant[1]}, {'true' if fp8 else 'false'})"
                )
    return "\n".join(lines) + "\n"


def _nvrtc() -> ctypes.CDLL:
    """libnvrtc: from the CUDA toolkit or the nvidia-cuda-nvrtc wheel torch's CUDA builds depend on."""
    names = ["libnvrtc.so", "libnvrtc.so.13", "libnvrtc.so.12"]
    roots = [os.environ.get("CUDA_HOME", "/usr/local/cuda") + "/lib64"] + sys.path
    for root in roots:
        names += sorted(glob.glob(os.path.join(root, "nvidia", "*", "lib", "libnvrtc.so*")))
        names += sorted(glob.glob(os.path.join(root, "nvidia", "cu*", "lib", "libnvrtc.so*")))
        names += sorted(glob.glob(os.path.join(root, "libnvrtc.so*")))
    for name in names:
        if "builtins" in name or "alt" in name:
            continue
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    raise SystemExit("libnvrtc not found: install the CUDA toolkit or nvidia-cuda-nvrtc")


def compile_cubin(arch: str, verbose: bool = False) -> tuple[bytes, str]:
    """The kernels as a cubin for `arch` (e.g. sm_90), and NVRTC's log (ptxas's register report with verbose)."""
    lib = _nvrtc()
    prog = ctypes.c_void_p()
    src = full_source().encode()
    if lib.nvrtcCreateProgram(ctypes.byref(prog), src, b"decode.cu", 0, None, None) != 0:
        raise RuntimeError("nvrtcCreateProgram failed")
    opts = [f"--gpu-architecture={arch}".encode(), b"--use_fast_math", b"-std=c++17", b"-default-device"]
    if verbose:
        opts.append(b"--ptxas-options=-v")
    arr = (ctypes.c_char_p * len(opts))(*opts)
    rc = lib.nvrtcCompileProgram(prog, len(opts), arr)
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, log)
    if rc != 0:
        raise RuntimeError(f"NVRTC could not compile the decode kernels:\n{log.value.decode()}")
    lib.nvrtcGetCUBINSize(prog, ctypes.byref(size))
    cubin = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetCUBIN(prog, cubin)
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return cubin.raw, log.value.decode()


class CudaModule:
    """A cubin loaded through the driver API; its kernels launched on a torch stream (so graphs capture them)."""

    def __init__(self, cubin: bytes) -> None:
        self.cuda = ctypes.CDLL("libcuda.so.1")
        self.module = ctypes.c_void_p()
        self._check(self.cuda.cuModuleLoadData(ctypes.byref(self.module), cubin), "cuModuleLoadData")
        self.functions: dict[str, ctypes.c_void_p] = {}

    def _check(self, rc: int, what: str) -> None:
        if rc != 0:
            raise RuntimeError(f"{what} failed with CUDA driver error {rc}")

    def function(self, name: str) -> ctypes.c_void_p:
        if name not in self.functions:
            fn = ctypes.c_void_p()
            self._check(self.cuda.cuModuleGetFunction(ctypes.byref(fn), self.module, name.encode()), name)
            self.functions[name] = fn
        return self.functions[name]

    def launch(self, name: str, grid: tuple[int, int, int], block: int, args: list[Any], stream: int) -> None:
        holders = [a if isinstance(a, ctypes._SimpleCData) else ctypes.c_void_p(a) for a in args]
        # cuLaunchKernel takes an array of pointers to each argument's value
        params = (ctypes.c_void_p * len(holders))(*[ctypes.addressof(h) for h in holders])
        rc = self.cuda.cuLaunchKernel(
            self.function(name), *grid, block, 1, 1, 0, ctypes.c_void_p(stream), params, None
        )
        self._check(rc, f"cuLaunchKernel({name})")


def decode_cuda(
    mod: CudaModule,
    q: Any,
    k_cache: Any,
    v_cache: Any,
    page_table: Any,
    rows: Any,
    seq_lens: Any,
    num_splits: int,
    sm_scale: float,
    k_scale: Any = None,
    v_scale: Any = None,
    order: Any = None,
    variant: tuple[int, int] = VARIANTS[0],
) -> Any:
    """`minisgl.kernel.attention.decode_attention`'s work (no rotary inside) by the CUDA kernel, splits merged by
    the engine's Triton merge kernel."""
    import torch

    from minisgl.kernel import attention as attn

    bs, hq, d = q.shape
    hk = k_cache.shape[1]
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    out = torch.empty((bs, hq, d), dtype=q.dtype, device=q.device)
    mid_o = mid_lse = out  # one split writes the output itself
    if num_splits > 1:
        mid_o = torch.empty((bs, hq, num_splits, d), dtype=torch.float32, device=q.device)
        mid_lse = torch.empty((bs, hq, num_splits), dtype=torch.float32, device=q.device)
    args = [
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(), mid_o.data_ptr(), mid_lse.data_ptr(),
        page_table.data_ptr(), rows.data_ptr(), seq_lens.data_ptr(), order.data_ptr() if order is not None else 0,
        k_scale.data_ptr() if fp8 else 0, v_scale.data_ptr() if fp8 else 0,
        ctypes.c_int64(q.stride(0)), ctypes.c_int64(q.stride(1)), ctypes.c_int64(k_cache.stride(0)),
        ctypes.c_int64(k_cache.stride(1)), ctypes.c_int64(page_table.stride(0)), ctypes.c_int64(out.stride(0)),
        ctypes.c_int64(out.stride(1)), ctypes.c_int32(hq), ctypes.c_int32(num_splits),
        ctypes.c_float(sm_scale * 1.4426950408889634),
    ]  # fmt: skip
    stream = torch.cuda.current_stream().cuda_stream
    mod.launch(kernel_name(hq // hk, variant, fp8), (hk, bs, num_splits), 128, args, stream)
    if num_splits > 1:
        attn._decode_merge_kernel[(bs, hq)](
            mid_o, mid_lse, out, out.stride(0), out.stride(1), num_splits, NUM_QO_HEADS=hq, D=d, BLOCK_D=d,
            BLOCK_S=max(2, 1 << (num_splits - 1).bit_length()), num_warps=4,
        )  # fmt: skip
    return out


def install(variant: tuple[int, int]) -> None:
    """Route the engine's decode attention through the CUDA kernel where it applies (a bf16 query, head dim 128,
    1, 2 or 4 query heads a KV head, no rotary inside); the Triton kernel elsewhere. For bench.py's
    --decode-cuda: compiled and loaded here, before any CUDA graph is captured."""
    import torch

    import minisgl.attention.triton_backend as backend
    from minisgl.kernel import attention as attn

    torch.zeros(1, device="cuda")  # the primary context current on this thread, for the driver calls
    major, minor = torch.cuda.get_device_capability()
    mod = CudaModule(compile_cubin(f"sm_{major}{minor}")[0])
    triton_decode = attn.decode_attention

    def routed(q, k_cache, v_cache, page_table, rows, seq_lens, num_splits, sm_scale, k_scale=None, v_scale=None,
               rope=None, order=None):  # fmt: skip  # noqa: ANN001, ANN202
        hq, d = q.shape[1], q.shape[2]
        if rope is None and d == 128 and q.dtype == torch.bfloat16 and hq // k_cache.shape[1] in GROUPS:
            return decode_cuda(mod, q, k_cache, v_cache, page_table, rows, seq_lens, num_splits, sm_scale,
                               k_scale, v_scale, order, variant)  # fmt: skip
        return triton_decode(q, k_cache, v_cache, page_table, rows, seq_lens, num_splits, sm_scale, k_scale,
                             v_scale, rope, order)  # fmt: skip

    backend.decode_attention = routed


def run_batch(mod: CudaModule, bs: int, fp8: bool, hk: int = 8, d: int = 128) -> list[dict[str, Any]]:
    from kv_layout import decode_case, graph_us

    from minisgl.kernel import attention as attn

    c = decode_case(bs, "engine", fp8)
    order = c.order()
    rows = []
    for splits in sorted({attn.decode_splits(bs, hk), 1, 2}):

        def triton(s: int = splits) -> Any:
            return attn.decode_attention(
                c.q, c.k, c.v, c.table, c.rows, c.seq, s, d**-0.5, *c.scales, None, order
            )

        ref = triton().float()
        rows.append(dict(bs=bs, fp8=fp8, kernel="triton", splits=splits, us=graph_us(triton)))
        for variant in VARIANTS:

            def cuda(v: tuple[int, int] = variant, s: int = splits) -> Any:
                return decode_cuda(
                    mod, c.q, c.k, c.v, c.table, c.rows, c.seq, s, d**-0.5, *c.scales, order, v
                )

            diff = (cuda().float() - ref).abs().max().item()
            name = f"cuda {variant[0]},{variant[1]}"
            rows.append(dict(bs=bs, fp8=fp8, kernel=name, splits=splits, us=graph_us(cuda), max_diff=diff))
    for r in rows:
        r["tb_s"] = c.kv_bytes / r["us"] / 1e6
        print(
            f"bs={bs} {'fp8 ' if fp8 else 'bf16'} {r['kernel']:>10} splits={r['splits']}: {r['us']:7.1f} us "
            f"({r['tb_s']:.2f} TB/s)"
            + (f", max diff against Triton {r['max_diff']:.2e}" if "max_diff" in r else ""),
            flush=True,
        )
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", default="64,128,256")
    p.add_argument("--json", default=None)
    p.add_argument("--compile-only", action="store_true", help="compile with NVRTC and print ptxas's report")
    p.add_argument("--arch", default=None, help="the target (default: the GPU's, e.g. sm_90)")
    args = p.parse_args()
    if args.compile_only:
        cubin, log = compile_cubin(args.arch or "sm_90", verbose=True)
        print(log)
        print(f"cubin: {len(cubin)} bytes")
        return
    import torch

    torch.zeros(1, device="cuda")  # the primary context current on this thread, for the driver calls
    major, minor = torch.cuda.get_device_capability()
    cubin, _ = compile_cubin(args.arch or f"sm_{major}{minor}")
    mod = CudaModule(cubin)
    results = []
    for bs in [int(b) for b in args.batches.split(",")]:
        for fp8 in (True, False):
            results += run_batch(mod, bs, fp8)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
