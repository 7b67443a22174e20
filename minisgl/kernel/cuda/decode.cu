// Paged decode attention on the CUDA cores: one query token a request, K/V rows gathered through the page table
// from a bf16 or FP8 (e4m3) pool, head dim 128. minisgl/kernel/cuda/decode.py instantiates DECODE_KERNEL for
// the query heads a KV head (G), the keys a thread group loads a step (U), the threads a key (LANES) and the pool.
//
// A program is one (KV head, request, split) with 128 threads in groups of LANES; a group takes one key at a
// time, each thread 128 / LANES of its dims, so that a thread's K and V bytes are one load each (or two),
// widened in registers and multiplied into its own dims of the output: no shared-memory layout change, which
// is what bounds Triton's FP8 kernel (docs/benchmarks.md, "Decode attention in CUDA C++"). Rows are loaded a
// step ahead and their slots two steps ahead, so no load in the loop waits on another. The groups' partial
// softmax states are joined through shared memory at the end. Splits write float32 partial outputs and their
// base-2 log-sum-exp for the Triton merge kernel (minisgl/kernel/attention.py's _decode_merge_kernel).
// decode_common.cuh comes before it (its types, bf16 conversions and the output write).

// two e4m3 bytes (element 0 in the low byte) to two floats, through one f16x2 conversion
__device__ __forceinline__ void e4m3x2_to_f32(unsigned short two, float& a, float& b) {
    u32 h2;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h2) : "h"(two));
    unsigned short lo = h2 & 0xffff, hi = h2 >> 16;
    asm("cvt.f32.f16 %0, %1;" : "=f"(a) : "h"(lo));
    asm("cvt.f32.f16 %0, %1;" : "=f"(b) : "h"(hi));
}

// one thread's N elements of a row (N = 8, 16 or 32): N bytes of e4m3, or 2N bytes of bf16, in 16-byte words
// (one 8-byte word for 8 e4m3 bytes)
template <int BYTES> struct Words { uint4 w[BYTES / 16]; };
template <> struct Words<8> { uint2 w[1]; };
template <bool FP8, int N> using Row = Words<N * (FP8 ? 1 : 2)>;

template <bool FP8, int N>
__device__ __forceinline__ Row<FP8, N> load_row(const char* p) {
    constexpr int BYTES = N * (FP8 ? 1 : 2);
    Row<FP8, N> r;
    if constexpr (BYTES == 8) {
        r.w[0] = __ldg(reinterpret_cast<const uint2*>(p));
    } else {
#pragma unroll
        for (int i = 0; i < BYTES / 16; ++i) r.w[i] = __ldg(reinterpret_cast<const uint4*>(p) + i);
    }
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

// grid (KV heads, requests, splits), 128 threads: groups of LANES threads (4, 8 or 16), a group one key at a time,
// a thread 128 / LANES dims.
// Scores are kept in base 2: q is multiplied by sm_scale * log2(e) (and the FP8 pool's K scale) once.
template <int G, int U, int LANES, bool FP8>
__device__ __forceinline__ void decode_body(DECODE_PARAMS) {
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
        write_dim(Out, MidO, MidLse, b, kvh * G + h, s, t, stride_ot, stride_oh, num_qo_heads, num_splits, o, sum,
                  mx, vscale);
        __syncthreads();
    }
}

#define DECODE_KERNEL(NAME, G, U, LANES, FP8)                                                                  \
    extern "C" __global__ void __launch_bounds__(128) NAME(DECODE_PARAMS) {                                    \
        wait_for_inputs();                                                                                     \
        decode_body<G, U, LANES, FP8>(DECODE_ARGS);                                                            \
    }
