// FP8 paged decode attention on the tensor cores (mma.sync m16n8k16, f16 in, f32 out), head dim 128, G <= 8
// query heads a KV head: decode.cu's work on an FP8 pool (the same arguments, grid and split outputs) on the
// tensor cores. minisgl/kernel/cuda/decode.py's TensorCoreDecode launches it; benchmark/offline/decode_tc.py
// times it against decode.cu's kernel and Triton's.
//
// A program is one (KV head, request, split), 4 warps; a warp takes tiles of 16 keys (tile w, w + 4, ...).
// Per tile, S = K Q^T by 8 mma (keys the M rows, queries the N columns: G of the 8 used, the rest zero), then
// O^T += V^T P^T by 8 mma (dims the M rows, keys the K dim). The dims inside each product are a permutation
// of the real ones, chosen so that every thread's bytes of a K or V row are contiguous (one or two 16-byte
// loads): in S = K Q^T, a thread with t = lane % 4 holds dims 32t .. 32t + 31 of its two key rows; in
// O^T = V^T P^T, a thread with g = lane / 4 holds dims 16g .. 16g + 15 of its four key rows. The permutation
// of a sum's terms changes nothing; the output dims are written back in place.
// e4m3 pairs widen to f16 pairs in one instruction; P goes from the S fragment's layout to the B operand's by
// four shuffles. Rows are loaded a tile ahead, their slots two tiles ahead.
typedef unsigned short bf16_t;
typedef unsigned int u32;
#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif

__device__ __forceinline__ u32 e4m3x2_to_f16x2(u32 two) {
    u32 r;
    unsigned short s = two & 0xffff;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(r) : "h"(s));
    return r;
}

__device__ __forceinline__ u32 f32x2_to_f16x2(float lo, float hi) {
    u32 r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

__device__ __forceinline__ u32 prmt(u32 a, u32 b, u32 sel) {
    u32 r;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(sel));
    return r;
}

__device__ __forceinline__ void mma16816(float* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ float bf16_to_f32(u32 bits) { return __uint_as_float(bits << 16); }

__device__ __forceinline__ bf16_t f32_to_bf16(float x) {
    unsigned short r;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(x));
    return r;
}

// one tile's rows for one thread: its 32 bytes of key rows g and g + 8 (for S), its 16 bytes of key rows
// 2t, 2t + 1, 2t + 8, 2t + 9 (for O)
struct Tile {
    uint4 ka[2], kb[2], v[4];
};

struct Slots {
    long long ka, kb, v[4];
};

__device__ __forceinline__ Slots tile_slots(const int* table, int kb0, int end, int g, int t) {
    Slots s;
    const int keys[6] = {kb0 + g, kb0 + g + 8, kb0 + 2 * t, kb0 + 2 * t + 1, kb0 + 2 * t + 8, kb0 + 2 * t + 9};
    long long v[6];
#pragma unroll
    for (int i = 0; i < 6; ++i) v[i] = keys[i] < end ? table[keys[i]] : 0;
    s.ka = v[0];
    s.kb = v[1];
#pragma unroll
    for (int i = 0; i < 4; ++i) s.v[i] = v[2 + i];
    return s;
}

// SPREAD: a thread's 32 bytes of a key row are bytes 16t .. 16t + 15 and 64 + 16t .. 64 + 16t + 15, so that each
// 16-byte load of the warp takes whole 32-byte sectors (4 lanes, 64 contiguous bytes a row); otherwise bytes
// 32t .. 32t + 31, where each load takes half of every sector it touches and the next load the other half
template <bool SPREAD>
__device__ __forceinline__ int k_byte(int t, int j) {  // the first of the 4 bytes (dims) of chunk j of thread t
    return SPREAD ? (j < 4 ? 16 * t + 4 * j : 64 + 16 * t + 4 * (j - 4)) : 32 * t + 4 * j;
}

template <bool SPREAD>
__device__ __forceinline__ Tile load_tile(const char* K, const char* V, const Slots& s, long long stride_kt,
                                          long long kcol, long long vcol) {
    Tile r;
    constexpr int second = SPREAD ? 4 : 1;  // the second 16-byte word, in words after the first
    const uint4* pa = reinterpret_cast<const uint4*>(K + s.ka * stride_kt + kcol);
    const uint4* pb = reinterpret_cast<const uint4*>(K + s.kb * stride_kt + kcol);
    r.ka[0] = __ldg(pa);
    r.ka[1] = __ldg(pa + second);
    r.kb[0] = __ldg(pb);
    r.kb[1] = __ldg(pb + second);
#pragma unroll
    for (int i = 0; i < 4; ++i) r.v[i] = __ldg(reinterpret_cast<const uint4*>(V + s.v[i] * stride_kt + vcol));
    return r;
}

__device__ __forceinline__ u32 word(const uint4* w, int i) {  // 32-bit word i of two 16-byte words
    const u32* p = reinterpret_cast<const u32*>(w);
    return p[i];
}

__device__ __forceinline__ u32 word1(const uint4& w, int i) {
    const u32* p = reinterpret_cast<const u32*>(&w);
    return p[i];
}

template <int G, bool SPREAD>
__device__ __forceinline__ void decode_tc_body(
    const bf16_t* __restrict__ Q, const char* __restrict__ K, const char* __restrict__ V, bf16_t* __restrict__ Out,
    float* __restrict__ MidO, float* __restrict__ MidLse, const int* __restrict__ PageTable,
    const int* __restrict__ Rows, const int* __restrict__ SeqLens, const int* __restrict__ Order,
    const float* __restrict__ KScale, const float* __restrict__ VScale, long long stride_qt, long long stride_qh,
    long long stride_kt, long long stride_kh, long long stride_pt, long long stride_ot, long long stride_oh,
    int num_qo_heads, int num_splits, float qk_scale) {
    constexpr int D = 128, WARPS = 4, TILE = 16;
    const int kvh = blockIdx.x;
    const int b = Order != nullptr ? Order[blockIdx.y] : blockIdx.y;
    const int s = blockIdx.z;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const long long row = Rows[b];
    const int seq_len = SeqLens[b];
    const int chunk = ((seq_len + num_splits - 1) / num_splits + WARPS * TILE - 1) / (WARPS * TILE) * (WARPS * TILE);
    const int start = s * chunk;
    const int end = min(start + chunk, seq_len);
    const float vscale = VScale[0];
    const float scale = qk_scale * KScale[0];

    // Q as the B operand of S = K Q^T: query g's dims k_byte(t, j) .. + 3 for chunk j (zero for g >= G)
    u32 qf[8][2];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        float x[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        if (g < G) {
            const uint2 w = __ldg(reinterpret_cast<const uint2*>(Q + b * stride_qt + (kvh * G + g) * stride_qh + k_byte<SPREAD>(t, j)));
            x[0] = bf16_to_f32(w.x & 0xffff) * scale;
            x[1] = bf16_to_f32(w.x >> 16) * scale;
            x[2] = bf16_to_f32(w.y & 0xffff) * scale;
            x[3] = bf16_to_f32(w.y >> 16) * scale;
        }
        qf[j][0] = f32x2_to_f16x2(x[0], x[1]);
        qf[j][1] = f32x2_to_f16x2(x[2], x[3]);
    }
    // the softmax state of queries 2t and 2t + 1 (the same columns in S's fragment and O's)
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
    float acc[8][4];
#pragma unroll
    for (int i = 0; i < 8; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[i][e] = 0.0f;

    const int* table = PageTable + row * stride_pt;
    const long long kcol = kvh * stride_kh + k_byte<SPREAD>(t, 0), vcol = kvh * stride_kh + 16 * g;
    int kb0 = start + warp * TILE;
    const int stride = WARPS * TILE;
    Slots slots_next = tile_slots(table, kb0 + stride, end, g, t);
    Tile next = load_tile<SPREAD>(K, V, tile_slots(table, kb0, end, g, t), stride_kt, kcol, vcol);
    for (; kb0 < end; kb0 += stride) {
        const Tile cur = next;
        if (kb0 + stride < end) {  // the same for the whole warp
            next = load_tile<SPREAD>(K, V, slots_next, stride_kt, kcol, vcol);
            slots_next = tile_slots(table, kb0 + 2 * stride, end, g, t);
        }
        // S = K Q^T: rows keys kb0 + g and kb0 + g + 8, columns queries 2t, 2t + 1
        float sc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const u32 wa = word(cur.ka, j), wb = word(cur.kb, j);  // bytes 4j .. 4j + 3 of each row's slice
            mma16816(sc, e4m3x2_to_f16x2(wa), e4m3x2_to_f16x2(wb), e4m3x2_to_f16x2(wa >> 16),
                     e4m3x2_to_f16x2(wb >> 16), qf[j][0], qf[j][1]);
        }
        if (kb0 + g >= end) sc[0] = sc[1] = -INFINITY;
        if (kb0 + g + 8 >= end) sc[2] = sc[3] = -INFINITY;
        // online softmax per column: the tile's max over the 16 keys (8 lanes of the same t, two rows each)
        float mx[2] = {fmaxf(sc[0], sc[2]), fmaxf(sc[1], sc[3])};
#pragma unroll
        for (int o = 4; o < 32; o *= 2) {
            mx[0] = fmaxf(mx[0], __shfl_xor_sync(0xffffffffu, mx[0], o));
            mx[1] = fmaxf(mx[1], __shfl_xor_sync(0xffffffffu, mx[1], o));
        }
        float alpha[2];
#pragma unroll
        for (int c = 0; c < 2; ++c) {
            const float mn = fmaxf(m[c], mx[c]);
            const float ref = mn == -INFINITY ? 0.0f : mn;  // no key yet: weights stay 0
            alpha[c] = exp2f(m[c] - ref);
            m[c] = mn;
            sc[c] = exp2f(sc[c] - ref);
            sc[c + 2] = exp2f(sc[c + 2] - ref);
            l[c] = l[c] * alpha[c] + sc[c] + sc[c + 2];  // this thread's rows only: summed over lanes at the end
        }
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            acc[i][0] *= alpha[0];
            acc[i][1] *= alpha[1];
            acc[i][2] *= alpha[0];
            acc[i][3] *= alpha[1];
        }
        // P^T as the B operand of O^T = V^T P^T: column (query) g, rows (keys) 2t, 2t + 1 and 2t + 8, 2t + 9;
        // P[q][key r] sits in lane 4r + q / 2 (r < 8: sc[0..1], else sc[2..3]), element q % 2
        const u32 p01 = f32x2_to_f16x2(sc[0], sc[1]), p23 = f32x2_to_f16x2(sc[2], sc[3]);
        const int src0 = 8 * t + g / 2, src1 = 8 * t + 4 + g / 2;
        const u32 sel = (g & 1) ? 0x7632u : 0x5410u;
        const u32 pb0 = prmt(__shfl_sync(0xffffffffu, p01, src0), __shfl_sync(0xffffffffu, p01, src1), sel);
        const u32 pb1 = prmt(__shfl_sync(0xffffffffu, p23, src0), __shfl_sync(0xffffffffu, p23, src1), sel);
        // V^T as the A operand: rows dims (row g of chunk i is dim 16g + 2i, row g + 8 dim 16g + 2i + 1), columns
        // keys 2t, 2t + 1 (v[0], v[1]) and 2t + 8, 2t + 9 (v[2], v[3])
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const int w = i / 2;
            const u32 selv = (i % 2) ? 0x7362u : 0x5140u;  // bytes 2i, 2i + 1 of two rows, interleaved
            const u32 x01 = prmt(word1(cur.v[0], w), word1(cur.v[1], w), selv);
            const u32 x23 = prmt(word1(cur.v[2], w), word1(cur.v[3], w), selv);
            mma16816(acc[i], e4m3x2_to_f16x2(x01), e4m3x2_to_f16x2(x01 >> 16), e4m3x2_to_f16x2(x23),
                     e4m3x2_to_f16x2(x23 >> 16), pb0, pb1);
        }
    }
#pragma unroll
    for (int c = 0; c < 2; ++c)
#pragma unroll
        for (int o = 4; o < 32; o *= 2) l[c] += __shfl_xor_sync(0xffffffffu, l[c], o);

    // the warps' states joined: query 2t + c's max and sum, and its output dims
    __shared__ float sm_m[WARPS][8], sm_l[WARPS][8];
    __shared__ float sm_acc[WARPS][8][D];
    if (g == 0) {
#pragma unroll
        for (int c = 0; c < 2; ++c) {
            sm_m[warp][2 * t + c] = m[c];
            sm_l[warp][2 * t + c] = l[c];
        }
    }
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        sm_acc[warp][2 * t][16 * g + 2 * i] = acc[i][0];
        sm_acc[warp][2 * t + 1][16 * g + 2 * i] = acc[i][1];
        sm_acc[warp][2 * t][16 * g + 2 * i + 1] = acc[i][2];
        sm_acc[warp][2 * t + 1][16 * g + 2 * i + 1] = acc[i][3];
    }
    __syncthreads();
    const int d = threadIdx.x;  // 128 threads: one output dim each
#pragma unroll
    for (int h = 0; h < G; ++h) {
        float mx = -INFINITY;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) mx = fmaxf(mx, sm_m[w][h]);
        const float ref = mx == -INFINITY ? 0.0f : mx;
        float sum = 0.0f, o = 0.0f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) {
            const float wt = exp2f(sm_m[w][h] - ref);
            sum += sm_l[w][h] * wt;
            o += sm_acc[w][h][d] * wt;
        }
        const int head = kvh * G + h;
        const float out = (sum > 0.0f ? o / sum : 0.0f) * vscale;
        if (num_splits == 1) {
            Out[b * stride_ot + head * stride_oh + d] = f32_to_bf16(out);
        } else {
            const long long at = ((long long)b * num_qo_heads + head) * num_splits + s;
            MidO[at * D + d] = out;
            if (d == 0) MidLse[at] = sum > 0.0f ? mx + log2f(sum) : -INFINITY;
        }
    }
}

// minisgl/kernel/cuda/decode.py instantiates it: G query heads a KV head, SPREAD (load_tile), and MIN_BLOCKS
// programs an SM that ptxas must fit in the registers (1: as many registers as it likes)
#define DECODE_TC_KERNEL(NAME, G, SPREAD, MIN_BLOCKS)                                                          \
    extern "C" __global__ void __launch_bounds__(128, MIN_BLOCKS) NAME(                                        \
        const bf16_t* Q, const char* K, const char* V, bf16_t* Out, float* MidO, float* MidLse,                \
        const int* PageTable, const int* Rows, const int* SeqLens, const int* Order, const float* KScale,      \
        const float* VScale, long long stride_qt, long long stride_qh, long long stride_kt, long long stride_kh, \
        long long stride_pt, long long stride_ot, long long stride_oh, int num_qo_heads, int num_splits,       \
        float qk_scale) {                                                                                      \
        decode_tc_body<G, SPREAD>(Q, K, V, Out, MidO, MidLse, PageTable, Rows, SeqLens, Order, KScale, VScale,  \
                                  stride_qt, stride_qh, stride_kt, stride_kh, stride_pt, stride_ot, stride_oh,  \
                                  num_qo_heads, num_splits, qk_scale);                                         \
    }
