// Paged decode attention on the tensor cores (mma.sync m16n8k16, f16 or bf16 in, f32 out) over an FP8 or a bf16
// pool, head dim 128, G <= 8 query heads a KV head: decode.cu's work (the same arguments, grid and split outputs)
// on the tensor cores. minisgl/kernel/cuda/decode.py's TensorCoreDecode launches it; benchmark/offline/decode_tc.py
// times it against decode.cu's kernel and Triton's.
//
// A program is one (KV head, request, split), 4 warps; a warp takes tiles of 16 keys (tile w, w + 4, ...).
// Per tile, S = K Q^T by 8 mma (keys the M rows, queries the N columns: G of the 8 used, the rest zero), then
// O^T += V^T P^T by 8 mma (dims the M rows, keys the K dim). The dims inside each product are a permutation
// of the real ones, chosen so that every thread's bytes of a K or V row are contiguous (one or two 16-byte
// words): in S = K Q^T, a thread with t = lane % 4 holds dims 32t .. 32t + 31 of its two key rows; in
// O^T = V^T P^T, a thread with g = lane / 4 holds dims 16g .. 16g + 15 of its four key rows (bf16: 8g .. 8g + 7
// and 64 + 8g .. 64 + 8g + 7, attend_tile_bf16). The permutation of a sum's terms changes nothing; the output dims
// are written back in place. e4m3 pairs widen to f16 pairs in one instruction, bf16 pairs are the operands as
// stored; P goes from the S fragment's layout to the B operand's by four shuffles.
//
// How the rows reach the registers: each warp copies its tiles into a ring of STAGES tiles (4 KB each, 8 KB bf16)
// in shared memory with cp.async, STAGES - 1 tiles ahead, each copy instruction whole rows (4 FP8, 2 bf16), the
// slots read from the page table a turn before their copy; and reads its words from there. A thread's words
// loaded straight into registers a tile ahead kept a third as many bytes in flight an SM and read 12-15% slower
// at 128-256 requests (docs/benchmarks.md, "Decode attention on the tensor cores").
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

__device__ __forceinline__ u32 f32x2_to_bf16x2(float lo, float hi) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

__device__ __forceinline__ u32 prmt(u32 a, u32 b, u32 sel) {
    u32 r;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(sel));
    return r;
}

// D += A B on f16 operands (an FP8 pool's, widened) or bf16 ones (a bf16 pool's, as stored)
template <bool F16>
__device__ __forceinline__ void mma16816(float* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    if constexpr (F16)
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
            "{%0,%1,%2,%3};"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
    else
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
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

// how a pool's rows lie in the ring in shared memory, [warp][stage][K, V][key row 0..15][16-byte word]:
// FP8 rows are 128 bytes (8 words), word w of row r at w ^ (r & 7); bf16 rows 256 bytes (16 words), word w at
// (w & 8) | ((w & 7) ^ (r & 7) ^ 2 (w >> 3)). Either way the words a warp reads at once (below) and those it
// copies (a whole row a quarter or half warp) fall in distinct banks.
template <bool FP8>
struct Pool {
    static constexpr int WORDS = FP8 ? 8 : 16;  // 16-byte words a row
    static constexpr int COPIES = 16 * WORDS / 32;  // copy instructions a tile's K (or V): 32 lanes, 16 bytes each
    __device__ __forceinline__ static int slot(int r, int w) {
        return FP8 ? w ^ (r & 7) : (w & 8) | ((w & 7) ^ (r & 7) ^ ((w >> 3) << 1));
    }
};

template <bool FP8>
__device__ __forceinline__ int ring_word(int stage, int kv, int r, int w, int stages) {
    return ((((threadIdx.x / 32) * stages + stage) * 2 + kv) * 16 + r) * Pool<FP8>::WORDS + Pool<FP8>::slot(r, w);
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

// the row lane L copies in copy i of a tile (each copy instruction whole rows: 4 of FP8, 2 of bf16); its word in
// the row is L % WORDS
template <bool FP8>
__device__ __forceinline__ int copy_row(int i) {
    return threadIdx.x % 32 / Pool<FP8>::WORDS + 32 / Pool<FP8>::WORDS * i;
}

// the slots of the rows lane L copies of the warp's tile at kb0 (-1 past `end`)
template <bool FP8>
struct Slots {
    int s[Pool<FP8>::COPIES];
};

template <bool FP8>
__device__ __forceinline__ Slots<FP8> tile_slots(const int* table, int kb0, int end) {
    Slots<FP8> r;
#pragma unroll
    for (int i = 0; i < Pool<FP8>::COPIES; ++i) {
        const int key = kb0 + copy_row<FP8>(i);
        r.s[i] = key < end ? table[key] : -1;
    }
    return r;
}

// the warp's tile into stage `stage`, its rows at `slots`: each instruction asks for whole rows (rows split over
// 16 instructions, 32 bytes of each, read 6-7% slower, and 1.8x slower when the slots lie anywhere:
// docs/benchmarks.md); a row past the end (slot -1) is zero-filled, not read. stride_kt and head_col in bytes.
template <int STAGES, bool FP8>
__device__ __forceinline__ void copy_tile(uint4* ring, const char* K, const char* V, const Slots<FP8>& slots,
                                          long long stride_kt, long long head_col, int stage) {
    const int w = threadIdx.x % Pool<FP8>::WORDS;
#pragma unroll
    for (int i = 0; i < Pool<FP8>::COPIES; ++i) {
        const int slot = slots.s[i], r = copy_row<FP8>(i);
        const long long at = (slot >= 0 ? (long long)slot * stride_kt : 0) + head_col + 16 * w;
        cp_async16(ring + ring_word<FP8>(stage, 0, r, w, STAGES), K + at, slot >= 0 ? 16 : 0);
        cp_async16(ring + ring_word<FP8>(stage, 1, r, w, STAGES), V + at, slot >= 0 ? 16 : 0);
    }
}

// an FP8 tile's words for one thread, read at once: its 32 bytes of key rows g and g + 8 (for S), its 16 bytes of
// key rows 2t, 2t + 1, 2t + 8, 2t + 9 (for O)
template <int STAGES>
__device__ __forceinline__ Tile read_tile(const uint4* ring, int stage, int g, int t) {
    Tile r;
    r.ka[0] = ring[ring_word<true>(stage, 0, g, 2 * t, STAGES)];
    r.ka[1] = ring[ring_word<true>(stage, 0, g, 2 * t + 1, STAGES)];
    r.kb[0] = ring[ring_word<true>(stage, 0, g + 8, 2 * t, STAGES)];
    r.kb[1] = ring[ring_word<true>(stage, 0, g + 8, 2 * t + 1, STAGES)];
    const int rows[4] = {2 * t, 2 * t + 1, 2 * t + 8, 2 * t + 9};
#pragma unroll
    for (int i = 0; i < 4; ++i) r.v[i] = ring[ring_word<true>(stage, 1, rows[i], g, STAGES)];
    return r;
}

// the softmax state of one warp: queries 2t and 2t + 1 (the same columns in S's fragment and O's)
struct State {
    float m[2], l[2];
    float acc[8][4];
};

// the scores of one tile (keys from `end` on masked out) into the warp's online softmax: the state's sums and
// output rescaled, and P^T returned as the B operand of O^T = V^T P^T (f16 or bf16 pairs): column (query) g, rows
// (keys) 2t, 2t + 1 (pb0) and 2t + 8, 2t + 9 (pb1)
template <bool F16>
__device__ __forceinline__ void softmax_tile(State& st, float (&sc)[4], int kb0, int end, int g, int t, u32& pb0,
                                             u32& pb1) {
    if (kb0 + g >= end) sc[0] = sc[1] = -INFINITY;
    if (kb0 + g + 8 >= end) sc[2] = sc[3] = -INFINITY;
    // the tile's max over the 16 keys (8 lanes of the same t, two rows each)
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
    // P[q][key r] sits in lane 4r + q / 2 (r < 8: sc[0..1], else sc[2..3]), element q % 2
    const u32 p01 = F16 ? f32x2_to_f16x2(sc[0], sc[1]) : f32x2_to_bf16x2(sc[0], sc[1]);
    const u32 p23 = F16 ? f32x2_to_f16x2(sc[2], sc[3]) : f32x2_to_bf16x2(sc[2], sc[3]);
    const int src0 = 8 * t + g / 2, src1 = 8 * t + 4 + g / 2;
    const u32 sel = (g & 1) ? 0x7632u : 0x5410u;
    pb0 = prmt(__shfl_sync(0xffffffffu, p01, src0), __shfl_sync(0xffffffffu, p01, src1), sel);
    pb1 = prmt(__shfl_sync(0xffffffffu, p23, src0), __shfl_sync(0xffffffffu, p23, src1), sel);
}

// one FP8 tile of 16 keys from kb0 into the warp's state, its words read at once (read_tile)
__device__ __forceinline__ void attend_tile(State& st, const Tile& cur, const u32 (&qf)[8][2], int kb0, int end, int g,
                                            int t) {
    // S = K Q^T: rows keys kb0 + g and kb0 + g + 8, columns queries 2t, 2t + 1; two sums of four products each,
    // so that the mma chain is half as long
    float sc[4] = {0.0f, 0.0f, 0.0f, 0.0f}, sd[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        const u32 wa = word(cur.ka, j), wb = word(cur.kb, j);  // bytes 4j .. 4j + 3 of each row's slice
        mma16816<true>(j % 2 ? sd : sc, e4m3x2_to_f16x2(wa), e4m3x2_to_f16x2(wb), e4m3x2_to_f16x2(wa >> 16),
                       e4m3x2_to_f16x2(wb >> 16), qf[j][0], qf[j][1]);
    }
#pragma unroll
    for (int e = 0; e < 4; ++e) sc[e] += sd[e];
    u32 pb0, pb1;
    softmax_tile<true>(st, sc, kb0, end, g, t, pb0, pb1);
    // V^T as the A operand: rows dims (row g of chunk i is dim 16g + 2i, row g + 8 dim 16g + 2i + 1), columns
    // keys 2t, 2t + 1 (v[0], v[1]) and 2t + 8, 2t + 9 (v[2], v[3])
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const int w = i / 2;
        const u32 selv = (i % 2) ? 0x7362u : 0x5140u;  // bytes 2i, 2i + 1 of two rows, interleaved
        const u32 x01 = prmt(word1(cur.v[0], w), word1(cur.v[1], w), selv);
        const u32 x23 = prmt(word1(cur.v[2], w), word1(cur.v[3], w), selv);
        mma16816<true>(st.acc[i], e4m3x2_to_f16x2(x01), e4m3x2_to_f16x2(x01 >> 16), e4m3x2_to_f16x2(x23),
                       e4m3x2_to_f16x2(x23 >> 16), pb0, pb1);
    }
}

// one bf16 tile of 16 keys from kb0 into the warp's state, its words read from stage `stage` of the ring as each
// product needs them (a tile is 64 registers a thread, twice an FP8 one's). In S = K Q^T a thread holds dims
// 32t .. 32t + 31 of key rows g and g + 8 (words 4t .. 4t + 3); in O^T = V^T P^T dims 8g .. 8g + 7 and
// 64 + 8g .. 64 + 8g + 7 (words g and g + 8) of key rows 2t, 2t + 1, 2t + 8, 2t + 9. S comes unscaled (q is as
// stored): `scale` multiplies it.
template <int STAGES>
__device__ __forceinline__ void attend_tile_bf16(State& st, const uint4* ring, int stage, const u32 (&qf)[8][2],
                                                 float scale, int kb0, int end, int g, int t) {
    float sc[4] = {0.0f, 0.0f, 0.0f, 0.0f}, sd[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int m = 0; m < 4; ++m) {  // word 4t + m: dims 32t + 8m .. + 7, the products j = 2m, 2m + 1
        const uint4 ka = ring[ring_word<false>(stage, 0, g, 4 * t + m, STAGES)];
        const uint4 kb = ring[ring_word<false>(stage, 0, g + 8, 4 * t + m, STAGES)];
        mma16816<false>(sc, ka.x, kb.x, ka.y, kb.y, qf[2 * m][0], qf[2 * m][1]);
        mma16816<false>(sd, ka.z, kb.z, ka.w, kb.w, qf[2 * m + 1][0], qf[2 * m + 1][1]);
    }
#pragma unroll
    for (int e = 0; e < 4; ++e) sc[e] = (sc[e] + sd[e]) * scale;
    u32 pb0, pb1;
    softmax_tile<false>(st, sc, kb0, end, g, t, pb0, pb1);
    // V^T as the A operand: row g of chunk i is dim dim_of<false>(g, i), row g + 8 the dim after it; columns keys
    // 2t, 2t + 1 and 2t + 8, 2t + 9, paired by prmt from two rows' words
    const int rows[4] = {2 * t, 2 * t + 1, 2 * t + 8, 2 * t + 9};
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        uint4 v[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) v[k] = ring[ring_word<false>(stage, 1, rows[k], g + 8 * half, STAGES)];
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            const u32 v0 = word1(v[0], c), v1 = word1(v[1], c), v2 = word1(v[2], c), v3 = word1(v[3], c);
            mma16816<false>(st.acc[4 * half + c], prmt(v0, v1, 0x5410u), prmt(v0, v1, 0x7632u), prmt(v2, v3, 0x5410u),
                            prmt(v2, v3, 0x7632u), pb0, pb1);
        }
    }
}

// the output dim of row g of O^T's chunk i (row g + 8: the dim after it)
template <bool FP8>
__device__ __forceinline__ int dim_of(int g, int i) {
    return FP8 ? 16 * g + 2 * i : 8 * g + 2 * (i % 4) + 64 * (i / 4);
}

// the joined warps' float state in shared memory: [warp][1056] floats, element (query h, dim d) at
// (d % 16) * 66 + (4 (h % 2) + h / 2) * 8 + d / 16, so that a warp's stores (lanes over t and g) and the reads
// (threads over d) each fall in 32 distinct banks; then the maxima and sums, [warp][8] each
constexpr int JOIN_WARP = 1056;

__device__ __forceinline__ int join_at(int h, int d) { return (d % 16) * 66 + (4 * (h % 2) + h / 2) * 8 + d / 16; }

// the 4 warps' states joined (through `smem`, 4 * (JOIN_WARP + 16) floats, free for it) and written: the output
// row with one split, else the split's float32 output and base-2 log-sum-exp
template <int G, bool FP8>
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
        const int dim = dim_of<FP8>(g, i);
        mine[join_at(2 * t, dim)] = st.acc[i][0];
        mine[join_at(2 * t + 1, dim)] = st.acc[i][1];
        mine[join_at(2 * t, dim + 1)] = st.acc[i][2];
        mine[join_at(2 * t + 1, dim + 1)] = st.acc[i][3];
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

// The rotary kernel's work for a decode step, done by the programs that attend (MINISGL_TC_DECODE_ROPE): q and the
// new token's K and V arrive as the q|k|v projection wrote them. Each program scales its row by 1 / rms of the
// hidden states (the norm folded into the projection, where Hid is given), takes Qwen3's RMSNorm over each head
// (where QW is given) and rotates its group's query heads into shared memory; the program whose split holds the
// new token (the context's last position) does the same to its K head, writes K and V into the pool at the
// token's slot and attends to them from shared memory after its loop over the pool, which stops one key short. The
// roundings are kernel/rotary.py's: the scaled head, the normalised head, its product with the weight, cos and sin
// and the rotated halves each to bf16; an FP8 pool's values divided by the scale, clamped to +-448, rounded.
#define DECODE_ROPE_PARAMS                                                                                        \
    const bf16_t *__restrict__ Knew, const bf16_t *__restrict__ Vnew, long long stride_nt, long long stride_nh,  \
        const long long *__restrict__ Pos, const void *__restrict__ CosSin, long long stride_cs, int cs_bf16,     \
        const long long *__restrict__ Loc, const bf16_t *__restrict__ QW, const bf16_t *__restrict__ KW,         \
        float eps, const bf16_t *__restrict__ Hid, long long stride_s, int s_n, float s_eps
#define DECODE_ROPE_ARGS \
    Knew, Vnew, stride_nt, stride_nh, Pos, CosSin, stride_cs, cs_bf16, Loc, QW, KW, eps, Hid, stride_s, s_n, s_eps

struct RopeArgs {
    const bf16_t* Knew;
    const bf16_t* Vnew;
    long long stride_nt, stride_nh;
    const long long* Pos;
    const void* CosSin;
    long long stride_cs;
    int cs_bf16;
    const long long* Loc;
    const bf16_t *QW, *KW;
    float eps;
    const bf16_t* Hid;
    long long stride_s;
    int s_n;
    float s_eps;
};

// the largest hidden row a program reduces for a folded norm's 1 / rms (decode.py's rope_args refuses larger ones)
constexpr int ROPE_MAX_HIDDEN = 2048;

// the rotation's inputs, copied into shared memory by cp.async before the pool's first tiles (one group, the oldest:
// so that they wait on one round trip to memory, beside the copies', and hold no registers meanwhile), and what it
// leaves there: the group's rotated query heads (over their inputs) and the new token's K and V rows as the pool
// holds them (bf16: 256 bytes, FP8: 128)
struct RopeShared {
    uint4 hid[ROPE_MAX_HIDDEN * 2 / 16];
    bf16_t q[8][128];
    bf16_t kin[128], vin[128], qw[128], kw[128];
    float cs[128];  // cos | sin at dims 0 .. 63 (float32 tables; a bf16 table's 128 values fill half of it)
    uint4 k[16], v[16];
};

__device__ __forceinline__ float round_bf16(float x) { return bf16_to_f32(f32_to_bf16(x)); }

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
    for (int o = 16; o > 0; o /= 2) x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}

// x as an FP8 pool stores it (store.py's to_pool): divided by the scale (correctly rounded, as torch divides),
// clamped, rounded to the nearest e4m3 value
__device__ __forceinline__ unsigned char to_e4m3(float x, float scale) {
    const float y = fminf(fmaxf(__fdiv_rn(x, scale), -448.0f), 448.0f);
    unsigned short r;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(0.0f), "f"(y));
    return static_cast<unsigned char>(r & 0xff);
}

// `bytes` (a multiple of 16, both ends 16-byte aligned) from global to shared memory, 16 bytes a thread a turn
__device__ __forceinline__ void stage(void* dst, const void* src, int bytes) {
    for (int c = threadIdx.x; c < bytes / 16; c += 128)
        cp_async16(reinterpret_cast<uint4*>(dst) + c, reinterpret_cast<const uint4*>(src) + c, 16);
}

// the rotation's inputs of request b (kvh's query heads, and where `holds` its K and V heads) on their way into rs:
// one cp.async group, committed
template <int G>
__device__ __forceinline__ void stage_rope(RopeShared& rs, const RopeArgs& ra, const bf16_t* Q, int b, int kvh,
                                           long long pos, long long stride_qt, long long stride_qh, bool holds) {
#pragma unroll
    for (int h = 0; h < G; ++h) stage(rs.q[h], Q + b * stride_qt + (kvh * G + h) * stride_qh, 256);
    if (holds) {
        stage(rs.kin, ra.Knew + b * ra.stride_nt + kvh * ra.stride_nh, 256);
        stage(rs.vin, ra.Vnew + b * ra.stride_nt + kvh * ra.stride_nh, 256);
    }
    if (ra.QW != nullptr) {
        stage(rs.qw, ra.QW, 256);
        stage(rs.kw, ra.KW, 256);
    }
    const int es = ra.cs_bf16 ? 2 : 4;  // the table row is [cos | sin], 128 wide each (halves equal)
    const char* row = reinterpret_cast<const char*>(ra.CosSin) + pos * ra.stride_cs * es;
    stage(rs.cs, row, 64 * es);
    stage(reinterpret_cast<char*>(rs.cs) + 64 * es, row + 128 * es, 64 * es);
    if (ra.Hid != nullptr) stage(rs.hid, ra.Hid + b * ra.stride_s, ra.s_n * 2);
    cp_async_commit();
}

// the rotation of request b's query heads (kvh's group) in rs.q and, where `holds`, of its K head into the pool and
// rs.k, its V into both, once stage_rope's group is in (the caller waits for it). A head is one warp's (jobs 0 .. G - 1
// the query heads, job G the K head with V; warp w takes jobs w, w + 4, ...), a lane its dims (l, l + 64) and
// (l + 32, l + 96), so that every sum is the warp's own: no barrier but the two around it
template <int G, bool FP8>
__device__ __forceinline__ void rotate_in_shared(RopeShared& rs, const RopeArgs& ra, char* K, char* V,
                                                 const float* KScale, const float* VScale, long long slot,
                                                 long long stride_kt, long long stride_kh, int kvh, bool holds) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    __syncthreads();  // every thread's copies are in
    float inv = 1.0f;
    if (ra.Hid != nullptr) {  // 1 / rms of the hidden row, float32 as norm.py's row_inv_rms; each warp sums it all
        float ss = 0.0f;
        for (int c = lane; c < ra.s_n / 8; c += 32) {  // 8 elements a word (rope_args: s_n a multiple of 8)
            const uint4 w = rs.hid[c];
            const u32 pairs[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const float lo = bf16_to_f32(pairs[e] & 0xffff), hi = bf16_to_f32(pairs[e] >> 16);
                ss += lo * lo + hi * hi;
            }
        }
        inv = rsqrtf(warp_sum(ss) / ra.s_n + ra.s_eps);
    }
    // cos and sin at dims lane and lane + 32, rounded to the heads' dtype first, as the rotary kernel and
    // transformers do
    float cs[2], sn[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int d = lane + 32 * h;
        cs[h] = round_bf16(ra.cs_bf16 ? bf16_to_f32(reinterpret_cast<const bf16_t*>(rs.cs)[d]) : rs.cs[d]);
        sn[h] = round_bf16(ra.cs_bf16 ? bf16_to_f32(reinterpret_cast<const bf16_t*>(rs.cs)[64 + d]) : rs.cs[64 + d]);
    }
    constexpr int ES = FP8 ? 1 : 2;
    for (int job = warp; job <= G; job += 4) {
        const bool is_k = job == G;
        if (is_k && !holds) break;
        const bf16_t* src = is_k ? rs.kin : rs.q[job];
        float x[4];  // dims lane, lane + 32 (first halves), lane + 64, lane + 96 (their partners)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            x[e] = bf16_to_f32(src[lane + 32 * e]);
            if (ra.Hid != nullptr) x[e] = round_bf16(x[e] * inv);
        }
        if (ra.QW != nullptr) {  // the head's RMSNorm
            const float h = rsqrtf(warp_sum(x[0] * x[0] + x[1] * x[1] + x[2] * x[2] + x[3] * x[3]) / 128.0f + ra.eps);
            const bf16_t* w = is_k ? rs.kw : rs.qw;
#pragma unroll
            for (int e = 0; e < 4; ++e) x[e] = round_bf16(round_bf16(x[e] * h) * bf16_to_f32(w[lane + 32 * e]));
        }
        float y[4];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            y[h] = round_bf16(x[h] * cs[h] - x[h + 2] * sn[h]);
            y[h + 2] = round_bf16(x[h + 2] * cs[h] + x[h] * sn[h]);
        }
        if (!is_k) {  // over its input: each dim is this lane's alone
#pragma unroll
            for (int e = 0; e < 4; ++e) rs.q[job][lane + 32 * e] = f32_to_bf16(y[e]);
            continue;
        }
        char* kdst = K + slot * stride_kt * ES + kvh * stride_kh * ES;
        char* vdst = V + slot * stride_kt * ES + kvh * stride_kh * ES;
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int d = lane + 32 * e;
            float v = bf16_to_f32(rs.vin[d]);
            if (ra.Hid != nullptr) v = round_bf16(v * inv);
            if constexpr (FP8) {
                const unsigned char ek = to_e4m3(y[e], KScale[0]), ev = to_e4m3(v, VScale[0]);
                kdst[d] = ek;
                vdst[d] = ev;
                reinterpret_cast<unsigned char*>(rs.k)[d] = ek;
                reinterpret_cast<unsigned char*>(rs.v)[d] = ev;
            } else {
                const bf16_t hk = f32_to_bf16(y[e]), hv = f32_to_bf16(v);
                reinterpret_cast<bf16_t*>(kdst)[d] = hk;
                reinterpret_cast<bf16_t*>(vdst)[d] = hv;
                reinterpret_cast<bf16_t*>(rs.k)[d] = hk;
                reinterpret_cast<bf16_t*>(rs.v)[d] = hv;
            }
        }
    }
    __syncthreads();  // rs.q, rs.k and rs.v are whole
}

// the tile of the new token (key seq_len - 1) into the calling warp's state: the row from rs into stage 0 of its
// ring (the other 15 rows zero, masked out of the softmax) and attended as a pool tile
template <int STAGES, bool FP8>
__device__ __forceinline__ void attend_new_token(State& st, uint4* ring, const RopeShared& rs, const u32 (&qf)[8][2],
                                                 float scale, int seq_len, int g, int t) {
    constexpr int WORDS = Pool<FP8>::WORDS;
    const int lane = threadIdx.x % 32;
    for (int x = lane; x < 2 * 16 * WORDS; x += 32) {
        const int kv = x / (16 * WORDS), r = x / WORDS % 16, w = x % WORDS;
        ring[ring_word<FP8>(0, kv, r, w, STAGES)] = r == 0 ? (kv ? rs.v[w] : rs.k[w]) : make_uint4(0, 0, 0, 0);
    }
    __syncwarp();
    if constexpr (FP8) {
        const Tile cur = read_tile<STAGES>(ring, 0, g, t);
        attend_tile(st, cur, qf, seq_len - 1, seq_len, g, t);
    } else {
        attend_tile_bf16<STAGES>(st, ring, 0, qf, scale, seq_len - 1, seq_len, g, t);
    }
}

template <int G, int STAGES, bool FP8, bool ROPE>
__device__ __forceinline__ void decode_tc_body(DECODE_PARAMS, const RopeArgs& ra) {
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
    // with ROPE the split that holds the new token reads the pool up to it and attends to it from shared memory
    const bool holds = ROPE && start < seq_len && end == seq_len;
    const int pool_end = holds ? end - 1 : end;
    const float vscale = FP8 ? VScale[0] : 1.0f;
    const float scale = qk_scale * (FP8 ? KScale[0] : 1.0f);
    constexpr int ES = FP8 ? 1 : 2;  // bytes an element of the pool

    // the rotation's inputs first, one cp.async group ahead of the pool's first tiles
    __shared__ RopeShared rs;
    long long slot = 0;
    if constexpr (ROPE) {
        slot = holds ? ra.Loc[b] : 0;
        stage_rope<G>(rs, ra, Q, b, kvh, ra.Pos[b], stride_qt, stride_qh, holds);
    }
    const int* table = PageTable + row * stride_pt;
    const int stride = WARPS * TILE;
    const int first = start + warp * TILE;
    const long long head_col = kvh * stride_kh * ES;
    const int tiles = pool_end > first ? (pool_end - first + stride - 1) / stride : 0;
    const long long row_bytes = stride_kt * ES;
    auto slots_of = [&](int i) { return tile_slots<FP8>(table, first + i * stride, i < tiles ? pool_end : 0); };
#pragma unroll
    for (int i = 0; i < STAGES - 1; ++i) {
        if (i < tiles) copy_tile<STAGES, FP8>(smem, K, V, slots_of(i), row_bytes, head_col, i);
        cp_async_commit();
    }
    if constexpr (ROPE) {  // the pool's first tiles are on their way while the heads are rotated
        cp_async_wait<STAGES - 1>();  // the rotation's group, the oldest, is in
        // the pool is written only at the new token's slot, which no program of this launch reads from it
        rotate_in_shared<G, FP8>(rs, ra, const_cast<char*>(K), const_cast<char*>(V), KScale, VScale, slot, stride_kt,
                                 stride_kh, kvh, holds);
    }
    // Q as the B operand of S = K Q^T: query g's dims 32t + 4j .. 32t + 4j + 3 for chunk j (zero for g >= G); for an
    // FP8 pool times the scale in f16, for a bf16 one as stored (its scores are scaled in f32)
    u32 qf[8][2];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        float x[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        uint2 w = make_uint2(0, 0);
        if (g < G)
            w = ROPE ? *reinterpret_cast<const uint2*>(&rs.q[g][32 * t + 4 * j])
                     : __ldg(reinterpret_cast<const uint2*>(Q + b * stride_qt + (kvh * G + g) * stride_qh + 32 * t +
                                                            4 * j));
        if (!FP8) {
            qf[j][0] = w.x;
            qf[j][1] = w.y;
            continue;
        }
        if (g < G) {
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

    // the next copy's slots, read a turn before it, so that the copy does not wait on the page table
    Slots<FP8> next = slots_of(STAGES - 1);
    for (int i = 0; i < tiles; ++i) {
        cp_async_wait<STAGES - 2>();  // this lane's copies of tile i are in; the warp's after the barrier
        __syncwarp();                 // also: every lane is done reading the stage the copy below refills
        const int ahead = i + STAGES - 1;
        if constexpr (FP8) {
            const Tile cur = read_tile<STAGES>(smem, i % STAGES, g, t);
            if (ahead < tiles) copy_tile<STAGES, FP8>(smem, K, V, next, row_bytes, head_col, ahead % STAGES);
            cp_async_commit();
            next = slots_of(ahead + 1);
            attend_tile(st, cur, qf, first + i * stride, pool_end, g, t);
        } else {  // the copy refills the stage read last turn, not this one's
            if (ahead < tiles) copy_tile<STAGES, FP8>(smem, K, V, next, row_bytes, head_col, ahead % STAGES);
            cp_async_commit();
            next = slots_of(ahead + 1);
            attend_tile_bf16<STAGES>(st, smem, i % STAGES, qf, scale, first + i * stride, pool_end, g, t);
        }
    }
    cp_async_wait<0>();
    // the new token's tile goes to the warp the pool gave fewest tiles (the one its next tile would have gone to)
    if constexpr (ROPE)
        if (holds && warp == (pool_end - start + TILE - 1) / TILE % WARPS) {
            __syncwarp();  // every lane is done with the ring
            attend_new_token<STAGES, FP8>(st, smem, rs, qf, scale, seq_len, g, t);
        }
    __syncthreads();  // the ring is free: the join reuses it
    join_and_write<G, FP8>(st, reinterpret_cast<float*>(smem), Out, MidO, MidLse, b, kvh, s, stride_ot, stride_oh,
                      num_qo_heads, num_splits, vscale, g, t);
}

// minisgl/kernel/cuda/decode.py instantiates it: G query heads a KV head, STAGES (>= 2, above), MIN_BLOCKS
// programs an SM that ptxas must fit in the registers (1: as many registers as it likes) and the pool (FP8: true,
// bf16: false). A program takes the dynamic shared memory decode.py's TensorCoreDecode.shared_bytes gives: the ring
// (4 warps, K and V, 16 rows a stage), or the join's floats if larger.
#define DECODE_TC_KERNEL(NAME, G, STAGES, MIN_BLOCKS, FP8)                                                     \
    extern "C" __global__ void __launch_bounds__(128, MIN_BLOCKS) NAME(DECODE_PARAMS) {                        \
        wait_for_inputs();                                                                                     \
        decode_tc_body<G, STAGES, FP8, false>(DECODE_ARGS, RopeArgs{});                                        \
    }

// the same with the rotary kernel's work inside (DECODE_ROPE_PARAMS above)
#define DECODE_TC_ROPE_KERNEL(NAME, G, STAGES, MIN_BLOCKS, FP8)                                                \
    extern "C" __global__ void __launch_bounds__(128, MIN_BLOCKS) NAME(DECODE_PARAMS, DECODE_ROPE_PARAMS) {    \
        wait_for_inputs();                                                                                     \
        decode_tc_body<G, STAGES, FP8, true>(DECODE_ARGS, RopeArgs{DECODE_ROPE_ARGS});                         \
    }
