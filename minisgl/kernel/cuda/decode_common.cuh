// What decode.cu and decode_tc.cu share, put before each of them by minisgl/kernel/cuda/decode.py: the types,
// bf16 conversions, and the write of one output dim once a program's states are joined.
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
