"""What a decode step's chain of weight reads costs as kernels and as phases of one persistent kernel.

    python benchmark/offline/phase_cost.py [--json out.json]

A Qwen3-0.6B decode step reads 28 layers x (q|k|v 8.4 MB, o 4.2, gate|up 12.6, down 6.3), 881 MB, 0.21 ms at
the copy rate, in 112 GEMMs that take 5-8 us each whether the rows are 1 or 256 (docs/benchmarks.md, "A decode
GEMM on the tensor cores"). Before building a persistent kernel for a layer's products, the parts of that cost,
each timed as 112 steps in one CUDA graph (one program an SM, 256 threads, each program's share of each weight a
contiguous run of bytes copied into shared memory with cp.async):
- `empty`: 112 launches of a kernel that does nothing (the boundary between two kernels in a graph);
- `barriers`: one launch of 112 barriers over the grid (a counter each program increments, then reads until it
  holds the phase's target), nothing else;
- `kernels`: 112 launches, each reading one weight's shares (the chain as kernels, without products);
- `kernels, PDL`: the same launched with programmatic dependent launch, each kernel letting the next start at once
  and asking for its weight before it waits for the one before (`griddepcontrol`), beside the same kernel
  launched plainly (one 96 KB buffer a program, so that two kernels' programs fit an SM);
- `phases`: one launch, a barrier after each weight's shares are in;
- `prefetch`: one launch, each program asking for the next weight's share before it waits at the barrier, so
  that DRAM streams across the phases;
- `ring`: one launch, the shares streamed through a ring of 24 chunks of 8 KB asked for 23 ahead across the
  phases (about three phases' shares in flight), a barrier when a phase's chunks are in;
- `waits on F`: one launch, the next weight asked for early, and instead of a barrier each program's phase waits
  only for F programs' previous phase (spread over the grid; each sets a flag when done): what a layer kernel
  whose phases depend on each other tile by tile would pay;
- `stream`: the 881 MB read by one launch with no barrier (the access pattern's own rate).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from skinny_gemm import graph_ms  # noqa: E402

from minisgl.kernel.cuda import load_module  # noqa: E402

SOURCE = r"""
typedef unsigned int u32;
#define THREADS 256
#define BUF (96 * 1024)

__device__ __forceinline__ void copy16(u32 dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src));
}

// this program's share of a weight of `bytes` (a multiple of 16 * gridDim.x) into buffer `buf` (a share larger
// than the buffer wraps around it: only `stream` asks for one)
__device__ __forceinline__ void ask(const char* w, long long bytes, int buf, char* smem) {
    const long long share = bytes / gridDim.x;
    const char* src = w + blockIdx.x * share;
    const u32 dst = (u32)__cvta_generic_to_shared(smem + buf * BUF);
    for (long long i = threadIdx.x * 16; i < share; i += THREADS * 16) copy16(dst + (u32)(i % BUF), src + i);
    asm volatile("cp.async.commit_group;\n" ::);
}

// a word of the share read back, so that the copy is used
__device__ __forceinline__ void use(const char* smem, int buf, float* sink) {
    const float v = reinterpret_cast<const float*>(smem + buf * BUF)[threadIdx.x];
    if (v == 12345.678f) sink[blockIdx.x] = v;
}

__device__ __forceinline__ void grid_barrier(u32* counter, u32 target) {
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        atomicAdd(counter, 1u);
        u32 seen;
        do {
            asm volatile("ld.acquire.gpu.global.u32 %0, [%1];\n" : "=r"(seen) : "l"(counter));
        } while (seen < target);
    }
    __syncthreads();
}

extern "C" __global__ void empty_kernel(float* sink) {
    if (threadIdx.x == 1023) sink[0] = 1.0f;
}

extern "C" __global__ void barrier_kernel(u32* counter, int phases) {
    for (int p = 0; p < phases; ++p) grid_barrier(counter, (p + 1) * gridDim.x);
}

extern "C" __global__ void read_kernel(const char* w, long long bytes, float* sink) {
    extern __shared__ char smem[];
    ask(w, bytes, 0, smem);
    asm volatile("cp.async.wait_group 0;\n" ::);
    __syncthreads();
    use(smem, 0, sink);
}

// read_kernel launched with programmatic dependent launch: it lets the next kernel launch at once and asks for its
// weight (which depends on nothing) before it waits for the kernel before it, as a GEMM's activations would
// (wait 0: it never waits, so that with the launch programmatic, kernels overlap as far as the SMs let them)
extern "C" __global__ void read_pdl_kernel(const char* w, long long bytes, float* sink, int wait) {
    extern __shared__ char smem[];
    asm volatile("griddepcontrol.launch_dependents;\n" ::);
    ask(w, bytes, 0, smem);
    if (wait) asm volatile("griddepcontrol.wait;\n" ::: "memory");
    asm volatile("cp.async.wait_group 0;\n" ::);
    __syncthreads();
    use(smem, 0, sink);
}

__device__ __forceinline__ unsigned long long now_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// a pair that says whether a programmatic launch starts early: the first kernel lets dependents launch, then
// spins for `spin_ns` and writes when it began and ended; the second writes when it began
extern "C" __global__ void spin_kernel(unsigned long long* times, long long spin_ns) {
    asm volatile("griddepcontrol.launch_dependents;\n" ::);
    const unsigned long long t0 = now_ns();
    while (now_ns() - t0 < (unsigned long long)spin_ns) {
    }
    if (threadIdx.x == 0 && blockIdx.x == 0) times[0] = t0, times[1] = now_ns();
}

extern "C" __global__ void stamp_kernel(unsigned long long* times, int wait) {
    if (threadIdx.x == 0 && blockIdx.x == 0) times[2] = now_ns();
    if (wait) asm volatile("griddepcontrol.wait;\n" ::: "memory");
}

// weights: `phases` pointers and byte counts; prefetch: ask for phase p + 1 before waiting on phase p's barrier
extern "C" __global__ void chain_kernel(const char* const* ws, const long long* bytes, int phases, u32* counter,
                                        int prefetch, int barriers, float* sink) {
    extern __shared__ char smem[];
    if (prefetch) ask(ws[0], bytes[0], 0, smem);
    for (int p = 0; p < phases; ++p) {
        if (prefetch) {
            if (p + 1 < phases) ask(ws[p + 1], bytes[p + 1], (p + 1) % 2, smem);
            else asm volatile("cp.async.commit_group;\n" ::);
            asm volatile("cp.async.wait_group 1;\n" ::);
        } else {
            ask(ws[p], bytes[p], p % 2, smem);
            asm volatile("cp.async.wait_group 0;\n" ::);
        }
        __syncthreads();
        use(smem, p % 2, sink);
        if (barriers) grid_barrier(counter, (p + 1) * gridDim.x);
    }
}
"""

RING = r"""
#define CHUNK (8 * 1024)
#define SLOTS 24

// where the program asks next: a phase and an offset in its share (the shares in phase order, each a whole
// number of chunks)
struct Cursor {
    int p;
    long long at;
};

// the chunk at the cursor into ring slot j % SLOTS (nothing past the last phase: an empty group), cursor moved on
__device__ __forceinline__ void ask_chunk(const char* const* ws, const long long* bytes, int phases, Cursor& cur,
                                          int j, char* smem) {
    if (cur.p < phases) {
        const long long share = bytes[cur.p] / gridDim.x;
        const char* src = ws[cur.p] + blockIdx.x * share;
        const u32 dst = (u32)__cvta_generic_to_shared(smem + (j % SLOTS) * CHUNK);
        for (int i = threadIdx.x * 16; i < CHUNK; i += THREADS * 16)
            if (cur.at + i < share) copy16(dst + i, src + cur.at + i);
        cur.at += CHUNK;
        if (cur.at >= share) cur.p += 1, cur.at = 0;
    }
    asm volatile("cp.async.commit_group;\n" ::);
}

// the weights' shares streamed through a ring of SLOTS chunks, SLOTS - 1 asked ahead across the phases, a
// barrier over the grid when a phase's chunks are in
extern "C" __global__ void ring_kernel(const char* const* ws, const long long* bytes, int phases, u32* counter,
                                       float* sink) {
    extern __shared__ char smem[];
    Cursor cur = {0, 0};
    int j = 0;
    for (; j < SLOTS - 1; ++j) ask_chunk(ws, bytes, phases, cur, j, smem);
    int next = 0;  // the next chunk to consume
    for (int p = 0; p < phases; ++p) {
        const int chunks = (int)((bytes[p] / gridDim.x + CHUNK - 1) / CHUNK);
        for (int c = 0; c < chunks; ++c, ++next) {
            asm volatile("cp.async.wait_group %0;\n" ::"n"(SLOTS - 2));
            __syncthreads();
            ask_chunk(ws, bytes, phases, cur, j++, smem);
            use(smem + (next % SLOTS) * CHUNK, 0, sink);
        }
        grid_barrier(counter, (p + 1) * gridDim.x);
    }
    asm volatile("cp.async.wait_group 0;\n" ::);
}

// tile-by-tile dependencies instead of a barrier: a program's phase p waits only for `fanin` programs' phase
// p - 1 (spread over the grid), each of which sets its own flag when its phase is done; the next weight asked for
// before the wait, as in chain_kernel's prefetch
extern "C" __global__ void local_kernel(const char* const* ws, const long long* bytes, int phases, u32* flags,
                                        int fanin, float* sink) {
    extern __shared__ char smem[];
    ask(ws[0], bytes[0], 0, smem);
    for (int p = 0; p < phases; ++p) {
        if (p + 1 < phases) ask(ws[p + 1], bytes[p + 1], (p + 1) % 2, smem);
        else asm volatile("cp.async.commit_group;\n" ::);
        asm volatile("cp.async.wait_group 1;\n" ::);
        if (p > 0 && threadIdx.x < fanin) {
            const int dep = (blockIdx.x + threadIdx.x * (gridDim.x / fanin)) % gridDim.x;
            const u32* flag = flags + (p - 1) * gridDim.x + dep;
            u32 seen;
            do {
                asm volatile("ld.acquire.gpu.global.u32 %0, [%1];\n" : "=r"(seen) : "l"(flag));
            } while (seen == 0);
        }
        __syncthreads();
        use(smem, p % 2, sink);
        __syncthreads();
        if (threadIdx.x == 0) {
            __threadfence();
            asm volatile("st.release.gpu.global.u32 [%0], %1;\n" ::"l"(flags + p * gridDim.x + blockIdx.x), "r"(1u));
        }
    }
}
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--layers", type=int, default=28)
    args = ap.parse_args()
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    mod = load_module(SOURCE + RING, "phase_cost.cu")
    shared = 2 * 96 * 1024
    for name in ("read_kernel", "chain_kernel", "ring_kernel", "local_kernel"):
        mod.allow_shared(name, shared)
    half = 96 * 1024  # one buffer: two programs of consecutive kernels fit an SM side by side
    mod.allow_shared("read_pdl_kernel", half)

    stream = lambda: torch.cuda.current_stream().cuda_stream  # noqa: E731
    sink = torch.zeros(sms, device=dev)
    counter = torch.zeros(1, dtype=torch.int32, device=dev)
    # a layer's weights, bytes rounded to a multiple of the programs' 16-byte words
    sizes = [4096 * 1024 * 2, 1024 * 2048 * 2, 6144 * 1024 * 2, 1024 * 3072 * 2]
    sizes = [s // (16 * sms) * 16 * sms for s in sizes]
    weights = [torch.empty(s, dtype=torch.uint8, device=dev) for _ in range(args.layers) for s in sizes]
    for w in weights:
        w.random_(0, 256)
    phases = len(weights)
    ptrs = torch.tensor([w.data_ptr() for w in weights], dtype=torch.int64, device=dev)
    nbytes = torch.tensor([w.numel() for w in weights], dtype=torch.int64, device=dev)
    total = sum(w.numel() for w in weights)
    big = torch.cat([w for w in weights])[: total // (16 * sms) * 16 * sms]

    def empty() -> None:
        for _ in range(phases):
            mod.launch("empty_kernel", (sms, 1, 1), 256, (sink.data_ptr(),), stream())

    def barriers() -> None:
        counter.zero_()
        mod.launch("barrier_kernel", (sms, 1, 1), 256, (counter.data_ptr(), ctypes.c_int32(phases)), stream())

    def kernels() -> None:
        for w in weights:
            args_ = (w.data_ptr(), ctypes.c_int64(w.numel()), sink.data_ptr())
            mod.launch("read_kernel", (sms, 1, 1), 256, args_, stream(), shared)

    def kernels_pdl(pdl: bool, wait: int = 1) -> None:
        for w in weights:
            args_ = (w.data_ptr(), ctypes.c_int64(w.numel()), sink.data_ptr(), ctypes.c_int32(wait))
            mod.launch("read_pdl_kernel", (sms, 1, 1), 256, args_, stream(), half, programmatic=pdl)

    def chain(prefetch: int, with_barriers: int = 1) -> None:
        counter.zero_()
        args_ = (
            ptrs.data_ptr(), nbytes.data_ptr(), ctypes.c_int32(phases), counter.data_ptr(),
            ctypes.c_int32(prefetch), ctypes.c_int32(with_barriers), sink.data_ptr(),
        )  # fmt: skip
        mod.launch("chain_kernel", (sms, 1, 1), 256, args_, stream(), shared)

    def ring() -> None:
        counter.zero_()
        args_ = (
            ptrs.data_ptr(),
            nbytes.data_ptr(),
            ctypes.c_int32(phases),
            counter.data_ptr(),
            sink.data_ptr(),
        )
        mod.launch("ring_kernel", (sms, 1, 1), 256, args_, stream(), shared)

    flags = torch.zeros(phases * sms, dtype=torch.int32, device=dev)

    def local(fanin: int) -> None:
        flags.zero_()
        args_ = (
            ptrs.data_ptr(), nbytes.data_ptr(), ctypes.c_int32(phases), flags.data_ptr(), ctypes.c_int32(fanin),
            sink.data_ptr(),
        )  # fmt: skip
        mod.launch("local_kernel", (sms, 1, 1), 256, args_, stream(), shared)

    def streamed() -> None:
        args_ = (big.data_ptr(), ctypes.c_int64(big.numel()), sink.data_ptr())
        # one program an SM reads 1/sms of the 881 MB: more than a buffer, so in several rounds
        mod.launch("read_kernel", (sms, 1, 1), 256, args_, stream(), shared)

    def eager_ms(pdl: bool, wait: int, chunks: int = 16) -> float:
        """The 881 MB read by `chunks` kernels launched eagerly (each long enough that the host keeps ahead): whether
        programmatic launches overlap outside a graph."""
        step = big.numel() // chunks // (16 * sms) * 16 * sms
        times = []
        for _ in range(5):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            for i in range(chunks):
                args_ = (
                    big.data_ptr() + i * step,
                    ctypes.c_int64(step),
                    sink.data_ptr(),
                    ctypes.c_int32(wait),
                )
                mod.launch("read_pdl_kernel", (sms, 1, 1), 256, args_, stream(), half, programmatic=pdl)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return sorted(times)[2]

    def early_start_us(pdl: bool, wait: int = 0) -> float:
        """How long before the first kernel ended the second began (negative: after), both launched on a created
        stream, the second programmatically or not."""
        times = torch.zeros(3, dtype=torch.int64, device=dev)
        with torch.cuda.stream(torch.cuda.Stream()):
            s_ = stream()
            for _ in range(3):  # the last of three, each kernel loaded by then
                mod.launch("spin_kernel", (4, 1, 1), 32, (times.data_ptr(), ctypes.c_int64(50_000)), s_)
                args_ = (times.data_ptr(), ctypes.c_int32(wait))
                mod.launch("stamp_kernel", (1, 1, 1), 32, args_, s_, programmatic=pdl)
            torch.cuda.synchronize()
        t = times.tolist()
        return (t[1] - t[2]) / 1e3

    early = {
        "plain": early_start_us(False),
        "programmatic": early_start_us(True),
        "programmatic, waiting after the stamp": early_start_us(True, 1),
    }
    print(f"the second kernel began before the first ended by: {early} us (a 50 us spin)")

    rows = {}
    rows["eager, 16 kernels"] = eager_ms(False, 1)
    rows["eager, 16 kernels, PDL"] = eager_ms(True, 1)
    rows["eager, 16 kernels, PDL, no wait"] = eager_ms(True, 0)
    with torch.cuda.stream(torch.cuda.Stream()):  # a created stream, not the legacy default one
        rows["eager on a created stream, 16 kernels"] = eager_ms(False, 1)
        rows["eager on a created stream, 16 kernels, PDL, no wait"] = eager_ms(True, 0)
    rows["empty"] = graph_ms(empty)
    rows["barriers"] = graph_ms(barriers)
    rows["kernels"] = graph_ms(kernels)
    rows["kernels, one buffer"] = graph_ms(lambda: kernels_pdl(False))
    rows["kernels, one buffer, PDL"] = graph_ms(lambda: kernels_pdl(True))
    rows["kernels, one buffer, PDL, no wait"] = graph_ms(lambda: kernels_pdl(True, 0))
    rows["phases"] = graph_ms(lambda: chain(0))
    rows["prefetch"] = graph_ms(lambda: chain(1))
    rows["prefetch, no barriers"] = graph_ms(lambda: chain(1, 0))
    rows["ring"] = graph_ms(ring)
    for fanin in (1, 4, 16, sms):
        rows[f"waits on {fanin}"] = graph_ms(lambda f=fanin: local(f))
    rows["stream"] = graph_ms(streamed)
    floor = total / 4.2e12 * 1e3
    print(f"{phases} steps, {total / 1e6:.0f} MB of weights, {floor:.3f} ms at 4.2 TB/s")
    for name, ms in rows.items():
        print(f"{name:24s} {ms:7.3f} ms  {ms * 1e3 / phases:6.2f} us a step  {total / ms / 1e9:6.2f} TB/s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"phases": phases, "bytes": total, "ms": rows, "early_start_us": early}, f, indent=1)


if __name__ == "__main__":
    main()
