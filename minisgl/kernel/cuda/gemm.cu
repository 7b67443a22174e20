// Products of few rows (decode steps of 1-8 rows) on the tensor cores, made for programmatic dependent launch:
// a program lets the next kernel launch as it starts, asks for its first stages' weight tiles (which depend on
// nothing), and only then waits for the kernel before it (griddepcontrol.wait) and asks for the activations.
// Launched plainly, or over a graph edge that is not programmatic, the two griddepcontrol instructions do nothing.
// minisgl/kernel/cuda/gemm.py launches it; engine/graph_edges.py makes the decode graphs' edges into it
// programmatic (docs/benchmarks.md, "A decode GEMM on the tensor cores" and "Products of few rows of our own").
//
// Y = X W^T (+ R): the weight's rows the M side of mma.sync m16n8k16, the tokens the N side; a program a tile of
// BN weight rows by BM tokens over one of SPLIT ranges of K, the SPLIT programs of a tile one cluster whose float32
// partial sums meet in distributed shared memory in rank order (the same bits every run, no workspace); tiles of
// 64 K by cp.async, STAGES - 1 ahead. Y may be R (the residual added in place: each output is read, then written,
// by one thread).

typedef unsigned short bf16_t;
typedef unsigned int u32;

#define GEMM_BK 64

__device__ __forceinline__ u32 smem_addr(const void* p) { return static_cast<u32>(__cvta_generic_to_shared(p)); }

__device__ __forceinline__ void copy16(u32 dst, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
}

__device__ __forceinline__ void ldmatrix4(u32 (&r)[4], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

__device__ __forceinline__ void mma_bf16(float* c, const u32 (&a)[4], u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}

__device__ __forceinline__ float4 cluster_load(const float* p, int rank) {
    u32 remote;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(smem_addr(p)), "r"(rank));
    float4 v;
    asm volatile("ld.shared::cluster.v4.f32 {%0,%1,%2,%3}, [%4];\n"
                 : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
                 : "r"(remote)
                 : "memory");
    return v;
}

__device__ __forceinline__ float bf16_lo(u32 w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf16_hi(u32 w) { return __uint_as_float(w & 0xffff0000u); }

__device__ __forceinline__ u32 pack_bf16(float lo, float hi) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// 8 outputs of one token: the float32 partial sums at `p` of a cluster's SPLIT programs added in rank order (the same
// sum whichever program came last), then the residual's 8 values at r + at (r null: none) in float32, the whole
// rounded once as cuBLAS's addmm (beta 1) rounds it, stored at `y`
template <int SPLIT>
__device__ __forceinline__ void store_sums8(const float* p, const bf16_t* r, long long at, bf16_t* y) {
    float s[8] = {0, 0, 0, 0, 0, 0, 0, 0};
#pragma unroll
    for (int rank = 0; rank < SPLIT; ++rank) {
        const float4 lo = SPLIT > 1 ? cluster_load(p, rank) : *reinterpret_cast<const float4*>(p);
        const float4 hi = SPLIT > 1 ? cluster_load(p + 4, rank) : *reinterpret_cast<const float4*>(p + 4);
        s[0] += lo.x, s[1] += lo.y, s[2] += lo.z, s[3] += lo.w;
        s[4] += hi.x, s[5] += hi.y, s[6] += hi.z, s[7] += hi.w;
    }
    if (r != nullptr) {
        const uint4 rv = *reinterpret_cast<const uint4*>(r + at);
        const u32 w[4] = {rv.x, rv.y, rv.z, rv.w};
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            s[2 * e] += bf16_lo(w[e]);
            s[2 * e + 1] += bf16_hi(w[e]);
        }
    }
    uint4 out;
    out.x = pack_bf16(s[0], s[1]);
    out.y = pack_bf16(s[2], s[3]);
    out.z = pack_bf16(s[4], s[5]);
    out.w = pack_bf16(s[6], s[7]);
    *reinterpret_cast<uint4*>(y) = out;
}

// shared memory word (16 bytes) of row r, word c of a tile of 128-byte rows
__device__ __forceinline__ int swizzled(int r, int c) { return r * 8 + (c ^ (r & 7)); }

// stage `stage` <- W rows n0 .. n0 + BN (PART & 1), X rows m0 .. m0 + BM, zeros past M (PART & 2); K columns
// k .. k + 64
template <int BN, int BM, int THREADS, int STAGES, int PART = 3>
__device__ __forceinline__ void load_stage(uint4* smem, const bf16_t* W, const bf16_t* X, int n0, int m0, int M,
                                           int k, long long ldw, long long ldx, int stage) {
    uint4* w_tile = smem + stage * (BN + BM) * 8;
    uint4* x_tile = w_tile + BN * 8;
    static_assert(BN * 8 % THREADS == 0, "every thread copies as many weight words");
    if constexpr ((PART & 1) != 0) {
#pragma unroll
        for (int j = 0; j < BN * 8 / THREADS; ++j) {
            const int i = threadIdx.x + j * THREADS, r = i / 8, c = i % 8;
            copy16(smem_addr(w_tile + swizzled(r, c)), W + (n0 + r) * ldw + k + c * 8, 16);
        }
    }
    if constexpr ((PART & 2) != 0) {
#pragma unroll
        for (int j = 0; j < (BM * 8 + THREADS - 1) / THREADS; ++j) {
            const int i = threadIdx.x + j * THREADS, r = i / 8, c = i % 8;
            const bool in = m0 + r < M;
            if (i < BM * 8)
                copy16(smem_addr(x_tile + swizzled(r, c)), X + (in ? (m0 + r) * ldx + k + c * 8 : 0), in ? 16 : 0);
        }
    }
}

template <int BN, int BM, int WN, int WM, int SPLIT, int STAGES>
__device__ __forceinline__ void gemm_body(const bf16_t* __restrict__ X, const bf16_t* __restrict__ W, bf16_t* Y,
                                          const bf16_t* R, int M, int K, long long ldx, long long ldw,
                                          long long ldy, long long ldr) {
    constexpr int THREADS = WN * WM * 32;
    constexpr int RW = BN / WN, TW = BM / WM;  // a warp's weight rows and tokens
    constexpr int MT = RW / 16, NT = TW / 8;  // its mma tiles along each
    static_assert(RW % 16 == 0 && TW % 16 == 0, "a warp takes whole 16-row tiles of each side");
    extern __shared__ uint4 smem[];

    const int rank = blockIdx.x % SPLIT;  // the cluster is the SPLIT programs of one tile, along x
    const int n0 = blockIdx.x / SPLIT * BN, m0 = blockIdx.y * BM;
    const int k_len = K / SPLIT, k_begin = rank * k_len, steps = k_len / GEMM_BK;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int wn = warp % WN, wm = warp / WN;

    float acc[MT][NT][4];
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
        for (int j = 0; j < NT; ++j) acc[i][j][0] = acc[i][j][1] = acc[i][j][2] = acc[i][j][3] = 0.0f;

    asm volatile("griddepcontrol.launch_dependents;\n" ::);
    // the first stages' weight tiles before the wait (they belong to the first commit group: waiting for any
    // stage waits for them too), the activations after it
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s)
        if (s < steps)
            load_stage<BN, BM, THREADS, STAGES, 1>(smem, W, X, n0, m0, M, k_begin + s * GEMM_BK, ldw, ldx, s);
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < steps)
            load_stage<BN, BM, THREADS, STAGES, 2>(smem, W, X, n0, m0, M, k_begin + s * GEMM_BK, ldw, ldx, s);
        asm volatile("cp.async.commit_group;\n" ::);
    }
    for (int t = 0; t < steps; ++t) {
        asm volatile("cp.async.wait_group %0;\n" ::"n"(STAGES - 2));
        __syncthreads();  // stage t is in, and every warp is done with the stage the next copy overwrites
        const int next = t + STAGES - 1;
        if (next < steps)
            load_stage<BN, BM, THREADS, STAGES>(smem, W, X, n0, m0, M, k_begin + next * GEMM_BK, ldw, ldx,
                                                next % STAGES);
        asm volatile("cp.async.commit_group;\n" ::);
        const uint4* w_tile = smem + (t % STAGES) * (BN + BM) * 8;
        const uint4* x_tile = w_tile + BN * 8;
#pragma unroll
        for (int kk = 0; kk < GEMM_BK / 16; ++kk) {
            u32 a[MT][4];
#pragma unroll
            for (int i = 0; i < MT; ++i)  // rows 0-15 of the tile: lanes 0-15 words 2kk, lanes 16-31 words 2kk + 1
                ldmatrix4(a[i], smem_addr(w_tile + swizzled(wn * RW + i * 16 + lane % 16, 2 * kk + lane / 16)));
#pragma unroll
            for (int j = 0; j < NT; j += 2) {  // tokens j*8 .. j*8 + 15: b0, b1 of tile j, then of tile j + 1
                u32 b[4];
                const int row = wm * TW + j * 8 + lane % 8 + (lane / 16) * 8;
                ldmatrix4(b, smem_addr(x_tile + swizzled(row, 2 * kk + (lane / 8) % 2)));
#pragma unroll
                for (int i = 0; i < MT; ++i) {
                    mma_bf16(acc[i][j], a[i], b[0], b[1]);
                    mma_bf16(acc[i][j + 1], a[i], b[2], b[3]);
                }
            }
        }
    }
    asm volatile("cp.async.wait_group 0;\n" ::);
    __syncthreads();

    // the partial sums, token-major (a row of BN + 4 floats: the 32 lanes' writes fall in distinct banks)
    constexpr int LD = BN + 4;
    float* part = reinterpret_cast<float*>(smem);
    const int g = lane / 4, q = lane % 4;
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
        for (int j = 0; j < NT; ++j) {
            const int f = wn * RW + i * 16 + g, tok = wm * TW + j * 8 + 2 * q;
            part[tok * LD + f] = acc[i][j][0];
            part[(tok + 1) * LD + f] = acc[i][j][1];
            part[tok * LD + f + 8] = acc[i][j][2];
            part[(tok + 1) * LD + f + 8] = acc[i][j][3];
        }
    if constexpr (SPLIT > 1)
        cluster_sync();  // every program's partials written (and visible to the cluster)
    else
        __syncthreads();

    // 8 outputs a thread a pass; program `rank` of the cluster writes items rank, rank + SPLIT, ...
    constexpr int ITEMS = BM * BN / 8;
    for (int it = rank * THREADS + threadIdx.x; it < ITEMS; it += SPLIT * THREADS) {
        const int tok = it / (BN / 8), f = it % (BN / 8) * 8;
        if (m0 + tok >= M) continue;
        const long long at = (long long)(m0 + tok);
        store_sums8<SPLIT>(part + tok * LD + f, R, at * ldr + n0 + f, Y + at * ldy + n0 + f);
    }
    if constexpr (SPLIT > 1) cluster_sync();  // no program leaves while another still reads its partials
}

#define GEMM_PARAMS                                                                                                 \
    const bf16_t *__restrict__ X, const bf16_t *__restrict__ W, bf16_t *Y, const bf16_t *R, int M, int K,          \
        long long ldx, long long ldw, long long ldy, long long ldr
#define GEMM_KERNEL(name, BN, BM, WN, WM, SPLIT, STAGES)                                                           \
    extern "C" __global__ void __cluster_dims__(SPLIT, 1, 1) __launch_bounds__(WN * WM * 32) name(GEMM_PARAMS) {   \
        gemm_body<BN, BM, WN, WM, SPLIT, STAGES>(X, W, Y, R, M, K, ldx, ldw, ldy, ldr);                            \
    }
