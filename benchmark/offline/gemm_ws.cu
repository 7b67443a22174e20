// A decode product whose weight waits in shared memory (measured by gemm_ws.py; compiled after gemm.cu, whose
// helpers it uses).
//
// Y = X W^T (+ R) for M <= MR tokens. A program owns a slice of R weight rows by KS columns of K (SPLIT programs
// a cluster along K, their float32 partial sums meeting in distributed shared memory in rank order) and holds the
// whole slice in shared memory: it asks for all of it before griddepcontrol.wait, so that under programmatic
// dependent launch the weight streams in while the kernel before still runs. After the wait it copies its X
// slice (every token, KS columns) in CHUNKS groups and multiplies each group as it lands: tokens the M side of
// mma.sync m16n8k16, weight rows the N side. The grid is about one program an SM, so that the next product's
// programs (which ask for their own slices at once) fit beside this one's.

// the slice's rows in shared memory: KS columns and 16 bytes, so that ldmatrix's 8 rows fall in distinct banks
template <int KS>
struct WsRow {
    static constexpr int ELEMS = KS + 8;
};

template <int R, int KS, int SPLIT, int MR, int WM, int WK, int CHUNKS>
__device__ __forceinline__ void ws_body(const bf16_t* __restrict__ X, const bf16_t* __restrict__ W, bf16_t* Y,
                                        const bf16_t* Res, int M, long long ldx, long long ldw, long long ldy,
                                        long long ldr) {
    // warp (wm, wk): tokens wm * MTW * 16 .. + MTW * 16, every weight row of the slice, the 16-column steps wk,
    // wk + WK, ... of each group; the WK warps' sums then meet in shared memory. Each operand's fragment is read
    // from shared memory once a step (the weight's WM times), where warps split along the rows read X once a warp.
    constexpr int THREADS = WM * WK * 32;
    constexpr int NT = R / 8;            // n8 tiles (weight rows)
    constexpr int MTW = MR / 16 / WM;    // a warp's m16 tiles (tokens)
    constexpr int KC = KS / CHUNKS;      // X's columns a group
    constexpr int STEPS = KC / 16 / WK;  // a warp's 16-column steps a group
    constexpr int STR = WsRow<KS>::ELEMS;
    constexpr int LD = R + 4;            // a token's partial sums (floats): the 32 lanes' writes in distinct banks
    static_assert(NT % 2 == 0 && MTW >= 1 && MR % (16 * WM) == 0, "whole tiles a warp");
    static_assert(KC % (16 * WK) == 0 && KS % 64 == 0, "whole 16-column steps a warp and group, 128-byte rows");
    extern __shared__ uint4 smem[];
    bf16_t* ws = reinterpret_cast<bf16_t*>(smem);
    bf16_t* xs = ws + R * STR;

    const int rank = blockIdx.x % SPLIT;
    const int n0 = blockIdx.x / SPLIT * R, k0 = rank * KS;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int wm = warp / WK, wk = warp % WK;

    asm volatile("griddepcontrol.launch_dependents;\n" ::);
    constexpr int ROW_WORDS = KS / 8;
    for (int i = threadIdx.x; i < R * ROW_WORDS; i += THREADS) {
        const int r = i / ROW_WORDS, c = i % ROW_WORDS;
        copy16(smem_addr(ws + r * STR + c * 8), W + (long long)(n0 + r) * ldw + k0 + c * 8, 16);
    }
    asm volatile("cp.async.commit_group;\n" ::);
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
    constexpr int CHUNK_WORDS = KC / 8;
    const int rows = M < MR ? M : MR;
#pragma unroll
    for (int ch = 0; ch < CHUNKS; ++ch) {
        for (int i = threadIdx.x; i < MR * CHUNK_WORDS; i += THREADS) {
            const int r = i / CHUNK_WORDS, c = ch * CHUNK_WORDS + i % CHUNK_WORDS;
            const bool in = r < rows;  // rows past M zero-filled, not read
            copy16(smem_addr(xs + r * STR + c * 8), X + (in ? (long long)r * ldx + k0 + c * 8 : 0), in ? 16 : 0);
        }
        asm volatile("cp.async.commit_group;\n" ::);
    }

    float acc[MTW][NT][4];
#pragma unroll
    for (int i = 0; i < MTW; ++i)
#pragma unroll
        for (int j = 0; j < NT; ++j) acc[i][j][0] = acc[i][j][1] = acc[i][j][2] = acc[i][j][3] = 0.0f;

#pragma unroll
    for (int ch = 0; ch < CHUNKS; ++ch) {
        // group ch (and the weight's, committed first) landed for this thread; the barrier, for every thread
        if (ch == 0) asm volatile("cp.async.wait_group %0;\n" ::"n"(CHUNKS - 1));
        if (ch == 1) asm volatile("cp.async.wait_group %0;\n" ::"n"(CHUNKS > 2 ? CHUNKS - 2 : 0));
        if (ch == 2) asm volatile("cp.async.wait_group %0;\n" ::"n"(CHUNKS > 3 ? CHUNKS - 3 : 0));
        if (ch >= 3) asm volatile("cp.async.wait_group 0;\n" ::);
        __syncthreads();
#pragma unroll
        for (int t = 0; t < STEPS; ++t) {
            const int k = ch * KC + (t * WK + wk) * 16;
            u32 a[MTW][4];
#pragma unroll
            for (int i = 0; i < MTW; ++i)
                ldmatrix4(a[i], smem_addr(xs + ((wm * MTW + i) * 16 + lane % 16) * STR + k + (lane / 16) * 8));
#pragma unroll
            for (int j = 0; j < NT; j += 2) {  // b0, b1 of n-tile j, then of n-tile j + 1
                u32 b[4];
                const int row = j * 8 + (lane / 16) * 8 + lane % 8;
                ldmatrix4(b, smem_addr(ws + row * STR + k + ((lane / 8) % 2) * 8));
#pragma unroll
                for (int i = 0; i < MTW; ++i) {
                    mma_bf16(acc[i][j], a[i], b[0], b[1]);
                    mma_bf16(acc[i][j + 1], a[i], b[2], b[3]);
                }
            }
        }
    }

    // the partial sums: warp (wm, wk) writes block wk of [WK][MR][LD] floats, over the X slice's room
    __syncthreads();
    float* part = reinterpret_cast<float*>(xs);
    const int g = lane / 4, q = lane % 4;
#pragma unroll
    for (int i = 0; i < MTW; ++i)
#pragma unroll
        for (int j = 0; j < NT; ++j) {
            const int tok = (wm * MTW + i) * 16 + g, f = j * 8 + 2 * q;
            float* p = part + (wk * MR + tok) * LD + f;
            *reinterpret_cast<float2*>(p) = make_float2(acc[i][j][0], acc[i][j][1]);
            *reinterpret_cast<float2*>(p + 8 * LD) = make_float2(acc[i][j][2], acc[i][j][3]);
        }
    __syncthreads();
    // 8 outputs an item: the WK blocks summed in order into block 0 (each item one thread's)
    constexpr int ITEMS = MR * R / 8;
    if constexpr (WK > 1) {
        for (int it = threadIdx.x; it < ITEMS; it += THREADS) {
            const int tok = it / (R / 8), f = it % (R / 8) * 8;
            if (tok >= rows) continue;
            float4 lo = *reinterpret_cast<const float4*>(part + tok * LD + f);
            float4 hi = *reinterpret_cast<const float4*>(part + tok * LD + f + 4);
#pragma unroll
            for (int w = 1; w < WK; ++w) {
                const float4 l = *reinterpret_cast<const float4*>(part + (w * MR + tok) * LD + f);
                const float4 h = *reinterpret_cast<const float4*>(part + (w * MR + tok) * LD + f + 4);
                lo.x += l.x, lo.y += l.y, lo.z += l.z, lo.w += l.w;
                hi.x += h.x, hi.y += h.y, hi.z += h.z, hi.w += h.w;
            }
            *reinterpret_cast<float4*>(part + tok * LD + f) = lo;
            *reinterpret_cast<float4*>(part + tok * LD + f + 4) = hi;
        }
    }
    if constexpr (SPLIT > 1)
        cluster_sync();  // every program's block 0 summed (and visible to the cluster)
    else if constexpr (WK > 1)
        __syncthreads();
    // program `rank` of the cluster writes items rank, rank + SPLIT, ... (gemm.cu's store_sums8)
    for (int it = rank * THREADS + threadIdx.x; it < ITEMS; it += SPLIT * THREADS) {
        const int tok = it / (R / 8), f = it % (R / 8) * 8;
        if (tok >= rows) continue;
        store_sums8<SPLIT>(part + tok * LD + f, Res, tok * ldr + n0 + f, Y + tok * ldy + n0 + f);
    }
    if constexpr (SPLIT > 1) cluster_sync();  // no program leaves while another still reads its partials
}

#define WS_PARAMS                                                                                                   \
    const bf16_t *__restrict__ X, const bf16_t *__restrict__ W, bf16_t *Y, const bf16_t *Res, int M, long long ldx, \
        long long ldw, long long ldy, long long ldr
#define WS_KERNEL(name, R, KS, SPLIT, MR, WM, WK, CHUNKS)                                                          \
    extern "C" __global__ void __cluster_dims__(SPLIT, 1, 1) __launch_bounds__(WM * WK * 32, 2) name(WS_PARAMS) {  \
        ws_body<R, KS, SPLIT, MR, WM, WK, CHUNKS>(X, W, Y, Res, M, ldx, ldw, ldy, ldr);                            \
    }
