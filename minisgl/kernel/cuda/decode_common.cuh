// What decode.cu and decode_tc.cu share, put before each of them by minisgl/kernel/cuda/decode.py: the types,
// bf16 conversions, the kernels' arguments, and the write of one output dim once a program's states are joined.
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

// dim d (of 128) of query head `head`, from the program's weighted sum o, its weights' sum and their max (base 2):
// the output row itself with one split, else the split's float32 output and log-sum-exp for the merge kernel
__device__ __forceinline__ void write_dim(bf16_t* Out, float* MidO, float* MidLse, int b, int head, int s, int d,
                                          long long stride_ot, long long stride_oh, int num_qo_heads,
                                          int num_splits, float o, float sum, float mx, float vscale) {
    const float out = (sum > 0.0f ? o / sum : 0.0f) * vscale;
    if (num_splits == 1) {
        Out[b * stride_ot + head * stride_oh + d] = f32_to_bf16(out);
    } else {
        const long long at = ((long long)b * num_qo_heads + head) * num_splits + s;
        MidO[at * 128 + d] = out;
        if (d == 0) MidLse[at] = sum > 0.0f ? mx + log2f(sum) : -INFINITY;
    }
}

// A kernel's first instruction, with MINISGL_PDL_KERNELS on (decode.py defines MINISGL_PDL): where a graph edge
// into it is programmatic (engine/graph_edges.py) it may start before the kernel it reads from has finished, and
// waits here until it has and its writes are visible; on any other launch this returns at once. Before Hopper
// there is no such launch and no instruction.
__device__ __forceinline__ void wait_for_inputs() {
#if defined(MINISGL_PDL) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// every decode kernel's arguments, in the order minisgl/kernel/cuda/decode.py's launcher passes them (strides in
// elements; KScale and VScale an FP8 pool's, else null), and their names to hand them on
#define DECODE_PARAMS                                                                                               \
    const bf16_t *__restrict__ Q, const char *__restrict__ K, const char *__restrict__ V, bf16_t *__restrict__ Out, \
        float *__restrict__ MidO, float *__restrict__ MidLse, const int *__restrict__ PageTable,                    \
        const int *__restrict__ Rows, const int *__restrict__ SeqLens, const int *__restrict__ Order,              \
        const float *__restrict__ KScale, const float *__restrict__ VScale, long long stride_qt, long long stride_qh, \
        long long stride_kt, long long stride_kh, long long stride_pt, long long stride_ot, long long stride_oh,    \
        int num_qo_heads, int num_splits, float qk_scale
#define DECODE_ARGS                                                                                                  \
    Q, K, V, Out, MidO, MidLse, PageTable, Rows, SeqLens, Order, KScale, VScale, stride_qt, stride_qh, stride_kt,    \
        stride_kh, stride_pt, stride_ot, stride_oh, num_qo_heads, num_splits, qk_scale
