"""A decode step's GEMMs on CUDA: cuBLAS (F.linear) against minisgl's split-K Triton GEMM (kernel/gemm.py).

    python benchmark/offline/skinny_gemm.py [--models qwen3-0.6b,llama3-8b] [--rows 1,8,64,256] [--sweep 1,64]

For each model shape and number of rows M: every layer's q|k|v, o, gate|up and down projections, each
layer its own weights (so the L2 cache holds none of them from one step to the next, as in a real
step), captured in one CUDA graph and replayed; the figure is a step's GEMM time and the weights' read
rate. `--sweep 1,64` also times tile configurations around the chosen one for every Qwen3-0.6B shape at
those rows, to check the heuristic. Every kernel's output is checked against a float32 product first.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from minisgl.kernel import gemm  # noqa: E402

# (layers, [(N, K) of q|k|v, o, gate|up, down])
MODELS = {
    "qwen3-0.6b": (28, [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072)]),
    "llama3-8b": (32, [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]),
}


def graph_ms(fn: Callable[[], None], replays: int = 20) -> float:
    """The median time of one replay of `fn` captured in a CUDA graph."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        fn()
        fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=stream):
        fn()
    return replay_ms(g, replays)


def replay_ms(g: torch.cuda.CUDAGraph, replays: int = 20) -> float:
    """The median time of one replay of the captured graph `g`."""
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def configs_around(m: int, n: int, k: int, sms: int, large: bool = False) -> list[gemm.GemmConfig]:
    base = gemm.choose_config(m, n, k, sms)
    if large:
        return configs_large(m, base)
    if m > gemm.MAX_ROWS:
        return configs_wide(m, base)
    out = {base}
    for bn in (32, 64, 128):
        for bk in (64, 128, 256):
            for mult in (0.5, 1, 2):
                split = max(1, int(base.split * mult))
                out.add(gemm.GemmConfig(base.block_m, bn, bk, split, 4, base.num_stages))
    for stages, warps in ((3, 4), (5, 4), (4, 8)):
        out.add(gemm.GemmConfig(base.block_m, base.block_n, base.block_k, base.split, warps, stages))
    return sorted(out, key=lambda c: (c != base, c.block_n, c.block_k, c.split, c.num_stages))


def configs_wide(m: int, base: gemm.GemmConfig) -> list[gemm.GemmConfig]:
    """Tiles for 32-256 rows, where cuBLAS's tiles leave SMs idle on the narrow outputs: rows 64 or 128
    (not past the padded batch), columns 64-128, K 64-128, 1-8 splits, 4 or 8 warps, 3 or 4 stages."""
    out = {base}
    for bm in (64, 128):
        if bm > max(64, triton.next_power_of_2(m)):
            continue
        for bn in (64, 128):
            for bk in (64, 128):
                for split in (1, 2, 4, 8):
                    for warps, stages in ((4, 3), (4, 4), (8, 3), (8, 4)):
                        if bm * bn >= 128 * 128 and warps == 4:
                            continue  # a 128 x 128 float32 accumulator over 4 warps spills
                        out.add(gemm.GemmConfig(bm, bn, bk, split, warps, stages))
    return sorted(out, key=lambda c: (c != base, c.block_m, c.block_n, c.block_k, c.split, c.num_warps))


def configs_large(m: int, base: gemm.GemmConfig) -> list[gemm.GemmConfig]:
    """Tiles for products whose FLOPs bound them (a large model's 128-256 rows): 128 or 256 rows (one
    row block where it covers the batch, so each weight tile is read once), 128 or 256 columns, K blocks
    of 64 (128 for the smaller tile), 1, 2 or 4 splits, 8 warps, 3 or 4 stages."""
    out = {base}
    tiles = [(128, 128, 64), (128, 128, 128), (128, 256, 64)]
    if m > 128:
        tiles.append((256, 128, 64))
    for bm, bn, bk in tiles:
        for split in (1, 2, 4):
            for stages in (3, 4):
                out.add(gemm.GemmConfig(bm, bn, bk, split, 8, stages))
    return sorted(out, key=lambda c: (c != base, c.block_m, c.block_n, c.block_k, c.split, c.num_stages))


def step(
    weights: list[torch.Tensor], xs: dict[int, torch.Tensor], config: gemm.GemmConfig | None, cublas: bool
) -> Callable[[], None]:
    """One pass over `weights` (each w [N, K] times xs[K]) by cuBLAS or the split-K kernel."""

    def run() -> None:
        for w in weights:
            x = xs[w.shape[1]]
            F.linear(x, w) if cublas else gemm.skinny_matmul(x, w, config)

    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="qwen3-0.6b,llama3-8b")
    ap.add_argument("--rows", default="1,2,4,8,16,32,64,128,256")
    ap.add_argument("--sweep", default="", help="rows at which to time configurations around the chosen one")
    ap.add_argument("--json", default=None)
    ap.add_argument(
        "--large", action="store_true", help="sweep the tiles of FLOP-bound products (configs_large) instead"
    )
    args = ap.parse_args()
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    gen = torch.Generator(device=dev).manual_seed(0)
    results: dict = {"device": torch.cuda.get_device_name(dev), "models": {}}
    for name in args.models.split(","):
        layers, shapes = MODELS[name]
        weights = [
            [torch.randn(n, k, device=dev, generator=gen, dtype=torch.bfloat16) * 0.02 for n, k in shapes]
            for _ in range(layers)
        ]
        step_bytes = sum(n * k * 2 for n, k in shapes) * layers
        rows_out = {}
        for m in [int(r) for r in args.rows.split(",")]:
            xs = {k: torch.randn(m, k, device=dev, generator=gen, dtype=torch.bfloat16) for _, k in shapes}
            for (n, k), w in zip(shapes, weights[0]):
                ref = xs[k].float() @ w.float().T
                err = ((gemm.skinny_matmul(xs[k], w).float() - ref).abs().max() / ref.abs().max()).item()
                if err > 1e-2:
                    raise SystemExit(f"{name} M={m} N={n} K={k}: relative error {err:.3g}")

            every = [w for layer in weights for w in layer]
            t_cublas = graph_ms(step(every, xs, None, cublas=True))
            t_skinny = graph_ms(step(every, xs, None, cublas=False))
            # what the engine runs: the kernel where `gemm.serves` the shape, cuBLAS elsewhere
            mine = [w for w in every if gemm.serves(m, *w.shape)]
            theirs = [w for w in every if not gemm.serves(m, *w.shape)]

            def engine(
                mine: list[torch.Tensor] = mine, theirs: list[torch.Tensor] = theirs, xs: dict = xs
            ) -> None:
                step(mine, xs, None, cublas=False)()
                step(theirs, xs, None, cublas=True)()

            t_engine = graph_ms(engine)
            entry = {
                "cublas_ms": t_cublas,
                "skinny_ms": t_skinny,
                "cublas_tb_s": step_bytes / t_cublas / 1e9,
                "skinny_tb_s": step_bytes / t_skinny / 1e9,
                "engine_ms": t_engine,
                "configs": {f"{n}x{k}": vars(gemm.choose_config(m, n, k, sms)) for n, k in shapes},
            }
            print(
                f"{name} M={m:4d}: cuBLAS {t_cublas:.3f} ms ({entry['cublas_tb_s']:.2f} TB/s), "
                f"skinny {t_skinny:.3f} ms ({entry['skinny_tb_s']:.2f} TB/s): {t_cublas / t_skinny:.2f}x; "
                f"the engine's mix {t_engine:.3f} ms: {t_cublas / t_engine:.2f}x",
                flush=True,
            )
            if str(m) in args.sweep.split(","):
                per_shape = {}
                for i, (n, k) in enumerate(shapes):
                    if m <= gemm.MAX_ROWS and not gemm.serves(m, n, k) and name != "qwen3-0.6b":
                        continue
                    ws = [layer[i] for layer in weights]
                    timed = {"cublas": graph_ms(step(ws, xs, None, cublas=True)) / layers * 1e3}
                    ref = F.linear(xs[k], ws[0]).float()
                    for c in configs_around(m, n, k, sms, args.large):
                        try:
                            err = (
                                gemm.skinny_matmul(xs[k], ws[0], c).float() - ref
                            ).abs().max() / ref.abs().max()
                            if err.item() > 1e-2:
                                raise SystemExit(f"{name} M={m} {n}x{k} {c}: relative error {err.item():.3g}")
                            us = graph_ms(step(ws, xs, c, cublas=False)) / layers * 1e3
                        except triton.runtime.errors.OutOfResources:
                            continue  # tiles x stages past the shared memory
                        timed[str(tuple(vars(c).values()))] = us
                    best = min(timed, key=lambda key: timed[key])
                    chosen = str(tuple(vars(gemm.choose_config(m, n, k, sms)).values()))
                    per_shape[f"{n}x{k}"] = {"us": timed, "best": best, "chosen": chosen}
                    print(
                        f"    {n}x{k}: cuBLAS {timed['cublas']:.1f} us, chosen {chosen} {timed[chosen]:.1f} us,"
                        f" best {best} {timed[best]:.1f} us; next "
                        + ", ".join(f"{key} {timed[key]:.1f}" for key in sorted(timed, key=timed.get)[1:4]),
                        flush=True,
                    )
                entry["sweep"] = per_shape
            rows_out[m] = entry
        results["models"][name] = rows_out
        weights.clear()
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
