"""A decoder layer's o projection, gate|up, SiLU and down projection in one persistent kernel, against the engine's
four launches (cuBLAS, SiLU, cuBLAS), 28 layers of the Qwen3-0.6B shape in one CUDA graph.

    python benchmark/offline/mlp_persistent.py [--rows 16,32,64] [--configs "4,3,0;4,3,1;8,3,2"] [--json out.json]

Why: a decode step's GEMMs take 5-8 us each for 4-12 MB (1-3 us of bytes), and neither a GEMM of our own nor one
that asks for its weight before the kernel before it finishes takes that down (docs/benchmarks.md, "The GEMM's own
weight asked into L2"): the time is each kernel's chain of loads, products, partial sums and writes. A kernel whose
programs stay resident runs the o projection, then gate|up with SiLU, then down, each phase split over every SM, with
a barrier over the grid between them instead of a launch (the ceiling of a layer's fused MLP half).

The phases (one program an SM, each takes the phase's work items in turn):
  1. o: h = residual + a Wo^T, 64-column tiles with K split in SPLIT_O; the last program of a tile (its ticket)
     adds the partials in split order and the residual, writes h over the residual and the tile's sums of squares;
  2. gate|up: 32 columns of gate and the same of up over all of K, each row times 1 / rms(h) (the norm folded into
     the weight, as the engine's fold), silu(gate) * up, written to the activation;
  3. down: residual + act Wd^T as in 1.
Rounded where the engine's kernels round (the products' float32 sums to bf16, the row scale, silu, the product).
Barriers: an arrival counter that every program increments and then reads until it holds the phase's target; the
last program out resets it for the next replay. Under Triton's interpreter (programs one after another) the phases
run as three launches instead (PHASE 1-3), which is what the CPU test checks. Options of the fused kernel
(`--configs`, warps,stages,mode): mode 1 asks every program's gate|up and down weights into L2 at the start, mode 2
loads its down weight into registers at the start. Measured on an H200: slower than the engine in every
configuration (docs/benchmarks.md, "A layer's MLP half in one persistent kernel").
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

H, KO, INTER = 1024, 2048, 3072  # Qwen3-0.6B: hidden, q heads x head dim, intermediate
BLOCK_M, BN, BK, GU_BN = 64, 64, 128, 32
SPLIT_O, SPLIT_D = 8, 8


@triton.jit
def _barrier(Bar, target):
    """Every program of the grid waits here until `target` arrivals have been counted."""
    tl.debug_barrier()  # this program's stores are issued before it arrives
    tl.atomic_add(Bar, 1, sem="release", scope="gpu")
    seen = tl.atomic_add(Bar, 0, sem="acquire", scope="gpu")
    while seen < target:
        seen = tl.atomic_add(Bar, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def _prefetch(P):
    """Ask the lines at the pointers P into L2 (no registers filled)."""
    tl.inline_asm_elementwise(
        "prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [P], dtype=tl.int32, is_pure=False, pack=1
    )


@triton.jit
def _split_gemm_add(
    X, W, R, Part, Counters, SS, item, M, stride_x, stride_r, K: tl.constexpr, N: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, WRITE_SS: tl.constexpr,
):  # fmt: skip
    """Work item `item` of R += X W^T: tile item // SPLIT, K range item % SPLIT; the tile's last ticket adds."""
    s = item % SPLIT
    rows = tl.arange(0, BLOCK_M)
    cols = (item // SPLIT) * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    kpart: tl.constexpr = K // SPLIT
    acc = tl.zeros((BLOCK_M, BN), tl.float32)
    for k0 in range(s * kpart, (s + 1) * kpart, BK):
        x = tl.load(X + rows[:, None] * stride_x + (k0 + rk)[None, :], mask=rows[:, None] < M, other=0.0,
                    cache_modifier=".cg")  # fmt: skip
        w = tl.load(W + cols[:, None].to(tl.int64) * K + (k0 + rk)[None, :])
        acc += tl.dot(x, tl.trans(w))
    _add_partial(acc, R, Part, Counters, SS, item, M, stride_r, N, SPLIT, BLOCK_M, BN, WRITE_SS)


@triton.jit
def _add_partial(
    acc, R, Part, Counters, SS, item, M, stride_r, N: tl.constexpr, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr,
    BN: tl.constexpr, WRITE_SS: tl.constexpr,
):  # fmt: skip
    """Item `item`'s partial sums written; the tile's last ticket adds them in split order and the residual."""
    tile = item // SPLIT
    s = item % SPLIT
    rows = tl.arange(0, BLOCK_M)
    cols = tile * BN + tl.arange(0, BN)
    offs = rows[:, None] * N + cols[None, :]
    tl.store(Part + s * BLOCK_M * N + offs, acc)
    tl.debug_barrier()
    ticket = tl.atomic_add(Counters + tile, 1, sem="acq_rel", scope="gpu")
    if ticket == SPLIT - 1:
        total = tl.zeros((BLOCK_M, BN), tl.float32)
        for p in range(SPLIT):
            total += tl.load(Part + p * BLOCK_M * N + offs, cache_modifier=".cg")
        mask = rows[:, None] < M
        r_ptr = R + rows[:, None] * stride_r + cols[None, :]
        total += tl.load(r_ptr, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
        h = total.to(R.dtype.element_ty)
        tl.store(r_ptr, h, mask=mask)
        if WRITE_SS:  # the tile's share of each row's sum of squares, for the next phase's 1 / rms
            hf = h.to(tl.float32)
            tl.store(SS + tile * BLOCK_M + rows, tl.sum(hf * hf, 1))
        tl.atomic_xchg(Counters + tile, 0, sem="relaxed", scope="gpu")


@triton.jit
def _mlp_kernel(
    A, Wo, R, Wgu, Wd, Act, Part, SS, Counters, Bar, M, eps, stride_a, stride_r, stride_act,
    H: tl.constexpr, KO: tl.constexpr, INTER: tl.constexpr, BLOCK_M: tl.constexpr, BN: tl.constexpr,
    BK: tl.constexpr, GU_BN: tl.constexpr, SPLIT_O: tl.constexpr, SPLIT_D: tl.constexpr, PHASE: tl.constexpr,
    PREFETCH: tl.constexpr, HOLD: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    progs = tl.num_programs(0)
    rows = tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BK)
    d_items: tl.constexpr = (H // BN) * SPLIT_D
    if HOLD:  # this program's down item's weight read into registers now, used after the second barrier
        tl.static_assert(INTER // SPLIT_D == 3 * BK)
        d_base = Wd + ((pid % d_items) // SPLIT_D * BN + tl.arange(0, BN))[:, None].to(tl.int64) * INTER
        d_base += (pid % SPLIT_D) * (INTER // SPLIT_D) + rk[None, :]
        wd0 = tl.load(d_base)
        wd1 = tl.load(d_base + BK)
        wd2 = tl.load(d_base + 2 * BK)
    if PREFETCH:  # the weights of this program's first gate|up and down items asked into L2 before phase 1
        lines = tl.arange(0, H // 64) * 64  # a 128-byte line every 64 bf16 elements
        if pid < INTER // GU_BN:
            gu_rows = pid * GU_BN + tl.arange(0, GU_BN)
            for half in range(2):
                _prefetch(Wgu + (half * INTER + gu_rows)[:, None].to(tl.int64) * H + lines[None, :])
        if pid < (H // BN) * SPLIT_D:
            d_rows = (pid // SPLIT_D) * BN + tl.arange(0, BN)
            n_lines: tl.constexpr = INTER // SPLIT_D // 64
            # a power-of-two range, the lines past the split's clamped to its last (asked twice, costing nothing)
            d_lines = (pid % SPLIT_D) * (INTER // SPLIT_D) + tl.minimum(tl.arange(0, 8), n_lines - 1) * 64
            _prefetch(Wd + d_rows[:, None].to(tl.int64) * INTER + d_lines[None, :])
    if PHASE == 0 or PHASE == 1:
        for item in range(pid, (H // BN) * SPLIT_O, progs):
            _split_gemm_add(A, Wo, R, Part, Counters, SS, item, M, stride_a, stride_r, KO, H, SPLIT_O, BLOCK_M, BN,
                            BK, True)  # fmt: skip
    if PHASE == 0:
        _barrier(Bar, progs)
    if PHASE == 0 or PHASE == 2:
        ss = tl.sum(
            tl.load(SS + tl.arange(0, H // BN)[:, None] * BLOCK_M + rows[None, :], cache_modifier=".cg"), 0
        )
        scale = tl.rsqrt(ss / H + eps)[:, None]
        for item in range(pid, INTER // GU_BN, progs):
            cols = item * GU_BN + tl.arange(0, GU_BN)
            acc_g = tl.zeros((BLOCK_M, GU_BN), tl.float32)
            acc_u = tl.zeros((BLOCK_M, GU_BN), tl.float32)
            for k0 in range(0, H, BK):
                x = tl.load(R + rows[:, None] * stride_r + (k0 + rk)[None, :], mask=rows[:, None] < M, other=0.0,
                            cache_modifier=".cg")  # fmt: skip
                wg = tl.load(Wgu + cols[:, None].to(tl.int64) * H + (k0 + rk)[None, :])
                wu = tl.load(Wgu + (INTER + cols)[:, None].to(tl.int64) * H + (k0 + rk)[None, :])
                acc_g += tl.dot(x, tl.trans(wg))
                acc_u += tl.dot(x, tl.trans(wu))
            # rounded as the engine rounds: the product to bf16, times the row's 1 / rms, silu, the product
            gate = (acc_g.to(Act.dtype.element_ty).to(tl.float32) * scale).to(Act.dtype.element_ty)
            up = (acc_u.to(Act.dtype.element_ty).to(tl.float32) * scale).to(Act.dtype.element_ty)
            g = gate.to(tl.float32)
            act = (g / (1.0 + tl.exp(-g))).to(Act.dtype.element_ty)
            out = (act.to(tl.float32) * up.to(tl.float32)).to(Act.dtype.element_ty)
            tl.store(Act + rows[:, None] * stride_act + cols[None, :], out, mask=rows[:, None] < M)
    if PHASE == 0:
        _barrier(Bar, 2 * progs)
    if HOLD:
        if pid < d_items:
            x_base = Act + rows[:, None] * stride_act + (pid % SPLIT_D) * (INTER // SPLIT_D) + rk[None, :]
            xm = rows[:, None] < M
            acc = tl.dot(tl.load(x_base, mask=xm, other=0.0, cache_modifier=".cg"), tl.trans(wd0))
            acc += tl.dot(tl.load(x_base + BK, mask=xm, other=0.0, cache_modifier=".cg"), tl.trans(wd1))
            acc += tl.dot(tl.load(x_base + 2 * BK, mask=xm, other=0.0, cache_modifier=".cg"), tl.trans(wd2))
            _add_partial(
                acc, R, Part, Counters + H // BN, SS, pid, M, stride_r, H, SPLIT_D, BLOCK_M, BN, False
            )
    elif PHASE == 0 or PHASE == 3:
        for item in range(pid, (H // BN) * SPLIT_D, progs):
            _split_gemm_add(Act, Wd, R, Part, Counters + H // BN, SS, item, M, stride_act, stride_r, INTER, H,
                            SPLIT_D, BLOCK_M, BN, BK, False)  # fmt: skip
    if PHASE == 0:  # the last program out resets the barrier for the next launch
        tl.debug_barrier()
        if tl.atomic_add(Bar + 1, 1, sem="acq_rel", scope="gpu") == progs - 1:
            tl.atomic_xchg(Bar, 0, sem="relaxed", scope="gpu")
            tl.atomic_xchg(Bar + 1, 0, sem="relaxed", scope="gpu")


class Workspace:
    """The kernel's partial sums, row sums of squares, tickets and barrier counters (zeroed once)."""

    def __init__(self, device: torch.device) -> None:
        self.part = torch.empty(max(SPLIT_O, SPLIT_D) * BLOCK_M * H, dtype=torch.float32, device=device)
        self.ss = torch.zeros((H // BN) * BLOCK_M, dtype=torch.float32, device=device)
        self.counters = torch.zeros(2 * (H // BN), dtype=torch.int32, device=device)
        self.bar = torch.zeros(2, dtype=torch.int32, device=device)


def mlp_half(
    a: torch.Tensor, wo: torch.Tensor, residual: torch.Tensor, wgu: torch.Tensor, wd: torch.Tensor, act: torch.Tensor,
    ws: Workspace, eps: float, programs: int, fused: bool, config: tuple[int, int, int] = (4, 2, 0),
    phases: tuple[int, ...] = (1, 2, 3),
) -> torch.Tensor:  # fmt: skip
    """residual (consumed) + o, then + down(silu(gate) * up) of its normalised rows: the new residual stream.
    Not fused, `phases` picks the launches (one alone: its time, the others' work not done)."""
    m = a.shape[0]
    assert m <= BLOCK_M and a.stride(1) == residual.stride(1) == act.stride(1) == 1
    args = (a, wo, residual, wgu, wd, act, ws.part, ws.ss, ws.counters, ws.bar, m, eps, a.stride(0),
            residual.stride(0), act.stride(0))  # fmt: skip
    consts = dict(
        H=H, KO=KO, INTER=INTER, BLOCK_M=BLOCK_M, BN=BN, BK=BK, GU_BN=GU_BN, SPLIT_O=SPLIT_O, SPLIT_D=SPLIT_D
    )
    for phase in (0,) if fused else phases:
        # mode 1: the later phases' weights asked into L2 at the start; 2: the down weight held in registers
        warps, stages, mode = config
        _mlp_kernel[(programs,)](
            *args, **consts, PHASE=phase, PREFETCH=mode == 1 and fused, HOLD=mode == 2 and fused,
            num_warps=warps, num_stages=stages,
        )  # fmt: skip
    return residual


def engine_half(
    a: torch.Tensor, wo: torch.Tensor, residual: torch.Tensor, wgu: torch.Tensor, wd: torch.Tensor, eps: float
) -> torch.Tensor:
    """The engine's launches for the same work (linear_add, linear, silu_and_mul with the row scale)."""
    from minisgl.kernel.activation import silu_and_mul
    from minisgl.layers.linear import linear, linear_add

    h = linear_add(a, wo, residual)
    return linear_add(silu_and_mul(linear(h, wgu), (h, eps)), wd, h)


def reference(a, wo, residual, wgu, wd, eps):  # type: ignore[no-untyped-def]
    """The same in float32 (rounded to the stream's dtype where the engine rounds the residual)."""
    h = (residual.float() + a.float() @ wo.float().T).to(residual.dtype)
    hf = h.float()
    scale = torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)
    gu = (hf @ wgu.float().T) * scale
    gate, up = gu.chunk(2, dim=-1)
    act = torch.nn.functional.silu(gate) * up
    return (hf + act @ wd.float().T).to(residual.dtype)


def graph_ms(fn: Callable[[], None], replays: int = 20) -> float:
    """ms a replay of `fn` captured in a CUDA graph (after a run outside it, which compiles)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(3):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / replays


def measure(
    m: int, weights: list[tuple[torch.Tensor, ...]], ws: Workspace, programs: int, eps: float,
    configs: list[tuple[int, int, int]],
) -> dict:  # fmt: skip
    """One layer's error against float32 both ways, then the 28 layers' graph time: the engine's launches, the
    phases as three launches, the fused kernel in each (warps, stages, mode) configuration (mode 0: plain; 1: the
    later phases' weights asked into L2 at the start; 2: the down weight held in registers from the start)."""
    dev, dt = weights[0][0].device, weights[0][0].dtype
    a = torch.randn(m, KO, device=dev).to(dt)
    r0 = torch.randn(m, H, device=dev).to(dt)
    act = torch.empty(m, INTER, device=dev, dtype=dt)
    wo, wgu, wd = weights[0]
    want = reference(a, wo, r0, wgu, wd, eps).float()
    row: dict[str, float] = {}
    runs: list[tuple[str, bool | None, tuple[int, int, int]]] = [("engine", None, configs[0])]
    runs.append(("phases", False, configs[0]))
    suffix = {0: "", 1: "_prefetch", 2: "_hold"}
    runs += [(f"fused_w{w}_s{st}{suffix[md]}", True, (w, st, md)) for w, st, md in configs]
    for name, fused, config in runs:
        if fused is None:
            got = engine_half(a, wo, r0.clone(), wgu, wd, eps)
        else:
            got = mlp_half(a, wo, r0.clone(), wgu, wd, act, ws, eps, programs, fused, config)
        row[f"err_{name}"] = ((got.float() - want).norm() / want.norm()).item()
        assert not ws.bar.any() and not ws.counters.any()

        def step(fused: bool | None = fused, config: tuple[int, int, int] = config) -> None:
            h = r0.clone()
            for wo, wgu, wd in weights:
                if fused is None:
                    h = engine_half(a, wo, h, wgu, wd, eps)
                else:
                    h = mlp_half(a, wo, h, wgu, wd, act, ws, eps, programs, fused, config)

        row[f"{name}_ms"] = graph_ms(step)
    for phase in (1, 2, 3):  # each phase alone, 28 launches: where the phases' time goes

        def alone(phase: int = phase) -> None:
            for wo, wgu, wd in weights:
                mlp_half(a, wo, r0, wgu, wd, act, ws, eps, programs, False, configs[0], (phase,))

        row[f"phase{phase}_ms"] = graph_ms(alone)
    from minisgl.kernel.activation import silu_and_mul
    from minisgl.layers.linear import linear, linear_add

    gu = torch.empty(m, 2 * INTER, device=dev, dtype=dt)
    parts = {  # the engine's launches one kind at a time, 28 of each
        "o": lambda wo, wgu, wd: linear_add(a, wo, r0),
        "gate_up": lambda wo, wgu, wd: linear(r0, wgu),
        "silu": lambda wo, wgu, wd: silu_and_mul(gu, (r0, eps)),
        "down": lambda wo, wgu, wd: linear_add(act, wd, r0),
    }
    for name, part in parts.items():

        def kind(part: Callable[..., object] = part) -> None:
            for w in weights:
                part(*w)

        row[f"engine_{name}_ms"] = graph_ms(kind)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="16,32,64")
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--json", default=None)
    p.add_argument(
        "--configs",
        default="4,3,0;4,3,1;8,3,2",
        help="the fused kernel's warps,stages,mode; ... (mode: measure's)",
    )
    args = p.parse_args()
    configs = [(int(w), int(st), int(md)) for w, st, md in (c.split(",") for c in args.configs.split(";"))]
    dev = torch.device("cuda")
    torch.manual_seed(0)
    dt, eps = torch.bfloat16, 1e-6
    # each layer its own weights, so that none stays in L2 from one layer to the next
    weights = [
        ((torch.randn(H, KO, device=dev) * KO**-0.5).to(dt), (torch.randn(2 * INTER, H, device=dev) * H**-0.5).to(dt),
         (torch.randn(H, INTER, device=dev) * INTER**-0.5).to(dt))
        for _ in range(args.layers)
    ]  # fmt: skip
    ws = Workspace(dev)
    programs = torch.cuda.get_device_properties(dev).multi_processor_count
    results: dict = {"device": torch.cuda.get_device_name(dev), "programs": programs, "rows": {}}
    for m in [int(r) for r in args.rows.split(",")]:
        row = measure(m, weights, ws, programs, eps, configs)
        results["rows"][m] = row
        print(f"rows {m}: " + ", ".join(f"{k} {v:.4g}" for k, v in row.items()), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
