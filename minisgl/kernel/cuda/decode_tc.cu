// FP8 paged decode attention on the tensor cores (mma.sync m16n8k16, f16 in, f32 out), head dim 128, G <= 8
// query heads a KV head: decode.cu's work on an FP8 pool (the same arguments, grid and split outputs) on the
// tensor cores. minisgl/kernel/cuda/decode.py's TensorCoreDecode launches it; benchmark/offline/decode_tc.py
// times it against decode.cu's kernel and Triton's.
//
// A program is one (KV head, request, split), 4 warps; a warp takes tiles of 16 keys (tile w, w + 4, ...).
// Per tile, S = K Q^T by 8 mma (keys the M rows, queries the N columns: G of the 8 used, the rest zero), then
// O^T += V^T P^T by 8 mma (dims the M rows, keys the K dim). The dims inside each product are a permutation
// of the real ones, chosen so that every thread's bytes of a K or V row are contiguous (one or two 16-byte
// words): in S = K Q^T, a thread with t = lane % 4 holds dims 32t .. 32t + 31 of its two key rows; in
// O^T = V^T P^T, a thread with g = lane / 4 holds dims 16g .. 16g + 15 of its four key rows. The permutation
// of a sum's terms changes nothing; the output dims are written back in place.
// e4m3 pairs widen to f16 pairs in one instruction; P goes from the S fragment's layout to the B operand's by
// four shuffles.
//
// How the rows reach the registers: each warp copies its tiles into a ring of STAGES tiles (4 KB each) in shared
// memory with cp.async, STAGES - 1 tiles ahead, each copy instruction 4 whole rows, the slots read from the page
// table a turn before their copy; and reads its words from there. A thread's words loaded straight into
// registers a tile ahead kept a third as many bytes in flight an SM and read 12-15% slower at 128-256 requests
// (docs/benchmarks.md, "Decode attention on the tensor cores").
// decode_common.cuh comes before it (its types, bf16 conversions and the output write).

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

// one tile's words for one thread: its 32 bytes of key rows g and g + 8 (for S), its 16 bytes of key rows
// 2t, 2t + 1, 2t + 8, 2t + 9 (for O)
struct Tile {
    uint4 ka[2], kb[2], v[4];
};

__device__ __forceinline__ u32 word(const uint4* w, int i) {  // 32-bit word i of two 16-byte words
    const u32* p = reinterpret_cast<const u32*>(w);
    return p[i];
}

__device__ __forceinline__ u32 word1(const uint4& w, int i) {
    const u32* p = reinterpret_cast<const u32*>(&w);
    return p[i];
}

// the ring in shared memory: [warp][stage][K, V][key row 0..15][16-byte word 0..7], word w of row r stored at
// w ^ (r & 7), so that the words a warp reads at once (S: rows g, g + 8, words 2t, 2t + 1; O: rows 2t.., word g)
// and those it copies (a whole row a quarter warp) fall in distinct banks
__device__ __forceinline__ int ring_word(int stage, int kv, int r, int w, int stages) {
    return ((((threadIdx.x / 32) * stages + stage) * 2 + kv) * 16 + r) * 8 + (w ^ (r & 7));
}

__device__ __forceinline__ void cp_async16(uint4* dst, const void* src, int src_bytes) {
    const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(dst));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(src), "r"(src_bytes));
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// the slots of the rows lane L copies of the warp's tile at kb0: rows L / 8 + 4i, i = 0..3 (-1 past `end`)
struct Slots {
    int s[4];
};

__device__ __forceinline__ int copy_row(int i) { return threadIdx.x % 32 / 8 + 4 * i; }

__device__ __forceinline__ Slots tile_slots(const int* table, int kb0, int end) {
    Slots r;
#pragma unroll
    for (int i = 0; i < 4; ++i) r.s[i] = kb0 + copy_row(i) < end ? table[kb0 + copy_row(i)] : -1;
    return r;
}

// the warp's tile into stage `stage`, its rows at `slots`: copy i, lane L takes word L % 8 of row L / 8 + 4i, of
// K and of V, so that each instruction asks for 4 whole 128-byte rows (16 rows, 32 bytes of each, read 6-7%
// slower, and 1.8x slower when the slots lie anywhere: docs/benchmarks.md); a row past the end (slot -1) is
// zero-filled, not read
template <int STAGES>
__device__ __forceinline__ void copy_tile(uint4* ring, const char* K, const char* V, const Slots& slots,
                                          long long stride_kt, long long head_col, int stage) {
    const int w = threadIdx.x % 8;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int slot = slots.s[i], r = copy_row(i);
        const long long at = (slot >= 0 ? (long long)slot * stride_kt : 0) + head_col + 16 * w;
        cp_async16(ring + ring_word(stage, 0, r, w, STAGES), K + at, slot >= 0 ? 16 : 0);
        cp_async16(ring + ring_word(stage, 1, r, w, STAGES), V + at, slot >= 0 ? 16 : 0);
    }
}

template <int STAGES>
__device__ __forceinline__ Tile read_tile(const uint4* ring, int stage, int g, int t) {
    Tile r;
    r.ka[0] = ring[ring_word(stage, 0, g, 2 * t, STAGES)];
    r.ka[1] = ring[ring_word(stage, 0, g, 2 * t + 1, STAGES)];
    r.kb[0] = ring[ring_word(stage, 0, g + 8, 2 * t, STAGES)];
    r.kb[1] = ring[ring_word(stage, 0, g + 8, 2 * t + 1, STAGES)];
    const int rows[4] = {2 * t, 2 * t + 1, 2 * t + 8, 2 * t + 9};
#pragma unroll
    for (int i = 0; i < 4; ++i) r.v[i] = ring[ring_word(stage, 1, rows[i], g, STAGES)];
    return r;
}

// the softmax state of one warp: queries 2t and 2t + 1 (the same columns in S's fragment and O's)
struct State {
    float m[2], l[2];
    float acc[8][4];
};

// one tile of 16 keys from kb0 (keys from `end` on masked out) into the warp's state
__device__ __forceinline__ void attend_tile(State& st, const Tile& cur, const u32 (&qf)[8][2], int kb0, int end, int g,
                                            int t) {
    // S = K Q^T: rows keys kb0 + g and kb0 + g + 8, columns queries 2t, 2t + 1; two sums of four products each,
    // so that the mma chain is half as long
    float sc[4] = {0.0f, 0.0f, 0.0f, 0.0f}, sd[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        const u32 wa = word(cur.ka, j), wb = word(cur.kb, j);  // bytes 4j .. 4j + 3 of each row's slice
        mma16816(j % 2 ? sd : sc, e4m3x2_to_f16x2(wa), e4m3x2_to_f16x2(wb), e4m3x2_to_f16x2(wa >> 16),
                 e4m3x2_to_f16x2(wb >> 16), qf[j][0], qf[j][1]);
    }
#pragma unroll
    for (int e = 0; e < 4; ++e) sc[e] += sd[e];
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
        const float mn = fmaxf(st.m[c], mx[c]);
        const float ref = mn == -INFINITY ? 0.0f : mn;  // no key yet: weights stay 0
        alpha[c] = exp2f(st.m[c] - ref);
        st.m[c] = mn;
        sc[c] = exp2f(sc[c] - ref);
        sc[c + 2] = exp2f(sc[c + 2] - ref);
        st.l[c] = st.l[c] * alpha[c] + sc[c] + sc[c + 2];  // this thread's rows only: summed over lanes at the end
    }
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        st.acc[i][0] *= alpha[0];
        st.acc[i][1] *= alpha[1];
        st.acc[i][2] *= alpha[0];
        st.acc[i][3] *= alpha[1];
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
        mma16816(st.acc[i], e4m3x2_to_f16x2(x01), e4m3x2_to_f16x2(x01 >> 16), e4m3x2_to_f16x2(x23),
                 e4m3x2_to_f16x2(x23 >> 16), pb0, pb1);
    }
}

// the joined warps' float state in shared memory: [warp][1056] floats, element (query h, dim d) at
// (d % 16) * 66 + (4 (h % 2) + h / 2) * 8 + d / 16, so that a warp's stores (lanes over t and g) and the reads
// (threads over d) each fall in 32 distinct banks; then the maxima and sums, [warp][8] each
constexpr int JOIN_WARP = 1056;

__device__ __forceinline__ int join_at(int h, int d) { return (d % 16) * 66 + (4 * (h % 2) + h / 2) * 8 + d / 16; }

// the 4 warps' states joined (through `smem`, 4 * (JOIN_WARP + 16) floats, free for it) and written: the output
// row with one split, else the split's float32 output and base-2 log-sum-exp
template <int G>
__device__ __forceinline__ void join_and_write(State& st, float* smem, bf16_t* Out, float* MidO, float* MidLse, int b,
                                               int kvh, int s, long long stride_ot, long long stride_oh,
                                               int num_qo_heads, int num_splits, float vscale, int g, int t) {
    constexpr int WARPS = 4;
    const int warp = threadIdx.x / 32;
#pragma unroll
    for (int c = 0; c < 2; ++c)
#pragma unroll
        for (int o = 4; o < 32; o *= 2) st.l[c] += __shfl_xor_sync(0xffffffffu, st.l[c], o);
    float* sm_acc = smem;
    float* sm_m = smem + WARPS * JOIN_WARP;
    float* sm_l = sm_m + WARPS * 8;
    if (g == 0) {
#pragma unroll
        for (int c = 0; c < 2; ++c) {
            sm_m[warp * 8 + 2 * t + c] = st.m[c];
            sm_l[warp * 8 + 2 * t + c] = st.l[c];
        }
    }
    float* mine = sm_acc + warp * JOIN_WARP;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        mine[join_at(2 * t, 16 * g + 2 * i)] = st.acc[i][0];
        mine[join_at(2 * t + 1, 16 * g + 2 * i)] = st.acc[i][1];
        mine[join_at(2 * t, 16 * g + 2 * i + 1)] = st.acc[i][2];
        mine[join_at(2 * t + 1, 16 * g + 2 * i + 1)] = st.acc[i][3];
    }
    __syncthreads();
    const int d = threadIdx.x;  // 128 threads: one output dim each
#pragma unroll
    for (int h = 0; h < G; ++h) {
        float mx = -INFINITY;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) mx = fmaxf(mx, sm_m[w * 8 + h]);
        const float ref = mx == -INFINITY ? 0.0f : mx;
        float sum = 0.0f, o = 0.0f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) {
            const float wt = exp2f(sm_m[w * 8 + h] - ref);
            sum += sm_l[w * 8 + h] * wt;
            o += sm_acc[w * JOIN_WARP + join_at(h, d)] * wt;
        }
        write_dim(Out, MidO, MidLse, b, kvh * G + h, s, d, stride_ot, stride_oh, num_qo_heads, num_splits, o, sum,
                  mx, vscale);
    }
}

// the shared memory a program takes: the ring, or the join's floats if larger
__host__ __device__ constexpr int shared_bytes(int stages) {
    return stages * 4 * 4096 > 4 * (JOIN_WARP + 16) * 4 ? stages * 4 * 4096 : 4 * (JOIN_WARP + 16) * 4;
}

template <int G, int STAGES>
__device__ __forceinline__ void decode_tc_body(
    const bf16_t* __restrict__ Q, const char* __restrict__ K, const char* __restrict__ V, bf16_t* __restrict__ Out,
    float* __restrict__ MidO, float* __restrict__ MidLse, const int* __restrict__ PageTable,
    const int* __restrict__ Rows, const int* __restrict__ SeqLens, const int* __restrict__ Order,
    const float* __restrict__ KScale, const float* __restrict__ VScale, long long stride_qt, long long stride_qh,
    long long stride_kt, long long stride_kh, long long stride_pt, long long stride_ot, long long stride_oh,
    int num_qo_heads, int num_splits, float qk_scale) {
    constexpr int WARPS = 4, TILE = 16;
    extern __shared__ uint4 smem[];
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

    // Q as the B operand of S = K Q^T: query g's dims 32t + 4j .. 32t + 4j + 3 for chunk j (zero for g >= G)
    u32 qf[8][2];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        float x[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        if (g < G) {
            const uint2 w = __ldg(reinterpret_cast<const uint2*>(Q + b * stride_qt + (kvh * G + g) * stride_qh + 32 * t + 4 * j));
            x[0] = bf16_to_f32(w.x & 0xffff) * scale;
            x[1] = bf16_to_f32(w.x >> 16) * scale;
            x[2] = bf16_to_f32(w.y & 0xffff) * scale;
            x[3] = bf16_to_f32(w.y >> 16) * scale;
        }
        qf[j][0] = f32x2_to_f16x2(x[0], x[1]);
        qf[j][1] = f32x2_to_f16x2(x[2], x[3]);
    }
    State st;
#pragma unroll
    for (int c = 0; c < 2; ++c) {
        st.m[c] = -INFINITY;
        st.l[c] = 0.0f;
    }
#pragma unroll
    for (int i = 0; i < 8; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) st.acc[i][e] = 0.0f;

    const int* table = PageTable + row * stride_pt;
    const int stride = WARPS * TILE;
    const int first = start + warp * TILE;
    const long long head_col = kvh * stride_kh;
    const int tiles = end > first ? (end - first + stride - 1) / stride : 0;
    auto slots_of = [&](int i) { return tile_slots(table, first + i * stride, i < tiles ? end : 0); };
#pragma unroll
    for (int i = 0; i < STAGES - 1; ++i) {
        if (i < tiles) copy_tile<STAGES>(smem, K, V, slots_of(i), stride_kt, head_col, i);
        cp_async_commit();
    }
    // the next copy's slots, read a turn before it, so that the copy does not wait on the page table
    Slots next = slots_of(STAGES - 1);
    for (int i = 0; i < tiles; ++i) {
        cp_async_wait<STAGES - 2>();  // this lane's copies of tile i are in; the warp's after the barrier
        __syncwarp();                 // also: every lane is done reading the stage the copy below refills
        const Tile cur = read_tile<STAGES>(smem, i % STAGES, g, t);
        const int ahead = i + STAGES - 1;
        if (ahead < tiles) copy_tile<STAGES>(smem, K, V, next, stride_kt, head_col, ahead % STAGES);
        cp_async_commit();
        next = slots_of(ahead + 1);
        attend_tile(st, cur, qf, first + i * stride, end, g, t);
    }
    cp_async_wait<0>();
    __syncthreads();  // the ring is free: the join reuses it
    join_and_write<G>(st, reinterpret_cast<float*>(smem), Out, MidO, MidLse, b, kvh, s, stride_ot, stride_oh,
                      num_qo_heads, num_splits, vscale, g, t);
}

// minisgl/kernel/cuda/decode.py instantiates it: G query heads a KV head, STAGES (>= 2, above), and MIN_BLOCKS
// programs an SM that ptxas must fit in the registers (1: as many registers as it likes). A program takes
// shared_bytes(STAGES) bytes of dynamic shared memory.
#define DECODE_TC_KERNEL(NAME, G, STAGES, MIN_BLOCKS)                                                          \
    extern "C" __global__ void __launch_bounds__(128, MIN_BLOCKS) NAME(                                        \
        const bf16_t* Q, const char* K, const char* V, bf16_t* Out, float* MidO, float* MidLse,                \
        const int* PageTable, const int* Rows, const int* SeqLens, const int* Order, const float* KScale,      \
        const float* VScale, long long stride_qt, long long stride_qh, long long stride_kt, long long stride_kh, \
        long long stride_pt, long long stride_ot, long long stride_oh, int num_qo_heads, int num_splits,       \
        float qk_scale) {                                                                                      \
        decode_tc_body<G, STAGES>(Q, K, V, Out, MidO, MidLse, PageTable, Rows, SeqLens, Order, KScale, VScale,  \
                                  stride_qt, stride_qh, stride_kt, stride_kh, stride_pt, stride_ot, stride_oh,  \
                                  num_qo_heads, num_splits, qk_scale);                                         \
    }
